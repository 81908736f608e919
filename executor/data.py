"""The global batch in, the global results out: data parallelism without touching the loop.

Every rank is handed the same global batch.  Before the model runs, each rank keeps
only its slice along dim 0 (its coordinate on the data-parallel mesh dims, row-major);
after it runs, results are made global again so the loop sees single-device values:

* a tensor whose dim 0 is the local batch is all-gathered along dim 0 (logits,
  hidden states).  Backward hands each rank its own slice of the gradient, scaled by
  the data-parallel size, because every rank computes the same global loss from the
  gathered tensor and the data-parallel gradient reduction (FSDP2) averages;
* a 0-dim floating tensor (the loss Hugging Face models compute from ``labels=``) is
  averaged over the data-parallel ranks.  Backward passes the gradient through
  unchanged: each rank's gradient is that of its local mean and the averaging
  reduction makes it the gradient of the global mean.

Randomness: on one device the mask of a batch element depends on its index in the
global batch (executor.rng draws by global element index).  While the root forward runs,
executor.rng hands dropout, attention dropout and the draws that follow a tensor's
layout (``*_like``, ``bernoulli``, in-place fills) here (``rng.redirected``), and they
draw on a DTensor view of the rank's slice, ``Shard(0)`` over the data-parallel dims, so
executor.rng draws exactly the global batch's values for this slice, without
communication.

A Hugging Face causal LM's loss is made exact even where the slices count different
numbers of tokens (padding, ``ignore_index``): each rank's loss divides its summed token
losses by the global count over the data-parallel size (``num_items_in_batch``), so the
mean over ranks is the global mean.  Other losses are a mean of per-rank means, equal
to the single-device loss when every slice counts the same.
The gather runs when the loop first reads a batch-shaped output (executor.outputs): a
loop that trains from ``labels=`` and reads only the loss never gathers the logits.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils._pytree import tree_map_only

from executor import rng


class BatchError(ValueError):
    """The batch cannot be split over the data-parallel ranks."""


class DataParallelBatch:
    """Slices inputs and globalises outputs over the data-parallel dims of a mesh."""

    def __init__(self, mesh: DeviceMesh, dims: tuple[str, ...], model_dims: tuple[str, ...],
                 counts_tokens: bool = False) -> None:
        # counts_tokens: the model is a Hugging Face causal LM whose loss takes
        # ``num_items_in_batch`` (see ``_items_per_rank``)
        self.counts_tokens = counts_tokens
        # Gathers run innermost dim first so that the result is in row-major rank
        # order, the order in which ``slice`` hands out the pieces; a dim of one rank (the
        # unit dim FSDP2's replicate mode needs) has nothing to gather or sum.
        self.groups = [mesh.get_group(d) for d in reversed(dims) if mesh.size(mesh.mesh_dim_names.index(d)) > 1]
        self._random = _SlicedRandomness(mesh[dims + model_dims], len(dims))
        self.size = 1
        self.index = 0
        for d in dims:
            self.index = self.index * mesh.size(mesh.mesh_dim_names.index(d)) + mesh.get_local_rank(d)
            self.size *= mesh.size(mesh.mesh_dim_names.index(d))
        self._local_batch: int | None = None

    def slice(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Every tensor whose dim 0 equals the first tensor input's dim 0 is sliced."""
        batch = batch_rows_of(args, kwargs)
        if batch % self.size:
            raise BatchError(
                f"batch: the global batch {batch} is not divisible by the data-parallel size {self.size}"
            )
        n = batch // self.size
        self._local_batch = self._random.rows = n
        if self.counts_tokens:
            kwargs = self._items_per_rank(kwargs)
        return narrow_rows((args, kwargs), batch, self.index * n, n)

    def _items_per_rank(self, kwargs: dict) -> dict:
        """``num_items_in_batch`` for a Hugging Face causal LM's loss, so that the mean of
        the ranks' losses is the global batch's: each rank's loss is its summed token
        losses over this number, the global count of counted tokens (the loop's own
        ``num_items_in_batch`` if it passes one) over the data-parallel size.  Without
        it each rank divides by its own count, and the mean of those means is the
        global mean only when every slice counts as many tokens (padding or
        ``ignore_index`` spread unevenly over the slices makes them differ)."""
        given = kwargs.get("num_items_in_batch")
        if given is None:
            given = counted_tokens(kwargs)
        return kwargs if given is None else {**kwargs, "num_items_in_batch": given / self.size}

    def randomness(self) -> AbstractContextManager:
        """Active around the forward (and any recomputation of it): slice-aware dropout."""
        return rng.redirected(self._random)

    def globalise(self, t: torch.Tensor) -> torch.Tensor:
        """One output tensor as on one device (executor.outputs decides when)."""
        if t.dim() == 0 and t.is_floating_point():
            return _MeanOverRanks.apply(t, self.groups, self.size)
        if t.dim() > 0 and t.shape[0] == self._local_batch:
            return _GatherBatch.apply(t, self.groups, self.size, self.index)
        return t


