"""Sharding rules DTensor lacks, or gets wrong, in the torch releases meshplan runs on.

``executor.apply`` installs them once per process.  Each says what failed without it;
they go through DTensor's public ``register_sharding`` except where no public API
reaches (the topk cache key, torch 2.14's scatter_add_ strategy).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

# torch 2.11's DTensor cannot flatten dims of which a later one is sharded (a linear on a
# [batch, seq, hidden] input split by sequence flattens batch and seq): "Attempted to
# flatten multiple dimensions, with dimension 1 being sharded".  2.13 and 2.14 can (2.12
# not tried).
FLATTENS_INNER_SHARDS = tuple(int(v) for v in torch.__version__.split(".")[:2]) >= (2, 13)

CPU_SDPA = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_CPU_SDPA_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


@functools.cache
def install() -> None:
    _cpu_attention()
    _key_topk_by_k()
    _scatter_add_in_place()


def _cpu_attention() -> None:
    """DTensor has sharding rules for the CUDA attention kernels but not for the CPU one
    that ``F.scaled_dot_product_attention`` picks on CPU; attention is independent per
    batch element and per head, so batch- and head-sharding are exact.  The keyword-only
    ``attn_mask`` (a padding mask, broadcast over the dims where it has size 1) is split
    like the query where it has that dim, and whole where it broadcasts."""
    def mask(q: Any, m: Any, p: Placement) -> list:
        if m is None:
            return []
        if isinstance(p, Shard):  # the mask's dims align with the query's from the right
            d = p.dim - (len(q.shape) - len(m.shape))
            if d >= 0 and m.shape[d] == q.shape[p.dim]:
                return [Shard(d)]
        return [Replicate()]

    @register_sharding(CPU_SDPA)
    def forward(q: Any, k: Any, v: Any, *args: Any, attn_mask: Any = None, **kwargs: Any) -> list:
        return [([p, p], [p, p, p] + [None] * len(args) + mask(q, attn_mask, p))
                for p in (Replicate(), Shard(0), Shard(1))]

    @register_sharding(_CPU_SDPA_BACKWARD)
    def backward(*args: Any, attn_mask: Any = None, **kwargs: Any) -> list:
        return [([p] * 3, [p] * 6 + [None] * (len(args) - 6) + mask(args[1], attn_mask, p))
                for p in (Replicate(), Shard(0), Shard(1))]


def _key_topk_by_k() -> None:
    """DTensor caches an op's sharding by its DTensor inputs and the arguments from
    ``static_argnum`` on; torch 2.13 registers ``aten.topk`` from its ``dim`` (2), not
    ``k`` (1), which sets the output's shape.  A second MoE model with another top-k in
    the same process then got the first one's global shape for its routing indices
    ("value tensor of shape [512] cannot be broadcast to ... [256]", a sweep of olmoe
    top-4 then top-2; black-box review).  No public API sets this, hence the private
    table; where torch already keys by ``k``, nothing changes."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    for name in ("op_to_schema_info", "op_to_schema_info_for_single_dim_strategy"):  # where _dispatch looks
        table = getattr(propagator, name, {})
        info = table.get(torch.ops.aten.topk.default)
        if info is not None and info.static_argnum > 1:
            table[torch.ops.aten.topk.default] = dataclasses.replace(info, static_argnum=1)


def _scatter_add_in_place() -> None:
    """torch 2.13 has no rule for the in-place ``aten.scatter_add_`` and derives one from
    its decomposition, which may redistribute ``self``: the sum then lands in a copy while
    ``self`` takes the copy's placement over its old values.  PhiMoE's router backward
    (``grad.scatter_add_(-1, experts, src)`` on pending sums) gave a router gradient 21x
    one device's, without a word.  This rule is the out-of-place op's (all whole, or
    ``self``, ``index`` and ``src`` split alike on a dim other than ``dim``) plus pending
    sums, which the op adds linearly.  As for every rule, DTensor then keeps an in-place
    op's ``self`` placement, or refuses the op by name.

    torch 2.14 has a strategy of its own for it (split alike only), which DTensor prefers
    to a registered rule and which refuses pending sums ("in-place operations that require
    placement changes are not supported"): PhiMoE's router backward stopped there.  No
    public API removes it, hence the private tables, as for topk."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    for name in ("op_single_dim_strategy_funcs", "op_to_schema_info_for_single_dim_strategy"):
        getattr(propagator, name, {}).pop(torch.ops.aten.scatter_add_.default, None)

    @register_sharding(torch.ops.aten.scatter_add_.default)
    def rule(self: Any, dim: int, index: Any, src: Any) -> list:
        ndim = len(self.shape)
        alike = [d for d in range(ndim) if d != dim % ndim and len(index.shape) == len(src.shape) == ndim
                 and self.shape[d] == index.shape[d] == src.shape[d]]
        whole_or_split = [([p], [p, None, p, p]) for p in (Replicate(), *(Shard(d) for d in alike))]
        return [*whole_or_split, ([Partial()], [Partial(), None, Replicate(), Partial()])]
