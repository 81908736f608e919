"""A training step inside the model's call: the plan's micro-batches, gradients held apart.

A plan's ``microbatches`` split each data-parallel rank's batch into parts that run one
after the other, their gradients accumulated (the planner raises the count until the
activations of one part fit).  The loop stays the one-device loop
(``loss = model(input_ids=..., labels=...).loss; loss.backward(); opt.step()``), so the
model's call runs the parts: under pipeline stages the schedule does (executor.pipeline),
without them :func:`accumulate` makes a training call with ``labels=`` run forward and
backward of each part in turn and return the step's loss.

Either way the step's backward has run when the loop's ``loss.backward()`` comes, and that
backward only scales: :class:`StepGradients` keeps the step's gradients apart from those
earlier calls left until then, so gradient accumulation written as on one device,
``(loss / k).backward()`` over ``k`` calls, gives one device's gradients.

Each part is rows ``[i * rows, (i + 1) * rows)`` of the global batch, sliced over the
data-parallel ranks as a whole batch is (executor.data), and draws randomness inside an
``executor.rng.batch_rows`` window from the counter the step started at: the masks of
those rows of one device's whole-batch forward.  A Hugging Face causal LM's loss divides
every part's summed token losses by the global batch's token count
(``num_items_in_batch``), so the parts' losses and gradients add up to the global mean's,
however unevenly ``-100`` labels fall over them.  Hand-written: neither torch nor
transformers accumulates inside a module's call (HF's Trainer does it in its loop).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map_only
from transformers.modeling_outputs import CausalLMOutputWithPast

from executor import rng
from executor.data import BatchError, DataParallelBatch, counted_tokens


class StepGradients:
    """The gradients of a step run inside the model's call, kept apart from those that
    earlier calls left until the step's ``loss.backward()`` says by how much to scale
    them (:class:`StepLoss`)."""

    def __init__(self, params: Sequence[torch.Tensor], error: type[Exception]) -> None:
        self.params, self.error = list(params), error
        self.earlier: list[torch.Tensor | None] = []  # held before this step
        self.this: list[torch.Tensor | None] = []  # this step's own
        self.steps = 0

    def set_aside(self) -> tuple[list, list]:
        """The gradients earlier calls left, held apart while the step computes its own;
        returns what ``put_back`` needs if the step fails."""
        pending = (self.earlier, self.this)  # the latest step's, until its loss's backward
        self.earlier = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        return pending

    def put_back(self, pending: tuple[list, list]) -> None:
        """A step that failed: the gradients held before it are held again (its own are
        dropped), and the step before it can still be scaled by its loss's backward."""
        for p, held in zip(self.params, self.earlier, strict=True):
            p.grad = held
        self.earlier, self.this = pending

    def combine(self, value: torch.Tensor) -> torch.Tensor:
        """The step is done: the held gradients become earlier + this step's (scale 1 until
        ``rescale``), added into the earlier tensor, so a loop that zeroes gradients in
        place (``zero_grad(set_to_none=False)``) keeps the same tensors every step.
        Returns the step's loss for the loop (``value``, whose backward scales)."""
        self.this = [p.grad for p in self.params]
        with torch.no_grad():
            for p, earlier, this in zip(self.params, self.earlier, self.this, strict=True):
                if earlier is not None:
                    if this is not None:
                        _local(earlier).add_(_local(this))
                    p.grad = earlier
        self.steps += 1
        return StepLoss.apply(value.detach().requires_grad_(), self, self.steps)

    def rescale(self, scale: torch.Tensor, step: int) -> None:
        """Step ``step``'s loss.backward() with gradient ``scale`` (``(loss / k).backward()``
        in a gradient-accumulation loop): its gradients, computed for scale 1, scaled so
        that the held ones are earlier + scale * this step's, as on one device."""
        if step != self.steps or not self.this:
            raise self.error("loss.backward(): the model's forward already ran this step's backward (a pipeline "
                             "plan, or the plan's micro-batches); only the latest step's loss can scale its "
                             "gradients, once")
        unscaled = bool(scale == 1)  # loss.backward(): the held gradients are already right
        with torch.no_grad():
            for p, earlier, this in zip(self.params, self.earlier, self.this, strict=True):
                if this is None:  # no gradient this step: the held one is the earlier calls'
                    continue
                if earlier is None:  # the held gradient is this step's own
                    _local(this).mul_(scale)
                elif not unscaled:  # held = earlier + this, made earlier + scale * this
                    _local(p.grad).add_(_local(this) * (scale - 1))
        self.earlier, self.this = [], []


