"""The browser plan viewer, rendered by headless Chromium against a real server."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import urllib.request
from html.parser import HTMLParser
from pathlib import Path

import pytest

from planner.schema import SKIPPED_BY_TIME_LIMIT, Plan
from service.app import STATIC_DIR
from service.process import ServerProcess

PROFILE = "h100-sxm-80g"


def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    assert exe, "headless Chromium is required for the viewer tests: apt-get install -y chromium"
    return exe


def render(url: str) -> str:
    """The DOM after the page's scripts ran (virtual time lets its fetches finish)."""
    with tempfile.TemporaryDirectory() as profile_dir:
        run = subprocess.run(
            [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile_dir}", "--virtual-time-budget=10000", "--dump-dom", url],
            capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stdout


class Elements(HTMLParser):
    """Each element's tag, attributes and the ids of its ancestors."""

    VOID = {"input", "br", "img", "meta", "link", "hr"}

    def __init__(self, html: str) -> None:
        super().__init__()
        self.found: list[tuple[str, dict[str, str], tuple[str, ...]]] = []
        self._stack: list[tuple[str, str]] = []
        self.text: list[str] = []
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        self.found.append((tag, a, tuple(i for _, i in self._stack if i)))
        if tag not in self.VOID:
            self._stack.append((tag, a.get("id", "")))

    def handle_endtag(self, tag: str) -> None:
        while self._stack:
            if self._stack.pop()[0] == tag:
                break

    def handle_data(self, data: str) -> None:
        self.text.append(data)

    def within(self, ancestor_id: str, tag: str | None = None, cls: str | None = None) -> list[dict[str, str]]:
        return [a for t, a, anc in self.found if ancestor_id in anc and (tag is None or t == tag)
                and (cls is None or cls in a.get("class", "").split())]


@pytest.fixture(scope="module")
def served_plan(tmp_path_factory: pytest.TempPathFactory) -> tuple[ServerProcess, str, Plan]:
    db = tmp_path_factory.mktemp("viewer") / "plans.db"
    with ServerProcess(db, workers=1) as server:
        status, body = server.post("/v1/plans", {"model": "llama-tiny", "devices": 4, "profile": PROFILE,
                                                 "batch_size": 8, "seq_len": 32, "mesh": {"dp": 2, "tp": 2}})
        assert status == 201, body
        yield server, body["id"], Plan.model_validate(body["plan"])


def test_plan_page_shows_mesh_placements_memory_and_json_tree(served_plan: tuple[ServerProcess, str, Plan]) -> None:
    server, plan_id, plan = served_plan
    page = Elements(render(f"{server.url}/plans/{plan_id}"))
    assert not page.within("main", cls="error"), " ".join(page.text)

    ranks = page.within("mesh-grid", cls="rank")
    assert len(ranks) == plan.devices
    assert ranks[3]["title"] == "dp=1, tp=1"  # row-major: rank 3 is the last of a 2x2 mesh

    rows = page.within("placement-table", tag="tr")
    assert len(rows) == len(plan.parameters) + 1  # + header
    cells = page.within("placement-table", cls="pl")
    assert len(cells) == len(plan.parameters) * len(plan.mesh.dims)
    # Every cell names its placement in the tooltip; the colour matches it: FSDP on
    # fully_shard dims, otherwise replicated exactly for R.
    fsdp_dims = {i for i, d in enumerate(plan.mesh.dims) if plan.dp_mode(d.name) == "fully_shard"}
    for i, cell in enumerate(cells):
        placement = cell["title"].split(":")[0]
        assert re.fullmatch(r"R|S\(\d+\)", placement), cell
        kind = cell["class"].split()[1]
        if i % len(plan.mesh.dims) in fsdp_dims:
            assert kind == "pl-fsdp", cell
        else:
            assert (kind == "pl-replicated") == (placement == "R"), cell

    assert page.within("memory-bar", cls="seg-parameters") and page.within("time-bar", cls="seg-compute")
    # the time bar's parts add up to the step: resharding is part of the exposed
    # communication, and was drawn a second time beside it (review)
    widths = [float(re.search(r"width: ([\d.e-]+)%", seg["style"]).group(1))
              for seg in page.within("time-bar", tag="span") if seg.get("class", "").startswith("seg-")]
    assert sum(widths) == pytest.approx(100, abs=0.1), widths
    assert len(page.within("json-tree", cls="json-formatter-row")) > 5
    assert page.within("main", tag="button")[0]["id"] == "download"
    if plan.solver.alternatives:
        assert len(page.within("alternatives", tag="tr")) == len(plan.solver.alternatives) + 1


def test_index_lists_plans_with_links(served_plan: tuple[ServerProcess, str, Plan]) -> None:
    server, plan_id, _ = served_plan
    page = Elements(render(f"{server.url}/"))
    links = [a["href"] for a in page.within("plan-list", tag="a")]
    assert f"/plans/{plan_id}" in links


def test_the_browsers_favicon_request_is_answered(served_plan: tuple[ServerProcess, str, Plan]) -> None:
    """A 404 there logged a console error on every page (review)."""
    assert served_plan[0].request("GET", "/favicon.ico")[0] == 204


def test_unknown_plan_shows_an_error(served_plan: tuple[ServerProcess, str, Plan]) -> None:
    server, _, _ = served_plan
    page = Elements(render(f"{server.url}/plans/{'0' * 20}"))
    assert page.within("main", cls="error")
    assert "no plan" in " ".join(page.text)
    assert [a["href"] for a in page.within("main", tag="a")] == ["/"]  # a way back (review)


@pytest.mark.parametrize("address", ["ABCDEF0123", "not-an-id", "%C3%A9t%C3%A9", "0" * 20 + "/",
                                     "", "a/b"])  # the last two: FastAPI's JSON 404 (review)
def test_a_plan_address_of_any_form_names_no_plan(served_plan: tuple[ServerProcess, str, Plan],
                                                  address: str) -> None:
    """An id the page cannot take is a plan that is not there, not the list of plans."""
    server, _, _ = served_plan
    page = Elements(render(f"{server.url}/plans/{address}"))
    assert page.within("main", cls="error"), " ".join(page.text)
    assert "no plan" in " ".join(page.text)
    assert not page.within("main", tag="table")


def _big_mesh_plan(server: ServerProcess) -> str:
    """A llama-tiny plan on a 1-D mesh of 2^20 devices (forced: no search, quick)."""
    n = 1 << 20
    status, body = server.post("/v1/plans", {"model": "llama-tiny", "devices": n, "profile": PROFILE,
                                             "batch_size": n, "seq_len": 32, "mesh": {"dp": n}})
    assert status in (200, 201), body
    return str(body["id"])


def test_a_long_mesh_dim_wraps_and_its_groups_are_abridged(served_plan: tuple[ServerProcess, str, Plan]) -> None:
    server, _, _ = served_plan
    page = Elements(render(f"{server.url}/plans/{_big_mesh_plan(server)}"))
    assert not page.within("main", cls="error"), " ".join(page.text)
    grid = next(a for _, a, _ in page.found if a.get("id") == "mesh-grid")
    columns = re.search(r"repeat\((\d+)", grid["style"])
    assert columns and int(columns[1]) <= 16, grid["style"]
    assert len(page.within("mesh-grid", cls="rank")) == 1024
    text = " ".join(page.text)
    assert "{0, 1, 2, …, 1048575} (1048576 ranks)" in text
    group_lines = [t for t in page.text if " group" in t]
    assert group_lines and max(map(len, group_lines)) < 200  # not every member of the group
    assert page.within("main", tag="p", cls="muted") and "16 ranks per row" in text


def test_the_plan_list_pages(served_plan: tuple[ServerProcess, str, Plan]) -> None:
    """Not only the newest page: the list says how many it shows and links to the rest."""
    server, _, _ = served_plan
    _big_mesh_plan(server)  # at least two plans
    ids = [p["id"] for p in server.get("/v1/plans?limit=1000")["plans"]]
    assert len(ids) >= 2
    page = Elements(render(f"{server.url}/?limit=1"))
    assert [a["href"] for a in page.within("plan-list", tag="a")] == [f"/plans/{ids[0]}"]
    assert f"showing the newest 1 of {len(ids)} plans" in " ".join(page.text)
    older = page.within("plan-pager", tag="a")
    assert [a["href"] for a in older] == ["/?offset=1&limit=1"]
    page = Elements(render(f"{server.url}{older[0]['href']}"))
    assert [a["href"] for a in page.within("plan-list", tag="a")] == [f"/plans/{ids[1]}"]
    assert "/?offset=0&limit=1" in [a["href"] for a in page.within("plan-pager", tag="a")]


def test_viewer_loads_nothing_from_the_network(served_plan: tuple[ServerProcess, str, Plan]) -> None:
    server, _, _ = served_plan
    with urllib.request.urlopen(f"{server.url}/") as resp:
        assert "default-src 'self'" in resp.headers["Content-Security-Policy"]
    for path in STATIC_DIR.rglob("*"):
        if path.suffix in (".html", ".js", ".css"):
            assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:)?//", path.read_text()), path
    vendor = STATIC_DIR / "vendor"
    assert (vendor / "json-formatter.umd.js").is_file()
    assert "MIT License" in (vendor / "json-formatter-js.LICENSE").read_text()


