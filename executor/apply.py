"""``apply(plan, model)``: run an unchanged model under a plan, as SPMD over a device mesh.

How the plan is realised (see docs/executor.md for the user-facing rules):

* Mesh dims named in ``plan.data_parallel`` (of size > 1; size-1 ones are ignored) are
  data-parallel: the batch is sliced over them (executor.data) and FSDP2
  ``fully_shard`` runs over them (``fully_shard`` mode shards parameters on the plan's
  ``S(d)``; ``replicate`` mode is HSDP's replicate dim).  Every other dim belongs to the *model mesh*: parameters become
  DTensors with the plan's placements there.
* On the model mesh, activations are DTensors too.  Tensors entering any module that
  holds DTensor parameters are made Replicate DTensors if they are plain, so DTensor
  sharding propagation computes every op exactly as on one device whatever the
  placements: a plan can be slow (an implicit all-gather) but never wrong.  The plan's
  ``modules`` layouts redistribute a module's first tensor input / output at its
  boundary (sequence parallel, or where the planner wants the resharding); at the
  root, outputs become plain full tensors again.
* A plan with ``pipeline`` stages is cut into stages (executor.pipeline) once the
  parameters are placed; each stage then gets the hooks, recomputation and FSDP above.
  Without stages, the plan's ``microbatches`` run inside the model's call
  (executor.accumulate: forward and backward of each part of a training call).
* Everything is checked before anything is changed, so a bad plan leaves the model
  as it was.
"""

from __future__ import annotations

import inspect
import math
import os
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from pydantic import ValidationError
from torch import nn
from torch.autograd import Variable
from torch.distributed._composable import checkpoint  # keeps FQNs, unlike the wrapper
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor import debug as dtensor_debug
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.utils import _sync_module_states  # DDP's broadcast of module states
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import SUPPORTED_NODES, tree_map_only
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
from transformers import PreTrainedModel

from cost_model.profile import problem_lines
from executor import deferred_init, dtensor_rules, local_regions, loss, outputs, pipeline, rng
from executor.accumulate import accumulate
from executor.data import DataParallelBatch, SameBatch
from planner.schema import (
    Fingerprint,
    MeshRoles,
    ModuleLayout,
    Plan,
    pattern_matches,
    shard_dim,
)

# FSDP2 only replicates as part of HSDP (a replicate dim and a shard dim).  A plan with
# a replicate dim but no fully_shard dim gets this extra size-1 shard dim, which
# changes no rank's position; it reuses FSDP2's bucketed all-reduce (overlapped with
# compute on CUDA streams; synchronous on a CPU) instead of torch DDP, which does not take
# DTensor (tensor-parallel) parameters.
_UNIT_SHARD_DIM = "_fsdp_unit"


_APPLIED = "_executor_applied"  # set on a model apply has changed: a second apply is refused
_REPLACED = "_executor_replaced_by_apply"  # on a parameter apply swapped for another: its FQN
_BROADCAST_BUCKET_BYTES = 250 * 2**20  # DDP's default broadcast bucket
_OPTIMIZER_HOOK: list[Any] = []  # the global step pre-hook, registered once
_CHECKED_OPTIMIZERS: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


class PlanError(ValueError):
    """The plan cannot run this model here; one line per problem, each naming its FQN or field."""


@dataclass
class _Layout(MeshRoles):
    """The plan's mesh roles, checked, and what apply works out from plan and model."""

    cuts: pipeline.Cuts | None = None  # the checked stage cut of a pipeline plan
    placements: dict[str, list[str]] = field(default_factory=dict)  # fqn -> plan placements


