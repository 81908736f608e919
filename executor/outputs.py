"""What the loop gets back: single-device outputs, each made global only when it is read.

The executor hands the loop single-device values: the global batch (an all-gather over
the data-parallel ranks, executor.data) and full tensors (``DTensor.full_tensor`` under
tensor parallelism).  Each costs a collective, and for the logits it is the largest one
of the step: about 1 GB per 4096-token sequence for a 128k vocabulary in bf16, gathered
to every data-parallel rank.  A loop that trains from ``labels=`` reads only ``.loss``.

So for a Hugging Face ``ModelOutput`` the scalar loss is made global at once and every
other tensor field the first time it is read, by attribute, key, ``get``, index,
iteration, ``values``/``items``, ``to_tuple``, repr or comparison.  A loop that never
reads the logits never gathers them; the planner's step time assumes that loop.

The read issues a collective, so every rank must read the same fields in the same order
(a loop that prints ``out.logits`` on rank 0 only would wait forever on rank 0); the
same code running on every rank, the SPMD rule, does this.  Outputs that are not a
``ModelOutput`` (a tensor, a tuple) are made global at once, as before.

Hand-written rather than reused: neither torch nor transformers has a lazily
materialised output container.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import is_dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

Resolve = Callable[[torch.Tensor], torch.Tensor]


def single_device(output: Any, resolve: Resolve) -> Any:
    """``output`` with ``resolve`` applied to every tensor: now to the scalars and to
    anything that is not a ``ModelOutput``, on first read to the other fields."""
    if not _is_model_output(output):
        return tree_map_only(torch.Tensor, resolve, output)
    pending = {}
    for name, value in dict.items(output):  # the stored values, without reading them
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            output[name] = resolve(value)
        elif _has_tensor(value):
            pending[name] = value
    if pending:
        output.__class__ = _lazy_class(type(output))
        vars(output)[_PENDING] = (pending, resolve)
    return output


_PENDING = "_meshplan_pending"
_LAZY: dict[type, type] = {}


def _is_model_output(output: Any) -> bool:
    return isinstance(output, dict) and is_dataclass(output) and hasattr(output, "to_tuple")


def _has_tensor(value: Any) -> bool:
    found: list[torch.Tensor] = []
    tree_map_only(torch.Tensor, found.append, value)
    return bool(found)


def _lazy_class(cls: type) -> type:
    if cls not in _LAZY:
        # Subclassing a ModelOutput registers it as a pytree node (transformers does it
        # in __init_subclass__), so torch's pytree utilities see its fields as before.
        _LAZY[cls] = type(cls.__name__, (_Lazy, cls), {"__module__": cls.__module__,
                                                        "__qualname__": cls.__qualname__})
    return _LAZY[cls]


class _Lazy:
    """Mixin over a ModelOutput class: every read path resolves the fields it returns.

    ``dict`` internals (``dict(out)``, ``{**out}``) would bypass ``__getitem__``; they
    take the slow, overridable path because ``__iter__`` is overridden."""

    def _resolve(self, name: str | None = None) -> None:
        state = object.__getattribute__(self, "__dict__").get(_PENDING)
        if state is None:
            return
        pending, resolve = state
        for key in [name] if name is not None else list(pending):
            if key in pending:
                value = tree_map_only(torch.Tensor, resolve, pending.pop(key))
                dict.__setitem__(self, key, value)
                object.__setattr__(self, key, value)
        if not pending:
            del object.__getattribute__(self, "__dict__")[_PENDING]

    def __getattribute__(self, name: str) -> Any:
        state = object.__getattribute__(self, "__dict__").get(_PENDING)
        if state is not None and name in state[0]:
            _Lazy._resolve(self, name)
        return super().__getattribute__(name)

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):  # HF's Trainer reads outputs["loss"]
            self._resolve(key)
            # ModelOutput looks a name up in dict(self.items()), which would resolve every field
            return dict.__getitem__(self, key)
        self._resolve()
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        self._resolve(key)
        return super().get(key, default)

    def __iter__(self) -> Any:
        self._resolve()
        return super().__iter__()

    def values(self) -> Any:
        self._resolve()
        return super().values()

    def items(self) -> Any:
        self._resolve()
        return super().items()

    def __repr__(self) -> str:
        self._resolve()
        return super().__repr__()

    def __eq__(self, other: object) -> bool:
        self._resolve()
        return super().__eq__(other)

    __hash__ = None  # as the dataclass it extends

    def __reduce__(self) -> Any:
        self._resolve()
        return super().__reduce__()
