"""The planner service over HTTP: a real ``meshplan serve`` (uvicorn, planner worker
processes, SQLite on disk) on a free loopback port, with real plans of tiny presets."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from cost_model.profile import load_profile
from planner.presets import PRESETS
from planner.schema import Plan
from service.app import create_app
from service.limits import MAX_HF_CONFIG_DEPTH, MAX_TIME_LIMIT_S
from service.models import HFConfigModel, PlanRequest
from service.process import ServerProcess
from service.worker import PlannerPool, PlanningInputError, PlanningTimeout

PROFILE = "h100-sxm-80g"
TINY = {"model": "llama-tiny", "devices": 2, "profile": PROFILE, "batch_size": 4, "seq_len": 32}


def _nested(depth: int) -> list:
    """A JSON array ``depth`` levels deep: [[[...]]]."""
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


def _inline_profile(name: str = PROFILE, all_reduce: float | None = None, bf16: float | None = None) -> dict:
    """The shipped profile as an inline dict, renamed or with one number changed."""
    profile = load_profile(PROFILE).model_dump(mode="json") | {"name": name}
    if all_reduce is not None:
        profile["levels"][0]["busbw"]["all_reduce"] = all_reduce
    if bf16 is not None:
        profile["peak_flops"]["bf16"] = bf16
    return profile


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    db = tmp_path_factory.mktemp("service") / "plans.db"
    # One worker: it stays warm (torch.export's first trace costs seconds), and one
    # busy worker is enough to show that reads are not blocked by solves.
    with ServerProcess(db, workers=1) as s:
        yield s


def test_plan_is_created_stored_listed_and_cached(server: ServerProcess) -> None:
    status, body = server.post("/v1/plans", TINY)
    assert status == 201, body
    assert body["cached"] is False
    plan = Plan.model_validate(body["plan"])
    assert (plan.model, plan.devices, plan.batch_size, plan.seq_len) == ("llama-tiny", 2, 4, 32)
    assert server.get(f"/v1/plans/{body['id']}")["plan"] == body["plan"]

    # The same request with its keys in another order is the same request.
    status, again = server.post("/v1/plans", dict(reversed(list(TINY.items()))))
    assert status == 200, again
    assert again["cached"] is True
    assert (again["id"], again["plan"]) == (body["id"], body["plan"])

    listed = {p["id"]: p for p in server.get("/v1/plans")["plans"]}
    row = listed[body["id"]]
    assert row["step_time_s"] == plan.prediction.time.step_time_s
    assert row["mesh"] == {d.name: d.size for d in plan.mesh.dims}
    assert (row["model"], row["devices"], row["profile"]) == ("llama-tiny", 2, plan.profile)


def test_spelled_out_defaults_are_the_same_request() -> None:
    implicit = PlanRequest(model="llama-tiny", devices=2, profile=PROFILE).with_defaults(60.0)
    # One sequence per device; the model's max positions (128) capped at 4096; the server's limit.
    assert (implicit.batch_size, implicit.seq_len, implicit.time_limit_s) == (2, 128, 60.0)
    for explicit in ('{"seq_len": 128, "profile": "h100-sxm-80g", "batch_size": 2, "devices": 2, '
                     '"model": "llama-tiny"}',
                     '{"model": "llama-tiny", "devices": 2, "profile": "h100-sxm-80g", "time_limit_s": 60}'):
        assert PlanRequest.model_validate_json(explicit).with_defaults(60.0).key() == implicit.key()
    assert PlanRequest(model="llama-tiny", devices=4, profile=PROFILE).with_defaults(60.0).key() != implicit.key()
    assert (PlanRequest(model="llama-tiny", devices=2, profile=PROFILE, time_limit_s=30).with_defaults(60.0).key()
            != implicit.key())


def test_hub_metadata_in_a_config_is_dropped_not_refused() -> None:
    """A config.json as the Hub serves it (Phi-2's, Mistral's carry ``_name_or_path``)
    plans as the config without that metadata: the same request."""
    hub = {"_name_or_path": "microsoft/phi-2", "_attn_implementation_autoset": True, **PRESETS["llama-tiny"]}
    bare = PlanRequest(**{**TINY, "model": {"hf_config": PRESETS["llama-tiny"]}})
    assert PlanRequest(**{**TINY, "model": {"hf_config": hub}}).key() == bare.key()


def test_strict_time_limit_still_takes_integers_and_floats() -> None:
    assert PlanRequest(**TINY, time_limit_s=5).time_limit_s == 5.0
    assert PlanRequest.model_validate_json('{"model": "llama-tiny", "devices": 2, "profile": "p", '
                                           '"time_limit_s": 2.5}').time_limit_s == 2.5


def test_hf_config_at_the_depth_limit_is_accepted_and_hashed() -> None:
    config = {"model_type": "llama", "x": _nested(MAX_HF_CONFIG_DEPTH - 1)}  # the config is level 1
    request = PlanRequest(**{**TINY, "model": {"hf_config": config}})
    assert len(request.key()) == 64


def test_a_request_that_cannot_be_hashed_is_a_value_error_naming_the_body() -> None:
    """key() fails with a ValueError (the service's 422), whatever slips past validation."""
    unchecked = HFConfigModel.model_construct(hf_config={"x": _nested(300)})
    request = PlanRequest.model_construct(**{**TINY, "model": unchecked, "time_limit_s": 60.0})
    with pytest.raises(ValueError, match="^body: "):
        request.key()


def test_head_is_answered_on_get_routes(server: ServerProcess) -> None:
    """Load balancers probe with HEAD: the GET's status and headers, no body."""
    status, body = server.post("/v1/plans", TINY)
    assert status in (200, 201), body
    for path in ("/", "/healthz", "/v1/plans", f"/v1/plans/{body['id']}", f"/plans/{body['id']}",
                 "/v1/profiles", f"/v1/profiles/{PROFILE}", "/openapi.json"):
        with urllib.request.urlopen(urllib.request.Request(server.url + path, method="HEAD"), timeout=30) as head:
            assert head.status == 200, path
            assert head.read() == b"", path
            length = head.headers["Content-Length"]
        if path != "/healthz":  # its counters may change in between
            with urllib.request.urlopen(server.url + path, timeout=30) as get:
                assert int(length) == len(get.read()), path


def test_a_method_not_served_is_405_naming_every_method_that_is() -> None:
    """Starlette's Allow named only the first matching route's methods: PUT /v1/plans
    answered "Allow: POST", though GET serves the list there (review)."""
    with TestClient(create_app(":memory:")) as client:
        for method, path, allowed in [("PUT", "/v1/plans", "GET, HEAD, POST"), ("DELETE", "/v1/plans/abc", "GET, HEAD"),
                                      ("POST", "/healthz", "GET, HEAD"), ("POST", "/plans/abc", "GET, HEAD")]:
            r = client.request(method, path)
            assert r.status_code == 405 and r.headers["Allow"] == allowed, (method, path, r.headers)
            assert r.json()["detail"] == f"method {method} not allowed on {path}; allowed: {allowed}"


def test_a_store_that_cannot_save_is_a_503_and_the_next_try_saves(server: ServerProcess) -> None:
    """Another process holding the store's write lock past its 5 s busy timeout: the
    answer was a plain-text 500 (review); it is a JSON 503 with Retry-After, and the
    same request once the lock is gone is planned and stored."""
    body = {**TINY, "batch_size": 2, "seq_len": 8}
    holder = sqlite3.connect(server.db, isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")
        status, answer = server.post("/v1/plans", body)
    finally:
        holder.close()
    assert status == 503, answer
    assert answer["detail"].startswith("store: the plan was made but could not be saved (database is locked)")
    status, answer = server.post("/v1/plans", body)
    assert status == 201, answer
    assert server.get(f"/v1/plans/{answer['id']}")["id"] == answer["id"]


def test_no_api_page_that_needs_a_cdn(server: ServerProcess) -> None:
    """FastAPI's /docs and /redoc load Swagger UI and ReDoc from a CDN (blank offline):
    they are off; the schema is /openapi.json."""
    for path in ("/docs", "/redoc"):
        status, _ = server.request("GET", path)
        assert status == 404, path
    assert "/v1/plans" in server.get("/openapi.json")["paths"]


def test_a_changed_planner_does_not_serve_the_old_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    """The store answers an identical request only from the same planner revision (its
    code, the cost model, the shipped profiles, torch and transformers)."""
    from service import models

    request = PlanRequest(**TINY)
    assert models.planner_revision() == models.planner_revision()  # stable within a process
    before = request.key()
    monkeypatch.setattr(models, "planner_revision", lambda: "a later planner")
    assert request.key() != before


def test_hf_config_inline_and_inline_profile(server: ServerProcess) -> None:
    from cost_model.profile import load_profile
    from planner.presets import PRESETS

    profile = load_profile(PROFILE).model_dump(mode="json")
    status, body = server.post("/v1/plans", {**TINY, "model": {"hf_config": PRESETS["llama-tiny"]},
                                             "profile": profile})
    assert status == 201, body
    assert Plan.model_validate(body["plan"]).devices == 2
    # two inline configs of one type are told apart in the list (both read "hf_config:llama")
    status, other = server.post("/v1/plans", {**TINY, "model": {"hf_config": {**PRESETS["llama-tiny"],
                                                                              "num_hidden_layers": 1}}})
    assert status == 201, other
    labels = {p["id"]: p["model"] for p in server.get("/v1/plans?limit=1000")["plans"]}
    assert labels[body["id"]] != labels[other["id"]]
    assert labels[body["id"]].startswith("hf_config:llama (inline ") and body["plan"]["model"] == "hf_config:llama"


def test_a_forced_pp_of_one_is_said_to_be_no_pipeline(server: ServerProcess) -> None:
    """A size-1 dp or tp stays in the plan's mesh, a forced pp=1 leaves it (no pipeline):
    that went unsaid, so the pp a client forced seemed lost (audit)."""
    status, body = server.post("/v1/plans", {**TINY, "batch_size": 6, "mesh": {"pp": 1, "dp": 2}})
    assert status in (200, 201), body
    assert [d["name"] for d in body["plan"]["mesh"]["dims"]] == ["dp"]
    assert "pp=1 is no pipeline: the plan's mesh has no pp dim" in body["plan"]["solver"]["notes"]


def test_identical_concurrent_requests_solve_once(server: ServerProcess) -> None:
    request = {**TINY, "batch_size": 8}
    before = server.get("/healthz")["solves"]
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda _: server.post("/v1/plans", request), range(6)))
    assert all(status in (200, 201) for status, _ in results), results
    assert len({body["id"] for _, body in results}) == 1
    assert server.get("/healthz")["solves"] - before == 1
    # one request made the plan (201); the others waited on its solve: 200 and cached, as
    # an identical request after it gets (all six said 201, not cached)
    assert sorted((status, body["cached"]) for status, body in results) == [(200, True)] * 5 + [(201, False)]


