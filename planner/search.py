"""Mesh search, evaluation and plan assembly: config -> graph -> strategies -> ILP -> Plan.

For each factorisation of the device count into ``dp x tp`` (tp a power of two that
stays inside a node, so tensor-parallel traffic rides the fastest level), each
data-parallel mode (replicate / fully sharded) and, only when memory demands it,
more micro-batches, or selective or full activation checkpointing (both tried: keeping
the matmuls can force slower placements than recomputing all), the ILP picks every
placement; :func:`evaluate` composes the solution into a step time with
``cost_model.step`` (FSDP prefetch and gradient-reduction overlap) and the best
fitting candidate becomes the plan.  Every candidate is recorded as an
alternative.  ``estimate`` runs the same evaluation on a hand layout by pinning
choices, so plans and hand layouts are compared by one cost function.
"""

from __future__ import annotations

import difflib
import functools
import json
import math
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
import torch
from pydantic import ValidationError

from cost_model.compute import peak_flops
from cost_model.memory import fsdp_gathered_bytes, state_bytes_per_param, usable_bytes
from cost_model.profile import Profile, load_profile, problem_lines
from cost_model.step import (
    StageCost,
    StepBreakdown,
    bucket_latency,
    compose_step,
    fsdp_step_gathers,
    optimizer_time,
    partial_grad_time,
)
from planner.ilp import (
    InfeasibleError,
    Solution,
    Tensor,
    min_memory,
    solve,
    tensors,
    unbounded_memory,
)
from planner.pipeline import (
    SCHEDULES,
    Stage,
    best_pipeline,
    pipeline_blocker,
    schedule_blocker,
    stage_modules,
)
from planner.presets import default_seq_len, load_config
from planner.schema import (
    SCHEMA_VERSION,
    SKIPPED_BY_TIME_LIMIT,
    Alternative,
    DataParallelDim,
    Fingerprint,
    MemoryBreakdown,
    Mesh,
    MeshDim,
    ModuleLayout,
    ParameterPlacement,
    Pipeline,
    PipelineStage,
    Plan,
    Prediction,
    SolverStats,
    TimeBreakdown,
    binary_size,
    fqn_pattern,
    pattern_matches,
)
from planner.strategies import (
    REDUCING_OPS,
    Choice,
    Context,
    Unit,
    build_units,
    canonical_map,
    concrete,
    fsdp_copy_s,
    fsdp_degree,
    fsdp_host_s,
    fsdp_shard,
    loss_mean_s,
    norm_module_node,
    unit_params,
    unplaced_compute_s,
)
from planner.timeline import sync_corrections
from planner.tracer import totals, trace

Progress = Callable[[str], None]

# Hand layouts for `estimate`: which linear layers TorchTitan / Megatron shard by
# column (output features) and which by row, under the names of each supported model
# type (Phi-3's qkv_proj and gate_up_proj end like q/k/v and up; GPT-NeoX's fused
# query_key_value holds each head's q, k and v together, so a column split keeps heads
# whole).  Everything else stays replicated.
# DeepSeek's up-projections (q_b_proj, kv_b_proj) and Laguna's output gate (g_proj) are per head.
# OPT's, BioGPT's, GPT-J's and MPT's out_proj, BioGPT's output_projection (its head),
# BLOOM's word_embeddings, GPT-J's and CodeGen's fc_in / fc_out, MPT's fused Wqkv.
_COLWISE = re.compile(r"(q_proj|k_proj|v_proj|gate_proj|up_proj|c_attn|c_fc|w1|w3|lm_head|query_key_value|"
                      r"dense_h_to_4h|fc1|embed_out|q_b_proj|kv_b_proj|g_proj|output_projection|fc_in|Wqkv)$")
_ROWWISE = re.compile(r"(o_proj|down_proj|c_proj|w2|embed_tokens|wte|dense|dense_4h_to_h|fc2|embed_in|out_proj|"
                      r"word_embeddings|fc_out)$")
# Linear attention (Gated DeltaNet: Qwen3.5, Qwen3-Next, OLMo Hybrid) stays whole on the
# model dims in every layout, the ILP's too: its body makes tensors of its own (the chunked
# delta rule's recurrent state), which DTensor mixes with its inputs in the forward and
# refuses in the backward; whole, the executor runs it on local tensors
# (executor.local_regions.Whole).  OLMo Hybrid names its projections q/k/v/g/o_proj.
_KEPT_WHOLE = re.compile(r"\.linear_attn(\.|$)")


class PlanningError(ValueError):
    """A planning request that cannot be satisfied; the message names the field."""


@dataclass
class Candidate:
    ctx: Context  # the dp x tp sub-mesh the ILP solved on
    units: dict[str, Unit]
    solution: Solution
    prediction: Prediction
    pp: int = 1
    stages: list[Stage] | None = None
    schedule: str = "1f1b"
    virtual_stages: int = 1


def _heads(config: Any) -> tuple[int, int] | None:
    """(attention heads, key/value heads) of a config, None for a module."""
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    return (int(heads), int(getattr(config, "num_key_value_heads", None) or heads)) if heads else None


def _feature_divisor(graph: nx.DiGraph, config: Any) -> int:
    heads = _heads(config)
    return math.gcd(*heads) if heads else 1


def _heads_text(config: Any, tp: int) -> str:
    """The head counts a feature (tensor-parallel) split of ``tp`` does not divide."""
    counts = _heads(config)
    if counts is None:
        return "the attention heads (unknown without the model's config, taken as 1)"
    heads, kv = counts
    failing = [f"{heads} attention heads"] if heads % tp else []
    if kv != heads and kv % tp:
        failing.append(f"{kv} key/value heads")
    return "the " + " and ".join(failing)


def _training_dtype(profile: Profile) -> torch.dtype:
    """What a plan trains in: fp32 on CPUs, bf16 mixed precision on GPUs."""
    return torch.float32 if profile.device_type == "cpu" else torch.bfloat16


def _context(profile: Profile, names: Sequence[str], shape: Sequence[int], batch: int, seq: int,
             microbatches: int, fsdp: bool, checkpointing: str, divisor: int,
             trace_itemsize: int = 4, pp: int = 1) -> Context:
    cpu = _training_dtype(profile) == torch.float32
    return Context(
        mesh_names=tuple(names), mesh_shape=tuple(shape), profile=profile, batch_size=batch,
        seq_len=seq, microbatches=microbatches, dtype="fp32" if cpu else "bf16",
        act_itemsize=_training_dtype(profile).itemsize, optimizer="adam-fp32" if cpu else "adam-mixed",
        fsdp=frozenset({"dp"}) if fsdp else frozenset(), checkpointing=checkpointing,
        feature_divisor=divisor, trace_itemsize=trace_itemsize, pp=pp,
    )


def _prediction(ctx: Context, graph: nx.DiGraph, b: StepBreakdown, state: Sequence[float],
                acts: float, devices: int, gathered: float) -> Prediction:
    total = int(sum(state) + acts + gathered)
    memory = MemoryBreakdown(
        parameters=int(state[0]), gradients=int(state[1]), optimizer=int(state[2]),
        activations=int(acts), fsdp_gathered=int(gathered), total=total, capacity=ctx.profile.memory_bytes,
        usable=usable_bytes(ctx.profile), fits=total <= usable_bytes(ctx.profile),
    )
    tokens = ctx.batch_size * ctx.seq_len
    train_flops = totals(graph)["train_flops"] * ctx.batch_size
    peak = peak_flops(ctx.profile, ctx.dtype)
    return Prediction(
        time=TimeBreakdown(**b.as_dict()), memory=memory,
        tokens_per_s_per_device=tokens / b.step_time_s / devices if b.step_time_s else 0.0,
        mfu=train_flops / b.step_time_s / devices / peak if b.step_time_s else 0.0,
    )


