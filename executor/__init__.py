"""Run a meshplan plan: ``apply`` shards a model, ``rng`` makes randomness sharding-independent,
``save``/``load`` checkpoint it under any plan; a pipeline plan runs its schedule in
the model's forward (executor.pipeline)."""

from executor import local_regions, rng
from executor.apply import PlanError, apply
from executor.checkpoint import CheckpointError, load, save
from executor.data import BatchError
from executor.pipeline import PipelineError

__all__ = ["apply", "save", "load", "rng", "local_regions", "PlanError", "BatchError", "CheckpointError", "PipelineError"]
