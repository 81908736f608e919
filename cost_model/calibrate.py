"""Measure this machine and write a Profile: GEMM throughput, memory bandwidth, op
dispatch overhead, gloo collectives.

Nothing here is fitted to end-to-end training throughput: each constant comes
from a micro-benchmark of the primitive the cost model uses it for.

A CPU "device" is one rank of a local gloo job: ranks are processes with one
thread each that share the machine's cores and memory bus.  So the device
constants (GEMM FLOP/s by size, copy bandwidth, the optimizer's update bandwidth, host
time per eager op, plain and DTensor) are measured inside the spawned ranks of the
largest group size, all ranks running the same micro-benchmark at once, as they do when
they train; a single process using every core would describe a device no rank ever gets.
Collective constants are fitted per group size to the very model
``cost_model.comm`` evaluates (``t = latency + S * f(n) / busbw``), from collectives
timed as training issues them, each between compute chunks (``timed_between_compute``):
on this oversubscribed CPU a rank that blocks in a collective while the other ranks
compute must wait to be rescheduled, which costs ~1.5-2x the latency of the same
collective timed alone after a barrier (the bandwidth term is no larger).  Nothing is
measured for ``overlap_exposure``: on a CPU FSDP2 issues its all-gathers and gradient
reductions synchronously (it overlaps them with compute only through CUDA streams), so the
rank waits in each however many cores are free, and a CPU profile's exposure is 1.  Timings are
medians of repeats: on a shared machine a rank sees the typical load, not the
quietest moment.
"""

from __future__ import annotations

import faulthandler
import functools
import itertools
import math
import mmap
import os
import platform
import signal
import statistics
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from multiprocessing.queues import SimpleQueue
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement

from cost_model.comm import GLOO_STAGED, bus_factor, collective_time
from cost_model.compute import fresh_pages_time
from cost_model.memory import OPTIMIZERS, model_state_bytes
from cost_model.profile import COLLECTIVE_KINDS, Profile, shipped_profiles

# torch 2.13 renamed these (the old names warn); 2.11 has only the old ones.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

DEFAULT_MESSAGE_SIZES = (64 * 2**10, 2**20, 8 * 2**20, 64 * 2**20)
GEMM_SIZES = (64, 128, 256, 512, 1024)
# Output widths of the narrow GEMMs (a linear of 1024 tokens x 256 features to these),
# the shapes tensor parallelism cuts projections into (measure_gemm_columns).
COLUMN_SIZES = (16, 32, 64, 128, 256, 512)
# The least each memory-bound micro-benchmark spans per rank; OperandSizes raises them
# where the last-level cache is larger.
COPY_BYTES = 16 * 2**20  # a copy's source (and an exp's input piece, which stays this size)
COLD_BYTES = 64 * 2**20  # GEMM operand pool
_UPDATE_NUMEL = 2**20  # elements per parameter of the AdamW update: bytes, not dispatch
_UPDATE_TENSORS = 4  # its parameters (at least; and those of DTensor's extra per op)
# glibc's malloc serves a block from its mmap threshold with fresh pages and unmaps it on
# free; the threshold adapts upwards to freed blocks but stops at 32 MiB on 64-bit Linux
# (DEFAULT_MMAP_THRESHOLD_MAX), so from there every allocation faults its pages in anew.
FRESH_ALLOC_BYTES = 32 * 2**20
FRESH_BYTES = 64 * 2**20  # the fresh allocation measure_fresh_pages times
_REPEATS = 7
_T = TypeVar("_T")
CHUNK_S = 0.01  # compute between two blocking collectives (timed_between_compute), wall s
_MIN_TIME_S = 1e-6  # floor of a timing: the fits divide by t, noise must not make it <= 0
_TINY_TOKENS = 8  # host-time models train on so few tokens that no kernel does measurable work


def _repeats(nbytes: int) -> int:
    """Timed repeats of one collective (``timed_between_compute``): 21 below 4 MB, 7 to
    32 MB, 3 from 32 MB.

    A repeat's time is the difference of two ~50 ms compute loops, whose scheduling
    noise on a shared core is a few ms whatever the message: as large as a 64 KB-1 MB
    collective's own 4-11 ms, small beside an 8 MB one's 10-30 ms, and a 64 MB one takes
    0.1-0.3 s (up to a second each on a busy machine).  Measured here (4 ranks, 60
    repeats of each kind at 64 KB and 1 MB, 24 at 8 MB; chance that the medians of two
    disjoint sets of k repeats differ by more than 25%, resampled): at 64 KB-1 MB 13-50%
    per kind with k = 7, 2-41% with 14 and 1-38% with 21 (the fastest kinds, all-to-all
    and send/recv, the most: the 64 KB all-to-all's median moved 22% between the run's
    halves, drift that resampling counts as noise and the bench's alternating check
    does not); at 8 MB 0-6% with k = 7.  A repeat below 4 MB costs ~0.12 s, so the 14
    extra ones add ~17 s per group size."""
    if nbytes < 4 * 2**20:
        return 3 * _REPEATS
    return _REPEATS if nbytes < 32 * 2**20 else 3


def _iterations(nbytes: int) -> int:
    """Compute-then-collective iterations per timed loop (``timed_between_compute``): 4,
    2 from 32 MB.  The loop's total is divided by them, so more iterations average the
    per-iteration scheduling noise a ~5 ms collective sees; a 64 MB collective takes
    ~0.1-0.3 s, its noise is relatively small already, and 4 of them in each of 3
    repeats per kind and group size would add ~8 s to calibrate."""
    return 4 if nbytes < 32 * 2**20 else 2


def _median_time(fn: Callable[[], object], window_s: float = 0.04, windows: int = 9) -> float:
    """Seconds per call of ``fn``: calls run back to back for ``window_s``, the elapsed
    time divided by the calls, median over ``windows`` windows (after one warm-up call).

    Windows rather than single calls: a rank that shares a core is descheduled for
    whole time slices, and timing single short calls would mostly catch it while it
    runs.  A window spans several slices, so it sees the rank's share of the core.
    """
    fn()
    per_call = []
    for _ in range(windows):
        calls, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < window_s or calls == 0:
            fn()
            calls += 1
        per_call.append(elapsed / calls)
    return statistics.median(per_call)


def together(measure: Callable[[], _T]) -> _T:
    """``measure()`` started on every rank at once, then this rank's core kept busy (with
    small matmuls) until every rank has finished.

    Training keeps every rank computing; a rank that finished a micro-benchmark early and
    waited idle would hand the laggards a core of their own, and the last rank to finish
    would measure a machine no training rank ever gets (seen here: a 1024^3 GEMM at 71
    GFLOP/s in calibration, 39 in the training job minutes later).
    """
    dist.barrier()
    result = measure()
    done = dist.barrier(async_op=True)
    busy = torch.randn(128, 128)
    while not done.is_completed():
        busy @ busy
    done.wait()
    return result


_OVERHEAD_PAIRS = 7  # (DTensor, plain) pairs of 3-window medians of the AdamW step


