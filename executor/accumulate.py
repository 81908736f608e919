"""A training step inside the model's call: the plan's micro-batches, gradients held apart.

A plan's ``microbatches`` split each data-parallel rank's batch into parts that run one
after the other, their gradients accumulated (the planner raises the count until the
activations of one part fit).  The loop stays the one-device loop
(``loss = model(input_ids=..., labels=...).loss; loss.backward(); opt.step()``), so the
model's call runs the parts: under pipeline stages the schedule does (executor.pipeline),
without them :func:`accumulate` makes a training call with ``labels=`` run forward and
backward of each part in turn and return the step's loss.

Either way the step's backward has run when the loop's ``loss.backward()`` comes, and that
backward only adds: :class:`StepGradients` holds the step's gradients apart from ``.grad``
until then and adds them times the gradient the loss receives, so gradient accumulation
written as on one device, ``(loss / k).backward()`` over ``k`` calls, gives one device's
gradients.

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

import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers.modeling_outputs import CausalLMOutputWithPast

from executor import rng
from executor.data import (
    BatchError,
    DataParallelBatch,
    SameBatch,
    batch_rows_of,
    counted_tokens,
    narrow_rows,
)


class StepGradients:
    """The gradients of a step run inside the model's call, held apart from ``.grad``
    until the step's ``loss.backward()`` adds them, scaled by the gradient it receives
    (:class:`StepLoss`): as on one device, a call whose loss is never backpropagated
    leaves no gradient, and other terms of the loop's loss (a penalty on the weights)
    add their own gradients unscaled by the step's."""

    def __init__(self, params: Sequence[torch.Tensor], error: type[Exception]) -> None:
        self.params, self.error = list(params), error
        self.earlier: list[torch.Tensor | None] = []  # .grad before the running step
        self.this: list[torch.Tensor | None] | None = None  # the latest step's, until its backward
        self.steps = 0

    def begin(self) -> list[torch.Tensor | None] | None:
        """Before a step computes its gradients: ``.grad`` is set aside (put back by
        ``end`` or ``abort``).  Returns the latest step's held gradients, for ``abort``."""
        self.earlier = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        return self.this

    def abort(self, pending: list[torch.Tensor | None] | None) -> None:
        """A step that failed: ``.grad`` is what it was before it (its own gradients are
        dropped), and the step before it (``pending``) can still be added by its loss."""
        for p, held in zip(self.params, self.earlier, strict=True):
            p.grad = held
        self.earlier, self.this = [], pending

    def end(self, value: torch.Tensor) -> torch.Tensor:
        """The step's backward is done: its gradients are held, ``.grad`` is put back
        (the same tensors: a loop that zeroes them in place keeps them), and the step's
        loss for the loop is returned (``value``, whose backward adds them)."""
        self.this = [p.grad for p in self.params]
        for p, held in zip(self.params, self.earlier, strict=True):
            p.grad = held
        self.earlier = []
        self.steps += 1
        return StepLoss.apply(value.detach().requires_grad_(), self, self.steps)

    def add(self, scale: torch.Tensor, step: int) -> None:
        """Step ``step``'s loss.backward() with gradient ``scale`` (1 for ``loss.backward()``,
        1/k for ``(loss / k).backward()``): ``.grad`` += scale x the step's gradients."""
        if step != self.steps or self.this is None:
            raise self.error("loss.backward(): the model's forward already ran this step's backward (a pipeline "
                             "plan, or the plan's micro-batches); only the latest step's loss can add its "
                             "gradients, once")
        unscaled = bool(scale == 1)
        with torch.no_grad():
            for p, this in zip(self.params, self.this, strict=True):
                if this is None:  # no gradient this step
                    continue
                if not unscaled:
                    _local(this).mul_(scale)
                if p.grad is None:
                    p.grad = this
                else:
                    _local(p.grad).add_(_local(this))
        self.this = None


class StepLoss(torch.autograd.Function):
    """The step's loss as the loop sees it: its backward differentiates nothing (the step's
    backward has run) but adds the step's gradients scaled by the gradient it receives, 1
    for ``loss.backward()``, 1/k for ``(loss / k).backward()``."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, grads: StepGradients, step: int) -> torch.Tensor:
        ctx.grads, ctx.step = grads, step
        return value.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        ctx.grads.add(grad, ctx.step)
        return None, None, None


def _local(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding this rank's values, to update in place under ``no_grad`` (a
    DTensor's local shard itself there: scaling it scales the DTensor whatever its
    placements)."""
    return t.to_local() if isinstance(t, DTensor) else t


def accumulate(model: nn.Module, microbatches: int, batch: DataParallelBatch | None,
               same_batch: SameBatch | None = None) -> None:
    """Make ``model``'s call run a training call with ``labels=`` as ``microbatches`` parts
    (the model is a Hugging Face causal LM, whose loss takes ``num_items_in_batch``).
    ``same_batch`` checks the whole batch first, before a rank can refuse it alone (the
    root hook's check would see only the first part, after every rank split its own).

    Its class becomes a subclass whose ``__call__`` does so around the unchanged call, so
    every part runs through the model's hooks (the data-parallel slice, FSDP2's gathers)
    as a whole call does.  Other calls (evaluation, ``torch.no_grad``, no labels) run the
    batch whole.  The subclass is one per model class and the state lives on the model
    (its parameters, not the model: no reference cycle), so a deep copy has its own."""
    model.__dict__[_PARTS] = _Parts(list(model.parameters()), microbatches, batch, same_batch)
    model.__class__ = _accumulating(type(model))


