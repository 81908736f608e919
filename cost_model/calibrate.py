"""Measure this machine and write a Profile: GEMM throughput, memory bandwidth, gloo collectives.

Nothing here is fitted to end-to-end training throughput: each constant comes
from a micro-benchmark of the primitive the cost model uses it for, and the
collective constants are fitted to the very model ``cost_model.comm`` evaluates
(``t = latency + S * f(n) / busbw``), over several group sizes at once so that
the bus-bandwidth factor is tested rather than assumed.
"""

from __future__ import annotations

import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cost_model.comm import bus_factor
from cost_model.profile import COLLECTIVE_KINDS, Profile

# torch 2.13 renamed these (the old names warn); 2.11 has only the old ones.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

DEFAULT_MESSAGE_SIZES = (64 * 2**10, 2**20, 8 * 2**20, 64 * 2**20)
GEMM_SIZES = (128, 256, 512, 1024)
_REPEATS = 5


def _best_time(fn: Callable[[], object], budget_s: float = 0.15, max_runs: int = 50) -> float:
    """Fastest wall time of ``fn`` after one warm-up, within a time budget.

    The minimum, not the median: on a shared machine other processes only ever
    add time, and the profile should describe the hardware, not the load.
    """
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_runs and (len(times) < 3 or time.perf_counter() - start < budget_s):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure_gemm(dtype: torch.dtype) -> list[tuple[float, float]]:
    """(FLOPs, achieved FLOP/s) of square matmuls of GEMM_SIZES."""
    out = []
    for n in GEMM_SIZES:
        a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        flops = 2.0 * n**3
        out.append((flops, flops / _best_time(lambda a=a, b=b: a @ b)))
    return out


def measure_memory_bandwidth(nbytes: int = 64 * 2**20) -> float:
    """B/s of a large copy (read + write counted), the traffic op_time's bytes mean."""
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best_time(lambda: dst.copy_(src))


def measure_kernel_floor() -> float:
    """Seconds of the cheapest op that still runs a kernel (1-element add)."""
    a, b = torch.ones(1), torch.ones(1)
    out = torch.empty(1)
    return _best_time(lambda: torch.add(a, b, out=out), budget_s=0.05, max_runs=2000)