def apply(plan: Plan, model: nn.Module, *, mesh: DeviceMesh | None = None) -> nn.Module:
    """Shard ``model`` in place as ``plan`` says and return it, ready for an unchanged loop.

    Runs under any initialised process group (``init_process_group``) whose world size
    is ``plan.devices``, or under ``torchrun`` (or another env:// launcher), whose group
    it initialises when the script has not; with no process group a 1-device plan returns the
    model as the single-device reference (on the plan's CUDA device where there is one,
    checkpointed and in micro-batches as the plan says).  ``mesh``: run on this device mesh instead of
    one built over the whole world (a job that already has one, or a subgroup: a mesh
    over torch's fake process group dry-runs the plan without communicating); its dim
    names and sizes must be the plan's.  Raises :class:`PlanError` listing every
    mismatch between plan, model and world before touching the model.
    """
    if not isinstance(plan, Plan):
        raise TypeError(f"plan: expected a planner.Plan, got {type(plan).__name__} "
                        "(planner.Plan.from_json reads a saved plan)")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh: expected a torch DeviceMesh (or None), got {type(mesh).__name__}")
    try:  # a plan changed in Python since it was read (pydantic checks only on construction)
        plan = Plan.model_validate(data := plan.model_dump())
    except ValidationError as e:
        raise PlanError("plan is invalid:\n  " + "\n  ".join(f"plan: {line}" for line in problem_lines(e, data))) from None
    if mesh is None and not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # Launched by torchrun (or any launcher that sets the env:// variables) and not
        # initialised yet: the training loop stays free of distributed set-up.  torch's
        # default backends: gloo for CPU tensors, NCCL for CUDA ones where CUDA exists.
        dist.init_process_group()
    world = mesh.size() if mesh is not None else dist.get_world_size() if dist.is_initialized() else 1
    try:
        layout = _check(plan, model, world, mesh)
    except PlanError:
        _agree(mesh, refused=True)
        raise
    _agree(mesh, refused=False)
    _refuse_hf_checkpointing_later(model, plan)
    # the plan's micro-batches without pipeline stages: the model's call runs them
    # (executor.accumulate) where the loss is the model's, else the loop must
    parts = plan.microbatches if plan.pipeline is None and plan.microbatches > 1 else 1
    if parts > 1 and not _counts_tokens(model):
        warnings.warn(f"plan.microbatches: {parts} (gradient accumulation) is the loop's to do for a model "
                      "that is not a Hugging Face causal LM: apply runs each call on the whole batch it is "
                      f"given, while the plan's memory assumes each rank's batch in {parts} parts; call the "
                      f"model on each part and backward its loss / {parts} before the optimizer step "
                      "(docs/executor.md, Known limits)", stacklevel=2)
        parts = 1
    on_meta = any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    if plan.devices == 1:
        device = _one_device(plan)
        if on_meta:
            model = deferred_init.materialize(model, device=device)
        elif device.type == "cuda":
            model = model.to(device)
        # the model's call changes (hooks, checkpointed blocks, parts): a second apply
        # would wrap them again, as on N devices
        setattr(model, _APPLIED, True)
        _checkpoint_activations(model, plan, None)
        _register_root_hooks(model, None, False, plan.activation_checkpointing)
        if parts > 1:
            accumulate(model, parts, None)
        return model
    if not rng.is_active() and _draws_dropout(model):
        warnings.warn("executor.rng is not seeded (or not active), so dropout draws from torch's generator: this "
                      f"{plan.devices}-device run will not reproduce the 1-device run; call "
                      "executor.rng.manual_seed(seed) before building the model", stacklevel=2)
    setattr(model, _APPLIED, True)
    _refuse_save_pretrained(model, plan.devices)
    mesh = mesh or _build_mesh(plan, layout)
    model_mesh = mesh[layout.model] if _size(mesh, layout.model) > 1 else None
    before = dict(model.named_parameters())
    if on_meta:
        _materialize(model, model_mesh, layout, plan.mesh.names)
    else:
        _from_first_rank(model, mesh)
    if model_mesh is not None:
        _distribute_parameters(model, model_mesh, layout, plan.mesh.names)
        if not layout.data:  # FSDP2 reduces the gradients of the parameters it wraps
            _reduce_pending_grads(model)
        if layout.cuts is None:  # a pipeline hooks each stage instead (_prepare_stage)
            _register_activation_hooks(model, model_mesh, plan, layout.model)
    batch = (DataParallelBatch(mesh, layout.data, layout.model if model_mesh is not None else (),
                               counts_tokens=layout.cuts is None and _counts_tokens(model))
             if _size(mesh, layout.data) > 1 else None)
    if batch is not None:
        for problem in _not_per_row(model):
            warnings.warn(f"{problem}; this run will not reproduce the 1-device run (docs/executor.md, "
                          "Known limits)", stacklevel=2)
    if layout.cuts is not None:
        model = pipeline.pipelined(model, plan, layout.cuts, mesh, batch,
                                   partial(_prepare_stage, plan=plan, mesh=mesh, model_mesh=model_mesh,
                                           layout=layout))
        _mark_replaced(before, model)
        return model
    _checkpoint_activations(model, plan, batch, tensor_parallel=model_mesh is not None)
    if layout.data:
        _fully_shard(model, mesh, layout, plan.mesh.names)
    # After fully_shard: FSDP2's root post-forward hook must see the local outputs, since
    # reading a lazily globalised field would gather it (executor.outputs).
    same_batch = SameBatch(mesh)
    _register_root_hooks(model, batch, model_mesh is not None, plan.activation_checkpointing, same_batch)
    if parts > 1:  # after fully_shard, whose class the model's becomes a subclass of
        accumulate(model, parts, batch, same_batch)
    _mark_replaced(before, model)
    return model


# -- checks ------------------------------------------------------------------------------

_DROPOUTS = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


def _draws_dropout(model: nn.Module) -> bool:
    """Dropout modules with p > 0, or a Hugging Face config's dropout probabilities
    (attention dropout is a config value its forward reads, not a module)."""
    if any(isinstance(m, _DROPOUTS) and m.p > 0 for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    fields = config.to_dict() if hasattr(config, "to_dict") else {}
    return any(k.endswith(("dropout", "pdrop")) and isinstance(v, float) and v > 0 for k, v in fields.items())


def _hf_checkpointing(model: nn.Module, modules: list[nn.Module], plan: Plan) -> str | None:
    """The problem when Hugging Face activation checkpointing is on in ``modules``.

    HF wraps each layer in torch.utils.checkpoint, whose recomputation redraws dropout
    from executor.rng's advanced counter (other masks than the forward's) and which the
    executor's own recomputation (the plan's) would then nest inside.  (Read off the
    layers' flag: the model-level property is deprecated in transformers 5.)"""
    if not any(getattr(m, "gradient_checkpointing", False) is True for m in modules):
        return None
    off = ("activation_checkpointing_disable" if hasattr(model, "activation_checkpointing_disable")
           else "gradient_checkpointing_disable")
    return (f"model: Hugging Face activation checkpointing is on; call model.{off}(): activation "
            f"checkpointing is the plan's field activation_checkpointing ({plan.activation_checkpointing!r} "
            "here), which redraws the forward's dropout masks")


def _refuse_hf_checkpointing_later(model: nn.Module, plan: Plan) -> None:
    """``gradient_checkpointing_enable()`` called after ``apply``: refused at the next
    forward (the modules that carry HF's flag are found once; reading their flags costs
    microseconds per step)."""
    flagged = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]

    def pre(mod: nn.Module, args: tuple) -> None:
        if problem := _hf_checkpointing(mod, flagged, plan):
            raise PlanError(problem)

    model.register_forward_pre_hook(pre, prepend=True)


def _refuse_save_pretrained(model: nn.Module, devices: int) -> None:
    """Hugging Face's ``save_pretrained`` on a rank's shards wrote a file of one pipeline
    stage's tensors (another ``from_pretrained`` would initialise the rest at random) or
    failed inside torch on DTensors; it is replaced by an error saying how to export."""
    if not callable(getattr(model, "save_pretrained", None)):
        return

    def save_pretrained(*_args: Any, **_kwargs: Any) -> None:
        raise PlanError(
            f"save_pretrained: under a {devices}-device plan each rank holds its shards or stages of the "
            "model only; save with executor.save(path, model=model), then in one process build the model "
            "(no plan), executor.load(path, model=plain) and call plain.save_pretrained(...)")

    model.save_pretrained = save_pretrained


