"""Pipeline stages: split the repeated layers over a ``pp`` mesh dim (Alpa's inter-op pass).

The placement ILP is solved once on the ``dp x tp`` sub-mesh; its per-unit costs are
then split into a per-layer part (units inside the repeated layers) and the parts
before the first layer (embeddings) and after the last (final norm, output head).
A model whose layers come in kinds (DeepSeek-V3's dense first layers, then MoE ones)
has a per-layer part per kind, and a stage costs the kinds it holds.  Stages are
contiguous runs of layers; dynamic programming over the layer count picks
the split minimising the slowest stage's time under each stage's memory, where a
stage's activations are multiplied by the micro-batches it holds in flight under the
schedule (``cost_model.memory.inflight_microbatches``).  ``cost_model.step`` then
composes the stages, bubble included (GPipe, 1F1B, interleaved 1F1B).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import networkx as nx

from cost_model.comm import collective_time
from cost_model.memory import (
    fsdp_gathered_bytes,
    inflight_microbatches,
    state_bytes_per_param,
    usable_bytes,
)
from cost_model.step import (
    StageCost,
    StepBreakdown,
    bucket_latency,
    compose_step,
    fsdp_gathers,
    fsdp_step_gathers,
    optimizer_time,
    partial_grad_time,
)
from planner.ilp import Solution
from planner.strategies import (
    Context,
    Unit,
    canonical_map,
    fsdp_copy_s,
    fsdp_degree,
    fsdp_host_s,
    layer_index,
    layer_kinds,
    loss_mean_s,
    unplaced_compute_s,
)
from planner.tracer import layer_weight


@dataclass(frozen=True)
class Part:
    """Per-micro-batch costs and per-device bytes of one slice of the model."""

    compute_s: float = 0.0
    recompute_s: float = 0.0  # the part of compute_s that activation checkpointing recomputes
    blocking_s: float = 0.0
    gather_s: float = 0.0  # one FSDP all-gather of its parameters (how many per step: _stage)
    grad_sync_s: float = 0.0  # per step
    state_bytes: float = 0.0
    act_bytes: float = 0.0  # one micro-batch
    tensors: float = 0.0  # parameter tensors (the optimizer's per-tensor ops)

    def __add__(self, o: Part) -> Part:
        return Part(*(a + b for a, b in zip(self.__dict__.values(), o.__dict__.values(), strict=True)))

    def __mul__(self, k: float) -> Part:
        return Part(*(a * k for a in self.__dict__.values()))


@dataclass(frozen=True)
class Stage:
    layers: tuple[int, int]  # [start, end) of the repeated layers
    first: bool
    last: bool
    cost: StageCost
    memory: float
    state_bytes: float  # the model states (weights, grads, optimizer) part of memory
    gathered: float  # what FSDP2 holds unsharded besides (cost_model.memory.fsdp_gathered_bytes)


def _first_nodes(graph: nx.DiGraph) -> set[str]:
    """Nodes that run before the repeated layers (ancestors of the first layer's nodes)."""
    if "first_nodes" not in graph.graph:  # cached on the graph: it never changes
        layer_nodes = [n for n, d in graph.nodes(data=True) if d.get("layer") is not None]
        first = min((graph.nodes[n]["layer"] for n in layer_nodes), default=None)
        out: set[str] = set()
        for n in layer_nodes:
            if graph.nodes[n]["layer"] == first:
                out |= nx.ancestors(graph, n)
        graph.graph["first_nodes"] = {n for n in out if graph.nodes[n].get("layer") is None}
    return graph.graph["first_nodes"]


def pipeline_blocker(graph: nx.DiGraph) -> str | None:
    """Why ``executor.apply`` could not cut this model into stages, or None.  Its rule
    (``executor.pipeline``): later stages start from the embedding's output
    (``inputs_embeds=``), so before the first layer only the input embedding may use
    parameters (GPT-2's position embedding is one more), and a parameter tied across
    stages (GPT-2's ``wte`` / ``lm_head``) cannot be split between them."""
    first = _first_nodes(graph)
    for n, d in sorted(graph.nodes(data=True)):
        users = list(graph.successors(n))
        if not d.get("is_param") or not any(u in first for u in users):
            continue
        if d["param"] != graph.graph.get("input_embedding"):
            return (f"{d['param']} is used before the first layer, and later stages start from "
                    "the input embedding's output")
        if any(u not in first and graph.nodes[u].get("layer") is None for u in users):
            return f"{d['param']} is tied to the output head, which a pipeline's last stage runs"
    return None


def stage_modules(graph: nx.DiGraph, stages: list[Stage], virtual: int = 1) -> list[list[str]]:
    """Module FQNs each stage runs, in order: embeddings, layers, head.

    With ``virtual`` > 1 (interleaved 1F1B) the list has one entry per virtual stage,
    ``pp * virtual`` of them, virtual stage ``s`` running on pp rank ``s % pp``: rank
    ``r``'s layer count is dealt out as ``count / virtual`` contiguous layers to each
    of its virtual stages, in model order, so the plan lists what each rank runs."""
    first = _first_nodes(graph)
    prefix = graph.graph["layer_prefix"]
    before: list[str] = []
    after: list[str] = []
    for n, d in graph.nodes(data=True):
        mod = d.get("module")
        if d.get("layer") is not None or d["kind"] != "call_function" or not mod:
            continue
        if prefix.startswith(mod + "."):  # a container of the layers (the model itself)
            continue
        target = before if n in first else after
        if mod not in target:
            target.append(mod)
    # a module that runs before the layers runs there only, even where the trace also
    # gives it a node outside the first layer's ancestors (Gemma's embedding: a dtype
    # assertion nothing uses), since its parameters belong to one stage (tied ones:
    # pipeline_blocker)
    after = [m for m in after if m not in before]
    pp = len(stages)
    sizes = [(st.layers[1] - st.layers[0]) // virtual for st in stages]
    out, start = [], stages[0].layers[0]
    for s in range(pp * virtual):
        n = sizes[s % pp]
        out.append([f"{prefix}.{i}" for i in range(start, start + n)])
        start += n
    out[0] = before + out[0]
    out[-1] = out[-1] + after
    return out


Partial = tuple[str, float, int]  # a gradient left Partial: (collective, bytes, mesh dim)
Partials = tuple[list[Partial], list[Partial]]  # the first stage's, the last stage's


@dataclass(frozen=True)
class Layers:
    """The repeated layers: one real layer's part and Partial gradients per kind of layer
    (``strategies.layer_kinds``), and which kind each real layer is."""

    parts: tuple[Part, ...]
    partials: tuple[tuple[Partial, ...], ...]
    kind: tuple[int, ...]  # real layer -> index into parts

    def on_rank(self, placed: int, n: int, virtual: int) -> tuple[int, ...]:
        """Layers of each kind on the pp rank that holds ``n`` layers after the ``placed``
        of the ranks before it.  With ``virtual`` stages per rank (interleaved 1F1B) they
        are ``n / virtual`` layers ``placed / virtual`` into each of the model's
        ``virtual`` equal runs, as ``stage_modules`` deals them out."""
        span, size = len(self.kind) // virtual, n // virtual
        counts = [0] * len(self.parts)
        for v in range(virtual):
            start = v * span + placed // virtual
            for k in self.kind[start:start + size]:
                counts[k] += 1
        return tuple(counts)


def split_parts(ctx: Context, graph: nx.DiGraph, units: dict[str, Unit], sol: Solution,
                partial: Sequence[tuple[str, str, float, int]] = ()) -> tuple[Layers, Part, Part, Part, Partials]:
    """(the layers, before the layers, after the layers, what every virtual stage runs
    again: the model's code on positions and masks, ``unplaced_compute_s``; and the
    gradients left Partial before and after the layers) of a solved assignment.
    ``partial``: ``planner.search._partial_grads``' entries.

    A unit's costs are the whole model's, summed over the real layers its traced nodes
    stand for; they are shared out to the kinds of layer (and the parts before and after
    them) by its nodes' work, each counted as often as it runs."""
    layers = graph.graph["layers"]
    first_nodes = _first_nodes(graph)
    traced_kind = layer_kinds(graph, canonical_map(graph))
    stand_ins = graph.graph["stand_ins"]
    if len(stand_ins) != layers:  # the layers were not told apart (no single prefix): one kind
        stand_ins = [min(traced_kind)] * layers
    kinds = sorted({traced_kind[i] for i in stand_ins})
    index = {k: i for i, k in enumerate(kinds)}
    of = tuple(index[traced_kind[i]] for i in stand_ins)
    real = [of.count(i) for i in range(len(kinds))]
    m = ctx.microbatches
    per_kind, first, last = [Part()] * len(kinds), Part(), Part()
    reshard_by_unit: dict[str, float] = {}
    for t_key, _src, _dst, cost in sol.edges:
        reshard_by_unit[t_key] = reshard_by_unit.get(t_key, 0.0) + cost
    for key, choice in sol.choice.items():
        u = units[key]
        w: dict[str | int, float] = {}
        for n in u.nodes:
            d = graph.nodes[n]
            where = (index[traced_kind[d["layer"]]] if d.get("layer") is not None
                     else "first" if n in first_nodes else "last")
            w[where] = w.get(where, 0.0) + (d["fwd_flops"] + d["bytes"] + 1.0) * layer_weight(graph, n)
        total = sum(w.values())
        part = Part(choice.compute_s / m, choice.recompute_s / m, (sum(reshard_by_unit.get(n, 0.0) for n in u.nodes) + choice.comm_s) / m,
                    choice.gather_s, choice.grad_sync_s, sum(choice.state), choice.act_bytes, choice.tensors)
        per_kind = [p + part * (w.get(i, 0.0) / total / real[i]) for i, p in enumerate(per_kind)]
        first = first + part * (w.get("first", 0.0) / total)
        last = last + part * (w.get("last", 0.0) / total)
    preamble, in_layers = unplaced_compute_s(ctx, graph)
    per_kind = [p + Part(compute_s=in_layers / m / layers) for p in per_kind]
    # each kind's Partial gradients are its first real layer's (that traced layer's own)
    entries: dict[int | str, list[Partial]] = {}
    before = {f for n in first_nodes for f in graph.nodes[n].get("params", {}).values()}
    for fqn, *entry in partial:
        i = layer_index(fqn)
        where = ("first" if fqn in before else "last") if i is None else i
        entries.setdefault(where, []).append(tuple(entry))
    layer_parts = Layers(tuple(per_kind), tuple(tuple(entries.get(k, ())) for k in kinds), of)
    return (layer_parts, first, last + Part(blocking_s=loss_mean_s(ctx)), Part(compute_s=preamble / m),
            (entries.get("first", []), entries.get("last", [])))


def _stage(ctx: Context, pp: int, index: int, counts: tuple[int, ...], layers: Layers, first: Part, last: Part,
           schedule: str, virtual: int, p2p_s: float, partials: Partials = ([], []),
           preamble: Part = Part()) -> tuple[StageCost, float, float, float]:
    """(cost, memory, model-state bytes, FSDP2's gathered bytes) of stage ``index`` holding
    ``counts`` layers of each kind; each of its ``virtual`` stages runs ``preamble``."""
    n = sum(counts)
    body = sum((p * c for p, c in zip(layers.parts, counts, strict=True)), Part())
    part = body + (first if index == 0 else Part()) + (last if index == pp - 1 else Part()) + preamble * virtual
    # the stage's gradients left Partial, reduced after each backward as without a pipeline
    pending = ([e for es, c in zip(layers.partials, counts, strict=True) for e in es * c]
               + (partials[0] if index == 0 else []) + (partials[1] if index == pp - 1 else []))
    partial_s = partial_grad_time(ctx.profile, ctx.mesh_shape, pending, bucketed=ctx.data_ranks == 1)
    per = state_bytes_per_param(ctx.optimizer)
    # torch's schedules reduce a stage's gradients once, after its last backward (unlike
    # the micro-batches of executor.accumulate, each reduced: Context.grad_reductions)
    assert ctx.grad_reductions == 1  # noqa: S101
    # one FSDP2 unit per layer plus the stage's root (cost_model.step.bucket_latency); each
    # virtual stage's last block keeps its parameters (cost_model.step.fsdp_gathers)
    m, kept = ctx.microbatches, min(virtual, n)
    gathers = fsdp_step_gathers(m, True, n, kept)
    weights = part.state_bytes * per.weights / per.total
    layer_weights = body.state_bytes * per.weights / per.total / n  # the stage's mean layer
    gathered = weights + (gathers - n - 1) * layer_weights  # each unit once, the unkept layers m more times
    compute = part.compute_s + (fsdp_host_s(ctx, n + 1, weights) + fsdp_copy_s(ctx, gathered, weights, 1)) / m
    fwd = (compute - part.recompute_s) / 3  # backward = 2x forward, plus the recompute
    gather_lat, reduce_lat = bucket_latency(ctx.profile, ctx.mesh_shape, ctx.data_dims, "dp" in ctx.fsdp,
                                            gathers=gathers, reductions=n + 1)
    root_gather = part.gather_s - body.gather_s
    gather = ((gathers - fsdp_gathers(m, True, kept=True)) * body.gather_s / n + root_gather + gather_lat) / m
    cost = StageCost(
        forward_compute_s=fwd, backward_compute_s=compute - fwd, recompute_s=part.recompute_s,
        blocking_comm_s=part.blocking_s + partial_s, gather_forward_s=gather / 2,
        gather_backward_s=gather / 2, p2p_s=p2p_s * virtual,
        grad_reduce_s=part.grad_sync_s + reduce_lat, grad_reduce_overlapped=False, layers=n,
        overlap_exposure=ctx.profile.overlap_exposure,
        optimizer_s=optimizer_time(ctx.profile, part.state_bytes / per.total, ctx.optimizer,
                                   tensors=max(round(part.tensors), 1),
                                   dtensor=math.prod(ctx.mesh_shape) > 1),  # as planner.search.evaluate
    )
    inflight = inflight_microbatches(schedule, pp, ctx.microbatches, index, virtual)
    # the stage's root unit holds the embedding (first stage) and the head (last stage);
    # a stage holds all its layers gathered at the end (fsdp_gathered_bytes): their mean
    degree = fsdp_degree(ctx)
    root = (first.state_bytes if index == 0 else 0.0) + (last.state_bytes if index == pp - 1 else 0.0)
    gathered = fsdp_gathered_bytes(root * degree / per.total, body.state_bytes / n * degree / per.total,
                                   ctx.optimizer, degree, stage_layers=n)
    return cost, part.state_bytes + part.act_bytes * inflight + gathered, part.state_bytes, gathered


def partition(ctx: Context, pp: int, layers: Layers, first: Part, last: Part,
              schedule: str, virtual: int, p2p_s: float, budget: float,
              partials: Partials = ([], []), by_memory: bool = False,
              preamble: Part = Part()) -> list[Stage] | None:
    """Contiguous layer counts per stage minimising the slowest stage within ``budget``
    bytes per device (DP); ``by_memory``: minimising the largest stage's memory instead."""
    inf = (math.inf, None)
    memo: dict[tuple[int, tuple[int, ...]], tuple[StageCost, float, float, float]] = {}

    def stage(i: int, placed: int, n: int) -> tuple[StageCost, float, float, float]:
        counts = layers.on_rank(placed, n, virtual)
        if (i, counts) not in memo:  # a stage is its index and how many layers of each kind
            memo[i, counts] = _stage(ctx, pp, i, counts, layers, first, last, schedule, virtual, p2p_s,
                                     partials, preamble)
        return memo[i, counts]

    # best[i][j]: (slowest stage time (or memory), counts) placing the first j layers on stages 0..i-1
    total = len(layers.kind)
    best = [[inf] * (total + 1) for _ in range(pp + 1)]
    best[0][0] = (0.0, ())
    for i in range(pp):
        for j in range(total + 1):
            if best[i][j][1] is None:
                continue
            for n in range(1, total - j + 1):
                if i == pp - 1 and j + n != total:
                    continue
                if n % virtual:
                    continue
                cost, mem, _, _ = stage(i, j, n)
                if mem > budget:
                    continue
                t = mem if by_memory else cost.forward_compute_s + cost.backward_compute_s + cost.blocking_comm_s
                cand = (max(best[i][j][0], t), best[i][j][1] + (n,))
                if cand[0] < best[i + 1][j + n][0]:
                    best[i + 1][j + n] = cand
    counts = best[pp][total][1]
    if counts is None:
        return None
    stages, start = [], 0
    for i, n in enumerate(counts):
        cost, mem, state, gathered = stage(i, start, n)
        stages.append(Stage((start, start + n), i == 0, i == pp - 1, cost, mem, state, gathered))
        start += n
    return stages


def p2p_time(ctx: Context, graph: nx.DiGraph, mesh_shape: tuple[int, ...]) -> float:
    """Send + receive of one micro-batch's activation and its gradient between stages."""
    hidden = next(d["shape"][-1] for _, d in graph.nodes(data=True) if d.get("short") == "embedding")
    nbytes = ctx.microbatch / ctx.data_ranks * ctx.seq_len * hidden * ctx.act_itemsize
    return 2 * collective_time(ctx.profile, "send_recv", nbytes, mesh_shape, 0)


SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2))


