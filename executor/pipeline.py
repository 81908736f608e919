"""Pipeline parallelism: run a plan's ``pipeline`` stages with torch.distributed.pipelining.

Composed with what ``apply`` does on the other mesh dims (FSDP2 / HSDP on data-parallel
dims, tensor / sequence parallelism on the rest), applied per stage.

Stages are cut from the unchanged model, TorchTitan-style, so parameter FQNs stay the
original ones (a checkpoint saved with pp=2 loads with pp=1 and the other way round):

* the user's model keeps only the modules of this rank's stages; every other module
  that holds parameters becomes a :class:`_Skipped` stand-in that hands its main input
  through, so the model's own forward code still runs unchanged around it;
* each stage is a *replica* of the model: its containers are shallow copies (their own
  child lists and hook tables), its kept modules are the very module objects of the
  user's model.  Stage 0 is called with ``input_ids``, the last stage returns the
  ``logits``.  A later stage is called with ``inputs_embeds=`` of the received
  activation's shape, so the model's own code before the layers (rotary tables, masks)
  runs, and a hook hands the received activation itself to the stage's first module:
  what a model does to its embeddings first (Granite's multiplier, GPT-NeoX's
  embedding dropout) is one device's stage 0's to do, not every stage's.  Only the
  input embedding may therefore hold parameters before the first layer.  A non-last
  stage sends its last module's output, taken by a hook, not what the model's forward
  returns after it (a parameter-free final norm such as OLMo's, Cohere's logit scale
  and Granite's logit divisor would run on every stage);
* the user's model's ``forward(input_ids=, labels=)`` runs one whole training step of
  the plan's schedule (GPipe, 1F1B, interleaved 1F1B) and returns the step's loss.

Randomness stays single-device-identical (docs/rng.md): before anything changes, a
dry run of the whole model on meta tensors counts the random ops one device draws
before each stage.  A stage's forward of micro-batch ``m`` then runs with the counter
one device's forward had at that stage, inside an ``executor.rng.batch_rows`` window
that makes its draws those of the micro-batch's rows of the global batch.  The order
in which the schedule runs micro-batches therefore does not matter, recomputation
replays the window (``executor.rng.checkpoint_context_fn``), and after the step every
rank's counter is where one device's is.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.experimental import implicit_replication
from torch.func import functional_call
from transformers.modeling_outputs import CausalLMOutputWithPast

from executor import loss, rng
from executor.accumulate import StepGradients, loss_only
from executor.data import BatchError, DataParallelBatch, SameBatch, comm_device, counted_tokens
from planner.schema import Plan

_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B}
# Keyword arguments of an HF forward that carry no tensor between stages.
_IGNORED_KWARGS = ("use_cache", "return_dict")


class PipelineError(ValueError):
    """The pipelined model was called in a way a pipeline step cannot run."""


@dataclass(frozen=True)
class Boundary:
    """Shape (after the batch and sequence dims) and dtype of a tensor crossing stages."""

    tail: tuple[int, ...]
    dtype: torch.dtype

    def meta(self, rows: int, seq: int) -> torch.Tensor:
        """Its description for a PipelineStage, which takes ``requires_grad`` from it: an
        activation gets (and sends back) a gradient."""
        return torch.empty((rows, seq, *self.tail), dtype=self.dtype, device="meta", requires_grad=True)


@dataclass(frozen=True)
class Cuts:
    """The checked stage cut of a model (what ``apply`` works out before changing anything)."""

    stages: tuple[tuple[str, ...], ...]  # module FQNs of each (virtual) stage, in model order
    draws_before: tuple[int, ...]  # random ops one device's forward draws before each stage
    draws: int  # random ops in one device's whole forward
    inputs: tuple[Boundary | None, ...]  # what each stage receives (None: the token ids)
    logits: Boundary  # what the last stage hands the loss
    counted: bool  # executor.rng was seeded when apply counted the draws (else all 0)


# -- checks (nothing changes until they pass) -------------------------------------------------

def check(plan: Plan, model: nn.Module, dry_run: bool) -> tuple[Cuts | None, list[str]]:
    """The stage cut of ``plan.pipeline`` on ``model``, or the problems, one per line.

    ``dry_run=False`` (the model does not fit the plan otherwise) checks the stages only."""
    spec = plan.pipeline
    assert spec is not None  # noqa: S101 - callers only pass pipeline plans
    problems = []
    if (spec.virtual_stages > 1) != (spec.schedule == "interleaved-1f1b"):  # one way round was accepted (review)
        problems.append(f"pipeline.virtual_stages: {spec.virtual_stages} with schedule {spec.schedule!r}; "
                        "interleaved-1f1b runs 2 or more stages per rank, the other schedules 1")
    pp = plan.mesh.size_of(spec.dim)
    if spec.schedule == "1f1b" and plan.microbatches < pp:
        problems.append(f"microbatches: {plan.microbatches} with 1f1b on {spec.dim}={pp}; the 1F1B schedule "
                        "needs at least one micro-batch per stage (torch.distributed.pipelining)")
    if spec.schedule == "interleaved-1f1b" and plan.microbatches % pp:
        problems.append(f"microbatches: {plan.microbatches} with interleaved-1f1b on {spec.dim}={pp}; the "
                        "interleaved schedule runs micro-batches in rounds of pp, so it needs a multiple of pp")
    if not (callable(getattr(model, "get_input_embeddings", None)) and hasattr(model, "loss_function")):
        problems.append(f"pipeline: {type(model).__name__} is not a Hugging Face causal LM; the pipeline "
                        "runtime starts later stages from inputs_embeds= and computes the loss with "
                        "the model's loss_function")
        return None, problems
    if getattr(model, "loss_type", None) != "ForCausalLM":
        # each micro-batch's loss is its share of the global mean through num_items_in_batch
        # (the schedule adds the micro-batches' gradients); a loss that ignored it would be
        # the micro-batch count times too large
        problems.append(f"pipeline: {type(model).__name__}'s loss is not Hugging Face's causal-LM loss "
                        f"(loss_type {getattr(model, 'loss_type', None)!r}); the pipeline weights "
                        "micro-batch losses by token counts through its num_items_in_batch")
        return None, problems
    stages, found = _virtual_stages(plan, model)
    problems += found
    if not problems:
        problems += _ownership(model, stages)
    if problems or not dry_run:
        return None, problems
    return _dry_run(model, stages)


def _is_layer(model: nn.Module, fqn: str) -> bool:
    parent = fqn.rpartition(".")[0]
    return isinstance(model.get_submodule(parent) if parent else model, nn.ModuleList)


def _virtual_stages(plan: Plan, model: nn.Module) -> tuple[list[list[str]], list[str]]:
    """Module lists of the ``pp x virtual_stages`` stages, stage ``s`` on pp rank ``s % pp``.

    A plan lists either every virtual stage, or (as the planner writes an interleaved
    plan) one stage per pp rank: rank ``i``'s layer count is then dealt out as
    ``count / virtual_stages`` layers to each of its virtual stages, in model order."""
    spec = plan.pipeline
    assert spec is not None  # noqa: S101
    pp, v = plan.mesh.size_of(spec.dim), spec.virtual_stages
    listed = [list(s.modules) for s in sorted(spec.stages, key=lambda s: s.index)]
    problems = []
    if sorted(s.index for s in spec.stages) != list(range(len(spec.stages))):
        problems.append(f"pipeline.stages: indices {[s.index for s in spec.stages]} are not 0..{len(spec.stages) - 1}")
    if len(listed) not in (pp, pp * v):
        problems.append(f"pipeline.stages: {len(listed)} stages for {spec.dim}={pp} with virtual_stages={v} "
                        f"(list {pp} per-rank or {pp * v} virtual stages)")
    names = {n for n, _ in model.named_modules()}
    for i, mods in enumerate(listed):
        problems += [f"pipeline.stages[{i}].modules: {m} is not a module of the model"
                     for m in mods if m not in names]
        if not mods:
            problems.append(f"pipeline.stages[{i}].modules: empty")
    if problems or len(listed) == pp * v:
        return listed, problems
    layers = [[m for m in mods if _is_layer(model, m)] for mods in listed]
    flat = [m for stage in layers for m in stage]
    if not flat:
        return listed, ["pipeline.stages: no repeated layers (nn.ModuleList entries) to interleave"]
    before = listed[0][:listed[0].index(flat[0])]
    last = listed[-1]
    after = last[last.index(flat[-1]) + 1:] if flat[-1] in last else []
    stray = [m for mods in listed for m in mods if m not in flat and m not in before and m not in after]
    problems += [f"pipeline.stages: {m} sits between layers; interleaving deals out layers only" for m in stray]
    problems += [f"pipeline.stages[{i}]: {len(ls)} layers do not split into virtual_stages={v}"
                 for i, ls in enumerate(layers) if len(ls) % v or not ls]
    if problems:
        return listed, problems
    out, at = [], 0
    for s in range(pp * v):
        n = len(layers[s % pp]) // v
        out.append(flat[at:at + n])
        at += n
    out[0] = before + out[0]
    out[-1] = out[-1] + after
    return out, []


def _owner(fqn: str, stages: Sequence[Sequence[str]]) -> list[int]:
    return [s for s, mods in enumerate(stages) if any(fqn == m or fqn.startswith(m + ".") for m in mods)]


def _ownership(model: nn.Module, stages: list[list[str]]) -> list[str]:
    """Every parameter in exactly one stage; only the input embedding before the layers."""
    problems = []
    owners: dict[int, tuple[str, list[int]]] = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        where = _owner(fqn, stages)
        if not where:
            problems.append(f"{fqn}: in no pipeline stage")
        elif len(where) > 1:
            problems.append(f"{fqn}: in pipeline stages {where}; a parameter belongs to one stage")
        elif id(p) in owners and owners[id(p)][1] != where:
            problems.append(f"{fqn}: tied to {owners[id(p)][0]} (stage {owners[id(p)][1][0]}) but in stage "
                            f"{where[0]}; tied parameters must share a stage (or untie them)")
        owners.setdefault(id(p), (fqn, where))
    embedding = model.get_input_embeddings()
    layers = [i for i, m in enumerate(stages[0]) if _is_layer(model, m)]
    for m in stages[0][:layers[0]] if layers else stages[0]:
        module = model.get_submodule(m)
        if module is not embedding and any(True for _ in module.parameters()):
            problems.append(f"pipeline.stages[0].modules: {m} holds parameters before the first layer; later "
                            "stages start from inputs_embeds=, so only the input embedding may come first")
    return problems


def _dry_run(model: nn.Module, stages: list[list[str]]) -> tuple[Cuts | None, list[str]]:
    """Count one device's random ops per stage and see what crosses each boundary.

    The forward runs on fake meta tensors (torch's FakeTensorMode over the meta device:
    shapes only, nothing computed or allocated; Hugging Face's data-dependent checks
    recognise fake tensors and stand aside, and executor.rng counts meta draws without
    computing them) over a two-token batch: the count of random ops does not depend on
    the shape.  It runs in training mode, the only mode a pipelined step runs in,
    whatever mode the model is in now (``from_pretrained`` returns it in eval mode,
    where dropout draws nothing).  The rng state is put back afterwards, with where a
    meta build began drawing (``materialize`` replays from there after this)."""
    active = rng.is_active()
    seen: dict[tuple[str, int], Any] = {}
    order: list[tuple[str, int]] = []  # stage starts and ends in the order the forward runs them
    sent: dict[int, Any] = {}  # each stage's last module's output (the activation it sends on)

    def counter() -> int:
        return rng.get_state()["counter"] if active else 0

    def at_start(s: int) -> Callable[..., None]:
        def hook(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            seen.setdefault(("start", s), (counter(), _main_input(args, kwargs)))
            order.append(("start", s))
        return hook

    def at_end(s: int) -> Callable[..., None]:
        def hook(mod: nn.Module, args: tuple, out: Any) -> None:
            seen[("end", s)] = counter()
            sent[s] = _main_output(out)
            order.append(("end", s))
        return hook

    handles = []
    for s, mods in enumerate(stages):
        handles.append(model.get_submodule(mods[0]).register_forward_pre_hook(at_start(s), with_kwargs=True))
        handles.append(model.get_submodule(mods[-1]).register_forward_hook(at_end(s)))
    fake = FakeTensorMode()
    tensors = {n: fake.from_tensor(torch.empty_like(t, device="meta"))
               for n, t in (*model.named_parameters(), *model.named_buffers())}
    modes = {m: m.training for m in model.modules()}
    # Hugging Face picks the experts' kernel per call (config._experts_implementation).
    # Its grouped GEMM on fake tensors runs torch's meta kernel, which takes bfloat16 only
    # ("Expected inputs of BF16 type"), where the CPU kernel that trains takes fp32 too:
    # an fp32 MoE pipeline failed here.  No kernel draws or moves a cut, so the dry run
    # has them run as batched GEMMs.
    grouped = {id(c): c for m in model.modules()
               if getattr(c := getattr(m, "config", None), "_experts_implementation", None) == "grouped_mm"}
    try:
        for c in grouped.values():
            c._experts_implementation = "batched_mm"
        model.train()
        with rng.preserved():
            if active:
                rng.set_state({"seed": rng.get_state()["seed"], "counter": 0})
            with fake, torch.no_grad():
                ids = torch.zeros(1, 2, dtype=torch.long, device="meta")
                out = functional_call(model, tensors, (), {"input_ids": ids, "use_cache": False}, strict=False)
            total = counter()
    finally:
        for h in handles:
            h.remove()
        for m, training in modes.items():
            m.training = training
        for c in grouped.values():
            c._experts_implementation = "grouped_mm"
    problems = [f"pipeline.stages[{s}].modules: {stages[s][0 if end == 'start' else -1]} does not run in the "
                "model's forward" for s in range(len(stages)) for end in ("start", "end") if (end, s) not in seen]
    if problems:
        return None, problems
    # the forward must run stage 0's modules, then stage 1's, ...: a stage's first module
    # starts after the stage before it has finished (its last module's last run)
    first_start = {s: order.index(("start", s)) for s in range(len(stages))}
    last_end = {s: len(order) - 1 - order[::-1].index(("end", s)) for s in range(len(stages))}
    for s in range(1, len(stages)):
        if first_start[s] < last_end[s - 1]:
            return None, [f"pipeline.stages: the model's forward runs {stages[s][0]} (stage {s}) before "
                          f"{stages[s - 1][-1]} (stage {s - 1}) has finished; each stage must hold a run of "
                          "modules that comes after the stage before it, in the forward's order"]
    starts = [seen[("start", s)][0] for s in range(len(stages))]
    ends = [seen[("end", s)] for s in range(len(stages))]
    for s in range(len(stages)):
        before = ends[s - 1] if s else 0
        if starts[s] != before:
            where = f"between {stages[s - 1][-1]} and {stages[s][0]}" if s else f"before {stages[0][0]}"
            problems.append(f"pipeline.stages: the model draws random numbers {where}, outside every stage's "
                            "modules; the pipeline would draw them on the wrong stage")
    if ends[-1] != total:
        problems.append(f"pipeline.stages: the model draws random numbers after {stages[-1][-1]}, "
                        "outside every stage's modules")
    for s in range(1, len(stages)):
        if sent[s - 1] is not seen[("start", s)][1]:
            # a stage sends its last module's output and the next hands it to its first module
            problems.append(f"pipeline.stages: the model's forward changes the activation between "
                            f"{stages[s - 1][-1]} (stage {s - 1}) and {stages[s][0]} (stage {s}); a stage "
                            "boundary must fall where one module's output is the next one's input")
    inputs = tuple(None if s == 0 else _boundary(seen[("start", s)][1]) for s in range(len(stages)))
    if problems:
        return None, problems
    return Cuts(stages=tuple(tuple(m) for m in stages), draws_before=tuple(starts), draws=total,
                inputs=inputs, logits=_boundary(out.logits), counted=active), []


def _main_input(args: tuple, kwargs: dict) -> torch.Tensor:
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    return next(v for v in kwargs.values() if isinstance(v, torch.Tensor))


def _with_main_input(args: tuple, kwargs: dict, x: torch.Tensor) -> tuple[tuple, dict]:
    """``args, kwargs`` with the tensor ``_main_input`` reads replaced by ``x``."""
    if args and isinstance(args[0], torch.Tensor):
        return (x, *args[1:]), kwargs
    key = next(k for k, v in kwargs.items() if isinstance(v, torch.Tensor))
    return args, {**kwargs, key: x}


def _main_output(out: Any) -> Any:
    """A block's output activation: HF decoder layers return it alone or first in a tuple."""
    return out[0] if isinstance(out, (tuple, list)) and out else out


