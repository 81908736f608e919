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
import operator
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.optim import Optimizer

from executor import rng
from executor.apply import replaced_parameter_problem

RECORD = "meshplan-checkpoint.json"
FORMAT_VERSION = 2  # 1 (before 2026-11-24) saved the optimizer state unflattened
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(RuntimeError):
    """The path is not a complete meshplan checkpoint, or not one of this model."""


def save(path: str | os.PathLike, *, model: nn.Module, optimizer: Optimizer | None = None,
         step: int | None = None) -> None:
    """Write model (and optimizer) state, the step and the RNG state to ``path``; collective."""
    _check_arguments(model, optimizer)
    if step is not None:  # checked on every rank before anything is written: rank 0 alone
        try:              # failed on a numpy int after the shards, and left the rest waiting
            if isinstance(step, bool):
                raise TypeError
            step = operator.index(step)
        except TypeError:
            raise TypeError(f"step: expected an int or None, got {type(step).__name__} {step!r}") from None
    final = _directory(path)
    staging = final.with_name(final.name + ".incomplete")
    retired = final.with_name(final.name + ".old")
    _check_replaceable(final, staging, retired)  # every rank: all raise, or none
    if _rank() == 0 and staging.exists():
        if (staging / RECORD).is_file():
            # a save that stopped between its renames: its checkpoint is complete and the
            # newest, which this used to delete (leaving <path>.old for good; audit)
            _put_in_place(staging, final, retired)
        else:
            shutil.rmtree(staging)  # debris of an earlier interrupted save
    _barrier()
    with _no_grads(optimizer):
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
            "tied": _tied(model),
        }
        (staging / RECORD).write_text(json.dumps(record, indent=2))
        _put_in_place(staging, final, retired)
    _barrier()  # nobody returns before the checkpoint is visible under its name


def _put_in_place(staging: Path, final: Path, retired: Path) -> None:
    """A complete checkpoint (its record written) from ``staging`` to ``final``, the one
    there before through ``retired``, removed last."""
    if final.exists():
        shutil.rmtree(retired, ignore_errors=True)
        final.rename(retired)
    staging.rename(final)
    shutil.rmtree(retired, ignore_errors=True)


def _ours(directory: Path) -> bool:
    """Whether ``directory`` is a checkpoint (it has the record) or a save's debris: only
    DCP's files (shards, its metadata and the temporary file it renames into place;
    hidden files such as NFS's are let be) and no record yet."""
    if (directory / RECORD).is_file():
        return True
    return all(f.name.startswith((".", "__")) or f.suffix == ".distcp" for f in directory.iterdir())


def _check_replaceable(final: Path, staging: Path, retired: Path) -> None:
    """Refuse, before writing anything, to save over what is not a checkpoint: ``save``
    replaces ``path`` and clears ``<path>.incomplete`` and ``<path>.old``, and once did so
    with whatever directory stood there (a run directory and its logs)."""
    if final.exists() and not (final.is_dir() and (final / RECORD).is_file()):
        raise CheckpointError(f"path: {final} exists and is not a meshplan checkpoint; save replaces only "
                              "a checkpoint, so choose a new path or remove it")
    for debris in (staging, retired):
        if debris.exists() and not (debris.is_dir() and _ours(debris)):
            raise CheckpointError(f"path: {debris} exists and is not a save's debris; save would remove it, "
                                  "so choose another path or remove it")


def load(path: str | os.PathLike, *, model: nn.Module, optimizer: Optimizer | None = None) -> int | None:
    """Load what :func:`save` wrote into ``model`` (and ``optimizer``), resharding as needed.

    Restores the RNG state too.  Returns the saved step.  Collective."""
    _check_arguments(model, optimizer)
    meta = next((n for n, p in model.named_parameters() if p.is_meta), None)
    if meta is not None:
        raise CheckpointError(f"model: {meta} is on the meta device (no storage to load into); "
                              "executor.apply the model first, which materialises it")
    record = _read_record(_directory(path))
    if optimizer is not None and not record["optimizer"]:
        raise CheckpointError(f"optimizer: {path} was saved without optimizer state")
    with _no_grads(optimizer):
        model_sd, optim_sd = get_state_dict(model, optimizer if optimizer is not None else [], options=_OPTIONS)
    _check_state(Path(path), "model", model_sd)
    # after the names and shapes: another model's checkpoint was refused for its ties (audit)
    saved_ties = {frozenset(group) for group in record.get("tied", [])}  # absent before session 21
    for group in _tied(model) if "tied" in record else []:
        if frozenset(group) not in saved_ties:
            raise CheckpointError(f"model: {' and '.join(group)} are one tensor in the model but were saved "
                                  f"as separate tensors in {path}; loading would keep one of them for both")
    state: dict[str, Any] = {"model": model_sd}
    if optimizer is not None:
        _check_state(Path(path), "optim", optim_sd)
        state["optim"] = optim_sd
    try:
        dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    except CheckpointException as e:  # a BaseException, which `except Exception` misses; on every rank
        raise CheckpointError(f"path: {path}: a file of the checkpoint is missing or damaged (DCP: "
                              f"{_first_line(e)})") from None
    set_state_dict(model, optimizer if optimizer is not None else [],
                   model_state_dict=state["model"], optim_state_dict=state.get("optim", {}), options=_OPTIONS)
    if record["rng"] is not None:
        rng.set_state(record["rng"])
    return record["step"]