def schedule_blocker(layers: int, pp: int, microbatches: int, schedule: str, virtual: int) -> str | None:
    """Why ``schedule`` with ``virtual`` stages per rank cannot run ``layers`` layers on ``pp``
    ranks, as "field: problem", or None.  The rules are ``executor.pipeline``'s: the
    interleaved schedule runs micro-batches in rounds of pp, and each rank's layers are
    dealt out evenly to its virtual stages, so every stage holds a multiple of
    ``virtual`` layers (at least one per virtual stage)."""
    if schedule == "interleaved-1f1b" and microbatches % pp:
        return (f"microbatches: {microbatches} is not divisible by pp={pp}; interleaved-1f1b runs "
                "micro-batches in rounds of pp")
    if pp * virtual > layers:
        return f"virtual_stages: pp*virtual_stages={pp * virtual} exceeds the model's {layers} layers"
    if layers % virtual:
        return (f"virtual_stages: {virtual} does not divide the model's {layers} layers; each pp rank "
                "deals its layers out evenly to its virtual stages")
    return None


def best_pipeline(ctx: Context, graph: nx.DiGraph, units: dict[str, Unit], sol: Solution, pp: int,
                  schedules: tuple[tuple[str, int], ...] = SCHEDULES, budget: float | None = None,
                  partial: Sequence[tuple[str, str, float, int]] = (), by_memory: bool = False,
                  ) -> tuple[list[Stage], str, int, StepBreakdown] | None:
    """The best (stages, schedule, virtual stages, step breakdown) over the ``schedules``
    the executor can run, each stage within ``budget`` bytes (default: the profile's usable
    memory); ``partial``: the gradients left Partial (``planner.search._partial_grads``).
    ``by_memory``: the leanest instead, the split and schedule whose largest stage needs
    the least memory."""
    layer_parts, first, last, preamble, partials = split_parts(ctx, graph, units, sol, partial)
    layers = graph.graph["layers"]
    p2p = p2p_time(ctx, graph, (pp, *ctx.mesh_shape))
    budget = usable_bytes(ctx.profile) if budget is None else budget
    best, best_key = None, (math.inf, math.inf)
    for schedule, virtual in schedules:
        if schedule_blocker(layers, pp, ctx.microbatches, schedule, virtual):
            continue
        stages = partition(ctx, pp, layer_parts, first, last, schedule, virtual, p2p, budget, partials,
                           by_memory, preamble)
        if stages is None:
            continue
        b = compose_step([s.cost for s in stages], ctx.microbatches, schedule, virtual)
        # on a tie in time the leaner schedule (1F1B holds fewer micro-batches' activations
        # than GPipe, which won ties before: review)
        key = (float(f"{b.step_time_s:.9g}"), max(s.memory for s in stages))  # equal to 9 digits: a tie
        key = key[::-1] if by_memory else key
        if best is None or key < best_key:
            best, best_key = (stages, schedule, virtual, b), key
    return best
