"""The order of a step's blocking collectives and the compute between them (issue 3).

Ranks that share cores drift apart while they compute, and a blocking collective first
waits for its group's slowest rank: the longer the compute since the rank's previous
collective, the longer the wait (``cost_model.comm.sync_correction``; measured in
docs/fidelity_log.md, sessions 36 and 42).  The collective constants were timed after
one fixed stretch of compute, and ``Choice`` and the ILP price each collective alone, so
neither knows that stretch in a step.  This module lays one micro-batch's step out in
the order the executor runs it and returns what that changes in the collectives' prices:

* forward: the graph's nodes in traced order, a repeated layer as often as the model
  has it; a tensor redistributed for a consumer just before the first node of that
  consumer that reads it (in every instance of a repeated layer, but once for a tensor
  from outside the layers: the embedding's output); the vocabulary-parallel loss's two
  all-reduces at the loss; the loss's mean over the data-parallel dims after the last
  node;
* backward: the same nodes in reverse; a redistribution's gradient collectives (and
  the all-reduce of a Partial gradient, Megatron's f) just after the backward of the
  consumer that read it; gradients left Partial reduced after the whole backward, one
  after another (``_reduce_pending_grads``);
* FSDP2, one unit per layer and the root (``executor.apply``): the all-gather before each
  layer's forward and, but for the last layer (kept), again before its backward; the
  gradient's reduce-scatter (all-reduce when replicated) after its backward; the root's
  gather first and its reduction last.

A unit's compute (forward: a third of its forward + backward, as ``search.evaluate``
splits it) is shared evenly by its nodes: on a CPU host time per node is most of a small
op's time.  DTensor's host work around each of its collectives
(``dtensor_redistribute_s``) precedes the collective and counts as compute before it.
Not in the stretches: nodes no unit holds (placeholders, parameters), FSDP2's host time,
and the optimizer.  Pipelines are not laid out (``planner.pipeline`` prices stages
without this correction).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping

import networkx as nx

from cost_model.comm import (
    backward_placements,
    partial_gradient_target,
    redistribute_collectives,
    sync_correction,
)
from cost_model.step import partial_grad_collectives
from planner.ilp import Solution, Tensor, leaves_run, partial_dims, summed_first
from planner.strategies import Context, Unit, canonical_map, concrete, layer_kinds

# the group sizes of the collectives issued at one point, in order (the first after the
# compute before it, the rest after DTensor's host work only)
Groups = list[int]
# per node: the collectives issued there, each with the instances of a repeated layer's
# run it is issued in: "every"; "first" (a tensor from before the layers, or leaving its
# run: ``ilp.leaves_run``); "rest" (the run's later instances, where the layer's input is
# the previous instance's output: the events of the next traced layer of the kind)
Events = dict[str, list[tuple[int, str]]]


def _groups(ctx: Context, src: list[str], dst: list[str]) -> Groups:
    return [int(ctx.mesh_shape[dim]) for _, dim in
            redistribute_collectives(ctx.mesh_shape, src, dst, ctx.profile.device_type)]


def _expanded(graph: nx.DiGraph) -> Iterator[tuple[str, bool, bool, bool]]:
    """(node, starts a layer, ends a layer, in the first instance of its run) in traced
    order, each traced layer's run of nodes repeated as often as the model has that layer."""
    for layer, run in itertools.groupby(graph.nodes, key=lambda n: graph.nodes[n].get("layer")):
        nodes = list(run)
        for k in range(1 if layer is None else graph.graph["layer_weights"][layer]):
            for i, n in enumerate(nodes):
                yield n, layer is not None and i == 0, layer is not None and i == len(nodes) - 1, k == 0