def _tied(model: nn.Module) -> list[list[str]]:
    """Names that share one parameter (a head tied to its embedding), sorted.  A checkpoint
    of an untied model loaded into a tied one passed the name and shape checks and put the
    head's weights in the embedding (review)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return sorted(sorted(group) for group in names.values() if len(group) > 1)


def _directory(path: object) -> Path:
    """The checkpoint's directory; '' and '.' have no name to stage beside (pathlib's
    "PosixPath('.') has an empty name" before; audit)."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path: expected a directory path, got {type(path).__name__}")
    if not Path(path).name:
        raise CheckpointError(f"path: {str(path)!r} names no directory of its own; give the checkpoint one, "
                              "such as 'ckpt'")
    return Path(path)


def _check_arguments(model: object, optimizer: object) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if optimizer is None:
        return
    if not isinstance(optimizer, Optimizer):
        raise TypeError(f"optimizer: expected a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
    # torch's get_state_dict raised a bare KeyError: 0 for another model's parameters (audit)
    held = {id(p) for p in model.parameters()}
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if id(p) not in held:
                raise CheckpointError(replaced_parameter_problem(p) or (
                    f"optimizer: param_groups[{g}] parameter {i} (shape {list(p.shape)}) is not a parameter of "
                    "the model; build the optimizer from model.parameters()"))


@contextmanager
def _no_grads(optimizer: Optimizer | None) -> Iterator[None]:
    """Gradients out of the way while ``get_state_dict`` reads an optimizer that has not
    stepped yet: it creates the state entries that loading fills (a step on zero
    gradients) only where no parameter has a gradient, and a loop that ran a backward
    before loading would otherwise have had none loaded."""
    params = [p for g in optimizer.param_groups for p in g["params"]] if optimizer is not None else []
    kept = [p.grad for p in params] if params and not optimizer.state else []
    for p in params[: len(kept)]:
        p.grad = None
    try:
        yield
    finally:
        for p, g in zip(params, kept, strict=False):
            p.grad = g


def _check_state(path: Path, section: str, held_sd: dict[str, Any]) -> None:
    """The checkpoint's ``section`` ("model" or "optim") against the loading side's, by key
    and global shape, from DCP's metadata: DCP's own error for a mismatch is a multi-rank
    traceback in a BaseException (``CheckpointException``), which ``except Exception``
    does not catch (an AdamW checkpoint loaded into SGD raised one; one saved before the
    first step, loaded into a stepped optimizer, silently kept the old moments).

    A pipeline rank holds its stages' entries only, so the ranks pool what they hold
    (collective): every rank then judges the whole state and raises the same error (a
    rank that raised alone would leave the others in DCP's collectives)."""
    try:
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as e:  # a bare FileNotFoundError or UnpicklingError before (audit)
        raise CheckpointError(f"path: {path}: DCP's metadata is missing or damaged "
                              f"({type(e).__name__}: {_first_line(e)})") from None
    prefix = section + "."  # the state saved is {"model": ..., "optim": ...}, flattened
    held = {key: tuple(v.shape) if hasattr(v, "shape") else None for key, v in held_sd.items()}
    if dist.is_initialized():
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, held)
        held = {key: shape for rank in every for key, shape in rank.items()}
    side = {"model": "model", "optim": "optimizer"}[section]
    problems = []
    for key, shape in sorted(held.items()):
        meta = saved.get(prefix + key)
        if meta is None:
            problems.append(f"{key}: in the {side}, not in the checkpoint")
        elif hasattr(meta, "size") and shape is not None and tuple(meta.size) != shape:
            problems.append(f"{key}: checkpoint shape {list(meta.size)}, {side} shape {list(shape)}")
    problems += [f"{key[len(prefix):]}: in the checkpoint, not in the {side}"
                 for key in sorted(saved) if key.startswith(prefix) and key[len(prefix):] not in held]
    if problems:
        shown = problems[:20] + ([f"... and {len(problems) - 20} more"] if len(problems) > 20 else [])
        raise CheckpointError(f"{side}: {path} does not fit the {side} ({len(problems)} problem(s)):\n  "
                              + "\n  ".join(shown))


def _read_record(path: Path) -> dict[str, Any]:
    marker = path / RECORD
    if not marker.is_file():
        hint = " (an interrupted save)" if path.name.endswith(".incomplete") else ""
        staged = path.with_name(path.name + ".incomplete")
        if (staged / RECORD).is_file():
            hint = (f" (a save stopped between its renames: {staged} holds its complete checkpoint; load it "
                    "from there, or the next save to this path puts it in place first)")
        raise CheckpointError(f"path: {path} is not a complete meshplan checkpoint{hint}: no {RECORD}")
    try:
        record = json.loads(marker.read_text())
    except (ValueError, OSError) as e:  # a JSONDecodeError naming no file before (audit)
        raise CheckpointError(f"path: {marker} is damaged ({e})") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT_VERSION:
        found = record.get("format") if isinstance(record, dict) else None
        raise CheckpointError(f"format: {path} has checkpoint format {found!r}, this executor reads {FORMAT_VERSION}")
    if missing := [key for key in ("step", "optimizer", "rng") if key not in record]:
        raise CheckpointError(f"path: {marker} is damaged (no {', '.join(missing)})")
    return record


def _first_line(e: BaseException) -> str:
    return next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
