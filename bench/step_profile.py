"""Where the fidelity bench's training steps spend their time, by kind of work: the
breakdown ``bench.costmodel_fidelity``'s totals cannot give.

    python -m bench.step_profile [--no-comm] [--steps 2] [--rounds 4]

The 4 ranks train the bench's Llama under each of its layouts and the plain local
reference (``bench.costmodel_fidelity._steps``), first ``--rounds`` unprofiled rounds
(the step's wall time), then ``--steps`` steps per layout under ``torch.profiler`` on every
rank at once, so each rank's profile sees the others' load.  Each profiled op's own time
on the rank's main thread goes to one column:

* ``GEMM``: ``aten::mm`` / ``addmm`` / ``bmm``; ``attn``: the fused attention kernels;
* ``aten``: every other aten op (elementwise kernels, copies, allocation, views);
* ``waits``: the main thread in DTensor's ``_c10d_functional.wait_tensor``, in the
  ``c10d`` calls (issuing them; a synchronous call's wait is plain Python, counted under
  the event around it), and in the executor's functions that wait in theirs: the loss
  averaging (``_MeanOverRanks``) and the vocabulary-parallel loss
  (``_VocabParallelCrossEntropy``, its Python included);
* ``FSDP2``: FSDP2's hooks, including the all-gathers and reductions it issues
  synchronously on a CPU (``FSDP::*``) and its copies' Python;
* ``DTensor``: DTensor's Python dispatch and redistributions (``PythonSubclass``,
  ``Redistribute``, ``_FromTorchTensor``, ...);
* ``rest``: the profiled wall time less all of the above (the model's Python, autograd's
  engine, the optimizer's loop, the profiler's own overhead).  Each column is its own
  median over ranks, so the columns need not add up to the step.

``--no-comm`` runs the ranks over torch's fake process group, whose collectives are
no-ops.  It reproduces the diagnostic session 27 ran on a lent 16-core machine
(docs/fidelity_log.md, Session 27): there the main thread of a DP rank waited ~32 ms per step in
FSDP2's gradient reductions that the model had hidden behind compute.  Seconds per step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile

from bench.costmodel_fidelity import (
    LAYOUTS,
    WORLD,
    _medians,
    _rank_setup,
    _slowest_rank,
    _steps,
    _timed_round_robin,
)

COLUMNS = ("GEMM", "attn", "aten", "waits", "FSDP2", "DTensor", "rest")
_GEMMS = {"aten::mm", "aten::addmm", "aten::bmm"}
_DTENSOR = ("PythonSubclass", "PythonDispatchMode", "Redistribute", "_Redistribute",
            "_FromTorchTensor", "_ToTorchTensor", "_ToTorchTensorBackward", "_RedistributeBackward")


def _column(name: str) -> str | None:
    if name in _GEMMS:
        return "GEMM"
    if "flash_attention" in name or "scaled_dot_product" in name:
        return "attn"
    if "c10d" in name or name in ("_MeanOverRanks", "_VocabParallelCrossEntropy"):
        return "waits"
    if name.startswith("FSDP::"):
        return "FSDP2"
    if name in _DTENSOR:
        return "DTensor"
    if name.startswith("aten::"):
        return "aten"
    return None


def _split(events: list, wall: float, steps: int) -> dict[str, float]:
    """Seconds per step in each column, from one rank's profile of ``steps`` steps."""
    main = Counter(e.thread for e in events if e.name.startswith("aten::")).most_common(1)[0][0]
    out = dict.fromkeys(COLUMNS, 0.0)
    for e in events:
        column = _column(e.name) if e.thread == main else None
        if column:
            out[column] += e.self_cpu_time_total / 1e6 / steps
    out["rest"] = wall / steps - sum(out.values())
    return out


def _worker(rank: int, plans: dict[str, str], init: str, out: str, no_comm: bool, steps: int,
            rounds: int, barrier: Any) -> None:
    """``barrier``: a ``multiprocessing`` barrier, which starts the fake group's steps on all
    ranks at once as gloo's does (the fake group's own is a no-op)."""
    _rank_setup()
    if no_comm:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", rank=rank, world_size=WORLD, store=FakeStore())
    else:
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD)
    try:
        steps_of = _steps(plans)
        times = _timed_round_robin(steps_of, 2, rounds, barrier.wait)
        split = {}
        for name, step in steps_of.items():
            barrier.wait()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                for _ in range(steps):
                    step()
                wall = time.perf_counter() - t0
            split[name] = _split(prof.events(), wall, steps)
        torch.save({"times": times, "split": split}, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--no-comm", action="store_true", help="fake process group: collectives are no-ops")
    ap.add_argument("--steps", type=int, default=2, help="profiled steps per layout")
    ap.add_argument("--rounds", type=int, default=4, help="unprofiled timed rounds before")
    args = ap.parse_args(argv)
    plans = {layout.name: layout.plan().to_json() for layout in LAYOUTS}
    print(f"start {time.strftime('%H:%M:%S UTC', time.gmtime())}; {os.cpu_count()} CPUs; "
          f"{'fake process group (no communication)' if args.no_comm else 'gloo'}, {WORLD} ranks")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r")
        mp.spawn(_worker, args=(plans, os.path.join(tmp, "init"), out, args.no_comm, args.steps,
                                args.rounds, mp.get_context("spawn").Barrier(WORLD)), nprocs=WORLD, join=True)
        ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in range(WORLD)]
    print(f"{'layout':<16}{'step s':>8} |" + "".join(f"{c:>9}" for c in COLUMNS))
    for name in ranks[0]["split"]:
        step = _medians(_slowest_rank([r["times"][name] for r in ranks]))[3]  # as the fidelity bench
        cols = [statistics.median(r["split"][name][c] for r in ranks) for c in COLUMNS]
        print(f"{name:<16}{step:>8.3f} |" + "".join(f"{v:>9.4f}" for v in cols))


if __name__ == "__main__":
    main()
