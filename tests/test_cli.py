"""The ``meshplan`` command line: real planner calls on tiny presets, user mistakes
as one line on stderr with exit status 2."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from planner.schema import Plan, binary_size, plan_json_schema
from service.cli import build_parser, main, parse_mesh
from service.limits import MAX_BATCH_SIZE, MAX_DEVICES

PROFILE = "h100-sxm-80g"
TINY = ["llama-tiny", "--devices", "2", "--profile", PROFILE, "--batch-size", "4", "--seq-len", "32"]


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("cli") / "plan.json"
    assert main(["plan", *TINY, "-o", str(path)]) == 0
    return path


def test_plan_writes_a_valid_plan(plan_file: Path) -> None:
    plan = Plan.from_json(plan_file.read_text())
    assert (plan.model, plan.devices, plan.batch_size, plan.seq_len) == ("llama-tiny", 2, 4, 32)


def test_plan_without_output_prints_it(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *TINY, "--mesh", "dp=1,tp=2"]) == 0
    plan = Plan.from_json(capsys.readouterr().out)
    assert plan.mesh.shape == (1, 2) and plan.mesh.names == ("dp", "tp")


def test_show_renders_the_essentials(plan_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = Plan.from_json(plan_file.read_text())
    assert main(["show", str(plan_file)]) == 0
    out = capsys.readouterr().out
    mesh_line = next(line for line in out.splitlines() if line.startswith("mesh: "))
    for d in plan.mesh.dims:
        assert f"{d.name}={d.size}" in mesh_line
    for p in plan.parameters:
        row = next(line for line in out.splitlines() if line.startswith(p.fqn + " ")).split()
        assert [t for t in row if re.fullmatch(r"R|S\(\d+\)", t)] == p.placements, row
    assert f"{plan.prediction.memory.total / 2**30:.2f} GiB" in out
    assert "step time" in out and plan.solver.solver in out
    for alt in plan.solver.alternatives:
        assert " x ".join(f"{k}={v}" for k, v in alt.mesh.items()) in out


def test_show_names_gpt2s_conv1d_splits_by_their_outputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """GPT-2's Conv1D weights are stored [in, out]: c_attn split by its outputs, S(1), read
    "row-sharded" and c_proj's S(0) "column-sharded" (audit)."""
    import planner

    plan = planner.hand_plan("gpt2-tiny", devices=2, profile=PROFILE, tp=2, batch_size=2, seq_len=32)
    (tmp_path / "g.json").write_text(plan.to_json())
    assert main(["show", str(tmp_path / "g.json")]) == 0
    words = {line.split()[0]: m[0] for line in capsys.readouterr().out.splitlines()
             if line.startswith("transformer.") and (m := re.search(r"(column|row)-sharded S\(\d\)", line))}
    assert words["transformer.h.*.attn.c_attn.weight"] == "column-sharded S(1)"
    assert words["transformer.h.*.mlp.c_fc.weight"] == "column-sharded S(1)"
    assert words["transformer.h.*.attn.c_proj.weight"] == words["transformer.h.*.mlp.c_proj.weight"] == "row-sharded S(0)"
    assert words["transformer.wte.weight"] == "row-sharded S(0)"  # an embedding split by vocabulary


