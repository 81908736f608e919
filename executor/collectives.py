"""Counting the collectives a stretch of code issues, DTensor's included.

``local_regions`` compares a region's local replay with its DTensor recording by the
collectives each issues where values cannot be compared (torch's ``fake`` process
group); the tests count a training step's collectives against the plan's.  torch's
``CommDebugMode`` counts only DTensor's functional collectives, and its module tracker
follows neither a checkpoint's recomputation nor a backward inside the model's call (as
micro-batches run) and raises an IndexError inside some models' forward (Phi, OLMo 3,
nanochat, Gemma 4, Cohere-Compass), so this is a dispatch mode of its own.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode


class Collectives(TorchDispatchMode):
    """Counts the collectives of ``namespaces`` by name: functional ones (DTensor's) by
    default, ``c10d`` ones (FSDP2's, replicate's) where asked.  Like ``CommDebugMode``, an
    op on DTensors is handed back to DTensor first, so the collectives it issues come back
    here."""

    def __init__(self, *namespaces: str) -> None:
        super().__init__()
        self.namespaces = namespaces or ("_c10d_functional",)
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if isinstance(func, torch._ops.HigherOrderOperator):  # DTensor's random ops: not collectives
            return func(*args, **(kwargs or {}))
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        if func.namespace in self.namespaces and not func.__name__.startswith(
                ("wait_tensor", "_wrap_tensor_autograd")):
            self.counts[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))
