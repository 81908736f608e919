"""executor.save / executor.load: resharding across plans and world sizes, atomicity.

A 4-rank run (2-D dp x tp, FSDP + sequence parallel, dropout) saves mid-training and
goes on uninterrupted.  From that checkpoint, the same 4 ranks under another plan
(plain data parallel) and a single process with no process group each resume, and
must reproduce the uninterrupted run's next losses: the weights, the optimizer state
and the RNG stream (dropout masks) all have to come back.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from _dist import make_plan, run_on_ranks
from test_executor import SEED, Case, batches, build, loss_of
from torch.distributed.tensor import DTensor

import executor
from executor.checkpoint import RECORD, CheckpointError
from planner.presets import PRESETS, build_model, load_config

SAVE_AT, STEPS = 3, 6
SAVER = Case("llama", {"dp": 2, "tp": 2}, fsdp=True, sp=True, dropout=0.1)
OTHER_PLAN = Case("llama", {"dp": 4}, dropout=0.1)
SINGLE = Case("llama", dropout=0.1)


def _full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}


def run(case: Case, save_to: str | None = None, resume_from: str | None = None,
        keep_rng: bool = True) -> dict[str, Any]:
    """The user's loop with checkpointing: resume if asked, save after SAVE_AT steps.

    ``keep_rng=False`` undoes the RNG restore, to show that it matters."""
    data = batches(case)[:STEPS]
    executor.rng.manual_seed(SEED)
    model = build(case)
    model = executor.apply(make_plan(model, case.mesh, fsdp=case.fsdp, sp=case.sp), model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    out: dict[str, Any] = {"losses": {}}
    step = 0
    if resume_from is not None:
        state = executor.rng.get_state()
        step = executor.load(resume_from, model=model, optimizer=opt)
        if not keep_rng:
            executor.rng.set_state(state)
        out["loaded"] = _full_params(model)
    while step < STEPS:
        x, y = data[step]
        loss = loss_of(model, case, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out["losses"][step] = loss.item()
        step += 1
        if step == SAVE_AT and save_to is not None:
            executor.save(save_to, model=model, optimizer=opt, step=step)
            out["saved"] = _full_params(model)
    return out


def world4(root: str) -> dict[str, Any]:
    return {"saver": run(SAVER, save_to=f"{root}/ckpt"),
            "other_plan": run(OTHER_PLAN, resume_from=f"{root}/ckpt")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = str(tmp_path_factory.mktemp("ckpt"))
    four = run_on_ranks(4, world4, root)[0]
    try:
        single = run(SINGLE, resume_from=f"{root}/ckpt")
    finally:
        executor.rng.deactivate()
    return {"root": root, **four, "single": single}


def _assert_same_losses(resumed: dict[int, float], uninterrupted: dict[int, float]) -> None:
    assert sorted(resumed) == list(range(SAVE_AT, STEPS))
    for step, value in resumed.items():
        assert value == pytest.approx(uninterrupted[step], rel=1e-5), step


def test_load_under_other_plans_restores_the_saved_state(runs: dict) -> None:
    saved = runs["saver"]["saved"]
    for loaded in (runs["other_plan"]["loaded"], runs["single"]["loaded"]):
        assert loaded.keys() == saved.keys()
        for name, value in loaded.items():
            assert torch.equal(value, saved[name]), name


def test_resume_under_another_plan_continues_the_run(runs: dict) -> None:
    _assert_same_losses(runs["other_plan"]["losses"], runs["saver"]["losses"])


def test_resume_on_one_device_continues_the_run(runs: dict) -> None:
    _assert_same_losses(runs["single"]["losses"], runs["saver"]["losses"])


def test_resume_without_the_rng_state_would_differ(runs: dict) -> None:
    """The check above can fail: resuming with a fresh dropout stream gives other losses."""
    try:
        fresh = run(SINGLE, resume_from=f"{runs['root']}/ckpt", keep_rng=False)
    finally:
        executor.rng.deactivate()
    assert fresh["losses"][SAVE_AT] != pytest.approx(runs["saver"]["losses"][SAVE_AT], rel=1e-5)


def test_checkpoint_records_step_and_rng(runs: dict) -> None:
    record = json.loads((Path(runs["root"]) / "ckpt" / RECORD).read_text())
    assert record["step"] == SAVE_AT and record["world_size"] == 4
    assert record["rng"]["seed"] == SEED and record["rng"]["counter"] > 0


def test_interrupted_save_does_not_load(tmp_path: Path) -> None:
    """What a save killed before its rename leaves behind is refused, by name."""
    model = build(Case("mlp"))
    staging = tmp_path / "ckpt.incomplete"
    staging.mkdir()
    (staging / "__0_0.distcp").write_bytes(b"half a shard")
    with pytest.raises(CheckpointError, match="not a complete meshplan checkpoint"):
        executor.load(staging, model=model)
    with pytest.raises(CheckpointError, match="ckpt is not a complete meshplan checkpoint"):
        executor.load(tmp_path / "ckpt", model=model)


def test_save_replaces_an_older_checkpoint_and_clears_debris(tmp_path: Path) -> None:
    model = build(Case("mlp"))
    path = tmp_path / "ckpt"
    (tmp_path / "ckpt.incomplete").mkdir()  # debris of an interrupted save
    executor.save(path, model=model, step=1)
    with torch.no_grad():
        model.up_proj.weight.add_(1.0)
    expected = model.up_proj.weight.detach().clone()
    executor.save(path, model=model, step=2)
    with torch.no_grad():
        model.up_proj.weight.zero_()
    assert executor.load(path, model=model) == 2
    assert torch.equal(model.up_proj.weight, expected)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_save_stopped_between_its_renames_keeps_its_checkpoint(tmp_path: Path) -> None:
    """Killed after moving <path> to <path>.old and before moving <path>.incomplete (the
    new, complete checkpoint) to <path>: load named neither, and the next save deleted
    the newest checkpoint and left <path>.old for good (audit)."""
    import shutil

    model = build(Case("mlp"))
    path = tmp_path / "ckpt"
    executor.save(path, model=model, step=1)
    executor.save(tmp_path / "newer", model=model, step=2)
    path.rename(tmp_path / "ckpt.old")
    shutil.copytree(tmp_path / "newer", tmp_path / "ckpt.incomplete")
    with pytest.raises(CheckpointError, match=r"a save stopped between its renames: .*ckpt\.incomplete holds its "
                                              "complete checkpoint"):
        executor.load(path, model=model)
    assert executor.load(tmp_path / "ckpt.incomplete", model=model) == 2
    executor.save(path, model=model, step=3)
    assert executor.load(path, model=model) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "newer"]


def test_save_does_not_replace_what_is_not_a_checkpoint(tmp_path: Path) -> None:
    """save replaces ``path`` and clears ``<path>.incomplete`` and ``<path>.old``: it removed
    a run directory with its log standing at ``path``, and over a plain file it failed
    half-way with shutil's NotADirectoryError.  Each is refused before anything is written."""
    model = build(Case("mlp"))
    run = tmp_path / "run"
    run.mkdir()
    (run / "train.log").write_text("step 1\n")
    (tmp_path / "file").write_text("x")
    (tmp_path / "ckpt.old").mkdir()
    (tmp_path / "ckpt.old" / "notes.txt").write_text("mine")
    for path, what in ((run, "run exists and is not a meshplan checkpoint"),
                       (tmp_path / "file", "file exists and is not a meshplan checkpoint"),
                       (tmp_path / "ckpt", "ckpt.old exists and is not a save's debris")):
        with pytest.raises(CheckpointError, match=f"^path: .*{what}"):
            executor.save(path, model=model, step=1)
    assert (run / "train.log").read_text() == "step 1\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.old", "file", "run"]
    # what is a checkpoint or a save's debris is still replaced: a checkpoint with a stray
    # hidden file (NFS's), debris of a save killed while DCP renamed its metadata
    executor.save(tmp_path / "good", model=model, step=1)
    (tmp_path / "good" / ".nfs0001").write_text("")
    (tmp_path / "good.incomplete").mkdir()
    for name in ("__0_0.distcp", ".metadata.tmp"):
        (tmp_path / "good.incomplete" / name).write_text("")
    executor.save(tmp_path / "good", model=model, step=2)
    assert executor.load(tmp_path / "good", model=model) == 2
    assert not (tmp_path / "good.incomplete").exists()