def test_a_shipped_profiles_copy_sent_inline_is_the_same_request(server: ServerProcess) -> None:
    """The docs let a client send a shipped profile back inline: it is that profile, so the
    request is the one by name (it was stored as a second plan under another id)."""
    request = {**TINY, "batch_size": 12}
    by_name = server.post("/v1/plans", request)[1]
    status, inline = server.post("/v1/plans", {**request, "profile": server.get(f"/v1/profiles/{PROFILE}")})
    assert (status, inline["cached"], inline["id"]) == (200, True, by_name["id"])


def test_reads_are_served_while_workers_solve(server: ServerProcess) -> None:
    """GETs go through while a worker is busy with an uncached solve."""
    request = {"model": "llama3-8b", "devices": 8, "profile": PROFILE, "batch_size": 8, "seq_len": 2048}
    result: list[tuple[int, object]] = []
    solving = threading.Thread(target=lambda: result.append(server.post("/v1/plans", request)))
    solving.start()
    saw_busy = False
    while solving.is_alive():
        health = server.get("/healthz", timeout=5)
        saw_busy |= health["busy_workers"] > 0 and solving.is_alive()
        server.get("/v1/plans?limit=5", timeout=5)
    solving.join()
    assert result[0][0] == 201, result
    assert saw_busy


