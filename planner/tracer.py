"""Tracer: unchanged model -> torch.export (non-strict, meta tensors) -> networkx graph.

Why only a few layers are exported: a decoder's layers are the same subgraph up to
names, so exporting ``TRACED_LAYERS`` of them, checking that they really are equal
(the per-layer signature of ops, shapes and relative module paths), and recording
how many the real model has keeps tracing time flat in depth (llama3-405b traces as
fast as llama3-8b).  A model whose layers come in kinds (their parameters differ:
DeepSeek-V3's dense first layers and MoE rest) has the shortest run of leading layers
that holds ``TRACED_LAYERS`` of each kind exported, each traced layer standing for its
share of its kind (``layer_weights``; DeepSeek-V3: 5 of 61 layers, its plan in ~20 s
against ~6 minutes with every layer).  When a kind's traced layers differ, or the
truncated model's layers are not the real one's first, the whole model is exported
instead, so the shortcut never silently misdescribes a model.

Node attributes (every call_function node):
    op            aten op name ("aten.linear.default")
    in_shapes     shapes of the tensor arguments, in argument order
    in_nodes      names of the producer node of each tensor argument (constants omitted)
    shape, dtype  the (first) tensor output
    itemsize      bytes per output element
    copy          new memory from an op that can alias its input (a cast, a clone, a
                  contiguous() of a strided view); a same-dtype ``to`` costs nothing
    fwd_flops, bwd_flops, bytes   FLOPs of forward / backward, bytes read + written
    bwd_bytes     bytes the backward reads + writes: elementwise ops by autograd's
                  derivative formulas, plus the accumulation of a gradient from several
                  readers (``_mark_backward``); cross-entropy's extra passes; else ``bytes``;
                  nothing (and no backward FLOPs) for a value that needs no gradient
    op_dims       the dims of its first input that its ``dim`` argument names, or its
                  ``normalized_shape`` covers (``mean(x, -1)``, ``layer_norm``: the last),
                  non-negative; None for an op without either, or given none (every dim)
    fwd_trans, bwd_trans   transcendental evaluations (exp, log, tanh, ...) of forward /
                  backward: on a CPU they, not FLOPs or bytes, bound softmax, SiLU and
                  the loss (``Profile.transcendental_rate``)
    params        {argument position: parameter FQN} for direct parameter inputs
    module        owning module path (innermost of ``nn_module_stack``)
    layer         layer index or None outside the repeated layers
    mask_numel    elements of the mask a dropout keeps for backward (0 for other ops)
    requires_grad a float value computed from a parameter
    saved         a backward needs this value (autograd's rules: ``_mark_saved``)
    rerun         a checkpointed layer's recomputation produces it again (``_mark_rerun``)
    ckpt_numel    what a checkpointed layer keeps of its inputs, recorded here
                  (``_mark_checkpoint_inputs``)
A model whose ``forward`` takes ``labels`` (every Hugging Face LM) is traced with
``labels=input_ids``, so the loss it computes in training (``cross_entropy_loss`` over
the whole vocabulary, as large as an MLP's GEMMs on small models) is in the graph.

Graph attributes: model, layers (real count), traced_layers, layer_weights (the real
layers each traced one stands for), stand_ins (the traced layer each real one is priced
as: a pipeline stage's layers), layer_prefix, batch_size,
seq_len, param_shapes (every parameter of the real model, FQN -> shape), dtype and
itemsize of the parameters (the model is traced in the training dtype: ``trace``).
"""

from __future__ import annotations

import inspect
import logging
import math
import re
import sys
import threading
from collections import Counter, defaultdict
from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from statistics import mean
from typing import Any

import networkx as nx
import torch
from torch import fx, nn
from transformers import PretrainedConfig

from planner.presets import (
    ConfigError,
    build_model,
    default_seq_len,
    load_config,
    max_positions,
    model_name,
)

TRACED_LAYERS = 2
# A repeated layer's module: Hugging Face's ``layers``, GPT-2's ``h``, MPT's and DBRX's ``blocks``
_LAYER_RE = re.compile(r"^(?P<prefix>.*?\.(?:layers|h|blocks))\.(?P<idx>\d+)(?:\.|$)")

# Ops that only reinterpret memory: no FLOPs, no traffic.
_VIEW_OPS = {
    "view", "_unsafe_view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "expand",
    "slice", "select", "alias", "t", "split", "chunk", "unbind", "detach", "_assert_tensor_metadata",
    "getitem", "lift_fresh_copy",
}
# Backward FLOPs as a multiple of forward: matmuls need dX and dW (2x); attention
# recomputes nothing in this count and needs dQ, dK, dV from 4 matmuls (2x);
# elementwise ops need about one pass.
_BWD_FACTOR = {"linear": 2.0, "mm": 2.0, "addmm": 2.0, "bmm": 2.0, "matmul": 2.0,
               "scaled_dot_product_attention": 2.0, "grouped_mm": 2.0, "chunk_gated_delta_rule": 2.0,
               "embedding": 0.0}
# Transcendental evaluations per output element, (forward, backward): the backward of
# SiLU / GELU re-evaluates the sigmoid / erf, log-softmax's backward takes exp of its
# output; sigmoid, tanh, exp and softmax differentiate from their saved output alone.
_TRANSCENDENTALS = {"exp": (1, 0), "log": (1, 0), "sigmoid": (1, 0), "tanh": (1, 0),
                    "silu": (1, 1), "gelu": (1, 1), "softmax": (1, 0), "_softmax": (1, 0),
                    "log_softmax": (1, 1), "_log_softmax": (1, 1)}


