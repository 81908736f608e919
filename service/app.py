"""The planner service: FastAPI app over the plan store and the planner workers.

Request handlers never solve on the event loop (solves run in ``service.worker``
processes) and never wait on an fsync there (store writes run in the thread pool;
reads are WAL reads, which no writer blocks), so ``/healthz`` and the GET routes
stay fast while many plans are being solved.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import sqlite3
import sys
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi import Path as PathParam
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.convertors import PathConvertor, register_url_convertor
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cost_model.profile import (
    load_profile,
    problem_lines,
    shipped_profile,
    shipped_profiles,
    shown,
)
from planner.presets import ConfigError
from planner.schema import Plan
from service.models import (
    JSON_VALUE_ERROR,
    ErrorResponse,
    Health,
    PlanList,
    PlanRequest,
    PlanResponse,
    PlanSummary,
    ProfileList,
    StoredPlanResponse,
    json_type_name,
)
from service.store import ID_LENGTH, PlanStore, StoredPlan, default_db_path
from service.worker import (
    ModelConfigError,
    PlannerBusy,
    PlannerFailed,
    PlannerPool,
    PlannerUnavailable,
    PlanningInputError,
    PlanningTimeout,
    SingleFlight,
)

STATIC_DIR = Path(__file__).parent / "static"
MAX_BODY_BYTES = 1 << 20
BODY_READ_TIMEOUT_S = 30.0  # between two pieces of a request's body
MAX_PAGE = 1000  # plans in one page of the list
MAX_OFFSET = 1 << 31
# The viewer loads nothing from the network: only this origin's files.
VIEWER_CSP = ("default-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
              "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'")


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The error answers a route can give, for its OpenAPI entry (each listed all of
    them, a 413 on a GET among them; review)."""
    return {code: {"model": ErrorResponse} for code in codes}


# a POST: a body that is not JSON, too large or stalled, a model or a plan that cannot be,
# busy or overrunning workers, a planner failure
_POST_ERRORS = _errors(400, 408, 413, 422, 500, 503, 504)
# No pattern: an id of the wrong form is an id that is not there (404), not a 422.
PLAN_ID = PathParam(description=f"plan id ({ID_LENGTH} hex digits)")
_ID_FORM = re.compile(f"[0-9a-f]{{{ID_LENGTH}}}")


class _AnyPlanId(PathConvertor):
    """A plan id with slashes in it too (/v1/plans/a%2Fb, /v1/plans/a/b), so that it gets
    the route's own 404 rather than the generic "Not Found"; not an empty one, so that
    /v1/plans/ still redirects to the list."""

    regex = ".+"


register_url_convertor("any_plan_id", _AnyPlanId())


