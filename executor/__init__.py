"""Run a meshplan plan: ``apply`` shards a model, ``rng`` makes randomness sharding-independent,
``save``/``load`` checkpoint it under any plan."""

from executor import rng
from executor.apply import PlanError, apply
from executor.checkpoint import CheckpointError, load, save
from executor.data import BatchError

__all__ = ["apply", "save", "load", "rng", "PlanError", "BatchError", "CheckpointError"]
