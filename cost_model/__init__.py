"""Analytic cost model: per-op compute, collectives, resharding, memory and step composition.

Every number the planner optimises and ``meshplan estimate`` reports comes from
these primitives and a hardware ``Profile``; see docs/cost_model.md.
``cost_model.calibrate`` (which imports torch.distributed) is not re-exported.
"""

from cost_model.comm import (
    RedistributeCost,
    bus_factor,
    collective_time,
    redistribute_cost,
    redistribute_time,
)
from cost_model.compute import matmul_flops, op_time
from cost_model.memory import (
    DEFAULT_HEADROOM,
    fits,
    inflight_microbatches,
    korthikanti_activation_bytes,
    model_state_bytes,
)
from cost_model.model_spec import ModelSpec, mfu, training_flops
from cost_model.profile import Profile, load_profile, shipped_profiles
from cost_model.step import StageCost, StepBreakdown, compose_step, optimizer_time

__all__ = [
    "DEFAULT_HEADROOM",
    "ModelSpec",
    "Profile",
    "RedistributeCost",
    "StageCost",
    "StepBreakdown",
    "bus_factor",
    "collective_time",
    "compose_step",
    "fits",
    "inflight_microbatches",
    "korthikanti_activation_bytes",
    "load_profile",
    "matmul_flops",
    "mfu",
    "model_state_bytes",
    "op_time",
    "optimizer_time",
    "redistribute_cost",
    "redistribute_time",
    "shipped_profiles",
    "training_flops",
]
