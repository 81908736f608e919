"""Run ``meshplan serve`` as a child process on a free loopback port.

The tests and ``bench/service_load.py`` exercise the real server (uvicorn, worker
processes, SQLite on disk) rather than an in-process test client, so they start
it the way a user does.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """``with ServerProcess(db) as server: server.url ...``; stops (or is killed) on exit."""

    def __init__(self, db: str | Path, *, port: int | None = None, workers: int = 2,
                 time_limit_s: float = 60.0, log: str | Path | None = None) -> None:
        self.db = Path(db)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workers = workers
        self.time_limit_s = time_limit_s
        self.log = Path(log) if log else self.db.with_suffix(".log")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 120.0) -> ServerProcess:
        """Start and wait until /healthz answers (imports take seconds on a small box)."""
        cmd = [sys.executable, "-m", "service.cli", "serve", "--port", str(self.port), "--db", str(self.db),
               "--workers", str(self.workers), "--time-limit", str(self.time_limit_s), "--log-level", "warning"]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=os.environ.copy())
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"meshplan serve exited with {self.proc.returncode}; log:\n{self.log.read_text()}")
            try:
                self.get("/healthz", timeout=1)
                return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.2)
        self.kill()
        raise TimeoutError(f"meshplan serve did not answer within {timeout_s} s; log:\n{self.log.read_text()}")

    def request(self, method: str, path: str, body: Any = None, timeout: float = 300.0) -> tuple[int, Any]:
        """(status, decoded JSON body); 4xx/5xx are returned, not raised."""
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null")

    def get(self, path: str, timeout: float = 30.0) -> Any:
        status, body = self.request("GET", path, timeout=timeout)
        if status != 200:
            raise RuntimeError(f"GET {path}: {status} {body}")
        return body

    def post(self, path: str, body: Any, timeout: float = 300.0) -> tuple[int, Any]:
        return self.request("POST", path, body, timeout=timeout)

    def stop(self) -> None:
        """SIGTERM: uvicorn shuts down gracefully and the lifespan kills the workers."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()

    def kill(self) -> None:
        """SIGKILL, as a crash would: no shutdown code runs."""
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()