def test_static_files_are_package_data() -> None:
    """pyproject ships service/static/* and service/static/vendor/*: nothing deeper."""
    deeper = [p for p in STATIC_DIR.rglob("*") if p.is_file() and len(p.relative_to(STATIC_DIR).parts) > 2]
    assert not deeper, deeper
    assert Path(STATIC_DIR / "index.html").is_file()


def test_a_pipeline_plan_names_each_parameters_stages(served_plan: tuple[ServerProcess, str, Plan]) -> None:
    """On the pipeline dim every parameter is whole (R), but only on its stages' ranks:
    the table said "replicated" for every parameter there."""
    server = served_plan[0]
    status, body = server.post("/v1/plans", {"model": "llama-tiny", "devices": 2, "profile": PROFILE,
                                             "batch_size": 8, "seq_len": 32, "mesh": {"pp": 2}})
    assert status in (200, 201), body
    plan = Plan.model_validate(body["plan"])
    stages = [s.modules for s in plan.pipeline.stages]
    assert stages[0][0] == "model.embed_tokens" and stages[-1][-1] == "lm_head"
    page = Elements(render(f"{server.url}/plans/{body['id']}"))
    pp = plan.mesh.names.index(plan.pipeline.dim)
    cells = page.within("placement-table", cls="pl")[pp::len(plan.mesh.dims)]
    labels = dict(zip((p.fqn for p in plan.parameters), (c["title"] for c in cells), strict=True))
    assert labels["model.embed_tokens.weight"] == "R: whole on the ranks of stage 0 only"
    assert labels["lm_head.weight"] == f"R: whole on the ranks of stage {len(stages) - 1} only"
    assert labels["model.layers.*.mlp.up_proj.weight"] == f"R: whole on the ranks of stages 0–{len(stages) - 1} only"
    assert len(page.within("pipeline", tag="th")) == 4  # the stage table had no header row (review)