def _redistributions(ctx: Context, graph: nx.DiGraph, units: Mapping[str, Unit], unit_of: Mapping[str, str],
                     tensor_map: Mapping[str, Tensor], sol: Solution) -> tuple[Events, Events]:
    """Per consumer node, the forward collectives issued before it and the backward ones
    after its backward."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    canon = canonical_map(graph)
    kinds = layer_kinds(graph, canon)
    fwd: Events = {}
    bwd: Events = {}
    for t in tensor_map.values():
        src = sol.choice[t.producer].out
        s = [concrete(x, t.shape, ctx.seq_len) for x in src]
        if None in s or not t.shape:
            continue
        # one redistribution per producer and layout, at its first consumer, as the ILP
        # prices it; its gradient sums its consumers', Partial where any of them leaves it so
        first: dict[tuple[str, tuple[str, ...]], str] = {}
        dims: dict[tuple[str, tuple[str, ...]], set[int]] = {}
        for u, v in t.edges:
            c = unit_of[v]
            need = sol.choice[c].inp if units[c].kind == "anchor" else sol.choice[c].out
            key = (u, need)
            if key not in first or order[v] < order[first[key]]:
                first[key] = v
            dims.setdefault(key, set()).update(partial_dims(ctx, units[c], sol.choice[c]))
        # a pending sum its readers also need summed is converted from that (ilp.summed_first)
        summed = {u: summed_first(src, {n for p, n in first if p == u}) for u, _ in first}
        for (u, need), v in first.items():
            d = [concrete(x, t.shape, ctx.seq_len) for x in need]
            if None in d:
                continue
            lu, lv = graph.nodes[u].get("layer"), graph.nodes[v].get("layer")
            once = lu is None or leaves_run(kinds, lu, lv)
            via = summed[u]
            frm = s if via is None or need == via else [concrete(x, t.shape, ctx.seq_len) for x in via]
            grad = ["P" if i in dims[u, need] else p for i, p in enumerate(d)]
            back = partial_gradient_target(frm, grad) if dims[u, need] else backward_placements(frm, grad)
            for events, groups in ((fwd, _groups(ctx, frm, d) if need != src else []),
                                   (bwd, _groups(ctx, grad, back))):
                events.setdefault(v, []).extend((g, "first" if once else "every") for g in groups)
                if not once and lu != lv:  # the first traced layer of the kind's later instances
                    events.setdefault(canon[v], []).extend((g, "rest") for g in groups)
    return fwd, bwd


def sync_corrections(ctx: Context, graph: nx.DiGraph, units: Mapping[str, Unit], unit_of: Mapping[str, str],
                     tensor_map: Mapping[str, Tensor], sol: Solution, partial: list[tuple[str, str, float, int]]
                     ) -> float:
    """Seconds per micro-batch the waits before a step's blocking collectives add to their
    calibrated prices (may be negative); 0 where the profile has no ``sync_cost``.
    ``partial``: ``search._partial_grads``' gradients left Partial."""
    prof = ctx.profile
    if not prof.sync_cost:
        return 0.0
    m = ctx.microbatches
    per_node: dict[str, tuple[float, float]] = {}  # node -> (forward s, backward s)
    for key, unit in units.items():
        c = sol.choice[key]
        forward = (c.compute_s - c.recompute_s) / 3
        share = unit.weight * m
        for n in unit.nodes:
            per_node[n] = (forward / share, (c.compute_s - forward) / share)
    fwd, bwd = _redistributions(ctx, graph, units, unit_of, tensor_map, sol)
    host = prof.dtensor_redistribute_s
    for key, unit in units.items():  # the vocabulary-parallel loss
        c = sol.choice[key]
        if c.comm_s:
            fwd.setdefault(unit.nodes[0], []).extend(
                (int(ctx.mesh_shape[i]), "first") for i in ctx.free_dims if c.out[i] == "H" for _ in range(2))
    data = ctx.data_ranks
    fsdp = data > 1 and "dp" in ctx.fsdp

    total = 0.0
    since = 0.0  # compute since this rank's previous collective

    def issue(groups: Groups, dtensor: bool = True) -> None:
        nonlocal total, since
        for g in groups:
            since += host if dtensor else 0.0
            total += sync_correction(prof, g, since)
            since = 0.0

    def at(events: Events, n: str, first: bool) -> Groups:
        return [g for g, when in events.get(n, ()) if when == "every" or (when == "first") == first]

    nodes = list(_expanded(graph))
    if fsdp:
        issue([data], dtensor=False)  # the root's all-gather
    for n, starts, _, first in nodes:
        if starts and fsdp:
            issue([data], dtensor=False)
        issue(at(fwd, n, first))
        since += per_node.get(n, (0.0, 0.0))[0]
    if data > 1:
        issue([data], dtensor=False)  # the loss's mean
    last_layer = max((i for i, (_, _, ends, _) in enumerate(nodes) if ends), default=-1)
    for i in range(len(nodes) - 1, -1, -1):
        n, starts, ends, first = nodes[i]
        if ends and fsdp and i != last_layer:
            issue([data], dtensor=False)  # the re-gather
        since += per_node.get(n, (0.0, 0.0))[1]
        issue(at(bwd, n, first))
        if starts and data > 1:
            issue([data], dtensor=False)  # the layer's gradient reduction
    if data > 1:
        issue([data], dtensor=False)  # the root's gradients
    issue([int(ctx.mesh_shape[dim]) for _, _, dim in
           partial_grad_collectives([e[1:] for e in partial], bucketed=data == 1)])
    return total