_PARTS = "_executor_parts"


@functools.cache
def _accumulating(base: type[nn.Module]) -> type[nn.Module]:
    def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return self.__dict__[_PARTS](self, lambda *a, **k: base.__call__(self, *a, **k), args, kwargs)

    return type(base.__name__, (base,), {"__call__": __call__, "__module__": base.__module__,
                                         "__qualname__": base.__qualname__})


class _Parts:
    def __init__(self, params: list[torch.Tensor], microbatches: int, batch: DataParallelBatch | None,
                 same_batch: SameBatch | None) -> None:
        self.microbatches, self.batch, self.same_batch = microbatches, batch, same_batch
        self.grads = StepGradients(params, RuntimeError)
        self.warned: set[str] = set()  # the reasons warned about, once each

    def __call__(self, model: nn.Module, call: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if self.same_batch is not None:
            self.same_batch(args, kwargs)
        why = self._whole(model, args, kwargs)
        if why is not None:
            if why and why not in self.warned:
                self.warned.add(why)
                warnings.warn(f"plan.microbatches: {self.microbatches} parts run inside the model's call only "
                              f"when it trains from labels= on inputs without autograd history; this call "
                              f"({why}) runs its whole batch at once, needing the activation memory of all "
                              "parts (docs/executor.md)", stacklevel=3)
            return call(*args, **kwargs)
        rows, total = self._rows(args, kwargs)
        items = kwargs.get("num_items_in_batch")
        items = counted_tokens(kwargs) if items is None else items
        state = rng.get_state() if rng.is_active() else None
        pending = self.grads.begin()
        losses = []
        try:
            # FSDP2 reduces each part's gradients in its backward (TorchTitan's choice):
            # skipping the sync would hold every unsharded gradient until the last part
            for i in range(self.microbatches):
                if state is not None:  # every part draws from the counter the step started at
                    rng.set_state(state)
                part_args, part_kwargs = narrow_rows((args, kwargs), total, i * rows, rows)
                if items is not None:
                    part_kwargs["num_items_in_batch"] = items
                with rng.batch_rows(i * rows, rows, total):
                    value = _loss(call(*part_args, **part_kwargs))  # the part's logits are let go
                value.backward()
                losses.append(value.detach())
        except BaseException:
            self.grads.abort(pending)
            if state is not None:
                rng.set_state(state)
            raise
        loss = self.grads.end(torch.stack(losses).sum())
        if kwargs.get("return_dict") is False:
            return (loss,)
        return loss_only(loss, f"this training call ran the plan's microbatches={self.microbatches} in parts "
                               "inside the model's call and kept no logits (every part's logits are what the "
                               "parts were cut to avoid holding); a call without labels=, or in eval mode or "
                               "under torch.no_grad(), runs its batch whole and returns them (docs/executor.md, "
                               "Micro-batches without a pipeline)")

    def _whole(self, model: nn.Module, args: tuple, kwargs: dict) -> str | None:
        """Why this call runs its batch whole ("" where that needs no warning), or None."""
        params = self.grads.params
        if not (model.training and torch.is_grad_enabled()) or not any(p.requires_grad for p in params):
            return ""  # nothing to backpropagate: one forward, as one device's
        if not isinstance(kwargs.get("labels"), torch.Tensor):
            return "no labels="
        if any(isinstance(t, torch.Tensor) and t.requires_grad for t in (*args, *kwargs.values())):
            return "an input that requires grad"  # each part's backward would run through the loop's graph
        return None

    def _rows(self, args: tuple, kwargs: dict) -> tuple[int, int]:
        """(rows per part, rows of the global batch)."""
        total = batch_rows_of(args, kwargs)
        ranks = self.batch.size if self.batch is not None else 1
        if total % (self.microbatches * ranks):
            raise BatchError(f"batch: the global batch {total} does not split into microbatches="
                             f"{self.microbatches} (the plan's micro-batch count) x {ranks} data-parallel ranks")
        return total // self.microbatches, total


_WHY = "_meshplan_no_logits"


class _LossOnly(CausalLMOutputWithPast):
    """A training step's output that keeps no logits (in micro-batches, or under a
    pipeline): reading ``logits`` says why.  ``None`` failed later and without a reason
    in a loop written against a plan without them (the planner picks them per device count)."""

    def __getattribute__(self, name: str) -> Any:
        if name == "logits":
            raise AttributeError(f"logits: {vars(self)[_WHY]}")
        return super().__getattribute__(name)


def loss_only(loss: torch.Tensor, why: str) -> CausalLMOutputWithPast:
    """``CausalLMOutputWithPast(loss=loss)`` whose ``logits`` raise ``AttributeError(why)``."""
    out = CausalLMOutputWithPast(loss=loss)
    out.__class__ = _LossOnly  # after construction: ModelOutput's __post_init__ reads every field
    vars(out)[_WHY] = why
    return out


def _loss(out: Any) -> torch.Tensor:
    """The loss of a Hugging Face model's output (a ``ModelOutput``, or its tuple with
    ``return_dict=False``)."""
    return out["loss"] if isinstance(out, dict) else out[0]