def _placed(chosen: Iterable[Choice]) -> dict[str, tuple[str, ...]]:
    """The solved placements per parameter pattern."""
    return {fqn_pattern(f): pl for c in chosen for f, pl in c.weights.items()}


def _partial_grads(ctx: Context, graph: nx.DiGraph, units: Mapping[str, Unit], sol: Solution,
                   placed: Mapping[str, tuple[str, ...]]) -> list[tuple[str, str, float, int]]:
    """(parameter, collective, local gradient bytes, mesh dim) per gradient left Partial on a dim.

    ``executor.apply`` reduces them once per backward: a parameter replicated on a
    model-parallel dim whose unit's activations are split over that dim (a norm under
    sequence parallelism: each rank sums its tokens' share) has a pending sum there
    (all-reduce to R).  Parameters no anchor places (norm weights) are replicated
    everywhere.  On replicated activations the gradient is whole: the executor reduces
    the pending gradient of a replicated block input where the column-parallel
    projections read it (Megatron's f, which the ILP charges as ``ilp.partial_grad_s``),
    before the norm that made it; so neither a norm's nor a row-parallel weight's
    gradient is Partial there.
    """
    per = state_bytes_per_param(ctx.optimizer)
    # parameter pattern -> the activations it meets: a segment's (a norm's), a product's
    # input for its weight and output for its bias (a row-parallel bias is added to the
    # reduced sum, whose gradient is whole: P reads as not split)
    layout: dict[str, tuple[str, ...]] = {}
    for key, c in sol.choice.items():
        for n in units[key].nodes:
            for fqn in graph.nodes[n].get("params", {}).values():
                bias = len(graph.graph["param_shapes"][fqn]) == 1
                layout[fqn_pattern(fqn)] = c.inp if units[key].kind == "anchor" and not bias else c.out
    # a parameter first computed on outside the units (Gemma's norm scale ``1 + weight``,
    # traced as ``to`` and ``add`` on the weight alone) meets the activations of the
    # segment that reads the result; without this its gradient read as Partial under
    # plain tensor parallelism, and the plan priced one all-reduce per norm that the
    # executor does not issue
    unit_at = {n: key for key, u in units.items() for n in u.nodes}
    for n, d in graph.nodes(data=True):
        fqn = d.get("param") if d["kind"] == "placeholder" else None
        if fqn is None or fqn_pattern(fqn) in layout:
            continue
        front, seen = [n], {n}
        while front and fqn_pattern(fqn) not in layout:
            for v in graph.successors(front.pop(0)):
                if v in unit_at and units[unit_at[v]].kind == "segment":
                    layout[fqn_pattern(fqn)] = sol.choice[unit_at[v]].out
                    break
                if v not in seen and v not in unit_at:
                    seen.add(v)
                    front.append(v)
    out = []
    for fqn, shape in graph.graph["param_shapes"].items():
        pat = fqn_pattern(fqn)
        pl = placed.get(pat, ("R",) * len(ctx.mesh_shape))
        acts = layout.get(pat)
        for i in ctx.free_dims:
            if ctx.mesh_shape[i] == 1 or pl[i] != "R" or (acts is not None and acts[i] in ("R", "P")):
                continue
            shards = math.prod(n for j, (n, p) in enumerate(zip(ctx.mesh_shape, pl))
                               if p.startswith("S(") and j != i)
            out.append((fqn, "all_reduce", math.prod(shape) / shards * per.grads, i))
    return out


def evaluate(ctx: Context, graph: nx.DiGraph, units: dict[str, Unit], sol: Solution,
             unit_of: Mapping[str, str], tensor_map: Mapping[str, Tensor]) -> Prediction:
    """Step time and memory of a solved assignment without pipelining (``cost_model.step``),
    its collectives priced by the compute before each (``planner.timeline``)."""
    chosen = sol.choice.values()
    placed = _placed(chosen)
    m = ctx.microbatches
    compute = sum(c.compute_s for c in chosen) + sum(unplaced_compute_s(ctx, graph))
    # executor.apply: one FSDP2 unit per layer plus the root, each moving its parameters in one collective
    layers = graph.graph["layers"]
    gather_lat, reduce_lat = bucket_latency(
        ctx.profile, ctx.mesh_shape, ctx.data_dims, "dp" in ctx.fsdp,
        gathers=fsdp_step_gathers(m, False, layers, kept_layers=min(layers, 1)),
        reductions=(layers + 1) * ctx.grad_reductions)
    gather = sum(c.gather_s * units[k].gathers for k, c in sol.choice.items()) + gather_lat
    state = [sum(c.state[i] for c in chosen) for i in range(3)]
    compute += fsdp_host_s(ctx, graph.graph["layers"] + 1, state[0]) + fsdp_copy_s(
        ctx, sum(c.state[0] * units[k].gathers for k, c in sol.choice.items()), state[0], ctx.grad_reductions)
    partial = _partial_grads(ctx, graph, units, sol, placed)
    # backward = 2x forward, plus what checkpointing recomputes
    recompute = sum(c.recompute_s for c in chosen)
    fwd = (compute - recompute) / 3
    stage = StageCost(
        forward_compute_s=fwd / m, backward_compute_s=(compute - fwd) / m, recompute_s=recompute / m,
        blocking_comm_s=(sol.reshard_s + sum(c.comm_s for c in chosen)) / m + loss_mean_s(ctx)
        + partial_grad_time(ctx.profile, ctx.mesh_shape, [e[1:] for e in partial], bucketed=ctx.data_ranks == 1),
        sync_correction_s=sync_corrections(ctx, graph, units, unit_of, tensor_map, sol, partial),
        gather_forward_s=gather / (2 * m),
        gather_backward_s=gather / (2 * m), grad_reduce_s=sum(c.grad_sync_s for c in chosen) + reduce_lat,
        grad_reduce_parts=ctx.grad_reductions,
        optimizer_s=optimizer_time(ctx.profile, sum(state) / state_bytes_per_param(ctx.optimizer).total,
                                   ctx.optimizer, tensors=max(round(sum(c.tensors for c in chosen)), 1),
                                   dtensor=math.prod(ctx.mesh_shape) > 1),  # executor.apply: DTensor params
        layers=max(graph.graph["layers"], 1), overlap_exposure=ctx.profile.overlap_exposure,
    )
    acts = sum(c.act_bytes for c in chosen)
    gathered = fsdp_gathered_bytes(*unit_params(ctx, graph.graph["param_shapes"], placed), ctx.optimizer,
                                   fsdp_degree(ctx))
    return _prediction(ctx, graph, compose_step([stage], microbatches=m), state, acts,
                       math.prod(ctx.mesh_shape), gathered)


def _gathered_estimate(ctx: Context, graph: nx.DiGraph, pp: int) -> float:
    """FSDP2's gathered units before the ILP has placed anything, as a tensor-parallel
    layout shards them (the ILP's memory is a sum over units, this a maximum over them,
    so it is held back from the ILP's budget); under pp the root's embedding and head are
    on different stages, and each holds all its layers (``fsdp_gathered_bytes``).  The
    ILP's memory is an average stage's (states / pp), so the root is averaged too: the
    first and last stages hold about half of it each, which ``partition`` checks per
    stage."""
    root, layer = unit_params(ctx, graph.graph["param_shapes"])
    return fsdp_gathered_bytes(root / pp, layer, ctx.optimizer, fsdp_degree(ctx),
                               stage_layers=math.ceil(graph.graph["layers"] / pp) if pp > 1 else 0)


def _units(ctx: Context, graph: nx.DiGraph, pins: Callable[[Unit], None] | None
           ) -> tuple[dict[str, Unit], dict[str, str]]:
    units, unit_of = build_units(ctx, graph)
    for u in units.values():
        if _KEPT_WHOLE.search(u.module):
            u.choices = [c for c in u.choices if all(
                c.inp[i] == "R" and c.out[i] == "R" and all(pl[i] == "R" for pl in c.weights.values())
                for i in ctx.free_dims)]
    if pins:
        for u in units.values():
            pins(u)
    return units, unit_of