def _open_file(tmp_path: Path, name: str, text: str, then: str = "") -> Elements:
    """The page after opening a file named ``name`` holding ``text`` with its file picker
    (what the picker's change handler runs; headless Chromium cannot pick a file), and
    after the script ``then``, run half a second later."""
    harness = tmp_path / "open.html"
    harness.write_text(
        '<!doctype html><html><head>'
        f'<link rel="stylesheet" href="{(STATIC_DIR / "viewer.css").as_uri()}"></head>'
        '<body><input type="file" id="open-file"><main id="main"></main>'
        f'<script src="{(STATIC_DIR / "vendor" / "json-formatter.umd.js").as_uri()}"></script>'
        f'<script src="{(STATIC_DIR / "viewer.js").as_uri()}"></script>'
        # after the page's own routing, which finds no server behind a file:// page
        f"<script>setTimeout(() => openPlanText({json.dumps(name)}, {json.dumps(text)}), 1000);"
        f"setTimeout(() => {{ {then} }}, 1500);</script>"
        "</body></html>")
    return Elements(render(harness.as_uri()))


# The lowest contrast of white text on its element's fill in the page (WCAG's ratio of
# relative luminances), written into <pre id="probe">.
_WHITE_TEXT_CONTRAST = """
const lin = (v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; };
const lum = (rgb) => { const [r, g, b] = rgb.match(/[\\d.]+/g).map(Number); return 0.2126 * lin(r) + 0.7152 * lin(g) + 0.0722 * lin(b); };
let worst = Infinity, count = 0;
for (const node of document.querySelectorAll("main *")) {
  const style = getComputedStyle(node);
  if (style.color !== "rgb(255, 255, 255)" || !node.textContent.trim()) continue;
  let fill = node;
  while (fill && getComputedStyle(fill).backgroundColor === "rgba(0, 0, 0, 0)") fill = fill.parentElement;
  worst = Math.min(worst, 1.05 / (lum(getComputedStyle(fill).backgroundColor) + 0.05));
  count++;
}
document.body.append(Object.assign(document.createElement("pre"), { id: "probe", textContent: `${count} ${worst}` }));
"""