def _check(plan: Plan, model: nn.Module, world: int, mesh: DeviceMesh | None) -> _Layout:
    problems: list[str] = []
    if getattr(model, _APPLIED, False):
        problems.append("model: executor.apply already ran on this model; build a fresh one (on the meta "
                        "device) for another plan")
    elif dtensors := [n for n, p in model.named_parameters() if isinstance(p, DTensor)]:
        problems.append(f"{dtensors[0]}: already a DTensor ({len(dtensors)} parameters): the model was "
                        "parallelised before; executor.apply takes the plain model")
    named = list(model.named_parameters())
    problems += plan.fingerprint.mismatches(Fingerprint.of((n, p.shape) for n, p in named))
    tensors = [*named, *model.named_buffers()]
    if 0 < len(meta := [n for n, t in tensors if t.is_meta]) < len(tensors):
        # the init program apply runs for a meta model writes every tensor: it silently
        # replaced loaded weights (audit, session 37)
        more = f" (and {len(meta) - 1} more)" if len(meta) > 1 else ""
        problems.append(
            f"{meta[0]}{more}: on the meta device while the model's other tensors hold values; apply "
            "initialises a model wholly on the meta device (every value from the init program, which would "
            "overwrite the others) or takes a wholly real one. load_state_dict(..., assign=True) into a meta "
            "model leaves what the state dict lacks on meta (Hugging Face's non-persistent buffers, such as "
            "rotary_emb.inv_freq): load into a model built for real")
    if mesh is None and world != plan.devices:
        where = "the process group" if dist.is_initialized() else "no process group (plain single process)"
        problems.append(f"devices: the plan is for {plan.devices} device{'s' * (plan.devices != 1)}, {where} has {world}")
    if plan.devices > 1 and plan.mesh.device_type == "cuda" and not torch.cuda.is_available():
        problems.append("mesh.device_type: the plan is for cuda, but CUDA is not available here")
    if problem := _hf_checkpointing(model, list(model.modules()), plan):
        problems.append(problem)
    roles, found = plan.mesh_roles()
    problems += found
    layout = _Layout(**asdict(roles))
    if mesh is not None:
        problems += _mesh_problems(plan, mesh, layout)
    problems += _unmatched_patterns(plan, model)
    experts: list[tuple[str, torch.dtype]] = []
    # on a model mesh every parameter is a DTensor, experts kept whole too
    grouped = (getattr(getattr(model, "config", None), "_experts_implementation", None) == "grouped_mm"
               and math.prod(plan.mesh.shape[plan.mesh.names.index(d)] for d in layout.model) > 1)
    for fqn, p in named:
        pl = plan.placement_for(fqn)
        if pl is None:
            problems.append(f"{fqn}: no placement in the plan")
            continue
        layout.placements[fqn] = pl
        problems += plan.placement_problems(fqn, tuple(p.shape), pl, layout)
        if grouped and p.dim() == 3 and ".experts." in fqn and p.dtype != torch.bfloat16:
            experts.append((fqn, p.dtype))
    if experts:
        # DTensor prices the experts' grouped GEMM with a meta kernel that takes bfloat16
        # only: "Expected inputs of BF16 type" from deep inside torch (black-box review),
        # split or replicated (the planner keeps a tiny model's whole on tp: a sweep, session 39)
        (fqn, dtype), more = experts[0], f" (and {len(experts) - 1} more)" if len(experts) > 1 else ""
        problems.append(f"{fqn}{more}: {str(dtype).removeprefix('torch.')} experts on the model dims (DTensors "
                        "there, split or whole); torch's grouped GEMM under DTensor takes bfloat16 only: build "
                        "or cast the model in bfloat16, or build it with experts_implementation=\"batched_mm\"")
    if not dtensor_rules.FLATTENS_INNER_SHARDS:
        problems += _older_dtensor_problems(model, plan, layout)
    if plan.pipeline is not None:  # its dry run needs a model that fits the plan
        layout.cuts, found = pipeline.check(plan, model, dry_run=not problems)
        problems += found
    if problems:
        raise PlanError("plan does not fit the model:\n  " + "\n  ".join(problems))
    return layout