def _solve(ctx: Context, graph: nx.DiGraph, units: dict[str, Unit], unit_of: dict[str, str],
           time_limit_s: float | None, pp: int = 1,
           schedules: tuple[tuple[str, int], ...] = SCHEDULES, lift_memory: bool = False) -> Candidate:
    """The ILP's best assignment (and pipeline split) within the profile's usable memory,
    or, with ``lift_memory``, with no memory bound: how a layout that does not fit would run."""
    tmap = tensors(ctx, graph, units, unit_of, canonical_map(graph))
    # A parameter several units use (a tied embedding and head) takes one placement, and
    # so does a pattern several units place: the plan writes one placement per pattern, so
    # the units of each layer kind (DeepSeek-V3's dense and MoE layers' attention) agree.
    uses: dict[str, dict[str, str]] = {}  # pattern -> unit key -> a parameter of it there
    for k, u in units.items():
        for fqn in sorted({f for c in u.choices for f in c.weights}):
            uses.setdefault(fqn_pattern(fqn), {}).setdefault(k, fqn)
    tied = {pattern: list(by_unit.items()) for pattern, by_unit in uses.items() if len(by_unit) > 1}
    gathered = _gathered_estimate(ctx, graph, pp)
    budget = usable_bytes(ctx.profile) - gathered
    if lift_memory:
        budget = max(budget, unbounded_memory(units, pp))
    try:
        sol = solve(ctx, units, tmap, budget, tied, time_limit_s, state_divisor=pp)
    except InfeasibleError as e:
        if e.need is not None:  # the ILP's bytes, less what FSDP gathers (held back from its budget)
            e.need += gathered
        raise
    if pp == 1:
        pred = evaluate(ctx, graph, units, sol, unit_of, tmap)
        if not pred.memory.fits and not lift_memory:  # the layout gathers more than estimated
            raise InfeasibleError(f"the layout needs {binary_size(pred.memory.total, 1)} per device",
                                  need=pred.memory.total)
        return Candidate(ctx, units, sol, pred)
    partial = _partial_grads(ctx, graph, units, sol, _placed(sol.choice.values()))
    found = best_pipeline(ctx, graph, units, sol, pp, schedules, math.inf if lift_memory else None, partial)
    if found is None:
        # the ILP bounds an average stage (states / pp, one micro-batch of every layer's
        # activations); priced one by one the stages can need more (docs/cost_model.md,
        # "Pipeline memory in the ILP"): say what the leanest split of them needs
        leanest = best_pipeline(ctx, graph, units, sol, pp, schedules, math.inf, partial, by_memory=True)
        need = max(s.memory for s in leanest[0]) if leanest else None
        raise InfeasibleError(f"no split of {graph.graph['layers']} layers into {pp} stages fits", need=need,
                              kind="memory" if leanest else "conflict")
    stages, schedule, virtual, b = found
    heavy = max(stages, key=lambda st: st.memory)
    whole = [sum(c.state[i] for c in sol.choice.values()) for i in range(3)]
    state = [w * heavy.state_bytes / sum(whole) for w in whole]  # the stage's states, split as the model's
    pred = _prediction(ctx, graph, b, state, heavy.memory - sum(state) - heavy.gathered,
                       pp * math.prod(ctx.mesh_shape), heavy.gathered)
    return Candidate(ctx, units, sol, pred, pp, stages, schedule, virtual)


_MESH_DIMS = ("pp", "dp", "tp")  # outermost first


def _check_mesh(mesh: Any, devices: int) -> None:
    """A forced mesh's own problems, found before the trace (seconds for a large model)."""
    if not isinstance(mesh, Mapping):
        raise PlanningError(f"mesh: expected a mapping of dim name to size such as "
                            f"{{'dp': 2, 'tp': 2}}, got {mesh!r}")
    if not mesh:
        raise PlanningError("mesh: empty; name at least one dim (pp, dp, tp), or leave mesh out "
                            "to let the planner choose")
    unknown = [n for n in mesh if n not in _MESH_DIMS]
    if unknown:
        raise PlanningError(f"mesh: unknown dim {unknown[0]!r} (supported: pp, dp, tp)")
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in mesh.values()):
        raise PlanningError(f"mesh: sizes must be positive integers, got {dict(mesh)}")
    if math.prod(mesh.values()) != devices:
        raise PlanningError(f"mesh: {dict(mesh)} has {math.prod(mesh.values())} devices, devices={devices}")