def _layer_of(module: str) -> tuple[str, int] | None:
    m = _LAYER_RE.match(module)
    return (m["prefix"], int(m["idx"])) if m else None


def _op_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{target._schema.name.split('::')[-1]}.{target._overloadname}"
    return getattr(target, "__name__", str(target))


# One name per computation where the export shows it under several: Hugging Face runs MoE
# experts with torch's grouped GEMM where it has a kernel for the dtype (bf16: every GPU
# profile's trace) and with its own custom op otherwise (fp32 on CPU).
_SHORT_ALIASES = {"_grouped_mm": "grouped_mm", "grouped_mm_fallback": "grouped_mm"}


def _short(op: str) -> str:
    parts = op.split(".")
    short = parts[1] if parts[0] == "aten" and len(parts) > 1 else op.split(".")[-1]
    return _SHORT_ALIASES.get(short, short)


def _op_dims(node: fx.Node, rank: int) -> tuple[int, ...] | None:
    """The ``op_dims`` of ``node`` (see the module docstring), whose first input has
    ``rank`` dims, from its aten schema's ``dim`` or ``normalized_shape`` argument."""
    schema = getattr(node.target, "_schema", None)
    if schema is None or rank == 0:
        return None
    given = {a.name: node.args[i] if i < len(node.args) else node.kwargs.get(a.name, a.default_value)
             for i, a in enumerate(schema.arguments) if i < len(node.args) or a.name in node.kwargs
             or a.has_default_value()}
    if "normalized_shape" in given:
        return tuple(range(rank - len(given["normalized_shape"]), rank))
    dims = given.get("dim")
    if dims is None:
        return None
    return tuple(sorted({d % rank for d in ([dims] if isinstance(dims, int) else dims)})) or None


def _tensors(val: Any) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [t for v in val for t in _tensors(v)]
    return []


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# Gated DeltaNet's chunked delta rule (Qwen3.5, Qwen3-Next, OLMo Hybrid) is traced as the one
# fused kernel training calls (flash-linear-attention's chunk_gated_delta_rule, chunks of
# 64 tokens), not as transformers' PyTorch fallback, which torch.export turns into ~2,000
# ops a layer (a 63-step forward substitution in place of solve_triangular): priced op by
# op, each with its launch and its round trip through memory, that layer cost ~10x a
# full-attention layer on an H100 (51 against 4.7 ms, forward and backward, at 4,096
# tokens).  The op below only stands in for the kernel in the trace: the model runs the
# fallback, or the fused kernel where it is installed.
_DELTA_CHUNK = 64
_TRACING = threading.local()  # .delta_rule: this thread is exporting a model


@torch.library.custom_op("meshplan::chunk_gated_delta_rule", mutates_args=())
def _delta_rule_stand_in(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor) -> torch.Tensor:
    raise NotImplementedError("meshplan::chunk_gated_delta_rule stands in for the kernel in traces only")