def _boundary(t: torch.Tensor) -> Boundary:
    return Boundary(tuple(t.shape[2:]), t.dtype)


# -- the cut ---------------------------------------------------------------------------------------

class _Skipped(nn.Module):
    """Stands in for a module another stage runs: hands its main input through, so the
    model's forward code around it runs unchanged."""

    def __init__(self, fqn: str) -> None:
        super().__init__()
        self.fqn = fqn

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return _main_input(args, kwargs)

    def extra_repr(self) -> str:
        return f"runs on another pipeline stage: {self.fqn}"


def _cut(module: nn.Module, keep: set[str], prefix: str, clone: bool) -> nn.Module:
    """``module`` with every parameter-holding module outside ``keep`` skipped.

    ``clone=False`` edits the tree in place (the user's model); ``clone=True`` builds a
    replica whose containers are copies and whose kept modules are shared."""
    if prefix in keep or not any(True for _ in module.parameters()):
        return module
    if not any(k.startswith(prefix + ".") or not prefix for k in keep):
        return _Skipped(prefix)
    out = _shallow_copy(module) if clone else module
    for name, child in module.named_children():
        out._modules[name] = _cut(child, keep, f"{prefix}.{name}" if prefix else name, clone)
    return out


def _shallow_copy(module: nn.Module) -> nn.Module:
    """Own child table and hook tables (FSDP registers hooks on a stage's root; they must
    not reach the user's model), shared everything else."""
    out = copy.copy(module)
    for key, value in vars(module).items():
        if isinstance(value, (dict, set)):
            out.__dict__[key] = copy.copy(value)
    return out