def test_optimizer_state_is_checked_and_loaded_after_a_backward(tmp_path: Path) -> None:
    """An AdamW checkpoint loaded into SGD raised DCP's multi-rank CheckpointException (a
    BaseException); it is refused by name.  A fresh AdamW whose model already ran a backward
    before loading got no moments loaded at all (``get_state_dict`` makes the entries that
    loading fills only where no parameter has a gradient)."""
    model = build(Case("mlp"))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 16)).sum().backward()
    opt.step()
    executor.save(tmp_path / "ckpt", model=model, optimizer=opt, step=1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(CheckpointError, match=r"^optimizer: .* does not fit the optimizer \(\d+ problem"
                                              r"\(s\)\):\n  param_groups\.down_proj\.bias\.dampening: in the optimizer"):
        executor.load(tmp_path / "ckpt", model=model, optimizer=sgd)
    fresh = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 16)).sum().backward()  # gradients present when loading
    assert executor.load(tmp_path / "ckpt", model=model, optimizer=fresh) == 1
    for p in model.parameters():
        assert torch.equal(fresh.state[p]["exp_avg"], opt.state[p]["exp_avg"])
        assert p.grad is not None  # left as they were


def test_a_checkpoint_of_another_model_is_refused_by_name(runs: dict) -> None:
    """The 4-rank FSDP + TP checkpoint loaded into a wider, deeper or shallower Llama: DCP's
    own error is a multi-rank traceback in a BaseException that ``except Exception`` misses."""
    path = Path(runs["root"]) / "ckpt"
    for change, expected in (({"hidden_size": 64, "intermediate_size": 128},
                              "model.embed_tokens.weight: checkpoint shape [128, 32], model shape [128, 64]"),
                             ({"num_hidden_layers": 3},
                              "model.layers.2.mlp.up_proj.weight: in the model, not in the checkpoint"),
                             ({"num_hidden_layers": 1},  # was loaded, its layer 1 ignored
                              "model.layers.1.mlp.up_proj.weight: in the checkpoint, not in the model")):
        config = {**PRESETS["llama-tiny"], **change}
        model = build_model(load_config(config), device="cpu")
        with pytest.raises(CheckpointError, match="does not fit the model") as e:
            executor.load(path, model=model)
        assert expected in str(e.value), str(e.value)


