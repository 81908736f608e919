"""Time of one kernel on one device: a roofline with a size-dependent GEMM efficiency."""

from __future__ import annotations

import math

import numpy as np

from cost_model.profile import Profile


def gemm_efficiency(profile: Profile, flops: float) -> float:
    """Achievable fraction of peak for a GEMM of ``flops``.

    Interpolated linearly in log10(FLOPs) because measured GEMM throughput curves
    are smooth on a log axis; clamped to the end points outside the measured range.
    """
    xs = [math.log10(p.flops) for p in profile.gemm_efficiency]
    ys = [p.efficiency for p in profile.gemm_efficiency]
    return float(np.interp(math.log10(max(flops, 1.0)), xs, ys))


def column_factor(profile: Profile, columns: float) -> float:
    """Speed of a GEMM whose output has ``columns`` columns, against the GEMM curve
    (``Profile.gemm_columns``; 1 where unmeasured or wider than its last point)."""
    points = profile.gemm_columns
    if not points or columns >= points[-1].columns:
        return 1.0
    xs = [math.log(p.columns) for p in points]
    return float(np.interp(math.log(max(columns, 1.0)), xs, [p.factor for p in points]))


def attention_efficiency(profile: Profile, head_flops: float | None) -> float | None:
    """Achievable fraction of peak for fused attention whose forward does ``head_flops``
    per (sequence, head) pair: the profile's ``attention_curve`` there (interpolated in
    log10(FLOPs) as the GEMM curve, clamped at its ends) where it has one and the op's
    figure is known, else ``attention_efficiency`` (None: the GEMM curve prices it)."""
    points = profile.attention_curve
    if not points or head_flops is None:
        return profile.attention_efficiency
    xs = [math.log10(p.head_flops) for p in points]
    return float(np.interp(math.log10(max(head_flops, 1.0)), xs, [p.efficiency for p in points]))


def peak_flops(profile: Profile, dtype: str) -> float:
    """Dense peak FLOP/s for ``dtype``; a clear error when the profile lacks it."""
    try:
        return profile.peak_flops[dtype]
    except KeyError:
        raise ValueError(
            f"peak_flops.{dtype}: profile {profile.name!r} has none, and the model computes in "
            f"{dtype} on it; it has {', '.join(sorted(profile.peak_flops))}"
        ) from None


def op_time(
    profile: Profile,
    flops: float,
    bytes_accessed: float,
    dtype: str = "bf16",
    dtensor: bool = False,
    transcendentals: float = 0.0,
    attention: bool = False,
    host_s: float | None = None,
    narrow: float = 1.0,
    bandwidth: float | None = None,
    head_flops: float | None = None,
) -> float:
    """Seconds for one eager op: the roofline of its kernel and the host time to issue it.

    On a GPU the host enqueues kernels asynchronously, so issuing overlaps the
    device's work and the op takes the longer of the two (a tiny kernel pays the
    launch floor).  On a CPU the same thread dispatches and then runs the kernel,
    so the two add up.  ``dtensor``: the operands are DTensors, whose Python-level
    dispatch (``dtensor_op_overhead_s``) adds host time per op.  ``transcendentals``:
    exp/log/tanh evaluations, a compute bound of their own where the profile has a
    ``transcendental_rate`` (a CPU evaluates exp as a polynomial of a dozen vector
    instructions: softmax runs 3x slower than a copy of the same bytes here).
    ``attention``: a fused attention kernel, at the profile's ``attention_efficiency``
    where it has one, or at its ``attention_curve`` for ``head_flops``, the op's forward
    FLOPs per (sequence, head) pair (``attention_efficiency()``).  ``narrow``: a GEMM
    kernel's speed against the curve, for outputs narrow enough to slow it
    (``column_factor`` of their column count).  ``host_s``: the
    host time of this op instead of ``kernel_floor_s`` (the planner passes
    ``node_host_s`` shares).  ``bandwidth``: the B/s this op's kernel moves its bytes at
    instead of ``memory_efficiency * memory_bandwidth`` (the optimizer's measured
    ``update_bandwidth``).
    Free ops (views, metadata: no FLOPs and no bytes) launch no kernel: they cost their
    ``host_s`` when given, else 0 (see docs/cost_model.md).
    """
    if flops < 0 or bytes_accessed < 0:
        raise ValueError(f"op_time: flops={flops} and bytes_accessed={bytes_accessed} must be >= 0")
    host = (profile.kernel_floor_s if host_s is None else host_s) + (
        profile.dtensor_op_overhead_s if dtensor else 0.0)
    if flops == 0 and bytes_accessed == 0:
        return 0.0 if host_s is None else host
    fused = attention_efficiency(profile, head_flops) if attention else None
    efficiency = fused or gemm_efficiency(profile, flops) * narrow
    compute = flops / (efficiency * peak_flops(profile, dtype)) if flops else 0.0
    if transcendentals and profile.transcendental_rate:
        compute = max(compute, transcendentals / profile.transcendental_rate)
    memory = bytes_accessed / (bandwidth or profile.memory_efficiency * profile.memory_bandwidth)
    if profile.device_type == "cpu":
        return host + max(compute, memory)
    return max(compute, memory, host)


def fresh_pages_time(nbytes: float, byte_s: float, min_bytes: int | None) -> float:
    """Seconds a new allocation of ``nbytes`` costs when it gets fresh pages from the OS:
    ``nbytes * byte_s`` from ``min_bytes`` up (a profile's ``fresh_page_byte_s`` and
    ``fresh_alloc_bytes``), 0 below, where the allocator reuses memory it holds."""
    return nbytes * byte_s if min_bytes is not None and nbytes >= min_bytes else 0.0


def matmul_flops(m: int, n: int, k: int) -> int:
    """FLOPs of an (m x k) @ (k x n) product: one multiply and one add per term."""
    return 2 * m * n * k
