"""What one feature of a layout adds to the step, measured and predicted, side by side.

``bench.costmodel_fidelity`` compares whole steps; when a pair of layouts is ranked the
wrong way this says which part of the difference the model gets wrong.  It trains the
fidelity bench's Llama on 4 gloo ranks under layouts that differ by one feature each
(sequence parallelism on a tp dim of 2 and of 4, FSDP on a dp dim of 2, FSDP2's
reduction of the norm weights' pending gradients under SP), the steps taking turns for
``--rounds`` rounds, and prints per pair the median over rounds of the paired
difference (round ``r`` of both saw the same load) against the difference of the two
plans' predictions under ``--profile`` (what ``bench.costmodel_fidelity
--save-profile`` wrote).

``fsdp2 x tp2+SP, norm sums skipped`` is a timing probe, not a layout: FSDP2 reduces
each norm weight's pending (Partial) gradient over tp with a DTensor redistribution of
its own before its reduce-scatter; the probe skips those (its gradients are wrong) to
time what they cost.

    python -m bench.fidelity_deltas --profile /tmp/meshplan-fidelity-profile.json [--rounds 8]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.fsdp._fully_shard._fsdp_param as fsdp_param
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from bench.costmodel_fidelity import (
    WORLD,
    Layout,
    _rank_setup,
    _slowest_rank,
    _steps,
    _timed_round_robin,
    save_all_ranks,
)
from cost_model.profile import load_profile

LAYOUTS = (
    Layout("TP", {"tp": 4}), Layout("TP+SP", {"tp": 4}, sp=True),
    Layout("dp2 x tp2", {"dp": 2, "tp": 2}), Layout("dp2 x tp2+SP", {"dp": 2, "tp": 2}, sp=True),
    Layout("fsdp2 x tp2", {"dp": 2, "tp": 2}, fsdp=True),
    Layout("fsdp2 x tp2+SP", {"dp": 2, "tp": 2}, fsdp=True, sp=True),
)
SKIPPED = "fsdp2 x tp2+SP, norm sums skipped"
# (what the pair isolates, layout, layout without it)
PAIRS = (
    ("SP on tp4", "TP+SP", "TP"),
    ("SP on tp2 (replicated dp2)", "dp2 x tp2+SP", "dp2 x tp2"),
    ("SP on tp2 (FSDP dp2)", "fsdp2 x tp2+SP", "fsdp2 x tp2"),
    ("FSDP on dp2 (tp2)", "fsdp2 x tp2", "dp2 x tp2"),
    ("FSDP on dp2 (tp2+SP)", "fsdp2 x tp2+SP", "dp2 x tp2+SP"),
    ("FSDP2's norm-gradient sums", "fsdp2 x tp2+SP", SKIPPED),
    ("fidelity pair", "fsdp2 x tp2+SP", "TP+SP"),
)

_SKIP = {"on": False}
_inner = fsdp_param.FSDPParam._get_grad_inner_tensor


def _skipping(self: Any, grad: torch.Tensor) -> torch.Tensor:
    if _SKIP["on"] and isinstance(grad, DTensor):
        return grad._local_tensor
    return _inner(self, grad)


def _worker(rank: int, plans: dict[str, str], init: str, out: str, rounds: int) -> None:
    _rank_setup()
    fsdp_param.FSDPParam._get_grad_inner_tensor = _skipping
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=WORLD)
    try:
        steps = _steps(plans)
        whole = steps["fsdp2 x tp2+SP"]

        def skipped() -> list[float]:
            _SKIP["on"] = True
            try:
                return whole()
            finally:
                _SKIP["on"] = False

        steps[SKIPPED] = skipped
        save_all_ranks(_timed_round_robin(steps, 2, rounds), out)
    finally:
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", required=True, help="a profile calibrated on this machine")
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args(argv)
    profile = load_profile(args.profile)
    plans = {lay.name: lay.plan().to_json() for lay in LAYOUTS}
    predicted = {lay.name: lay.plan(profile).prediction.time.step_time_s for lay in LAYOUTS}
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(plans, f"{tmp}/init", f"{tmp}/out", args.rounds), nprocs=WORLD)
        per_rank = torch.load(Path(tmp) / "out")
    # per round, the slowest rank's step (SPMD waits for it)
    step: dict[str, list[float]] = {name: [s[3] for s in _slowest_rank([r[name] for r in per_rank])]
                                    for name in per_rank[0]}
    print(f"Fidelity Llama on {WORLD} gloo ranks, {args.rounds} rounds; profile {profile.name}")
    print(f"{'layout':<36} {'measured s':>10} {'predicted s':>11}")
    for name, ts in step.items():
        pred = predicted.get(name)
        print(f"{name:<36} {statistics.median(ts):>10.3f} {'' if pred is None else f'{pred:.3f}':>11}")
    print()
    print(f"{'what the pair isolates':<28} {'layout - without':<40} {'measured ms':>11} {'predicted ms':>12} "
          f"{'rounds +':>8}")
    for what, a, b in PAIRS:
        diffs = [x - y for x, y in zip(step[a], step[b], strict=True)]
        pred = f"{(predicted[a] - predicted[b]) * 1e3:+.0f}" if b in predicted else "not priced"
        print(f"{what:<28} {f'{a} - {b}':<40} {statistics.median(diffs) * 1e3:>+11.0f} {pred:>12} "
              f"{sum(d > 0 for d in diffs):>5}/{len(diffs)}")


if __name__ == "__main__":
    main()