class _Stage(PipelineStage):
    """A PipelineStage whose forward of micro-batch ``m`` draws as one device would."""

    def __init__(self, draws: Callable[[int, int], Any], *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._draws = draws

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        with self._draws(self.stage_index, fwd_chunk_id):
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)


class _ShardedLogits:
    """The last stage's vocabulary-sharded logits between its forward and the loss.

    PipelineStage passes plain tensors, so the stage hands the loss its shard and the
    loss wraps it back as the DTensor it was: the loss then runs on the shards
    (executor.loss) instead of on logits gathered whole."""

    def __init__(self, shards: int) -> None:
        self.shards = shards
        self.spec: tuple[DeviceMesh, tuple[Placement, ...], torch.Size, tuple[int, ...]] | None = None

    def local(self, out: DTensor) -> torch.Tensor:
        vocab = out.ndim - 1
        keep = [p if isinstance(p, Shard) and p.dim in (vocab, -1) else Replicate() for p in out.placements]
        out = out.redistribute(out.device_mesh, keep)
        self.spec = (out.device_mesh, tuple(out.placements), out.shape, out.stride())
        return out.to_local()

    def whole(self, local: torch.Tensor) -> DTensor:
        assert self.spec is not None  # noqa: S101 - the loss follows its micro-batch's forward
        mesh, placements, shape, stride = self.spec
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def _vocab_shards(plan: Plan, model: nn.Module) -> int:
    """Into how many shards the model-parallel dims split the output projection's
    vocabulary (its weight's dim 0), as the plan places it."""
    head = model.get_output_embeddings()
    fqn = next((name for name, m in model.named_modules() if m is head), None)
    placements = plan.placement_for(f"{fqn}.weight") if fqn is not None else None
    if placements is None:
        return 1
    skip = {d.dim for d in plan.data_parallel} | {plan.pipeline.dim}
    return math.prod(d.size for d, p in zip(plan.mesh.dims, placements, strict=True)
                     if p == "S(0)" and d.name not in skip)