def measure_op_overhead(world: int) -> tuple[float, float]:
    """(host s of one plain eager op, extra s per op when its operands are DTensors).

    A 1-element add runs a kernel that does no measurable work, so its time is the
    dispatch itself.  DTensor's extra (sharding propagation, unwrapping, rewrapping) is
    the difference per op (``update_ops`` of ``adam-fp32``: a mix of in-place and
    out-of-place ops like the model's) of torch's AdamW step over ``_UPDATE_TENSORS``
    sharded parameters against the same step over plain ones as large as their shards,
    so the kernels cancel: the median over ``_OVERHEAD_PAIRS`` pairs, each the DTensor
    step's median over 3 windows less the plain step's just after, so the shared
    machine's drift falls on both sides of a pair alike.

    The shards are of ``_UPDATE_NUMEL`` elements, as a model's parameters are: each op
    then streams more than a core's L2, and DTensor's Python code runs after it on cold
    caches, as it does in a training step.  Over tiny parameters (what this measured
    until session 32) the same code ran several times faster: one process here, 21 us
    per op at 4 elements, 64 at 256 K, 106-141 at 1 M; 4 ranks at once, 42-87 at 4
    elements against 122-188 at 1 M; and a 4-element op 21-25 us with nothing in
    between, 48-82 after a 1-16 MB kernel.  On a lent 16-core machine the fidelity
    bench's DP step (AdamW over FSDP2's replicated DTensors) took 103 us per op more
    than its plain step, where the tiny parameters had read 33; on the 2-core one (run
    85) this measured 180 where they had read 59, and the DP step took 162 more.  Needs
    a process group of ``world``.
    """
    a, b = torch.ones(1), torch.ones(1)
    plain = _median_time(lambda: a + b)
    mesh = init_device_mesh("cpu", (world,))
    local = _adamw_step(lambda: torch.ones(_UPDATE_NUMEL), _UPDATE_TENSORS)
    sharded = _adamw_step(lambda: distribute_tensor(torch.ones(world * _UPDATE_NUMEL), mesh, [Shard(0)]),
                          _UPDATE_TENSORS)
    extra = statistics.median(_median_time(sharded, windows=3) - _median_time(local, windows=3)
                              for _ in range(_OVERHEAD_PAIRS))
    return plain, max(0.0, extra / _adamw_ops(_UPDATE_TENSORS))


def _adamw_step(make: Callable[[], torch.Tensor], tensors: int) -> Callable[[], None]:
    """torch's AdamW step over ``tensors`` parameters made by ``make``, with gradients."""
    params = [torch.nn.Parameter(make()) for _ in range(tensors)]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)
    return torch.optim.AdamW(params, lr=1e-6).step


def _adamw_ops(tensors: int) -> int:
    """Eager ops torch's per-tensor AdamW step issues over ``tensors`` parameters."""
    return tensors * OPTIMIZERS["adam-fp32"].update_ops


_REDISTRIBUTE_CALLS = 40  # per timed loop; every rank issues the same collectives