def test_gpt2s_conv1d_weights_are_named_by_their_output_split(tmp_path: Path) -> None:
    """GPT-2's Conv1D weights are stored [in, out]: c_attn's and c_fc's S(1) split their
    outputs (column-wise), c_proj's S(0) their inputs; the page had them the other way
    round (audit)."""
    import planner

    plan = planner.hand_plan("gpt2-tiny", devices=2, profile=PROFILE, tp=2, batch_size=2, seq_len=32)
    page = _open_file(tmp_path, "gpt2.json", plan.to_json())
    column = [a["title"] for a in page.within("placement-table", tag="span", cls="pl-column")]
    row = [a["title"] for a in page.within("placement-table", tag="span", cls="pl-row")]
    assert sorted(column) == ["S(1): column-wise: dim 1 split"] * 2, column  # c_attn, c_fc
    assert sorted(row) == ["S(0): row-wise: dim 0 split"] * 3, row  # c_proj twice, wte


def test_opening_a_file_draws_a_plan_or_names_what_is_wrong(
        served_plan: tuple[ServerProcess, str, Plan], tmp_path: Path) -> None:
    server, plan_id, _ = served_plan
    answer = server.get(f"/v1/plans/{plan_id}")
    # a plan file, and the API's answer saved as is (which names the plan's id)
    for data, source in ((answer["plan"], "local file"), (answer, plan_id)):
        page = _open_file(tmp_path, "plan.json", json.dumps(data))
        assert not page.within("main", cls="error"), " ".join(page.text)
        assert page.within("mesh-grid", cls="rank") and source in page.text
    # what the schema lets a plan leave out is drawn with its defaults (the page showed the
    # browser's "Cannot read properties of undefined", review)
    lean = {k: v for k, v in answer["plan"].items() if k not in ("modules", "data_parallel")}
    lean["solver"] = {k: v for k, v in lean["solver"].items() if k not in ("alternatives", "unsupported_ops")}
    lean["prediction"]["time"] = {k: v for k, v in lean["prediction"]["time"].items()
                                  if k not in ("resharding_s", "pipeline_bubble_s", "optimizer_s")}
    Plan.model_validate(lean)  # a valid plan
    page = _open_file(tmp_path, "lean.json", json.dumps(lean))
    assert not page.within("main", cls="error"), " ".join(page.text)
    assert page.within("mesh-grid", cls="rank") and page.within("time-bar", cls="seg-compute")
    # a search the time limit ended says so (the Solver section read "Optimal", review)
    limited = json.loads(json.dumps(answer["plan"]))
    limited["solver"]["alternatives"].append({"mesh": {"dp": 1, "tp": 2}, "step_time_s": None, "fits": False,
                                              "note": f"dp=1xtp=2 replicate: {SKIPPED_BY_TIME_LIMIT}"})
    page = _open_file(tmp_path, "limited.json", json.dumps(limited))
    assert any(t.startswith("The time limit ended the search: 1 of ") for t in page.text), page.text

    def error(name: str, text: str) -> str:
        page = _open_file(tmp_path, name, text)
        assert page.within("main", tag="p", cls="error"), " ".join(page.text)
        return next(t for t in page.text if t.startswith(f"{name}: "))

    profile = server.get(f"/v1/profiles/{PROFILE}")
    assert error("profile.json", json.dumps(profile)).startswith(
        'profile.json: not a meshplan plan: no "model", "profile", "devices"')
    assert error("list.json", "[1, 2]") == "list.json: not a meshplan plan: the file holds no JSON object"
    future = {**answer["plan"], "schema_version": "2.0"}
    assert error("new.json", json.dumps(future)) == (
        'new.json: schema_version: "2.0"; this viewer reads plans of schema 1.0')
    unversioned = {k: v for k, v in answer["plan"].items() if k != "schema_version"}  # drawn as 1.0 (review)
    assert error("old.json", json.dumps(unversioned)) == (
        "old.json: schema_version: missing; this viewer reads plans of schema 1.0")