def _agree(mesh: DeviceMesh | None, refused: bool) -> None:
    """Every rank learns whether any rank's checks refused the plan, before the first
    collective that sets anything up (building the mesh, the first rank's broadcast).
    Ranks check their own models, which can differ (built or loaded apart); the ones whose
    checks passed waited in that collective for a rank that had raised, until the process
    group's timeout (30 minutes by default), or failed with gloo's 'Connection closed by
    peer' where that rank's process ended (audit, session 37).  One MAX all-reduce over
    the world (or over each dim of a given mesh) of (refused, -rank): on the ranks that
    passed, raises a PlanError naming the first rank that refused."""
    if mesh is not None:
        groups = [mesh.get_group(d) for d in range(mesh.ndim) if mesh.size(d) > 1]
    elif dist.is_initialized():
        groups = [dist.group.WORLD]
    else:
        return
    rank = dist.get_rank()
    flag = torch.tensor([int(refused), -rank if refused else -(1 << 62)], dtype=torch.int64)
    for group in groups:
        if dist.get_backend(group) == "nccl":  # takes CUDA tensors only
            flag = flag.to(_cuda_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if flag[0] and not refused:
        raise PlanError(f"plan: rank {-int(flag[1])} refused it (its error names the problem); this rank's "
                        "checks passed, and the ranks must agree before any of them changes its model")


def _mesh_problems(plan: Plan, mesh: DeviceMesh, layout: _Layout) -> list[str]:
    """A given mesh must be the plan's: the same dims in order, sizes and device type."""
    want = dict(zip(plan.mesh.names, plan.mesh.shape, strict=True))
    if mesh.mesh_dim_names is None:
        return [f"mesh: the given mesh {tuple(mesh.shape)} has no dim names; the plan's mesh is {want}"]
    given = dict(zip(mesh.mesh_dim_names, mesh.shape, strict=True))
    out = []
    if list(given.items()) != list(want.items()):
        out.append(f"mesh: the plan's mesh is {want}, the given mesh is {given or tuple(mesh.shape)}")
    if mesh.device_type != plan.mesh.device_type:
        out.append(f"mesh.device_type: the plan is for {plan.mesh.device_type}, the given mesh is "
                   f"{mesh.device_type}")
    if layout.replicate and not layout.shard:
        out.append("data_parallel: a replicate-only plan runs as HSDP on an extra size-1 mesh dim "
                   f"({_UNIT_SHARD_DIM}) that apply builds itself; pass no mesh for it")
    return out


def _unmatched_patterns(plan: Plan, model: nn.Module) -> list[str]:
    fqns = [n for n, _ in model.named_parameters()]
    modules = [n for n, _ in model.named_modules()]
    out = [f"{p.fqn}: matches no parameter of the model" for p in plan.parameters
           if not any(pattern_matches(p.fqn, f) for f in fqns)]
    out += [f"modules: {m.module} matches no module of the model" for m in plan.modules
            if not any(pattern_matches(m.module, n) for n in modules)]
    return out


# -- mesh and parameters --------------------------------------------------------------------

# init_device_mesh makes new process groups on every call, and each keeps its threads and
# connections until the process ends (gloo: two worker threads and a socket loop per
# group): a process applying plans again and again (a notebook, a sweep, the tests' rank
# pool) grew by 6 threads a rank per apply on a 2-D mesh, to 1,360 after ~200 applies,
# each apply then ~5x slower.  So a mesh is kept per default group, device type, shape
# and dim names, and every apply with the same ones shares it.
_MESHES: dict[tuple[str, tuple[int, ...], tuple[str, ...]], tuple[Any, DeviceMesh]] = {}


def _build_mesh(plan: Plan, layout: _Layout) -> DeviceMesh:
    device = plan.mesh.device_type
    names, shape = list(plan.mesh.names), list(plan.mesh.shape)
    if layout.replicate and not layout.shard:
        at = names.index(layout.replicate) + 1
        names.insert(at, _UNIT_SHARD_DIM)
        shape.insert(at, 1)
        layout.shard = _UNIT_SHARD_DIM
    if device == "cuda":
        _cuda_device()
    key = (device, tuple(shape), tuple(names))
    held = _MESHES.get(key)
    if held is None or held[0] is not dist.group.WORLD:
        _forget_dead_meshes()
        mesh = init_device_mesh(device, key[1], mesh_dim_names=key[2])  # (may start the default group)
        held = _MESHES[key] = (dist.group.WORLD, mesh)
    return held[1]


def _forget_dead_meshes() -> None:
    """Clear DTensor's sharding propagation cache before a new mesh is made.  It maps input
    specs to output specs, and a new mesh equals an earlier one of the same shape and dim
    names (``DeviceMesh.__eq__`` does not compare process groups): after the default group
    was destroyed and made again (a notebook, the tests' fake groups), a hit handed out a
    spec on the old mesh, whose collectives then failed with "Could not resolve the process
    group registered under the name 3".  A private torch API (torch 2.13's debug module has
    it); looked up, so that a release without it only loses the clearing."""
    clear = getattr(dtensor_debug, "_clear_sharding_prop_cache", None)
    if clear is not None:
        clear()


def _cuda_device() -> torch.device:
    """This rank's GPU, made current: LOCAL_RANK's (torchrun's) or the rank's modulo the
    GPUs this host has."""
    local = os.environ.get("LOCAL_RANK")
    torch.cuda.set_device(int(local) if local is not None else dist.get_rank() % torch.cuda.device_count())
    return torch.device("cuda", torch.cuda.current_device())


def _from_first_rank(model: nn.Module, mesh: DeviceMesh) -> None:
    """Give every rank the parameters and buffers of the mesh's first rank, as DDP does
    when it is constructed (with DDP's own helper).

    Ranks that built or loaded a real model apart can hold different values: another seed,
    or a checkpoint read on one rank only.  FSDP2 would shard each rank's own copy and a
    replicated dim would keep it, so the copies would train apart without an error.  Each
    mesh dim broadcasts in turn from its coordinate 0; after dim ``d`` every rank holds the
    values of the rank whose coordinates up to ``d`` are 0."""
    for dim in range(mesh.ndim):
        if mesh.size(dim) > 1:
            group = mesh.get_group(dim)
            _sync_module_states(model, group, _BROADCAST_BUCKET_BYTES, 0, ())  # src: the group's rank 0


def _mark_replaced(before: dict[str, nn.Parameter], model: nn.Module) -> None:
    """Tag each parameter that apply swapped for a distributed one with its FQN: an
    optimizer built from them before apply would step tensors no gradient reaches, and
    train nothing without an error (``_refuse_replaced_parameters``)."""
    kept = {id(p) for p in model.parameters()}
    replaced = [(fqn, p) for fqn, p in before.items() if id(p) not in kept]
    for fqn, p in replaced:
        setattr(p, _REPLACED, fqn)
    if replaced and not _OPTIMIZER_HOOK:
        _OPTIMIZER_HOOK.append(register_optimizer_step_pre_hook(_refuse_replaced_parameters))


def replaced_parameter_problem(p: torch.Tensor) -> str | None:
    """Why an optimizer must not hold ``p``, where apply replaced it (``_mark_replaced``)."""
    fqn = getattr(p, _REPLACED, None)
    if fqn is None:
        return None
    return (f"optimizer: parameter {fqn} is the one executor.apply replaced with a distributed parameter, so "
            "stepping it trains nothing; build the optimizer from the applied model's parameters, after apply")


def _refuse_replaced_parameters(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    """A global optimizer step pre-hook: refuse, at an optimizer's first step, parameters
    apply replaced."""
    if optimizer in _CHECKED_OPTIMIZERS:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if problem := replaced_parameter_problem(p):
                raise RuntimeError(problem)
    _CHECKED_OPTIMIZERS.add(optimizer)


def _older_dtensor_problems(model: nn.Module, plan: Plan, layout: _Layout) -> list[str]:
    """What torch 2.11's DTensor cannot run (a helper's run of the suite there, session 25):
    MoE experts split over the model dims (no rule for the in-place ``index_put_`` the
    grouped GEMM path runs; the batched one mixed plain tensors and DTensors in backward),
    and eager attention split by heads (its ``query @ key.T`` flattens batch and the split
    heads).  Refused here by name, not met deep inside torch."""
    split = [fqn for fqn, pl in layout.placements.items()
             if any(pl[plan.mesh.names.index(d)] != "R" for d in layout.model)]
    version = torch.__version__.split("+")[0]
    problems = []
    if experts := [f for f in split if ".experts." in f]:
        problems.append(f"{experts[0]}: experts split over the model dims need torch >= 2.13 (torch {version}'s "
                        "DTensor has no rule for the in-place index_put_ they run); plan with them replicated there")
    eager = getattr(getattr(model, "config", None), "_attn_implementation", None) == "eager"
    if eager and (attention := [f for f in split if "attn." in f]):
        problems.append(f"{attention[0]}: eager attention split by heads needs torch >= 2.13 (torch {version}'s "
                        "DTensor cannot flatten the split heads of its scores); plan without tensor parallelism")
    return problems


def _one_device(plan: Plan) -> torch.device:
    """Where a 1-device plan's model lives: the plan's CUDA device where this process has
    CUDA (as an N-device plan's DTensors and FSDP2 units do), else the CPU, where a CUDA
    plan still runs as the single-device reference."""
    if plan.mesh.device_type == "cuda" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _not_per_row(model: nn.Module) -> list[str]:
    """What a Hugging Face config turns on that data parallelism cannot split by batch
    rows: each rank computes it on its slice as if the slice were the whole batch."""
    config = getattr(model, "config", None)
    problems = []
    if getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", 0):
        problems.append("output_router_logits: the router's load-balancing loss is computed on each "
                        "data-parallel rank's slice, and it is not a mean over rows, so the loss and the "
                        "router's gradients differ from one device's")
    return problems


def _size(mesh: DeviceMesh, dims: tuple[str, ...]) -> int:
    return math.prod(mesh.size(mesh.mesh_dim_names.index(d)) for d in dims)


def _model_placements(pl: list[str], names: tuple[str, ...], model_dims: tuple[str, ...]) -> list[Placement]:
    out: list[Placement] = []
    for name in model_dims:
        d = shard_dim(pl[names.index(name)])
        out.append(Replicate() if d is None else Shard(d))
    return out


def _materialize(model: nn.Module, mesh: DeviceMesh | None, layout: _Layout,
                 names: tuple[str, ...]) -> None:
    """A meta-device model gets storage for its model-mesh shards only (executor.deferred_init),
    initialised as the single-device build would be.  Data-parallel dims shard later, in
    fully_shard, so before that a rank holds its tensor-parallel share of the model."""
    device = "cuda" if mesh is not None and mesh.device_type == "cuda" else "cpu"

    def placements(fqn: str) -> tuple[DeviceMesh, list[Placement]] | None:
        if mesh is None or fqn not in layout.placements:  # buffers stay plain
            return None
        return mesh, _model_placements(layout.placements[fqn], names, layout.model)

    deferred_init.materialize(model, placements, device=device)


def _distribute_parameters(model: nn.Module, mesh: DeviceMesh, layout: _Layout,
                           names: tuple[str, ...]) -> None:
    """Every parameter becomes a DTensor on the model mesh; tied parameters stay tied."""
    fqn_of = {id(p): n for n, p in model.named_parameters()}
    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for pname, p in list(module._parameters.items()):
            if p is None:
                continue
            if isinstance(p, DTensor):  # materialised from meta already sharded
                continue
            if id(p) not in new:
                placements = _model_placements(layout.placements[fqn_of[id(p)]], names, layout.model)
                new[id(p)] = nn.Parameter(distribute_tensor(p.data, mesh, placements),
                                          requires_grad=p.requires_grad)
            module._parameters[pname] = new[id(p)]


def _reduce_pending_grads(model: nn.Module) -> None:
    """A parameter replicated on a dim its activations are split over gets a Partial
    gradient (a pending sum).  Left so, DTensor reduces it again in every optimizer op
    that reads it (AdamW: three times per parameter); reducing it to the parameter's own
    placements once per backward gives the same values.

    The reductions go out together when the backward ends: gradients of replicated
    parameters (norm weights, a replicated embedding) with the same pending placements
    in one all-reduce of their concatenation, the others (a sharded parameter's) one by
    one.  Issued one by one as each gradient is accumulated, every tiny all-reduce was a
    blocking collective in the middle of the backward: on the fidelity bench's TP Llama
    (4 gloo ranks, 2 cores) 9 norm-weight all-reduces of 1 KB waited 15 ms each."""
    pending: list[nn.Parameter] = []

    def record(p: torch.Tensor) -> None:
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            if not pending:
                Variable._execution_engine.queue_callback(flush)
            pending.append(p)

    @torch.no_grad()
    def flush() -> None:
        buckets: dict[tuple, list[torch.Tensor]] = defaultdict(list)
        for p in pending:
            g = p.grad
            if all(isinstance(pl, Replicate) for pl in p.placements):
                buckets[(g.device_mesh, tuple(g.placements), g.dtype)].append(p)
            else:
                p.grad = g.redistribute(g.device_mesh, p.placements)
        pending.clear()
        for (mesh, placements, _), params in buckets.items():
            grads = [p.grad.to_local() for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            replicate = [Replicate()] * mesh.ndim
            summed = DTensor.from_local(flat, mesh, placements, run_check=False).redistribute(
                mesh, replicate).to_local()
            for p, g, part in zip(params, grads, summed.split([g.numel() for g in grads]), strict=True):
                p.grad = DTensor.from_local(part.view_as(g), mesh, replicate, run_check=False)

    for p in model.parameters():
        if isinstance(p, DTensor) and p.requires_grad:
            p.register_post_accumulate_grad_hook(record)


# -- activations -------------------------------------------------------------------------------

def _register_activation_hooks(model: nn.Module, mesh: DeviceMesh, plan: Plan,
                               model_dims: tuple[str, ...]) -> None:
    dtensor_rules.install()
    replicate = [Replicate()] * mesh.ndim

    def as_dtensor(t: torch.Tensor) -> torch.Tensor:
        return t if isinstance(t, DTensor) else DTensor.from_local(t, mesh, replicate, run_check=False)

    def to_dtensors(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        # Runs before every module that holds parameters; most calls carry no plain
        # tensor, and then pytree's rebuild of the arguments is skipped (except in a
        # local region's recording or replay, where every call must cross the same steps).
        if not local_regions.active() and not _has_plain_tensor((*args, *kwargs.values())):
            return None
        return tree_map_only(torch.Tensor, lambda t: local_regions.convert(t, as_dtensor), (args, kwargs))

    def resolve_partial(t: torch.Tensor) -> torch.Tensor:
        return _summed(t) if isinstance(t, DTensor) else t

    def no_partial_outputs(module: nn.Module, args: tuple, out: Any) -> Any:
        # A pending sum leaving a module would be reduced wherever DTensor next needs
        # it, possibly after all-gathering weights; reduce it here, at the boundary.
        if isinstance(out, DTensor) and not local_regions.active():
            return resolve_partial(out)
        return tree_map_only(torch.Tensor, lambda t: local_regions.convert(t, resolve_partial), out)

    last = _Conversions()
    model.register_forward_pre_hook(last.clear)
    model.register_forward_hook(last.clear)
    for name, module in model.named_modules():
        layout = plan.layout_for(name)
        if layout is not None:  # first: a Partial output goes straight to the layout's
            # placement (Partial -> Shard is one reduce-scatter; via Replicate it would be
            # an all-reduce of twice the bytes and a slice)
            _register_layout_hooks(module, mesh, layout, as_dtensor,
                                   lambda spec: _model_placements(spec, plan.mesh.names, model_dims), last)
        if any(True for _ in module.parameters()):
            module.register_forward_pre_hook(to_dtensors, with_kwargs=True)
            module.register_forward_hook(no_partial_outputs)
        if isinstance(module, nn.Linear) and isinstance(module.weight, DTensor):
            module.register_forward_pre_hook(_linear_input)
    loss.install(model)  # the loss on vocabulary-sharded logits, without gathering them

    def replicated_input(fqn: str) -> bool:
        layout = plan.layout_for(fqn)
        return (layout is not None and layout.input is not None
                and all(isinstance(p, Replicate) for p in _model_placements(layout.input, plan.mesh.names,
                                                                             model_dims)))

    local_regions.kept_whole(model, mesh, replicated_input)
    local_regions.regions(model, mesh)


def _linear_input(module: nn.Linear, args: tuple) -> tuple | None:
    """A Linear's input redistributed, at its boundary, to what the weight's sharding needs
    (the whole input features for a column-parallel weight, a shard of them for a
    row-parallel one), as TorchTitan's parallel styles do.  Left to DTensor, the
    redistribution happens inside the matmul's dispatch, autograd saves the input as it
    was, and backward plans the gradients afresh: measured on the sequence-parallel Llama,
    the vocabulary-parallel lm_head then computed its weight gradient for the whole
    vocabulary (a 4x larger GEMM) with two extra collectives.  On a torch whose DTensor
    cannot flatten an input split by sequence, a replicated weight's input is gathered."""
    x = args[0] if args else None
    if not isinstance(x, DTensor) and not local_regions.active():
        return None

    def needed(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, DTensor):
            return t
        target = [Replicate() if isinstance(w, Shard) and w.dim == 0
                  else Shard(t.ndim - 1) if isinstance(w, Shard) and w.dim == 1
                  else Replicate() if (not dtensor_rules.FLATTENS_INNER_SHARDS and isinstance(p, Shard)
                                       and 0 < p.dim % t.ndim < t.ndim - 1) else p
                  for p, w in zip(t.placements, module.weight.placements, strict=True)]
        return t if target == list(t.placements) else t.redistribute(t.device_mesh, target)

    return (local_regions.convert(x, needed), *args[1:])


def _has_plain_tensor(values: Iterable[Any]) -> bool:
    """Whether pytree would find a tensor that is not a DTensor among ``values``.  Plain
    tuples and lists are searched here; any other container pytree walks (dicts, named
    tuples, registered classes such as model outputs) answers yes and is left to pytree.
    Hand-written because pytree flattens and rebuilds the arguments on every call."""
    for v in values:
        if isinstance(v, torch.Tensor):
            if not isinstance(v, DTensor):
                return True
        elif type(v) in (tuple, list):
            if _has_plain_tensor(v):
                return True
        elif isinstance(v, tuple) or type(v) in SUPPORTED_NODES:
            return True
    return False


class _Conversions:
    """The module inputs the layout hooks converted, and to what: a module that reads a
    tensor already converted (same object, unchanged since) into the same placements
    reuses the result.  q, k and v (gate and up) projections read one normed hidden
    state, and so do the attention and the MLP of a parallel block (Cohere, Phi, GPT-J);
    converting it once is one all-gather forward and one reduce-scatter backward
    (autograd sums the consumers' gradients first), which is what the planner prices
    (one reshard per tensor and layout).  Only the last conversion was kept until the
    parallel block's attention converted its children's inputs between: its MLP then
    converted the hidden state again, one collective more each way per layer than the
    plan priced.  Each result is held while its source lives (a weak reference to the
    source drops the entry), so a hit does not depend on what the first consumer keeps:
    a local region's replay, a recomputation and ``no_grad`` hit as a recording does.
    The entries go when the model's forward starts and when it returns (``clear``): a
    result that is a view of its source (Megatron's ``f``, a slice to a sequence shard)
    keeps the source alive, so its weak reference never fired, and each step kept the
    last one's converted tensors and their autograd graph for good (the fidelity bench's
    TP Llama grew by ~30 MB per step and rank).  A checkpointed block's recomputation in
    backward fills the cache anew; the next forward empties it.  A conversion that
    changes nothing (a child reading its parent's converted input) is not kept: its
    readers may see it behind a wrapper of their own (a module's full backward hooks wrap
    its inputs, as CommDebugMode's tracker has them do), and a hit the recording had and
    the replay misses crosses a boundary the tape lacks."""

    def __init__(self) -> None:
        # id(source) -> (source, its version then, placements, result); id(result) -> placements
        self._entries: dict[int, tuple[weakref.ref, int, list[Placement], torch.Tensor]] = {}
        self._made: dict[int, list[Placement]] = {}

    def get(self, t: torch.Tensor, target: list[Placement]) -> torch.Tensor | None:
        entry = self._entries.get(id(t))
        if entry is None:
            return None
        src, version, want, out = entry
        return out if src() is t and _version(t) == version and want == target else None

    def produced(self, t: torch.Tensor, target: list[Placement]) -> bool:
        """Whether ``t`` is a conversion's result, in ``target``: a child module reading its
        parent's converted input (attention's q_proj)."""
        return self._made.get(id(t)) == target

    def put(self, t: torch.Tensor, target: list[Placement], out: torch.Tensor) -> torch.Tensor:
        self._drop_id(id(t))
        self._entries[id(t)] = (weakref.ref(t, lambda _ref, key=id(t): self._drop_id(key)), _version(t),
                                target, out)
        self._made[id(out)] = target
        return out

    def clear(self, *_: Any) -> None:
        """Forget every conversion (hooks of the model's forward: none outlives it)."""
        self._entries.clear()
        self._made.clear()

    def _drop_id(self, key: int) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None and self._made.get(id(entry[3])) is entry[2]:
            del self._made[id(entry[3])]


def _version(t: torch.Tensor) -> int:
    """``t``'s in-place version; -1 for a tensor made under ``torch.inference_mode``, which
    has none (changing one in place between q, k and v's projections goes unseen there,
    as sharing the conversion is also what a learned local region replays)."""
    return -1 if t.is_inference() else t._version


def _register_layout_hooks(module: nn.Module, mesh: DeviceMesh, layout: ModuleLayout,
                           as_dtensor: Callable[[torch.Tensor], DTensor],
                           placements: Callable[[list[str]], list[Placement]],
                           last: _Conversions) -> None:
    def redistribute(t: torch.Tensor, spec: list[str], shared: bool = False) -> torch.Tensor:
        target = placements(spec)
        if any(isinstance(p, Shard) and p.dim >= t.dim() for p in target):  # else an IndexError in torch
            side = "input" if shared else "output"
            raise PlanError(f"modules: {layout.module} {side} {spec} shards a dim that its "
                            f"{t.dim()}-D activation {list(t.shape)} does not have")
        if shared and (done := last.get(t, target)) is not None:
            return done
        # Megatron's f: a module input that stays replicated, read by column-parallel
        # projections, gets back a pending-sum gradient; reduced where the outermost such
        # module is entered, the norm before it sees whole gradients, so its weight's are
        # whole too (left pending, they reached the residual stream summed and each norm
        # weight needed an all-reduce of its own: one by one under FSDP2).  A child reading
        # its parent's converted input adds none (it would reduce each child's share); it
        # still crosses ``local_regions.convert``, one tape step in a recording as in the
        # replay, where the parent's result may be another (local) tensor.  A module that
        # gives its input's layout back (a norm) gets no pending gradient to reduce.
        reduce_grad = (shared and any(isinstance(p, Replicate) for p in target)
                       and layout.output != layout.input
                       and not last.produced(local_regions.original(t), target))

        def convert(t: torch.Tensor) -> torch.Tensor:
            t = as_dtensor(t)
            if list(t.placements) != target:
                return _redistributed(t, target)
            return _GradNotPartial.apply(t) if reduce_grad else t

        out = local_regions.convert(t, convert)
        return last.put(t, target, out) if shared and out is not t else out

    def pre(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if args and isinstance(args[0], torch.Tensor):
            return (redistribute(args[0], layout.input, shared=True), *args[1:]), kwargs
        key = next((k for k, v in kwargs.items() if isinstance(v, torch.Tensor)), None)
        if key is not None:
            kwargs = {**kwargs, key: redistribute(kwargs[key], layout.input, shared=True)}
        return args, kwargs

    def post(mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
        if isinstance(out, torch.Tensor):
            return redistribute(out, layout.output)
        if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
            return (redistribute(out[0], layout.output), *out[1:])
        return out

    if layout.input is not None:
        module.register_forward_pre_hook(pre, with_kwargs=True)
    if layout.output is not None:
        module.register_forward_hook(post, with_kwargs=True)


class _GradNotPartial(torch.autograd.Function):
    """Identity forward; backward, a pending-sum gradient is summed (all-reduced) first.

    Placed after a redistribution out of one of DTensor's special pending sums: a
    vocabulary-sharded embedding's output is a MaskPartial, and the redistribution's
    backward must turn the gradient back into the source's placement, which DTensor
    refuses for a Partial gradient ("from one partial type (P(sum)) to another (MaskP)")
    but does for a replicated or sharded one.  Without sequence parallelism the
    gradient arrives as a pending sum from the column-parallel projections after the
    first norm; with it, sharded (and then all-gathered all the same)."""

    @staticmethod
    def forward(ctx: Any, t: DTensor) -> DTensor:
        return t.view_as(t)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> DTensor:
        return _summed(grad)


def _summed(t: DTensor) -> DTensor:
    """``t`` with its pending sums reduced (Partial -> Replicate), else ``t`` itself."""
    if not any(p.is_partial() for p in t.placements):
        return t
    return _redistributed(t, [Replicate() if p.is_partial() else p for p in t.placements])


def _redistributed(t: DTensor, target: list[Placement]) -> DTensor:
    """``t.redistribute(target)``; out of a special pending sum (MaskPartial), behind
    ``_GradNotPartial`` so that backward can turn the gradient back."""
    special = any(p.is_partial() and type(p) is not Partial for p in t.placements)
    out = t.redistribute(t.device_mesh, target)
    return _GradNotPartial.apply(out) if special else out


def _counts_tokens(model: nn.Module) -> bool:
    """Whether ``model`` is a Hugging Face causal LM whose forward hands
    ``num_items_in_batch`` to its loss (executor.data)."""
    takes = any(p.kind is inspect.Parameter.VAR_KEYWORD or p.name == "num_items_in_batch"
                for p in inspect.signature(model.forward).parameters.values())
    return takes and getattr(model, "loss_type", None) == "ForCausalLM"


def _register_root_hooks(model: nn.Module, batch: DataParallelBatch | None, tensor_parallel: bool,
                         checkpointing: str, same_batch: SameBatch | None = None) -> None:
    """Root: check that the ranks were given the same batch (``same_batch``, on N
    devices), slice it, then (after forward) hand back plain global tensors,
    each when the loop first reads it (executor.outputs).  A Hugging Face model is called
    with ``use_cache=False`` unless the loop asks for a cache.

    With tensor parallelism the forward runs under ``implicit_replication``: tensors the
    model creates inside its forward (masks, biases from ``torch.arange``) are the same
    on every rank, so treating them as Replicate is exact."""
    replication = ExitStack()
    # A Hugging Face model builds a key/value cache on every call unless told not to, in
    # training and validation too, where nothing reads it; every layer appends to it.  A
    # recomputed layer (the plan's checkpointing) would append again and run other ops
    # than its forward (selective checkpointing then fails), and a layer checked for local
    # shards likewise (executor.local_regions).  Under tensor parallelism the cache cannot
    # even start: its plain empty tensor does not join DTensor keys (an IndexError).
    signature = inspect.signature(model.forward).parameters
    params = list(signature)
    cache_at = params.index("use_cache") if "use_cache" in params else None
    if (cache_at is None and isinstance(model, PreTrainedModel)
            and any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.values())):
        cache_at = len(params)  # GraniteMoE's causal LM takes it through **kwargs only, never positionally
    no_cache = ("tensor-parallel plan (Hugging Face's cache cannot hold DTensors)" if tensor_parallel
                else f"plan that recomputes layers (activation_checkpointing {checkpointing!r}: a "
                "recomputed layer would append to the cache again)" if checkpointing != "none" else None)

    def pre(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        # autocast keeps its low-precision copy of a weight for the whole autocast block,
        # keyed by the weight tensor; FSDP2 refills the same unsharded tensors each call,
        # so a second call in one block (a micro-batch, or the loop's own accumulation)
        # would backpropagate through the first call's copy and its gradient be lost
        torch.clear_autocast_cache()
        if cache_at is not None and len(args) <= cache_at:
            if kwargs.get("use_cache") is None:
                kwargs = {**kwargs, "use_cache": False}
            elif kwargs["use_cache"] and no_cache and (tensor_parallel or (mod.training and torch.is_grad_enabled())):
                raise ValueError(f"use_cache=True: a key/value cache is not supported under a {no_cache}; "
                                 "pass use_cache=False (to generate(), which turns the cache on by default, too)")
        if same_batch is not None:
            same_batch(args, kwargs)
        if batch is not None:
            args, kwargs = batch.slice(args, kwargs)
        if tensor_parallel:
            replication.enter_context(implicit_replication())
        if batch is not None:
            replication.enter_context(batch.randomness())
        return args, kwargs

    def single_device(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, DTensor):
            t = t.full_tensor()
        return batch.globalise(t) if batch is not None else t

    def post(mod: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
        replication.close()
        return outputs.single_device(out, single_device)

    model.register_forward_pre_hook(pre, with_kwargs=True, prepend=True)
    if batch is not None or tensor_parallel:  # else the outputs are the single device's already
        model.register_forward_hook(post, with_kwargs=True, always_call=True)


# -- data parallel and activation checkpointing -------------------------------------------

def _fully_shard(model: nn.Module, mesh: DeviceMesh, layout: _Layout, names: tuple[str, ...]) -> None:
    """FSDP2 per repeated block (a ModuleList entry), then the root, as torch recommends.

    The last block keeps its parameters gathered after forward (TorchTitan's default
    too): backward starts with it, so resharding would only all-gather them again."""
    dp_mesh = mesh[layout.data] if len(layout.data) > 1 else mesh[layout.data[0]]
    fqn_of = {id(p): n for n, p in model.named_parameters()}
    shard_at = names.index(layout.shard) if layout.shard in names else None

    def placement(p: nn.Parameter) -> Shard:
        if shard_at is None:
            return Shard(0)
        return Shard(shard_dim(layout.placements[fqn_of[id(p)]][shard_at]))

    blocks = local_regions.blocks(model)
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=dp_mesh, shard_placement_fn=placement,
                    reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=dp_mesh, shard_placement_fn=placement)


def _prepare_stage(stage: nn.Module, plan: Plan, mesh: DeviceMesh, model_mesh: DeviceMesh | None,
                   layout: _Layout) -> None:
    """A pipeline stage gets what ``apply`` gives a whole model: activation hooks on the
    model mesh (on the stage root, not the user's model, whose forward is the schedule),
    activation checkpointing, then FSDP2 over the data-parallel dims (the runtime takes
    the batch slice and turns the stage's outputs into plain tensors)."""
    if model_mesh is not None:
        _register_activation_hooks(stage, model_mesh, plan, layout.model)
    _checkpoint_activations(stage, plan, None, tensor_parallel=model_mesh is not None)
    if layout.data:
        _fully_shard(stage, mesh, layout, plan.mesh.names)


def _checkpoint_activations(model: nn.Module, plan: Plan, batch: DataParallelBatch | None,
                            tensor_parallel: bool = False) -> None:
    """Recompute each repeated block in backward: all of it (``full``) or all but its matmul
    and attention outputs (``selective``, torch's selective activation checkpointing)."""
    if plan.activation_checkpointing == "none":
        return
    selective = plan.activation_checkpointing == "selective"
    for block in local_regions.blocks(model):
        checkpoint(block, context_fn=partial(_recompute_contexts, selective, batch, tensor_parallel))


# planner.strategies.SAVED_BY_SELECTIVE is the planner's view of this set
_SAVED_BY_SELECTIVE = {
    torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
    torch.ops.aten.baddbmm.default, torch.ops.aten._grouped_mm.default,
    dtensor_rules.CPU_SDPA, torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
}


def _keep_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_BY_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


def _recompute_contexts(selective: bool, batch: DataParallelBatch | None, tensor_parallel: bool,
                        ) -> tuple[AbstractContextManager, AbstractContextManager]:
    """The recomputation must redraw the forward's dropout masks (executor.rng's contexts,
    and the batch-slice view the root hooks give the forward), run under the forward's
    ``implicit_replication`` (a tensor the block makes mixes with DTensors there: the MoE
    experts' ``inv_perm[perm] = arange(...)``, which failed in backward; black-box review)
    and, when selective, reuse the saved matmuls (torch's contexts): run all the pairs."""
    pairs = [rng.checkpoint_context_fn()] if rng.is_active() else []
    if batch is not None:
        pairs.append((nullcontext(), batch.randomness()))
    if tensor_parallel:
        pairs.append((nullcontext(), implicit_replication()))
    if selective:
        pairs.append(create_selective_checkpoint_contexts(_keep_matmuls))
    return _together(p[0] for p in pairs), _together(p[1] for p in pairs)


@contextmanager
def _together(contexts: Iterable[AbstractContextManager]) -> Iterator[None]:
    with ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield
