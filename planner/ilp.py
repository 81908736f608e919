"""The placement ILP, solved with PuLP (HiGHS where installed, else CBC).

Formulation (units and choices from ``planner.strategies``):

    x[u,c] in {0,1}     unit u (anchor or segment) takes choice c;  sum_c x[u,c] = 1
    z[t,l] in {0,1}     tensor t is needed in layout l by some consumer:
                        x[v,c] <= z[t, in_layout(v,c)]  for every consumer v of t
    w[t,s,l] >= 0       t is produced in layout s and needed in l (linearised AND):
                        w[t,s,l] >= sum_{c: out(c)=s} x[producer(t),c] + z[t,l] - 1
    p[t,l,D] in {0,1}   t is needed in layout l by a column-parallel consumer, so its
                        gradient comes back Partial on dims D (Megatron's f):
                        x[v,c] <= p[t, in_layout(v,c), D(c)]
    minimise  sum x[u,c] (compute + collectives inside c (the vocab-parallel loss's)
                          + gradient sync + FSDP gathers + optimizer step
                          + reducing gradients its split activations leave Partial)
            + sum w[t,s,l] * reshard(t, s -> l)             (forward + backward, + the
                        forward again where a checkpointed layer recomputes t)
            + sum w'[t,s,l,D] * partial_grad(t, s -> l, D)   (the backward's reduction;
                        w' linearises x[producer, s] AND p[t,l,D] like w)
            - sum d[t,s,l] * (reshard(t, s -> l) - reshard(t, sum(s) -> l))
                        (a pending sum s also needed summed, sum(s), is converted to the
                        other layouts from that: summed_first; d in [0, 1] is bounded by
                        x[producer, s], z[t,l] and z[t,sum(s)], and the minimisation
                        takes it wherever all three hold)
    s.t.      sum x[u,c] (weights + grads + optimizer + in-flight activations)
                  <= usable memory per device              (bytes, not counts)
              tied parameters, and a pattern's parameters, take one placement across
                  their uses
              a unit that does not cut replicated inputs itself takes a sharded
                  layout only where some input arrives in it (_forbid_unmade_chunks)
              the loss is vocabulary-sharded (H) on a mesh dim exactly where its
                  logits arrive so (_loss_takes_logits_as_they_arrive)
              user pins remove the choices that contradict them.

Repeated layers share variables: units and tensors are keyed by their counterpart
in the first traced layer, with costs multiplied by how many real layers they
stand for.  One reshard per (tensor, layout) is paid however many consumers need it
(z), which is what the executor does at module boundaries.  Communication is
summed as if exposed here; ``planner.search`` composes the chosen solution with
``cost_model.step`` (overlap, bubble) for the reported step time.
"""

from __future__ import annotations

import functools
import math
import os
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Literal

import networkx as nx
import pulp

from cost_model.comm import partial_gradient_target, redistribute_cost, redistribute_time
from cost_model.memory import state_bytes_per_param
from cost_model.step import optimizer_time
from planner.strategies import Choice, Context, Unit, concrete, layer_kinds
from planner.tracer import floating

# A step time no profile of a real machine can give (~30,000 years): past it a number in
# the profile is out of range, e.g. a bus bandwidth of 1e-300 B/s.
ABSURD_S = 1e12


class InfeasibleError(ValueError):
    """No choice assignment was found.  ``kind`` says why, which decides what a message may
    call it: ``memory``, none fits (``need``: the bytes per device the leanest needs, where
    known); ``conflict``, none meets the other constraints (tied parameters the pins place
    apart, a unit the pins leave no choice); ``time``, the solver's time limit ran out
    before it found one."""

    def __init__(self, message: str, need: float | None = None,
                 kind: Literal["memory", "conflict", "time"] = "memory") -> None:
        super().__init__(message)
        self.need = need
        self.kind = kind


@dataclass
class Solution:
    choice: dict[str, Choice]  # unit key -> chosen choice
    objective: float
    status: str
    solver: str
    variables: int
    constraints: int
    solve_time_s: float
    gap: float | None
    reshard_s: float  # forward + backward resharding per step of the chosen layouts
    # (tensor, from layout, to layout, seconds per step) of every reshard the solution pays
    edges: list[tuple[str, tuple[str, ...], tuple[str, ...], float]] = field(default_factory=list)


@dataclass
class Tensor:
    key: str  # canonical producer node (the producer itself for an output leaving its run)
    producer: str  # unit key
    shape: tuple[int, ...]  # one global micro-batch
    itemsize: int
    weight: float  # real tensors this canonical one stands for
    consumers: set[str] = field(default_factory=set)  # unit keys
    rerun: bool = False  # a checkpointed layer's recomputation redistributes it again
    edges: list[tuple[str, str]] = field(default_factory=list)  # (producer, consumer) traced nodes


def tensors(ctx: Context, graph: nx.DiGraph, units: dict[str, Unit], unit_of: dict[str, str],
            canon: dict[str, str]) -> dict[str, Tensor]:
    """Activation tensors that cross a unit boundary, keyed canonically, each standing for
    as many real tensors as its producers run (``layer_weight``).

    A repeated layer's output is the exception.  Of the ``w`` times the last traced layer of
    a run stands for, only the last output leaves the run (to the final norm, or to a layer
    of another kind: ``exits``, keyed by the producer itself, weight 1); the other ``w - 1``
    feed the next instance of the layer, so they count with the same output of the
    previous traced layer of the kind (its canonical tensor), which feeds a layer's input
    consumers.  Priced all alike, a post-norm layer's q/k/v input (OLMo 2) was charged as
    the final norm's in ``w - 1`` layers and the final norm's ``w`` times."""
    from planner.tracer import layer_weight

    kinds = layer_kinds(graph, canon)
    batched = _batched(graph)
    out: dict[str, Tensor] = {}
    counted: set[tuple[str, str]] = set()
    exits: set[str] = set()
    for u, v in graph.edges:
        if u not in unit_of or v not in unit_of or unit_of[u] == unit_of[v] or _metadata_input(graph, u, v):
            continue
        d = graph.nodes[u]
        if leaves_run(kinds, d.get("layer"), graph.nodes[v].get("layer")):
            key = u
            exits.add(u)
        else:
            key = canon[u]
        t = out.get(key)
        if t is None:
            rows = d["shape"][0] * ctx.microbatch if u in batched else d["shape"][0]
            shape = (rows,) + tuple(d["shape"][1:]) if d["shape"] else ()
            itemsize = max(1, round(d["itemsize"] * ctx.bytes_scale))
            t = out[key] = Tensor(key, unit_of[u], shape, itemsize, 0.0)
        if (key, u) not in counted:
            t.weight += 1 if u in exits and key == u else layer_weight(graph, u)
            t.rerun = t.rerun or d.get("rerun", False)
            counted.add((key, u))
        t.consumers.add(unit_of[v])
        t.edges.append((u, v))
    for u in exits:
        rest = layer_weight(graph, u) - 1
        twin = out.get(canon[u])
        if rest and twin is not None and twin is not out[u]:
            twin.weight += rest
        elif rest:  # no earlier layer of the kind to count with (not in a traced graph)
            out[u].weight += rest
    return out


def _batched(graph: nx.DiGraph) -> set[str]:
    """Nodes whose first dim is the batch, which ``tensors`` scales to the micro-batch (the
    graph is traced at batch 1): those computed from the model's inputs (input_ids,
    labels) or from a tensor the model makes with a leading 1, which at batch 1 may be
    the batch (BioGPT's ``ones(batch, seq)`` attention mask).  The others hold no batch
    dim, whatever their first one: GPT-2's position embeddings, ``[1, s, h]`` from
    ``arange(seq)``, broadcast over the batch in the add, were priced as if they had one
    (their gradient's all-gather 8 times too large at a batch of 8)."""
    seeds = [n for n, d in graph.nodes(data=True)
             if (d["kind"] == "placeholder" and d.get("param") is None)
             or (d["kind"] != "placeholder" and graph.in_degree(n) == 0 and d["shape"][:1] == (1,))]
    return set(seeds).union(*(nx.descendants(graph, n) for n in seeds))


def leaves_run(kinds: dict[int, int], producer: int | None, consumer: int | None) -> bool:
    """Whether an edge from a node of traced layer ``producer`` to one of ``consumer``
    (None: outside the layers) leaves the producer's run of layers: its consumer is outside
    the layers or in a layer of another kind (``kinds``: ``layer_kinds``)."""
    return producer is not None and consumer != producer and (consumer is None or kinds[consumer] != kinds[producer])


def _metadata_input(graph: nx.DiGraph, u: str, v: str) -> bool:
    """``u`` is index metadata of product ``v``, not its operand: a grouped_mm's group
    offsets (integers, one per expert), which DTensor keeps replicated whatever the
    product's layout (``grouped_mm_strategy``: "offs should always be replicated"), so
    they do not take the layout the product asks of its input."""
    dtype = graph.nodes[u].get("dtype")
    return graph.nodes[v].get("short") == "grouped_mm" and bool(dtype) and not floating(dtype)


def reshard_s(ctx: Context, t: Tensor, src: tuple[str, ...], dst: tuple[str, ...]) -> float:
    """Seconds per step to move ``t`` from semantic layout ``src`` to ``dst``, fwd + bwd,
    and the forward again where activation checkpointing recomputes it (the executor's
    module hooks inside a checkpointed layer run again)."""
    if src == dst:
        return 0.0
    s = [concrete(x, t.shape, ctx.seq_len) for x in src]
    d = [concrete(x, t.shape, ctx.seq_len) for x in dst]
    if None in s or None in d or not t.shape:
        return math.inf
    try:
        cost = redistribute_cost(ctx.profile, ctx.mesh_shape, s, d, t.shape, t.itemsize)
    except ValueError:  # a transition DTensor cannot perform (e.g. S -> P)
        return math.inf
    again = cost.forward_s if t.rerun and ctx.checkpointing != "none" else 0.0
    return (cost.total_s + again) * ctx.microbatches


def summed_first(src: tuple[str, ...], needed: Collection[tuple[str, ...]]) -> tuple[str, ...] | None:
    """Where ``executor.apply`` converts a pending sum for its readers from its summed form:
    a module's Partial output that leaves it for readers in several layouts (``search._settled``
    hands it over as is) is all-reduced at the boundary (``no_partial_outputs``), and each
    reader converts the replicated result.  When the summed layout is among ``needed``, the
    tensor is converted to it once, and the other layouts come from it (a sequence shard:
    a slice forward, where the ILP priced a reduce-scatter of the pending sum; OLMo 2's
    embedding under sequence parallelism, read by q/k/v replicated and by the residual add
    by sequence).  None where that does not apply."""
    if "P" not in src:
        return None
    summed = tuple("R" if p == "P" else p for p in src)
    return summed if summed in needed else None


def partial_dims(ctx: Context, unit: Unit, c: Choice) -> tuple[int, ...]:
    """Mesh dims on which the gradient of anchor choice ``c``'s input comes back Partial:
    where it takes the input replicated and splits the output's features (column
    parallel), each rank's backward gives only its share of the input's gradient
    (Megatron's f: the executor all-reduces it once per block input, or reduce-scatters
    it into a sequence-parallel residual stream)."""
    if unit.kind != "anchor":
        return ()
    return tuple(i for i in ctx.free_dims
                 if ctx.mesh_shape[i] > 1 and c.inp[i] == "R" and c.out[i] == "H")


def partial_grad_s(ctx: Context, t: Tensor, src: tuple[str, ...], dst: tuple[str, ...],
                   dims: tuple[int, ...]) -> float:
    """Seconds per step the backward of moving ``t`` from ``src`` to ``dst`` costs beyond
    ``reshard_s`` when its gradient arrives Partial on ``dims`` (``partial_dims``): an
    all-reduce where ``src`` is replicated or Partial, a reduce-scatter where it is sharded."""
    if not dims:
        return 0.0
    s = [concrete(x, t.shape, ctx.seq_len) for x in src]
    d = [concrete(x, t.shape, ctx.seq_len) for x in dst]
    if None in s or None in d or not t.shape:
        return math.inf
    grad = ["P" if i in dims else p for i, p in enumerate(d)]
    try:
        extra = (redistribute_time(ctx.profile, ctx.mesh_shape, grad, partial_gradient_target(s, grad),
                                   t.shape, t.itemsize)
                 - redistribute_cost(ctx.profile, ctx.mesh_shape, s, d, t.shape, t.itemsize).backward_s)
    except ValueError:
        return math.inf
    return max(0.0, extra) * ctx.microbatches


_BANNER_LOCK = threading.Lock()


@functools.cache
def _silence_highs_banner() -> None:
    """HiGHS writes a two-line banner to the process's C-level stdout when its first
    solver object is built, before PuLP can turn its output off; ``meshplan plan >
    plan.json`` then held the banner ahead of the JSON.  The first object is built here
    with file descriptor 1 on /dev/null (the banner is printed once per process); the
    lock keeps two threads from swapping the descriptor at once."""
    import highspy

    with _BANNER_LOCK:
        sys.stdout.flush()
        saved = os.dup(1)
        try:
            with open(os.devnull, "w") as null:
                os.dup2(null.fileno(), 1)
                highspy.Highs()
        finally:
            os.dup2(saved, 1)
            os.close(saved)


def _solver(time_limit_s: float | None) -> tuple[pulp.LpSolver, str]:
    kwargs = {"msg": False}
    if time_limit_s:
        kwargs["timeLimit"] = time_limit_s
    highs = pulp.HiGHS(**kwargs)
    if highs.available():
        _silence_highs_banner()
        return highs, "HiGHS"
    return pulp.PULP_CBC_CMD(**kwargs), "CBC"


def solve(ctx: Context, units: dict[str, Unit], tensor_map: dict[str, Tensor],
          memory_budget: float, tied: dict[str, list[tuple[str, str]]] | None = None,
          time_limit_s: float | None = None, state_divisor: int = 1) -> Solution:
    """Solve the ILP above; raises InfeasibleError with the memory the best layout needs.

    ``state_divisor``: pipeline stages each hold 1/pp of the model states, while the
    first stage of 1F1B holds pp micro-batches of its 1/pp of the layers, i.e. one
    micro-batch of the whole model's activations: so states are divided, activations not.
    """
    for u in units.values():
        if not u.choices:
            raise InfeasibleError(f"no valid placement for {u.kind} {u.key} ({u.module or 'model'})", kind="conflict")
    for param, uses in (tied or {}).items():
        # a parameter (or pattern) several units place takes one placement: where their
        # choices share none, no memory bound makes the ILP feasible
        offered = [{c.weights[fqn] for c in units[k].choices if fqn in c.weights} for k, fqn in uses]
        if not set.intersection(*offered):
            takes = "; ".join(sorted(f"{units[k].module} takes {' or '.join(str(list(pl)) for pl in sorted(o))}"
                                     for (k, _), o in zip(uses, offered)))
            raise InfeasibleError(f"{param} is tied, and no placement suits all its uses: {takes}", kind="conflict")
    prob = pulp.LpProblem("placement", pulp.LpMinimize)
    x = {k: [prob.add_variable(f"x_{i}_{j}", cat="Binary") for j in range(len(u.choices))]
         for i, (k, u) in enumerate(units.items())}
    objective = []
    per = state_bytes_per_param(ctx.optimizer)

    def update_s(c: Choice) -> float:  # the optimizer step over the choice's parameter shard
        return optimizer_time(ctx.profile, sum(c.state) / per.total, ctx.optimizer) if any(c.state) else 0.0

    for k, u in units.items():
        prob += pulp.lpSum(x[k]) == 1
        objective += [v * (c.compute_s + c.comm_s + c.grad_sync_s + c.gather_s * u.gathers + c.pending_grad_s
                           + update_s(c) / state_divisor)
                      for v, c in zip(x[k], u.choices)]
    for ti, t in enumerate(tensor_map.values()):
        prod = units[t.producer]
        # z: t needed in a layout; p: ... with its gradient Partial on some dims
        needed: dict[tuple[str, ...], pulp.LpVariable] = {}
        partial: dict[tuple[tuple[str, ...], tuple[int, ...]], pulp.LpVariable] = {}
        for cons in sorted(t.consumers):
            cu = units[cons]
            for v, c in zip(x[cons], cu.choices):
                lay = c.inp if cu.kind == "anchor" else c.out
                if lay not in needed:
                    needed[lay] = prob.add_variable(f"z_{ti}_{len(needed)}", cat="Binary")
                prob += v <= needed[lay]
                if dims := partial_dims(ctx, cu, c):
                    if (lay, dims) not in partial:
                        partial[lay, dims] = prob.add_variable(f"p_{ti}_{len(partial)}", cat="Binary")
                    prob += v <= partial[lay, dims]
        by_src: dict[tuple[str, ...], list] = defaultdict(list)
        for v, c in zip(x[t.producer], prod.choices):
            by_src[c.out].append(v)
        pairs = [(lay, z, reshard_s) for lay, z in needed.items()] + [
            ((lay, dims), z, lambda ctx, t, src, key: partial_grad_s(ctx, t, src, *key))
            for (lay, dims), z in partial.items()]
        for si, (src, vs) in enumerate(by_src.items()):
            summed = summed_first(src, needed)
            for li, (lay, z, price) in enumerate(pairs):
                cost = price(ctx, t, src, lay) * t.weight
                if cost == 0.0:
                    continue
                if math.isinf(cost):  # impossible pair: forbid it
                    prob += pulp.lpSum(vs) + z <= 1
                    continue
                w = prob.add_variable(f"w_{ti}_{si}_{li}", lowBound=0)
                prob += w >= pulp.lpSum(vs) + z - 1
                objective.append(cost * w)
                # converted from the summed form where that is needed too (summed_first): a
                # discount d <= each of the three conditions, which the minimisation takes
                # whenever all hold
                if price is reshard_s and summed is not None and lay != summed:
                    saved = cost - reshard_s(ctx, t, summed, lay) * t.weight
                    if saved > 0.0:
                        d = prob.add_variable(f"d_{ti}_{si}_{li}", lowBound=0)
                        prob += d <= pulp.lpSum(vs)
                        prob += d <= z
                        prob += d <= needed[summed]
                        objective.append(-saved * d)
    _forbid_unmade_chunks(prob, units, tensor_map, x)
    _loss_takes_logits_as_they_arrive(prob, units, tensor_map, x, ctx.free_dims)
    # CBC gives up on coefficients this large, which would read as "nothing fits"
    worst = max((abs(coef) for term in objective for coef in term.values()), default=0.0)
    if not worst < ABSURD_S:
        raise ValueError(f"profile: {ctx.profile.name!r} prices a choice or a resharding at {worst:.3g} s "
                         "per step; a bandwidth or rate in it is out of range")
    prob += pulp.lpSum(objective)
    mem = [v * _choice_bytes(c, state_divisor)
           for k, u in units.items() for v, c in zip(x[k], u.choices)]
    prob += pulp.lpSum(mem) <= memory_budget, "memory"
    for (first, fqn), *rest in (tied or {}).values():
        placements = {c.weights[fqn] for c in units[first].choices}
        for other, other_fqn in rest:
            for pl in placements:
                prob += (pulp.lpSum(v for v, c in zip(x[first], units[first].choices) if c.weights[fqn] == pl)
                         == pulp.lpSum(v for v, c in zip(x[other], units[other].choices)
                                       if c.weights.get(other_fqn) == pl))
    solver, name = _solver(time_limit_s)
    t1 = time.perf_counter()
    prob.solve(solver)
    solve_time = time.perf_counter() - t1
    status = pulp.LpStatus[prob.status]
    values = {k: [v.value() or 0.0 for v in vs] for k, vs in x.items()}
    if status != "Optimal" and not all(max(vs) > 0.5 for vs in values.values()):
        stopped = (f"the solver found no assignment in its time limit ({time_limit_s:g} s)" if time_limit_s
                   else f"the solver found no assignment ({status})")
        if status != "Infeasible":
            raise InfeasibleError(stopped, kind="time" if time_limit_s else "conflict")
        need = min_memory(units, state_divisor)
        if need <= memory_budget:
            # the leanest choice of each unit fits, so memory may not be what rules every
            # assignment out: solve again without the bound for the least memory any
            # consistent assignment needs (none: the other constraints conflict)
            prob.get_constraint_by_name("memory").changeRHS(unbounded_memory(units, state_divisor))
            prob.setObjective(pulp.lpSum(mem))
            prob.solve(solver)
            if not all(max(v.value() or 0.0 for v in vs) > 0.5 for vs in x.values()):
                if pulp.LpStatus[prob.status] == "Infeasible":
                    raise InfeasibleError("no assignment meets the placement constraints", kind="conflict")
                raise InfeasibleError(stopped, kind="time" if time_limit_s else "conflict")
            need = max(need, float(pulp.value(prob.objective)))
        raise InfeasibleError(
            f"devices: no layout fits; the leanest needs {need / 2**30:.1f} GiB per device, "
            f"{memory_budget / 2**30:.1f} GiB usable", need=need)
    choice = {k: units[k].choices[max(range(len(vs)), key=vs.__getitem__)] for k, vs in values.items()}
    reshard_total, edges = realised_resharding(ctx, units, tensor_map, choice)
    gap = 0.0 if status == "Optimal" else None
    return Solution(choice, float(pulp.value(prob.objective) or 0.0), status, name,
                    prob.numVariables(), prob.numConstraints(), solve_time, gap, reshard_total, edges)


def _chunks(src: tuple[str, ...], dst: tuple[str, ...]) -> bool:
    """``src -> dst`` cuts a replicated tensor locally on some mesh dim."""
    return any(a == "R" and b not in ("R", "P") for a, b in zip(src, dst))


def _forbid_unmade_chunks(prob: pulp.LpProblem, units: dict[str, Unit], tensor_map: dict[str, Tensor],
                          x: dict[str, list]) -> None:
    """A unit that does not cut replicated inputs itself (``Unit.cuts_inputs``: no module
    boundary the executor converts, no sharded weight for DTensor to follow) may take a
    layout that needs its inputs cut only if one of them arrives in it already: for each
    such choice of consumer ``v`` with ``k`` input tensors,
    ``x[v,c] + sum_t sum_{s: out(s) cut to in(c)} x[producer(t), s] <= k``."""
    inputs: dict[str, list[Tensor]] = defaultdict(list)
    for t in tensor_map.values():
        for cons in t.consumers:
            inputs[cons].append(t)
    for cons, ts in inputs.items():
        cu = units[cons]
        if cu.cuts_inputs:
            continue
        for v, c in zip(x[cons], cu.choices):
            lay = c.inp if cu.kind == "anchor" else c.out
            cut = [[xv for xv, pc in zip(x[t.producer], units[t.producer].choices) if _chunks(pc.out, lay)]
                   for t in ts]
            if all(cut):
                prob += v + pulp.lpSum(xv for each in cut for xv in each) <= len(ts)


def _loss_takes_logits_as_they_arrive(prob: pulp.LpProblem, units: dict[str, Unit],
                                      tensor_map: dict[str, Tensor], x: dict[str, list],
                                      dims: Sequence[int]) -> None:
    """executor.loss computes the cross-entropy on the logits' vocabulary shards wherever
    they arrive sharded, and on whole logits wherever they arrive whole: it neither
    gathers sharded logits for a replicated loss nor cuts whole ones.  So on each mesh dim
    the loss unit's layout is H exactly where its input's is: for every loss choice ``c``
    and producer choice ``s`` that differ there, ``x[loss,c] + x[producer,s] <= 1``.
    (Pricing the gather instead, the ILP chose it for small vocabularies, and the plan
    priced an all-gather where the executor ran two all-reduces.)"""
    for t in tensor_map.values():
        for cons in t.consumers:
            if not units[cons].loss:
                continue
            prod = units[t.producer]
            for v, c in zip(x[cons], units[cons].choices):
                for w, s in zip(x[t.producer], prod.choices):
                    if any((c.out[i] == "H") != (s.out[i] == "H") for i in dims):
                        prob += v + w <= 1


def realised_resharding(ctx: Context, units: dict[str, Unit], tensor_map: dict[str, Tensor],
                        choice: dict[str, Choice]) -> tuple[float, list]:
    """Resharding seconds of a fixed assignment (each tensor moved once per layout)."""
    total = 0.0
    edges = []
    for t in tensor_map.values():
        src = choice[t.producer].out
        needed = {(choice[c].inp if units[c].kind == "anchor" else choice[c].out) for c in t.consumers}
        summed = summed_first(src, needed)
        for lay in needed:
            frm = summed if summed is not None and lay != summed else src
            cost = reshard_s(ctx, t, frm, lay) * t.weight
            if cost:
                total += cost
                edges.append((t.key, frm, lay, cost))
        partial = {(choice[c].inp, dims) for c in t.consumers
                   if (dims := partial_dims(ctx, units[c], choice[c]))}
        for lay, dims in partial:
            cost = partial_grad_s(ctx, t, src, lay, dims) * t.weight
            if cost:
                total += cost
                edges.append((t.key, src, lay, cost))
    return total, edges


def _choice_bytes(c: Choice, state_divisor: int) -> float:
    """Bytes per device a choice adds to the memory constraint."""
    return sum(c.state) / state_divisor + c.act_bytes


def min_memory(units: dict[str, Unit], state_divisor: int = 1) -> float:
    """Bytes per device of the leanest choice per unit (a lower bound of any layout)."""
    return sum(min(_choice_bytes(c, state_divisor) for c in u.choices) for u in units.values() if u.choices)


def unbounded_memory(units: dict[str, Unit], state_divisor: int = 1) -> float:
    """A memory bound no layout reaches (the largest choice per unit, plus a byte): what
    lifts the bound, since PuLP refuses an infinite one."""
    return 1 + sum(max(_choice_bytes(c, state_divisor) for c in u.choices) for u in units.values() if u.choices)