@_delta_rule_stand_in.register_fake
def _(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
      beta: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(value)  # [batch, seq, heads, value head dim], as the kernel's


def _delta_rule_flops(q: torch.Tensor, v: torch.Tensor) -> float:
    """Forward FLOPs of the chunked delta rule on q [b, t, hk, dk] and v [b, t, h, dv] (each
    query/key head serves h / hk value heads), per head and chunk of C tokens: within it
    k k^T, q k^T and the gated-key products (3 x 2C^2 dk), the values' two (2 x 2C^2 dv),
    the triangular solve (2C^3 / 3); across chunks the state's read by keys and by
    queries and its update (3 x 2C dk dv).  transformers' fallback, which pads the
    sequence to whole chunks, runs the same matmuls and solves by forward substitution."""
    b, t, _, dk = q.shape
    h, dv, c = v.shape[-2], v.shape[-1], _DELTA_CHUNK
    tokens = b * h * math.ceil(t / c) * c
    return tokens * (6.0 * c * dk + 4.0 * c * dv + 2.0 * c * c / 3 + 6.0 * dk * dv)


def _fused_delta_rule(model: nn.Module) -> None:
    """Make ``model``'s modelling modules call the stand-in while this thread exports: their
    ``torch_chunk_gated_delta_rule`` (a module global the layers look up at each call) is
    wrapped once, for good, and calls the original unless ``_TRACING.delta_rule`` is set,
    so other threads' models and eager runs are untouched."""
    for module in {sys.modules[type(m).__module__] for m in model.modules()}:
        original = getattr(module, "torch_chunk_gated_delta_rule", None)
        if original is None or getattr(original, "_meshplan_stand_in", False):
            continue

        def wrapped(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            if not getattr(_TRACING, "delta_rule", False) or args or kwargs.get("initial_state") is not None:
                return _original(query, key, value, g, beta, *args, **kwargs)
            return torch.ops.meshplan.chunk_gated_delta_rule(query, key, value, g, beta), None

        wrapped._meshplan_stand_in = True  # type: ignore[attr-defined]
        module.torch_chunk_gated_delta_rule = wrapped


def _matmul_flops(short: str, ins: list[torch.Tensor], out: torch.Tensor | None, node: fx.Node,
                  causal_lm: bool) -> float:
    """Forward FLOPs of the ops that dominate training (2 per multiply-add).

    Written here because export's training IR keeps aten.linear and
    aten.scaled_dot_product_attention, which torch.utils.flop_counter does not cover.
    """
    if out is None:
        return 0.0
    if short in ("linear", "mm", "addmm", "bmm", "matmul", "baddbmm"):
        weight = ins[1] if short in ("linear", "mm", "bmm", "matmul") else ins[2]
        k = weight.shape[-1] if short == "linear" else weight.shape[-2]
        return 2.0 * out.numel() * k
    if short == "scaled_dot_product_attention":
        q, k = ins[0], ins[1]
        batch_heads = math.prod(q.shape[:-2])
        flops = 4.0 * batch_heads * q.shape[-2] * k.shape[-2] * q.shape[-1]
        # A causal LM's mask is causal even where HF materialises it for export; causal
        # kernels (flash, cuDNN) skip the masked half, which is what training runs.
        causal = causal_lm or node.kwargs.get("is_causal", False)
        return flops / 2 if causal else flops
    if short == "grouped_mm":  # MoE experts: every routed token row x its expert
        x, w = ins[0], ins[1]
        return 2.0 * x.shape[0] * w.shape[-1] * w.shape[-2]
    if short == "chunk_gated_delta_rule":
        return _delta_rule_flops(ins[0], ins[2])
    return 0.0


@dataclass
class _Export:
    program: torch.export.ExportedProgram
    layers: int


class _ThreadFilter(logging.Filter):
    """Drops the records one thread logs."""

    def __init__(self, thread: int) -> None:
        super().__init__()
        self.thread = thread

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread != self.thread


def _export(model: nn.Module, batch_size: int, seq_len: int, fused: bool) -> torch.export.ExportedProgram:
    # the ids live where the weights do: torch 2.11's fake tensors refuse a CPU model's
    # embedding of meta ids (2.13 lets the meta device win)
    device = next((p.device for p in model.parameters()), torch.device("meta"))
    ids = torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)
    kwargs: dict[str, Any] = {"use_cache": False} if hasattr(model, "config") else {}
    if "labels" in inspect.signature(model.forward).parameters:
        kwargs["labels"] = ids  # training computes the loss: trace it too
    # torch's fake tensors log a failing op's traceback (~20 lines on stderr) before the
    # exception this turns into one line; the exception keeps it as its cause.  A filter
    # on this thread's records only: other threads' traces log as they would
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    quiet = _ThreadFilter(threading.get_ident())
    fake_log.addFilter(quiet)
    if fused:
        _fused_delta_rule(model)
    _TRACING.delta_rule = fused
    try:
        return torch.export.export(model, (ids,), kwargs, strict=False)
    except Exception as e:  # torch.export raises many unrelated types; report one line
        raise ConfigError(f"model: torch.export failed on {type(model).__name__}: {str(e).splitlines()[0]}") from e
    finally:
        _TRACING.delta_rule = False
        fake_log.removeFilter(quiet)


def _num_layers(config: PretrainedConfig) -> int:
    return int(getattr(config, "num_hidden_layers", None) or config.n_layer)


def _truncated(config: PretrainedConfig, layers: int) -> PretrainedConfig:
    small = config.__class__.from_dict(config.to_dict())
    small.name_or_path = config.name_or_path
    if hasattr(small, "n_layer"):
        small.n_layer = layers
    small.num_hidden_layers = layers
    if getattr(small, "layer_types", None):
        small.layer_types = small.layer_types[:layers]
    return small


def _param_behind_views(arg: fx.Node, sig: Any, param_of: Mapping[str, str]) -> tuple[str, bool] | None:
    """The parameter an argument is, directly or through views, so its memory and
    placement are charged to the op that uses it; and whether the views swap its last two
    dims (Mixtral's experts, stored [experts, out, in], reach the grouped GEMM transposed;
    GPT-OSS's, stored [experts, in, out], as they are)."""
    swapped = False
    while arg.op == "call_function" and _short(_op_name(arg)) in _VIEW_OPS and arg.args:
        if not isinstance(arg.args[0], fx.Node):
            return None
        swapped ^= _swaps_last_two(arg)
        arg = arg.args[0]
    return (param_of[arg.name], swapped) if arg.name in sig.inputs_to_parameters else None


def _swaps_last_two(view: fx.Node) -> bool:
    rank = len(view.meta["val"].shape) if isinstance(view.meta.get("val"), torch.Tensor) else 0
    short = _short(_op_name(view))
    if short == "t":
        return True
    if short == "transpose" and rank >= 2:
        return {int(d) % rank for d in view.args[1:3]} == {rank - 2, rank - 1}
    if short == "permute" and rank >= 2:
        perm = [int(d) % rank for d in view.args[1]]
        return perm[-2:] == [rank - 1, rank - 2]
    return False


def build_graph(program: torch.export.ExportedProgram, causal_lm: bool = False,
                aliases: Mapping[str, str] | None = None) -> nx.DiGraph:
    """The export graph as a networkx DiGraph with per-node costs (see module doc).

    ``aliases`` maps a tied parameter's other names to its first one (GPT-2's
    lm_head.weight -> transformer.wte.weight), so one parameter has one FQN.
    """
    sig = program.graph_signature
    aliases = aliases or {}
    param_of = {k: aliases.get(v, v) for k, v in {**sig.inputs_to_parameters, **sig.inputs_to_buffers}.items()}
    graph = nx.DiGraph()
    for node in program.graph.nodes:
        if node.op == "placeholder":
            val = node.meta.get("val")
            graph.add_node(node.name, kind="placeholder", op="placeholder",
                           param=param_of.get(node.name),
                           is_param=node.name in sig.inputs_to_parameters,
                           shape=tuple(val.shape) if isinstance(val, torch.Tensor) else (),
                           dtype=str(val.dtype) if isinstance(val, torch.Tensor) else "",
                           itemsize=val.element_size() if isinstance(val, torch.Tensor) else 0,
                           module="", layer=None, fwd_flops=0.0, bwd_flops=0.0, bytes=0.0,
                           bwd_bytes=0.0, fwd_trans=0.0, bwd_trans=0.0)
            continue
        if node.op != "call_function":
            continue
        op = _op_name(node)
        short = _short(op)
        arg_nodes = [a for a in node.all_input_nodes]
        ins = [t for a in node.args for t in (_tensors(a.meta.get("val")) if isinstance(a, fx.Node) else [])]
        in_nodes = [a.name for a in node.args if isinstance(a, fx.Node)
                    and _tensors(a.meta.get("val"))]
        outs = _tensors(node.meta.get("val"))
        out = outs[0] if outs else None
        stack = node.meta.get("nn_module_stack") or {}
        module = list(stack.values())[-1][0] if stack else ""
        layer = _layer_of(module)
        fwd = _matmul_flops(short, ins, out, node, causal_lm)
        # new memory from an op that can alias its input: a dtype change (bf16 -> fp32 in
        # Hugging Face's norms), a clone, contiguous() of a strided view
        copy = bool(ins) and out is not None and (
            ins[0].dtype != out.dtype or short == "clone"
            or (short == "contiguous" and not ins[0].is_contiguous()))
        if short in _VIEW_OPS or not outs or (short in _MAYBE_ALIAS and not copy):
            nbytes = 0.0
        else:
            nbytes = float(sum(_nbytes(t) for t in ins) + sum(_nbytes(t) for t in outs))
            if fwd == 0.0 and short != "embedding":
                fwd = float(sum(t.numel() for t in outs))  # one FLOP per output element
        bwd_bytes = nbytes
        per_elem = _TRANSCENDENTALS.get(short, (0, 0))
        trans = (per_elem[0] * (out.numel() if out is not None else 0),
                 per_elem[1] * (out.numel() if out is not None else 0))
        if short == "scaled_dot_product_attention":  # one exp per attention score, both ways
            scores = fwd / (4.0 * ins[0].shape[-1])
            trans = (scores, scores)
        elif short == "chunk_gated_delta_rule":
            # exp of each chunk's C x C decay mask, per token and head, both ways; the
            # kernel writes each chunk's state [dk, dv] per head and reads it back
            q, v = ins[0], ins[2]
            chunks = math.ceil(q.shape[1] / _DELTA_CHUNK)
            scores = float(v.shape[0] * v.shape[2] * chunks * _DELTA_CHUNK * _DELTA_CHUNK)
            trans = (scores, scores)
            nbytes += 2.0 * v.shape[0] * v.shape[2] * chunks * q.shape[-1] * v.shape[-1] * v.element_size()
            bwd_bytes = nbytes
        elif short == "cross_entropy_loss":
            # log-softmax over the vocabulary, then a gather: one exp per logit; the
            # backward zero-fills the logits' gradient, scatters into it, and runs
            # log-softmax's backward (exp of the saved log-probabilities, read + write)
            logits = ins[0]
            fwd = float(logits.numel())
            nbytes = 2.0 * _nbytes(logits)
            bwd_bytes = 4.0 * _nbytes(logits)
            trans = (float(logits.numel()), float(logits.numel()))
        behind = {i: found for i, a in enumerate(node.args)
                  if isinstance(a, fx.Node) and (found := _param_behind_views(a, sig, param_of))}
        params = {i: fqn for i, (fqn, _) in behind.items()}
        graph.add_node(
            node.name, kind="call_function", op=op, short=short,
            in_shapes=[tuple(t.shape) for t in ins], in_nodes=in_nodes,
            shape=tuple(out.shape) if out is not None else (),
            dtype=str(out.dtype) if out is not None else "",
            itemsize=out.element_size() if out is not None else 0,
            copy=copy,
            # a dropout keeps its mask for backward: one byte per element
            mask_numel=out.numel() if short == "dropout" and len(node.args) > 1
            and float(node.args[1]) > 0 else 0,
            out_numel=sum(t.numel() for t in outs),
            fwd_flops=fwd, bwd_flops=fwd * _BWD_FACTOR.get(short, 1.0), bytes=nbytes,
            bwd_bytes=bwd_bytes, fwd_trans=float(trans[0]), bwd_trans=float(trans[1]),
            params=params, params_swapped={i for i, (_, swapped) in behind.items() if swapped},
            module=module, layer=layer[1] if layer else None,
            op_dims=_op_dims(node, ins[0].dim()) if ins else None,
        )
        for a in arg_nodes:
            if a.name in graph:
                val = a.meta.get("val")
                nb = sum(_nbytes(t) for t in _tensors(val))
                graph.add_edge(a.name, node.name, bytes=nb)
    _mark_requires_grad(graph)
    _mark_backward(graph)
    _mark_saved(graph)
    _mark_rerun(graph)
    return graph


# Ops whose backward needs an input's value: autograd saves those inputs.  Adds,
# casts, negation, concatenation and views need none, so what feeds only them is
# not kept (this is how the Korthikanti et al. per-layer count is built up).  The loss
# keeps its log-probabilities, not the logits (planner.strategies counts them).
_SAVES_INPUTS = {"linear", "addmm", "mm", "bmm", "matmul", "mul", "div", "pow", "silu", "gelu",
                 "scaled_dot_product_attention", "layer_norm", "native_layer_norm", "rms_norm",
                 "grouped_mm", "log", "index", "gather", "chunk_gated_delta_rule"}


def floating(dtype: str) -> bool:
    """Whether a node's recorded dtype (``"torch.float32"``; ``""`` for no tensor) is a
    floating-point one."""
    return getattr(torch, dtype.removeprefix("torch."), torch.int64).is_floating_point


def _mark_requires_grad(graph: nx.DiGraph) -> None:
    """``requires_grad``: a float value computed from a parameter (inputs and buffers,
    such as rotary cos / sin, need no gradient)."""
    for n in nx.topological_sort(graph):
        d = graph.nodes[n]
        d["requires_grad"] = d["is_param"] if d["kind"] == "placeholder" else (
            floating(d["dtype"]) and any(graph.nodes[p]["requires_grad"] for p in graph.predecessors(n)))


# Backward kernels of elementwise ops, from autograd's derivative formulas (torch's
# tools/autograd/derivatives.yaml), checked against the bytes autograd's own kernels move
# (tests/test_tracer.py).  Ops not named here keep their forward's bytes as the estimate.
_ADDS = {"add", "sub"}  # the gradient passes through: no kernel for a same-shape input
# the gradient itself, or views of it (cat's pieces, stack's slices, sum's expansion)
_PASS_THROUGH = {"contiguous", "clone", "sum", "cat", "stack"}
# one-input ops: passes over the input's size.  pow(x, 2): grad * 2 * x.pow(1), three
# kernels; rsqrt: -0.5 * grad * out.pow(3), three; sqrt: grad / (2 * out), two; the rest
# one kernel reading the gradient and a saved tensor (neg: the gradient alone)
_UNARY_PASSES = {"pow": 7, "rsqrt": 7, "sqrt": 5, "silu": 3, "gelu": 3, "tanh": 3, "sigmoid": 3,
                 "exp": 3, "log": 3, "relu": 3, "neg": 2}
_COUNTED = _ADDS | _PASS_THROUGH | set(_UNARY_PASSES) | {"mul", "div", "to", "type_as", "mean"}
_SPLITS = {"split", "split_with_sizes", "chunk", "unbind"}  # pieces of one tensor


def _mark_backward(graph: nx.DiGraph) -> None:
    """The backward's FLOPs and bytes, which forward shapes alone do not give.

    * A value that needs no gradient has no backward: masks, positions, rotary tables.
    * Elementwise ops get their gradient kernels (``_elementwise_backward_bytes``): a
      product whose two inputs both need gradients (SwiGLU's gate * up) costs twice its
      forward, a broadcast weight's gradient a full-size product and its sum besides, a
      same-shape add nothing.
    * A value that k ops send gradients gets k - 1 accumulations, each an add of two
      gradients (autograd's; the residual stream's fork).  A multi-output op (split,
      chunk) gets its pieces' gradients back as one concatenation instead.
    Measured on an H100 against an FSDP2 step's per-op kernel time (docs/cost_model.md,
    "On a GPU"): the step's ``mul`` kernels took 12.5 ms where ``bwd_bytes = bytes``
    priced the traced muls at 5.5, forward and backward; they are priced 9.9 now.
    Parameters' own accumulation (a tied embedding and head) is not counted: the
    planner prices operator nodes only."""
    for n, d in graph.nodes(data=True):
        if d["kind"] != "call_function":
            continue
        if not d["requires_grad"]:
            d["bwd_flops"] = d["bwd_bytes"] = d["bwd_trans"] = 0.0
            continue
        elementwise = _elementwise_backward_bytes(graph, d)
        if elementwise is not None:
            d["bwd_bytes"] = elementwise
        senders = [c for c in graph.successors(n) if graph.nodes[c]["requires_grad"]]
        if d["short"] in _SPLITS:
            d["bwd_bytes"] += 2.0 * d["out_numel"] * d["itemsize"]  # cat the pieces' gradients
            continue
        # an input named twice (x * x) sends two gradients; one in a list (cat) once
        count = sum(max(1, graph.nodes[c]["in_nodes"].count(n)) for c in senders)
        if count > 1:
            d["bwd_bytes"] += (count - 1) * 3.0 * _out_bytes(d)


def _out_bytes(d: dict) -> float:
    return float(math.prod(d["shape"]) * d["itemsize"])


def _elementwise_backward_bytes(graph: nx.DiGraph, d: dict) -> float | None:
    """Bytes the backward kernels of elementwise op ``d`` read and write (None: not one
    of the ops counted here)."""
    short = d["short"]
    if short in _PASS_THROUGH or (short in ("to", "type_as") and not d["copy"]):
        return 0.0
    if short not in _COUNTED or len(d["in_nodes"]) != len(d["in_shapes"]):
        return None
    inputs = [graph.nodes[p] for p in d["in_nodes"]]
    sizes = [math.prod(shape) * p["itemsize"] for shape, p in zip(d["in_shapes"], inputs, strict=True)]
    grad = _out_bytes(d)
    numel = math.prod(d["shape"])
    total = 0.0
    for i, p in enumerate(inputs):
        if not p["requires_grad"]:
            continue
        # a broadcast input's gradient is a full-size tensor first, then summed down to it
        reduce = 2.0 * grad if math.prod(d["in_shapes"][i]) < numel else 0.0
        if short in _ADDS:
            same = not reduce and p["dtype"] == d["dtype"]
            total += 0.0 if same and (short == "add" or i == 0) else grad + sizes[i] + reduce
        elif short == "mul" or (short == "div" and i == 0):  # grad * other, grad / other
            total += grad + sum(sizes) + reduce
        elif short == "div":  # the denominator's: -grad * (a / b) / b, four kernels
            total += sizes[0] + 2.0 * sizes[1] + 7.0 * grad + (reduce + sizes[1] if reduce else 0.0)
        elif short == "mean":  # the gradient expanded to the input, divided by the count
            total += grad + sizes[i]
        elif short in ("to", "type_as"):  # the gradient cast back
            total += grad + sizes[i]
        else:
            total += _UNARY_PASSES[short] * sizes[i]
    return total


def _keeps(graph: nx.DiGraph, consumer: str, value: str) -> bool:
    """Whether ``consumer``'s backward needs ``value``, one of its inputs: a product keeps
    a factor only for the other factor's gradient (``q * cos`` keeps cos, not q)."""
    c = graph.nodes[consumer]
    if not c.get("requires_grad"):  # no backward at all
        return False
    if c.get("short") == "mul":
        others = list(c["in_nodes"])
        if value in others:
            others.remove(value)
        return any(graph.nodes[o]["requires_grad"] for o in others)
    return c.get("short") in _SAVES_INPUTS


# Ops whose backward needs their own output (attention also keeps its log-sum-exp).
_SAVES_OUTPUT = {"scaled_dot_product_attention", "softmax", "_softmax", "log_softmax",
                 "_log_softmax", "exp", "sigmoid", "tanh", "rsqrt", "sqrt"}
_MAYBE_ALIAS = {"to", "contiguous"}  # the input itself unless ``copy``


def _is_alias(d: dict) -> bool:
    """Whether node ``d``'s output is its input's memory (a view, a same-dtype ``to``)."""
    return d.get("short") in _VIEW_OPS or (d.get("short") in _MAYBE_ALIAS and not d["copy"])


def _mark_saved(graph: nx.DiGraph) -> None:
    """``saved``: some backward needs this value, directly or through aliases of it."""
    for n in reversed(list(nx.topological_sort(graph))):
        d = graph.nodes[n]
        d["saved"] = (d.get("short") in _SAVES_OUTPUT and d["requires_grad"]) or any(
            _keeps(graph, c, n) or (_is_alias(graph.nodes[c]) and graph.nodes[c]["saved"])
            for c in graph.successors(n))


def _mark_rerun(graph: nx.DiGraph) -> None:
    """``rerun``: a checkpointed layer's recomputation produces this value again.  torch's
    non-reentrant checkpoint stops once it has rebuilt every tensor the layer's backward
    needs, so that is a value an op of the same layer needs for its backward (its own
    output, for attention or softmax), or one feeding an op that reruns (a layer's last
    ops, whose outputs only the next layer reads, do not; nor do their input
    redistributions)."""
    for n in reversed(list(nx.topological_sort(graph))):
        d = graph.nodes[n]
        layer = d.get("layer")
        d["rerun"] = layer is not None and (
            (d.get("short") in _SAVES_OUTPUT and d["requires_grad"]) or any(
                graph.nodes[c].get("layer") == layer and (_keeps(graph, c, n) or graph.nodes[c]["rerun"])
                for c in graph.successors(n)))


def _input_embedding(model: nn.Module) -> str | None:
    """FQN of the weight of the embedding that reads ``input_ids`` (Hugging Face's
    ``get_input_embeddings``), if the model says."""
    get = getattr(model, "get_input_embeddings", None)
    weight = getattr(get() if callable(get) else None, "weight", None)
    return next((n for n, p in model.named_parameters() if p is weight), None)


def _aliases(model: nn.Module) -> dict[str, str]:
    first: dict[int, str] = {}
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out[name] = first.setdefault(id(p), name)
    return out


def _layer_kinds(model: nn.Module) -> list[tuple]:
    """Each repeated layer of ``model``, in order, as its parameters' relative names and
    shapes: the layers of one kind are the same subgraph.  DeepSeek-V3's first
    ``first_k_dense_replace`` layers (3 by default) are dense and the rest MoE, so two
    traced layers, both dense, stood for every layer and lost the experts from the graph
    (Qwen2-MoE's ``mlp_only_layers`` likewise).  Empty unless the layers have one prefix."""
    layers: dict[tuple[str, int], list[tuple[str, tuple[int, ...]]]] = defaultdict(list)
    for name, p in model.named_parameters():
        if m := _LAYER_RE.match(name):
            layers[m["prefix"], int(m["idx"])].append((name[m.end():], tuple(p.shape)))
    if len({prefix for prefix, _ in layers}) != 1:
        return []
    return [tuple(params) for _, params in sorted(layers.items())]


def _traced_prefix(kinds: list[tuple]) -> int:
    """How many leading layers to export: enough to hold ``TRACED_LAYERS`` of each kind
    (every layer of a kind with fewer), so each kind's traced layers can be checked equal
    and stand for the rest of that kind."""
    want = Counter({k: min(c, TRACED_LAYERS) for k, c in Counter(kinds).items()})
    seen: Counter = Counter()
    for i, k in enumerate(kinds):
        seen[k] += 1
        if seen >= want:
            return max(i + 1, min(len(kinds), TRACED_LAYERS))
    return len(kinds)


def _stand_ins(kinds: list[tuple], traced: int) -> list[int]:
    """The traced layer each real layer is priced as: itself among the first ``traced``,
    else the first traced layer of its kind."""
    first = {}
    for i, k in enumerate(kinds[:traced]):
        first.setdefault(k, i)
    return [i if i < traced else first[k] for i, k in enumerate(kinds)]


def _layer_weights(kinds: list[tuple], traced: int) -> list[int]:
    """How many real layers each of the first ``traced`` stands for: its kind's real
    count split evenly among the traced layers of that kind."""
    real, ours = Counter(kinds), Counter(kinds[:traced])
    weights, nth = [], Counter()
    for k in kinds[:traced]:
        weights.append(real[k] // ours[k] + (nth[k] < real[k] % ours[k]))
        nth[k] += 1
    return weights


def layer_signature(graph: nx.DiGraph, layer: int, prefix: str) -> tuple:
    """Ops, shapes and relative module paths of one layer, in graph order."""
    base = f"{prefix}.{layer}"
    return tuple(
        (d["op"], d["shape"], tuple(d["in_shapes"]), d["module"][len(base):])
        for _, d in graph.nodes(data=True)
        if d["kind"] == "call_function" and d["layer"] == layer
    )


def trace(model: str | Mapping[str, Any] | PretrainedConfig | nn.Module, batch_size: int = 1,
          seq_len: int | None = None, dtype: torch.dtype = torch.float32,
          fused_kernels: bool = False) -> nx.DiGraph:
    """Trace ``model`` (preset, config.json path, HF config dict/object, or nn.Module),
    built in ``dtype`` (a module as it is): the training dtype, so the graph shows which
    ops run in fp32 anyway (Hugging Face's norms and loss upcast).  ``seq_len``
    defaults as everywhere (``presets.default_seq_len``).  ``fused_kernels``: the
    chunked delta rule as the one kernel a GPU runs (``_fused_delta_rule``), not the
    PyTorch fallback a CPU runs."""
    with _executor_rng_suspended():
        return _trace(model, batch_size, default_seq_len(model) if seq_len is None else seq_len, dtype,
                      fused_kernels)


def _executor_rng_suspended() -> AbstractContextManager:
    """A training script that seeded meshplan's executor.rng has it intercept every random
    op of its thread: building and exporting a model here would draw from that stream
    (shifting the training run's dropout masks against the 1-device run) and export
    through its mode (torch.export then fails on a data-dependent value).  The planner
    does not import the executor; where the script has, it is suspended here."""
    rng = sys.modules.get("executor.rng")
    return rng.suspended() if rng is not None and rng.is_active() else nullcontext()


def _trace(model: str | Mapping[str, Any] | PretrainedConfig | nn.Module, batch_size: int,
           seq_len: int, dtype: torch.dtype, fused: bool) -> nx.DiGraph:
    if batch_size <= 0:
        raise ConfigError(f"batch_size: must be positive, got {batch_size}")
    if seq_len <= 0:
        raise ConfigError(f"seq_len: must be positive, got {seq_len}")
    name = model_name(model)
    if isinstance(model, nn.Module):
        full, exported, layers, kinds, known = model, model, None, [], False
    else:
        config = load_config(model)
        max_pos = max_positions(config)
        if max_pos and seq_len > max_pos:  # (MPT's alibi table: a broadcast error in torch.export)
            raise ConfigError(f"seq_len: {seq_len} exceeds the model's {max_pos} positions")
        layers = _num_layers(config)
        full = build_model(config, "meta", dtype)
        kinds = _layer_kinds(full)
        known = len(kinds) == layers
        kinds = kinds if known else [()] * layers  # not told apart: taken as one kind
        exported = build_model(_truncated(config, _traced_prefix(kinds)), "meta", dtype)
    causal_lm = getattr(getattr(exported, "config", None), "is_decoder", False) or hasattr(
        exported, "generate")
    graph = build_graph(_export(exported, batch_size, seq_len, fused), causal_lm, _aliases(exported))
    prefixes = {_layer_of(d["module"])[0] for _, d in graph.nodes(data=True)
                if d["kind"] == "call_function" and _layer_of(d["module"])}
    prefix = prefixes.pop() if len(prefixes) == 1 else None
    traced = _traced_layers(graph)
    weights, stand_ins = [1] * traced, list(range(traced))
    whole = False
    if prefix and layers and layers > traced and traced >= 2:
        # each kind's traced layers must be one subgraph, and the truncated model's layers
        # the real model's first ones (a config could build its layers by the model's depth)
        same = all(len({layer_signature(graph, i, prefix) for i in range(traced) if kinds[i] == k}) == 1
                   for k in set(kinds[:traced]))
        if same and (not known or _layer_kinds(exported) == kinds[:traced]):
            weights, stand_ins = _layer_weights(kinds, traced), _stand_ins(kinds, traced)
        else:  # layers differ: export them all
            whole = True
    elif exported is not full and layers and traced < layers:
        # the truncated model's layers were not found in its graph (a layer list by another
        # name): it stands for nothing, so the whole model is exported (MPT's ``blocks``
        # were priced as 2 of 4 layers before ``_LAYER_RE`` knew them)
        whole = True
    if whole:
        graph = build_graph(_export(full, batch_size, seq_len, fused), causal_lm, _aliases(full))
        traced = _traced_layers(graph)
        weights, stand_ins = [1] * traced, list(range(traced))
    if causal_lm and not isinstance(model, nn.Module):
        _price_sliding_windows(graph, config, seq_len, layers, traced, kinds)
    graph.graph.update(
        model=name, layers=layers or traced, traced_layers=traced, layer_weights=weights, stand_ins=stand_ins,
        layer_prefix=prefix,
        batch_size=batch_size, seq_len=seq_len,
        param_shapes={n: tuple(p.shape) for n, p in full.named_parameters()},
        input_embedding=_input_embedding(full),
        dtype=str(next(full.parameters()).dtype), itemsize=next(full.parameters()).element_size(),
    )
    _mark_checkpoint_inputs(graph)
    return graph


# Model types whose layers each take the mask their ``layer_types`` entry names
# (``causal_mask_mapping[config.layer_types[i]]`` in their modelling code).
_MASK_PER_LAYER_TYPE = ("qwen2", "qwen3", "gemma3_text", "qwen2_moe", "exaone4", "smollm3", "ministral", "olmo3",
                        "cohere2", "gemma4_text", "cwm", "dots1", "exaone_moe", "cohere2_moe", "afmoe", "laguna",
                        "mellum")


def _price_sliding_windows(graph: nx.DiGraph, config: PretrainedConfig, seq_len: int, layers: int,
                           traced: int, kinds: list[tuple]) -> None:
    """A sliding-window layer's attention at a sequence as long as its window costs all of
    a full attention's FLOPs, not the causal half ``_matmul_flops`` prices: Hugging Face
    then passes SDPA the window's mask (``_ignore_causal_mask_sdpa``), and the kernels that
    take a mask compute every block; none skips the blocks outside the window.  Which
    layers slide: per ``layer_types`` for the models that pick each layer's mask by it
    (Gemma 3's five local to one global, Qwen2/3's from ``max_window_layers``; Qwen2-MoE,
    EXAONE 4, SmolLM3, Ministral), else every layer once ``sliding_window`` is set
    (Mistral, Mixtral, Phi-3, Starcoder2, Qwen3-MoE build one mask for all).  Gemma 2 picks
    masks by ``layer_types`` too, but runs eager attention, traced as matmuls that compute
    every score: no SDPA node here to price.
    A traced layer standing for several real ones takes the average over its kind's
    (``kinds``: one per real layer, all alike where ``_layer_kinds`` cannot tell them apart)."""
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or seq_len < window:
        return
    types = getattr(config, "layer_types", None) if config.model_type in _MASK_PER_LAYER_TYPE else None
    sliding = [t == "sliding_attention" for t in (types or ["sliding_attention"] * layers)[:layers]]
    share_of = {k: mean(s for s, k_ in zip(sliding, kinds, strict=False) if k_ == k) for k in set(kinds)}
    for _, d in graph.nodes(data=True):
        if d.get("short") != "scaled_dot_product_attention" or d["layer"] is None:
            continue
        share = sliding[d["layer"]] if traced == layers else share_of[kinds[d["layer"]]]
        for key in ("fwd_flops", "bwd_flops", "fwd_trans", "bwd_trans"):
            d[key] *= 1.0 + share


def _mark_checkpoint_inputs(graph: nx.DiGraph) -> None:
    """``ckpt_numel``: what a checkpointed layer keeps, its inputs.  One every traced layer
    reads from outside the layers (rotary cos / sin, the attention mask) is one tensor
    all checkpoints share: recorded on its producer, once, unless backward keeps it
    anyway (``saved``).  Any other (the residual stream: the embedding output for the
    first traced layer, the previous layer's output for the others) is recorded on the
    layer's first consumer of it that makes a tensor (not a metadata check), so it counts
    once per real layer that traced layer stands for."""
    layers = {d["layer"] for _, d in graph.nodes(data=True) if d.get("layer") is not None}
    readers: dict[str, set[int]] = defaultdict(set)
    for u, v in graph.edges:
        if graph.nodes[u].get("layer") is None and graph.nodes[v].get("layer") is not None:
            readers[u].add(graph.nodes[v]["layer"])
    seen: set[tuple[str, int]] = set()
    for u, v in graph.edges:
        lv = graph.nodes[v].get("layer")
        du = graph.nodes[u]
        if (lv is None or du.get("layer") == lv or du["kind"] != "call_function" or (u, lv) in seen
                or not graph.nodes[v]["out_numel"]):
            continue
        seen.add((u, lv))
        if du.get("layer") is None and readers[u] == layers:
            if not du.get("saved"):
                du["ckpt_numel"] = du["out_numel"]
            continue
        graph.nodes[v]["ckpt_numel"] = graph.nodes[v].get("ckpt_numel", 0) + du["out_numel"]


def _traced_layers(graph: nx.DiGraph) -> int:
    return len({d["layer"] for _, d in graph.nodes(data=True) if d["layer"] is not None})


def layer_weight(graph: nx.DiGraph, node: str) -> int:
    """How many real nodes a traced node stands for (repeated layers count many)."""
    layer = graph.nodes[node].get("layer")
    return 1 if layer is None else graph.graph["layer_weights"][layer]


def totals(graph: nx.DiGraph) -> dict[str, float]:
    """Whole-model figures (repeated layers counted as often as the model has them)."""
    fwd = bwd = nbytes = 0.0
    nodes = 0
    for n, d in graph.nodes(data=True):
        if d["kind"] != "call_function":
            continue
        w = layer_weight(graph, n)
        fwd += w * d["fwd_flops"]
        bwd += w * d["bwd_flops"]
        nbytes += w * d["bytes"]
        nodes += w
    return {"fwd_flops": fwd, "bwd_flops": bwd, "train_flops": fwd + bwd, "bytes": nbytes,
            "nodes": nodes}
