"""SQLite plan store.

One row per distinct (defaults-filled, canonicalised) request.  WAL mode with
``synchronous=FULL`` makes every commit durable before ``put`` returns, so a plan a
client has been handed survives ``kill -9`` of the server or a power cut.
"""

from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from planner.schema import Plan

_SCHEMA = """
CREATE TABLE IF NOT EXISTS plans (
    id          TEXT PRIMARY KEY,
    request_key TEXT NOT NULL UNIQUE,
    model       TEXT NOT NULL,
    devices     INTEGER NOT NULL,
    profile     TEXT NOT NULL,
    created     REAL NOT NULL,
    step_time_s REAL NOT NULL,
    mesh        TEXT NOT NULL,
    request     TEXT NOT NULL,
    plan        TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS plans_created ON plans (created);
"""

ID_LENGTH = 20


def default_db_path() -> Path:
    """``$XDG_DATA_HOME/meshplan/plans.db`` (``~/.local/share`` when unset)."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "meshplan" / "plans.db"


@dataclass(frozen=True)
class StoredPlan:
    id: str
    model: str
    devices: int
    profile: str
    created: float
    step_time_s: float
    mesh: str  # JSON object: dim name -> size
    plan: str  # JSON; empty in list()


class PlanStore:
    """Writes go through one connection under a lock; reads use one connection per
    thread.  In WAL mode readers never wait for a writer's fsync, so a read by id is
    cheap enough to run on the server's event loop itself; a list page (OFFSET) and the
    count scale with the store and run in the thread pool."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._write_lock = threading.Lock()
        self._writer = self._connect()
        self._writer.execute("PRAGMA journal_mode=WAL")
        self._writer.executescript(_SCHEMA)
        self._local = threading.local()
        self._readers: list[tuple[threading.Thread, sqlite3.Connection]] = []

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        db.execute("PRAGMA synchronous=FULL")
        db.execute("PRAGMA busy_timeout=5000")
        return db

    def _reader(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = self._local.db = self._connect()
            db.execute("PRAGMA query_only=ON")
            with self._write_lock:
                # the thread pool retires idle threads and starts new ones: close the
                # connections of threads that are gone (each burst of requests added
                # connections and file descriptors for good; review)
                for thread, old in self._readers:
                    if not thread.is_alive():
                        old.close()
                self._readers = [(t, c) for t, c in self._readers if t.is_alive()]
                self._readers.append((threading.current_thread(), db))
        return db

    def close(self) -> None:
        with self._write_lock:
            for db in [*(c for _, c in self._readers), self._writer]:
                db.close()

    @staticmethod
    def id_for(request_key: str) -> str:
        return request_key[:ID_LENGTH]

    def put(self, request_key: str, request_json: str, plan: Plan, profile: str | None = None,
            model: str | None = None) -> StoredPlan:
        """Insert and commit; an existing row for the same request wins (first writer).
        ``profile``, ``model``: the labels the list shows (default: the plan's names)."""
        row = StoredPlan(
            id=self.id_for(request_key), model=model or plan.model, devices=plan.devices,
            profile=profile or plan.profile, created=time.time(),
            step_time_s=plan.prediction.time.step_time_s,
            mesh=json.dumps({d.name: d.size for d in plan.mesh.dims}), plan=plan.to_json(indent=None),
        )
        with self._write_lock:  # autocommit: durable (synchronous=FULL) when execute returns
            self._writer.execute(
                "INSERT OR IGNORE INTO plans (id, request_key, model, devices, profile, created,"
                " step_time_s, mesh, request, plan) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (row.id, request_key, row.model, row.devices, row.profile, row.created,
                 row.step_time_s, row.mesh, request_json, row.plan),
            )
        stored = self.get(row.id)
        assert stored is not None  # just inserted or already there
        return stored

    def get(self, plan_id: str) -> StoredPlan | None:
        row = self._reader().execute(
            "SELECT id, model, devices, profile, created, step_time_s, mesh, plan"
            " FROM plans WHERE id = ?", (plan_id,)).fetchone()
        return StoredPlan(*row) if row else None

    def get_by_key(self, request_key: str) -> StoredPlan | None:
        return self.get(self.id_for(request_key))

    def list(self, limit: int, offset: int) -> list[StoredPlan]:
        """Newest first; the plan body is left out (lists stay cheap)."""
        rows = self._reader().execute(
            "SELECT id, model, devices, profile, created, step_time_s, mesh, '' FROM plans"
            " ORDER BY created DESC, id LIMIT ? OFFSET ?", (limit, offset)).fetchall()
        return [StoredPlan(*r) for r in rows]

    def count(self) -> int:
        return int(self._reader().execute("SELECT COUNT(*) FROM plans").fetchone()[0])
