"""The loss on vocabulary-sharded logits, without gathering them (loss parallelism).

A column-parallel output projection leaves each model-parallel rank a shard of the
vocabulary.  Gathering the logits for the loss moves ``tokens x vocabulary`` values per
rank and step (Llama 3's 128k vocabulary: 0.5 GB per 1k tokens in fp32) and runs the
log-softmax on every rank over the whole vocabulary.  Megatron's vocab-parallel
cross-entropy needs only three numbers per token from the other shards: the max logit,
the sum of exps and the target's logit.  :class:`_VocabParallelCrossEntropy` does that on
the local shards with two all-reduces of ``tokens`` values in forward and none in
backward (each rank differentiates its own shard: ``softmax - onehot``).

Hugging Face models compute their loss inside ``forward(labels=)`` through
``model.loss_function`` (a documented, settable attribute).  :func:`install` wraps it:
inside, ``F.cross_entropy`` on a DTensor whose class dim is sharded goes to the
vocab-parallel path, and any other DTensor input is first gathered over its class dim
(at the loss's boundary, so that backward slices the gradient before the output
projection computes its weight gradient on the shard).  Models without a
``loss_function`` leave their loss to DTensor.

Hand-written because torch's ``loss_parallel()`` needs the backward to run inside its
context manager, which a training loop the executor does not own would have to enter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.overrides import TorchFunctionMode

_CLASS_DIM = 1  # F.cross_entropy's input is (N, C) or (N, C, d1, ...)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of local logits ``[N, V/k]`` holding classes
    ``[start, start + V/k)`` of ``group``'s ``k`` ranks, for global targets ``[N]``;
    0 where the target is ``ignore_index``."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, start: int,
                ignore_index: int, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.dtype = logits.dtype
        x = logits.detach().float()  # half-precision logits: sums in fp32, as torch's kernels
        peak = x.amax(dim=1)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        shifted = x - peak[:, None]
        local = target - start
        inside = (local >= 0) & (local < logits.shape[1])
        index = torch.where(inside, local, 0)
        picked = torch.where(inside, shifted.gather(1, index[:, None]).squeeze(1), 0.0)
        sums = torch.stack([shifted.exp().sum(dim=1), picked])  # one all-reduce for both
        dist.all_reduce(sums, group=group)
        log_sum = sums[0].log()
        valid = target != ignore_index
        ctx.save_for_backward(shifted, log_sum, index, inside & valid, valid)
        return torch.where(valid, log_sum - sums[1], 0.0).to(ctx.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        shifted, log_sum, index, hit, valid = ctx.saved_tensors
        out = (shifted - log_sum[:, None]).exp_()  # this shard's softmax
        rows = torch.arange(out.shape[0], device=out.device)
        out[rows, index] -= hit.to(out.dtype)
        out.mul_(torch.where(valid, grad.float(), 0.0)[:, None])
        return out.to(ctx.dtype), None, None, None, None


def _class_mesh_dim(input: DTensor) -> int | None:
    """The one mesh dim that shards the class dim, when every other mesh dim is
    Replicate or shards the batch (dim 0) and no rank's shard is empty; None otherwise."""
    placements = input.placements
    dims = [i for i, p in enumerate(placements) if isinstance(p, Shard) and p.dim == _CLASS_DIM]
    others = [p for i, p in enumerate(placements) if i not in dims]
    if len(dims) != 1 or not all(isinstance(p, Replicate) or p == Shard(0) for p in others):
        return None
    classes, ranks = input.shape[_CLASS_DIM], input.device_mesh.size(dims[0])
    if -(-classes // ranks) * (ranks - 1) >= classes:  # torch.chunk leaves the last rank none
        return None
    return dims[0]


def _cross_entropy(input: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                   size_average: Any = None, ignore_index: int = -100, reduce: Any = None,
                   reduction: str = "mean", label_smoothing: float = 0.0) -> torch.Tensor:
    """``F.cross_entropy`` for a DTensor ``input``: vocab-parallel where it can be, else
    on logits gathered over the class dim."""
    simple = (weight is None and size_average is None and reduce is None and label_smoothing == 0.0
              and input.ndim == 2 and target.ndim == 1 and reduction in ("mean", "sum", "none"))
    mesh_dim = _class_mesh_dim(input) if simple else None
    token_placements = [Replicate() if i == mesh_dim else p for i, p in enumerate(input.placements)]
    if mesh_dim is not None and (list(target.placements) != token_placements
                                 if isinstance(target, DTensor)
                                 else any(not isinstance(p, Replicate) for p in token_placements)):
        mesh_dim = None  # a target sharded otherwise, or plain where the tokens are sharded
    if mesh_dim is None:
        # a mean over token shards is DTensor's mean of the shards' means, not the mean over
        # the tokens ignore_index leaves (logits split by sequence, from a replicated head
        # under sequence parallelism, flatten to a _StridedShard): for "mean" the tokens
        # are gathered too
        whole = [Replicate() if reduction == "mean" or (isinstance(p, Shard) and p.dim == _CLASS_DIM) else p
                 for p in input.placements]
        if reduction == "mean" and isinstance(target, DTensor):
            target = target.redistribute(target.device_mesh, [Replicate()] * target.device_mesh.ndim)
        return F.cross_entropy(input.redistribute(input.device_mesh, whole), target, weight,
                               size_average, ignore_index, reduce, reduction, label_smoothing)
    mesh = input.device_mesh
    local_target = target.to_local() if isinstance(target, DTensor) else target
    shard = input.to_local()
    start = mesh.get_local_rank(mesh_dim) * -(-input.shape[_CLASS_DIM] // mesh.size(mesh_dim))
    losses = _VocabParallelCrossEntropy.apply(shard, local_target, start, ignore_index,
                                              mesh.get_group(mesh_dim))
    per_token = DTensor.from_local(losses, mesh, token_placements, run_check=False)
    if reduction == "none":
        return per_token
    if reduction == "sum":
        return per_token.sum()
    valid = DTensor.from_local(local_target != ignore_index, mesh, token_placements, run_check=False)
    return per_token.sum() / valid.sum()


class _LossMode(TorchFunctionMode):
    """Reroutes ``F.cross_entropy`` on DTensor logits; everything else passes through."""

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.cross_entropy and args and isinstance(args[0], DTensor):
            return _cross_entropy(*args, **kwargs)
        return func(*args, **kwargs)


def vocab_parallel(loss_function: Callable[..., Any]) -> Callable[..., Any]:
    """``loss_function`` with its cross-entropy on vocabulary shards (see the module)."""

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with _LossMode():
            return loss_function(*args, **kwargs)

    return wrapped


def install(model: nn.Module) -> None:
    """Wrap ``model.loss_function`` (Hugging Face's), if it has one."""
    original = getattr(model, "loss_function", None)
    if callable(original):
        model.loss_function = vocab_parallel(original)
