"""Measured fidelity of the cost model (issue 3): predicted vs measured step times of
hand layouts of a small Llama on 4 gloo processes, and collective micro-predictions.

    python -m bench.costmodel_fidelity [--profile PATH] [--steps 9] [--warmup 2]

Without ``--profile`` the machine is calibrated inside the run: after each third of
the timed steps the 4 ranks run calibrate's own micro-benchmarks (``collective_samples``:
gloo collectives in groups of 2 and 4, a third of the repeats each time, the median of
all kept; ``sync_samples``: what synchronising a group adds by the compute before it,
likewise; ``measure_device``: GEMMs, copies, AdamW's update, exps, attention, host time,
op dispatch, the median of the three kept), and the profile built from them
(``profile_from_job``, exactly what ``meshplan calibrate`` writes) is saved to
``--save-profile`` and used for the predictions.  On a machine shared with other jobs
the load changes within minutes; calibrating in the same job, spread over the minutes
the steps run, measures the primitives under the load the steps see.  The 4 ranks are
spawned once; inside them every layout trains the same model on the same global batch
(forward, backward, AdamW step; the layouts' steps interleaved, round-robin, so the
shared machine's load drift hits them alike, each timed step after an untimed one of the
same layout, as in a training loop) through ``executor.apply`` with the plan
``planner.hand_plan`` writes for the layout (TorchTitan's: vocabulary-parallel embedding
and head, column- then row-parallel projections, SP where asked; the executor tests
train two of them against one device).  Each layout is predicted as that plan's own
prediction under the calibrated profile (``planner.estimate``: the planner's cost
function with the placements pinned; the table says whether the plan it prices is the
one that ran), and, beside it, the same plan priced without the profile's ``sync_cost``
(every collective as calibrated, whatever the compute before it).  Nothing here adjusts
a constant.

Each layout's step is also timed with its collectives switched off (``CollectivesSwitch``:
every collective returns at once, its output filled from the rank's own input), in the
same rounds as the others: what a layout's step costs without communication, against the
predicted compute + optimizer, and, paired round by round, what communication added to
the step, against the predicted exposed communication.  DTensor's host work around each
redistribution still runs, which the model prices as communication
(``dtensor_redistribute_s``), so the table moves that share to the compute side.

Besides the strict ranking, the table lists each pair the prediction orders against the
measured medians, with the rounds in which the measured order held: the layouts' steps
take turns, so round ``r`` of each saw the same load, and a two-sided sign test over the
rounds says whether the measurement separates the two at all (with 9 rounds an order
that held in 8 does).  A swap of two layouts the rounds do not separate is a swap
within the measurement's own noise; the strict ranking is printed as well.

For diagnosis, each layout also records forward / backward / optimizer time, the CPU
seconds all ranks spend per step (``CPU s``, gloo's threads included) and the share of the
machine's cores that keeps busy (``busy``: with 4 single-thread ranks on 2 cores a step is
bound by the work of all ranks; what it adds to ``CPU s / cores`` is time with idle
cores), the collectives it issues in one step (``CommDebugMode``), and the ranks run two
communication-free references under the same contention: a plain 1-process step on
the DP local batch, and fp32 GEMMs timed as calibration times them (a square one, and the
thinnest GEMM of a TP rank), with one thread per rank.

The collective micro-predictions are checked against timings taken the way calibrate
takes the ones it fits (``collective_samples``): each collective issued between
~10 ms compute chunks, as training issues it, its time the loop's minus the compute
alone's, so a rank that blocks pays its rescheduling as in a training step.  Every kind
is checked, among all 4 ranks.  The check's repeats are held out from the fit and taken
alternately with the calibration's, repeat by repeat (twice the repeats, the even ones
fitted, the odd ones checked): until session 15 they ran once at the end, minutes after
the calibration, and the machine's drift in between (1.5x at 8-64 MB in one run) decided
whether they fell within +-25%; until session 28 they ran after the calibration's in
each part, half a minute apart, and drift in between still moved a kind's medians by up
to 40% (run 74: the 1 MB all-reduce 8.6 ms fitted, 6.2 checked).  With ``--profile`` the
run does not calibrate and every repeat is checked.
"""

from __future__ import annotations

import abc
import argparse
import math
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch._C._distributed_c10d import _create_work_from_future
from torch.distributed.tensor.debug import CommDebugMode

import executor
import planner
from cost_model.calibrate import (
    SYNC_REPEATS,
    OperandSizes,
    Sync,
    _repeats,
    cold_gemm_time,
    collective_medians,
    collective_samples,
    compute_chunk,
    dtensor_collectives,
    measure_device,
    profile_from_job,
    sync_samples,
    together,
)
from cost_model.comm import collective_time
from cost_model.compute import column_factor, gemm_efficiency
from cost_model.profile import COLLECTIVE_KINDS, load_profile
from planner.presets import build_model, load_config

