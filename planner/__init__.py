"""meshplan planner: trace a model, search placements on a device mesh, write a plan."""

from planner.presets import ConfigError, load_config
from planner.schema import SCHEMA_VERSION, Plan, Prediction, plan_json_schema
from planner.search import PlanningError, default_shape, estimate, plan
from planner.tracer import trace

__all__ = ["SCHEMA_VERSION", "ConfigError", "Plan", "PlanningError", "Prediction", "default_shape", "estimate",
           "load_config", "plan", "plan_json_schema", "trace"]