@pytest.mark.parametrize(("body", "status", "names"), [
    ({**TINY, "model": "no-such-model"}, 422, "model: 'no-such-model' is not a preset"),
    ({**TINY, "model": "/etc/passwd"}, 422, "file paths are not accepted"),
    ({**TINY, "model": {"hf_config": {"model_type": "bert", "hidden_size": 8}}}, 422, "model_type: 'bert'"),
    ({**TINY, "model": {"hf_config": {"model_type": "llama", "hidden_size": 10**7, "num_hidden_layers": 2,
                                      "num_attention_heads": 4, "vocab_size": 64}}}, 422, "hidden_size"),
    ({**TINY, "model": {"hf_config": {"model_type": "llama", "auto_map": {"AutoModel": "x.Y"}}}}, 422,
     "model.hf_config.auto_map: not accepted by the service: it points at the model's own code"),
    ({**TINY, "model": {"hf_config": {"_name_or_path": "a/b", "model_type": "llama", "_attn_implementation": "x",
                                      "quantization_config": {}}}},
     422, "model.hf_config._attn_implementation: not accepted by the service: keys starting with '_' set "
          "transformers' internal state (also refused: quantization_config)"),
    ({**TINY, "devices": 0}, 422, "devices: Input should be greater than or equal to 1"),
    ({**TINY, "profile": "nope"}, 422, "profile: 'nope' is not a shipped profile"),
    ({**TINY, "profile": {"name": "half-a-profile"}}, 422, "profile.device_type: Field required"),
    ({**TINY, "profile": _inline_profile("mine", all_reduce=-1)}, 422,
     "profile.levels.0.busbw.all_reduce: Input should be greater than or equal to 1000000"),
    ({**TINY, "profile": _inline_profile(bf16=1e300)}, 422, f"profile.name: {PROFILE!r} is a shipped profile's name"),
    # JSON's 1e400 parses as inf (a 500 from the ILP before); 1e-300 B/s is finite but no
    # machine's, and 1e-308 FLOP/s or an efficiency of 5e-324 priced a step at inf (a 500, review)
    (json.dumps({**TINY, "profile": _inline_profile("mine", all_reduce=12345.5)}).replace("12345.5", "1e400").encode(),
     422, "profile.levels.0.busbw.all_reduce: must be a finite number"),
    ({**TINY, "profile": _inline_profile("mine", all_reduce=1e-300)}, 422,
     "profile.levels.0.busbw.all_reduce: Input should be greater than or equal to 1000000"),
    ({**TINY, "profile": {**_inline_profile("mine"), "peak_flops": {"bf16": 1e15, "fp9": 1e15}}}, 422,  # was taken
     "profile.peak_flops.fp9: Input should be 'fp64', 'fp32', 'tf32', 'bf16', 'fp16', 'fp8', 'fp4' or 'int8'"),
    ({**TINY, "profile": {**_inline_profile("mine"), "memory_bytes": True}}, 422,  # was 1 byte
     "profile.memory_bytes: Input should be a valid integer"),
    ({**TINY, "profile": {**_inline_profile("mine"), "memory_bandwidth": "3.35e12"}}, 422,
     "profile.memory_bandwidth: Input should be a valid number"),
    ({**TINY, "profile": {**_inline_profile("mine"), "memory_efficiency": 5e-324}}, 422,
     "profile.memory_efficiency: Input should be greater than or equal to 0.000001"),
    ({**TINY, "model": {"hf_config": {**PRESETS["llama-tiny"], "text_config": {}}}}, 422,
     "model.hf_config.text_config: transformers cannot build a llama model with text_config={}"),
    ({**TINY, "model": {"hf_config": {**PRESETS["llama-tiny"], "sub_configs": 1}}}, 422,
     "model.hf_config.sub_configs: property 'sub_configs' of 'LlamaConfig' object has no setter"),
    ({**TINY, "devices": True}, 422, "devices: Input should be a valid integer"),
    ({**TINY, "batch_size": 4.0}, 422, "batch_size: Input should be a valid integer"),
    ({**TINY, "mesh": {"dp": True}}, 422, "mesh.dp: Input should be a valid integer"),
    ({**TINY, "time_limit_s": float("nan")}, 422, "time_limit_s: Input should be a finite number"),
    # A config error found while filling in the defaults, and one found by a worker.
    ({"model": {"hf_config": {}}, "devices": 2, "profile": PROFILE}, 422, "model.hf_config.model_type: missing from the config"),
    ({**TINY, "model": {"hf_config": {}}}, 422, "model.hf_config.model_type: missing from the config"),
    ({**TINY, "mesh": {"dp": 3}}, 422, "mesh"),
    ({**TINY, "mesh": {"DP": 2}}, 422, "mesh.DP: String should match pattern"),  # read mesh.DP.[key]: (audit)
    ({**TINY, "time_limit_s": MAX_TIME_LIMIT_S + 1}, 422, "time_limit_s"),
    ({**TINY, "bogus": 1}, 422, "bogus: Extra inputs are not permitted"),
    ({key: v for key, v in TINY.items() if key != "devices"}, 422, "devices: Field required"),
    ({"model": "llama3-70b", "devices": 1, "profile": PROFILE, "batch_size": 1, "seq_len": 128}, 422, "devices: no layout"),
    (b"{not json", 422, "body: invalid JSON"),
    # Nesting: deeper than the request's limit (pydantic's serialiser, which computes the
    # plan id, fails at ~255 levels: a 500 before), and deeper than the JSON parser's.
    ({**TINY, "model": {"hf_config": {"model_type": "llama", "x": _nested(300)}}}, 422,
     "model.hf_config: nested too deeply"),
    ({**TINY, "model": {"hf_config": {"model_type": "llama", "x": _nested(MAX_HF_CONFIG_DEPTH)}}}, 422,
     "model.hf_config: nested too deeply"),
    (b'{"model": "llama-tiny", "devices": 2, "profile": "h100-sxm-80g", "mesh": ' + b"[" * 5000 + b"]" * 5000
     + b"}", 400, "body: JSON nested too deeply"),
    # NaN and the infinities would all be null in the plan id.
    ({**TINY, "model": {"hf_config": {"model_type": "llama", "rms_norm_eps": float("nan")}}}, 422,
     "model.hf_config.rms_norm_eps: must be a finite number"),
    ({**TINY, "model": {"hf_config": {"model_type": "llama", "rope_scaling": {"f": [1.0, float("-inf")]}}}},
     422, "model.hf_config.rope_scaling.f.1: must be a finite number"),
    # A lone surrogate escape parses in Python but no UTF-8 encoder takes it: a 500 when the
    # request was stored, after the solve (audit, session 37).
    ({**TINY, "model": {"hf_config": {**PRESETS["llama-tiny"], "foo": ["\ud800"]}}}, 422,
     "model.hf_config.foo.0: not Unicode text"),
    ({**TINY, "model": {"hf_config": {**PRESETS["llama-tiny"], "rope_scaling": {"\udfff": 1}}}}, 422,
     "model.hf_config.rope_scaling: a key is not Unicode text"),
    ({**TINY, "profile": {**_inline_profile("mine"), "source": "x\ud800"}}, 422, "profile.source: not Unicode text"),
    ({**TINY, "time_limit_s": True}, 422, "time_limit_s: Input should be a valid number"),
    ({**TINY, "time_limit_s": "5"}, 422, "time_limit_s: Input should be a valid number"),
    # Neither branch of a union: named as the field's, not as one branch's (or a tag's).
    ({**TINY, "profile": 7}, 422,
     "profile: expected a shipped profile name or an inline profile object, got integer"),
    ({**TINY, "model": 5}, 422, 'model: expected a preset name or {"hf_config": {...}}, got integer'),
    ({**TINY, "model": [1]}, 422, 'model: expected a preset name or {"hf_config": {...}}, got array'),
    ({**TINY, "model": {"hf_config": {}, "foo": 1}}, 422, "model.foo: Extra inputs are not permitted"),
    (b'{"model": "\xff"}', 400, "body: not valid UTF-8 JSON (byte 0xff at position 11)"),
    # past Python's int digits limit: "There was an error parsing the body"
    (b'{"devices": ' + b"9" * 5000 + b"}", 400, "body: a number has more than 4300 digits"),
])
def test_bad_input_is_a_4xx_naming_the_field(server: ServerProcess, body: object, status: int,
                                             names: str) -> None:
    got, answer = server.post("/v1/plans", body)
    assert got == status, answer
    assert names in answer["detail"], answer["detail"]