WORLD = 4
BATCH, SEQ = 16, 128
# A small Llama whose step takes ~0.5-1 s on 4 ranks sharing 2 cores.  Every sharded
# dim divides by 4 (heads 8, KV heads 4, FFN 768, vocab 1024).  Its shape is chosen so
# that a ranking can be tested at all: until session 34 it had vocab 4096 and batch 8,
# and the shipped profile predicted two of its pairs within 1.5% of each other
# (dp2 x tp2 / TP, fsdp2 x tp2 + SP / TP + SP), closer than any measurement here
# separates (a pair moves by ~15% between runs minutes apart: docs/fidelity_log.md,
# session 20).  This shape came from a grid over hidden (160-512), layers (2-6), vocab
# (1024-8192), batch (4-24), sequence (64-256) and KV heads (4, 8), taking among the
# shapes whose slowest layout the shipped profile predicts within 0.8 s, the one that keeps
# the old width, depth and heads (only vocab and batch change) and predicts its closest
# pair furthest apart: 8.1% (the best shape in the grid: 8.7%).
# The choice used predictions only; what the steps measure decides whether they agree.
MODEL = {
    "model_type": "llama", "hidden_size": 256, "intermediate_size": 768,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
    "vocab_size": 1024, "max_position_embeddings": SEQ, "tie_word_embeddings": False,
}
LOCAL = "local compute"  # the communication-free reference case
RUN_PROFILE = "cpu-gloo-local"  # the profile the plans that run are written with
MESSAGE_SIZES = (64 * 2**10, 2**20, 8 * 2**20, 64 * 2**20)
GROUPS = (2, WORLD)  # the collectives' group sizes calibrated: a mesh dim of 2 or of all ranks


@dataclass(frozen=True)
class Layout:
    name: str
    mesh: dict[str, int]
    fsdp: bool = False
    sp: bool = False

    def plan(self, profile: Any = RUN_PROFILE) -> planner.Plan:
        return planner.hand_plan(MODEL, devices=WORLD, profile=profile,
                                 dp=self.mesh.get("dp", 1), tp=self.mesh.get("tp", 1),
                                 fsdp=self.fsdp, sp=self.sp, batch_size=BATCH, seq_len=SEQ)


LAYOUTS = (
    Layout("DP", {"dp": 4}),
    Layout("FSDP", {"dp": 4}, fsdp=True),
    Layout("TP", {"tp": 4}),
    Layout("TP+SP", {"tp": 4}, sp=True),
    Layout("dp2 x tp2", {"dp": 2, "tp": 2}),
    Layout("fsdp2 x tp2+SP", {"dp": 2, "tp": 2}, fsdp=True, sp=True),
)


# -- on the ranks ---------------------------------------------------------------------------

