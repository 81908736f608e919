"""Strategies: the placements each part of the traced graph can take on a mesh.

The graph is condensed before anything is enumerated (Alpa's "follow" merge):

* **anchors** are the ops that own the parallelisation decision: ops with a
  parameter (linear, GPT-2's Conv1D addmm, embedding, MoE grouped_mm) and
  attention (scaled_dot_product_attention);
* **segments** are the connected groups of other activation ops between anchors
  (norms, residual adds, rotary, activation functions, views).  A segment holds one
  layout for all its tensors, so elementwise chains never reshard internally.

Layouts are semantic, per mesh dim: ``R`` replicate, ``B`` batch-sharded, ``Q``
sequence-sharded, ``H`` feature-sharded (hidden / heads / ffn), ``P`` partial sum;
:func:`concrete` turns one into ``R``/``S(d)``/``P`` for a given tensor shape.

Data-parallel mesh dims (named ``dp``) are batch-sharded everywhere; the other
dims (``tp``) are free, and every anchor picks one of:

    data  x B -> y B, weight replicated (gradient reduced over the dim)
    seq   x Q -> y Q, weight replicated (gradient reduced over the dim)
    col   x R -> y H, weight sharded on its output features
    row   x H -> y P, weight sharded on its input features
    rep   x R -> y R, everything replicated (redundant compute)

Each choice carries its per-device compute time, the parameter placements it
implies and its model-state bytes, all from ``cost_model``; resharding between
choices is priced by the ILP on the graph's edges.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import networkx as nx

from cost_model.comm import collective_time
from cost_model.compute import column_factor, fresh_pages_time, op_time
from cost_model.memory import state_bytes_per_param
from cost_model.profile import Profile
from cost_model.step import (
    fsdp_copy_time,
    fsdp_gathers,
    fsdp_host_time,
    fsdp_step_gathers,
    loss_mean_time,
)
from planner.schema import fqn_pattern, shard_dim
from planner.tracer import layer_weight

ANCHOR_OPS = {"linear", "addmm", "embedding", "scaled_dot_product_attention", "grouped_mm"}
# Ops that reduce over features: a segment holding one cannot be feature-sharded.
REDUCING_OPS = {"mean", "sum", "var", "layer_norm", "native_layer_norm", "softmax", "_softmax",
                "log_softmax", "_log_softmax", "cross_entropy_loss",
                "topk", "sort", "cumsum", "histc", "rms_norm", "amax", "max", "argmax", "norm"}
# Products of two activations (Gemma 2's eager attention: scores = q @ k^T, then
# probabilities @ v) contract over the keys: split by sequence, each rank needs every
# key, which DTensor gathers, so a segment holding one is not split by sequence.
ACTIVATION_PRODUCTS = {"matmul", "bmm", "baddbmm"}
# The loss runs replicated or, on vocabulary-sharded logits (a column-parallel head's),
# on the shards (H): executor.loss, two all-reduces per token (_vocab_parallel_loss_s).
LOSS_OPS = {"cross_entropy_loss"}
VIEW_OPS = {"view", "_unsafe_view", "reshape", "transpose", "permute", "unsqueeze", "squeeze",
            "expand", "slice", "select", "alias", "t", "split", "chunk", "unbind", "getitem",
            "contiguous", "clone", "_assert_tensor_metadata", "to", "detach"}
# What selective activation checkpointing keeps of a layer (executor.apply's policy, at
# aten level mm / addmm / bmm / baddbmm / _grouped_mm and the attention kernels): the
# other ops are recomputed.
SAVED_BY_SELECTIVE = {"linear", "mm", "addmm", "bmm", "matmul", "baddbmm",
                      "scaled_dot_product_attention", "grouped_mm"}
# Ops that cut a tensor into pieces along a dim.  DTensor gathers a tensor sharded on the
# dim it cuts first (``split_strategy``: "if the input is sharded on the split dim, we
# need to unshard it"), so a segment that cuts the features cannot keep them sharded:
# GPT-2's q/k/v split of one projection, Mixtral's gate/up chunk of its fused experts.
CUTTING_OPS = {"split", "split_with_sizes", "chunk", "slice", "narrow"}
# Ops that reshape a tensor.  DTensor keeps a shard through a merge of dims only where
# the sharded dim comes first in the merged group (``view_groups``' Flatten), and gathers
# it otherwise: BLOOM folds the heads into the batch for its ALiBi ``baddbmm``.
RESHAPING_OPS = {"view", "_unsafe_view", "reshape"}
LAYOUTS = ("R", "B", "Q", "H", "P")
ANCHOR_KINDS = ("data", "seq", "col", "row", "rep")


@dataclass(frozen=True)
class Context:
    """What every cost needs: mesh, profile, training shape and dtype."""

    mesh_names: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    profile: Profile
    batch_size: int  # global batch, sequences
    seq_len: int
    microbatches: int
    dtype: str  # compute dtype name for the profile ("bf16", "fp32")
    act_itemsize: int  # bytes per activation element in training
    optimizer: str  # key of cost_model.memory.OPTIMIZERS
    fsdp: frozenset[str]  # data-parallel dims whose parameters are fully sharded
    checkpointing: str
    feature_divisor: int  # every feature sharding must divide this (heads, kv heads, ...)
    trace_itemsize: int = 4  # bytes per parameter element of the traced graph
    pp: int = 1  # pipeline stages

    @property
    def grad_reductions(self) -> int:
        """Data-parallel gradient reductions per step: one per micro-batch without a
        pipeline (executor.accumulate lets FSDP2 reduce each part's), one under a
        pipeline schedule."""
        return self.microbatches if self.pp == 1 else 1

    def gathers(self, in_layer: bool, layers: int) -> float:
        """FSDP2 all-gathers per step of a parameter (``cost_model.step.fsdp_gathers``):
        in the root's unit, or in a repeated layer's, averaged over the ``layers`` layers,
        of which each pipeline stage's last keeps its parameters (virtual stages' last
        blocks are left out here; ``planner.pipeline`` counts them per stage)."""
        m, piped = self.microbatches, self.pp > 1
        root = fsdp_gathers(m, piped, kept=True)
        if not in_layer:
            return root
        return (fsdp_step_gathers(m, piped, layers, kept_layers=min(self.pp, layers)) - root) / layers

    @property
    def bytes_scale(self) -> float:
        """Training bytes per traced byte: 1 for a graph traced in the training dtype (whose
        fp32 ops show as such); a graph traced in fp32 for bf16 training is halved."""
        return self.act_itemsize / self.trace_itemsize

    @property
    def data_dims(self) -> tuple[int, ...]:
        return tuple(i for i, n in enumerate(self.mesh_names) if n == "dp")

    @property
    def data_ranks(self) -> int:
        """Ranks the batch is split over (1 without data-parallel dims)."""
        return math.prod(self.mesh_shape[i] for i in self.data_dims)

    @property
    def free_dims(self) -> tuple[int, ...]:
        return tuple(i for i, n in enumerate(self.mesh_names) if n != "dp")

    @property
    def microbatch(self) -> int:
        """Global sequences per micro-batch."""
        return self.batch_size // self.microbatches


@dataclass
class Choice:
    name: str  # e.g. "col" or "tp:Q"; per free dim, joined with "+"
    out: tuple[str, ...]  # semantic layout of the output, per mesh dim
    inp: tuple[str, ...]  # semantic layout required of activation inputs
    compute_s: float  # forward + backward (+ recompute) seconds per step
    recompute_s: float = 0.0  # the part of compute_s that activation checkpointing recomputes
    weights: dict[str, tuple[str, ...]] = field(default_factory=dict)  # param -> placements
    state: tuple[float, float, float] = (0.0, 0.0, 0.0)  # weight, grad, optimizer bytes per device
    act_bytes: float = 0.0  # activations kept for backward, per device
    grad_sync_s: float = 0.0  # gradient all-reduce / reduce-scatter per step
    gather_s: float = 0.0  # one FSDP all-gather of its parameters (Unit.gathers of them per step)
    tensors: float = 0.0  # parameter tensors it owns (the optimizer's per-tensor ops)
    pending_grad_s: float = 0.0  # reducing its parameters' Partial gradients, per step (ILP only)
    comm_s: float = 0.0  # blocking collectives inside the choice per step (the vocab-parallel loss's)


@dataclass
class Unit:
    key: str  # canonical node name (the first traced layer stands for all)
    kind: str  # "anchor" or "segment"
    nodes: list[str]
    weight: int  # how many real units this canonical one stands for
    module: str
    choices: list[Choice] = field(default_factory=list)
    # whether a replicated input is cut to this unit's layout (a local chunk) even when
    # none of its other inputs arrives so: see ``cuts_replicated_inputs``
    cuts_inputs: bool = True
    gathers: float = 0.0  # FSDP all-gathers of its parameters per step (Context.gathers)
    # holds the loss, which executor.loss runs vocabulary-parallel exactly where its logits
    # arrive vocabulary-sharded (ilp._loss_takes_logits_as_they_arrive)
    loss: bool = False


def concrete(layout: str, shape: Sequence[int], seq_len: int) -> str | None:
    """The placement of semantic ``layout`` on a tensor of ``shape`` (None: impossible)."""
    if layout in ("R", "P"):
        return layout
    if not shape:
        return None
    if layout == "B":
        return "S(0)"
    if layout == "Q":
        dims = [d for d in range(1, len(shape)) if shape[d] == seq_len]
        return f"S({dims[0]})" if dims else None
    if len(shape) == 4:  # attention: [b, heads, s, d] or [b, s, heads, d]
        heads = 1 if shape[2] == seq_len else 2
        # one head: a 2-D product's features unsqueezed (GPT-BigCode's multi-query c_attn
        # output, DeepSeek's latent), which DTensor keeps cut on the last dim
        return f"S({heads})" if shape[heads] > 1 else "S(3)"
    return f"S({len(shape) - 1})" if len(shape) >= 2 else None


def _combine(ctx: Context, per_dim: dict[int, str], fixed: str) -> tuple[str, ...]:
    return tuple(per_dim.get(i, fixed) for i in range(len(ctx.mesh_shape)))


def _shards(ctx: Context, layout: Sequence[str], kinds: str = "BQH") -> int:
    return math.prod(n for n, letter in zip(ctx.mesh_shape, layout) if letter in kinds)


def _divisible(ctx: Context, layout: Sequence[str], shape: Sequence[int]) -> bool:
    """Every sharded semantic dim splits evenly (the executor supports uneven, the cost model not)."""
    for letter, size in (("B", ctx.microbatch), ("Q", ctx.seq_len), ("H", ctx.feature_divisor)):
        n = _shards(ctx, layout, letter)
        if n > 1 and size % n:
            return False
    return all(concrete(letter, shape, ctx.seq_len) is not None for letter in layout)


def _scaled(ctx: Context, node: dict) -> tuple[float, ...]:
    """(fwd FLOPs, bwd FLOPs, fwd bytes, bwd bytes, fwd and bwd transcendentals) of a
    traced node for one global micro-batch."""
    b = ctx.microbatch
    return tuple(node[k] * b for k in ("fwd_flops", "bwd_flops", "bytes", "bwd_bytes",
                                       "fwd_trans", "bwd_trans"))


def _compute_s(ctx: Context, nodes: Sequence[tuple[dict, float]], shards: int,
               out_shards: int | None = None, gemm: tuple[float, float] | None = None,
               plain: bool = False) -> tuple[float, float]:
    """Per-device seconds per step for (node, multiplicity) split ``shards`` ways: forward
    + backward + recompute, and the recompute alone; the outputs are split ``out_shards``
    ways (default ``shards``; a row-parallel product's Partial output is whole on every
    rank).  ``gemm``: a product's (output, input) features on this rank, whose narrow
    outputs slow its GEMMs (forward: M x N; backward: dX M x K and dW N x K, equal FLOPs,
    so their speeds combine harmonically).  ``plain``: the nodes run on plain tensors
    whatever the mesh (``unplaced_compute_s``)."""
    narrow_f = narrow_b = 1.0
    if gemm is not None:
        n, k = gemm
        narrow_f = column_factor(ctx.profile, n)
        narrow_b = 2 / (1 / column_factor(ctx.profile, k) + 1 / column_factor(ctx.profile, min(n, k)))
    total = recomputed = 0.0
    scale = ctx.bytes_scale
    # the executor runs activations as DTensors on the model (non-dp) mesh dims
    dtensor = not plain and any(ctx.mesh_shape[i] > 1 for i in ctx.free_dims)
    # where the profile measured eager host time per graph node (CPU), every node,
    # views included, costs its half each way, and DTensor's share per node with it;
    # else each kernel costs kernel_floor_s, plus dtensor_op_overhead_s on DTensors
    host = None if ctx.profile.node_host_s is None else ctx.profile.node_host_s / 2
    if host is not None and dtensor and ctx.profile.dtensor_node_host_s is not None:
        host, dtensor = host + ctx.profile.dtensor_node_host_s / 2, False
    for d, mult in nodes:
        fwd, bwd, f_bytes, b_bytes, f_trans, b_trans = _scaled(ctx, d)
        f_bytes, b_bytes = f_bytes * scale, b_bytes * scale
        attention = d["short"] == "scaled_dot_product_attention"
        # the query's (sequence, head) pairs, which splitting by batch or heads (its only
        # splits: _anchor_layouts) divides without changing a pair's work
        head_flops = d["fwd_flops"] / math.prod(d["in_shapes"][0][:-2]) if attention else None
        fresh_f, fresh_b = _fresh_pages_s(ctx, d, shards if out_shards is None else out_shards)
        t_f = op_time(ctx.profile, fwd / shards, f_bytes / shards, ctx.dtype, dtensor,
                      f_trans / shards, attention, host, narrow_f, head_flops=head_flops) + fresh_f
        t_b = op_time(ctx.profile, bwd / shards, b_bytes / shards, ctx.dtype, dtensor,
                      b_trans / shards, attention, host, narrow_b, head_flops=head_flops) + fresh_b
        recompute = t_f if _recomputed(ctx, d) else 0.0
        total += mult * (t_f + t_b + recompute)
        recomputed += mult * recompute
    return total * ctx.microbatches, recomputed * ctx.microbatches


def _recomputed(ctx: Context, node: dict) -> bool:
    """Whether backward runs ``node``'s forward again: the executor checkpoints the
    repeated layers only, and recomputes what the layer's backward needs (``rerun``,
    planner.tracer): all of it (``full``) or all but the matmuls and attention, whose
    outputs are kept (``selective``)."""
    if not node["rerun"] or ctx.checkpointing == "none":
        return False
    return ctx.checkpointing == "full" or node["short"] not in SAVED_BY_SELECTIVE


def _fresh_pages_s(ctx: Context, node: dict, out_shards: int) -> tuple[float, float]:
    """(forward, backward) seconds the new tensors of one node cost where they get fresh
    pages from the OS (from the profile's ``fresh_alloc_bytes`` up, a CPU's allocator:
    cost_model.compute.fresh_pages_time): the forward allocates the node's output, split
    ``out_shards`` ways, the backward its gradient if it has one (its consumers' backward,
    as large).  The loss allocates its log-probabilities forward and their zero-filled
    gradient backward, each as large as the logits in fp32 (Hugging Face upcasts them)."""
    if _aliases_input(node):
        return 0.0, 0.0
    if node["short"] in LOSS_OPS:
        numel, itemsize, grad = math.prod(node["in_shapes"][0]), 4, True
    else:
        numel, itemsize, grad = node["out_numel"], node["itemsize"] * ctx.bytes_scale, node["requires_grad"]
    t = fresh_pages_time(numel * ctx.microbatch * itemsize / out_shards,
                         ctx.profile.fresh_page_byte_s, ctx.profile.fresh_alloc_bytes)
    return t, t if grad else 0.0


def _saved_bytes(ctx: Context, nodes: Sequence[tuple[dict, float]], layers: int) -> float:
    """Activation bytes (node, multiplicity) keep for backward, one micro-batch, unsharded.

    A tensor is kept when a backward needs it (``saved``, set by the tracer from
    autograd's rules); views alias their input; the loss keeps its log-probabilities
    and a dropout its mask, which the trace does not show as tensors.  A checkpointed
    layer keeps its inputs (``ckpt_numel``: planner.tracer._mark_checkpoint_inputs)
    and, under ``selective``, every matmul and attention output whether backward needs
    it or not (torch's selective checkpointing caches what the policy saves); what it
    recomputes exists for one layer at a time, during that layer's recomputation.
    """
    total = 0.0
    per_seq = ctx.microbatch * ctx.act_itemsize
    for d, mult in nodes:
        if ctx.checkpointing != "none":
            total += mult * d.get("ckpt_numel", 0) * per_seq
            if d["layer"] is not None:
                if ctx.checkpointing == "selective" and d["short"] in SAVED_BY_SELECTIVE:
                    total += mult * _output_bytes(ctx, d)
                    continue
                mult = mult / layers
        if d["short"] in LOSS_OPS:  # its log-probabilities, fp32 (Hugging Face upcasts the logits)
            total += mult * math.prod(d["in_shapes"][0]) * ctx.microbatch * 4
            continue
        total += mult * d.get("mask_numel", 0) * ctx.microbatch  # dropout's, a byte per element
        if _aliases_input(d) or not d.get("saved"):
            continue
        total += mult * _output_bytes(ctx, d)
    return total


def _aliases_input(node: dict) -> bool:
    """A view of its input (or a same-dtype ``to``, a ``contiguous`` of a contiguous
    tensor): no new memory."""
    return node["short"] in VIEW_OPS and not node.get("copy")


def _output_bytes(ctx: Context, node: dict) -> float:
    """Bytes of ``node``'s outputs for one micro-batch in training (fp32 where the traced
    graph runs fp32 under bf16 training)."""
    return node["out_numel"] * node["itemsize"] * ctx.bytes_scale * ctx.microbatch


def weight_placement(kind: str, op: str, arg: int, shape: Sequence[int], swapped: bool) -> str:
    """Placement on one mesh dim of a parameter at argument ``arg`` of anchor ``op``;
    ``swapped``: the parameter reaches a grouped GEMM with its last two dims swapped."""
    if kind in ("data", "seq", "rep"):
        return "R"
    if op == "linear":  # weight [out, in], bias [out]
        return ("S(0)" if kind == "col" else "S(1)") if arg == 1 else ("S(0)" if kind == "col" else "R")
    if op == "addmm":  # GPT-2 Conv1D: bias [out] at 0, weight [in, out] at 2
        return ("S(1)" if kind == "col" else "S(0)") if arg == 2 else ("S(0)" if kind == "col" else "R")
    if op == "embedding":  # weight [vocab, hidden]: col shards hidden, row shards vocab
        return "S(1)" if kind == "col" else "S(0)"
    if op == "grouped_mm":  # the op takes [experts, in, out]: stored [experts, out, in] when swapped
        return ("S(1)" if kind == "col" else "S(2)") if swapped else ("S(2)" if kind == "col" else "S(1)")
    return "R"


def _anchor_layouts(op: str, kind: str) -> tuple[str, str] | None:
    """(input layout, output layout) of an anchor kind on one mesh dim."""
    if op == "scaled_dot_product_attention":
        return {"data": ("B", "B"), "col": ("H", "H"), "rep": ("R", "R")}.get(kind)
    if op == "embedding":
        return {"data": ("B", "B"), "seq": ("Q", "Q"), "col": ("R", "H"), "row": ("R", "P"),
                "rep": ("R", "R")}[kind]
    if op == "grouped_mm" and kind == "seq":
        return None  # routed tokens are flattened: no sequence dim left
    return {"data": ("B", "B"), "seq": ("Q", "Q"), "col": ("R", "H"), "row": ("H", "P"),
            "rep": ("R", "R")}[kind]


def fsdp_shard(ctx: Context, shape: Sequence[int], placements: Sequence[str]) -> tuple[int, float]:
    """(tensor dim, elements per rank) of FSDP2's shard of a parameter placed ``placements``
    on the model dims (``fsdp_degree(ctx)`` ranks; the whole local tensor without FSDP).

    FSDP2 cuts the dim into chunks and pads every rank's to the first's, ceil(rows /
    ranks) rows.  Cut on dim 0, Mixtral's 8 experts over 64 ranks would leave each rank a
    whole expert: 1/8 of the tensor, not the 1/64 an even split gives.  So a parameter with
    fewer rows than ranks is cut on the first dim that has as many entries and that no
    model dim splits (TorchTitan cuts MoE experts on dim 1 for the same reason); the plan
    writes that dim (``S(d)`` on the fully sharded dim) and ``executor.apply`` cuts there."""
    local = list(shape)
    for n, p in zip(ctx.mesh_shape, placements):
        d = shard_dim(p)
        if d is not None and d < len(local):
            local[d] = math.ceil(local[d] / n)
    degree = fsdp_degree(ctx)
    if degree == 1 or not local:
        return 0, float(math.prod(local))
    split = {shard_dim(p) for p in placements}
    dim = 0 if local[0] >= degree else next(
        (d for d, n in enumerate(local) if n >= degree and d not in split), 0)
    return dim, float(math.ceil(local[dim] / degree) * math.prod(n for d, n in enumerate(local) if d != dim))


def _param_state(ctx: Context, shape: Sequence[int], placements: Sequence[str]
                 ) -> tuple[tuple[float, float, float], float, float]:
    """((weight, grad, optimizer) bytes per device, gradient sync s, one FSDP gather s) of
    one parameter.  FSDP divides all three by its degree (ZeRO-3), padded as FSDP2 pads
    (``fsdp_shard``); the transient unsharded copy of the layer being computed is left to
    the profile's memory headroom."""
    per = state_bytes_per_param(ctx.optimizer)
    numel = math.prod(shape)
    shards = math.prod(n for n, p in zip(ctx.mesh_shape, placements) if p.startswith("S("))
    local = numel / shards
    fsdp = [i for i, name in enumerate(ctx.mesh_names) if name in ctx.fsdp and ctx.mesh_shape[i] > 1]
    if fsdp:
        at_rest = fsdp_shard(ctx, shape, placements)[1]
        local = at_rest * math.prod(ctx.mesh_shape[i] for i in fsdp)  # what FSDP2's collectives move
    else:
        at_rest = local
    state = (at_rest * per.weights, at_rest * per.grads, at_rest * per.optimizer)
    grad_bytes = local * per.grads
    sync = gather = 0.0
    for i, (name, p) in enumerate(zip(ctx.mesh_names, placements)):
        if p != "R" or ctx.mesh_shape[i] == 1:
            continue
        # FSDP2 moves a module's parameters in one collective: the latency is charged
        # per module (cost_model.step.bucket_latency), only the bytes per parameter
        if i in fsdp:
            sync += ctx.grad_reductions * collective_time(ctx.profile, "reduce_scatter", grad_bytes,
                                                          ctx.mesh_shape, i, latency=False)
            gather += collective_time(ctx.profile, "all_gather", local * per.weights, ctx.mesh_shape, i,
                                      latency=False)
        elif name == "dp":
            sync += ctx.grad_reductions * collective_time(ctx.profile, "all_reduce", grad_bytes,
                                                          ctx.mesh_shape, i, latency=False)
    return state, sync, gather


def _pending_grad_s(ctx: Context, shape: Sequence[int], placements: Sequence[str],
                    acts: Sequence[str]) -> float:
    """Seconds per step reducing a parameter's gradient where it comes out Partial: on a
    model dim the parameter is whole on and the activations it meets are split on (batch
    rows, sequence: each rank sums its tokens' share), once per micro-batch, blocking, one
    all-reduce and one DTensor redistribution each.  The ILP's linear price; the step time
    prices the same reductions over the whole solution (``planner.search._partial_grads``,
    ``cost_model.step.partial_grad_time``, which buckets them where the executor does)."""
    per = state_bytes_per_param(ctx.optimizer)
    t = 0.0
    for i in ctx.free_dims:
        if ctx.mesh_shape[i] == 1 or placements[i] != "R" or acts[i] in ("R", "P"):
            continue
        shards = math.prod(n for j, (n, p) in enumerate(zip(ctx.mesh_shape, placements))
                           if p.startswith("S(") and j != i)
        t += (collective_time(ctx.profile, "all_reduce", math.prod(shape) / shards * per.grads, ctx.mesh_shape, i)
              + ctx.profile.dtensor_redistribute_s)
    return ctx.microbatches * t


def _per_dim_options(ctx: Context, options: Sequence[str]) -> list[dict[int, str]]:
    combos: list[dict[int, str]] = [{}]
    for i in ctx.free_dims:
        combos = [{**c, i: o} for c in combos for o in options]
    return combos


def _gemm_features(ctx: Context, node: dict, op: str, kinds: dict[int, str]) -> tuple[float, float] | None:
    """(output, input) features of a product's GEMM on one rank: column parallelism splits
    the outputs, row parallelism the inputs.  None for other anchors."""
    if op == "linear":  # weight [out, in]
        n, k = node["in_shapes"][1][:2]
    elif op == "addmm" and len(node["in_shapes"]) > 2:  # GPT-2's Conv1D: weight [in, out]
        k, n = node["in_shapes"][2][:2]
    else:
        return None
    split = {kind: math.prod(ctx.mesh_shape[i] for i, x in kinds.items() if x == kind) for kind in ("col", "row")}
    return n / split["col"], k / split["row"]


def anchor_choices(ctx: Context, graph: nx.DiGraph, node: str, mult: float,
                   shared: frozenset[str] = frozenset()) -> list[Choice]:
    """Choices of anchor ``node`` standing for ``mult`` real ops (repeated layers).

    ``shared``: its parameters that another anchor owns (a tied head's weight, the
    embedding's): placed here too, their state and its traffic counted by the owner."""
    d = graph.nodes[node]
    layers = graph.graph["layers"]
    op = d["short"]
    shape = d["shape"]
    out: list[Choice] = []
    for kinds in _per_dim_options(ctx, ANCHOR_KINDS):
        lay = {i: _anchor_layouts(op, k) for i, k in kinds.items()}
        if any(v is None for v in lay.values()):
            continue
        inp = _combine(ctx, {i: v[0] for i, v in lay.items()}, "B")
        outl = _combine(ctx, {i: v[1] for i, v in lay.items()}, "B")
        if not _divisible(ctx, outl, shape):
            continue
        # the activation input: addmm's (GPT-2's Conv1D) comes after the bias
        act_in = 1 if op == "addmm" and len(d["in_shapes"]) > 2 else 0
        if op != "embedding" and d["in_shapes"] and not _divisible(ctx, inp, d["in_shapes"][act_in]):
            continue
        weights: dict[str, tuple[str, ...]] = {}
        state = (0.0, 0.0, 0.0)
        sync = gather = tensors = pending = 0.0
        ok = True
        for arg, fqn in d["params"].items():
            pshape = graph.graph["param_shapes"][fqn]
            pl = tuple("R" if i not in kinds else weight_placement(kinds[i], op, arg, pshape,
                                                                   arg in d["params_swapped"])
                       for i in range(len(ctx.mesh_shape)))
            for n, p in zip(ctx.mesh_shape, pl):
                if p.startswith("S(") and pshape[int(p[2:-1])] % n:
                    ok = False
            weights[fqn] = pl
            if fqn in shared:
                continue
            tensors += mult
            s, g_sync, g_gather = _param_state(ctx, pshape, pl)
            state = tuple(a + mult * b for a, b in zip(state, s))
            gather += mult * g_gather
            sync += mult * g_sync
            pending += mult * _pending_grad_s(ctx, pshape, pl, inp if len(pshape) > 1 else outl)
        if not ok:
            continue
        work = _shards(ctx, outl) * _shards(ctx, inp, "H") if op != "embedding" else _shards(ctx, outl)
        if op == "scaled_dot_product_attention":
            work = _shards(ctx, outl)
        name = "+".join(kinds[i] for i in ctx.free_dims) or "data"
        act = _saved_bytes(ctx, [(d, mult)], layers) / max(_shards(ctx, outl), 1)
        compute, recompute = _compute_s(ctx, [(d, mult)], work, _shards(ctx, outl),
                                        _gemm_features(ctx, d, op, kinds))
        out.append(Choice(name, outl, inp, compute, recompute, weights, state, act, sync, gather, tensors=tensors,
                          pending_grad_s=pending))
    return out


def norm_module_node(node: dict) -> bool:
    """A node of a norm module over the hidden states (``[b, s, h]``): the executor
    converts such a module's input and output to the plan's layouts (plan.modules)."""
    return node["short"] in REDUCING_OPS and bool(node["module"]) and len(node["shape"]) == 3


def cuts_replicated_inputs(graph: nx.DiGraph, kind: str, members: Sequence[str]) -> bool:
    """Whether a unit's replicated input is cut to the unit's sharded layout whatever its
    other inputs are.  A local chunk happens where the executor converts a module's input
    (a norm module's; a projection's, whose sharded weight DTensor also follows where no
    module boundary lies, as in the second product of Mixtral's experts).  Elsewhere
    DTensor decides, and it cuts a replicated operand only to match one that arrives
    sharded (an elementwise op's): with every input replicated (GPT-2's attention after
    the q/k/v split gathers them, a loss on a replicated head's logits) the op runs
    replicated, so the ILP may not price it sharded behind a free chunk."""
    if kind == "anchor":
        return bool(graph.nodes[members[0]]["params"])
    return any(norm_module_node(graph.nodes[n]) for n in members)


def _crosses_features(ctx: Context, node: dict) -> bool:
    """Whether ``node`` works across the dim a feature (``H``) layout shards, so that a
    segment holding it cannot keep that dim sharded: a reduction or norm over it, or a cut
    of it (DTensor gathers a tensor sharded on the dim it splits, ``split_strategy``).  On
    a tensor of up to 3 dims ``H`` shards the last: a norm over the hidden states, GPT-2's
    q/k/v split, Mixtral's gate/up chunk cross it.  On attention's 4-D tensors it shards
    the heads, which a per-head norm over head_dim (Qwen3's q_norm) and rotary's halves of
    head_dim leave whole, and StableLM's split into single heads cuts.  A reshape that
    folds it into a dim before it crosses it too (BLOOM's heads into the batch)."""
    short = node["short"]
    src = (node.get("in_shapes") or [()])[0]
    sharded = concrete("H", src, ctx.seq_len)
    if short in CUTTING_OPS:
        dst, dim = node["shape"], shard_dim(sharded) if sharded else None
        return dim is not None and len(dst) == len(src) and dst[dim] != src[dim]
    if short in REDUCING_OPS - LOSS_OPS:
        dims = node.get("op_dims")
        return dims is None or sharded is None or shard_dim(sharded) in dims
    if short in RESHAPING_OPS and sharded and len(src) > 1:
        return _merged_after_another(tuple(src), tuple(node["shape"]), shard_dim(sharded))
    return False


@functools.cache  # asked per layout of every segment; a model has few distinct reshapes
def _merged_after_another(src: tuple[int, ...], dst: tuple[int, ...], dim: int) -> bool:
    """Whether reshaping ``src`` to ``dst`` merges ``dim`` into a dim before it, by DTensor's
    own reading of the reshape (``view_groups``).  The graph is traced with one sequence, so
    the batch's dim (0, in and out) is given two first: a one-sized dim reads as no dim.
    (``view_groups`` is private; it is what DTensor's view rules run, so the plan reads a
    reshape as the executor will.)"""
    from torch.distributed.tensor._ops._view_ops import Flatten, InputDim, Split, view_groups

    groups = view_groups([2 * src[0], *src[1:]], [2 * dst[0], *dst[1:]])
    for spec in groups:
        spec = spec.input_dim if isinstance(spec, Split) else spec
        if isinstance(spec, Flatten) and any(
                isinstance(d, InputDim) and d.input_dim == dim for d in spec.input_dims[1:]):
            return True
    return False


def segment_choices(ctx: Context, graph: nx.DiGraph, nodes: Sequence[str],
                    shared: frozenset[str] = frozenset()) -> list[Choice]:
    """Layouts of the segment made of ``nodes`` (every traced member, each at its multiplicity).

    Its parameters (norm weights and biases, but ``shared`` ones, which an anchor owns)
    stay replicated on the model dims under every layout: their state and its traffic
    are the same in each choice."""
    data = [(graph.nodes[n], float(layer_weight(graph, n))) for n in nodes]
    layers = graph.graph["layers"]
    owned = {fqn: w for d, w in data for fqn in d["params"].values() if fqn not in shared}
    whole = ("R",) * len(ctx.mesh_shape)
    state, sync, gather = (0.0, 0.0, 0.0), 0.0, 0.0
    for fqn, w in owned.items():
        s, g_sync, g_gather = _param_state(ctx, graph.graph["param_shapes"][fqn], whole)
        state = tuple(a + w * b for a, b in zip(state, s))
        sync, gather = sync + w * g_sync, gather + w * g_gather
    shorts = {d["short"] for d, _ in data}
    only_views = shorts <= VIEW_OPS
    shapes = {d["shape"] for d, _ in data if d["shape"]}
    out = []
    for per_dim in _per_dim_options(ctx, LAYOUTS):
        layout = _combine(ctx, per_dim, "B")
        if "P" in layout and not only_views:
            continue
        if "H" in layout and any(_crosses_features(ctx, d) for d, _ in data):
            continue
        if "Q" in layout and shorts & ACTIVATION_PRODUCTS:
            continue
        if shorts & LOSS_OPS and any(layout[i] not in ("R", "H") for i in ctx.free_dims):
            continue
        if not all(_divisible(ctx, layout, s) for s in shapes):
            continue
        shards = _shards(ctx, layout)
        name = "+".join(per_dim[i] for i in ctx.free_dims) or "B"
        comm = _vocab_parallel_loss_s(ctx, layout) if shorts & LOSS_OPS else 0.0
        compute, recompute = _compute_s(ctx, data, shards)
        pending = sum(w * _pending_grad_s(ctx, graph.graph["param_shapes"][fqn], whole, layout)
                      for fqn, w in owned.items())
        out.append(Choice(name, layout, layout, compute, recompute, weights=dict.fromkeys(owned, whole),
                          state=state, act_bytes=_saved_bytes(ctx, data, layers) / shards,
                          grad_sync_s=sync, gather_s=gather, tensors=sum(owned.values()),
                          pending_grad_s=pending, comm_s=comm))
    return out


def activation_nodes(graph: nx.DiGraph) -> set[str]:
    """Nodes downstream of an embedding: the ones whose size grows with the batch."""
    roots = [n for n, d in graph.nodes(data=True) if d.get("short") == "embedding"]
    seen: set[str] = set(roots)
    for r in roots:
        seen |= nx.descendants(graph, r)
    return {n for n in seen if graph.nodes[n]["kind"] == "call_function"
            and graph.nodes[n]["out_numel"] > 0}


def unplaced_compute_s(ctx: Context, graph: nx.DiGraph) -> tuple[float, float]:
    """(before the layers, in all layers) per-device seconds per step of the traced ops no
    unit holds: those not downstream of an embedding (``activation_nodes``), which the ILP
    has nothing to place for.  They run all the same, whole and on plain tensors on every
    rank: the model's own code on positions and masks (rotary tables, the causal mask;
    ~60 nodes of a Hugging Face Llama) and the layers' dtype asserts.  On a CPU each costs
    its ``node_host_s``, which calibrate measures per node of the whole trace
    (``cost_model.calibrate.measure_node_host``); the units' nodes alone are ~2/3 of a
    Llama's.  Their tensors follow the rank's share of the batch.  Under pipelining every
    stage runs the code before the layers again (``executor.pipeline``): the first
    figure is one run's, times the micro-batches."""
    act = activation_nodes(graph)
    before: list[tuple[dict, float]] = []
    within: list[tuple[dict, float]] = []
    for n, d in graph.nodes(data=True):
        if d["kind"] == "call_function" and n not in act:
            (before if d.get("layer") is None else within).append((d, layer_weight(graph, n)))
    return (_compute_s(ctx, before, ctx.data_ranks, plain=True)[0],
            _compute_s(ctx, within, ctx.data_ranks, plain=True)[0])


def canonical_map(graph: nx.DiGraph) -> dict[str, str]:
    """Each traced node -> its counterpart in the first traced layer of its kind (itself
    elsewhere): a model whose layers come in kinds (DeepSeek-V3's dense and MoE layers)
    has one set of units per kind, each kind's layers taking one layout."""
    by_layer: dict[int, list[str]] = defaultdict(list)
    for n, d in graph.nodes(data=True):
        if d.get("layer") is not None and d["kind"] == "call_function":
            by_layer[d["layer"]].append(n)
    canon = {n: n for n in graph.nodes}
    firsts: dict[tuple, list[str]] = {}
    for layer in sorted(by_layer):
        nodes = by_layer[layer]
        kind = tuple((graph.nodes[n]["op"], graph.nodes[n]["shape"]) for n in nodes)
        canon.update(zip(nodes, firsts.setdefault(kind, nodes)))
    return canon


def layer_kinds(graph: nx.DiGraph, canon: Mapping[str, str]) -> dict[int, int]:
    """Each traced layer -> the first traced layer of its kind (``canonical_map``'s)."""
    return {d["layer"]: graph.nodes[canon[n]]["layer"] for n, d in graph.nodes(data=True)
            if d.get("layer") is not None and d["kind"] == "call_function"}


def _adds_heads(d: dict) -> bool:
    """An ``expand`` of one head to all, ``[b, 1, s, d] -> [b, h, s, d]``: DeepSeek's
    rotary key, shared by the heads and computed beside ``kv_a_layernorm`` (which reduces
    over features, so its segment is never split by heads).  Its consumers (the heads'
    keys) can be, so the follow merge ends here and the ILP prices the step between
    (replicated to split by heads is a local slice forward, a gather of the gradient)."""
    shapes = d.get("in_shapes") or ()
    return (d["short"] == "expand" and len(d["shape"]) == 4 and len(shapes) > 0
            and len(shapes[0]) == 4 and shapes[0][1] == 1 < d["shape"][1])


def build_units(ctx: Context, graph: nx.DiGraph) -> tuple[dict[str, Unit], dict[str, str]]:
    """Canonical units with their choices, and node -> unit key for every activation node."""
    act = activation_nodes(graph)
    anchors = {n for n in act if graph.nodes[n]["short"] in ANCHOR_OPS
               and (graph.nodes[n]["short"] != "addmm" or graph.nodes[n]["params"])}
    follow = nx.Graph()
    follow.add_nodes_from(act - anchors)
    follow.add_edges_from((u, v) for u, v in graph.edges
                          if u in follow and v in follow and not _adds_heads(graph.nodes[u]))
    canon = canonical_map(graph)
    # a parameter used by several anchors (tied embeddings) is owned by the first
    owner: dict[str, str] = {}
    for n in nx.topological_sort(graph):
        if n in anchors:
            for fqn in graph.nodes[n]["params"].values():
                owner.setdefault(fqn, canon[n])
    unit_of: dict[str, str] = {}
    groups: dict[str, list[str]] = {}
    for a in anchors:
        unit_of[a] = canon[a]
        groups.setdefault(canon[a], []).append(a)
    for comp in nx.connected_components(follow):
        key = min(canon[n] for n in comp)
        for n in comp:
            unit_of[n] = key
        groups.setdefault(key, []).extend(comp)
    units: dict[str, Unit] = {}
    for key, members in groups.items():
        kind = "anchor" if key in anchors else "segment"
        mult = sum(layer_weight(graph, n) for n in members)
        unit = Unit(key, kind, sorted(members), mult, graph.nodes[key]["module"],
                    cuts_inputs=cuts_replicated_inputs(graph, kind, [key] if kind == "anchor" else members),
                    gathers=ctx.gathers(graph.nodes[key].get("layer") is not None, graph.graph["layers"]),
                    loss=any(graph.nodes[n]["short"] in LOSS_OPS for n in members))
        if kind == "anchor":
            shared = frozenset(f for f in graph.nodes[key]["params"].values() if owner[f] != key)
            unit.choices = anchor_choices(ctx, graph, key, mult, shared)
        else:
            unit.choices = segment_choices(ctx, graph, members, frozenset(owner))
        units[key] = unit
    return units, unit_of


def _vocab_parallel_loss_s(ctx: Context, layout: Sequence[str]) -> float:
    """Seconds per step of executor.loss's collectives on vocabulary-sharded (H) dims: an
    all-reduce of the max logit, then one of the sum of exps and the target's logit, per
    fp32 token of the rank's micro-batch; none in backward."""
    tokens = ctx.microbatch * ctx.seq_len / _shards(ctx, layout, "BQ")
    return ctx.microbatches * sum(
        collective_time(ctx.profile, "all_reduce", 4 * n * tokens, ctx.mesh_shape, i)
        for i in ctx.free_dims if layout[i] == "H" for n in (1, 2))


def loss_mean_s(ctx: Context) -> float:
    """Seconds per micro-batch executor.data spends averaging the loss over the
    data-parallel dims (cost_model.step.loss_mean_time)."""
    return loss_mean_time(ctx.profile, ctx.mesh_shape, ctx.data_dims)


def fsdp_degree(ctx: Context) -> int:
    """Ranks a fully sharded parameter is split over (1 without fully sharded dims)."""
    return math.prod(n for name, n in zip(ctx.mesh_names, ctx.mesh_shape) if name in ctx.fsdp)


def layer_index(fqn: str) -> int | None:
    """The repeated layer a parameter belongs to (``model.layers.3.mlp...`` -> 3; the first
    number in its name), None for the root's."""
    return next((int(part) for part in fqn.split(".") if part.isdigit()), None)


def unit_params(ctx: Context, param_shapes: Mapping[str, Sequence[int]],
                placed: Mapping[str, Sequence[str]] | None = None) -> tuple[float, float]:
    """(root, largest layer) parameters on one device before FSDP's division, for the FSDP2
    units ``executor.apply`` makes (one per repeated layer, the rest in the root).

    ``placed``: placements per parameter pattern (a solved layout); without it every
    matrix is taken as split over the model-parallel dims and every vector as whole, as
    tensor-parallel layouts place them (the estimate before the ILP has chosen)."""
    split = math.prod(ctx.mesh_shape[i] for i in ctx.free_dims)
    root, layers = 0.0, defaultdict(float)
    for fqn, shape in param_shapes.items():
        numel = math.prod(shape)
        if placed is None:
            local = numel / split if len(shape) >= 2 else numel
        else:
            pl = placed.get(fqn_pattern(fqn), ("R",) * len(ctx.mesh_shape))
            local = numel / math.prod(ctx.mesh_shape[i] for i in ctx.free_dims if pl[i].startswith("S("))
        at = layer_index(fqn)
        if at is None:
            root += local
        else:
            layers[at] += local
    return root, max(layers.values(), default=0.0)


def fsdp_host_s(ctx: Context, units: int, weight_bytes: float) -> float:
    """FSDP2's host time per step (cost_model.step.fsdp_host_time) for ``units`` units
    whose weights take ``weight_bytes`` per device at rest (1/degree of them under FSDP)."""
    degree = ctx.data_ranks
    if degree == 1:
        return 0.0
    fsdp = "dp" in ctx.fsdp
    return fsdp_host_time(ctx.profile, "fully_shard" if fsdp else "replicate", units,
                          weight_bytes * (degree if fsdp else 1), ctx.microbatches)


def fsdp_copy_s(ctx: Context, gathered_bytes: float, weight_bytes: float, reductions: int) -> float:
    """FSDP2's copy kernels per step on a GPU (cost_model.step.fsdp_copy_time) for weights
    of ``weight_bytes`` per device at rest (1/degree of them under FSDP), their gradients
    reduced ``reductions`` times, and ``gathered_bytes`` of them at rest times their
    all-gathers in the step."""
    if ctx.data_ranks == 1:
        return 0.0
    shard = fsdp_degree(ctx)
    per_param = shard / state_bytes_per_param(ctx.optimizer).weights
    return fsdp_copy_time(ctx.profile, ctx.optimizer, shard, gathered_bytes * per_param,
                          weight_bytes * per_param, reductions)