HUGE = 900_000  # characters: a body under the 1 MiB limit


@pytest.mark.parametrize(("body", "starts"), [
    ({**TINY, "model": "x" * HUGE}, f"model: {'x' * 64!r}... ({HUGE} characters) is not a preset ("),
    ({**TINY, "y" * HUGE: 1}, f"{'y' * 64}... ({HUGE} characters): Extra inputs are not permitted"),
    ({**TINY, "profile": "z" * HUGE}, f"profile: {'z' * 64!r}... ({HUGE} characters) is not a shipped profile"),
    ({**TINY, "mesh": {"q" * HUGE: 2}}, f"mesh.{'q' * 64}... ({HUGE} characters): String should match pattern"),
    ({**TINY, "profile": {**_inline_profile("mine"), "k" * HUGE: 1}},
     f"profile.{'k' * 64}... ({HUGE} characters): Extra inputs are not permitted"),
    ({**TINY, "model": {"hf_config": {"model_type": "llama", "_" * HUGE: 1}}},
     f"model.hf_config.{'_' * 64}... ({HUGE} characters): not accepted by the service"),
    # the planner's own messages quote what they refuse: cut in the middle (no batch_size:
    # the server builds the config to fill it in, so no worker is needed)
    ({"model": {"hf_config": {"model_type": "m" * HUGE}}, "devices": 2, "profile": PROFILE},
     "model.hf_config.model_type: 'mmm"),
])
def test_a_huge_name_is_echoed_as_its_start_and_length(tmp_path: Path, body: dict, starts: str) -> None:
    """A 900 kB unknown preset, profile or key was echoed whole: a 900 kB 422 (audit)."""
    answer = TestClient(create_app(tmp_path / "plans.db")).post("/v1/plans", json=body)
    detail = answer.json()["detail"]
    assert answer.status_code == 422 and detail.startswith(starts), detail[:200]
    assert len(answer.content) < 2000 and (f"{HUGE} characters" in detail or "characters left out" in detail)