def test_show_leaves_fits_blank_for_meshes_never_priced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A mesh the time limit skipped read "fits: no" (review; again in session 37's audit:
    the test had written the note without the mesh label the planner puts first)."""
    # once the first mesh is solved, a spent time limit skips every later one
    assert main(["plan", *TINY, "--time-limit", "0.001", "-o", str(tmp_path / "p.json")]) == 0
    assert main(["show", str(tmp_path / "p.json")]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.endswith("skipped (time limit)")]
    # step time, peak memory and fits all "-", then the planner's note
    assert len(rows) == 2 and all(re.search(r" - +- +- +\S+ (fsdp|replicate): skipped \(time limit\)$", row)
                                  for row in rows), rows


def test_show_accepts_a_saved_service_response(plan_file: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    saved = tmp_path / "response.json"
    saved.write_text(json.dumps({"id": "x", "plan": json.loads(plan_file.read_text())}))
    assert main(["show", str(saved)]) == 0
    assert "mesh: " in capsys.readouterr().out


def test_estimate_json_has_the_promised_fields(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", *TINY, "--dp", "2", "--tp", "1", "--fsdp", "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    # progress on stderr, as plan's: a large model's trace took tens of seconds in silence (audit)
    progress = captured.err.splitlines()
    assert progress[0] == "tracing llama-tiny ..." and progress[1].endswith("; pricing the layout"), progress
    for key in ("step_time_s", "tokens_per_s_per_device", "mfu", "peak_memory_bytes_per_device", "fits"):
        assert key in out
    assert out["step_time_s"] == out["breakdown"]["time"]["step_time_s"] > 0
    assert out["peak_memory_bytes_per_device"] == out["breakdown"]["memory"]["total"] > 0
    # the layout priced, which a script comparing several estimates needs (review)
    assert out["layout"] == {"dp": 2, "tp": 1, "pp": 1, "fsdp": True, "sp": False, "microbatches": 1,
                             "checkpointing": "none", "schedule": None, "virtual_stages": 1}


def test_estimate_names_the_layout_and_the_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The header printed the profile's path and no layout (review)."""
    path = Path(__file__).parents[1] / "profiles" / f"{PROFILE}.json"
    assert main(["estimate", *TINY[:3], "--profile", str(path), *TINY[5:], "--dp", "2", "--tp", "1", "--fsdp"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        f"llama-tiny on 2 x {PROFILE}: dp=2 fsdp, batch 4 x seq 32, 1 micro-batch(es)")


def test_estimate_reports_a_layout_that_does_not_fit(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """SPEC's ``fits``: a script asks whether a layout fits and gets false, not an error."""
    from cost_model.profile import load_profile

    small = tmp_path / "small.json"
    small.write_text(json.dumps({**load_profile(PROFILE).model_dump(mode="json"), "name": "small",
                                 "memory_bytes": 100_000}))
    argv = ["estimate", "llama-tiny", "--devices", "2", "--profile", str(small), "--dp", "2", "--tp", "1"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fits"] is False and out["peak_memory_bytes_per_device"] > 100_000
    # what fits is measured against: the capacity less the planner's 10% headroom (a total
    # of 75 GiB "of 80 GiB" that did not fit read as a contradiction without it)
    assert out["breakdown"]["memory"]["usable"] == 90_000
    assert out["batch_size"] == 2 and out["seq_len"] == 128
    assert main(argv) == 0
    head = capsys.readouterr().out.splitlines()[1]
    assert "of 97.66 KiB (87.89 KiB usable)   DOES NOT FIT" in head, head  # read "of 0.00 GiB" before


def test_estimate_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["estimate", *TINY, "--dp", "1", "--tp", "2", "--sp"]) == 0
    out = capsys.readouterr().out
    workload, head = out.splitlines()[:2]
    # the workload the defaults or flags chose (it was not shown)
    assert workload == f"llama-tiny on 2 x {PROFILE}: tp=2 sp, batch 4 x seq 32, 1 micro-batch(es)"
    assert head.startswith("step time ") and "activations" in out and "exposed" in out
    assert re.search(r"memory \d+\.\d\d KiB of 80\.00 GiB", head)  # a tiny model's memory read 0.00 GiB
    assert main(["estimate", *TINY, "--dp", "1", "--tp", "1", "--pp", "2", "--microbatches", "2",
                 "--checkpointing", "full"]) == 0
    workload = capsys.readouterr().out.splitlines()[0]  # the schedule and checkpointing were left out
    assert workload == f"llama-tiny on 2 x {PROFILE}: pp=2 full checkpointing, batch 4 x seq 32, 2 micro-batch(es), 1f1b"
    # a pipeline without --microbatches: as many as stages (it was "microbatches: 1 < pp=2")
    assert main(["estimate", *TINY, "--dp", "1", "--tp", "1", "--pp", "2"]) == 0
    out = capsys.readouterr().out
    assert ", 2 micro-batch(es), 1f1b" in out.splitlines()[0]
    # and its stages, as show prints them: the split need not be even (it was not shown)
    assert "pipeline: 1f1b on pp=2, 2 stages, 1 per rank" in out
    assert re.search(r"^0 +0 +[\d.]+ ms +model\.embed_tokens, model\.rotary_emb, model\.layers\.0$", out, re.M), out
    assert main(["estimate", *TINY, "--dp", "1", "--tp", "1", "--pp", "2", "--json"]) == 0
    stages = json.loads(capsys.readouterr().out)["stages"]
    assert [s["modules"][-1] for s in stages] == ["model.layers.0", "lm_head"]
    assert all(s["predicted_time_s"] > 0 for s in stages)
    # a batch the default does not divide says where the count came from
    assert main(["estimate", *TINY, "--dp", "1", "--tp", "1", "--pp", "2", "--batch-size", "3"]) == 2
    assert capsys.readouterr().err.rstrip().endswith("(--microbatches defaults to --pp=2; give the count to use)")


def test_schema_prints_the_plan_json_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema"]) == 0
    assert json.loads(capsys.readouterr().out) == plan_json_schema()


def test_profiles_lists_the_shipped_ones(capsys: pytest.CaptureFixture[str]) -> None:
    from cost_model.profile import shipped_profiles

    assert main(["profiles"]) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    assert header.split()[:4] == ["name", "device", "memory", "peak"]
    assert [row.split()[0] for row in rows] == shipped_profiles()
    assert all(len(row) < 160 for row in rows), "one short line per profile"
    # the peak plans are priced at: fp32 on the CPU (it showed the bf16 peak, 2.3x)
    assert all(("fp32" in row) == (row.split()[1] == "cpu") for row in rows), rows
    # in columns: the CPU's 0.07327 TFLOP/s was a digit wider and pushed its row out (audit)
    network = header.index("network")
    assert all(row[network - 2:network] == "  " and row[network] != " " for row in rows), rows
    assert len({row.index("FLOP/s") for row in rows}) == 1 and len({row.index("GiB") for row in rows}) == 1, rows


def test_parse_mesh() -> None:
    assert parse_mesh("dp=8,tp=8") == {"dp": 8, "tp": 8}
    for bad in ("dp8", "dp=0", "dp=x", "dp=2,dp=2", "=2", f"dp={MAX_DEVICES + 1}", "DP=2"):
        with pytest.raises(Exception, match="NAME=SIZE|twice"):
            parse_mesh(bad)


@pytest.fixture()
def bad_files(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "bert.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    (tmp_path / "notjson.json").write_text("{nope")
    (tmp_path / "notaplan.json").write_text(json.dumps({"model": "x"}))
    profile = json.loads((Path(__file__).parents[1] / "profiles" / f"{PROFILE}.json").read_text())
    profile["levels"][0]["busbw"]["all_reduce"] = -1
    (tmp_path / "badprofile.json").write_text(json.dumps(profile))
    profile["levels"][0]["busbw"]["all_reduce"] = 1e-300  # no machine's: CBC gave up; now refused
    (tmp_path / "absurdprofile.json").write_text(json.dumps({**profile, "name": "absurd"}))
    # a shipped name on other numbers: the plan, which records the name only, read as
    # planned for 80 GB H100s with 1 TiB of memory ("130 GiB of 1024 GiB ... fits")
    spoof = json.loads((Path(__file__).parents[1] / "profiles" / f"{PROFILE}.json").read_text())
    (tmp_path / "spoof.json").write_text(json.dumps({**spoof, "memory_bytes": 2**40}))
    (tmp_path / "notadb.db").write_text("not SQLite\n" * 100)
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe")
    (tmp_path / "hugeint.json").write_text('{"model_type": "llama", "hidden_size": ' + "9" * 5000 + "}")
    (tmp_path / "llamacfg.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32}))
    return {name.removesuffix(".json").removesuffix(".db"): str(tmp_path / name)
            for name in ("bert.json", "notjson.json", "notaplan.json", "badprofile.json", "absurdprofile.json",
                         "spoof.json", "notadb.db", "binary.json", "hugeint.json", "llamacfg.json")} | {
        "missing": str(tmp_path / "missing.json"), "nodir": str(tmp_path / "no" / "such" / "p.json"),
        "shippedname": str(tmp_path / "cpu-gloo-local.json"),
        "dir": str(tmp_path)}


@pytest.mark.parametrize(("argv", "names"), [
    (["plan", "no-such-model", "--devices", "2", "--profile", PROFILE], "model: 'no-such-model'"),
    (["plan", "{bert}", "--devices", "2", "--profile", PROFILE], "model_type: 'bert'"),
    (["plan", *TINY[:3], "--profile", "nope"], "nope"),
    (["plan", *TINY, "--mesh", "dp=3"], "--mesh: {'dp': 3} has 3 devices"),
    (["plan", *TINY, "-o", "{nodir}"], "-o: directory"),
    (["estimate", *TINY, "--dp", "3", "--tp", "1"], "--devices: dp*tp*pp = 3"),
    (["show", "{missing}"], "plan: cannot read"),
    # read as the current directory: "cannot read : Is a directory" (audit)
    (["show", ""], "plan: empty path"),
    (["serve", "--port", "0", "--db", ""], "--db: empty path"),
    (["show", "{notjson}"], "is not JSON"),
    (["show", "{notaplan}"], "Field required"),
    # were a bare codec message, and Python's advice to raise its int digits limit
    (["show", "{binary}"], "binary.json is not UTF-8 text (byte 0xff at position 0)"),
    (["show", "{hugeint}"], "hugeint.json is not JSON: Exceeds the limit (4300 digits)"),
    (["plan", "{hugeint}", "--devices", "1", "--profile", PROFILE], "model: cannot read"),
    # a typo'd directory started an empty store there
    (["serve", "--port", "0", "--db", "{nodir}"], "--db: directory"),
    (["calibrate", "-o", "{nodir}"], "-o: directory"),
    (["plan", *TINY, "-o", ""], "-o: empty path"),
    (["plan", *TINY, "-o", "{dir}"], "is a directory"),
    (["calibrate", "-o", "{dir}"], "is a directory"),
    # the plan was written over the config it was made from (audit)
    (["plan", "{llamacfg}", "--devices", "2", "--profile", PROFILE, "-o", "{llamacfg}"],
     "llamacfg.json is the file given as MODEL; writing there would overwrite it"),
    # calibrate measures for minutes before it writes: a path no one can create is refused
    # first, whatever its permission bits say (root may "write" /proc), and a file is no directory
    (["calibrate", "-o", "/proc/meshplan-test.json"], "-o: cannot write /proc/meshplan-test.json"),
    (["calibrate", "-o", "{notjson}/p.json"], "notjson.json is not a directory"),
    # the profile is named after the file: under a shipped name every later use refuses it
    (["calibrate", "-o", "{shippedname}"], "-o: cpu-gloo-local.json would name the profile 'cpu-gloo-local', a shipped profile's name"),
    (["plan", *TINY, "--profile", "{badprofile}"],
     "badprofile.json: levels.0.busbw.all_reduce: Input should be greater than or equal to 1000000 (1 problem(s))"),
    (["estimate", *TINY, "--dp", "2", "--tp", "1", "--profile", "{spoof}"],
     f"profile.name: {PROFILE!r} is a shipped profile's name, but the numbers differ from it"),
    (["estimate", *TINY, "--dp", "2", "--tp", "1", "--profile", "{absurdprofile}"],
     "absurdprofile.json: levels.0.busbw.all_reduce: Input should be greater than or equal to 1000000"),
    # flags that would change nothing (were accepted, the estimate as without them)
    (["estimate", *TINY, "--dp", "1", "--tp", "2", "--fsdp"], "--fsdp: shards over the data-parallel dim, and dp is 1"),
    (["estimate", *TINY, "--dp", "2", "--tp", "1", "--sp"], "--sp: shards the sequence over the tensor-parallel dim"),
    (["estimate", *TINY, "--dp", "2", "--tp", "1", "--schedule", "gpipe"], "--schedule: gpipe needs a pipeline (pp > 1)"),
    # without a pipeline first, as docs/service.md says (it named the schedule; review)
    (["estimate", *TINY, "--dp", "2", "--tp", "1", "--virtual-stages", "2"], "--virtual-stages: 2 needs a pipeline (pp > 1)"),
    # the mesh's size first (it said "microbatches: 1 < pp=64"; now pp micro-batches by default)
    (["estimate", *TINY, "--dp", "1", "--tp", "1", "--pp", "64"], "--devices: dp*tp*pp = 64, but devices=2"),
    # blamed the model ("sequence parallelism is not available for this model")
    (["estimate", *TINY, "--dp", "1", "--tp", "2", "--sp", "--seq-len", "15"], "--seq-len: 15 is not divisible by tp=2"),
    (["estimate", *TINY, "--dp", "2", "--tp", "1", "--schedule", "interleaved-1f1b", "--virtual-stages", "2"],
     "--virtual-stages: 2 needs a pipeline (pp > 1)"),
    # one stage per rank interleaves nothing: accepted and priced as interleaved (audit)
    (["estimate", *TINY, "--dp", "1", "--tp", "1", "--pp", "2", "--schedule", "interleaved-1f1b"],
     "--virtual-stages: interleaved-1f1b needs at least 2 stages per rank, got 1; with one, the schedule is 1f1b"),
    (["estimate", *TINY, "--dp", "1", "--tp", "1", "--pp", "2", "--schedule", "1f1b", "--virtual-stages", "2"],
     "--virtual-stages: 2 needs schedule interleaved-1f1b"),
    # the flag typed, not the API field (it read "batch_size: ..."; audit), and a forced
    # mesh said once (it read "... by dp=2 (dp=2)")
    (["estimate", *TINY[:5], "--batch-size", "3", "--dp", "2", "--tp", "1"],
     "--batch-size: 3 is not divisible by dp*microbatches = 2"),
    (["plan", *TINY[:5], "--batch-size", "3", "--mesh", "dp=2"],
     "--batch-size: no mesh tried can split the batch: 3 is not divisible by dp=2"),
    (["serve", "--port", "0", "--db", "{dir}"], "--db: "),
    # a file that cannot be read (a traceback before; audit): Linux's reads of it fail
    (["plan", *TINY, "--profile", "/proc/self/mem"], "--profile: cannot read '/proc/self/mem': Input/output error"),
    (["serve", "--port", "0", "--db", "{notadb}"], "cannot be used as an SQLite plan store"),
])
def test_user_mistakes_are_one_line_and_exit_2(argv: list[str], names: str, bad_files: dict[str, str],
                                               capsys: pytest.CaptureFixture[str]) -> None:
    argv = [a.format(**bad_files) if a.startswith("{") else a for a in argv]
    assert main(argv) == 2
    captured = capsys.readouterr()
    # Progress lines may come first; the error is the last line, and the only one.
    errors = [line for line in captured.err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0] == captured.err.strip().splitlines()[-1], captured.err
    assert errors[0].startswith("meshplan: error: ") and names in errors[0], captured.err
    assert "Traceback" not in captured.err and not captured.out


@pytest.mark.parametrize("command", ["plan", "estimate"])
def test_a_bad_profile_is_refused_before_the_trace(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A typo'd profile was reported after torch's import and the trace (seconds for a big model)."""
    extra = ["--dp", "2", "--tp", "1"] if command == "estimate" else []
    assert main([command, "llama3-405b", "--devices", "2", "--profile", "nope", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshplan: error: --profile: 'nope' is neither") and "tracing" not in err, err


def test_errors_name_the_flag_a_field_came_from() -> None:
    """The planner names its fields (``time_limit_s``); the CLI user typed flags (audit).
    A config file's field, a profile file's and the positional MODEL keep their names."""
    from planner.search import PlanningError
    from service.cli import _one_line

    args = build_parser().parse_args(["plan", *TINY])
    for field, shown in (("time_limit_s", "--time-limit"), ("batch_size", "--batch-size"),
                         ("hidden_size", "hidden_size"), ("profile.levels.0.busbw", "profile.levels.0.busbw"),
                         ("model", "model")):
        assert _one_line(PlanningError(f"{field}: the problem"), args) == f"{shown}: the problem"
    assert _one_line(PlanningError("no field here"), args) == "no field here"


def test_a_forced_mesh_of_the_wrong_size_is_refused_before_the_trace(capsys: pytest.CaptureFixture[str]) -> None:
    """It was found after the trace, seconds for a large model (audit)."""
    assert main(["plan", "llama3-405b", "--devices", "2", "--profile", PROFILE, "--mesh", "dp=4"]) == 2
    err = capsys.readouterr().err
    assert err == "meshplan: error: --mesh: {'dp': 4} has 4 devices, devices=2\n", err


def test_argument_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["plan", "llama-tiny", "--profile", PROFILE], ["plan", *TINY, "--mesh", "dp=x"],
                 ["estimate", *TINY, "--dp", "2", "--tp", "1", "--checkpointing", "some"], ["bogus"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert "error:" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "names"), [
    (["plan", *TINY, "--devices", "99999999999999999999"], f"--devices: '99999999999999999999': Input should "
                                                            f"be less than or equal to {MAX_DEVICES}"),
    (["plan", *TINY, "--batch-size", str(MAX_BATCH_SIZE + 1)], "--batch-size"),
    (["plan", *TINY, "--time-limit", "inf"], "--time-limit: 'inf': Input should be a finite number"),
    (["plan", *TINY, "--time-limit", "nan"], "--time-limit: 'nan': Input should be a finite number"),
    (["plan", *TINY, "--time-limit", "-1"], "--time-limit: '-1': Input should be greater than 0"),
    (["plan", *TINY, "--time-limit", "601"], "--time-limit"),
    (["serve", "--time-limit", "inf"], "--time-limit"),
    (["serve", "--port", "99999"], "--port: '99999' is not a TCP port"),
    (["plan", *TINY, "--devices", "2.0"], "--devices: '2.0': Input should be a valid integer"),  # was taken as 2
    (["serve", "--port", "-1"], "--port"),
    (["serve", "--workers", "1000"], "--workers: 1000 is more than 4 per CPU"),  # took a 2-core machine down
])
def test_values_beyond_the_http_limits_are_argument_errors(argv: list[str], names: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI refuses what POST /v1/plans refuses (the same service.limits), before any work."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert names in err and "Traceback" not in err, err


def test_serve_refuses_a_taken_port(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port), "--db", str(tmp_path / "plans.db")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"meshplan: error: --port: cannot listen on 127.0.0.1:{port}"), err


def _first_placed(placements: Callable[[list[str]], list[str]]) -> Callable[[dict], object]:
    """An edit of a plan's data: its first parameter's placements replaced."""
    return lambda data: data["parameters"][0].update(placements=placements(data["parameters"][0]["placements"]))


@pytest.mark.parametrize("edit, says", [
    # passes the schema but shards a matrix on dim 9: apply's message, not an IndexError
    (_first_placed(lambda pl: ["S(9)", *pl[1:]]), "{fqn}: S(9) on mesh dim {dim!r}, but the parameter has 2 dims"),
    # it read 'parameters.0.placements.0: String should match pattern ...' (audit)
    (_first_placed(lambda pl: ["S(0)x", *pl[1:]]),
     "{fqn} (parameters.0.placements.0): 'S(0)x' is not a placement: R (replicated), P (partial sums) or "
     "S(<dim>) (sharded on that tensor dim)"),
    # the plan format is versioned: a file without schema_version was shown as a 1.0 plan (audit)
    (lambda data: data.pop("schema_version"), "schema_version: Field required"),
    # refused by the plan's own validator: its field and problem, not pydantic's
    # 'plan: Value error, ' prefix (review)
    (_first_placed(lambda pl: ["P"] * len(pl)), "parameters: {fqn} cannot be Partial"),
], ids=["shard-dim-9", "not-a-placement", "unversioned", "partial"])
def test_show_refuses_a_bad_plan_naming_what_is_wrong(edit: Callable[[dict], object], says: str, plan_file: Path,
                                                      tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = json.loads(plan_file.read_text())
    fqn, dim = data["parameters"][0]["fqn"], data["mesh"]["dims"][0]["name"]
    edit(data)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    assert main(["show", str(bad)]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"meshplan: error: {bad}: {says.format(fqn=fqn, dim=dim)} (1 problem(s))\n", captured.err
    assert not captured.out


def test_show_does_not_import_torch(plan_file: Path, tmp_path: Path) -> None:
    """``show`` reads JSON: it must start in a blink, so its checks (a plan with S(9), which
    ``apply`` refuses too) run without torch."""
    data = json.loads(plan_file.read_text())
    data["parameters"][0]["placements"] = ["S(9)"] + data["parameters"][0]["placements"][1:]
    bad = tmp_path / "s9.json"
    bad.write_text(json.dumps(data))
    code = ("import sys; from service.cli import main; "
            f"codes = [main(['show', {str(plan_file)!r}]), main(['show', {str(bad)!r}])]; "
            "print(codes, 'torch' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.splitlines()[-1] == "[0, 2] False", run.stdout[-500:] + run.stderr[-2000:]
def test_help_reads_well() -> None:
    parser = build_parser()
    assert "``" not in parser.format_help()
    sub = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    estimate, serve = sub["estimate"].format_help(), sub["serve"].format_help()
    for text in ("data-parallel degree", "(default: 1f1b)", "pipeline stages per rank"):
        assert text in " ".join(estimate.split()), estimate
    for text in ("(default: 127.0.0.1)", "(default: 8000)", "(default: 2)", "(default: 60.0)"):
        assert text in " ".join(serve.split()), serve
    # it measures for minutes: the help did not say so (audit)
    calibrate = " ".join(sub["calibrate"].format_help().split())
    assert "Takes a few minutes (about 2 on 2 cores)" in calibrate, calibrate
    assert "(takes a few minutes)" in " ".join(parser.format_help().split())


def test_version_is_the_installed_distributions(monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """There was no ``--version``: a user filing a bug could not say which meshplan ran."""
    import importlib.metadata

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"meshplan {importlib.metadata.version('meshplan')}\n"

    def missing(_name: str) -> str:
        raise importlib.metadata.PackageNotFoundError("meshplan")

    monkeypatch.setattr(importlib.metadata, "version", missing)  # a source tree never installed
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("meshplan (version unknown: not installed")


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs Linux's /dev/full")
def test_a_full_disk_under_stdout_is_one_line() -> None:
    """``meshplan schema > plan.json`` on a full disk gave a traceback."""
    exe = Path(sys.executable).with_name("meshplan")
    with open("/dev/full", "w") as full:
        run = subprocess.run([str(exe), "schema"], stdout=full, stderr=subprocess.PIPE, text=True, timeout=60)
    assert run.returncode == 2 and run.stderr == "meshplan: error: stdout: cannot write: No space left on device\n"


def test_memory_reads_in_the_largest_binary_unit() -> None:
    assert [binary_size(n) for n in (1.15 * 2**40, 3 * 2**30, 512, 1536)] == [
        "1.15 TiB", "3.00 GiB", "512 B", "1.50 KiB"]  # a 70B model's states read 1179.79 GiB


def test_a_closed_stdout_ends_quietly() -> None:
    """``meshplan schema | head -c 0``: no BrokenPipeError traceback."""
    exe = Path(sys.executable).with_name("meshplan")
    proc = subprocess.Popen([str(exe), "schema"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the command writes anything
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1, err
    assert err == "", err


def test_console_script_reports_errors_without_traceback(tmp_path: Path) -> None:
    """The installed entry point, as a user runs it."""
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    exe = Path(sys.executable).with_name("meshplan")
    run = subprocess.run([str(exe), "show", str(bad)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert run.stderr.startswith("meshplan: error: ") and len(run.stderr.strip().splitlines()) == 1
    assert subprocess.run([str(exe), "--help"], capture_output=True, timeout=60).returncode == 0


def test_console_script_stdout_holds_only_the_plan() -> None:
    """``meshplan plan ... > plan.json`` as a user runs it: the solver library writes
    nothing of its own to the process's stdout (HiGHS printed its banner there)."""
    exe = Path(sys.executable).with_name("meshplan")
    run = subprocess.run([str(exe), "plan", *TINY], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    plan = Plan.from_json(run.stdout)
    assert plan.model == "llama-tiny"


def test_the_output_check_leaves_links_and_files_as_they_are(tmp_path: Path) -> None:
    """``-o`` is created and removed to check it before minutes of calibration: a
    dangling link stays a link (its target is not made), an existing file keeps its text."""
    import argparse

    from service.cli import _check_output

    (tmp_path / "link.json").symlink_to(tmp_path / "target.json")
    (tmp_path / "kept.json").write_text("kept")
    for name in ("link.json", "kept.json", "new.json"):
        _check_output(argparse.Namespace(output=str(tmp_path / name)))
    assert (tmp_path / "link.json").is_symlink() and not (tmp_path / "target.json").exists()
    assert (tmp_path / "kept.json").read_text() == "kept" and not (tmp_path / "new.json").exists()
