"""Planning off the event loop: worker processes with a hard wall-clock limit.

Tracing and the ILP hold the GIL for seconds, so they run in other processes.
``concurrent.futures.ProcessPoolExecutor`` cannot stop one task: a solve that
overran its time limit would hold its worker for good (and block shutdown).  So
each slot here is one spawned process fed through a pipe; when a job overruns the
hard limit, that slot's process is killed and replaced, and the client gets a
clear timeout instead of a hang.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import sys
import traceback
from collections.abc import Awaitable, Callable
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from planner.schema import Plan

T = TypeVar("T")


class PlanningTimeout(Exception):
    """The planner overran the hard wall-clock limit; its worker was restarted."""


class PlannerBusy(Exception):
    """No worker became free in time."""


class PlannerUnavailable(Exception):
    """The planner cannot run here (not installed yet, or its worker died)."""


class PlannerFailed(Exception):
    """The planner raised something other than ValueError: a bug, reported as a 500."""


class PlanningInputError(ValueError):
    """The planner rejected the request; the message names the field."""


class ModelConfigError(PlanningInputError):
    """The planner rejected the model's config (its ConfigError): the message names the
    config's keys, which the service places under the request's ``model.hf_config``."""


def _die_with(parent: int) -> None:
    """Linux: be killed when the server dies.  A server killed with SIGKILL closes the
    pipe, which an idle worker notices, but a busy one went on solving for its full time
    (~70 s seen; review).  The stdlib has no call for prctl's PR_SET_PDEATHSIG, hence
    ctypes; elsewhere the pipe is the only signal.  The signal follows the thread that
    started the worker: the event loop's, or for a restarted worker a thread of the
    loop's executor, which lives as long as the loop."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # the server died before the call
        os._exit(1)


def _worker_main(conn: Connection, parent: int) -> None:
    """Child process: import the planner once (seconds: torch, transformers), then
    serve jobs until the pipe closes."""
    _die_with(parent)
    # Nothing a request says may make this process download anything.
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    try:
        from planner import plan as plan_fn
        from planner.presets import ConfigError
    except ImportError as e:
        plan_fn, missing = None, f"planner.plan is not available yet ({e})"
    while True:
        try:
            tag, kwargs = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            return
        if plan_fn is None:
            conn.send(("unavailable", missing))
            continue
        try:
            plan = plan_fn(**kwargs, progress=lambda line, tag=tag: print(f"[plan {tag}] {line}", file=sys.stderr))
            answer = ("ok", plan.to_json(indent=None))
        except ConfigError as e:
            answer = ("config_error", str(e))
        except ValueError as e:
            answer = ("user_error", str(e))
        except Exception as e:  # noqa: BLE001 - a planner bug must reach the client as a 500, not kill the worker
            traceback.print_exc()
            answer = ("error", f"{type(e).__name__}: {e}")
        try:
            conn.send(answer)
        except OSError:  # the server is gone (killed): nobody to answer
            return


class _Slot:
    """One worker process and its pipe."""

    def __init__(self, ctx: Any) -> None:
        self._ctx = ctx
        self._closed = False
        self._start()

    def _start(self) -> None:
        self.conn, child = self._ctx.Pipe()
        self.proc = self._ctx.Process(target=_worker_main, args=(child, os.getpid()), daemon=True, name="meshplan-planner")
        self.proc.start()
        child.close()

    def run(self, tag: str, kwargs: dict[str, Any], hard_limit_s: float) -> tuple[str, str]:
        """Blocking (called in a thread): send one job, wait for its answer or kill."""
        try:
            self.conn.send((tag, kwargs))
            if self.conn.poll(hard_limit_s):
                return self.conn.recv()
        except (EOFError, OSError):
            if self._closed:
                raise PlannerUnavailable("the server is shutting down") from None
            self.restart()
            raise PlannerUnavailable("the planner worker died (out of memory?); try again") from None
        self.restart()
        raise PlanningTimeout(f"time_limit_s: planning did not finish within {hard_limit_s:.0f} s")

    def restart(self) -> None:
        self._stop()
        if not self._closed:
            self._start()

    def close(self) -> None:
        self._closed = True
        self._stop()

    def _stop(self) -> None:
        self.proc.kill()
        self.proc.join()
        self.conn.close()


class PlannerPool:
    """``workers`` planner processes; jobs queue for a free one."""

    def __init__(self, workers: int, queue_timeout_s: float = 60.0) -> None:
        if workers < 1:
            raise ValueError(f"workers: must be at least 1, got {workers}")
        self.workers = workers
        self.queue_timeout_s = queue_timeout_s
        self.solves = 0  # jobs handed to a worker since start: shows single-flight working
        self._slots: list[_Slot] = []
        self._free: asyncio.Queue[_Slot] | None = None

    def start(self) -> None:
        """Spawn the workers (they import the planner in the background)."""
        ctx = multiprocessing.get_context("spawn")
        self._slots = [_Slot(ctx) for _ in range(self.workers)]
        self._free = asyncio.Queue()
        for slot in self._slots:
            self._free.put_nowait(slot)

    def close(self) -> None:
        for slot in self._slots:
            slot.close()
        self._slots = []

    @property
    def pids(self) -> list[int]:
        return [slot.proc.pid for slot in self._slots]

    @property
    def busy(self) -> int:
        return self.workers - (self._free.qsize() if self._free else 0)

    async def plan(self, tag: str, kwargs: dict[str, Any], hard_limit_s: float) -> Plan:
        assert self._free is not None, "PlannerPool.start() was not called"
        try:
            slot = await asyncio.wait_for(self._free.get(), self.queue_timeout_s)
        except asyncio.TimeoutError:
            raise PlannerBusy(f"all {self.workers} planner workers stayed busy for "
                              f"{self.queue_timeout_s:.0f} s; try again later") from None
        self.solves += 1
        try:
            status, payload = await asyncio.to_thread(slot.run, tag, kwargs, hard_limit_s)
        finally:
            self._free.put_nowait(slot)
        if status == "ok":
            return Plan.from_json(payload)
        if status == "user_error":
            raise PlanningInputError(payload)
        if status == "config_error":
            raise ModelConfigError(payload)
        if status == "unavailable":
            raise PlannerUnavailable(payload)
        raise PlannerFailed(f"planner failed: {payload}")


class SingleFlight:
    """Concurrent callers with the same key share one run.  The run is shielded: a
    client that disconnects does not cancel the solve (or the store write) that
    others are waiting for."""

    def __init__(self) -> None:
        self._running: dict[str, asyncio.Task[Any]] = {}

    async def run(self, key: str, start: Callable[[], Awaitable[T]]) -> T:
        task = self._running.get(key)
        if task is None:
            task = asyncio.ensure_future(start())
            self._running[key] = task
            task.add_done_callback(lambda _t: self._running.pop(key, None))
        return await asyncio.shield(task)