def _collective(kind: str, nbytes: int, world: int, rank: int) -> Callable[[], object]:
    """A closure running one ``kind`` collective of nccl-tests size ``nbytes``."""
    numel = max(world, nbytes // 4 // world * world)
    full = torch.ones(numel)
    part = torch.empty(numel // world)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(full)
    if kind == "all_gather":
        return lambda: _ALL_GATHER(full, part.fill_(1.0))
    if kind == "reduce_scatter":
        return lambda: _REDUCE_SCATTER(part, full)
    if kind == "all_to_all":
        recv = torch.empty_like(full)
        return lambda: dist.all_to_all_single(recv, full)
    recv = torch.empty_like(full)

    def ring_exchange() -> None:  # every rank sends to the next and receives from the previous
        reqs = [dist.isend(full, (rank + 1) % world), dist.irecv(recv, (rank - 1) % world)]
        for r in reqs:
            r.wait()

    return ring_exchange


def _collective_worker(
    rank: int, world: int, init_file: str, sizes: Sequence[int], out: str
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        rows = []
        for kind in COLLECTIVE_KINDS:
            for nbytes in sizes:
                fn = _collective(kind, nbytes, world, rank)
                fn()  # warm-up (connection set-up, allocation)
                times = []
                for _ in range(_REPEATS):
                    dist.barrier()
                    t0 = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t0)
                # min over repeats: interference from other processes only ever adds time
                slowest = torch.tensor([min(times)], dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # the slowest rank sets the time
                rows.append((kind, nbytes, slowest.item()))
        if rank == 0:
            Path(out).write_text("\n".join(f"{k} {n} {t!r}" for k, n, t in rows))
        dist.barrier()  # gloo: every rank must be done before the group goes away
    finally:
        dist.destroy_process_group()


def measure_collectives(world: int, sizes: Sequence[int]) -> list[tuple[str, int, float]]:
    """(kind, nccl-tests size, seconds) among ``world`` local gloo processes, one spawn."""
    with tempfile.TemporaryDirectory() as tmp:
        init, out = os.path.join(tmp, "init"), os.path.join(tmp, "out")
        mp.spawn(_collective_worker, args=(world, init, tuple(sizes), out), nprocs=world, join=True)
        rows = [line.split() for line in Path(out).read_text().splitlines()]
    return [(k, int(n), float(t)) for k, n, t in rows]


def fit_collectives(
    samples: Sequence[tuple[str, int, int, float]],
) -> tuple[float, dict[str, float], list[str]]:
    """Shared latency, per-kind busbw, and the kinds the model could not fit.

    Weighted least squares on ``t = a + S*f(n) * (1/busbw_kind)``, each row
    divided by its t so that small and large messages count alike (relative
    error); one latency for all kinds because a profile level has one.  numpy
    has the solver; no library offers this particular model.  When noise (a
    loaded machine) leaves a kind with no positive slope, its busbw falls back
    to the median ratio S*f(n)/t (as if latency were 0, erring towards
    overestimating time), and the kind is reported so the caller can say so.
    """
    kinds = [k for k in COLLECTIVE_KINDS if any(s[0] == k for s in samples)]
    latency, slopes = _weighted_fit(samples, kinds)
    unfit = [k for k in kinds if slopes[k] <= 0]
    if unfit:  # refit without them so their noise does not skew the shared latency
        kinds = [k for k in kinds if k not in unfit]
        latency, slopes = (
            _weighted_fit([s for s in samples if s[0] in kinds], kinds) if kinds else (0.0, {})
        )
    busbw = {k: 1.0 / slopes[k] for k in kinds}
    for kind in unfit:
        busbw[kind] = statistics.median(
            n * bus_factor(k, w) / t for k, w, n, t in samples if k == kind
        )
    return latency, busbw, unfit


def _weighted_fit(
    samples: Sequence[tuple[str, int, int, float]], kinds: list[str]
) -> tuple[float, dict[str, float]]:
    """(latency >= 0, seconds per bus byte per kind) minimising relative error."""
    rows = []
    for kind, world, nbytes, t in samples:
        row = [1.0] + [0.0] * len(kinds)
        row[1 + kinds.index(kind)] = nbytes * bus_factor(kind, world)
        rows.append([v / t for v in row])
    a, rhs = np.array(rows), np.ones(len(rows))
    coef = np.linalg.lstsq(a, rhs, rcond=None)[0]
    if coef[0] < 0:  # noise made the intercept negative: refit through the origin
        coef = np.concatenate([[0.0], np.linalg.lstsq(a[:, 1:], rhs, rcond=None)[0]])
    return float(coef[0]), {k: float(c) for k, c in zip(kinds, coef[1:], strict=True)}


def calibrate(
    output: Path,
    world_sizes: Sequence[int] = (2, 4),
    progress: Callable[[str], None] = print,
    message_sizes: Sequence[int] = DEFAULT_MESSAGE_SIZES,
) -> Profile:
    """Measure this machine, write its Profile JSON to ``output`` and return it."""
    if not world_sizes or any(w < 2 for w in world_sizes):
        raise ValueError(f"world_sizes: need group sizes >= 2, got {list(world_sizes)}")
    if len(message_sizes) < 2:
        raise ValueError(
            "message_sizes: need at least two sizes to separate latency from bandwidth"
        )
    progress("gemm fp32 ...")
    fp32 = measure_gemm(torch.float32)
    peaks = {"fp32": max(r for _, r in fp32)}
    progress(f"gemm fp32: {peaks['fp32'] / 1e9:.1f} GFLOP/s peak; bf16 ...")
    try:
        peaks["bf16"] = max(r for _, r in measure_gemm(torch.bfloat16))
        progress(f"gemm bf16: {peaks['bf16'] / 1e9:.1f} GFLOP/s peak")
    except RuntimeError as e:  # a CPU build without bf16 matmul kernels
        progress(f"gemm bf16: not supported here ({e}); profile will have fp32 only")
    bandwidth = measure_memory_bandwidth()
    floor = measure_kernel_floor()
    progress(f"memory: {bandwidth / 1e9:.1f} GB/s copy; kernel floor {floor * 1e6:.1f} us")
    samples = []
    for world in world_sizes:
        progress(f"gloo collectives among {world} processes, {len(message_sizes)} sizes ...")
        samples += [(k, world, n, t) for k, n, t in measure_collectives(world, message_sizes)]
    latency, busbw, unfit = fit_collectives(samples)
    if unfit:
        progress(f"warning: no bandwidth signal for {unfit} (machine busy?); used S*f(n)/t")
    error = statistics.median(
        abs(latency + n * bus_factor(k, w) / busbw[k] - t) / t for k, w, n, t in samples
    )
    progress(
        f"collectives: latency {latency * 1e6:.0f} us, busbw "
        + ", ".join(f"{k} {v / 1e9:.2f} GB/s" for k, v in busbw.items())
        + f"; median fit error {error:.0%}"
    )
    profile = Profile(
        name=Path(output).stem,
        source=(
            f"measured by `meshplan calibrate` on {platform.node()} ({platform.processor() or platform.machine()}, "
            f"{os.cpu_count()} CPUs, torch {torch.__version__}) at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: "
            f"square GEMMs {list(GEMM_SIZES)}, {len(message_sizes)} gloo message sizes "
            f"{min(message_sizes)}..{max(message_sizes)} B among {list(world_sizes)} local processes, "
            f"median relative error of the collective fit {error:.0%}"
        ),
        device_type="cpu",
        peak_flops=peaks,
        gemm_efficiency=[{"flops": f, "efficiency": min(1.0, r / peaks["fp32"])} for f, r in fp32],
        memory_bytes=psutil.virtual_memory().total,
        memory_bandwidth=bandwidth,
        memory_efficiency=1.0,  # the measured copy bandwidth is already the achievable one
        kernel_floor_s=floor,
        levels=[{"name": "loopback", "devices": None, "busbw": busbw, "latency_s": latency}],
    )
    Path(output).write_text(profile.model_dump_json(indent=2) + "\n")
    progress(f"wrote {output}")
    return profile
