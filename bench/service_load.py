"""Load test of the planner service: cached and uncached plan requests from many
concurrent clients, and /healthz latency while uncached plans are solving.

Starts a real ``meshplan serve`` on a free loopback port with a fresh database.
Every loop is bounded; nothing leaves the machine.

    python -m bench.service_load [--clients 32] [--requests 25] [--uncached 6]

Targets: 0 errors; cached p99 <= 50 ms at 32 clients; /healthz p99 <= 50 ms while
uncached plans solve.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from service.process import ServerProcess

PROFILE = "h100-sxm-80g"
CACHED = {"model": "llama-tiny", "devices": 2, "profile": PROFILE, "batch_size": 4, "seq_len": 32}


class Client:
    """One keep-alive connection, as a real client library would hold."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)

    def call(self, method: str, path: str, body: dict | None = None) -> tuple[int, float]:
        data = None if body is None else json.dumps(body)
        start = time.perf_counter()
        self.conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = self.conn.getresponse()
        resp.read()
        return resp.status, time.perf_counter() - start

    def close(self) -> None:
        self.conn.close()


def percentile(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1] if len(xs) > 1 else xs[0]


def run_clients(port: int, clients: int, jobs: list[tuple[str, str, dict | None]]) -> tuple[list[float], int, float]:
    """Spread ``jobs`` over ``clients`` threads; latencies, errors, wall time."""
    per_client = [jobs[i::clients] for i in range(clients)]

    def work(mine: list[tuple[str, str, dict | None]]) -> tuple[list[float], int]:
        client, lat, errors = Client(port), [], 0
        try:
            for method, path, body in mine:
                status, dt = client.call(method, path, body)
                lat.append(dt)
                errors += status >= 400
        finally:
            client.close()
        return lat, errors

    start = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(work, per_client))
    wall = time.perf_counter() - start
    return [x for r in results for x in r[0]], sum(r[1] for r in results), wall


def poll_health(port: int, stop: threading.Event, out: list[float], errors: list[int]) -> None:
    client = Client(port)
    try:
        while not stop.is_set() and len(out) < 100_000:
            status, dt = client.call("GET", "/healthz")
            out.append(dt)
            errors[0] += status != 200
            time.sleep(0.02)
    finally:
        client.close()


def row(name: str, lat: list[float], errors: int, wall: float) -> str:
    ms = sorted(x * 1e3 for x in lat)
    return (f"| {name:36} | {len(ms):6d} | {len(ms) / wall:8.1f} | {percentile(ms, 50):8.1f} "
            f"| {percentile(ms, 99):8.1f} | {ms[-1]:8.1f} | {errors:6d} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=25, help="cached requests per client")
    ap.add_argument("--uncached", type=int, default=6, help="distinct uncached plans")
    ap.add_argument("--uncached-clients", type=int, default=6)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp, \
            ServerProcess(Path(tmp) / "plans.db", workers=args.workers) as server:
        status, body = server.post("/v1/plans", CACHED)  # warm: workers imported, plan stored
        assert status == 201, body
        plan_id = body["id"]
        lines = ["| scenario                             | reqs   | req/s    | p50 ms   | p99 ms   | max ms   | errors |",
                 "|--------------------------------------|--------|----------|----------|----------|----------|--------|"]

        jobs = [("POST", "/v1/plans", CACHED)] * 200
        lines.append(row("cached POST /v1/plans, 1 client", *run_clients(server.port, 1, jobs)))
        jobs = [("POST", "/v1/plans", CACHED)] * (args.clients * args.requests)
        lines.append(row(f"cached POST /v1/plans, {args.clients} clients", *run_clients(server.port, args.clients, jobs)))
        jobs = [("GET", f"/v1/plans/{plan_id}", None)] * (args.clients * args.requests)
        lines.append(row(f"GET /v1/plans/{{id}}, {args.clients} clients", *run_clients(server.port, args.clients, jobs)))

        # Uncached: distinct requests (llama3-8b, different batch sizes) while /healthz is polled.
        uncached = [("POST", "/v1/plans", {"model": "llama3-8b", "devices": 8, "profile": PROFILE,
                                           "batch_size": 8 * (i + 1), "seq_len": 2048})
                    for i in range(args.uncached)]
        stop, health, health_errors = threading.Event(), [], [0]
        poller = threading.Thread(target=poll_health, args=(server.port, stop, health, health_errors))
        poller.start()
        try:
            lat, errors, wall = run_clients(server.port, args.uncached_clients, uncached)
        finally:
            stop.set()
            poller.join()
        lines.append(row(f"uncached POST, {args.uncached_clients} clients, {args.workers} workers", lat, errors, wall))
        lines.append(row("GET /healthz while solving", health, health_errors[0], wall))
    load = os.getloadavg()
    print("\n".join(lines))
    print(f"\nclients and server share this machine: {os.cpu_count()} CPUs, "
          f"load average {load[0]:.1f} / {load[1]:.1f} (1 / 5 min) at the end")


if __name__ == "__main__":
    main()
