"""meshplan planner: trace a model, search placements on a device mesh, write a plan.

Attributes load lazily (PEP 562) so that ``planner.schema`` — all that ``meshplan show``,
the service's store and the viewer need — does not import torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "SCHEMA_VERSION": "planner.schema",
    "Plan": "planner.schema",
    "Prediction": "planner.schema",
    "plan_json_schema": "planner.schema",
    "ConfigError": "planner.presets",
    "load_config": "planner.presets",
    "PlanningError": "planner.search",
    "default_shape": "planner.search",
    "estimate": "planner.search",
    "hand_plan": "planner.search",
    "plan": "planner.search",
    "trace": "planner.tracer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'planner' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