def test_arguments_are_checked_on_every_rank_before_anything_is_written(tmp_path: Path) -> None:
    """save(step=1.5) failed on rank 0 only, after the shards were written, leaving the
    other ranks in the final barrier; a numpy or tensor step failed there too (review)."""
    model = build_model(load_config(PRESETS["llama-tiny"]), device="cpu")
    with pytest.raises(TypeError, match=r"^step: expected an int or None, got float 1.5$"):
        executor.save(tmp_path / "ck", model=model, step=1.5)
    with pytest.raises(TypeError, match=r"^step: expected an int or None, got bool True$"):
        executor.save(tmp_path / "ck", model=model, step=True)
    with pytest.raises(TypeError, match=r"^model: expected a torch.nn.Module, got NoneType$"):
        executor.save(tmp_path / "ck", model=None)
    with pytest.raises(TypeError, match=r"^path: expected a directory path, got NoneType$"):
        executor.save(None, model=model)
    for nameless in ("", "."):
        with pytest.raises(CheckpointError, match=r"names no directory of its own"):
            executor.save(nameless, model=model)
    assert not list(tmp_path.iterdir())  # nothing written
    executor.save(tmp_path / "ck", model=model, step=torch.tensor(3))
    assert json.loads((tmp_path / "ck" / RECORD).read_text())["step"] == 3
    assert executor.load(tmp_path / "ck", model=model) == 3
    # a model on the meta device has nothing to load into (DCP's BaseException before)
    with pytest.raises(CheckpointError, match=r"^model: model.embed_tokens.weight is on the meta device"):
        executor.load(tmp_path / "ck", model=build_model(load_config(PRESETS["llama-tiny"]), device="meta"))


