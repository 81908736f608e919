"""Distributed checkpoints that load under any plan or world size.

The tensors go through ``torch.distributed.checkpoint`` (DCP): every rank writes only
its shards, and loading reshards to whatever placements the loading model has (plain,
tensor-parallel DTensors, FSDP2), keyed by parameter FQN, which ``apply`` never changes
(a pipeline rank holds its stages' parameters under their original FQNs, so a checkpoint
saved with pp=2 loads with pp=1 and the other way round).
``get_state_dict``/``set_state_dict`` give model and optimizer state in that FQN-keyed
form, the optimizer's flattened (``flatten_optimizer_state_dict``): each parameter's
state and hyperparameters under its own FQN.  Unflattened, a parameter group is one
entry holding the list of its parameters' names, which differs between pipeline ranks;
DCP keeps one rank's copy of such an entry, and a resumed pipeline rank then found no
hyperparameters for its parameters (format 1, which ``load`` now refuses by name).
Alongside goes a small JSON record (step, ``executor.rng`` state, world size).

A save is atomic: ranks write into ``<path>.incomplete``, and only after all of them
have finished does rank 0 write the record and rename the directory to ``<path>``.  A
save killed half-way leaves at most ``<path>.incomplete``, which ``load`` refuses.
``path`` must be on a filesystem every rank sees (as DCP itself requires).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.optim import Optimizer

from executor import rng

RECORD = "meshplan-checkpoint.json"
FORMAT_VERSION = 2  # 1 (before 2026-11-24) saved the optimizer state unflattened
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(RuntimeError):
    """The path is not a complete meshplan checkpoint, or not one of this model."""


def save(path: str | os.PathLike, *, model: nn.Module, optimizer: Optimizer | None = None,
         step: int | None = None) -> None:
    """Write model (and optimizer) state, the step and the RNG state to ``path``; collective."""
    final = Path(path)
    staging = final.with_name(final.name + ".incomplete")
    if _rank() == 0 and staging.exists():
        shutil.rmtree(staging)  # debris of an earlier interrupted save
    _barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [], options=_OPTIONS)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(staging),
             no_dist=not dist.is_initialized())
    _barrier()  # every rank's shards are on disk
    if _rank() == 0:
        record = {
            "format": FORMAT_VERSION,
            "step": step,
            "rng": rng.get_state() if rng.is_active() else None,
            "world_size": dist.get_world_size() if dist.is_initialized() else 1,
            "optimizer": optimizer is not None,
        }
        (staging / RECORD).write_text(json.dumps(record, indent=2))
        if final.exists():
            retired = final.with_name(final.name + ".old")
            shutil.rmtree(retired, ignore_errors=True)
            final.rename(retired)
            staging.rename(final)
            shutil.rmtree(retired)
        else:
            staging.rename(final)
    _barrier()  # nobody returns before the checkpoint is visible under its name


def load(path: str | os.PathLike, *, model: nn.Module, optimizer: Optimizer | None = None) -> int | None:
    """Load what :func:`save` wrote into ``model`` (and ``optimizer``), resharding as needed.

    Restores the RNG state too.  Returns the saved step.  Collective."""
    record = _read_record(Path(path))
    if optimizer is not None and not record["optimizer"]:
        raise CheckpointError(f"optimizer: {path} was saved without optimizer state")
    model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [], options=_OPTIONS)
    _check_model(Path(path), model_sd)
    state: dict[str, Any] = {"model": model_sd}
    if optimizer is not None:
        state["optim"] = optim_sd
    dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    set_state_dict(model, optimizer if optimizer is not None else [],
                   model_state_dict=state["model"], optim_state_dict=state.get("optim", {}), options=_OPTIONS)
    if record["rng"] is not None:
        rng.set_state(record["rng"])
    return record["step"]


def _check_model(path: Path, model_sd: dict[str, Any]) -> None:
    """The checkpoint's model state against the model's, by FQN and global shape, from
    DCP's metadata: DCP's own error for a mismatch is a multi-rank traceback in a
    BaseException (``CheckpointException``), which ``except Exception`` does not catch.

    A pipeline rank holds its stages' entries only, so the ranks pool what they hold
    (collective): every rank then judges the whole model and raises the same error (a
    rank that raised alone would leave the others in DCP's collectives)."""
    saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    prefix = "model."  # the state saved is {"model": ..., "optim": ...}, flattened
    held = {fqn: tuple(v.shape) if hasattr(v, "shape") else None for fqn, v in model_sd.items()}
    if dist.is_initialized():
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, held)
        held = {fqn: shape for rank in every for fqn, shape in rank.items()}
    problems = []
    for fqn, shape in sorted(held.items()):
        meta = saved.get(prefix + fqn)
        if meta is None:
            problems.append(f"{fqn}: in the model, not in the checkpoint")
        elif hasattr(meta, "size") and shape is not None and tuple(meta.size) != shape:
            problems.append(f"{fqn}: checkpoint shape {list(meta.size)}, model shape {list(shape)}")
    problems += [f"{key[len(prefix):]}: in the checkpoint, not in the model"
                 for key in sorted(saved) if key.startswith(prefix) and key[len(prefix):] not in held]
    if problems:
        raise CheckpointError(f"model: {path} does not fit the model ({len(problems)} problem(s)):\n  "
                              + "\n  ".join(problems))


def _read_record(path: Path) -> dict[str, Any]:
    marker = path / RECORD
    if not marker.is_file():
        hint = " (an interrupted save)" if path.name.endswith(".incomplete") else ""
        raise CheckpointError(f"path: {path} is not a complete meshplan checkpoint{hint}: no {RECORD}")
    record = json.loads(marker.read_text())
    if record.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"format: {path} has checkpoint format {record.get('format')!r}, "
                              f"this executor reads {FORMAT_VERSION}")
    return record


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
