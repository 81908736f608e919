"""The plan: what the planner writes, the service stores and the executor applies.

A plan is plain data (pydantic v2) so that it round-trips exactly through JSON and
has a JSON Schema (`meshplan schema`, or `docs/plan.schema.json`).  Placements are
written the way people read them: ``R`` (replicate), ``S(d)`` (shard tensor dim d),
``P`` (partial sum), one per mesh dim, in mesh-dim order.

Repeated layers are written once with a pattern: ``*`` stands for exactly one
dotted path component (``model.layers.*.mlp.up_proj.weight``).  The most specific
pattern wins when several match (fewest ``*``, then longest).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    WithJsonSchema,
    model_validator,
)

SCHEMA_VERSION = "1.0"

PLACEMENT_RE = r"^(R|P|S\((0|[1-9][0-9]*)\))$"


def _placement(value: str) -> str:
    # a check of our own rather than StringConstraints' pattern, whose error quotes the regex
    # to a user who typed "S(7)x" (audit); the published schema keeps the pattern
    if not re.fullmatch(PLACEMENT_RE, value):
        raise ValueError(f"{value!r} is not a placement: R (replicated), P (partial sums) or S(<dim>) "
                         "(sharded on that tensor dim)")
    return value


Placement = Annotated[str, AfterValidator(_placement), WithJsonSchema({"type": "string", "pattern": PLACEMENT_RE})]
DataParallelMode = Literal["replicate", "fully_shard"]
Checkpointing = Literal["none", "selective", "full"]
Schedule = Literal["gpipe", "1f1b", "interleaved-1f1b"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


def shard_dim(placement: str) -> int | None:
    """The tensor dim of ``S(d)``, else None."""
    return int(placement[2:-1]) if placement.startswith("S(") else None


def pattern_matches(pattern: str, fqn: str) -> bool:
    """``*`` matches exactly one dotted component; everything else literally."""
    p, f = pattern.split("."), fqn.split(".")
    return len(p) == len(f) and all(a == "*" or a == b for a, b in zip(p, f))


def fqn_pattern(fqn: str) -> str:
    """The pattern a parameter of a repeated layer is written under (digits -> ``*``)."""
    return ".".join("*" if part.isdigit() else part for part in fqn.split("."))


def _specificity(pattern: str) -> tuple[int, int]:
    return (-pattern.count("*"), len(pattern))


class MeshDim(_Strict):
    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$", description="dim name: dp, tp, pp, ...")
    size: int = Field(ge=1)


class Mesh(_Strict):
    """Device mesh.  Ranks are laid out row-major: the last dim holds adjacent ranks,
    so it is the one kept inside a node."""

    dims: list[MeshDim] = Field(min_length=1)
    device_type: Literal["cuda", "cpu"] = "cuda"

    @model_validator(mode="after")
    def _unique_names(self) -> Mesh:
        names = [d.name for d in self.dims]
        if len(set(names)) != len(names):
            raise ValueError(f"mesh dim names must be unique, got {names}")
        return self

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(d.size for d in self.dims)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.dims)

    @property
    def devices(self) -> int:
        n = 1
        for d in self.dims:
            n *= d.size
        return n

    def size_of(self, name: str) -> int:
        return next((d.size for d in self.dims if d.name == name), 1)


class ParameterPlacement(_Strict):
    fqn: str = Field(description="parameter FQN or pattern with * per repeated component")
    placements: list[Placement] = Field(description="one placement per mesh dim")


class ModuleLayout(_Strict):
    """Where the plan reshards activations at a module boundary (sequence parallel).

    ``input``: placements the module's first tensor input is redistributed to before
    its forward; ``output``: placements its output is redistributed to after it.
    """

    module: str
    input: list[Placement] | None = None
    output: list[Placement] | None = None


class DataParallelDim(_Strict):
    dim: str
    mode: DataParallelMode


class PipelineStage(_Strict):
    index: int = Field(ge=0)
    modules: list[str] = Field(description="module FQNs this stage runs, in order")
    predicted_time_s: float | None = Field(
        default=None, ge=0,
        description="forward + backward compute and blocking communication of one micro-batch on this "
                    "stage; with virtual stages, its pp rank's time divided by virtual_stages (the split "
                    "balances ranks, so a rank's virtual stages show the same time)")


class Pipeline(_Strict):
    dim: str = "pp"
    schedule: Schedule
    virtual_stages: int = Field(default=1, ge=1, description="stages per pp rank")
    stages: list[PipelineStage] = Field(
        min_length=1,
        description="one per pp rank, or pp x virtual_stages (stage i on pp rank i % pp), in model order")


class TimeBreakdown(_Strict):
    step_time_s: float = Field(ge=0)
    compute_s: float = Field(ge=0)
    recompute_s: float = Field(default=0.0, ge=0,
                               description="the part of compute_s that activation checkpointing recomputes")
    communication_s: float = Field(ge=0, description="all communication, overlapped or not")
    exposed_communication_s: float = Field(ge=0)
    resharding_s: float = Field(default=0.0, ge=0)
    pipeline_bubble_s: float = Field(default=0.0, ge=0)
    optimizer_s: float = Field(default=0.0, ge=0)


def binary_size(n: float, digits: int = 2) -> str:
    """Bytes in the largest binary unit that keeps them at one or more (a tiny model's
    states do not read 0.00 GiB, nor a 70B model's 1179.79 GiB)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.{digits}f} {unit}"
    return f"{n:.0f} B"


class MemoryBreakdown(_Strict):
    """Bytes per device (the most loaded device)."""

    parameters: int = Field(ge=0)
    gradients: int = Field(ge=0)
    optimizer: int = Field(ge=0)
    activations: int = Field(ge=0)
    fsdp_gathered: int = Field(default=0, ge=0, description=(
        "parameters and gradients FSDP2 holds unsharded when the backward starts, on top of the "
        "shards counted above (the root unit's, and a layer computing plus one prefetched)"))
    total: int = Field(ge=0)
    capacity: int = Field(ge=0)
    usable: int | None = Field(default=None, ge=0, description=(
        "bytes a device may hold: the capacity less the headroom the planner keeps for what it "
        "does not count (allocator fragmentation, communication buffers, the runtime); fits is "
        "total <= usable (absent in plans written before it was recorded)"))
    fits: bool


class Prediction(_Strict):
    time: TimeBreakdown
    memory: MemoryBreakdown
    tokens_per_s_per_device: float = Field(ge=0)
    mfu: float = Field(ge=0)


# How an alternative's note ends when the search's time limit came before its mesh was
# priced (service/static/viewer.js tests for the same words).
SKIPPED_BY_TIME_LIMIT = "skipped (time limit)"


class Alternative(_Strict):
    mesh: dict[str, int]
    step_time_s: float | None = Field(description="None when no feasible plan exists")
    peak_memory_bytes: int | None = None
    fits: bool
    note: str = ""

    @property
    def skipped(self) -> bool:
        """The time limit came before this mesh was priced: its ``fits`` says nothing."""
        return self.note.endswith(SKIPPED_BY_TIME_LIMIT)


class SolverStats(_Strict):
    solver: str
    status: str
    variables: int = Field(ge=0)
    constraints: int = Field(ge=0)
    solve_time_s: float = Field(ge=0)
    total_time_s: float = Field(ge=0)
    objective: float
    gap: float | None = Field(default=None, description="relative optimality gap, 0 = optimal")
    unsupported_ops: dict[str, int] = Field(
        default_factory=dict,
        description="aten ops with no sharding rule of their own, priced as element-wise ops in their "
                    "segment's layout (no resharding of their own); count"
    )
    alternatives: list[Alternative] = Field(default_factory=list)
    notes: list[str] = Field(
        default_factory=list,
        description="what the search found worth saying beyond the numbers (the CLI prints them as "
                    "'note:' lines): a forced tp the head counts do not divide, a mesh dim that splits nothing"
    )


class Fingerprint(_Strict):
    """Parameter names and shapes of the planned model, grouped by pattern."""

    params: dict[str, list[int]] = Field(description="pattern -> shape")
    counts: dict[str, int] = Field(description="pattern -> how many parameters it stands for")
    digest: str

    @classmethod
    def of(cls, named_shapes: Iterable[tuple[str, Iterable[int]]]) -> Fingerprint:
        params: dict[str, list[int]] = {}
        counts: dict[str, int] = {}
        for fqn, shape in named_shapes:
            pat, shp = fqn_pattern(fqn), [int(s) for s in shape]
            key = pat if params.get(pat, shp) == shp else fqn  # layers of unequal shape
            params[key] = shp
            counts[key] = counts.get(key, 0) + 1
        body = json.dumps([params, counts], sort_keys=True).encode()
        return cls(params=params, counts=counts, digest=hashlib.sha256(body).hexdigest()[:16])

    def mismatches(self, other: Fingerprint) -> list[str]:
        """Human-readable differences, one per offending parameter pattern, except that the
        patterns of one layer stack counted alike on both sides (a model with fewer layers
        than planned: every pattern of its layers) make one line naming the layers."""
        out = []
        recounted: dict[tuple[str, int, int], list[str]] = {}
        for k in sorted(set(self.params) | set(other.params)):
            if k not in other.params:
                out.append(f"{k}: in the plan, not in the model")
            elif k not in self.params:
                out.append(f"{k}: in the model, not in the plan")
            elif self.params[k] != other.params[k]:
                out.append(f"{k}: plan shape {self.params[k]}, model shape {other.params[k]}")
            elif self.counts[k] != other.counts[k]:
                recounted.setdefault((k.partition("*")[0], self.counts[k], other.counts[k]), []).append(k)
        for (stack, planned, found), keys in recounted.items():
            if len(keys) > 1 and "*" in keys[0]:
                out.append(f"{stack}*: plan has {planned} such layers, model {found} "
                           f"({len(keys)} parameter patterns each)")
            else:
                out += [f"{k}: plan has {planned} such parameters, model {found}" for k in keys]
        return out


@dataclass
class MeshRoles:
    """What a plan asks of each mesh dim: data-parallel (replicate or fully_shard), pipeline,
    or model (tensor / sequence parallel: every other dim of size > 1 and every data dim)."""

    replicate: str | None = None  # data-parallel dim in replicate mode
    shard: str | None = None  # data-parallel dim in fully_shard mode
    model: tuple[str, ...] = ()  # every other dim: tensor/sequence parallel
    pipeline: str | None = None  # the pipeline dim: stages over it, nothing sharded on it

    @property
    def data(self) -> tuple[str, ...]:
        return tuple(d for d in (self.replicate, self.shard) if d)


def plan_data(data: object) -> object:
    """The plan in parsed JSON that is a plan or a saved service response: POST and GET
    ``/v1/plans`` answer ``{"id": ..., "plan": {...}}``, and a plan has a
    ``schema_version`` (a user who saved the response and trained on it got 13
    'Field required' errors; review)."""
    if isinstance(data, dict) and "plan" in data and "schema_version" not in data:
        return data["plan"]
    return data


class Plan(_Strict):
    # required: a plan file without it was read as 1.0 whatever format wrote it (audit);
    # every plan the planner and service ever wrote has it
    schema_version: Literal["1.0"] = Field(description="the plan format's version; a reader refuses others")
    model: str = Field(description="preset name, config path or model class")
    profile: str
    devices: int = Field(ge=1)
    batch_size: int = Field(ge=1, description="global batch in sequences")
    seq_len: int = Field(ge=1)
    mesh: Mesh
    parameters: list[ParameterPlacement]
    modules: list[ModuleLayout] = Field(default_factory=list)
    data_parallel: list[DataParallelDim] = Field(default_factory=list)
    pipeline: Pipeline | None = None
    microbatches: int = Field(default=1, ge=1)
    activation_checkpointing: Checkpointing = "none"
    prediction: Prediction
    fingerprint: Fingerprint
    solver: SolverStats

    @model_validator(mode="after")
    def _consistent(self) -> Plan:
        if self.mesh.devices != self.devices:
            raise ValueError(f"mesh: {self.mesh.shape} has {self.mesh.devices} devices, devices={self.devices}")
        ndim = len(self.mesh.dims)
        for p in self.parameters:
            if len(p.placements) != ndim:
                raise ValueError(f"parameters: {p.fqn} has {len(p.placements)} placements for a {ndim}-D mesh")
            if "P" in p.placements:
                raise ValueError(f"parameters: {p.fqn} cannot be Partial")
        for m in self.modules:
            for pl in (m.input, m.output):
                if pl is not None and len(pl) != ndim:
                    raise ValueError(f"modules: {m.module} has {len(pl)} placements for a {ndim}-D mesh")
        names = set(self.mesh.names)
        listed: set[str] = set()
        for d in self.data_parallel:
            if d.dim not in names:
                raise ValueError(f"data_parallel: unknown mesh dim {d.dim!r}")
            if d.dim in listed:  # refused only per parameter before, as "R on fully_shard dim" (audit)
                raise ValueError(f"data_parallel: mesh dim {d.dim!r} is listed twice")
            listed.add(d.dim)
        if self.pipeline is not None and self.pipeline.dim not in names:
            raise ValueError(f"pipeline.dim: unknown mesh dim {self.pipeline.dim!r}")
        return self

    # -- (de)serialisation ------------------------------------------------------
    def to_json(self, indent: int | None = 2) -> str:
        return self.model_dump_json(indent=indent)

    @classmethod
    def from_json(cls, text: str | bytes) -> Plan:
        """The plan ``to_json`` wrote, or the one a saved service response holds
        (``plan_data``), as ``meshplan show`` reads both."""
        return cls.model_validate(plan_data(json.loads(text)))

    # -- lookups ------------------------------------------------------------------
    def placement_for(self, fqn: str) -> list[str] | None:
        """Placements of parameter ``fqn``: its most specific matching entry."""
        hits = [p for p in self.parameters if pattern_matches(p.fqn, fqn)]
        if not hits:
            return None
        return list(max(hits, key=lambda p: _specificity(p.fqn)).placements)

    def layout_for(self, module: str) -> ModuleLayout | None:
        hits = [m for m in self.modules if pattern_matches(m.module, module)]
        return max(hits, key=lambda m: _specificity(m.module)) if hits else None

    def dp_mode(self, dim: str) -> DataParallelMode | None:
        return next((d.mode for d in self.data_parallel if d.dim == dim), None)

    # -- checks the schema alone cannot make -------------------------------------------
    # They need the parameters' shapes (a model's, or the plan's own fingerprint), so
    # they are methods rather than validators: executor.apply runs them against the
    # model, ``meshplan show`` against the fingerprint, neither importing the other.
    def mesh_roles(self) -> tuple[MeshRoles, list[str]]:
        """Each mesh dim's role, and the problems with them (one line each)."""
        roles, problems = MeshRoles(), []
        names = self.mesh.names
        size = dict(zip(names, self.mesh.shape, strict=True))
        for d in self.data_parallel:
            if size[d.dim] == 1:  # nothing to split or reduce: no FSDP2 wrapping, no hooks
                continue
            role = "replicate" if d.mode == "replicate" else "shard"
            if getattr(roles, role) is not None:
                problems.append(f"data_parallel: more than one {d.mode} dim ({getattr(roles, role)}, {d.dim})")
            setattr(roles, role, d.dim)
        roles.pipeline = self.pipeline.dim if self.pipeline is not None else None
        idle = {d.dim for d in self.data_parallel if size[d.dim] == 1}
        roles.model = tuple(n for n in names if n not in roles.data and n not in idle and n != roles.pipeline)
        order = [names.index(d) for d in roles.data]
        if order != sorted(order) or (roles.model and order and max(order) > names.index(roles.model[0])):
            problems.append(
                f"mesh.dims: data-parallel dims must come first, replicate before fully_shard, got {list(names)}"
            )
        return roles, problems

    def placement_problems(self, fqn: str, shape: tuple[int, ...], placements: list[str],
                           roles: MeshRoles) -> list[str]:
        """Why parameter ``fqn`` of ``shape`` cannot take ``placements`` on this mesh."""
        out = []
        split = [1] * len(shape)  # how many pieces each tensor dim is cut into on the model mesh
        for name, size, p in zip(self.mesh.names, self.mesh.shape, placements, strict=True):
            d = shard_dim(p)
            if d is not None and d >= len(shape):
                out.append(f"{fqn}: {p} on mesh dim {name!r}, but the parameter has {len(shape)} dims")
                continue
            if name == roles.replicate and p != "R":
                out.append(f"{fqn}: {p} on replicate data-parallel dim {name!r}; only R is possible there")
            elif name == roles.shard and d is None:
                out.append(f"{fqn}: {p} on fully_shard dim {name!r}; FSDP shards every parameter, write S(d)")
            elif name == roles.pipeline and p != "R":
                out.append(f"{fqn}: {p} on pipeline dim {name!r}; a stage holds whole parameters, write R")
            elif name in roles.model and d is not None:
                split[d] *= size
        for d, pieces in enumerate(split):
            if shape[d] % pieces:
                out.append(f"{fqn}: dim {d} of size {shape[d]} does not split evenly into {pieces} "
                           "tensor-parallel shards (uneven shards are only supported on fully_shard dims)")
        return out

    def fingerprint_problems(self) -> list[str]:
        """The mesh roles' problems, and each placement written for a full FQN checked
        against that parameter's shape in the plan's own fingerprint (``S(9)`` of a matrix):
        what the schema lets through and ``apply`` would refuse, without the model.  Also a
        fingerprint parameter no entry covers and an entry that covers none (``show``
        drew them with a shape of "?", audit); a per-layer entry covers its pattern's key
        and the other way round."""
        roles, problems = self.mesh_roles()
        keys = list(self.fingerprint.params)

        def covers(entry: str, key: str) -> bool:
            return pattern_matches(entry, key) or pattern_matches(key, entry)

        problems += [f"{key}: no placement in the plan" for key in keys
                     if not any(covers(p.fqn, key) for p in self.parameters)]
        for p in self.parameters:
            shape = self.fingerprint.params.get(p.fqn)
            if shape is not None:
                problems += self.placement_problems(p.fqn, tuple(shape), p.placements, roles)
            elif not any(covers(p.fqn, key) for key in keys):
                problems.append(f"{p.fqn}: matches no parameter of the plan's fingerprint")
        return problems


def plan_json_schema() -> dict:
    return Plan.model_json_schema()