def test_the_page_can_be_read_and_used_without_a_mouse(
        served_plan: tuple[ServerProcess, str, Plan], tmp_path: Path) -> None:
    """Review: white text on the rank and placement colours read at 2.2-3.9:1, the JSON
    tree's togglers were not reachable from the keyboard, the list and error pages had no
    heading."""
    server, plan_id, _ = served_plan
    plan = server.get(f"/v1/plans/{plan_id}")["plan"]
    page = _open_file(tmp_path, "plan.json", json.dumps(plan), _WHITE_TEXT_CONTRAST)
    count, worst = next(t for t in page.text if re.fullmatch(r"\d+ [\d.]+|\d+ Infinity", t)).split()
    assert int(count) > 10 and float(worst) >= 4.5, (count, worst)  # WCAG AA for text

    togglers = page.within("json-tree", tag="a", cls="json-formatter-toggler-link")
    assert togglers and all(a.get("tabindex") == "0" and a.get("role") == "button" for a in togglers)
    assert togglers[0]["aria-expanded"] == "true"  # the root is drawn open
    before = len(page.within("json-tree", cls="json-formatter-row"))
    # Enter on the first closed toggler (the "mesh" object) opens it, as a click does
    press = ("const a = [...document.querySelectorAll('#json-tree a.json-formatter-toggler-link')]"
             ".find((t) => t.getAttribute('aria-expanded') === 'false'); a.focus();"
             "a.dispatchEvent(new KeyboardEvent('keydown', { key: 'Enter', bubbles: true }));")
    page = _open_file(tmp_path, "plan.json", json.dumps(plan), press)
    assert len(page.within("json-tree", cls="json-formatter-row")) > before
    assert [a["aria-expanded"] for a in page.within("json-tree", tag="a", cls="json-formatter-toggler-link")][1] == "true"

    assert Elements(render(f"{server.url}/")).within("main", tag="h1")
    assert Elements(render(f"{server.url}/plans/{'0' * 20}")).within("main", tag="h1")


def test_an_interleaved_pipeline_shows_each_stages_rank(tmp_path: Path) -> None:
    """Virtual stage s runs on pp rank s % pp; the table listed stages without their
    ranks, so an interleaved plan read as if stage 2 ran on a third rank (review)."""
    from transformers import LlamaConfig

    from planner import hand_plan
    from service.terminal import render_plan

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256)
    plan = hand_plan(config, devices=2, profile=PROFILE, pp=2, schedule="interleaved-1f1b", virtual_stages=2,
                     microbatches=4, batch_size=8, seq_len=32)
    assert len(plan.pipeline.stages) == 4
    page = _open_file(tmp_path, "interleaved.json", plan.to_json())
    rows = [t.strip() for t in page.text if t.strip()]
    at = rows.index("predicted time per virtual stage")
    cells = rows[at + 2:]
    assert [cells[i * 4:i * 4 + 2] for i in range(4)] == [["stage 0", "0"], ["stage 1", "1"], ["stage 2", "0"],
                                                          ["stage 3", "1"]], cells[:16]
    table = render_plan(plan)
    assert re.search(r"^2 +0 ", table, re.M) and re.search(r"^3 +1 ", table, re.M), table
    # a plan may list one row per rank instead (a layer count each, which apply deals out
    # over all virtual stages): said so, not "this rank's layers" (code review)
    per_rank = plan.model_copy(deep=True)
    first, second, third, fourth = per_rank.pipeline.stages
    first.modules += second.modules
    third.modules += fourth.modules
    third.index = 1
    per_rank.pipeline.stages = [first, third]
    assert "each row gives a rank's layer count" in render_plan(per_rank)
    page = _open_file(tmp_path, "per-rank.json", per_rank.to_json())
    assert any(t.startswith("Each row gives one pp rank's layer count") for t in page.text), page.text


def test_the_planners_notes_are_shown(tmp_path: Path) -> None:
    """What the search said beyond the numbers (a forced tp the heads do not divide) went to
    the CLI's progress lines only; a service client now reads it in the plan, the page
    and ``meshplan show`` (review)."""
    import planner
    from service.terminal import render_plan

    plan = planner.plan("llama-tiny", devices=4, profile="cpu-gloo-local", batch_size=8, seq_len=16,
                        mesh={"dp": 1, "tp": 4})
    note = "tp=4 does not divide the 2 key/value heads, so attention cannot split over it"
    assert note in plan.solver.notes
    assert f"note: {note}" in render_plan(plan).splitlines()
    page = _open_file(tmp_path, "notes.json", plan.to_json())
    assert len(page.within("notes", tag="li")) == len(plan.solver.notes)
    assert f"Note: {note}" in page.text