def _stage_forward(replica: nn.Module, stage: Sequence[str], first: bool, last: bool,
                   logits: _ShardedLogits | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """The stage's forward: its input in, a plain tensor out (what PipelineStage sends):
    whole activations, or the last stage's vocabulary shard of the logits (``logits``).

    A later stage's first module is handed the received activation by a pre-hook that
    runs before the executor's own (which turn it into the DTensor the plan places there),
    with the random-op counter put back to where it stood when the stage began, the
    counter one device has there; a non-last stage's last module's output is taken by a
    hook that runs after the executor's.  Both act once per stage call: a recomputation
    in backward runs the modules again without them.

    Under tensor parallelism the activations inside are DTensors; tensors the model makes
    in its forward (masks, positions) are the same on every rank, so treating them as
    replicated is exact (as ``apply`` does at a whole model's root)."""
    run = replica.forward
    call: dict[str, Any] = {}  # this call's received activation and counter, then its output

    def enter(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if "received" not in call:
            return None
        if call["counter"] is not None:
            rng.set_state(call.pop("counter"))
        return _with_main_input(args, kwargs, call.pop("received"))

    def leave(mod: nn.Module, args: tuple, out: Any) -> None:
        if call.pop("sending", False):
            call["sent"] = _main_output(out)

    if not first:
        replica.get_submodule(stage[0]).register_forward_pre_hook(enter, with_kwargs=True, prepend=True)
    if not last:
        replica.get_submodule(stage[-1]).register_forward_hook(leave)

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not first:
            call.update(received=x, counter=rng.get_state() if rng.is_active() else None)
        call["sending"] = not last
        inputs = {"input_ids": x} if first else {"inputs_embeds": torch.zeros_like(x)}
        try:
            with implicit_replication():
                result = run(**inputs, use_cache=False).logits
            out = call.pop("sent") if not last else result
        finally:
            call.clear()
        if not isinstance(out, DTensor):
            return out
        return logits.local(out) if logits is not None else out.full_tensor()

    return forward


def pipelined(model: nn.Module, plan: Plan, cuts: Cuts, mesh: DeviceMesh,
              batch: DataParallelBatch | None, prepare: Callable[[nn.Module], None]) -> nn.Module:
    """Keep this rank's stages of ``model`` and make its forward run the plan's schedule.

    ``prepare`` gets each stage's root (activation checkpointing, FSDP over the
    data-parallel dims)."""
    spec = plan.pipeline
    assert spec is not None  # noqa: S101
    pp = mesh.size(mesh.mesh_dim_names.index(spec.dim))
    rank = mesh.get_local_rank(spec.dim)
    mine = [s for s in range(len(cuts.stages)) if s % pp == rank]
    _cut(model, {m for s in mine for m in cuts.stages[s]}, "", clone=False)
    replicas = {s: _cut(model, set(cuts.stages[s]), "", clone=True) for s in mine}
    shards = _vocab_shards(plan, model)
    logits = _ShardedLogits(shards) if shards > 1 else None
    last = len(cuts.stages) - 1
    for s, replica in replicas.items():
        prepare(replica)  # first: the stage's hooks run before and after the executor's
        replica.forward = _stage_forward(replica, cuts.stages[s], first=s == 0, last=s == last,
                                         logits=logits if s == last else None)
    runner = _Runner(model, plan, cuts, replicas, mesh.get_group(spec.dim), batch, SameBatch(mesh),
                     comm_device(mesh.device_type), logits)
    model.forward = runner.step
    return model


def _batch_problem(input_ids: torch.Tensor, labels: torch.Tensor, vocab: int) -> str | None:
    """What one device's step would raise on this batch, found before the schedule runs.
    Inside it only the stage that meets a bad tensor raises (the embedding's stage an id
    outside the vocabulary, the loss's stage bad labels), and the other stages waited in
    their send or receive until the process group's timeout (audit, session 37).  Every
    rank holds the same global batch, so every rank finds the same problem."""
    for name, t in (("input_ids", input_ids), ("labels", labels)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            return f"{name}: expected a [batch, sequence] tensor, got {shape}"
    if labels.shape != input_ids.shape:
        return f"labels: shape {list(labels.shape)} differs from input_ids' {list(input_ids.shape)}"
    if input_ids.dtype not in (torch.int32, torch.int64):
        return f"input_ids: expected integer token ids (int64 or int32), got {input_ids.dtype}"
    if labels.dtype != torch.int64:
        return f"labels: expected int64 (torch.long) token ids, as the loss takes, got {labels.dtype}"
    for name, ids, ignored in (("input_ids", input_ids, ""),
                               ("labels", labels[labels != -100], " and is not -100 (ignored)")):  # the loss's ignore_index
        if ids.numel() == 0:
            continue
        low, high = (int(v) for v in torch.aminmax(ids))
        if low < 0 or high >= vocab:
            return f"{name}: token id {low if low < 0 else high} is outside the vocabulary (0..{vocab - 1}){ignored}"
    return None


class _Runner:
    """One pipelined training step per call of the user's model."""

    def __init__(self, model: nn.Module, plan: Plan, cuts: Cuts, replicas: dict[int, nn.Module],
                 group: dist.ProcessGroup, batch: DataParallelBatch | None, same_batch: SameBatch,
                 device: torch.device, logits: _ShardedLogits | None) -> None:
        self.model, self.cuts, self.replicas, self.group, self.batch = model, cuts, replicas, group, batch
        self.same_batch, self.device = same_batch, device
        self.schedule_name, self.microbatches = plan.pipeline.schedule, plan.microbatches
        loss_function, vocab = loss.vocab_parallel(model.loss_function), model.config.vocab_size
        self.vocab = vocab

        def loss_fn(out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            value = loss_function(logits=out if logits is None else logits.whole(out), labels=labels,
                                  vocab_size=vocab, num_items_in_batch=self._items)
            return value.to_local() if isinstance(value, DTensor) else value  # replicated

        self.loss_fn = loss_fn
        tail = cuts.logits.tail  # the last stage hands on its vocabulary shard
        self.logits = cuts.logits if logits is None else Boundary((*tail[:-1], tail[-1] // logits.shards),
                                                                   cuts.logits.dtype)
        self._built: tuple[tuple[int, int], Any] | None = None
        self._base = 0  # the rng counter at the start of the step
        self._rows = (0, 1, 1)  # first row of micro-batch 0 in the global batch, rows per micro-batch, total
        # num_items_in_batch of each micro-batch's loss: the global batch's counted tokens
        # over data-parallel ranks, so that the sum of a rank's micro-batch losses (their
        # gradients add up: the schedule does not rescale them) and the mean over ranks
        # (FSDP2's gradient reduction, _step_loss) is the global mean token loss however
        # unevenly -100 labels fall over them
        self._items: torch.Tensor | float = 1.0
        params = {id(p): p for r in replicas.values() for p in r.parameters()}.values()
        self.grads = StepGradients(list(params), PipelineError)

    def step(self, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
             **kwargs: Any) -> CausalLMOutputWithPast:
        self._refuse(input_ids, labels, kwargs)
        self.same_batch((), {"input_ids": input_ids, "labels": labels})
        self._items = counted_tokens({"labels": labels}) / (self.batch.size if self.batch is not None else 1)
        if self.batch is not None:
            (), sliced = self.batch.slice((), {"input_ids": input_ids, "labels": labels})
            x, y, size, index = sliced["input_ids"], sliced["labels"], self.batch.size, self.batch.index
        else:
            x, y, size, index = input_ids, labels, 1, 0
        rows = x.shape[0]
        if rows % self.microbatches:
            raise BatchError(f"batch: {rows} rows per data-parallel rank do not split into "
                             f"microbatches={self.microbatches} (the plan's micro-batch count)")
        mb = rows // self.microbatches
        self._rows = (index * rows, mb, rows * size)
        schedule = self._schedule(mb, x.shape[1])
        for replica in self.replicas.values():  # its copied containers keep the mode they had at apply
            replica.train()
        state = rng.get_state() if rng.is_active() else None
        if state is not None and not self.cuts.counted:
            # the stages' draws were counted as 0: every step would redraw the first step's
            # dropout masks, and every stage its neighbours' (review)
            raise PipelineError("executor.rng was seeded after executor.apply (by manual_seed, or by "
                                "executor.load restoring a seeded run): under a pipeline plan apply counts "
                                "each stage's random draws, which needs the seed; call "
                                "executor.rng.manual_seed before executor.apply")
        self._base = state["counter"] if state is not None else 0
        losses: list[torch.Tensor] = []
        first, last = 0 in self.replicas, len(self.cuts.stages) - 1 in self.replicas
        pending = self.grads.begin()
        try:
            schedule.step(*((x,) if first else ()), **({"target": y, "losses": losses} if last else {}))
        except BaseException:
            self.grads.abort(pending)
            if state is not None:
                rng.set_state(state)
            raise
        if state is not None:  # every rank ends where one device's step ends
            rng.set_state({"seed": state["seed"], "counter": self._base + self.cuts.draws})
        return loss_only(self.grads.end(self._step_loss(losses, size)),
                         "a pipeline's training step keeps no logits (they stay on the last stage's ranks); "
                         "to evaluate, load a checkpoint under a plan without pipeline stages "
                         "(docs/executor.md, Pipeline parallelism)")

    def _refuse(self, input_ids: torch.Tensor | None, labels: torch.Tensor | None, kwargs: dict) -> None:
        if input_ids is None or labels is None:
            missing = "input_ids" if input_ids is None else "labels"
            raise PipelineError(
                f"{missing}: under a pipeline plan the model's forward runs a whole training step "
                "(forward and backward of every micro-batch, as the schedule interleaves them), "
                "so it needs input_ids= and labels=; forward-only calls are not supported")
        extra = sorted(k for k, v in kwargs.items() if v is not None and k not in _IGNORED_KWARGS)
        if extra:
            raise PipelineError(f"{extra[0]}: not passed between pipeline stages; the pipelined forward "
                                "takes input_ids= and labels= only")
        if problem := _batch_problem(input_ids, labels, self.vocab):
            raise BatchError(problem)
        if not torch.is_grad_enabled():
            mode = "torch.inference_mode" if torch.is_inference_mode_enabled() else "torch.no_grad"
            raise PipelineError(f"{mode}: a pipelined forward runs backward too; call it with grad enabled")
        if not self.model.training:
            raise PipelineError("model.eval(): under a pipeline plan the forward runs a training step (its "
                                "backward too), so evaluation is not supported; call model.train(), and "
                                "evaluate a checkpoint (executor.save) loaded under a plan without pipeline stages")
        frozen = next((name for name, m in self.model.named_modules() if not m.training), None)
        if frozen is not None:
            raise PipelineError(f"{frozen}: in eval mode while the model trains; under a pipeline plan every "
                                "module trains (each stage's random draws were counted with all modules "
                                "training, and the schedule runs a stage in one mode), so a submodule frozen "
                                "in eval mode is not supported; call model.train() (requires_grad_(False) "
                                "freezes weights without eval mode)")

    def _schedule(self, mb: int, seq: int) -> Any:
        """The schedule for micro-batches of ``mb`` x ``seq`` tokens (stages are static-shaped)."""
        if self._built is not None and self._built[0] == (mb, seq):
            return self._built[1]
        n = len(self.cuts.stages)
        stages = []
        for s, replica in self.replicas.items():
            given = self.cuts.inputs[s]
            inputs = torch.empty(mb, seq, dtype=torch.long, device="meta") if given is None else given.meta(mb, seq)
            after = self.cuts.inputs[s + 1] if s + 1 < n else self.logits
            stages.append(_Stage(self._draws, replica, s, n, self.device, input_args=(inputs,),
                                 output_args=(after.meta(mb, seq),), group=self.group))
        cls = _SCHEDULES[self.schedule_name]
        schedule = cls(stages if cls is ScheduleInterleaved1F1B else stages[0], self.microbatches,
                       loss_fn=self.loss_fn, scale_grads=False)
        self._built = ((mb, seq), schedule)
        return schedule

    @contextmanager
    def _draws(self, stage: int, microbatch: int) -> Iterator[None]:
        """Stage ``stage``'s forward of ``microbatch``: one device's counter, its rows."""
        if rng.is_active():
            seed = rng.get_state()["seed"]
            rng.set_state({"seed": seed, "counter": self._base + self.cuts.draws_before[stage]})
        start, mb, total = self._rows
        torch.clear_autocast_cache()  # FSDP2 refills its weights per micro-batch (apply's root hook says why)
        with rng.batch_rows(start + microbatch * mb, mb, total):
            yield

    def _step_loss(self, losses: list[torch.Tensor], dp_size: int) -> torch.Tensor:
        """The sum of the last stage's micro-batch losses (each over the global token count
        / dp), on every rank, averaged over data parallel: the global mean token loss."""
        value = torch.stack([t.detach() for t in losses]).sum() if losses else torch.zeros((), device=self.device)
        value = value.to(self.device, torch.float32)
        dist.all_reduce(value, group=self.group)  # only the last stage's rank adds a non-zero
        if self.batch is not None:
            for g in self.batch.groups:
                dist.all_reduce(value, group=g)  # SUM: gloo has no AVG
            value = value / dp_size
        return value