class HeadAsGet:
    """Answer HEAD on every GET route (FastAPI routes take only the methods they name;
    load balancers probe with HEAD): the request goes to the app as a GET and the
    response goes out with the GET's headers (Content-Length included) and no body."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def headers_only(message: Message) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, headers_only)


class BodyLimits:
    """Reject request bodies over ``max_bytes`` with 413, and answer 408 when the body's
    next bytes take longer than ``read_timeout_s`` to arrive.  Starlette has no such
    limits and uvicorn bounds only the headers, so without them a client could make the
    server buffer and parse an arbitrarily large JSON body, or hold a request open for
    good by declaring more bytes than it sends (audit)."""

    def __init__(self, app: ASGIApp, max_bytes: int, read_timeout_s: float = BODY_READ_TIMEOUT_S) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout_s = read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._reject(scope, receive, send)
            return
        seen, complete = 0, False

        async def limited() -> Message:
            # Chunked bodies carry no length: count as they arrive.  HTTPException
            # raised here surfaces inside the route, where FastAPI turns it into a 413
            # (408).  Once the body is complete, receive() waits for the client's
            # disconnect, as long as a solve runs: not timed.
            nonlocal seen, complete
            if complete:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.read_timeout_s)
            except asyncio.TimeoutError:  # not the builtin before Python 3.11
                raise HTTPException(408, f"body: no bytes for {self.read_timeout_s:g} s before its end "
                                         "(a Content-Length larger than the body sent?)") from None
            complete = message["type"] != "http.request" or not message.get("more_body", False)
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                raise HTTPException(413, self._message())
            return message

        await self.app(scope, limited, send)

    def _message(self) -> str:
        return f"body: larger than the {self.max_bytes} byte limit"

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        await JSONResponse({"detail": self._message()}, status_code=413)(scope, receive, send)


# The tags of PlanRequest.model's union, which pydantic puts in an error's location
# after the field's name (model.hf_config.foo for an extra key "foo" beside hf_config).
_MODEL_UNION_TAGS = ("preset", "hf_config")


def _field(loc: tuple[Any, ...] | list[Any]) -> str:
    # "[key]": pydantic's mark on a dict key's own error (mesh.DP.[key]: the key DP is wrong)
    parts = [shown(str(p)) for p in loc if p not in ("body", "query", "path", "[key]")]
    if len(parts) > 1 and parts[0] == "model" and parts[1] in _MODEL_UNION_TAGS:
        del parts[1]
    return ".".join(parts) or "body"


# What a POST body is, for a body that is not a JSON object (FastAPI's answer to an empty
# one was "body: Field required", which reads as a missing field named body).
_BODY_EXPECTED = ('a JSON object such as {"model": "llama3-8b", "devices": 64, "profile": "h100-sxm-80g"} '
                  "(its fields: /openapi.json)")


def _problem(error: dict[str, Any]) -> str:
    if tuple(error["loc"]) == ("body",) and error["type"] == "missing":
        return f"body: empty; expected {_BODY_EXPECTED}"
    if tuple(error["loc"]) == ("body",) and error["type"] == "model_attributes_type":
        return f"body: expected {_BODY_EXPECTED}, got {json_type_name(error['input'])}"
    if error["type"] == "json_invalid":
        return f"body: invalid JSON ({error.get('ctx', {}).get('error', 'unparsable')})"
    if error["type"] == JSON_VALUE_ERROR:  # a problem inside an inline JSON value: its path
        ctx = error["ctx"]
        return f"{'.'.join(filter(None, [_field(error['loc']), ctx['path']]))}: {ctx['problem']}"
    return f"{_field(error['loc'])}: {error['msg'].removeprefix('Value error, ')}"


MAX_DETAIL_LINE = 1000


def _bounded(detail: str) -> str:
    """``detail`` with each line cut to at most about MAX_DETAIL_LINE characters, as a
    safety net behind ``shown``: the planner's messages quote the values they refuse
    (``model_type: '<900 kB string>' is not supported (...)``).  A line's start names the
    field and its end most often the problem, so its middle is what goes."""
    head, tail = 2 * MAX_DETAIL_LINE // 3, MAX_DETAIL_LINE // 3
    return "\n".join(line if len(line) <= MAX_DETAIL_LINE
                     else f"{line[:head]}... ({len(line) - head - tail} characters left out) ...{line[-tail:]}"
                     for line in detail.split("\n"))


def validation_message(errors: list[dict[str, Any]]) -> str:
    """pydantic errors as 'field: problem' lines, the format of every 4xx here."""
    return "\n".join(_problem(e) for e in errors)


@lru_cache(maxsize=1)
def _shipped_profiles() -> tuple[str, ...]:
    return tuple(shipped_profiles())


def _check_profile(profile: str | dict[str, Any]) -> str:
    """A profile the planner can use, checked in the server process (pydantic, no torch):
    a shipped name, or an inline profile that validates and does not pass itself off as
    a shipped one.  Returns the label the plan list shows for it.

    A plan records its profile by name only, so an inline "h100-sxm-80g" with other
    numbers would be indistinguishable from the real one (refused), and two teams' inline
    "cluster" profiles from each other: an inline profile is listed as ``name (inline
    <first 8 hex digits of the SHA-256 of its validated JSON>)``, unless it is a shipped
    profile's exact copy."""
    shipped = _shipped_profiles()
    if isinstance(profile, str):
        if profile not in shipped:
            raise HTTPException(422, f"profile: {shown(profile, quote=True)} is not a shipped profile "
                                     f"({', '.join(shipped)}); or send the profile inline")
        return profile
    try:
        inline = load_profile(profile, allow_paths=False)
    except ValidationError as e:
        raise HTTPException(422, "\n".join(f"profile.{line}" for line in problem_lines(e))) from None
    except ValueError as e:  # a shipped profile's name with other numbers
        raise HTTPException(422, str(e)) from None
    if inline.name in shipped:
        return inline.name
    digest = hashlib.sha256(inline.model_dump_json().encode()).hexdigest()[:8]
    return f"{inline.name} (inline {digest})"