def _phases(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> list[float]:
    """One training step, as the user's loop writes it; seconds of forward, backward,
    optimizer, and the process's CPU seconds for the step (gloo's threads included)."""
    cpu = time.process_time()
    t0 = time.perf_counter()
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad()
    return [t1 - t0, t2 - t1, time.perf_counter() - t2, time.process_time() - cpu]


def _timed_round_robin(steps_of: dict[str, Callable[[], list[float]]], warmup: int, steps: int,
                       barrier: Callable[[], object] = dist.barrier) -> dict[str, list[list[float]]]:
    """Every case's step in turn, ``steps`` rounds: the load of the shared machine drifts
    over minutes, and interleaving spreads that drift over all cases alike instead of
    charging it to whichever case ran while it peaked.  Each timed step follows an untimed
    one of the same case, as a training loop's step follows its own last step, which left
    its parameters, optimizer states and allocator as that step needs them, not as the
    other cases' steps left them: a condition no training job has.  (In separate runs the
    plain step took 266-289 ms back to back, 312 interleaved with 3 other models, session
    31; its AdamW update ran 7.1-11 GB/s in its own loop, ~5.2 in the round robin,
    session 32.  The first run with this order, 86, showed no difference beyond the
    run-to-run noise.)

    ``barrier`` starts each step on every rank at once, a step with its collectives
    switched off too (nothing in it waits for the other ranks): ranks that start apart
    partly run alone.  (On a lent 16-core machine a staggered fake-group job's plain step
    took 0.11 s, the gloo job's 0.14 s, session 27.)"""
    for step in steps_of.values():
        for _ in range(warmup):
            step()
    out: dict[str, list[list[float]]] = {name: [] for name in steps_of}
    for _ in range(steps):
        for name, step in steps_of.items():
            step()  # untimed: the case's own step comes before the timed one
            barrier()  # every step starts together, so a straggler's wait is in the step
            out[name].append(step())
    return out


def _training_step(plan: str | None, ids: torch.Tensor) -> Callable[[], list[float]]:
    """The model under ``plan`` (JSON; ``None``: a plain model on the DP local batch, no
    communication: the compute a DP rank does, under the same contention) and its step."""
    executor.rng.manual_seed(1234)
    model = build_model(load_config(MODEL), device="cpu").train()
    if plan is None:
        ids = ids[: BATCH // WORLD]
    else:
        model = executor.apply(planner.Plan.from_json(plan), model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return lambda: _phases(model, opt, ids)


def _no_comm(name: str) -> str:
    return f"{name}, no comm"


def _steps(plans: dict[str, str], switch: CollectivesSwitch | None = None) -> dict[str, Callable[[], list[float]]]:
    """Every layout's training step, each followed by the same step with its collectives
    switched off where ``switch`` is given (the same model and optimizer: the values
    that step leaves differ per rank, which changes no step's work), and the local
    reference's, on the same global batch."""
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, MODEL["vocab_size"], (BATCH, SEQ), generator=g)
    steps_of = {}
    for name, plan in plans.items():
        steps_of[name] = _training_step(plan, ids)
        if switch is not None:
            steps_of[_no_comm(name)] = switch.without(steps_of[name])
    steps_of[LOCAL] = _training_step(None, ids)
    return steps_of


def _collectives_per_step(step: Callable[[], list[float]]) -> dict[str, int]:
    comm = CommDebugMode()
    with comm:
        step()
    return {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items()}


# (m, k, n) of (m x k) @ (k x n): a square GEMM like calibrate's, and the thinnest GEMM
# of a TP rank here (a KV projection shard: all tokens x hidden -> a quarter of the KV width)
_KV = MODEL["num_key_value_heads"] * MODEL["hidden_size"] // MODEL["num_attention_heads"] // WORLD
GEMM_SHAPES = {"square 1024^3": (1024, 1024, 1024),
               f"TP kv shard {BATCH * SEQ}x{MODEL['hidden_size']}x{_KV}": (BATCH * SEQ, MODEL["hidden_size"], _KV)}


def _gemm_rates() -> dict[str, float]:
    """FLOP/s of fp32 GEMMs of GEMM_SHAPES, all ranks at once, timed as calibrate times
    its square ones (``together`` + ``cold_gemm_time``): what a rank's "device" delivers
    here, square and thin, to compare with the profile's rate for that shape (the FLOPs'
    curve times the output width's factor)."""
    pool = OperandSizes.for_job(WORLD).gemm_pool
    return {name: 2.0 * m * k * n / together(lambda m=m, k=k, n=n: cold_gemm_time(m, k, n, pool_bytes=pool))
            for name, (m, k, n) in GEMM_SHAPES.items()}


def _all_ranks(value: Any) -> list[Any]:
    """``value`` of every rank, on every rank."""
    out: list[Any] = [None] * WORLD
    dist.all_gather_object(out, value)
    return out


def save_all_ranks(value: Any, out: str) -> None:
    """Every rank's ``value``, saved by rank 0 to ``out`` for the spawning process (call on
    every rank)."""
    gathered = _all_ranks(value)
    if dist.get_rank() == 0:
        torch.save(gathered, out)


def _rank_setup() -> None:
    torch.set_num_threads(1)  # 4 ranks on 2 cores: one thread each, as the executor tests run
    # HF outputs are dataclasses, so torch warns on every step that module backward hooks
    # (the executor's) see no tensor output; harmless here and it would bury the tables.
    warnings.filterwarnings("ignore", category=UserWarning)


def _fill_gathered(out: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
    """``out`` filled with ``shard`` once per rank, as an all-gather of equal shards fills it."""
    n = out.numel() // shard.numel()
    out.view(n, -1).copy_(shard.reshape(1, -1).expand(n, -1))
    return out


def _done(result: object) -> object:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(result)
    return _create_work_from_future(fut).boxed()


# What each collective the steps issue leaves when switched off: the output the
# collective's schema gives, filled from the rank's own input (c10d's in-place ops return
# their output and a completed Work; the functional ones, DTensor's, a new tensor).
_NO_OPS: dict[tuple[str, str], Callable[..., Any]] = {
    ("c10d", "allreduce_"): lambda tensors, *_: (tensors, _done(tensors)),
    ("c10d", "_allgather_base_"): lambda out, inp, *_: (_fill_gathered(out, inp), _done(out)),
    ("c10d", "_reduce_scatter_base_"): lambda out, inp, *_: (
        out.copy_(inp.reshape(-1)[: out.numel()].view_as(out)), _done(out)),
    ("_c10d_functional", "all_reduce"): lambda x, *_: x.clone(),
    ("_c10d_functional", "all_gather_into_tensor"): lambda x, n, *_: _fill_gathered(
        x.new_empty((x.shape[0] * n, *x.shape[1:])), x),
    ("_c10d_functional", "reduce_scatter_tensor"): lambda x, _op, n, *_: x[: x.shape[0] // n].clone(),
}
SWITCHABLE = {name for _, name in _NO_OPS}  # as CommDebugMode names them


_K = TypeVar("_K", bound="KernelsBelowAutograd")


class KernelsBelowAutograd(abc.ABC):
    """A ``with`` block that registers Python kernels for ``OPS`` ((namespace, name) pairs)
    at AutogradCPU, which the dispatcher reaches before gloo's CPU kernel, and removes
    them on leaving.  ``_kernel(ns, name, op)`` makes each; it is called with the dispatch
    keyset first, to redispatch below autograd."""

    OPS: ClassVar[tuple[tuple[str, str], ...]] = ()

    def __init__(self) -> None:
        self._libraries: list[torch.library.Library] = []

    def __enter__(self: _K) -> _K:
        libraries: dict[str, torch.library.Library] = {}
        for ns, name in self.OPS:
            op = getattr(getattr(torch.ops, ns), name).default
            if ns not in libraries:
                libraries[ns] = torch.library.Library(ns, "IMPL")
            libraries[ns].impl(name, self._kernel(ns, name, op), "AutogradCPU", with_keyset=True)
        self._libraries = list(libraries.values())
        return self

    def __exit__(self, *exc: object) -> None:
        for library in self._libraries:
            library._destroy()
        self._libraries.clear()

    @abc.abstractmethod
    def _kernel(self, ns: str, name: str, op: Any) -> Callable[..., Any]:
        """The kernel for ``op`` (``ns::name``)."""


class CollectivesSwitch(KernelsBelowAutograd):
    """Within its ``with`` block, a step run through ``without`` finds every collective of
    this process a no-op, while the rest communicate, so one gloo job times a layout's
    step with and without its communication in the same round, as alike as the round
    robin makes all steps.

    Until session 35 the no-communication steps ran in a second job over torch's fake
    process group, minutes after the gloo job, and the machine's drift between the two
    moved the split by tens of points from run to run (TP's compute error read -1% to
    -35% in runs 90-94).  A process has one default group and torch has no switch for
    it, so this registers a kernel for c10d's collective ops (``torch.distributed``'s API,
    FSDP2) and the functional ones (DTensor): it either redispatches below autograd, to
    gloo, or returns what ``_NO_OPS`` gives."""

    OPS = tuple(_NO_OPS)

    def __init__(self) -> None:
        super().__init__()
        self.skipping = False

    def _kernel(self, ns: str, name: str, op: Any) -> Callable[..., Any]:
        after_autograd, no_op = torch._C._after_autograd_keyset, _NO_OPS[(ns, name)]

        def kernel(keyset: Any, *args: Any) -> Any:
            return no_op(*args) if self.skipping else op.redispatch(keyset & after_autograd, *args)

        return kernel

    def without(self, step: Callable[[], list[float]]) -> Callable[[], list[float]]:
        """``step`` run with every collective switched off."""
        def run() -> list[float]:
            if not self._libraries:  # without its kernels every collective would still run
                raise RuntimeError("CollectivesSwitch.without: a step run outside the switch's with block")
            self.skipping = True
            try:
                return step()
            finally:
                self.skipping = False
        return run


def _worker(rank: int, plans: dict[str, str], init_file: str, out: str, warmup: int, steps: int,
            calibrate: bool) -> None:
    _rank_setup()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        switch = CollectivesSwitch()
        steps_of = _steps(plans, switch)
        # counted first (after a step of each: the first may set up more than a step
        # does): a kind the switch does not know would run in the no-comm steps
        for name in plans:
            steps_of[name]()
        counted = {name: _collectives_per_step(steps_of[name]) for name in plans}
        unknown = {kind for kinds in counted.values() for kind in kinds} - SWITCHABLE
        if unknown:
            raise RuntimeError(f"CollectivesSwitch cannot switch off {sorted(unknown)}")
        # calibration between the thirds of the steps, each part after one third: this
        # VM's speed drifts by 20-30% within minutes (the bench's own GEMM check has read
        # 20% below a calibration taken two minutes earlier) and the steps span all three.
        # The device constants (GEMM rate, host time per op, ...) are measured in every
        # part, the median of the three kept; the collectives' repeats are spread over the
        # parts, the median of all kept.  The collective check's repeats alternate with
        # the calibration's (below), so they are held out from the fit but see the same
        # seconds.
        chunk = compute_chunk()  # sized once, the same compute between every collective
        groups = {g: dist.new_subgroups(g)[0] if g < WORLD else None for g in GROUPS}
        parts = 3

        def share(n: int, part: int) -> int:  # part's share of n things split in parts, exactly
            return n // parts + (part < n % parts)

        thirds = [share(steps, part) for part in range(parts)]
        samples: dict[int, dict[tuple[str, int], list[float]]] = {g: {} for g in GROUPS}
        devices: list[Any] = []
        sync: dict[int, dict[int, list[Sync]]] = {}
        micro: dict[str, list[float]] = {}
        times: dict[str, list[list[float]]] = {}
        for part, n in enumerate(thirds):
            with switch:  # only around the steps: calibration times gloo as `meshplan calibrate` does
                for name, ts in _timed_round_robin(steps_of, warmup if part == 0 else 0, n).items():
                    times.setdefault(name, []).extend(ts)
            for g, group in groups.items():
                checked = g == WORLD  # the check's collectives are among all ranks
                if not (calibrate or checked):
                    continue
                # among all ranks while calibrating: twice the repeats, the even ones fitted,
                # the odd ones checked, so the two see the same seconds of the machine
                runs = 2 if calibrate and checked else 1
                taken = collective_samples(g, MESSAGE_SIZES, chunk,
                                           lambda nbytes, part=part, runs=runs: runs * share(_repeats(nbytes), part),
                                           group)
                for (kind, nbytes), ts in taken.items():
                    if calibrate:
                        samples[g].setdefault((kind, nbytes), []).extend(ts[::runs])
                    if checked:
                        micro.setdefault(f"{kind} {nbytes}", []).extend(ts[runs - 1::runs])
            if calibrate:
                for g, by_k in sync_samples(chunk, groups, share(SYNC_REPEATS, part)).items():
                    for k, rows in by_k.items():
                        sync.setdefault(g, {}).setdefault(k, []).extend(rows)
                devices += _all_ranks(measure_device(WORLD))
        job = {"collectives": {g: collective_medians(s) for g, s in samples.items()},
               "device": devices, "ranks": WORLD, "sync": sync} if calibrate else None
        result: dict[str, Any] = {"times": times, "job": job, "micro": micro}
        result["collectives"] = counted
        dist.barrier()
        result["gemm"] = _gemm_rates()
        save_all_ranks(result, out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


# -- reporting -----------------------------------------------------------------------------

def _slowest_rank(per_rank: list[list[list[float]]]) -> list[list[float]]:
    """Per step: fwd, bwd, opt of the slowest rank in each, the slowest rank's step (SPMD
    waits for it), and the CPU seconds all ranks spent on it."""
    return [[max(r[i] for r in ranks) for i in range(3)] + [max(sum(r[:3]) for r in ranks),
                                                             sum(r[3] for r in ranks)]
            for ranks in zip(*per_rank, strict=True)]


def comm_added(per_rank: list[dict[str, list[list[float]]]], name: str) -> list[float]:
    """Per round, the slowest rank's step of layout ``name`` less its step with the
    collectives switched off (``per_rank[r]``: rank ``r``'s times per case): the rounds
    pair the two, which took turns."""
    gloo, alone = (_slowest_rank([r[case] for r in per_rank]) for case in (name, _no_comm(name)))
    return [g[3] - a[3] for g, a in zip(gloo, alone, strict=True)]


def _ranks_mean(per_rank: list[list[list[float]]]) -> float:
    """The median over steps of the ranks' mean step.  Where nothing syncs the ranks (a
    step with no communication) this is what the profile's device constants, medians over
    ranks, describe; the slowest rank adds the ranks' drift apart (bench.collective_wait:
    5-10% after 0.3-0.4 s of compute, session 36)."""
    return statistics.median(statistics.fmean(sum(rank[i][:3]) for rank in per_rank)
                             for i in range(len(per_rank[0])))


def _medians(steps: list[list[float]]) -> list[float]:
    return [statistics.median(s[i] for s in steps) for i in range(5)]


def _rank_order(values: list[float]) -> list[int]:
    return sorted(range(len(values)), key=values.__getitem__)


def _spearman(a: list[float], b: list[float]) -> float:
    ra, rb = _rank_order(a), _rank_order(b)
    pos_a = {v: i for i, v in enumerate(ra)}
    pos_b = {v: i for i, v in enumerate(rb)}
    n = len(a)
    d2 = sum((pos_a[i] - pos_b[i]) ** 2 for i in range(n))
    return 1 - 6 * d2 / (n * (n * n - 1))


def _separated(a: list[float], b: list[float], alpha: float = 0.05) -> tuple[int, bool]:
    """(rounds in which ``a``'s step was faster than ``b``'s, whether the rounds order the
    two at all: a two-sided sign test at ``alpha``).  The layouts' steps take turns, so
    round ``r`` of each saw the same load: the rounds pair them.  With 9 rounds 8 of 9
    passes (p = 20/512); 7 of 9 is p = 0.18.  With 6 only a unanimous order would."""
    n, k = len(a), sum(x < y for x, y in zip(a, b, strict=True))
    tail = sum(math.comb(n, i) for i in range(max(k, n - k), n + 1)) / 2**n
    return k, 2 * tail < alpha


def _discordant(names: list[str], steps: list[list[float]], measured: list[float],
                predicted: list[float]) -> list[tuple[str, bool]]:
    """(description, separated by the rounds) of each pair the prediction orders against
    the measured medians."""
    out = []
    for i in range(len(names)):
        for j in range(len(names)):
            if measured[i] < measured[j] and predicted[i] > predicted[j]:
                k, sep = _separated(steps[i], steps[j])
                out.append((f"{names[i]} < {names[j]} measured ({measured[j] / measured[i] - 1:.0%} "
                            f"apart, faster in {k} of {len(steps[i])} rounds), predicted the other "
                            f"way", sep))
    return out


def _load() -> str:
    return " ".join(f"{v:.2f}" for v in os.getloadavg())


def _same_plan(a: planner.Plan, b: planner.Plan) -> bool:
    """Whether two plans run alike (their predictions and solver statistics aside)."""
    keep = {"mesh", "parameters", "modules", "data_parallel", "pipeline", "microbatches",
            "activation_checkpointing"}
    return a.model_dump(include=keep) == b.model_dump(include=keep)


def _step_table(results: list[dict], priced: dict[str, planner.Plan], ran: dict[str, str],
                profile: dict, as_calibrated: dict[str, planner.Plan]) -> None:
    m = MODEL
    print(f"\n== Step time: Llama h{m['hidden_size']} L{m['num_hidden_layers']} heads "
          f"{m['num_attention_heads']}/{m['num_key_value_heads']} ffn {m['intermediate_size']} "
          f"vocab {m['vocab_size']}, batch {BATCH} x seq {SEQ}, "
          f"{WORLD} gloo ranks, forward+backward+AdamW ==")
    print(f"{'layout':<16}{'measured s':>11}{'min s':>7}{'predicted s':>12}{'error':>8}   "
          f"{'fwd':>6}{'bwd':>6}{'opt':>6}{'CPU s':>7}{'busy':>6} | {'pred compute':>12}{'exp comm':>9}"
          f"{'opt':>7}   collectives/step")
    cores = os.cpu_count() or 1
    measured, fastest, predicted, per_round = [], [], [], []
    for layout in LAYOUTS:
        steps = _slowest_rank([r["times"][layout.name] for r in results])
        fwd, bwd, opt, step, cpu = _medians(steps)
        t = priced[layout.name].prediction.time
        measured.append(step)
        per_round.append([s[3] for s in steps])
        fastest.append(min(s[3] for s in steps))
        predicted.append(t.step_time_s)
        colls = ", ".join(f"{k} {v}" for k, v in sorted(results[0]["collectives"][layout.name].items()))
        print(f"{layout.name:<16}{step:>11.3f}{fastest[-1]:>7.3f}{t.step_time_s:>12.3f}{(t.step_time_s - step) / step:>+8.0%}   "
              f"{fwd:>6.3f}{bwd:>6.3f}{opt:>6.3f}{cpu:>7.3f}{cpu / step / cores:>6.0%} | "
              f"{t.compute_s:>12.3f}{t.exposed_communication_s:>9.3f}"
              f"{t.optimizer_s:>7.3f}   {colls}")
    mape = statistics.mean(abs(p - m) / m for p, m in zip(predicted, measured, strict=True))
    names = [lay.name for lay in LAYOUTS]
    same = _rank_order(measured) == _rank_order(predicted)
    mape_min = statistics.mean(abs(p - m) / m for p, m in zip(predicted, fastest, strict=True))
    print(f"MAPE {mape:.0%} (target <= 20%; against the fastest step: {mape_min:.0%}); Spearman rho {_spearman(measured, predicted):+.2f}; "
          f"identical ranking: {same}")
    print("  measured order : " + " < ".join(names[i] for i in _rank_order(measured)))
    print("  predicted order: " + " < ".join(names[i] for i in _rank_order(predicted)))
    differ = [n for n in names if not _same_plan(priced[n], planner.Plan.from_json(ran[n]))]
    print("  the plans priced are the plans that ran" if not differ else
          f"  under the calibrated profile the planner writes other placements for {differ} "
          f"than those that ran ({RUN_PROFILE}'s); predicted: the calibrated profile's")
    swapped = _discordant(names, per_round, measured, predicted)
    for text, sep in swapped:
        print(f"  {text}: {'separated' if sep else 'not separated'} by the rounds (sign test, 5%)")
    print(f"  identical ranking up to pairs the rounds do not separate: {not any(sep for _, sep in swapped)}")
    # the same plans priced without sync_cost (every collective as calibrated, whatever
    # the compute before it): the model before session 42, on the same measurements
    flat = [as_calibrated[n].prediction.time.step_time_s for n in names]
    print(f"  without sync_cost: MAPE {statistics.mean(abs(p - m) / m for p, m in zip(flat, measured, strict=True)):.0%}; "
          f"Spearman rho {_spearman(measured, flat):+.2f}; identical ranking: {_rank_order(measured) == _rank_order(flat)}; "
          "predicted " + ", ".join(f"{n} {t:.3f}" for n, t in zip(names, flat, strict=True)))
    flat_swapped = _discordant(names, per_round, measured, flat)
    print(f"  without sync_cost, identical up to pairs the rounds do not separate: "
          f"{not any(sep for _, sep in flat_swapped)}")

    per_rank = [r["times"][LOCAL] for r in results]
    fwd, bwd, opt, step, _ = _medians(_slowest_rank(per_rank))
    mean = _ranks_mean(per_rank)
    # the same plain model on one device (no FSDP2, no DTensor), under the ranks' profile
    plain = planner.estimate(MODEL, devices=1, profile=profile, dp=1, batch_size=BATCH // WORLD,
                             seq_len=SEQ).time
    print(f"\nCompute check, no communication: a plain 1-process step on the DP local batch "
          f"({BATCH // WORLD} x {SEQ}) on all {WORLD} ranks at once: measured {step:.3f} s, the slowest "
          f"rank's (fwd {fwd:.3f}, bwd {bwd:.3f}, opt {opt:.3f}), the ranks' mean {mean:.3f} s; predicted "
          f"{plain.step_time_s:.3f} s (compute {plain.compute_s:.3f}, optimizer {plain.optimizer_s:.3f}), "
          f"{plain.step_time_s / step - 1:+.0%} ({plain.step_time_s / mean - 1:+.0%} against the mean)")
    prof = load_profile(profile)
    for name, (m, k, n) in GEMM_SHAPES.items():
        flops = 2.0 * m * k * n
        rate = gemm_efficiency(prof, flops) * column_factor(prof, n) * prof.peak_flops["fp32"]
        rates = [res["gemm"][name] for res in results]
        print(f"GEMM fp32 {name}: the profile's rate {rate / 1e9:.1f} GFLOP/s per rank; measured now "
              f"in the {WORLD} ranks at once (1 thread each): median rank {statistics.median(rates) / 1e9:.1f}, "
              f"fastest {max(rates) / 1e9:.1f} GFLOP/s")


def _no_comm_table(results: list[dict], predicted: dict[str, planner.Plan], profile: dict) -> None:
    """Each layout's step with its collectives switched off against the predicted compute +
    optimizer, and what communication added to the step (the gloo step less the no-comm
    one, round by round) against the predicted exposed communication."""
    rounds = len(results[0]["times"][LOCAL])
    print(f"\n== Without communication: each layout's step with its collectives switched off, in the "
          f"same {rounds} rounds ==")
    print("predicted: compute + optimizer + DTensor's host time around each collective it issues "
          "(dtensor_redistribute_s x the step's DTensor collectives), which runs with the collectives "
          "off too; the model counts it as communication")
    print("no-comm s is the slowest rank's, as every step here; mean is the ranks' mean, which nothing "
          "syncs in these steps")
    print(f"{'layout':<16}{'no-comm s':>10}{'mean':>7}{'predicted':>10}{'error':>8}{'vs mean':>8}   "
          f"{'gloo - no-comm':>15}{'predicted':>10}{'error':>8}   rounds' gloo - no-comm, min..max")
    print(f"{'':<16}{'(compute and host)':>43}   {'(communication added, exposed)':>33}")
    for layout in LAYOUTS:
        t = predicted[layout.name].prediction.time
        per_rank = [r["times"][_no_comm(layout.name)] for r in results]
        alone, mean = _slowest_rank(per_rank), _ranks_mean(per_rank)
        added = comm_added([r["times"] for r in results], layout.name)
        issued = dtensor_collectives(results[0]["collectives"][layout.name])
        host = issued * profile["dtensor_redistribute_s"]
        compute = t.compute_s + t.optimizer_s + host
        step, comm = _medians(alone)[3], statistics.median(added)
        print(f"{layout.name:<16}{step:>10.3f}{mean:>7.3f}{compute:>10.3f}{compute / step - 1:>+8.0%}"
              f"{compute / mean - 1:>+8.0%}   "
              f"{comm:>15.3f}{t.exposed_communication_s - host:>10.3f}"
              f"{(t.exposed_communication_s - host - comm) / max(comm, 1e-3):>+8.0%}   "
              f"{min(added):.3f}..{max(added):.3f}")


def _collective_table(results: list[dict], profile: dict) -> None:
    """The check's medians against the profile, beside the calibration's own medians where
    the run calibrated (``fit ms``: the same collective, its repeats alternating with the
    check's): the fit's miss on those is the model's, the rest the repeats' noise."""
    prof = load_profile(profile)
    job = results[0]["job"]
    fitted = {(k, n): t for k, n, t in job["collectives"][WORLD]} if job else {}
    print(f"\n== Collectives among {WORLD} gloo processes, each between ~10 ms compute chunks "
          f"(time added to the compute): median over repeats of the slowest rank ==")
    print(f"{'kind':<16}{'size':>8}{'measured ms':>13}{'min ms':>9}{'fit ms':>9}{'predicted ms':>14}"
          f"{'error':>8}{'vs min':>8}")
    errors = []
    for kind in COLLECTIVE_KINDS:
        for nbytes in MESSAGE_SIZES:
            per_rank = [r["micro"][f"{kind} {nbytes}"] for r in results]
            slowest = [max(ts) for ts in zip(*per_rank, strict=True)]  # already alike on every rank
            measured = statistics.median(slowest)
            predicted = collective_time(prof, kind, nbytes, (WORLD,), 0)
            err = (predicted - measured) / measured
            errors.append(abs(err))
            size = f"{nbytes // 2**20} MB" if nbytes >= 2**20 else f"{nbytes // 2**10} KB"
            fit = f"{fitted[kind, nbytes] * 1e3:>9.2f}" if (kind, nbytes) in fitted else f"{'-':>9}"
            flag = "" if abs(err) <= 0.25 else "  outside +-25%"
            # a repeat whose loop with the collective ran no slower than without is floored
            # at _MIN_TIME_S: no ratio against it
            vs_min = f"{predicted / min(slowest) - 1:>+8.0%}" if min(slowest) > 1e-5 else f"{'-':>8}"
            print(f"{kind:<16}{size:>8}{measured * 1e3:>13.2f}{min(slowest) * 1e3:>9.2f}{fit}"
                  f"{predicted * 1e3:>14.2f}{err:>+8.0%}{vs_min}{flag}")
    inside = sum(e <= 0.25 for e in errors)
    print(f"{inside}/{len(errors)} within +-25%; median |error| {statistics.median(errors):.0%}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", type=Path, help="use this profile JSON instead of calibrating in the run")
    ap.add_argument("--save-profile", type=Path, default=Path(tempfile.gettempdir()) / "meshplan-fidelity-profile.json",
                    help="where the calibration writes the profile (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=9, help="timed steps per layout (the rounds)")
    args = ap.parse_args(argv)
    sys.stdout.reconfigure(line_buffering=True)  # each table as it is done, also through a pipe
    print(f"start {time.strftime('%H:%M:%S UTC', time.gmtime())}; load average {_load()} "
          f"({os.cpu_count()} CPUs)")
    plans = {layout.name: layout.plan().to_json() for layout in LAYOUTS}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.pt")
        mp.spawn(_worker, args=(plans, os.path.join(tmp, "init"), out, args.warmup, args.steps,
                                args.profile is None), nprocs=WORLD, join=True)
        results = torch.load(out, weights_only=False)
        print(f"gloo phase done {time.strftime('%H:%M:%S UTC', time.gmtime())}")
        if args.profile is None:
            measured = profile_from_job(args.save_profile.stem, results[0]["job"], MESSAGE_SIZES)
            args.save_profile.write_text(measured.model_dump_json(indent=2) + "\n")
            args.profile = args.save_profile
        profile = load_profile(args.profile).model_dump()
        print(f"profile: {args.profile} ({profile['source']})")
        predicted = {layout.name: layout.plan(profile) for layout in LAYOUTS}
        as_calibrated = {layout.name: layout.plan(dict(profile, sync_cost=[])) for layout in LAYOUTS}
        _step_table(results, predicted, plans, profile, as_calibrated)
        _collective_table(results, profile)
    _no_comm_table(results, predicted, profile)
    print(f"\nend {time.strftime('%H:%M:%S UTC', time.gmtime())}; load average {_load()}")


if __name__ == "__main__":
    main()