EXPECTED_BODY = 'a JSON object such as {"model": "llama3-8b", "devices": 64, "profile": "h100-sxm-80g"}'


@pytest.mark.parametrize(("body", "detail"), [
    (b"", f"body: empty; expected {EXPECTED_BODY}"),
    (b"null", f"body: expected {EXPECTED_BODY} (its fields: /openapi.json), got null"),
    (b"[1]", f"body: expected {EXPECTED_BODY} (its fields: /openapi.json), got array"),
])
def test_a_body_that_is_not_an_object_says_what_is_expected(tmp_path: Path, body: bytes, detail: str) -> None:
    """An empty body was 'body: Field required', which reads as a missing field named body (audit)."""
    answer = TestClient(create_app(tmp_path / "plans.db")).post(
        "/v1/plans", content=body, headers={"Content-Type": "application/json"})
    assert answer.status_code == 422 and answer.json()["detail"].startswith(detail), answer.json()


@pytest.mark.parametrize("path", ["/", "/plans", "/v1/plans"])
def test_a_list_page_refuses_a_paging_value_out_of_bounds(tmp_path: Path, path: str) -> None:
    """The page quietly clamped /?limit=-5 to 1 and read /?limit=abc as its default
    (audit): every list address refuses what GET /v1/plans refuses, naming the parameter."""
    client = TestClient(create_app(tmp_path / "plans.db"))
    for query, detail in [("limit=-5", "limit: Input should be greater than or equal to 1"),
                          ("limit=0", "limit: Input should be greater than or equal to 1"),
                          ("limit=abc", "limit: Input should be a valid integer"),
                          ("limit=2.5", "limit: Input should be a valid integer"),
                          ("limit=1001", "limit: Input should be less than or equal to 1000"),
                          ("offset=-1", "offset: Input should be greater than or equal to 0")]:
        answer = client.get(f"{path}?{query}")
        assert answer.status_code == 422 and answer.json()["detail"].startswith(detail), (query, answer.text)
    assert client.get(f"{path}?limit=7&offset=3").status_code == 200


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded", "text/plain"])
def test_a_body_not_sent_as_json_is_415(server: ServerProcess, content_type: str) -> None:
    """curl -d sends a form by default; the answer says so instead of 'Input should be a
    valid dictionary'."""
    request = urllib.request.Request(server.url + "/v1/plans", data=b'{"model": "llama-tiny"}', method="POST")
    request.add_header("Content-Type", content_type)
    with pytest.raises(urllib.error.HTTPError) as error:
        urllib.request.urlopen(request, timeout=30)
    assert error.value.code == 415
    assert "application/json" in error.value.read().decode()