def mesh_candidates(devices: int, profile: Profile, divisor: int, layers: int,
                    mesh: Mapping[str, int] | None, unpipelined: str | None = None,
                    ) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
    """Named mesh shapes to try: dims ordered pp, dp, tp (tp innermost, so inside a node
    where it fits in one).
    ``unpipelined``: why the model cannot be cut into pipeline stages (no pp then)."""
    if mesh is not None:  # checked on its own by plan (_check_mesh), before the trace
        # pp=1 is no pipeline: kept, the search read the stages' first dim as dp and tried
        # no FSDP (review)
        mesh = {k: v for k, v in mesh.items() if not (k == "pp" and v == 1)} or {"dp": 1}
        if mesh.get("pp", 1) > max(layers, 1):
            raise PlanningError(f"mesh: pp={mesh['pp']} exceeds the model's {layers} layers")
        if mesh.get("pp", 1) > 1 and unpipelined:
            raise PlanningError(f"mesh: pp={mesh['pp']}: the model cannot be cut into pipeline stages "
                                f"({unpipelined})")
        if set(mesh) == {"pp"}:  # the stages still need a data dim to plan within
            mesh = {**mesh, "dp": 1}
        ordered = sorted(mesh, key=_MESH_DIMS.index)
        return [(tuple(ordered), tuple(int(mesh[n]) for n in ordered))]
    node = profile.levels[0].devices or devices
    # tp beyond a node too: the cost model prices it on the outer level, and where a node
    # holds one or two devices it is the only tensor parallelism there is
    tps = [t for t in (1, 2, 4, 8, 16) if t <= devices and devices % t == 0
           and (t == 1 or divisor % t == 0)]
    out = [(("dp", "tp"), (devices // t, t)) if t > 1 else (("dp",), (devices,)) for t in tps]
    # Pipelining pays off across nodes: try pp with a full node of tp (and half of one).
    if devices > node and not unpipelined:
        for pp in (2, 4, 8, 16):
            for t in [t for t in tps if t <= node][-2:]:
                if devices % (pp * t) == 0 and pp <= layers // 2:
                    out.append((("pp", "dp", "tp"), (pp, devices // (pp * t), t)) if t > 1
                               else (("pp", "dp"), (pp, devices // pp)))
    return out


@dataclass
class Searched:
    """What :func:`_search` found: the fastest candidate (None if none fits), every candidate
    as an alternative, the least bytes per device any layout ruled out by memory needs (inf
    when memory ruled none out), and why the batch ruled meshes out, one note per mesh."""

    best: Candidate | None
    alternatives: list[Alternative]
    leanest: float
    batch_blocked: list[str]
    # why layouts were ruled out by something other than memory: (InfeasibleError.kind,
    # "mesh label: message") for a conflict of constraints or the solver's time limit
    conflicts: list[tuple[str, str]] = field(default_factory=list)

    def need(self, profile: Profile) -> str:
        """The memory clause of a "does not fit" message ("" when nothing was priced)."""
        return "" if self.leanest == math.inf else (
            f"; the leanest layout needs {binary_size(self.leanest, 1)} per device, "
            f"{binary_size(usable_bytes(profile), 1)} usable on {profile.name}")


def _mesh_label(mesh: Mapping[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in mesh.items())


def _search(graph: nx.DiGraph, profile: Profile, devices: int, batch: int, seq: int,
            meshes: list[tuple[tuple[str, ...], tuple[int, ...]]], divisor: int,
            time_limit_s: float | None, progress: Progress,
            fixed: dict[str, Any] | None = None,
            pins: Callable[[Unit], None] | None = None, lift_memory: bool = False) -> Searched:
    """Best candidate over meshes x dp modes (x checkpointing, micro-batches when needed).
    ``lift_memory``: price layouts whatever memory they need (see :func:`_solve`)."""
    best: Candidate | None = None
    alternatives: list[Alternative] = []
    blocked: list[str] = []
    conflicts: list[tuple[str, str]] = []
    leanest = math.inf
    deadline = time.perf_counter() + time_limit_s if time_limit_s else None
    for names, shape in meshes:
        pp = shape[0] if names[0] == "pp" else 1
        sub_names, sub_shape = (names[1:], shape[1:]) if pp > 1 else (names, shape)
        dp = sub_shape[0] if sub_names[0] == "dp" else 1
        mesh_d = dict(zip(names, shape))
        fsdp_modes = [fixed["fsdp"]] if fixed else ([False, True] if dp > 1 else [False])
        schedules = fixed["schedules"] if fixed else SCHEDULES
        micro = [fixed["microbatches"]] if fixed else [
            m for m in (1, 2, 4, 8, 16, 32, 64, 128) if (batch // dp) % m == 0 and m >= pp]
        why = (f"{batch} is not divisible by dp={dp}" if batch % dp else
               None if micro else f"{batch // dp} sequences per dp rank cannot keep pp={pp} stages busy")
        if why:
            alternatives.append(Alternative(mesh=mesh_d, step_time_s=None, fits=False, note=f"batch_size {why}"))
            # the mesh's label unless the reason names the whole mesh already ("3 is not
            # divisible by dp=2 (dp=2)" for a forced dp=2, audit)
            blocked.append(why if mesh_d == {"dp": dp} else f"{why} ({_mesh_label(mesh_d)})")
            continue
        for fsdp in fsdp_modes:
            label = f"{'x'.join(f'{k}={v}' for k, v in mesh_d.items())} {'fsdp' if fsdp else 'replicate'}"
            ckpts = [fixed["checkpointing"]] if fixed else ["none", "selective", "full"]
            found, late, fewest_fits, conflict = None, False, False, ""
            for ckpt in ckpts:
                # micro-batch counts from the fewest that fits: without a pipeline more only
                # cost time (the first that fits is the one), with one the fewest that fits
                # and twice that (a smaller bubble against smaller GEMMs)
                solved = 0
                for m in micro:
                    ctx = _context(profile, sub_names, sub_shape, batch, seq, m, fsdp, ckpt, divisor,
                                   graph.graph.get("itemsize", 4), pp)
                    left = deadline - time.perf_counter() if deadline else None
                    if left is not None and left <= 0 and best is not None:
                        late = True
                        break
                    units, unit_of = _units(ctx, graph, pins)
                    if any(not u.choices for u in units.values()):
                        continue  # the pins leave this unit nothing on this mesh
                    need = min_memory(units, pp) + _gathered_estimate(ctx, graph, pp)
                    if need > usable_bytes(profile) and not lift_memory:
                        leanest = min(leanest, need)
                        continue  # cannot fit: skip the solve
                    try:
                        cand = _solve(ctx, graph, units, unit_of, max(left, 1.0) if left else None,
                                      pp, schedules, lift_memory)
                    except InfeasibleError as e:
                        # only a layout memory rules out is "leanest": the bound ``need``
                        # fit here, so it is no measure of what one that does not fit needs
                        if e.kind == "memory":
                            leanest = min(leanest, max(need, e.need or 0.0))
                        else:
                            conflicts.append((e.kind, f"{label}: {e}"))
                            conflict = str(e)
                        continue
                    if found is None or cand.prediction.time.step_time_s < found.prediction.time.step_time_s:
                        found = cand
                    fewest_fits = fewest_fits or (ckpt == "none" and m == micro[0])
                    solved += 1
                    if solved == (1 if pp == 1 else 2):
                        break
                if late:
                    break
                if fewest_fits:
                    break  # no recomputation fits at the fewest micro-batches: checkpointing cannot be faster
            if not found:
                note = (SKIPPED_BY_TIME_LIMIT if late else f"no layout found ({conflict})" if conflict
                        else "nothing fits")
                alternatives.append(Alternative(mesh=mesh_d, step_time_s=None, fits=False, note=f"{label}: {note}"))
                progress(f"  {label}: {'no layout fits' if note == 'nothing fits' else note}")
                continue
            p = found.prediction
            extra = f", schedule={found.schedule}" if found.pp > 1 else ""
            alternatives.append(Alternative(
                mesh=mesh_d, step_time_s=p.time.step_time_s, peak_memory_bytes=p.memory.total,
                fits=p.memory.fits,
                note=f"{label}, checkpointing={found.ctx.checkpointing}, "
                     f"microbatches={found.ctx.microbatches}{extra}"))
            progress(f"  {label}: {p.time.step_time_s * 1e3:.1f} ms/step, "
                     f"{binary_size(p.memory.total, 1)}/device")
            if best is None or p.time.step_time_s < best.prediction.time.step_time_s:
                best = found
    return Searched(best, alternatives, leanest, blocked, conflicts)


def _lead(cand: Candidate) -> tuple[str, ...]:
    """Placements on the pp dim: stages hold different layers, nothing is split across it."""
    return ("R",) if cand.pp > 1 else ()


def _parameters(graph: nx.DiGraph, cand: Candidate) -> list[ParameterPlacement]:
    """Placements at rest: the ILP's compute placements, with FSDP's shard written on
    fully-sharded data-parallel dims (where FSDP2 keeps parameters between uses): dim 0,
    or the dim ``fsdp_shard`` cuts a parameter with fewer rows than ranks on."""
    ctx = cand.ctx
    ndim = len(ctx.mesh_shape)
    placed: dict[str, tuple[str, ...]] = {}
    for c in cand.solution.choice.values():
        for fqn, pl in c.weights.items():
            placed[fqn_pattern(fqn)] = pl
    out: dict[str, tuple[str, ...]] = {}
    for fqn, shape in graph.graph["param_shapes"].items():
        pat = fqn_pattern(fqn)
        pl = placed.get(pat, ("R",) * ndim)
        cut = f"S({fsdp_shard(ctx, shape, pl)[0]})"
        out[pat] = tuple(cut if name in ctx.fsdp else p for name, p in zip(ctx.mesh_names, pl))
    return [ParameterPlacement(fqn=k, placements=[*_lead(cand), *v]) for k, v in out.items()]


def _settled(graph: nx.DiGraph, cand: Candidate, unit_of: dict[str, str], key: str) -> tuple[str, ...]:
    """The layout anchor ``key``'s output leaves its module in: its own, unless every
    consumer needs it in one other layout, which the ILP prices as one reshard of the
    tensor.  The executor can only redistribute at module boundaries, and where no
    module boundary converts it, DTensor converts the tensor for each op that reads it:

    * a pending sum (a row-parallel product, a vocabulary-parallel embedding) leaving a
      module is reduced (all-reduce), and the residual add that consumes ``o_proj``'s sum
      is no module, so the plan has the module hand it over already in the layout wanted
      there (sequence parallel: one reduce-scatter, not an all-reduce);
    * a fused q/k/v product split by features (Phi-3's ``qkv_proj``) is sliced three
      times: three all-gathers of the whole product where the plan priced one.

    But where elementwise ops alone lead from the output to a norm module (BitNet's gate
    and up products, through ``act(gate) * up``, to its sub-norm), DTensor runs them on
    the shards and the norm's boundary converts their result once: converting at the
    outputs would gather both products instead of one (the plan prices both; it cannot
    cut a segment between the elementwise ops and the norm)."""
    out = cand.solution.choice[key].out
    if "P" not in out and _ends_in_a_norm(graph, cand.units[key].nodes):
        return out
    consumers = {unit_of[v] for n in cand.units[key].nodes for v in graph.successors(n)
                 if unit_of.get(v, key) != key}
    needed = {(cand.solution.choice[k].inp if cand.units[k].kind == "anchor"
               else cand.solution.choice[k].out) for k in consumers}
    return needed.pop() if len(needed) == 1 else out


def _ends_in_a_norm(graph: nx.DiGraph, nodes: list[str]) -> bool:
    """Whether every path out of ``nodes`` reaches a norm module through elementwise ops
    alone (``_settled``)."""
    norms = {d["module"] for _, d in graph.nodes(data=True) if d["kind"] == "call_function" and norm_module_node(d)}
    inside = set(nodes)
    front = [v for n in nodes for v in graph.successors(n) if v not in inside]
    seen: set[str] = set()
    while front:
        v = front.pop()
        if v in seen:
            continue
        seen.add(v)
        d = graph.nodes[v]
        if d.get("module") in norms:
            continue
        if d.get("short") not in ELEMENTWISE | {"to"} and not _pointwise(d.get("op", "")):
            return False
        front.extend(graph.successors(v))
    return bool(seen)


@functools.cache
def _pointwise(op: str) -> bool:
    """Whether traced op ``aten.<name>.<overload>`` carries torch's pointwise tag (BitNet's
    ``square`` after ``relu``)."""
    parts = op.split(".")
    packet = getattr(torch.ops.aten, parts[1], None) if len(parts) == 3 and parts[0] == "aten" else None
    overload = getattr(packet, parts[2], None) if packet is not None else None
    return overload is not None and torch.Tag.pointwise in overload.tags


_RESHAPES = {"view", "_unsafe_view", "reshape"}


def _boundary_shapes(graph: nx.DiGraph, key: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of product ``key``'s input and output where its module takes and gives
    them.  GPT-2's Conv1D flattens its input to 2-D for ``addmm`` and views the product
    back inside the module: placed by the 2-D shapes, the features' dim (``S(1)``) named
    the 3-D boundary tensors' sequence dim, and the executor re-laid c_fc's output by
    sequence and gathered it again for c_proj (6 all-gathers per layer in the forward
    under tp 2, now 1: the q/k/v split's)."""
    d = graph.nodes[key]
    if d["short"] != "addmm":
        return d["in_shapes"][0], d["shape"]
    flat = graph.nodes[d["in_nodes"][1]]  # addmm(bias, x, weight)
    inp = flat["in_shapes"][0] if flat.get("short") in _RESHAPES else d["in_shapes"][1]
    back = [graph.nodes[v]["shape"] for v in graph.successors(key) if graph.nodes[v].get("short") in _RESHAPES]
    return inp, back[0] if back else d["shape"]


def _modules(graph: nx.DiGraph, cand: Candidate) -> list[ModuleLayout]:
    """Module boundaries where the layout is not plain data parallel (what apply reshards).

    Batch rows split on a model dim (``B`` on tp: the layer runs as data parallel there)
    are not plain: apply slices the batch on the data-parallel dims only, and a module
    left out would run its whole micro-batch on every rank of that dim."""
    seq = cand.ctx.seq_len
    out: dict[str, ModuleLayout] = {}
    model_dims = any(cand.ctx.mesh_shape[i] > 1 for i in cand.ctx.free_dims)
    plain = None if model_dims else tuple("B" for _ in cand.ctx.mesh_shape)
    unit_of = {n: k for k, u in cand.units.items() for n in u.nodes}
    # in graph order: a module holding several products (Mixtral's experts: gate_up, then
    # down) takes its input from the first and its output from the last
    order = {n: i for i, n in enumerate(nx.topological_sort(graph))}
    for key, c in sorted(cand.solution.choice.items(), key=lambda kc: order[kc[0]]):
        u = cand.units[key]
        d = graph.nodes[key]
        if not u.module or (c.inp == plain and c.out == plain):
            continue
        if u.kind == "anchor" and d["short"] != "scaled_dot_product_attention":
            in_shape, out_shape = _boundary_shapes(graph, key)
            inp = ([*_lead(cand), *(_at_boundary(x, in_shape, seq, d["short"]) for x in c.inp)]
                   if d["short"] != "embedding" else None)
            outp = [*_lead(cand), *(_at_boundary(x, out_shape, seq, d["short"])
                                    for x in _settled(graph, cand, unit_of, key))]
            pat = fqn_pattern(u.module)
            first = out.get(pat)
            out[pat] = ModuleLayout(module=pat, input=first.input if first else inp, output=outp)
        elif u.kind == "segment":
            for n in u.nodes:
                nd = graph.nodes[n]
                if norm_module_node(nd):
                    pl = [*_lead(cand), *(concrete(x, nd["shape"], seq) for x in c.out)]
                    pat = fqn_pattern(nd["module"])
                    out[pat] = ModuleLayout(module=pat, input=pl, output=pl)
    _lift_inputs(graph, cand, out)
    return list(out.values())


def _at_boundary(layout: str, shape: tuple[int, ...], seq: int, op: str) -> str | None:
    """``concrete``'s placement at an anchor's module boundary, where a linear's features
    are its last dim whatever its rank (a 4-D input ``[b, s, heads, d]``, whose heads
    ``concrete`` names; DeepSeek's kv_b_proj reads a 4-D latent ``[b, 1, s, r]``, which
    it wrote S(1) before a one-sized heads dim meant the features)."""
    if op in ("linear", "addmm") and layout == "H" and len(shape) >= 2:
        return f"S({len(shape) - 1})"
    return concrete(layout, shape, seq)


def _lift_inputs(graph: nx.DiGraph, cand: Candidate, out: dict[str, ModuleLayout]) -> None:
    """A module whose input only its children's projections read, all wanting one layout
    (q/k/v of an attention, gate/up of an MLP), takes that layout as its own input too:
    the conversion then happens where the module is entered, as in TorchTitan's plan, and
    the module's own code sees the converted tensor (HF attention reads its input's
    shape, which under sequence parallelism the executor's local regions would see
    sharded).  The same one reshard the ILP priced; the children's layouts stay."""
    readers: dict[tuple[str, str], list[tuple[str, list[str]]]] = {}  # (parent, source) -> anchors
    for key in cand.solution.choice:
        module = cand.units[key].module
        layout = out.get(fqn_pattern(module)) if module and cand.units[key].kind == "anchor" else None
        if layout is None or layout.input is None or "." not in module:
            continue
        for src in graph.predecessors(key):
            if not graph.nodes[src].get("is_param"):
                readers.setdefault((module.rsplit(".", 1)[0], src), []).append((key, layout.input))
    for (parent, src), anchors in readers.items():
        inside = {v for v in graph.successors(src) if _under(graph.nodes[v]["module"], parent)}
        if (_under(graph.nodes[src]["module"], parent) or inside != {key for key, _ in anchors}
                or len({tuple(inp) for _, inp in anchors}) != 1):
            continue
        pattern = fqn_pattern(parent)
        out.setdefault(pattern, ModuleLayout(module=pattern, input=anchors[0][1]))


def _under(module: str, parent: str) -> bool:
    return module == parent or module.startswith(parent + ".")


def _unsupported(graph: nx.DiGraph) -> dict[str, int]:
    from planner.strategies import ANCHOR_OPS, VIEW_OPS, activation_nodes

    known = ANCHOR_OPS | VIEW_OPS | REDUCING_OPS | ELEMENTWISE
    counts: dict[str, int] = {}
    for n in activation_nodes(graph):
        op = graph.nodes[n]["short"]
        if op not in known:
            counts[graph.nodes[n]["op"]] = counts.get(graph.nodes[n]["op"], 0) + 1
    return counts


ELEMENTWISE = {"add", "sub", "mul", "div", "neg", "pow", "rsqrt", "silu", "gelu", "tanh", "sigmoid",
               "exp", "log", "relu", "dropout", "cat", "where", "masked_fill", "index", "type_as",
               "new_ones", "ones_like", "zeros_like", "empty_like", "clamp", "abs", "sqrt"}


def default_shape(model: Any, devices: int, batch_size: int | None = None,
                  seq_len: int | None = None) -> tuple[int, int]:
    """(batch_size, seq_len) with the defaults filled in: one sequence per device
    (divisible by any data-parallel degree) and ``default_seq_len``.  The service and
    the CLI fill their defaults here too, so all agree."""
    return (devices if batch_size is None else batch_size), (
        default_seq_len(model) if seq_len is None else seq_len)


def _positive_ints(optional: bool = False, **values: Any) -> None:
    """Refuse, by name, a value that is not a positive int (a bool is not; None is where
    ``optional``)."""
    for name, value in values.items():
        if (value is not None or not optional) and (isinstance(value, bool) or not isinstance(value, int)
                                                    or value < 1):
            raise PlanningError(f"{name}: must be a positive integer, got {value!r}")


def _resolve(model: Any, devices: int, profile: Any, batch_size: int | None,
             seq_len: int | None, say: Progress | None = None) -> tuple[nx.DiGraph, Profile, int, int, Any]:
    """Graph, profile and workload, the cheap checks before the trace (``say``: its progress line)."""
    _positive_ints(devices=devices)
    try:
        prof = load_profile(profile)
    except ValidationError as e:  # pydantic's multi-line text with URLs, as the CLI and HTTP name it
        raise PlanningError("\n".join(f"profile.{line}" for line in problem_lines(e))) from None
    if prof.max_devices is not None and devices > prof.max_devices:
        raise PlanningError(f"devices: {devices} exceeds the {prof.max_devices} devices profile {prof.name!r} describes")
    _positive_ints(optional=True, batch_size=batch_size, seq_len=seq_len)
    config = None if hasattr(model, "named_parameters") else load_config(model)
    batch, seq_len = default_shape(config if config is not None else model, devices, batch_size, seq_len)
    dtype = _training_dtype(prof)
    if say is not None:
        say(f"tracing {model if isinstance(model, str) else type(model).__name__} ...")
    fused = prof.device_type == "cuda"  # a GPU's fused kernels (the delta rule's), not the CPU's fallbacks
    graph = _trace_named(model, _config_key(config), seq_len, dtype, fused) if isinstance(model, str) else trace(
        config if config is not None else model, 1, seq_len, dtype, fused)
    return graph, prof, batch, seq_len, config


def _traced(graph: nx.DiGraph, t0: float) -> str:
    """The progress line after the trace (started at ``t0``)."""
    return (f"traced {totals(graph)['nodes']} nodes ({graph.graph['traced_layers']} of "
            f"{graph.graph['layers']} layers exported) in {time.perf_counter() - t0:.1f}s")


def _config_key(config: Any) -> str:
    """The loaded config as JSON, part of the trace cache's key: a config file (or a
    directory's config.json) edited between two plans of one process is traced again."""
    return json.dumps(config.to_dict(), sort_keys=True, default=str)


@functools.lru_cache(maxsize=8)
def _trace_named(model: str, config: str, seq_len: int, dtype: torch.dtype, fused: bool) -> nx.DiGraph:
    """Graphs of named models are reused: a plan and the estimates that check it, or a
    service worker answering many requests, trace each (model, seq_len, dtype) once.
    Keyed by the ``config`` it names too: a config file edited between two plans of one
    process was planned as the model it described first (review).  Callers never mutate
    the graph."""
    return trace(model, 1, seq_len, dtype, fused)


def plan(model: Any, devices: int, profile: Any = "h100-sxm-80g", batch_size: int | None = None,
         seq_len: int | None = None, mesh: Mapping[str, int] | None = None,
         constraints: Sequence[Mapping[str, Any]] | None = None, time_limit_s: float | None = None,
         progress: Progress | None = None) -> Plan:
    """Plan ``model`` on ``devices`` devices of ``profile`` (see SPEC.md).

    ``constraints``: pins, each ``{"param": pattern, "placements": [...]}``; the parameters
    the pattern matches (an FQN, or the plan's ``*`` pattern of repeated blocks, e.g.
    ``model.layers.*.mlp.up_proj.weight``) take those placements, one per mesh dim (``R``,
    ``S(d)``), on every mesh searched.  A pattern that matches no parameter, or a pin no
    mesh can take, raises :class:`PlanningError` naming it."""
    say = progress or (lambda _msg: None)
    if time_limit_s is not None and (isinstance(time_limit_s, bool) or not isinstance(time_limit_s, (int, float))
                                     or not math.isfinite(time_limit_s) or time_limit_s <= 0):
        raise PlanningError(f"time_limit_s: must be a positive number of seconds, got {time_limit_s!r}")
    if mesh is not None:
        _check_mesh(mesh, devices)  # before the trace; mesh_candidates checks the rest against the model
    t0 = time.perf_counter()
    graph, prof, batch, seq, config = _resolve(model, devices, profile, batch_size, seq_len, say)
    divisor = _feature_divisor(graph, config) if config is not None else 1
    meshes = mesh_candidates(devices, prof, divisor, graph.graph["layers"], mesh, pipeline_blocker(graph))
    pins = _constraint_pins(constraints, graph.graph["param_shapes"],
                            {tuple(n[1:] if n[0] == "pp" and sh[0] > 1 else n) for n, sh in meshes})
    say(f"{_traced(graph, t0)}; searching {len(meshes)} mesh shape(s)")
    found = _search(graph, prof, devices, batch, seq, meshes, divisor, time_limit_s, say, pins=pins)
    best = found.best
    if best is None and pins is not None and pins.emptied:
        raise PlanningError(f"{sorted(pins.emptied)[0]} on any mesh tried")
    # a forced tp the head counts do not divide is searched (its ranks may still split the
    # MLPs or the batch), but attention cannot split over it: say so, as estimate refuses it
    forced_tp = (mesh or {}).get("tp", 1)
    heads = (f"tp={forced_tp} does not divide {_heads_text(config, forced_tp)}, so attention cannot split "
             "over it" if forced_tp > 1 and divisor % forced_tp else None)
    if best is None or not best.prediction.memory.fits:
        raise PlanningError(_nothing_fits(model, devices, prof, len(meshes), found)
                            + (f"; note: {heads}" if heads else ""))
    total = time.perf_counter() - t0
    say(f"best: {'x'.join(f'{n}={s}' for n, s in zip(best.ctx.mesh_names, best.ctx.mesh_shape))}"
        f"{(' fsdp' if best.ctx.fsdp else ' replicate') if best.ctx.data_ranks > 1 else ''}"
        f"{f' pp={best.pp} ' + best.schedule if best.pp > 1 else ''}, "
        f"{best.prediction.time.step_time_s * 1e3:.1f} ms/step ({total:.1f}s)")
    # in the plan as well, where a service client (who sees no progress lines) reads them
    notes = [heads] if heads else []
    if (mesh or {}).get("pp") == 1:  # dropped by mesh_candidates, where a size-1 dp or tp stays: said
        notes.append("pp=1 is no pipeline: the plan's mesh has no pp dim")
    notes += [f"{name} splits nothing in this plan: every one of its ranks runs the same work (on "
              f"{prof.name} no split of this model paid for its communication); fewer devices would do as well"
              for name in _idle_dims(best)]
    for note in notes:
        say(f"note: {note}")
    return _assemble(model, graph, prof, devices, best, found.alternatives, total, notes)


def _idle_dims(cand: Candidate) -> list[str]:
    """Model dims on which no parameter and no activation of the solution is split."""
    ctx = cand.ctx
    return [f"{name}={size}" for i, (name, size) in enumerate(zip(ctx.mesh_names, ctx.mesh_shape))
            if i in ctx.free_dims and size > 1 and all(
                c.out[i] == "R" and c.inp[i] == "R" and all(pl[i] == "R" for pl in c.weights.values())
                for c in cand.solution.choice.values())]


def _nothing_fits(model: Any, devices: int, prof: Profile, meshes: int, found: Searched) -> str:
    """Why no layout was found, naming the field to change: the batch when it cannot be
    split over any mesh tried, memory when no split layout fits, both when each ruled out some."""
    blocked = "; ".join(found.batch_blocked)
    if len(found.batch_blocked) == meshes:
        return f"batch_size: no mesh tried can split the batch: {blocked}"
    if found.leanest == math.inf and found.conflicts:
        kinds, why = {kind for kind, _ in found.conflicts}, found.conflicts[0][1]
        memory = (f"time_limit_s: no layout of {model_label(model)} was found in the time given ({why}); "
                  "give the solver more time" if kinds == {"time"}
                  else f"devices: no layout of {model_label(model)} was found ({why})")
    else:
        memory = f"devices: no layout of {model_label(model)} fits on {devices} x {prof.name}{found.need(prof)}"
    return f"{memory}; batch_size rules out the other meshes: {blocked}" if blocked else memory


def _flat_tokens(graph: nx.DiGraph, units: Sequence[Unit]) -> str:
    """What keeps a residual stream's segment from a sequence layout: an op on tokens
    flattened into one dim (GPT-2's Conv1D views the hidden states as ``[tokens, features]``,
    Mixtral's router works on ``[tokens, experts]``), traced in the norm's segment since no
    product lies between them."""
    for unit in units:
        for n in unit.nodes:
            d = graph.nodes[n]
            if len(d["shape"]) < 3:
                return f"{d['short']} to {list(d['shape'])} in {d['module'] or 'the model'}"
    return "ops whose tensors have no sequence dim"


def model_label(model: Any) -> str:
    from planner.presets import model_name

    return model_name(model)


def _assemble(model: Any, graph: nx.DiGraph, prof: Profile, devices: int, best: Candidate,
              alts: list[Alternative], total_s: float, notes: Sequence[str] = ()) -> Plan:
    ctx, sol = best.ctx, best.solution
    dims = [MeshDim(name=n, size=s) for n, s in zip(ctx.mesh_names, ctx.mesh_shape)]
    pipeline = None
    if best.pp > 1:
        dims.insert(0, MeshDim(name="pp", size=best.pp))
        v = best.virtual_stages
        pipeline = Pipeline(schedule=best.schedule, virtual_stages=v, stages=[
            PipelineStage(index=i, modules=mods,  # the rank's time (what the split balances), per virtual stage
                          predicted_time_s=(st.cost.forward_compute_s + st.cost.backward_compute_s
                                            + st.cost.blocking_comm_s) / v)
            for i, (st, mods) in enumerate(zip([s for _ in range(v) for s in best.stages],
                                               stage_modules(graph, best.stages, v)))])
    return Plan(
        schema_version=SCHEMA_VERSION, model=model_label(model), profile=prof.name, devices=devices,
        batch_size=ctx.batch_size, seq_len=ctx.seq_len, mesh=Mesh(dims=dims, device_type=prof.device_type), pipeline=pipeline,
        parameters=_parameters(graph, best), modules=_modules(graph, best),
        data_parallel=[DataParallelDim(dim="dp", mode="fully_shard" if ctx.fsdp else "replicate")]
        if "dp" in ctx.mesh_names else [],
        microbatches=ctx.microbatches, activation_checkpointing=ctx.checkpointing,
        prediction=best.prediction,
        fingerprint=Fingerprint.of(graph.graph["param_shapes"].items()),
        solver=SolverStats(solver=sol.solver, status=sol.status, variables=sol.variables,
                           constraints=sol.constraints, solve_time_s=sol.solve_time_s,
                           total_time_s=total_s, objective=sol.objective, gap=sol.gap,
                           unsupported_ops=_unsupported(graph), alternatives=alts, notes=list(notes)),
    )


@dataclass
class _Pins:
    """User pins: ``{"param": pattern, "placements": [...]}`` keeps only matching choices;
    ``emptied`` says which pin left a unit no choice (its mesh is then skipped)."""

    rules: list[tuple[str, tuple[str, ...]]]
    emptied: set[str] = field(default_factory=set)

    def __call__(self, unit: Unit) -> None:
        for i, (pattern, placements) in enumerate(self.rules):
            keep = [ch for ch in unit.choices
                    if all(pl == placements for f, pl in ch.weights.items() if _pinned(pattern, f))]
            if unit.choices and not keep:
                self.emptied.add(f"constraints.{i}: no placement of {unit.module or unit.key} takes "
                                 f"{pattern} as {list(placements)}")
            unit.choices = keep


def _pinned(pattern: str, fqn: str) -> bool:
    return pattern_matches(pattern, fqn) or pattern_matches(pattern, fqn_pattern(fqn))


def _constraint_pins(constraints: Sequence[Mapping[str, Any]] | None, fqns: Iterable[str],
                     meshes: set[tuple[str, ...]]) -> _Pins | None:
    """The pins, each checked against the model's parameters and the ``meshes`` searched
    (their dims but pp's): a placement of the wrong form or count read "no placement
    ... takes ... on any mesh tried", which did not say which (review)."""
    if not constraints:
        return None
    rules, fqns = [], list(fqns)
    for i, c in enumerate(constraints):
        if not isinstance(c, Mapping) or set(c) != {"param", "placements"}:
            raise PlanningError(f"constraints.{i}: expected {{'param': pattern, 'placements': [...]}}")
        placements = c["placements"]
        if isinstance(placements, str) or not isinstance(placements, Sequence):
            raise PlanningError(f"constraints.{i}.placements: expected a list of placements, got {placements!r}")
        bad = next((p for p in placements if not (isinstance(p, str) and re.fullmatch(r"R|S\(\d+\)", p))), None)
        if bad is not None:
            raise PlanningError(f"constraints.{i}.placements: {bad!r} is not a placement (R or S(d))")
        if all(len(placements) != len(names) for names in meshes):
            dims = " or ".join(sorted({", ".join(names) for names in meshes}, key=len))
            raise PlanningError(f"constraints.{i}.placements: {len(placements)} given; one per mesh dim ({dims})")
        pattern = str(c["param"])
        if not any(_pinned(pattern, f) for f in fqns):
            names = sorted({fqn_pattern(f) for f in fqns})
            close = difflib.get_close_matches(pattern, names, n=1)
            raise PlanningError(f"constraints.{i}.param: {pattern} matches no parameter of the model"
                                + (f"; did you mean {close[0]}?" if close else f" (one is {names[0]})" if names else ""))
        rules.append((pattern, tuple(c["placements"])))
    return _Pins(rules)


def estimate(model: Any, devices: int, profile: Any = "h100-sxm-80g", dp: int = 1, tp: int = 1,
             pp: int = 1, fsdp: bool = False, sp: bool = False, microbatches: int | None = None,
             checkpointing: str = "none", schedule: str | None = None, virtual_stages: int = 1,
             batch_size: int | None = None, seq_len: int | None = None, require_fit: bool = True,
             progress: Progress | None = None) -> Prediction:
    """Predicted step time and memory of a hand layout (TorchTitan/Megatron style);
    ``require_fit`` and ``progress`` as in :func:`hand_plan`."""
    return hand_plan(model, devices, profile, dp=dp, tp=tp, pp=pp, fsdp=fsdp, sp=sp,
                     microbatches=microbatches, checkpointing=checkpointing, schedule=schedule,
                     virtual_stages=virtual_stages, batch_size=batch_size, seq_len=seq_len,
                     require_fit=require_fit, progress=progress).prediction


def hand_plan(model: Any, devices: int, profile: Any = "h100-sxm-80g", dp: int = 1, tp: int = 1,
              pp: int = 1, fsdp: bool = False, sp: bool = False, microbatches: int | None = None,
              checkpointing: str = "none", schedule: str | None = None, virtual_stages: int = 1,
              batch_size: int | None = None, seq_len: int | None = None, require_fit: bool = True,
              progress: Progress | None = None) -> Plan:
    """The plan of a hand layout (TorchTitan/Megatron style: projections column- then
    row-parallel on tp, norms and the residual stream sequence-parallel with ``sp``),
    with the prediction ``estimate`` reports for it.  ``schedule`` (default 1f1b) needs a
    pipeline, ``fsdp`` a dp dim and ``sp`` a tp dim: each is refused without, as it would
    change nothing.

    A layout that does not fit in memory raises PlanningError, unless ``require_fit`` is
    False: then it is priced with the memory bound lifted and comes back with
    ``prediction.memory.fits`` False, so that ``estimate --json`` can report what it needs.
    ``microbatches`` defaults to ``pp``, the fewest that keep every stage busy.
    ``progress`` gets a line before and after the trace, the slow part for a large model."""
    t0 = time.perf_counter()
    microbatches = pp if microbatches is None else microbatches
    _positive_ints(devices=devices, dp=dp, tp=tp, pp=pp, microbatches=microbatches,  # dp="2" was a TypeError
                   virtual_stages=virtual_stages)
    given_schedule, schedule = schedule, schedule or "1f1b"
    if schedule not in ("gpipe", "1f1b", "interleaved-1f1b"):
        raise PlanningError(f"schedule: expected gpipe, 1f1b or interleaved-1f1b, got {schedule!r}")
    if virtual_stages > 1 and pp == 1:  # first: without a pipeline no schedule helps
        raise PlanningError(f"virtual_stages: {virtual_stages} needs a pipeline (pp > 1)")
    if virtual_stages > 1 and schedule != "interleaved-1f1b":
        raise PlanningError(f"virtual_stages: {virtual_stages} needs schedule interleaved-1f1b")
    if schedule == "interleaved-1f1b" and virtual_stages < 2 and pp > 1:
        # with one stage per rank there is nothing to interleave (the search pairs the schedule
        # with 2, planner.pipeline.SCHEDULES); it was accepted and priced as interleaved (audit)
        raise PlanningError(f"virtual_stages: interleaved-1f1b needs at least 2 stages per rank, got "
                            f"{virtual_stages}; with one, the schedule is 1f1b")
    if given_schedule is not None and pp == 1:
        raise PlanningError(f"schedule: {given_schedule} needs a pipeline (pp > 1)")
    if fsdp and dp == 1:
        raise PlanningError("fsdp: shards over the data-parallel dim, and dp is 1")
    if sp and tp == 1:
        raise PlanningError("sp: shards the sequence over the tensor-parallel dim, and tp is 1")
    if dp * tp * pp != devices:
        raise PlanningError(f"devices: dp*tp*pp = {dp * tp * pp}, but devices={devices}")
    if pp > 1 and microbatches < pp:
        raise PlanningError(f"microbatches: {microbatches} < pp={pp} leaves pipeline stages idle")
    if checkpointing not in ("none", "selective", "full"):
        raise PlanningError(f"checkpointing: expected none, selective or full, got {checkpointing!r}")
    graph, prof, batch, seq, config = _resolve(model, devices, profile, batch_size, seq_len, progress)
    if progress is not None:
        progress(f"{_traced(graph, t0)}; pricing the layout")
    if batch % (dp * microbatches):
        raise PlanningError(f"batch_size: {batch} is not divisible by dp*microbatches = {dp * microbatches}")
    divisor = _feature_divisor(graph, config) if config is not None else 1
    if tp > 1 and divisor % tp:
        raise PlanningError(f"tp: {tp} does not divide {_heads_text(config, tp)}")
    if sp and seq % tp:
        raise PlanningError(f"seq_len: {seq} is not divisible by tp={tp}; sequence parallelism splits "
                            "each sequence over the tensor-parallel ranks")
    if pp > graph.graph["layers"]:
        raise PlanningError(f"pp: {pp} exceeds the model's {graph.graph['layers']} layers")
    if pp > 1 and (why := schedule_blocker(graph.graph["layers"], pp, microbatches, schedule, virtual_stages)):
        raise PlanningError(why)
    if pp > 1 and (why := pipeline_blocker(graph)):
        raise PlanningError(f"pp: the model cannot be cut into pipeline stages ({why})")
    names, shape = (("dp", "tp"), (dp, tp)) if tp > 1 else (("dp",), (dp,))
    if pp > 1:
        names, shape = ("pp", *names), (pp, *shape)

    def hand(unit: Unit) -> None:
        if tp == 1:
            return
        if unit.kind == "anchor":
            if unit.choices and not unit.choices[0].weights:
                return  # attention: heads sharded where its inputs arrive so, as DTensor runs it
            # a linear is named by its module (q_proj.weight), a fused MoE product by its
            # parameter (Mixtral's experts.gate_up_proj / experts.down_proj, one module)
            names = [unit.module, *(unit.choices[0].weights if unit.choices else ())]
            leaves = [name.rsplit(".", 1)[-1] for name in names]
            want = ("col" if any(_COLWISE.search(leaf) for leaf in leaves)
                    else "row" if any(_ROWWISE.search(leaf) for leaf in leaves) else "rep")
            # a dimension tp does not divide (GPT-2's 50257-token vocabulary under the
            # vocabulary-parallel embedding and head) leaves that module replicated
            unit.choices = ([c for c in unit.choices if c.name == want]
                            or [c for c in unit.choices if c.name == "rep"])
        else:
            if not any(c.name == "H" for c in unit.choices):
                # the residual stream and its norms sequence-parallel with sp (TorchTitan's
                # SequenceParallel); anything else without heads replicated (GPT-2's q/k/v
                # split, whose input is the flat 2-D product and cannot be cut by sequence)
                stream = any(norm_module_node(graph.nodes[n]) for n in unit.nodes)
                want = "Q" if sp and stream and any(c.name == "Q" for c in unit.choices) else "R"
                unit.choices = [c for c in unit.choices if c.name == want]
                if stream:
                    streams.append((unit, want))

    streams: list[tuple[Unit, str]] = []  # the residual stream's segments, as pinned
    fixed = {"fsdp": fsdp, "checkpointing": checkpointing, "microbatches": microbatches,
             "schedules": ((schedule, virtual_stages),)}

    def search(lift_memory: bool) -> Searched:
        return _search(graph, prof, devices, batch, seq, [(names, shape)], divisor, None,
                       lambda _m: None, fixed=fixed, pins=hand, lift_memory=lift_memory)

    found = search(lift_memory=False)
    if sp and not (streams and all(want == "Q" for _, want in streams)):
        raise PlanningError(f"sp: {model_label(model)}'s norms are traced in one segment with "
                            f"{_flat_tokens(graph, [u for u, want in streams if want != 'Q'])}, which the planner cannot "
                            "split by sequence: sequence parallelism is not available for this model")
    if found.best is None and not found.conflicts:
        # only now: a layout that fits keeps the bound's choices.  With the bound lifted the
        # layout may still fit: the ILP bounds a pipeline's memory by states / pp plus one
        # micro-batch of every layer's activations, which the stages priced one by one can
        # undercut (estimate said Qwen3-30B-A3B pp16 x tp4 fits in 69.7 GiB, hand_plan that
        # it does not; review)
        lifted = search(lift_memory=True)
        if lifted.best is not None and (not require_fit or lifted.best.prediction.memory.fits):
            found = lifted
        elif lifted.best is not None:  # what estimate prices for this layout, not the ILP's bound
            found.leanest = lifted.best.prediction.memory.total
    if found.best is None and found.leanest == math.inf and found.conflicts:
        raise PlanningError(f"devices: this layout has no consistent placement ({found.conflicts[0][1]})")
    if found.best is None:
        raise PlanningError(f"devices: this layout does not fit{found.need(prof)}")
    return _assemble(model, graph, prof, devices, found.best, [], time.perf_counter() - t0)
