"""Where a collective's time goes in a training step on a CPU its ranks share: the wait
for the group's last rank to arrive, and the transfer after it (issue 3).

The cost model prices every collective at what ``meshplan calibrate`` measures for it
between ~10 ms compute chunks (``calibrate.timed_between_compute``).  In the fidelity
bench's steps sequence parallelism's collectives cost less than that, and tensor
parallelism's all-reduces what they are priced (session 35: switched off in a step,
TP+SP's saved 17% and fsdp2 x tp2+SP's 40% below their price, TP's 2% below).  This bench tests one cause:
4 single-thread ranks on 2 cores drift apart while they compute, so a collective first
waits for its group's slowest rank, and the drift grows with the compute since the
group last met; in a step that compute differs by collective (a whole attention or MLP
block before TP's all-reduce, a norm before SP's all-gather), in the calibration it is
always one chunk.  Three tables, from one 4-rank gloo job:

1. Drift of barrier-started compute: every rank runs the same matmuls for about ``T``
   ms after a barrier; per ``T``, the slowest of the 4 ranks and the slower of each
   pair, above the ranks' mean (what a collective of the 4, or of a pair, would wait).
2. The collectives of the fidelity bench's layouts' steps (those with tensor
   parallelism: DTensor's, and FSDP2's where it shards): every rank's issue and return
   time (``time.perf_counter``: CLOCK_MONOTONIC, which the processes share), per
   collective and group: the compute segment before it (own issue less own return from
   the step's previous collective), the wait (the group's last issue less own issue)
   and the transfer (own return less the last issue), each the mean over the group's
   ranks; the medians over its runs, the drift table 1 gives for that segment
   (interpolated log-log; the pairs' column for groups of 2), and beside what it costs
   in the step (wait + transfer), what the same collective costs timed as ``meshplan
   calibrate`` times the collectives the model is fitted to (between ~10 ms chunks).
3. Per layout and step, all its collectives: the wall time in them (mean rank), their
   price as calibrated (table 2's), and what switching them off saved
   (``CollectivesSwitch``, the steps with and without taking turns, paired round by
   round, the slowest rank's step): what the step pays, which the wall time need not be
   on a machine whose ranks share cores.

c10d's collectives (FSDP2's, which it issues synchronously on a CPU: ``unshard_async_op``
is off) are waited inside the recorder, at once, so that they too end a segment.  Each
timed step follows an untimed one of the same layout, after a barrier, as in the
fidelity bench.

    python -m bench.collective_wait [--steps 6]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.costmodel_fidelity import (
    LAYOUTS,
    LOCAL,
    WORLD,
    CollectivesSwitch,
    KernelsBelowAutograd,
    _all_ranks,
    _rank_setup,
    _steps,
    _timed_round_robin,
    comm_added,
    save_all_ranks,
)
from cost_model.calibrate import _collective, compute_chunk, timed_between_compute

SEGMENTS_MS = (2, 10, 40, 160)  # table 1's compute lengths, in ~1 ms matmul chunks
TRIAL_MS = 320  # table 1 runs each length at least this long in all (and 3 times)
FUNCTIONAL = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")  # DTensor's
C10D = ("allreduce_", "_allgather_base_", "_reduce_scatter_base_")  # torch.distributed's, FSDP2's
DECOMPOSED = tuple(layout.name for layout in LAYOUTS if layout.mesh.get("tp", 1) > 1)  # with DTensor collectives

# name, group's ranks, nccl-tests size (the full buffer: an all-gather's output, a
# reduce-scatter's input) in bytes, issue s, return s
Entry = tuple[str, tuple[int, ...], int, float, float]
Key = tuple[str, int, int]  # name, group size, nccl-tests bytes
KIND = {"all_reduce": "all_reduce", "allreduce_": "all_reduce", "all_gather_into_tensor": "all_gather",
        "_allgather_base_": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
        "_reduce_scatter_base_": "reduce_scatter"}  # as calibrate names them


def _group_ranks(group: Any) -> tuple[int, ...]:
    """Global ranks of a collective's group, given as c10d's ops give it (a boxed
    ProcessGroup) or as the functional ones do (its name)."""
    if isinstance(group, str):
        group = dist.distributed_c10d._resolve_process_group(group)
    elif isinstance(group, torch.ScriptObject):
        group = dist.ProcessGroup.unbox(group)
    return tuple(dist.get_process_group_ranks(group))


class CollectiveClock(KernelsBelowAutograd):
    """Within its ``with`` block, ``record(step)`` runs ``step`` and returns each of its
    collectives as an ``Entry``: a functional collective's return is its ``wait_tensor``'s
    (DTensor waits where the result is first needed), a c10d one's its Work's, waited in
    the kernel at once."""

    OPS = (*(("_c10d_functional", name) for name in (*FUNCTIONAL, "wait_tensor")),
           *(("c10d", name) for name in C10D))

    def __init__(self) -> None:
        super().__init__()
        self._on = False
        self._log: list[list[Any]] = []
        self._pending: dict[int, list[Any]] = {}
        self._depth = 0

    def _kernel(self, ns: str, name: str, op: Any) -> Callable[..., Any]:
        after_autograd = torch._C._after_autograd_keyset

        def kernel(keyset: Any, *args: Any) -> Any:
            issued = time.perf_counter()
            self._depth += 1
            try:
                out = op.redispatch(keyset & after_autograd, *args)
            finally:
                self._depth -= 1
            if not self._on:
                return out
            if name == "wait_tensor":
                entry = self._pending.pop(args[0].data_ptr(), None)
                if entry is not None:
                    entry[4] = time.perf_counter()
            elif ns == "_c10d_functional":
                group = _group_ranks(args[-1])
                full = args[0].nbytes * (len(group) if name == "all_gather_into_tensor" else 1)
                entry = [name, group, full, issued, None]
                self._log.append(entry)
                self._pending[out.data_ptr()] = entry
            elif self._depth == 0:  # not the c10d op a functional all-reduce runs through
                out[-1].wait()
                returned = time.perf_counter()
                group, full = (args[1], args[0][0]) if name == "allreduce_" else (args[2], max(args[:2], key=torch.Tensor.numel))
                self._log.append([name, _group_ranks(group), full.nbytes, issued, returned])
            return out

        return kernel

    def record(self, step: Callable[[], object]) -> list[Entry]:
        if not self._libraries:
            raise RuntimeError("CollectiveClock.record: called outside the clock's with block")
        self._log, self._pending = [], {}
        self._on = True
        try:
            step()
        finally:
            self._on = False
        if self._pending:
            raise RuntimeError(f"CollectiveClock.record: {len(self._pending)} functional collectives never waited")
        return [tuple(e) for e in self._log]


def decompose(logs: Sequence[Sequence[Entry]]) -> dict[Key, list[tuple[float, float, float]]]:
    """Per collective (name, group size, bytes), one (segment, wait, transfer) in seconds
    per time it ran in the step and group, each the mean over the group's ranks (module
    doc).  ``logs[r]`` is rank ``r``'s record of the same step; SPMD ranks issue the same
    collectives in the same order, which this checks.  The step's first collective has no
    segment and is left out."""
    if len({len(log) for log in logs}) != 1:
        raise ValueError(f"logs: the ranks recorded {[len(log) for log in logs]} collectives")
    out: dict[Key, list[tuple[float, float, float]]] = {}
    for k in range(1, len(logs[0])):
        for group in sorted({log[k][1] for log in logs}):
            name, _, nbytes, *_ = first = logs[group[0]][k]
            if any(logs[r][k][:3] != first[:3] for r in group):  # name, group, size
                raise ValueError(f"logs: collective {k} differs between the ranks of group {group}")
            last = max(logs[r][k][3] for r in group)
            rows = [(logs[r][k][3] - logs[r][k - 1][4], last - logs[r][k][3], logs[r][k][4] - last) for r in group]
            out.setdefault((name, len(group), nbytes), []).append(
                tuple(statistics.fmean(col) for col in zip(*rows, strict=True)))
    return out


def drift_at(table: Sequence[tuple[float, float]], seconds: float) -> float:
    """Seconds of drift a compute segment of ``seconds`` accumulates, from ``table``'s
    (mean rank s, drift s) rows sorted by time: the drift's share of the segment
    interpolated log-log between rows (it falls with the segment's length), held at the
    first and last rows' shares beyond them."""
    share = [(t, d / t) for t, d in table]
    if seconds <= share[0][0]:
        return seconds * share[0][1]
    for (t0, s0), (t1, s1) in zip(share, share[1:]):
        if seconds <= t1:
            f = math.log(seconds / t0) / math.log(t1 / t0)
            return seconds * math.exp(math.log(s0) * (1 - f) + math.log(s1) * f)
    return seconds * share[-1][1]


def drift_table(per_rank: Sequence[Sequence[tuple[int, float]]], pairs: Sequence[tuple[int, int]]
                ) -> list[tuple[int, float, float, float]]:
    """Per segment length (ms asked): mean rank s, slowest rank less the mean, and the
    slower of each pair less the pair's mean (averaged over pairs), each averaged over the
    trials.  ``per_rank[r]`` holds rank ``r``'s (ms asked, s taken) per trial, in the same
    order on every rank."""
    by_length: dict[int, list[tuple[float, float, float]]] = {}
    for trial in zip(*per_rank, strict=True):
        times = [t for _, t in trial]
        mean = statistics.fmean(times)
        pair = statistics.fmean(max(times[a], times[b]) - (times[a] + times[b]) / 2 for a, b in pairs)
        by_length.setdefault(trial[0][0], []).append((mean, max(times) - mean, pair))
    return [(ms, *(statistics.fmean(col) for col in zip(*rows, strict=True))) for ms, rows in sorted(by_length.items())]


def _drift_trials(reps: int) -> list[tuple[int, float]]:
    one = compute_chunk(0.001)
    trials = []
    for _ in range(reps):
        for ms in SEGMENTS_MS:
            for _ in range(max(3, TRIAL_MS // ms)):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(ms):
                    one()
                trials.append((ms, time.perf_counter() - t0))
    return trials


def _as_calibrated(keys: Sequence[Key], repeats: int) -> dict[Key, float]:
    """Median seconds of each (name, group size, bytes) timed as ``meshplan calibrate``
    times what the model prices it from: between ~10 ms compute chunks, every group at
    once (``calibrate.timed_between_compute``)."""
    rank, chunk = dist.get_rank(), compute_chunk()
    groups = {g: dist.new_subgroups(g)[0] if g < WORLD else None for g in sorted({g for _, g, _ in keys})}
    return {(name, g, nbytes): statistics.median(timed_between_compute(
                _collective(KIND[name], nbytes, g, rank % g, groups[g]), repeats, chunk))
            for name, g, nbytes in keys}


def _worker(rank: int, init_file: str, out: str, steps: int) -> None:
    _rank_setup()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        plans = {layout.name: layout.plan().to_json() for layout in LAYOUTS if layout.name in DECOMPOSED}
        switch = CollectivesSwitch()
        steps_of = _steps(plans, switch)
        del steps_of[LOCAL]  # the plain step: no collectives
        logs: dict[str, list[list[Entry]]] = {name: [] for name in plans}
        with CollectiveClock() as clock:
            for name in plans:
                steps_of[name]()
            for _ in range(steps):
                for name in plans:
                    steps_of[name]()  # untimed, as in the fidelity bench
                    dist.barrier()
                    logs[name].append(clock.record(steps_of[name]))
        with switch:  # each layout's step and the same with its collectives off, in turns
            timed = _timed_round_robin(steps_of, 0, steps)
        mine = {(e[0], len(e[1]), e[2]) for runs in logs.values() for log in runs for e in log}
        keys = sorted(set().union(*_all_ranks(mine)))  # the same on every rank, which all time each
        save_all_ranks({"logs": logs, "timed": timed, "drift": _drift_trials(reps=3),
                        "calibrated": _as_calibrated(keys, repeats=7)}, out)
    finally:
        dist.destroy_process_group()


def _report(gathered: list[dict[str, Any]]) -> None:
    pairs = [(r, r + 1) for r in range(0, WORLD, 2)]
    table = drift_table([g["drift"] for g in gathered], pairs)
    print(f"== Drift of barrier-started compute, {WORLD} gloo ranks (1 thread each) ==")
    print("asked ms   mean rank ms   slowest of 4 - mean   slower of a pair - mean")
    for ms, mean, four, pair in table:
        print(f"{ms:>8}   {mean * 1e3:12.1f}   {four * 1e3:8.2f} ms ({four / mean:4.0%})   "
              f"{pair * 1e3:8.2f} ms ({pair / mean:4.0%})")
    calibrated = gathered[0]["calibrated"]
    print("\n== The collectives in the steps (the step's first left out): medians over their runs, ms ==")
    print("layout           collective               group     bytes  per step  segment    wait  "
          "transfer  drift at segment  in step  as calibrated  in step per step s")
    for layout, runs in gathered[0]["logs"].items():
        rows: dict[Key, list[tuple[float, float, float]]] = {}
        for s in range(len(runs)):
            for key, values in decompose([g["logs"][layout][s] for g in gathered]).items():
                rows.setdefault(key, []).extend(values)
        for (name, size, nbytes), values in sorted(rows.items(), key=lambda kv: -len(kv[1])):
            seg, wait, transfer = (statistics.median(v[i] for v in values) for i in range(3))
            drift = drift_at([(row[1], row[2 if size == WORLD else 3]) for row in table], seg)
            both = statistics.median(v[1] + v[2] for v in values)
            per_step = len(values) / len(runs) / (WORLD // size)
            total = sum(v[1] + v[2] for v in values) / len(runs) / (WORLD // size)
            print(f"{layout:<16} {name:<24} {size:>5}  {nbytes:>8}  {per_step:8.0f}  {seg * 1e3:7.2f}  "
                  f"{wait * 1e3:6.2f}  {transfer * 1e3:8.2f}  {drift * 1e3:16.2f}  {both * 1e3:7.2f}  "
                  f"{calibrated[(name, size, nbytes)] * 1e3:13.2f}  {total:18.3f}")
    print("\n== Per step, all its collectives: wall time in them (mean rank, median over steps), their "
          "price as calibrated, and what switching them off saved (slowest rank, median over paired rounds), s ==")
    print("layout           wall in collectives  as calibrated  saved when off")
    for layout, runs in gathered[0]["logs"].items():
        wall = statistics.median(statistics.fmean(sum(e[4] - e[3] for e in g["logs"][layout][s]) for g in gathered)
                                 for s in range(len(runs)))
        priced = sum(calibrated[(e[0], len(e[1]), e[2])] for e in runs[0])
        saved = statistics.median(comm_added([g["timed"] for g in gathered], layout))
        print(f"{layout:<16} {wall:19.3f}  {priced:13.3f}  {saved:14.3f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6, help="recorded steps per layout")
    args = ap.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/out.pt"
        mp.spawn(_worker, args=(f"{tmp}/init", out, args.steps), nprocs=WORLD, join=True)
        _report(torch.load(out, weights_only=False))


if __name__ == "__main__":
    main()