def test_an_inline_copy_of_a_shipped_profile_is_that_profile(server: ServerProcess) -> None:
    """Listed under the shipped name only when it is the shipped profile (see the 422 above)."""
    status, body = server.post("/v1/plans", {**TINY, "batch_size": 2, "profile": _inline_profile()})
    assert status in (200, 201), body
    row = next(p for p in server.get("/v1/plans")["plans"] if p["id"] == body["id"])
    assert row["profile"] == PROFILE


def test_inline_profiles_of_one_name_are_listed_apart(server: ServerProcess) -> None:
    """Two teams' inline "team-cluster" profiles with different numbers: two plans, and the
    list tells them apart (each labelled with a digest of its numbers)."""
    labels = []
    for all_reduce in (1e9, 2e9):
        status, body = server.post("/v1/plans", {**TINY, "batch_size": 2,
                                                 "profile": _inline_profile("team-cluster", all_reduce)})
        assert status in (200, 201), body
        assert body["plan"]["profile"] == "team-cluster"
        labels.append(next(p for p in server.get("/v1/plans")["plans"] if p["id"] == body["id"])["profile"])
    assert all(label.startswith("team-cluster (inline ") for label in labels), labels
    assert labels[0] != labels[1]


def _raw_post(server: ServerProcess, head: str, body: bytes = b"") -> str:
    """Status line of a hand-made request (urllib cannot send a lying Content-Length)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(f"POST /v1/plans HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{head}\r\n".encode()
                     + body)
        return sock.makefile("rb").readline().decode()


def test_oversized_bodies_are_413(server: ServerProcess) -> None:
    # Refused on the declared length, before any of the body is read ...
    assert " 413 " in _raw_post(server, f"Content-Length: {(1 << 20) + 1}\r\n")
    # ... and, without a length (chunked), once the bytes read pass the limit.
    chunk = b'{"model": "' + b"x" * (1 << 20) + b'"}'
    body = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n0\r\n\r\n"
    assert " 413 " in _raw_post(server, "Transfer-Encoding: chunked\r\n", body)


def test_a_body_that_stops_arriving_is_408() -> None:
    """A Content-Length larger than the body sent held the request open for good (audit).
    The middleware alone, on a route that reads a JSON body, with a short timeout; a
    complete body's later receive() (the wait for a disconnect during a solve) is not timed."""
    import asyncio

    from fastapi import Body, FastAPI

    from service.app import BodyLimits

    app = FastAPI()

    @app.post("/echo")
    async def echo(value: dict = Body()) -> dict:  # noqa: B008 (FastAPI's way)
        return value

    async def post(pieces: list[bytes], stall: bool) -> tuple[int, bytes]:
        queue = [{"type": "http.request", "body": piece, "more_body": True} for piece in pieces]
        sent: list[dict] = []

        async def receive() -> dict:
            if queue:
                return queue.pop(0)
            if stall:
                await asyncio.sleep(3600)
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/echo", "raw_path": b"/echo", "query_string": b"",
                 "headers": [(b"content-type", b"application/json")], "http_version": "1.1", "scheme": "http",
                 "server": ("x", 80), "client": ("y", 1), "root_path": ""}
        await asyncio.wait_for(BodyLimits(app, max_bytes=1 << 20, read_timeout_s=0.2)(scope, receive, send), 10)
        return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])

    status, body = asyncio.run(post([b'{"a": '], stall=True))
    assert status == 408 and b"body: no bytes for 0.2 s before its end" in body, body
    assert asyncio.run(post([b'{"a": ', b"1}"], stall=False)) == (200, b'{"a":1}')