def measure_redistribute_overhead(world: int) -> float:
    """Host s a DTensor redistribution adds to the collective it issues, per step.

    A redistribution plans its transform, runs it as an autograd function and issues the
    collective as a functional collective that it then waits on: Python on the rank's
    only thread, which ``collective_time`` (calibrated on ``torch.distributed`` calls)
    leaves out.  On a tensor of 256 x ``world`` bytes (1 KB at 4 ranks), for all-reduce
    (P -> R), all-gather (S(0) -> R) and reduce-scatter (P -> S(0)) alike, this thread's
    CPU time (``time.thread_time``: a wait costs none, gloo's own threads are not
    counted) per DTensor call minus per raw call; the mean, scaled by this rank's share
    of a core (wall over CPU time of the same DTensor code without a collective,
    R -> S(0)), to wall seconds like every other host constant.  Measured here (4 ranks on 2 cores): a DTensor all-reduce 0.8 ms of
    CPU against 0.16 for ``dist.all_reduce``; unpriced, it left the fidelity bench's
    sequence-parallel layout (~40 of them a step) predicted a quarter low.  The timed
    call is a ``from_local -> redistribute -> to_local`` round trip, the shape of an
    executor boundary; a backward step (``Redistribute.backward`` on the gradient) skips
    the two wrappers (~0.35 of the ~0.65 ms here), so charging it the same
    overestimates backward steps: an approximation, one constant for both.  Needs a
    process group of ``world``.
    """
    mesh = init_device_mesh("cpu", (world,))
    x = torch.ones(world * 64)
    ours = _round_trips(mesh, x)
    pairs = list(zip(ours, [
        lambda: dist.all_reduce(x.clone()),
        lambda: _ALL_GATHER(torch.empty(world * x.numel()), x),
        lambda: _REDUCE_SCATTER(torch.empty(x.numel() // world), x),
    ], strict=True))

    def cpu_per_call(fn: Callable[[], object]) -> float:
        fn()
        per = []
        for _ in range(_REPEATS):
            start = time.thread_time()
            for _ in range(_REDISTRIBUTE_CALLS):
                fn()
            per.append((time.thread_time() - start) / _REDISTRIBUTE_CALLS)
        return statistics.median(per)

    extra = statistics.mean(cpu_per_call(ours) - cpu_per_call(raw) for ours, raw in pairs)
    local = _round_trip(mesh, x, Replicate(), Shard(0))  # no collective: wall / CPU is the core share
    share = _median_time(local) / max(cpu_per_call(local), _MIN_TIME_S)
    return max(0.0, extra * max(1.0, share))


def _round_trip(mesh: DeviceMesh, x: torch.Tensor, src: Placement, dst: Placement) -> Callable[[], object]:
    """One executor-boundary redistribution: ``x`` in as ``src``, out as ``dst``, local."""
    return lambda: DTensor.from_local(x, mesh, [src], run_check=False).redistribute(mesh, [dst]).to_local()


def _round_trips(mesh: DeviceMesh, x: torch.Tensor) -> list[Callable[[], object]]:
    """All-reduce (P -> R), all-gather (S(0) -> R) and reduce-scatter (P -> S(0)) of ``x``."""
    return [_round_trip(mesh, x, src, dst)
            for src, dst in ((Partial(), Replicate()), (Shard(0), Replicate()), (Partial(), Shard(0)))]


def _tensor_parallel_tiny(world: int) -> dict[str, Any]:
    """llama-tiny's shape with every dim tensor parallelism splits a multiple of ``world``."""
    from planner.presets import PRESETS

    return {**PRESETS["llama-tiny"], "num_attention_heads": world, "num_key_value_heads": world,
            "hidden_size": 8 * world, "intermediate_size": 16 * world, "vocab_size": 32 * world}


@functools.cache
def _fake_mesh(world: int, names: tuple[str, ...]) -> DeviceMesh:
    """A (1, ``world``) mesh over torch's fake process group, made once per process (its
    groups live as long as the job's).  Call on every rank (it creates process groups)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers backend "fake"

    fake = dist.new_group(backend="fake")
    own = dist.new_subgroups(1, backend="fake")[0]
    return DeviceMesh.from_group([own, fake], "cpu", mesh=torch.arange(world).view(1, world),
                                 mesh_dim_names=names)


def dtensor_collectives(counts: dict[str, int]) -> int:
    """How many of a step's collectives (``CommDebugMode`` counts by op name) DTensor
    issued: its redistributions are functional collectives; FSDP2's and the
    vocabulary-parallel loss's are c10d's in-place ops (a trailing underscore)."""
    return sum(n for op, n in counts.items() if not op.endswith("_"))


def measure_dtensor_node_host(world: int) -> float:
    """Host seconds per traced graph node, forward + backward, that running a model's
    activations as DTensors adds (``executor.apply`` with a model-parallel mesh dim):
    DTensor's dispatch of every op and of its backward, and the executor's conversions
    at module boundaries.  ``measure_op_overhead``'s AdamW mix prices an optimizer's
    elementwise ops; a model's (matmuls, views, rotary embedding, the loss) cost DTensor
    about twice as much each way as that mix did over tiny parameters (132-290 us per
    node here, against 34-89 us per op): priced with that figure, the fidelity bench's
    tensor-parallel layouts ran ~40% above their predicted compute with collectives made
    no-ops.  (Over model-sized parameters the mix now reads 151-180 us per op here, on
    cold caches; this tiny Llama's kernels touch almost nothing, so whether a real
    model's nodes pay a cold-cache extra beyond this figure is not measured.)

    A tiny Llama (``_tensor_parallel_tiny``) trains on ``_TINY_TOKENS`` tokens, where no
    kernel does measurable work, under ``planner.hand_plan``'s tensor-parallel layout (no
    sequence parallelism: fewer redistributions to take off) on all ``world`` ranks, on
    a mesh over torch's fake process group: collectives are
    no-ops there, so the step is host time.  Taken off it: the plain model's step (its
    host time is ``node_host_s``), and each redistribution the step issues at the time
    of one on that mesh (a ``from_local -> redistribute -> to_local`` round trip, mean of
    the three kinds: ``dtensor_redistribute_s`` prices those).  The rest, per traced
    node that runs on DTensors: those downstream of the embedding, which the planner
    charges it on (``planner.strategies.activation_nodes``); the model's own code on
    positions and masks, a third of the tiny Llama's nodes, stays on plain tensors.
    Call on every rank (it creates process groups)."""
    from torch.distributed.tensor.debug import CommDebugMode

    import executor
    from planner import hand_plan
    from planner.presets import build_model, load_config
    from planner.schema import Plan
    from planner.strategies import activation_nodes
    from planner.tracer import layer_weight, trace

    config = _tensor_parallel_tiny(world)
    plan = hand_plan(config, world, "cpu-gloo-local", tp=world, batch_size=1,
                     seq_len=_TINY_TOKENS).model_dump()
    # DTensor's caches tell meshes apart by ranks and dim names, not by process group: a
    # fake mesh named like a real one over the same ranks (a training job's "tp") could
    # hand that mesh's ops its no-op collectives.  Names of its own keep them apart.
    for d in plan["mesh"]["dims"]:
        d["name"] = f"fake_{d['name']}"
    for d in plan["data_parallel"]:
        d["dim"] = f"fake_{d['dim']}"
    plan = Plan.model_validate(plan)
    mesh = _fake_mesh(world, plan.mesh.names)
    ids = torch.zeros(1, _TINY_TOKENS, dtype=torch.long)

    def step_of(model: torch.nn.Module) -> Callable[[], None]:
        return lambda: model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    plain = _median_time(step_of(build_model(load_config(config), "cpu").train()))
    sharded = step_of(executor.apply(plan, build_model(load_config(config), "cpu").train(), mesh=mesh))
    with warnings.catch_warnings():
        # HF outputs are dataclasses: torch warns that the executor's module backward hooks
        # see no tensor output, once per call site; harmless, and not the user's concern
        warnings.simplefilter("ignore", UserWarning)
        sharded()
        with CommDebugMode() as comm:
            sharded()
        t_sharded = _median_time(sharded)
    issued = dtensor_collectives({str(op): n for op, n in comm.get_comm_counts().items()})
    redistribute = statistics.mean(_median_time(f) for f in _round_trips(mesh[plan.mesh.names[-1]],
                                                                          torch.ones(world * 64)))
    extra = t_sharded - plain - issued * redistribute
    graph = trace(config, 1, _TINY_TOKENS)
    return max(0.0, extra / sum(layer_weight(graph, n) for n in activation_nodes(graph)))


def last_level_cache_bytes(cpus: Path = Path("/sys/devices/system/cpu")) -> int:
    """Bytes of last-level cache the CPUs this process may run on share out: each CPU's
    highest cache level (sysfs), each instance once (one per socket, or per core complex
    on AMD).  0 where sysfs does not say (not Linux)."""
    instances: dict[str, int] = {}
    for cpu in os.sched_getaffinity(0):
        caches = (cpus / f"cpu{cpu}" / "cache").glob("index*")
        try:
            level, shared, size = max(
                (int((c / "level").read_text()), (c / "shared_cpu_list").read_text().strip(),
                 (c / "size").read_text().strip()) for c in caches if (c / "type").read_text().strip() != "Instruction")
        except (OSError, ValueError):  # no sysfs cache entries here
            return 0
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        instances[f"L{level}:{shared}"] = int(size.rstrip("KMG")) * units.get(size[-1], 1)
    return sum(instances.values())


@dataclass(frozen=True)
class OperandSizes:
    """How much memory a rank's memory-bound micro-benchmarks span.

    A training step streams its parameters, gradients and optimizer states (and the other
    ranks theirs) through the last-level cache, so each step finds them in DRAM; a
    micro-benchmark whose operands, summed over the job's ranks, fit in that cache times
    the cache instead.  On the 2-core machine (32 MiB L3) the floors already overflow it;
    on a lent 16-core machine (300 MiB L3, 4 ranks) a 16 MB copy and a 64 MB GEMM pool per
    rank did not (there the plain step ran ~30% slower in the training job than calibration
    predicted; how much of that this explains is not measured yet).  So each size here is at
    least what makes the ranks together span twice the last-level cache
    (``last_level_cache_bytes``), up to an eighth of the available memory per rank (a VM
    may list every vCPU's cache as its own).  More memory comes as more operands, never
    larger ones: an eager op's output from ``FRESH_ALLOC_BYTES`` up would take fresh pages
    on every call, which the update and exp must not pay."""

    cache: int  # bytes of last-level cache they were sized for (0: sysfs did not say)
    gemm_pool: int  # bytes of GEMM operand pairs cycled through (cold_gemm_time)
    copy: int  # bytes a copy reads (and writes); exp cycles through as many in COPY_BYTES pieces
    update_tensors: int  # parameters of _UPDATE_NUMEL elements in the AdamW update (4 fp32 states each)

    @classmethod
    def for_job(cls, world: int) -> OperandSizes:
        cache = last_level_cache_bytes()
        span = min(2 * cache, psutil.virtual_memory().available // 8) // world
        return cls(cache=cache, gemm_pool=max(COLD_BYTES, span), copy=max(COPY_BYTES, span // 2),
                   update_tensors=max(_UPDATE_TENSORS, span // (16 * _UPDATE_NUMEL)))


def cold_gemm_time(m: int, k: int, n: int, dtype: torch.dtype = torch.float32,
                   pool_bytes: int = COLD_BYTES) -> float:
    """Seconds of one (m x k) @ (k x n) matmul on cold operands (``_median_time``).

    Each call takes the next pair of a pool of ``pool_bytes`` (``OperandSizes``): in a
    training step every GEMM reads activations and weights that other ops (and the other
    ranks) have since pushed out of the cache, and timing one hot pair back to back
    overstates small GEMMs (measured here, 4 ranks at once: 256 x 256 x 768 at 22
    GFLOP/s hot, 17 cold; 1024^3 alike at 21).
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    pairs = max(2, pool_bytes // ((m * k + k * n) * itemsize))
    lhs, rhs = torch.randn(pairs, m, k).to(dtype), torch.randn(pairs, k, n).to(dtype)
    turn = itertools.cycle(range(pairs))
    return _median_time(lambda: lhs[(i := next(turn))] @ rhs[i])


def measure_gemm(dtype: torch.dtype, dispatch_s: float = 0.0,
                 pool_bytes: int = COLD_BYTES) -> list[tuple[float, float]]:
    """(FLOPs, achieved FLOP/s) of square matmuls of GEMM_SIZES on cold operands.

    ``dispatch_s`` is taken off each time: the cost model adds the host time of an
    op to its kernel's roofline on a CPU, so the rate must describe the kernel alone.
    """
    out = []
    for n in GEMM_SIZES:
        flops = 2.0 * n**3
        t = together(lambda n=n: cold_gemm_time(n, n, n, dtype, pool_bytes))
        out.append((flops, flops / max(t - dispatch_s, t / 2)))
    return out


def measure_gemm_columns(square: list[tuple[float, float]], dispatch_s: float = 0.0,
                         pool_bytes: int = COLD_BYTES, tokens: int = 1024,
                         features: int = 256) -> list[tuple[int, float]]:
    """(output columns, speed against ``square``'s curve) of fp32 ``F.linear`` from
    ``features`` to each of COLUMN_SIZES on ``tokens`` rows, cold operands.

    A GEMM's speed follows its output's width, not only its FLOPs: measured here, a
    1024 x 256 -> 32 linear ran at half the rate of a 256-wide one.  ``square`` is
    measure_gemm's (FLOPs, FLOP/s), which the cost model's curve interpolates."""
    xs, ys = [math.log10(f) for f, _ in square], [r for _, r in square]
    out = []
    for n in COLUMN_SIZES:
        pairs = max(2, pool_bytes // ((tokens * features + n * features) * 4))
        x, w = torch.randn(pairs, tokens, features), torch.randn(pairs, n, features)
        turn = itertools.cycle(range(pairs))
        t = together(lambda x=x, w=w, turn=turn: _median_time(
            lambda: torch.nn.functional.linear(x[(i := next(turn))], w[i])))
        flops = 2.0 * tokens * features * n
        rate = flops / max(t - dispatch_s, t / 2)
        out.append((n, min(1.0, rate / float(np.interp(math.log10(flops), xs, ys)))))
    return out




def measure_update_bandwidth(dispatch_s: float = 0.0, tensors: int = _UPDATE_TENSORS) -> float:
    """B/s of torch's AdamW update (``adam-fp32``'s ``update_traffic`` over the step's time
    less ``dispatch_s`` per op) over ``tensors`` parameters of ``_UPDATE_NUMEL``
    elements.  Its ops are not copies: ``lerp_``, ``addcmul_`` and ``addcdiv_`` read two or
    three tensors, ``sqrt`` and ``div`` allocate their outputs; on a lent 16-core machine
    they moved 13-15 GB/s per rank where a copy moved 21.7, so pricing the update at the
    copy's bandwidth put the optimizer 30% low there; on the 2-core machine, 4 ranks at once,
    it runs 1.4-1.5x a copy's speed (its arithmetic leaves the shared memory bus less
    contended), and the copy's bandwidth put it too high."""
    step = _median_time(_adamw_step(lambda: torch.ones(_UPDATE_NUMEL), tensors))
    traffic = model_state_bytes(tensors * _UPDATE_NUMEL, "adam-fp32").update_traffic
    return traffic / max(step - _adamw_ops(tensors) * dispatch_s, step / 2)


def measure_memory_bandwidth(nbytes: int = COPY_BYTES) -> float:
    """B/s of a large copy (read + write counted), the traffic op_time's bytes mean."""
    src = torch.empty(nbytes // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_time(lambda: dst.copy_(src))


def measure_fresh_pages(nbytes: int = FRESH_BYTES) -> float:
    """s per byte that filling a newly mapped ``nbytes`` block costs over filling a reused one:
    the page faults, zeroing and unmapping of an allocation from ``FRESH_ALLOC_BYTES`` up
    (4 ranks at once here: ~1 ns/B, 0.8-1.4 measured, ~7x the fill itself).  gloo's all-gather and
    reduce-scatter allocate such a buffer per call (cost_model.comm.staging_time).

    The new block is mapped here as glibc maps one (private anonymous memory, unmapped
    after the fill), not taken from ``torch.empty``: in a process whose heap has grown
    and fragmented, malloc serves even 64 MB from a free heap chunk whose pages are
    already there.  ``bench.costmodel_fidelity``'s ranks, after their training steps,
    read 0.01 ms/MB that way where a new process read 0.85 (and their 64 MB all-gather
    took ~40 ms more than the fitted line: gloo's buffer did get fresh pages)."""
    reused = torch.empty(nbytes // 4)
    fill = _median_time(lambda: reused.fill_(1.0))

    def fresh_fill() -> None:
        with mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as block:
            torch.frombuffer(block, dtype=torch.float32).fill_(1.0)

    return max(0.0, _median_time(fresh_fill) - fill) / nbytes


def measure_transcendental_rate(nbytes: int = COPY_BYTES) -> float:
    """exp evaluations per second: ``torch.exp`` of float32 tensors of ``COPY_BYTES`` each,
    ``nbytes`` of them in turn, into a new output, as an eager op writes.  A CPU evaluates
    exp as a polynomial of a dozen vector instructions, so softmax, SiLU and the loss's
    log-softmax run at this rate rather than at the copy bandwidth (here 4 ranks at once:
    exp 0.5 G elements/s per rank, copy 1.6 G)."""
    xs = torch.randn(max(1, nbytes // COPY_BYTES), COPY_BYTES // 4)
    turn = itertools.cycle(xs)
    return xs.shape[1] / _median_time(lambda: torch.exp(next(turn)))


# batch, heads, sequence, head dim of causal blocks from a small model's to a large one's:
# the work per (sequence, head) pair grows 256-fold, the whole block's ~16-fold
ATTENTION_SHAPES = ((4, 8, 128, 32), (4, 8, 256, 64), (2, 8, 512, 64), (1, 4, 1024, 128))


def measure_attention_rates() -> list[tuple[float, float]]:
    """(forward FLOPs per (sequence, head) pair, FLOP/s) of causal
    ``scaled_dot_product_attention`` forward + backward at each of ``ATTENTION_SHAPES``
    (FLOPs counted as the tracer counts them: 4bhs^2d forward, halved for causal, twice
    that backward).  On a CPU the fused kernel works in small blocks with an exp per
    score and runs at a fraction of the GEMM rate, growing with the work per head: 4 ranks
    at once here, 8-10 GFLOP/s at sequence 128 and head dim 32, 15 at 256 and 64, 16 at
    512 and 64, 25 at 1024 and 128, against GEMMs at ~55-68; one shape's figure put the
    fidelity bench's attention (128, 32) at 1.5x its speed."""
    out = []
    for b, h, s, d in ATTENTION_SHAPES:
        q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))

        def step(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v) -> None:
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

        forward = 4.0 * b * h * s * s * d / 2
        out.append((forward / (b * h), 3 * forward / _median_time(step)))
    return out


def measure_node_host() -> float:
    """Host seconds per traced graph node, forward + backward, of eager training: the
    ``llama-tiny`` preset (hidden 32) trains on 8 tokens, where no kernel does
    measurable work, and the step time is divided by the nodes ``planner.trace`` finds
    in it (views and the loss included).  What it measures is what a 1-element add
    misses: the model's Python code, autograd's backward nodes, views and gradient
    accumulation (here ~50 us per node against ~11 us for an add forward and backward)."""
    from planner.presets import build_model, load_config
    from planner.tracer import totals, trace

    model = build_model(load_config("llama-tiny"), "cpu").train()
    ids = torch.zeros(1, _TINY_TOKENS, dtype=torch.long)

    def step() -> None:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    return _median_time(step) / totals(trace("llama-tiny", 1, _TINY_TOKENS))["nodes"]


# Two Llamas of 2 layers for FSDP2's overhead: llama-tiny (0.1 MB of weights: the fixed
# cost per unit) and this one (26 MB: the cost per byte).
_FSDP_MID = {"model_type": "llama", "vocab_size": 128, "hidden_size": 512,
             "intermediate_size": 1536, "num_hidden_layers": 2, "num_attention_heads": 8,
             "num_key_value_heads": 4, "max_position_embeddings": 128,
             "tie_word_embeddings": False}


def measure_fsdp_overhead() -> dict[str, tuple[float, float]]:
    """Per data-parallel mode, (s per unit, s per parameter byte) FSDP2 adds to a
    training step's forward + backward, as ``executor.apply`` wraps a model (each layer,
    then the root; ``replicate`` as HSDP with a size-1 shard dim).

    Each rank wraps its models on a mesh of its own process alone, so the collectives
    are trivial and what is timed is FSDP2's host work: hooks, buffer bookkeeping, and
    copies of parameters and gradients into and out of flat buffers.  Two models (tiny
    and 26 MB of weights, 3 units each) give the two constants; the step time without
    FSDP2 is taken off each.  Measured here, 4 ranks at once: replicate ~3 ms per unit +
    1.7 ms per MB, fully_shard ~2 ms + 2.5 ms per MB, as much as the compute of a small
    model's step.  Call on every rank (it creates process groups)."""
    from planner.presets import build_model, load_config

    own, rank = dist.new_subgroups(1)[0], dist.get_rank()
    meshes = {"fully_shard": DeviceMesh.from_group(own, "cpu"),
              "replicate": DeviceMesh.from_group([own, own], "cpu", mesh=torch.tensor([[rank]]),
                                                 mesh_dim_names=("replicate", "shard"))}
    ids = torch.zeros(1, 8, dtype=torch.long)

    def step_time(config: Any, mesh: Any) -> tuple[float, float, int]:
        model = build_model(load_config(config), "cpu").train()
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        units = len(model.model.layers) + 1
        if mesh is not None:
            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
        return _median_time(lambda: model(input_ids=ids, labels=ids, use_cache=False).loss.backward()), nbytes, units

    plain = [(c, *step_time(c, None)) for c in ("llama-tiny", _FSDP_MID)]
    out = {}
    for mode, mesh in meshes.items():
        (t_small, b_small, units), (t_big, b_big, _) = (
            (step_time(c, mesh)[0] - t, nbytes, units) for c, t, nbytes, units in plain)
        byte_s = max(0.0, (t_big - t_small) / (b_big - b_small))
        out[mode] = (max(0.0, (t_small - b_small * byte_s) / units), byte_s)
    return out


def measure_device(world: int, say: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Every device constant, measured by this rank while the other ranks do the same;
    ``say`` names each phase as it starts."""
    sizes = OperandSizes.for_job(world)
    say("op dispatch, plain and DTensor")
    floor, dtensor = together(lambda: measure_op_overhead(world))
    out: dict[str, Any] = {"floor": floor, "dtensor": dtensor, "operands": asdict(sizes)}
    say("GEMMs: fp32 by size, narrow outputs, bf16")
    out["fp32"] = measure_gemm(torch.float32, floor, sizes.gemm_pool)
    out["columns"] = measure_gemm_columns(out["fp32"], floor, sizes.gemm_pool)
    try:
        out["bf16"] = measure_gemm(torch.bfloat16, floor, sizes.gemm_pool)
    except RuntimeError:  # a CPU build without bf16 matmul kernels (every rank alike)
        out["bf16"] = None
    say("memory: copies, AdamW's update, fresh pages, exps")
    out["bandwidth"] = together(lambda: measure_memory_bandwidth(sizes.copy))
    out["update"] = together(lambda: measure_update_bandwidth(floor, sizes.update_tensors))
    out["fresh_pages"] = together(measure_fresh_pages)
    out["exp"] = together(lambda: measure_transcendental_rate(sizes.copy))
    say("fused attention")
    out["attention"] = together(measure_attention_rates)
    say("host time: training steps per graph node, FSDP2, DTensor redistributions and activations")
    out["node_host"] = together(measure_node_host)
    out["fsdp"] = together(measure_fsdp_overhead)
    out["redistribute"] = together(lambda: measure_redistribute_overhead(world))
    out["dtensor_node"] = together(lambda: measure_dtensor_node_host(world))
    return out


def _collective(
    kind: str, nbytes: int, world: int, rank: int, group: dist.ProcessGroup | None = None
) -> Callable[[], object]:
    """A closure running one ``kind`` collective of nccl-tests size ``nbytes`` among the
    ``world`` ranks of ``group`` (default: the whole job); ``rank`` is this rank's index in it."""
    numel = max(world, nbytes // 4 // world * world)
    full = torch.ones(numel)
    part = torch.empty(numel // world)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if kind == "all_gather":
        return lambda: _ALL_GATHER(full, part.fill_(1.0), group=group)
    if kind == "reduce_scatter":
        return lambda: _REDUCE_SCATTER(part, full, group=group)
    if kind == "all_to_all":
        recv = torch.empty_like(full)
        return lambda: dist.all_to_all_single(recv, full, group=group)
    recv = torch.empty_like(full)

    def peer(i: int) -> int:
        return i if group is None else dist.get_global_rank(group, i)

    def ring_exchange() -> None:  # every rank sends to the next and receives from the previous
        reqs = [dist.isend(full, peer((rank + 1) % world), group=group),
                dist.irecv(recv, peer((rank - 1) % world), group=group)]
        for r in reqs:
            r.wait()

    return ring_exchange


def _slowest(times: Sequence[float]) -> list[float]:
    """Each of ``times`` as the slowest rank saw it (SPMD waits for that rank)."""
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def compute_chunk(seconds: float = CHUNK_S) -> Callable[[], None]:
    """A closure doing fixed matmul work that takes about ``seconds`` of wall time on a
    rank while every rank computes: ``n`` projections of 256 tokens by a 768 x 256 weight
    (one MLP projection of the fidelity bench's model), ``n`` sized from the slowest rank's
    time per projection and so identical on every rank.  Call it on every rank."""
    a, w = torch.randn(256, 256), torch.randn(768, 256)
    one = _slowest([together(lambda: _median_time(lambda: torch.nn.functional.linear(a, w)))])[0]
    n = max(1, round(seconds / one))

    def chunk() -> None:
        for _ in range(n):
            torch.nn.functional.linear(a, w)

    return chunk


def timed_between_compute(
    fn: Callable[[], object],
    repeats: int,
    chunk: Callable[[], None] | None = None,
    iterations: int = 4,
) -> list[float]:
    """Seconds one blocking ``fn`` (a collective) adds to a loop that computes between
    collectives, as training issues them; one value per repeat, the slowest rank's (the
    same list on every rank).  Call it on every rank of the job.

    Per repeat, interleaved so load drift hits both alike, every rank times (after a
    barrier) ``iterations`` x [``chunk``] (``a``) and ``iterations`` x [``chunk``, ``fn``]
    (``b``); the collective's time is ``(slowest b - slowest a) / iterations`` (SPMD waits
    for the slowest rank), floored at ``_MIN_TIME_S``.  ``chunk`` defaults to
    ``compute_chunk()`` (sized anew: pass one to time many collectives).

    Why not the collective alone, back to back after a barrier: on an oversubscribed CPU
    (4 single-thread gloo ranks on 2 cores) a rank that blocks in a collective issued
    between compute phases gives up its core and must be rescheduled while the other
    ranks compute, so the collective costs more latency than in isolation, where every
    rank waits in it at once.  Measured here (4 ranks, ~10 ms chunks; isolated ->
    in-loop): all-reduce 64 KB 5.3 -> 7.7 ms, 1 MB 7.2 -> 10.8, 16 MB 35.5 -> 31.4;
    all-gather 4.0 -> 3.6, 4.0 -> 7.4, 17.7 -> 18.3; reduce-scatter 5.4 -> 8.2,
    6.6 -> 9.6, 57.0 -> 36.0.  The latency term is ~1.5-2x larger in the loop, the
    bandwidth term not (sometimes smaller), and training issues collectives the loop's way.
    """
    chunk = chunk or compute_chunk()
    fn()  # warm-up (connection set-up, allocation)

    def loop(with_fn: bool) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iterations):
            chunk()
            if with_fn:
                fn()
        return time.perf_counter() - t0

    alone, both = [], []
    for _ in range(repeats):
        alone.append(loop(False))
        both.append(loop(True))
    slow = _slowest(alone + both)
    return [max(_MIN_TIME_S, (b - a) / iterations)
            for a, b in zip(slow[:repeats], slow[repeats:], strict=True)]


SYNC_CHUNKS = (0, 1, 4, 12)  # compute before each synchronisation timed, in calibrate's chunks
SYNC_REPEATS = 7
# The points at no compute and at one chunk are repeated this many times as often: every
# collective's price is corrected against the one-chunk point (``sync_correction``), so
# its noise shifts all of a step's collectives alike, and their loops take a tenth of
# the longer ones' time.  With 7 repeats the one-chunk point of pairs ranged 1.4-3.0 ms
# over the fidelity bench's runs 104-109 (docs/fidelity_log.md, session 46).
SHORT_SYNC_TIMES = 4
Sync = tuple[float, float]  # the ranks' mean compute s, what the all-reduce added s


def sync_samples(chunk: Callable[[], None], groups: dict[int, dist.ProcessGroup | None], repeats: int,
                 iterations: int = 4) -> dict[int, dict[int, list[Sync]]]:
    """What a 4-byte all-reduce (synchronisation, next to no transfer) adds to a loop of
    compute as long as ``SYNC_CHUNKS`` chunks, per group size (``groups``: this rank's
    group of each size, every group at once), timed as ``timed_between_compute`` times
    the collectives the model is fitted to: per repeat, every rank times ``iterations`` x
    [compute] and ``iterations`` x [compute, all-reduce] after a barrier, and the
    all-reduce's time is the difference of the slowest rank's loops per iteration.  Only
    the compute's length varies, so at one chunk this is what the fitted constants hold.
    ``repeats`` per length, ``SHORT_SYNC_TIMES`` as many at 0 and 1 chunk, the lengths
    interleaved within each round so that load drift hits them alike.  Per repeat also
    the ranks' mean compute per iteration.  The same on every rank; call it on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def loop(chunks: int, sync: Callable[[], object] | None) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iterations):
            for _ in range(chunks):
                chunk()
            if sync is not None:
                sync()
        return time.perf_counter() - t0

    counts = {k: repeats * (SHORT_SYNC_TIMES if k <= 1 else 1) for k in SYNC_CHUNKS}
    out: dict[int, dict[int, list[Sync]]] = {}
    for g, group in groups.items():
        tiny = _collective("all_reduce", 4, g, rank % g, group)
        tiny()
        loops: dict[int, list[float]] = {k: [] for k in SYNC_CHUNKS}
        for r in range(max(counts.values())):
            for k in SYNC_CHUNKS:
                if r < counts[k]:
                    loops[k] += [loop(k, None), loop(k, tiny)]
        for k in SYNC_CHUNKS:
            own = torch.tensor(loops[k], dtype=torch.float64)
            every = [torch.zeros_like(own) for _ in range(world)]
            dist.all_gather(every, own)
            table = torch.stack(every)
            a, b = table[:, 0::2], table[:, 1::2]  # ranks x repeats
            out.setdefault(g, {})[k] = [(float(a[:, r].mean()) / iterations,
                                         float(b[:, r].max() - a[:, r].max()) / iterations) for r in range(counts[k])]
    return out


def sync_cost(samples: dict[int, dict[int, list[Sync]]]) -> list[dict[str, Any]]:
    """``Profile.sync_cost`` from ``sync_samples``' repeats (several calls' merged):
    medians per group size and length, the point at no compute at 0; ``held_s`` is the
    point at one chunk, the compute calibrate times collectives after."""
    out = []
    for g, by_k in sorted(samples.items()):
        points = [{"compute_s": 0.0 if k == 0 else statistics.median(s[0] for s in rows),
                   "added_s": max(0.0, statistics.median(s[1] for s in rows))} for k, rows in sorted(by_k.items())]
        out.append({"size": g, "held_s": points[SYNC_CHUNKS.index(1)]["added_s"], "points": points})
    return out


def collective_samples(
    size: int,
    sizes: Sequence[int],
    chunk: Callable[[], None] | None = None,
    repeats: Callable[[int], int] = _repeats,
    group: dist.ProcessGroup | None = None,
) -> dict[tuple[str, int], list[float]]:
    """Per (kind, bytes), the seconds each of ``repeats(nbytes)`` repeats adds, in groups
    of ``size`` consecutive ranks, every group at once (as the groups of a mesh dim run
    in training), each collective timed between compute chunks of ~10 ms
    (``timed_between_compute``: why, there): the slowest rank's added time,
    ``_iterations(nbytes)`` collectives per loop.  Raw repeats, so that a job can take
    them in several parts and keep the median of all (``bench.costmodel_fidelity`` spreads
    them over the minutes its steps run; it passes the ``group`` of ``size`` ranks this
    rank is in, made once, where a call without makes new ones).

    Two compute loops per repeat make this slower than timing each collective alone:
    with 4 ranks on this 2-core machine, groups of 2 and 4 at the default sizes took
    ~35 s with 7 repeats below 32 MB (~11 s alone); 2 iterations and 3 repeats from 32 MB
    (where one collective takes ~0.1-0.3 s, so its noise is relatively small) keep it
    there, and 21 repeats below 4 MB (``_repeats``: why) add ~20-35 s: ``meshplan
    calibrate`` took 134 s against 115 s with 7 (one run each, back to back)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if group is None and size != world:
        group = dist.new_subgroups(size)[0]
    chunk = chunk or compute_chunk()
    return {(kind, nbytes): timed_between_compute(_collective(kind, nbytes, size, rank % size, group),
                                                  repeats(nbytes), chunk, _iterations(nbytes))
            for kind in COLLECTIVE_KINDS for nbytes in sizes}


def collective_medians(samples: dict[tuple[str, int], list[float]]) -> list[tuple[str, int, float]]:
    """``collective_samples``' repeats as the (kind, bytes, median s) rows the fit takes."""
    return [(kind, nbytes, statistics.median(times)) for (kind, nbytes), times in samples.items()]


def measure_job(groups: Sequence[int], sizes: Sequence[int],
                say: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    """Everything ``profile_from_job`` needs, measured on every rank of the current gloo
    job (call it on all ranks): collectives in groups of each size, then every rank's
    device constants; ``say`` names each phase as it starts.  A job that trains can call
    it between steps, under the same load."""
    chunk = compute_chunk()  # sized once, the same compute between every collective
    result: dict[str, Any] = {"collectives": {}}
    for g in groups:
        say(f"collectives in groups of {g}: {len(COLLECTIVE_KINDS)} kinds x {len(sizes)} sizes")
        result["collectives"][g] = collective_medians(collective_samples(g, sizes, chunk))
    say("synchronisation after compute")
    world = dist.get_world_size()
    result["sync"] = sync_samples(chunk, {g: dist.new_subgroups(g)[0] if g < world else None for g in groups},
                                  SYNC_REPEATS)
    dist.barrier()
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, measure_device(dist.get_world_size(), say))
    result["device"] = per_rank
    return result


def _rank_worker(
    rank: int, world: int, init_file: str, groups: Sequence[int], sizes: Sequence[int], out: str,
    phases: SimpleQueue,
) -> None:
    """One rank of ``measure_ranks``' job; rank 0 puts each phase's name on ``phases`` (a
    multiprocessing queue), all ranks being in the same phase."""
    faulthandler.enable()  # a rank killed by a signal prints where it was (stderr)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's (measure_ranks), from any thread
    torch.set_num_threads(1)  # a rank is one thread, as executor-run training uses
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        result = measure_job(groups, sizes, phases.put if rank == 0 else lambda _: None)
        if rank == 0:  # complete once rank 0 has it (the last step gathered every rank's)
            torch.save(result, out + ".part")
            os.replace(out + ".part", out)
        dist.barrier()  # gloo: every rank must be done before the group goes away
    finally:
        dist.destroy_process_group()


def measure_ranks(
    world: int, groups: Sequence[int], sizes: Sequence[int],
    progress: Callable[[str], None] = print, retry: bool = True,
) -> dict[str, Any]:
    """One job of ``world`` local gloo processes: collectives in groups of each size in
    ``groups`` (all groups at once) and every rank's device constants.

    A failed rank (seen once in CI: ``terminate called without an active exception``
    from gloo's C++ side, SIGABRT, not reproduced in 31 runs here; its peers may then
    raise on the broken connection first) does not lose a finished measurement: if rank 0
    had already written the results they are used; otherwise the job runs once more
    (``retry``) and a second failure is raised.

    Each phase's name reaches ``progress`` as the ranks start it, with the seconds since
    the job started: the measurement takes minutes (~2 on 2 cores)."""
    phases = mp.get_context("spawn").SimpleQueue()
    start = time.monotonic()

    def report_phases() -> None:
        while not phases.empty():
            progress(f"  [{time.monotonic() - start:4.0f} s] {phases.get()} ...")

    with tempfile.TemporaryDirectory() as tmp:
        init, out = os.path.join(tmp, "init"), os.path.join(tmp, "out.pt")
        # the ranks inherit an ignored SIGINT from their first instruction (a spawned Python
        # leaves it ignored), so Ctrl-C is this process's alone to handle
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
        try:
            ranks = mp.spawn(_rank_worker, args=(world, init, tuple(groups), tuple(sizes), out, phases),
                             nprocs=world, join=False)
        finally:
            if main:
                signal.signal(signal.SIGINT, previous)
        try:
            while not ranks.join(timeout=0.5):
                report_phases()
            report_phases()
        except KeyboardInterrupt:
            # the ranks ignore SIGINT: one that died of it mid-collective left its peers
            # blocked in gloo, and the interpreter's exit joined them for gloo's 30-minute
            # timeout; stop them all here instead
            for p in ranks.processes:
                p.kill()
                p.join()
            raise
        except (mp.ProcessExitedException, mp.ProcessRaisedException) as e:
            why = str(e).strip().splitlines()[-1]
            if not os.path.exists(out):
                if not retry:
                    raise
                progress(f"rank {e.error_index} failed mid-measurement ({why}); measuring again ...")
                return measure_ranks(world, groups, sizes, progress, retry=False)
            progress(f"rank {e.error_index} failed ({why}) after the measurements were complete; "
                     "they are kept")
        return torch.load(out, weights_only=False)


def _device_constants(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The typical rank: the median over ranks of each measured constant."""
    def med(values: Sequence[float]) -> float:
        return statistics.median(values)

    scalars = ("floor", "dtensor", "redistribute", "bandwidth", "update", "fresh_pages", "exp",
               "node_host", "dtensor_node")
    out: dict[str, Any] = {k: med([r[k] for r in per_rank]) for k in scalars}
    out["fsdp"] = {mode: tuple(med([r["fsdp"][mode][i] for r in per_rank]) for i in range(2))
                   for mode in per_rank[0]["fsdp"]}
    for dtype in ("fp32", "bf16"):
        if any(r[dtype] is None for r in per_rank):
            continue
        sizes = [f for f, _ in per_rank[0][dtype]]
        out[dtype] = [(f, med([r[dtype][i][1] for r in per_rank])) for i, f in enumerate(sizes)]
    for curve in ("columns", "attention"):
        out[curve] = [(x, med([r[curve][i][1] for r in per_rank])) for i, (x, _) in enumerate(per_rank[0][curve])]
    return out


def fit_collectives(
    samples: Sequence[tuple[str, int, int, float]],
) -> tuple[float, dict[str, float], list[str]]:
    """Shared latency, per-kind busbw, and the kinds the model could not fit.

    Weighted least squares on ``t = a + S*f(n) * (1/busbw_kind)``, each row
    divided by its t so that small and large messages count alike (relative
    error); one latency for all kinds because a level's default has one.  numpy
    has the solver; no library offers this particular model.  When noise (a
    loaded machine) leaves a kind with no positive slope, its busbw falls back
    to the median ratio S*f(n)/t (as if latency were 0, erring towards
    overestimating time), and the kind is reported so the caller can say so.
    """
    kinds = [k for k in COLLECTIVE_KINDS if any(s[0] == k for s in samples)]
    latency, slopes = _weighted_fit(samples, kinds)
    unfit: list[str] = []
    # Refit without them so their noise does not skew the shared latency; the new
    # latency may leave another kind without a positive slope (seen in CI), so repeat.
    while bad := [k for k in kinds if slopes[k] <= 0]:
        unfit += bad
        kinds = [k for k in kinds if k not in bad]
        latency, slopes = (
            _weighted_fit([s for s in samples if s[0] in kinds], kinds) if kinds else (0.0, {})
        )
    busbw = {k: 1.0 / slopes[k] for k in kinds}
    for kind in unfit:
        busbw[kind] = statistics.median(
            n * bus_factor(k, w) / t for k, w, n, t in samples if k == kind
        )
    return latency, busbw, unfit


def fit_group(
    samples: Sequence[tuple[str, int, int, float]],
) -> tuple[dict[str, float], dict[str, float], list[str]]:
    """Per-kind latency and busbw of one group size: ``fit_collectives`` on each kind alone."""
    latency, busbw, unfit = {}, {}, []
    for kind in COLLECTIVE_KINDS:
        rows = [s for s in samples if s[0] == kind]
        if rows:
            lat, bw, bad = fit_collectives(rows)
            latency[kind], busbw[kind] = (0.0 if bad else lat), bw[kind]
            unfit += bad
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
    """Measure this machine, write its Profile JSON to ``output`` and return it.

    One job of ``max(world_sizes)`` processes measures everything: the device
    constants describe one of its ranks, and each size in ``world_sizes`` is a
    group size whose collectives run in every group of the job at once.
    """
    if Path(output).stem in shipped_profiles():  # the profile is named after the file
        raise ValueError(f"output: {Path(output).name} would name the profile {Path(output).stem!r}, a shipped "
                         "profile's name, which means that profile's numbers; choose another file name")
    if not world_sizes or any(w < 2 for w in world_sizes):
        raise ValueError(f"world_sizes: need group sizes >= 2, got {list(world_sizes)}")
    if len(message_sizes) < 2:
        raise ValueError(
            "message_sizes: need at least two sizes to separate latency from bandwidth"
        )
    ranks = max(world_sizes)
    sizes = sorted(set(world_sizes))
    if any(ranks % g for g in sizes):
        raise ValueError(f"world_sizes: every group size must divide the largest, got {sizes}")
    progress(f"{ranks} gloo processes, 1 thread each: collectives in groups of {sizes} "
             f"({len(message_sizes)} sizes), then GEMMs, copies and op dispatch in every rank at once ...")
    _note_other_load(progress, "before measuring", own=0)
    profile = profile_from_job(Path(output).stem, measure_ranks(ranks, sizes, message_sizes, progress),
                               message_sizes, progress)
    _note_other_load(progress, "at the end", own=ranks)
    Path(output).write_text(profile.model_dump_json(indent=2) + "\n")
    progress(f"wrote {output}")
    return profile


def _note_other_load(progress: Callable[[str], None], when: str, own: int) -> None:
    """Say so when other work shares the cores: the ranks measure what they get of the
    machine, so a profile calibrated beside another job describes that share (seen here:
    DTensor dispatch 10x the idle figure).  Before the job (``own`` 0) the cores' use is
    sampled for a second: the one-minute load average would still count a job that
    ended a minute ago (it warned after every earlier calibrate).  At the end that
    average is what covers the measurement, less ``own``, the load this job's ranks
    added themselves."""
    cpus = os.cpu_count() or 1
    if own:
        other = os.getloadavg()[0] - own
        seen = f"load average {other + own:.1f} on {cpus} cores {when} ({own} of it this job's ranks)"
    else:
        other = psutil.cpu_percent(interval=1.0) / 100 * cpus
        seen = f"{other:.1f} of {cpus} cores busy {when}"
    if other > cpus / 2:
        progress(f"note: {seen}: other work is running, and the profile measures the share of the "
                 "machine it leaves; calibrate an otherwise idle machine to describe the machine itself")


def profile_from_job(
    name: str,
    result: dict[str, Any],
    message_sizes: Sequence[int] = DEFAULT_MESSAGE_SIZES,
    progress: Callable[[str], None] = print,
) -> Profile:
    """The Profile a ``measure_job`` result describes: per-group collective fits, the
    typical rank's device constants."""
    sizes = sorted(result["collectives"])
    ranks = result.get("ranks", len(result["device"]))  # device may hold several rounds
    device = _device_constants(result["device"])
    samples, groups = [], []
    for g in sizes:
        # latency and busbw are fitted to the transfer alone: the staging buffer's fresh
        # pages are measured apart (measure_fresh_pages) and comm adds them back
        rows = [(k, g, n, max(_MIN_TIME_S, t - _staging(k, n, device["fresh_pages"])))
                for k, n, t in result["collectives"][g]]
        samples += rows
        latency, busbw, unfit = fit_group(rows)
        if unfit:
            progress(f"warning: no bandwidth signal for {unfit} among {g} (machine busy?); used S*f(n)/t")
        groups.append({"size": g, "latency_s": latency, "busbw": busbw})
        progress(f"  groups of {g}: " + ", ".join(
            f"{k} {latency[k] * 1e6:.0f} us + {busbw[k] / 1e9:.2f} GB/s" for k in COLLECTIVE_KINDS))
    operands = OperandSizes(**result["device"][0]["operands"])  # what the ranks measured with
    peaks = {"fp32": max(r for _, r in device["fp32"])}
    if "bf16" in device:
        peaks["bf16"] = max(r for _, r in device["bf16"])
    progress(
        f"per rank ({ranks} at once, 1 thread each): GEMM "
        + ", ".join(f"{d} {v / 1e9:.1f}" for d, v in peaks.items())
        + " GFLOP/s peak (narrow outputs: " + ", ".join(f"{n} cols x{f:.2f}" for n, f in device["columns"])
        + f"); copy {device['bandwidth'] / 1e9:.1f} GB/s, AdamW update {device['update'] / 1e9:.1f} GB/s, fresh pages "
        f"{device['fresh_pages'] * 1e9:.2f} ms/MB; exp {device['exp'] / 1e9:.2f} G/s; attention "
        + ", ".join(f"{r / 1e9:.1f}" for _, r in device["attention"]) + " GFLOP/s by work per head; "
        f"host {device['node_host'] * 1e6:.0f} us per graph node, DTensor activations "
        f"+{device['dtensor_node'] * 1e6:.0f} us; FSDP2 " + ", ".join(
            f"{m} {u * 1e3:.1f} ms/unit + {b * 1e9:.2f} ms/MB" for m, (u, b) in device["fsdp"].items())
        + f"; op dispatch "
        f"{device['floor'] * 1e6:.1f} us, DTensor +{device['dtensor'] * 1e6:.1f} us, "
        f"DTensor redistribution +{device['redistribute'] * 1e6:.0f} us"
    )
    sync = sync_cost(result["sync"]) if result.get("sync") else []
    for g in sync:
        progress(f"  synchronising groups of {g['size']} adds " + ", ".join(
            f"{p['added_s'] * 1e3:.2f} ms after {p['compute_s'] * 1e3:.1f}" for p in g["points"])
            + f" ms of compute; the collectives' prices hold {g['held_s'] * 1e3:.2f} ms")
    latency, busbw, _ = fit_collectives(samples)
    profile = Profile(
        name=name,
        source="",
        device_type="cpu",
        peak_flops=peaks,
        gemm_efficiency=[{"flops": f, "efficiency": min(1.0, r / peaks["fp32"])} for f, r in device["fp32"]],
        gemm_columns=[{"columns": n, "factor": f} for n, f in device["columns"]],
        memory_bytes=psutil.virtual_memory().total // ranks,
        memory_bandwidth=device["bandwidth"],
        memory_efficiency=1.0,  # the measured copy bandwidth is already the achievable one
        update_bandwidth=device["update"],
        fresh_page_byte_s=device["fresh_pages"],
        fresh_alloc_bytes=FRESH_ALLOC_BYTES,
        transcendental_rate=device["exp"],
        attention_curve=[{"head_flops": f, "efficiency": min(1.0, r / peaks["fp32"])} for f, r in device["attention"]],
        node_host_s=device["node_host"],
        dtensor_node_host_s=device["dtensor_node"],
        fsdp_overhead={mode: {"unit_s": u, "byte_s": b} for mode, (u, b) in device["fsdp"].items()},
        kernel_floor_s=device["floor"],
        dtensor_op_overhead_s=device["dtensor"],
        dtensor_redistribute_s=device["redistribute"],
        levels=[{"name": "loopback", "devices": None, "busbw": busbw, "latency_s": latency,
                 "groups": groups}],
        sync_cost=sync,
    )
    error = statistics.median(_relative_errors(profile, [
        (k, g, n, t) for g in sizes for k, n, t in result["collectives"][g]]))
    progress(f"collective model: median relative error {error:.0%} over {len(samples)} timings")
    profile = profile.model_copy(update={"source": (
        f"measured by `meshplan calibrate` on {platform.node()} ({platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, torch {torch.__version__}) at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"load average {os.getloadavg()[0]:.1f}: a device is one single-thread rank of a {ranks}-process "
        f"gloo job (operands sized so that the ranks together span at least twice the {operands.cache >> 20} MiB of last-level cache: GEMMs {list(GEMM_SIZES)} on a {operands.gemm_pool >> 20} MiB pool of cold operands, and 1024 x 256 linears to {list(COLUMN_SIZES)} columns against that curve, {operands.copy >> 20} MiB copies, exps over as much in {COPY_BYTES >> 20} MiB pieces, AdamW steps over {operands.update_tensors} parameters of {_UPDATE_NUMEL} elements (update_bandwidth), {FRESH_BYTES >> 20} MB fills of fresh vs reused memory (fresh pages from {FRESH_ALLOC_BYTES >> 20} MiB, glibc's mmap threshold), causal attention {list(ATTENTION_SHAPES)} forward + backward, llama-tiny training steps per traced node, plain and tensor-parallel on all ranks over a fake process group (less its redistributions), FSDP2's extra on 2-layer Llamas of 0.1 and 26 MB on one-rank meshes, 1-element adds, "
        f"AdamW steps on {_UPDATE_TENSORS} DTensor parameters of {_UPDATE_NUMEL}-element shards vs plain ones as large "
        f"(DTensor's extra per op, {_OVERHEAD_PAIRS} alternating pairs), "
        f"{256 * ranks} B DTensor redistributions vs raw collectives (thread CPU time x core share), timed in all {ranks} ranks at once, medians; memory_bytes = host RAM / {ranks}); "
        f"overlap_exposure 1, not measured: on a CPU FSDP2 issues its all-gathers and gradient reductions "
        f"synchronously (no streams), so none hides behind compute; "
        f"collectives: {len(message_sizes)} sizes {min(message_sizes)}..{max(message_sizes)} B in groups of "
        f"{sizes} ranks of that job, all groups at once, each issued between ~{CHUNK_S * 1e3:.0f} ms matmul chunks "
        f"as training issues them: per repeat (loop of {_iterations(0)} x [chunk, collective] - loop of "
        f"{_iterations(0)} x [chunk]) / {_iterations(0)} ({_iterations(2**30)} from 32 MB), each loop the slowest "
        f"rank's, median of {_repeats(0)} interleaved repeats ({_repeats(4 * 2**20)} from 4 MB, "
        f"{_repeats(32 * 2**20)} from 32 MB), "
        f"latency and busbw fitted per group size (groups) and over all sizes (level default) "
        f"to the times less the fresh pages of gloo's staging buffer; sync_cost: a 4-byte all-reduce "
        f"timed the same way between {list(SYNC_CHUNKS)} chunks, median of {SYNC_REPEATS} repeats ({SYNC_REPEATS * SHORT_SYNC_TIMES} at 0 and 1), "
        f"interleaved; "
        f"median relative error of the collective model {error:.0%}"
    )})
    return profile


def _staging(kind: str, nbytes: int, byte_s: float) -> float:
    """comm.staging_time of a calibrated CPU profile, before the profile exists."""
    return fresh_pages_time(nbytes, byte_s, FRESH_ALLOC_BYTES) if kind in GLOO_STAGED else 0.0


def _relative_errors(profile: Profile, samples: Sequence[tuple[str, int, int, float]]) -> list[float]:
    """|model - measured| / measured of every timing, through cost_model.comm itself."""
    return [abs(collective_time(profile, k, n, (w,), 0) - t) / t for k, w, n, t in samples]