def test_an_untied_checkpoint_is_refused_by_a_tied_model(tmp_path: Path) -> None:
    """Both names passed the key and shape checks and the head's weights landed in the
    tied embedding (review).  The other way round is fine: each takes the one tensor."""
    def llama(tied: bool) -> torch.nn.Module:
        return build_model(load_config({**PRESETS["llama-tiny"], "tie_word_embeddings": tied}), device="cpu")

    executor.save(tmp_path / "untied", model=llama(False))
    with pytest.raises(CheckpointError, match=r"^model: lm_head.weight and model.embed_tokens.weight are one tensor"):
        executor.load(tmp_path / "untied", model=llama(True))
    tied = llama(True)
    executor.save(tmp_path / "tied", model=tied)
    untied = llama(False)
    executor.load(tmp_path / "tied", model=untied)
    assert torch.equal(untied.lm_head.weight, tied.lm_head.weight)
    assert torch.equal(untied.model.embed_tokens.weight, tied.model.embed_tokens.weight)


def test_a_damaged_checkpoint_or_a_foreign_optimizer_is_a_checkpoint_error(tmp_path: Path) -> None:
    """DCP's CheckpointException (a BaseException naming no file), pickle's, json's and a
    bare KeyError reached the loop before, and torch's ``KeyError: 0`` for an optimizer
    over another model's parameters (audit, session 37)."""
    import shutil

    def llama() -> torch.nn.Module:
        return build_model(load_config(PRESETS["llama-tiny"]), device="cpu")

    model = llama()
    opt = torch.optim.AdamW(model.parameters())
    executor.save(tmp_path / "ck", model=model, optimizer=opt, step=1)
    damages = {
        "shard deleted": (lambda d: next(d.glob("*.distcp")).unlink(), "a file of the checkpoint is missing or damaged"),
        "metadata truncated": (lambda d: (d / ".metadata").write_bytes((d / ".metadata").read_bytes()[:50]),
                               "DCP's metadata is missing or damaged"),
        "metadata deleted": (lambda d: (d / ".metadata").unlink(), "DCP's metadata is missing or damaged"),
        "record truncated": (lambda d: (d / RECORD).write_text((d / RECORD).read_text()[:20]), f"{RECORD} is damaged"),
        "record without optimizer": (lambda d: (d / RECORD).write_text(json.dumps(
            {k: v for k, v in json.loads((d / RECORD).read_text()).items() if k != "optimizer"})),
            f"{RECORD} is damaged (no optimizer)"),
    }
    for name, (damage, expected) in damages.items():
        copy = tmp_path / name.replace(" ", "-")
        shutil.copytree(tmp_path / "ck", copy)
        damage(copy)
        with pytest.raises(CheckpointError) as e:
            executor.load(copy, model=llama())
        assert expected in str(e.value), (name, str(e.value))
    other = torch.optim.AdamW(llama().parameters())
    for call in (executor.save, executor.load):
        with pytest.raises(CheckpointError, match=r"^optimizer: param_groups\[0\] parameter 0 \(shape \[128, 32\]\) "
                                                  "is not a parameter of the model"):
            call(tmp_path / "ck", model=model, optimizer=other)
    # another model is named by its keys, not by the ties it lacks (was: "lm_head.weight and
    # transformer.wte.weight are one tensor in the model but were saved as separate tensors")
    with pytest.raises(CheckpointError, match="does not fit the model"):
        executor.load(tmp_path / "ck", model=build_model(load_config(PRESETS["gpt2-tiny"]), device="cpu"))