def test_unknown_ids_and_profiles_are_404(server: ServerProcess) -> None:
    status, body = server.request("GET", "/v1/plans/" + "0" * 20)
    assert status == 404 and "plan_id" in body["detail"]
    status, body = server.request("GET", "/v1/plans/nosuch")  # not of an id's form: still just not there
    assert status == 404 and "nosuch" in body["detail"]
    status, body = server.request("GET", "/v1/plans/" + "a" * 20000)  # echoed whole before (review)
    assert status == 404 and body["detail"] == (f"plan_id: no plan {'a' * 64!r}... (20000 characters) "
                                                "(a plan id is 20 hex digits)")
    status, body = server.request("GET", "/v1/profiles/nope")
    assert status == 404 and "nope" in body["detail"]
    assert PROFILE in server.get("/v1/profiles")["profiles"]
    assert server.get(f"/v1/profiles/{PROFILE}")["name"] == PROFILE


def test_an_id_not_of_a_plan_ids_form_gets_the_routes_404_saying_so(tmp_path: Path) -> None:
    """/v1/plans/a%2Fb (a slash in it) matched no route: FastAPI's bare "Not Found" (audit)."""
    client = TestClient(create_app(tmp_path / "plans.db"))
    for path, shown in [("a%2Fb", "a/b"), ("a/b", "a/b"), ("xyz", "xyz"), ("0" * 19 + "g", "0" * 19 + "g")]:
        answer = client.get(f"/v1/plans/{path}")
        assert (answer.status_code, answer.json()["detail"]) == (
            404, f"plan_id: no plan {shown!r} (a plan id is 20 hex digits)"), path
    assert client.get("/v1/plans/" + "0" * 20).json()["detail"] == f"plan_id: no plan {'0' * 20!r}"
    assert client.get("/v1/plans/").json() == {"plans": [], "total": 0}  # still the list, redirected