def comm_device(device_type: str) -> torch.device:
    """The device a mesh of ``device_type`` communicates from (this process's CUDA device)."""
    return torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device(device_type)


class SameBatch:
    """On the model's first call: that every rank of the mesh was given the same batch.

    apply's contract is that every rank passes the global batch and the executor takes
    each rank's slice.  A loop written for DDP passes each rank its own (a
    ``DistributedSampler``, a loader shuffled per rank): that trained on the wrong rows
    without a word (each rank slicing its own batch again, tensor-parallel ranks
    computing on different inputs), and under a pipeline whose ranks' shapes differed it
    ended in gloo's abort.  The check compares a fingerprint of the call's tensors (how
    many, their shapes, and the integer ones' values, plain and position-weighted;
    floating ones by shape only) as its maximum and minimum over the ranks, reduced
    along each mesh dim in turn, so every rank reaches the same verdict.  Once: checking
    every step would stall each step on the host."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self._groups = [mesh.get_group(d) for d in range(mesh.ndim) if mesh.size(d) > 1]
        self._device = comm_device(mesh.device_type)
        self._checked = not self._groups

    def __call__(self, args: tuple, kwargs: dict) -> None:
        if self._checked:
            return
        self._checked = True
        mine = _fingerprint(_tensors((args, kwargs)), self._device)
        both = torch.cat([mine, ~mine])  # max(~x) = ~min(x), with no overflow as -x has
        for group in self._groups:
            dist.all_reduce(both, dist.ReduceOp.MAX, group=group)
        high, low = both[:len(mine)], ~both[len(mine):]
        if not torch.equal(high, low):
            what = "shapes" if not torch.equal(high[:_SHAPE_FIELDS], low[:_SHAPE_FIELDS]) else "values"
            raise BatchError(
                f"batch: the ranks were given batches of different {what}; every rank passes the same "
                "global batch and apply slices it per data-parallel rank (a DistributedSampler, or a "
                "loader shuffled per rank, gives each rank its own: drop it; docs/executor.md, Data)")


_SHAPE_FIELDS = 3  # the fingerprint's first fields: tensors, elements, shapes' hash


def _fingerprint(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """int64 [tensors, elements, shapes' hash, values' sum, position-weighted sum]."""
    count = numel = shapes = 0
    values = torch.zeros(2, dtype=torch.int64, device=device)
    for t in tensors:
        count, numel = count + 1, numel + t.numel()
        shapes = (shapes * 31 + hash(tuple(t.shape))) % 2**61  # an int tuple's hash is the same in every process
        if not (t.is_floating_point() or t.is_complex() or isinstance(t, DTensor)):
            v = t.detach().reshape(-1).to(device, torch.int64)
            weights = torch.arange(v.numel(), device=device) % 1021 + 1
            values += torch.stack([v.sum(), (v * weights).sum()])
    return torch.cat([torch.tensor([count, numel, shapes], dtype=torch.int64, device=device), values])


def batch_rows_of(args: tuple, kwargs: dict) -> int:
    """The batch's rows: dim 0 of the model's first tensor input."""
    first = next((t for t in _tensors((args, kwargs))), None)
    if first is None or first.dim() == 0:
        raise BatchError("batch: the model's first tensor input must have a batch dim 0")
    return first.shape[0]


def narrow_rows(tree: Any, batch: int, start: int, count: int) -> Any:
    """``tree`` with every tensor whose dim 0 is the ``batch`` rows cut to rows
    ``[start, start + count)``; other tensors (masks broadcast over the batch) as they are."""
    return tree_map_only(
        torch.Tensor, lambda t: t.narrow(0, start, count) if t.dim() > 0 and t.shape[0] == batch else t, tree)


def counted_tokens(kwargs: dict) -> torch.Tensor | None:
    """How many tokens a Hugging Face causal LM's loss counts for the ``labels=`` (or
    ``shift_labels=``) among ``kwargs``: those not ``ignore_index``, after its shift (the
    last label predicts nothing).  A tensor: no host-device sync at the start of every
    step.  None without labels."""
    labels = kwargs.get("shift_labels")
    if labels is None and isinstance(kwargs.get("labels"), torch.Tensor):
        labels = kwargs["labels"][..., 1:]
    if not isinstance(labels, torch.Tensor):
        return None
    return (labels != kwargs.get("ignore_index", -100)).sum()


def _tensors(tree: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    tree_map_only(torch.Tensor, found.append, tree)
    return found


class _MeanOverRanks(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, groups: list, size: int) -> torch.Tensor:
        out = t.detach().clone()
        for g in groups:
            dist.all_reduce(out, group=g)  # SUM: gloo has no AVG
        return out / size

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        return grad, None, None


class _GatherBatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, groups: list, size: int, index: int) -> torch.Tensor:
        ctx.size, ctx.index, ctx.n = size, index, t.shape[0]
        out = t.detach().contiguous()
        for g in groups:  # into one buffer: a list of parts would need a copy into one more
            full = out.new_empty((dist.get_world_size(g) * out.shape[0], *out.shape[1:]))
            dist.all_gather_into_tensor(full, out, group=g)
            out = full
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple:
        local = grad.narrow(0, ctx.index * ctx.n, ctx.n) * ctx.size
        return local, None, None, None


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class _SlicedRandomness:
    """Random draws on a batch slice, drawn as the slice of the global batch's values.

    executor.rng hands it the dropout, attention and input-following calls it intercepts
    (rng.redirected), and it calls rng's public ``dropout``/``sdpa``/``draw`` on a view
    whose dim 0 is the global batch (``Shard(0)`` on each data-parallel dim, then the
    tensor's own model-mesh placements): the view shares the slice's storage, so no rank
    gathers anything.  For the input-following draws, a dim 0 of ``k`` times the rank's
    rows is taken as the rows folded with the dims after them, batch outermost (an MoE
    router's ``[batch * seq, experts]`` scores, on which PhiMoE makes its Gumbel draws):
    ``Shard(0)`` of that global tensor is this slice.  Other tensors draw as on one device.
    (It used to be a torch-function mode of its own above rng's, which made every op of
    the forward pass through one more Python frame.)"""

    def __init__(self, mesh: DeviceMesh, data_dims: int) -> None:
        self.mesh, self.data_dims = mesh, data_dims
        self.rows = 1  # the rank's batch rows, set by each slice
        self._ranks = mesh.mesh.shape[:data_dims].numel()  # data-parallel ranks

    def __call__(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if func in rng.FOLLOW_INPUT:  # *_like, bernoulli, in-place fills
            return self._follow_input(func, args, kwargs)
        if func is F.dropout or func is torch.dropout:
            a = _bind_dropout(func, args, kwargs)
            if not a["training"] or a["p"] == 0.0:
                return func(*args, **kwargs)
            out = self._back(rng.dropout(self._global(a["input"]), a["p"], True), a["input"])
            return a["input"].copy_(out) if a["inplace"] else out
        a = {**dict(zip(_SDPA_ARGS, args, strict=False)), **kwargs}  # attention
        if not a.get("dropout_p"):
            return rng.sdpa(**a)  # on the rank's batch slice (no mask to draw); q, k, v aligned
        q = a["query"]
        batched = {k: self._global(v) if _has_batch(v, q) else v for k, v in a.items()}
        return self._back(rng.sdpa(**batched), q)

    def _follow_input(self, func: Any, args: tuple, kwargs: dict) -> Any:
        t = args[0] if args else None
        if not (isinstance(t, torch.Tensor) and t.dim() and t.shape[0] % self.rows == 0):
            return rng.draw(func, args, kwargs)  # not the batch's rows: as on one device

        def view(a: Any) -> Any:  # bernoulli_'s probabilities (by position or as p=)
            # a DTensor of the same rows is viewed as the tensor is; a plain one already lines
            # up with the rank's rows
            return self._global(a) if isinstance(a, DTensor) and _has_batch(a, t) else a

        rest = [view(a) for a in args[1:]]
        target = kwargs.get("out")  # written with the draw: out=, or the tensor an in-place fill fills
        kwargs = {k: view(v) for k, v in kwargs.items() if k != "out"}
        source = t
        if func.__name__.endswith("_"):  # drawn apart and copied in, so that autograd sees the fill
            target, source = t, torch.empty_like(t)
        drawn = self._back(rng.draw(func, (self._global(source), *rest), kwargs), source)
        return drawn if target is None else target.copy_(drawn)

    def _global(self, t: torch.Tensor) -> DTensor:
        if isinstance(t, DTensor):
            local, placements = t.to_local(), list(t.placements)
        else:
            local, placements = t, [Replicate()] * (self.mesh.ndim - self.data_dims)
        return _from_local(local, self.mesh, [Shard(0)] * self.data_dims + placements,
                           torch.Size((t.shape[0] * self._ranks, *t.shape[1:])))

    def _back(self, out: DTensor, like: torch.Tensor) -> torch.Tensor:
        """``out``'s rank slice on ``like``'s mesh, with ``out``'s model-mesh placements:
        attention may return another layout than its query arrived in (rng.sdpa aligns
        q, k and v on their heads)."""
        local = out.to_local()
        if isinstance(like, DTensor):
            return _from_local(local, like.device_mesh, out.placements[self.data_dims:],
                               torch.Size((out.shape[0] // self._ranks, *out.shape[1:])))
        return local


def _from_local(local: torch.Tensor, mesh: DeviceMesh, placements: list, shape: torch.Size) -> DTensor:
    """``DTensor.from_local`` told the global shape where the shard is contiguous: inferred
    from the shard, it differs by rank for a dim split unevenly (15 over 2 ranks), and the
    draws with it (review).  A non-contiguous shard (a slice of a wider tensor) keeps
    DTensor's inference, uneven splits' shapes included: not seen in a model's activations."""
    if not local.is_contiguous():
        return DTensor.from_local(local, mesh, placements, run_check=False)
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def _has_batch(v: Any, query: torch.Tensor) -> bool:
    """Whether ``v`` carries the rank's batch rows in dim 0, as the query does.  A mask
    broadcast over the batch (dim 0 of size 1) is told apart by its size; with one row
    per rank it cannot be, and is taken as batched: a broadcast mask is then the same
    row on every rank, which as a global tensor is that row repeated, the same values.
    A mask of fewer dims than the query broadcasts over its leading dims: not batched."""
    return isinstance(v, torch.Tensor) and v.dim() == query.dim() and v.shape[0] == query.shape[0]


def _bind_dropout(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    if func is torch.dropout:  # torch.dropout(input, p, train)
        names, defaults = ("input", "p", "training"), {"inplace": False}
    else:
        names, defaults = ("input", "p", "training", "inplace"), {"p": 0.5, "training": True, "inplace": False}
    bound = {**defaults, **dict(zip(names, args, strict=False)), **kwargs}
    if "train" in bound:
        bound["training"] = bound.pop("train")
    return bound