def _model_label(request: PlanRequest, plan: Plan) -> str:
    """What the plan list shows for the model: a preset's name; an inline config's type
    with the first 8 hex digits of the SHA-256 of its JSON, as inline profiles are told
    apart (every one read "hf_config:llama"; review)."""
    if isinstance(request.model, str):
        return plan.model
    digest = hashlib.sha256(json.dumps(request.model.hf_config, sort_keys=True).encode()).hexdigest()[:8]
    return f"{plan.model} (inline {digest})"


async def _json_body(request: Request) -> None:
    """POST bodies must say they are JSON: FastAPI would otherwise validate the raw bytes
    of a form or text body and answer 'body: Input should be a valid dictionary'."""
    content_type = request.headers.get("content-type", "")
    media = content_type.partition(";")[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise HTTPException(415, f"Content-Type: the body must be sent as application/json, "
                                 f"got {content_type or 'none'!r}")


def _summary(row: StoredPlan) -> PlanSummary:
    return PlanSummary(id=row.id, model=row.model, devices=row.devices, profile=row.profile,
                       created=row.created, step_time_s=row.step_time_s, mesh=json.loads(row.mesh))


def _plan_response(row: StoredPlan, status: int, cached: bool | None = None) -> Response:
    """The stored plan text spliced in as is: it was validated before it was stored, and
    parsing and re-serialising it per request would dominate a cached request's time."""
    head = {"id": row.id, "created": row.created} | ({} if cached is None else {"cached": cached})
    body = json.dumps(head)[:-1] + ', "plan": ' + row.plan + "}"
    return Response(body, status_code=status, media_type="application/json")


def _allowed_methods(app: FastAPI, scope: Scope) -> list[str]:
    """Every method some route serves at this path.  Starlette's 405 names only those of
    the first route that matched it: /v1/plans is served by two (GET and POST)."""
    allowed = {m for route in app.router.routes if isinstance(route, Route)
               and route.matches(scope)[0] != Match.NONE for m in route.methods or ()}
    return sorted(allowed | ({"HEAD"} if "GET" in allowed else set()))


def create_app(db_path: str | Path | None = None, *, workers: int = 2,
               default_time_limit_s: float = 60.0, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The service.  ``default_time_limit_s`` is the solver limit when a request sets
    none; a solve is killed after ``2 * limit + 30`` s wall clock (tracing and model
    building are outside the solver's own limit)."""
    store = PlanStore(db_path or default_db_path())
    pool = PlannerPool(workers)
    flights = SingleFlight()

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        pool.start()
        try:
            yield
        finally:
            pool.close()
            store.close()

    # No /docs or /redoc: FastAPI's pages load Swagger UI / ReDoc from a CDN, so they
    # would be blank offline.  The schema itself is /openapi.json.
    app = FastAPI(title="meshplan", version="1.0",
                  description="Auto-parallel training plans for PyTorch models.", lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimits, max_bytes=max_body_bytes)
    app.add_middleware(HeadAsGet)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": _bounded(validation_message(list(exc.errors())))}, status_code=422)

    @app.exception_handler(StarletteHTTPException)  # what FastAPI raises on an undecodable body
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # FastAPI's answer to a body it cannot decode names nothing; bytes that are not
        # UTF-8, and JSON nested deeper than the parser's recursion limit (~1000 levels),
        # are the cases a client can fix once told which.
        if isinstance(exc.__cause__, UnicodeDecodeError):
            cause = exc.__cause__
            return JSONResponse({"detail": f"body: not valid UTF-8 JSON (byte {cause.object[cause.start]:#04x} "
                                           f"at position {cause.start})"}, status_code=400)
        if isinstance(exc.__cause__, RecursionError):
            return JSONResponse({"detail": "body: JSON nested too deeply"}, status_code=400)
        if isinstance(exc.__cause__, ValueError) and "digits" in str(exc.__cause__):  # Python's int limit
            return JSONResponse({"detail": f"body: a number has more than {sys.get_int_max_str_digits()} "
                                           "digits"}, status_code=400)
        if exc.status_code == 405 and (allowed := _allowed_methods(app, request.scope)):
            allow = ", ".join(allowed)
            return JSONResponse({"detail": f"method {request.method} not allowed on {request.url.path}; "
                                           f"allowed: {allow}"}, status_code=405, headers={"Allow": allow})
        if isinstance(exc.detail, str):
            exc.detail = _bounded(exc.detail)
        return await http_exception_handler(request, exc)

    @app.exception_handler(PlannerUnavailable)
    async def _unavailable(_request: Request, exc: PlannerUnavailable) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=503)

    @app.exception_handler(PlannerFailed)
    async def _failed(_request: Request, exc: PlannerFailed) -> JSONResponse:
        return JSONResponse({"detail": _bounded(str(exc))}, status_code=500)

    async def solve(request: PlanRequest, key: str, profile_label: str) -> StoredPlan:
        limit = request.time_limit_s
        assert limit is not None, "with_defaults fills it"
        kwargs = {"model": request.planner_model(), "devices": request.devices,
                  "profile": request.profile, "batch_size": request.batch_size,
                  "seq_len": request.seq_len, "mesh": request.mesh, "time_limit_s": limit}
        try:
            plan = await pool.plan(key[:8], kwargs, hard_limit_s=2 * limit + 30)
        except ModelConfigError as e:
            raise HTTPException(422, request.config_error(str(e))) from None
        except PlanningInputError as e:
            raise HTTPException(422, str(e)) from None
        except PlannerBusy as e:
            raise HTTPException(503, str(e), headers={"Retry-After": "10"}) from None
        except PlanningTimeout as e:
            raise HTTPException(504, str(e)) from None
        try:
            return await run_in_threadpool(store.put, key, request.model_dump_json(), plan, profile_label,
                                           _model_label(request, plan))
        except sqlite3.Error as e:  # locked by another process past busy_timeout, disk full, read-only
            raise HTTPException(503, f"store: the plan was made but could not be saved ({e}); try again",
                                headers={"Retry-After": "10"}) from None

    @app.post("/v1/plans", status_code=201, response_model=PlanResponse, responses={
        200: {"model": PlanResponse, "description": "an identical request was planned before"},
        415: {"model": ErrorResponse, "description": "the body is not sent as application/json"},
        **_POST_ERRORS}, dependencies=[Depends(_json_body)])
    async def create_plan(request: PlanRequest) -> Response:
        """Plan a model on a cluster; the same request again returns the stored plan (200)."""
        profile_label = _check_profile(request.profile)
        if not isinstance(request.profile, str) and profile_label == request.profile.get("name"):
            # a shipped profile's exact copy, sent inline: the same request as by its name
            request = request.model_copy(update={"profile": profile_label})
        if request.batch_size is None or request.seq_len is None:
            try:  # builds the model's config: off the event loop
                request = await run_in_threadpool(request.with_defaults, default_time_limit_s)
            except ConfigError as e:
                raise HTTPException(422, request.config_error(str(e))) from None
            except ValueError as e:
                raise HTTPException(422, str(e)) from None
        else:
            request = request.with_defaults(default_time_limit_s)
        try:
            key = request.key()
        except ValueError as e:  # validation should have refused it: a 422, never a 500
            raise HTTPException(422, str(e)) from None
        row = store.get_by_key(key)
        led = False  # whether this request's solve made the plan, or it waited on another's

        def lead() -> Awaitable[StoredPlan]:
            nonlocal led
            led = True
            return solve(request, key, profile_label)

        if row is None:
            row = await flights.run(key, lead)
        return _plan_response(row, 201 if led else 200, not led)

    @app.get("/v1/plans", response_model=PlanList, responses=_errors(422))
    async def list_plans(limit: int = Query(100, ge=1, le=MAX_PAGE),
                         offset: int = Query(0, ge=0, le=MAX_OFFSET)) -> PlanList:
        """Newest first."""
        # off the event loop: an OFFSET page and COUNT(*) of 200,000 plans took 1.5-3.7 s,
        # and held /healthz that long (review)
        rows, total = await run_in_threadpool(lambda: (store.list(limit, offset), store.count()))
        return PlanList(plans=[_summary(r) for r in rows], total=total)

    @app.get("/v1/plans/{plan_id:any_plan_id}", response_model=StoredPlanResponse, responses=_errors(404))
    async def get_plan(plan_id: str = PLAN_ID) -> Response:
        row = store.get(plan_id)
        if row is None:
            form = "" if _ID_FORM.fullmatch(plan_id) else f" (a plan id is {ID_LENGTH} hex digits)"
            raise HTTPException(404, f"plan_id: no plan {shown(plan_id, quote=True)}{form}")
        return _plan_response(row, 200)

    @app.get("/v1/profiles", response_model=ProfileList)
    def list_profiles() -> ProfileList:
        return ProfileList(profiles=list(_shipped_profiles()))

    @app.get("/v1/profiles/{name}", responses=_errors(404))
    def get_profile(name: str) -> dict[str, Any]:
        """The profile's numbers (bandwidths, peak FLOP/s, memory)."""
        if name not in _shipped_profiles():
            raise HTTPException(404, f"name: {shown(name, quote=True)} is not a shipped profile "
                                     f"({', '.join(_shipped_profiles())})")
        return shipped_profile(name).model_dump(mode="json")

    @app.get("/healthz", response_model=Health)
    async def healthz() -> Health:
        """Answered on the event loop without touching the disk or the workers."""
        return Health(status="ok", workers=pool.workers, busy_workers=pool.busy, solves=pool.solves)

    def viewer() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", headers={"Content-Security-Policy": VIEWER_CSP})

    def list_page(limit: int | None = Query(None, ge=1, le=MAX_PAGE),
                  offset: int | None = Query(None, ge=0, le=MAX_OFFSET)) -> FileResponse:
        # The page pages through GET /v1/plans with these: checked here with its bounds, as
        # the page quietly clamped /?limit=-5 to 1 and read /?limit=abc as its default (audit).
        return viewer()

    app.get("/", include_in_schema=False)(list_page)
    # every /plans address is the page, whose "no plan" error names what is not an id
    # (/plans/, /plans/a/b answered FastAPI's JSON 404)
    app.get("/plans", include_in_schema=False)(list_page)
    app.get("/plans/{plan_id:path}", include_in_schema=False)(viewer)

    @app.get("/favicon.ico", include_in_schema=False)
    def favicon() -> Response:  # browsers ask on every page; a 404 logs a console error
        return Response(status_code=204)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return app