def _schemathesis() -> str:
    exe = shutil.which("schemathesis") or str(Path(sys.executable).with_name("schemathesis"))
    assert Path(exe).exists(), "schemathesis is not installed: pip install -e '.[test]'"
    return exe


@pytest.mark.parametrize("selection", [
    ["--exclude-method", "POST", "--phases", "coverage,fuzzing", "-n", "15"],
    # POST with schema-violating bodies only: valid bodies would start real solves
    # of random presets on up to a million devices; those are covered above.
    ["--include-method", "POST", "-m", "negative", "--phases", "coverage,fuzzing", "-n", "30"],
])
def test_openapi_fuzz_gives_no_server_errors(server: ServerProcess, selection: list[str],
                                             tmp_path: Path) -> None:
    run = subprocess.run(
        [_schemathesis(), "run", f"{server.url}/openapi.json", "--checks", "not_a_server_error",
         "--generation-database", "none", "--seed", "7", "--no-shrink", "--no-color",
         "--request-timeout", "30", *selection],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)  # it writes a cache dir in cwd
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]


def test_overrunning_solve_is_killed_and_its_worker_replaced() -> None:
    """The hard wall-clock limit: the job is abandoned, the worker process replaced,
    and the replacement serves the next job."""
    job = {"model": "llama-tiny", "devices": 2, "profile": PROFILE, "batch_size": 4, "seq_len": 32,
           "mesh": None, "time_limit_s": 30.0}

    async def scenario() -> None:
        pool = PlannerPool(1)
        pool.start()
        try:
            first = pool.pids
            with pytest.raises(PlanningTimeout, match="time_limit_s"):
                await pool.plan("t1", job, hard_limit_s=0.05)
            assert pool.pids != first
            assert pool.busy == 0
            # The replacement answers (a quick job: the answer is an input error).
            with pytest.raises(PlanningInputError, match="profile"):
                await pool.plan("t2", {**job, "profile": "nope"}, hard_limit_s=300)
        finally:
            pool.close()

    asyncio.run(scenario())


def test_plans_survive_kill_9(server: ServerProcess) -> None:
    """A plan is committed before it is returned: kill -9 right after the answer loses
    nothing.  (The module's server is restarted in place for any later test.)"""
    listed = {p["id"] for p in server.get("/v1/plans?limit=1000")["plans"]}
    status, body = server.post("/v1/plans", {**TINY, "batch_size": 6})
    assert status == 201, body
    server.kill()
    server.start()
    for plan_id in listed:
        server.get(f"/v1/plans/{plan_id}")
    assert server.get(f"/v1/plans/{body['id']}")["plan"] == body["plan"]
    assert server.get("/v1/plans")["total"] == len(listed) + 1


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid`` (/proc: Linux)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_busy_worker_dies_with_a_killed_server(tmp_path: Path) -> None:
    """kill -9 of the server left a busy worker solving on, orphaned, for its full time
    (~70 s seen; review): it now dies with the server."""
    with ServerProcess(tmp_path / "plans.db", workers=1) as server:
        assert server.proc is not None
        workers = _children(server.proc.pid)
        assert workers, "no worker process"
        def post() -> None:
            with contextlib.suppress(OSError):  # the server is killed under it
                server.post("/v1/plans", {"model": "llama3-405b", "devices": 1024, "profile": PROFILE,
                                          "time_limit_s": 60})

        slow = threading.Thread(target=post, daemon=True)
        slow.start()
        deadline = time.monotonic() + 60
        while server.get("/healthz")["busy_workers"] == 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert server.get("/healthz")["busy_workers"] == 1
        server.kill()
        deadline = time.monotonic() + 10
        while any(map(_running, workers)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [w for w in workers if _running(w)]


def test_reader_connections_of_finished_threads_are_closed(tmp_path: Path) -> None:
    """The thread pool retires idle threads and starts new ones; each new thread's
    connection was kept for good, with its file descriptors (review)."""
    from service.store import PlanStore

    store = PlanStore(tmp_path / "plans.db")
    for _ in range(5):
        threads = [threading.Thread(target=store.list, args=(10, 0)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    store.count()  # this thread's connection: the finished threads' are closed on the way
    assert len(store._readers) == 1
    store.close()