class StepLoss(torch.autograd.Function):
    """The step's loss as the loop sees it: its backward differentiates nothing (the step's
    backward has run) but scales the step's gradients by the gradient it receives, 1 for
    ``loss.backward()``, 1/k for ``(loss / k).backward()``."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, grads: StepGradients, step: int) -> torch.Tensor:
        ctx.grads, ctx.step = grads, step
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        ctx.grads.rescale(grad, ctx.step)
        return None, None, None


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding this rank's values, to update in place under ``no_grad`` (a
    DTensor's local shard itself there: scaling it scales the DTensor whatever its
    placements)."""
    return t.to_local() if isinstance(t, DTensor) else t


def accumulate(model: nn.Module, microbatches: int, batch: DataParallelBatch | None) -> None:
    """Make ``model``'s call run a training call with ``labels=`` as ``microbatches`` parts
    (the model is a Hugging Face causal LM, whose loss takes ``num_items_in_batch``).

    Its class becomes a subclass whose ``__call__`` does so around the unchanged call, so
    every part runs through the model's hooks (the data-parallel slice, FSDP2's gathers)
    as a whole call does.  Other calls (evaluation, ``torch.no_grad``, no labels) run the
    batch whole."""
    parts = _Parts(model, microbatches, batch)
    base = type(model)

    def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return parts(lambda *a, **k: base.__call__(self, *a, **k), args, kwargs)

    model.__class__ = type(base.__name__, (base,), {"__call__": __call__, "__module__": base.__module__})


class _Parts:
    def __init__(self, model: nn.Module, microbatches: int, batch: DataParallelBatch | None) -> None:
        self.model, self.microbatches, self.batch = model, microbatches, batch
        self.grads = StepGradients(list(model.parameters()), RuntimeError)
        self.warned = False

    def __call__(self, call: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        model = self.model
        training = model.training and torch.is_grad_enabled()
        if not (training and isinstance(kwargs.get("labels"), torch.Tensor)):
            if training and not self.warned:
                self.warned = True
                warnings.warn(f"plan.microbatches: {self.microbatches} parts run inside the model's call only "
                              "when it trains from labels=; this call (no labels=) runs its whole batch at "
                              "once, needing the activation memory of all parts (docs/executor.md)", stacklevel=3)
            return call(*args, **kwargs)
        rows, total = self._rows(args, kwargs)
        items = kwargs.get("num_items_in_batch")
        items = counted_tokens(kwargs) if items is None else items
        state = rng.get_state() if rng.is_active() else None
        pending = self.grads.set_aside()
        losses = []
        try:
            for i in range(self.microbatches):
                if state is not None:  # every part draws from the counter the step started at
                    rng.set_state(state)
                part_args, part_kwargs = tree_map_only(
                    torch.Tensor, lambda t, i=i: t.narrow(0, i * rows, rows) if t.dim() and t.shape[0] == total else t,
                    (args, kwargs))
                if items is not None:
                    part_kwargs["num_items_in_batch"] = items
                if isinstance(model, FSDPModule):  # reduce the gradients once, after the last part
                    model.set_requires_gradient_sync(i == self.microbatches - 1)
                with rng.batch_rows(i * rows, rows, total):
                    value = _loss(call(*part_args, **part_kwargs))  # the part's logits are let go
                value.backward()
                losses.append(value.detach())
        except BaseException:
            self.grads.put_back(pending)
            if state is not None:
                rng.set_state(state)
            raise
        finally:
            if isinstance(model, FSDPModule):
                model.set_requires_gradient_sync(True)
        return CausalLMOutputWithPast(loss=self.grads.combine(torch.stack(losses).sum()))

    def _rows(self, args: tuple, kwargs: dict) -> tuple[int, int]:
        """(rows per part, rows of the global batch)."""
        first = next(iter(t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.dim()), None)
        if first is None:
            raise BatchError("batch: the model's first tensor input must have a batch dim 0")
        total = first.shape[0]
        ranks = self.batch.size if self.batch is not None else 1
        if total % (self.microbatches * ranks):
            raise BatchError(f"batch: the global batch {total} does not split into microbatches="
                             f"{self.microbatches} (the plan's micro-batch count) x {ranks} data-parallel ranks")
        return total // self.microbatches, total


def _loss(out: Any) -> torch.Tensor:
    """The loss of a Hugging Face model's output (a ``ModelOutput``, or its tuple with
    ``return_dict=False``)."""
    return out["loss"] if isinstance(out, dict) else out[0]
