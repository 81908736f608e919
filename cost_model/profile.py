"""Hardware profiles: the only place machine constants live.

A profile is plain, validated data so that users can ship their own (a JSON file
or an inline dict in an HTTP request) and get a pydantic error naming the exact
field when a number is wrong, instead of a silently absurd plan.
"""

from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, get_args

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

# A rate, FLOP/s or B/s: at least 1e6.  Any device or link of the last decades is faster;
# one near the smallest float (1e-308) made a step's price overflow to inf, which the ILP
# cannot take (a 500 over HTTP).
Rate = Annotated[float, Field(ge=1e6)]
# An efficiency: at least 1e-6 for the same reason (a rate times it is at least 1 per second).
Fraction = Annotated[float, Field(ge=1e-6, le=1)]

COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
# The dtype names peak_flops may use: a misspelt one (bf61, fp9) was taken and never read,
# so the peak it meant to give was silently missing (audit).  The planner reads fp32 and
# bf16; the rest are the other figures a datasheet gives.
Dtype = Literal["fp64", "fp32", "tf32", "bf16", "fp16", "fp8", "fp4", "int8"]
_PRINTABLE = r"^[^\x00-\x1f\x7f]+$"  # names are printed in one-line notes and tables


class _Strict(BaseModel):
    # a number a profile gives must be finite: JSON reads 1e400 as inf, which the bounds
    # let through and the ILP then refuses with an error naming no field; and a number:
    # memory_bytes true read as 1 byte, "6319125504" as a number (strict; review)
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _whole_floats_are_ints(cls, data: Any) -> Any:
        """JSON has one number type: a Python client's ``80e9`` arrives as 80000000000.0,
        which strict int fields refuse; a whole float there is taken as its int."""
        if not isinstance(data, dict):
            return data
        ints = {name for name, f in cls.model_fields.items()
                if f.annotation is int or (int in get_args(f.annotation) and float not in get_args(f.annotation))}
        return {k: int(v) if k in ints and isinstance(v, float) and v.is_integer() else v for k, v in data.items()}


class CollectiveBandwidth(_Strict):
    """Achieved nccl-tests *bus* bandwidth per collective kind, bytes/s per rank.

    Bus bandwidth (not algorithm bandwidth) is used because it is independent of
    the group size for ring algorithms, so one number per kind covers every
    mesh-dim size (see cost_model.comm for the f(n) factors).
    """

    all_reduce: Rate = Field(description="all-reduce bus bandwidth, B/s")
    all_gather: Rate = Field(description="all-gather bus bandwidth, B/s")
    reduce_scatter: Rate = Field(description="reduce-scatter bus bandwidth, B/s")
    all_to_all: Rate = Field(description="all-to-all bus bandwidth, B/s")
    send_recv: Rate = Field(description="point-to-point bandwidth of one pair, B/s")


class CollectiveLatency(_Strict):
    """Fixed cost of one collective per kind, s (gloo's algorithms differ per kind)."""

    all_reduce: float = Field(ge=0, description="all-reduce latency, s")
    all_gather: float = Field(ge=0, description="all-gather latency, s")
    reduce_scatter: float = Field(ge=0, description="reduce-scatter latency, s")
    all_to_all: float = Field(ge=0, description="all-to-all latency, s")
    send_recv: float = Field(ge=0, description="point-to-point latency of one pair, s")


_Sized = TypeVar("_Sized", bound="GroupFit | GroupSync")


def _distinct_sizes(groups: list[_Sized]) -> list[_Sized]:
    """Measured group sizes, each at most once: the constants are looked up by size."""
    sizes = [g.size for g in groups]
    if len(sizes) != len(set(sizes)):
        raise ValueError(f"group sizes must be distinct, got {sizes}")
    return groups


class GroupFit(_Strict):
    """Latency and bus bandwidth measured for one group size at this level.

    Bus bandwidth is size-independent only for a ring on dedicated links; processes
    sharing cores (or a switch's arbitration) make both constants depend on how many
    ranks take part, so a calibration records them per measured group size.
    """

    size: int = Field(ge=2, description="ranks in the group these constants were measured with")
    latency_s: CollectiveLatency = Field(description="fixed cost per collective kind, s")
    busbw: CollectiveBandwidth = Field(description="bus bandwidth per collective kind, B/s")


class NetworkLevel(_Strict):
    """One level of the network hierarchy (NVLink inside a node, InfiniBand across).

    ``latency_s`` and ``busbw`` hold for any group size; ``groups`` may override
    them for the group sizes a calibration measured (see cost_model.comm).
    """

    name: str = Field(min_length=1, max_length=255, pattern=_PRINTABLE, description="label, e.g. nvlink, ib, loopback")
    devices: int | None = Field(
        ge=1,
        description="devices reachable at this level (8 for an 8-GPU node); "
        "null on the outermost level means any number",
    )
    busbw: CollectiveBandwidth = Field(description="achieved bus bandwidth per collective kind")
    latency_s: float = Field(ge=0, description="fixed cost of one collective at this level, s")
    groups: Annotated[list[GroupFit], AfterValidator(_distinct_sizes)] = Field(
        default_factory=list,
        description="measured constants per group size; a phase among `size` members uses "
        "them instead of latency_s / busbw, and so does one among more members, up to the next "
        "measured size",
    )


class GemmPoint(_Strict):
    flops: float = Field(ge=1, description="FLOPs of one GEMM (2*m*n*k)")
    efficiency: Fraction = Field(description="achievable fraction of peak at that size")


class AttentionPoint(_Strict):
    head_flops: float = Field(ge=1, description="forward FLOPs of fused attention per (sequence, head) pair")
    efficiency: Fraction = Field(description="achievable fraction of peak there, forward and backward")


class ColumnPoint(_Strict):
    columns: int = Field(gt=0, description="columns of a GEMM's output")
    factor: Fraction = Field(description="its speed against a GEMM of as many FLOPs with wide outputs")


class FsdpOverhead(_Strict):
    """Host time FSDP2 adds to one micro-batch's forward + backward, per mode: its hooks
    and buffer bookkeeping per unit, and copies of the unit's parameters and gradients
    into and out of the collectives' flat buffers per byte.  A CPU runs it on the cores
    the compute uses; a GPU host issues it beside the kernels (not set there), and the
    copies are kernels priced from their bytes (cost_model.step.fsdp_copy_time)."""

    unit_s: float = Field(ge=0, description="per FSDP2 unit (a layer, the root), s")
    byte_s: float = Field(ge=0, description="per byte of the unit's unsharded parameters, s")


class SyncPoint(_Strict):
    compute_s: float = Field(ge=0, description="compute before each collective (the ranks' mean), s")
    added_s: float = Field(ge=0, description="what a 4-byte all-reduce among the group then adds, "
                           "timed as calibrate times collectives, s")


class GroupSync(_Strict):
    """What synchronising a group costs by the compute before it, for one group size.

    Ranks that share cores drift apart while they compute, so a collective after a long
    stretch waits longer for its group's slowest rank than one right after another
    collective, and while it waits other ranks may use its core.  Measured as calibrate
    times collectives (what one adds to the slowest rank's loop of compute chunks), with
    the compute's length varied: a 4-byte all-reduce, all synchronisation and no
    transfer, after 0, 1, 4 and 12 chunks, every group at once.  The collectives' fitted
    constants hold the point at one chunk (``held_s``), so a collective after ``s`` of
    compute costs ``added(s) - held_s`` beyond its price
    (``cost_model.comm.sync_correction``; docs/cost_model.md, Step composition).
    """

    size: int = Field(ge=2, description="ranks in the group these points were measured with")
    held_s: float = Field(ge=0, description="added_s after calibrate's own chunk: what the "
                          "collectives' fitted constants hold of it, s")
    points: list[SyncPoint] = Field(min_length=2, description="by compute_s, from 0; interpolated "
                                    "linearly, held at the last point's beyond it")

    @field_validator("points")
    @classmethod
    def _sorted(cls, points: list[SyncPoint]) -> list[SyncPoint]:
        xs = [p.compute_s for p in points]
        if xs != sorted(set(xs)) or xs[0] != 0:
            raise ValueError("points must start at compute_s 0 and have strictly increasing compute_s")
        return points


class Profile(_Strict):
    """Per-device compute and memory plus the network, innermost level first."""

    name: str = Field(min_length=1, max_length=255, pattern=_PRINTABLE,
                      description="profile name, e.g. h100-sxm-80g (calibrate: the output file's stem)")
    source: str = Field(default="", description="where the numbers come from")
    device_type: Literal["cuda", "cpu"] = Field(description="torch device type")
    peak_flops: dict[Dtype, Rate] = Field(
        min_length=1, description=f"dense peak FLOP/s per dtype name ({', '.join(get_args(Dtype))})"
    )
    gemm_efficiency: list[GemmPoint] = Field(
        min_length=1,
        description="achievable fraction of peak by GEMM size; interpolated in log(FLOPs), "
        "clamped at both ends",
    )
    memory_bytes: int = Field(gt=0, description="memory capacity per device, bytes")
    memory_bandwidth: Rate = Field(description="peak memory bandwidth per device, B/s")
    memory_efficiency: Fraction = Field(description="achievable fraction of memory_bandwidth")
    update_bandwidth: Rate | None = Field(
        default=None,
        description="B/s the optimizer's per-tensor update achieves per device (torch's AdamW "
        "over parameters of 2^20 elements: lerp_, addcmul_, sqrt, div, addcdiv_ read two or "
        "three tensors, and sqrt and div allocate theirs); None: memory_efficiency x "
        "memory_bandwidth (GPU profiles: the foreach kernels stream at HBM speed)",
    )
    kernel_floor_s: float = Field(
        ge=0,
        description="host time to issue one eager op that runs a kernel (dispatcher + "
        "launch), s; the least any non-free op takes",
    )
    dtensor_op_overhead_s: float = Field(
        default=0.0,
        ge=0,
        description="extra host time per op whose operands are DTensors (sharding "
        "propagation, unwrapping and rewrapping), s",
    )
    dtensor_redistribute_s: float = Field(
        default=0.0,
        ge=0,
        description="extra host time per collective that DTensor issues (a redistribution "
        "step, forward or backward: transform planning, the Redistribute autograd "
        "function, functional-collective wrapping and waiting), over the same collective "
        "called through torch.distributed, s. On a CPU the rank's only thread pays it; 0: "
        "not measured (a GPU host issues it beside the device's work)",
    )
    fresh_page_byte_s: float = Field(
        default=0.0,
        ge=0,
        description="host time per byte of an allocation that gets fresh pages from the "
        "operating system: a page fault, zeroing and mapping per 4 KiB page on first touch, "
        "unmapping on free, s. On a CPU it costs ~7x writing the same bytes to reused "
        "memory; 0: not measured (a GPU's caching allocator reuses its blocks)",
    )
    fresh_alloc_bytes: int | None = Field(
        default=None,
        gt=0,
        description="allocations at least this large get fresh pages on every call (glibc "
        "serves them with mmap from its M_MMAP_THRESHOLD, whose dynamic value stops at 32 "
        "MiB on 64-bit Linux, and unmaps them on free; smaller ones reuse the heap, unless "
        "glibc has trimmed it meanwhile, which is not modelled); None: no allocation does",
    )
    gemm_columns: list[ColumnPoint] | None = Field(
        default=None,
        description="slowdown of GEMMs with narrow outputs, by the output's column count "
        "(a tensor-parallel shard's): multiplies gemm_efficiency, interpolated in "
        "log(columns), 1 from the last point on; None: none (GPU profiles: unmeasured)",
    )
    attention_efficiency: Fraction | None = Field(
        default=None,
        description="achievable fraction of peak_flops for fused attention "
        "(scaled_dot_product_attention), forward and backward; None: the GEMM curve. "
        "CPU flash attention runs at ~1/4 of the GEMM rate (small blocks, exp per score)",
    )
    attention_curve: list[AttentionPoint] | None = Field(
        default=None,
        description="achievable fraction of peak_flops for fused attention by its forward "
        "FLOPs per (sequence, head) pair, forward and backward; interpolated in log(FLOPs), "
        "clamped at both ends; used instead of attention_efficiency.  CPU flash attention's "
        "rate grows with the work per head (4 ranks at once: 8-10 GFLOP/s at sequence 128 "
        "and head dim 32, 15 at 256 and 64, 25 at 1024 and 128); None: unmeasured",
    )
    node_host_s: float | None = Field(
        default=None,
        ge=0,
        description="eager host time per traced graph node, forward + backward, s: Python "
        "module code, dispatch, autograd's backward nodes, views, gradient accumulation, "
        "measured on a model too small to compute; on a CPU it replaces kernel_floor_s "
        "for the model's ops (half each way, views included). None: kernel_floor_s per op",
    )
    dtensor_node_host_s: float | None = Field(
        default=None,
        ge=0,
        description="extra eager host time per traced graph node downstream of the embedding "
        "(the ones that run on DTensors), forward + backward, when "
        "the executor runs the activations as DTensors (a model-parallel mesh dim): "
        "DTensor's dispatch of the op and its backward, the executor's conversions at "
        "module boundaries; measured on a tiny tensor-parallel Llama whose collectives are "
        "no-ops (redistributions: dtensor_redistribute_s). Used with node_host_s; None: "
        "dtensor_op_overhead_s per op each way",
    )
    fsdp_overhead: dict[Literal["replicate", "fully_shard"], FsdpOverhead] = Field(
        default_factory=dict,
        description="host time FSDP2 adds per micro-batch, by data-parallel mode "
        "(replicate runs as HSDP); a mode left out adds none",
    )
    transcendental_rate: Rate | None = Field(
        default=None,
        description="exp/log/tanh evaluations per second per device (softmax, SiLU, the "
        "loss's log-softmax); an op takes at least its evaluations over this rate. "
        "None: never the bound (GPU special-function units outrun HBM on elementwise ops)",
    )
    overlap_exposure: float = Field(
        default=0.0,
        ge=0,
        le=4,
        description="step seconds one second of an FSDP2 all-gather or gradient reduction adds "
        "when it is issued beside compute: 0 = fully hidden (GPUs: FSDP2 runs them on CUDA "
        "streams of their own, the network on its own engines), 1 = serialised (CPUs: FSDP2 "
        "issues them synchronously, so the rank waits in each; what `meshplan calibrate` "
        "writes), above 1 = the contention also slows the compute; default 0 on a cuda "
        "profile, 1 on a cpu one",
    )
    levels: list[NetworkLevel] = Field(min_length=1, description="network levels, innermost first")
    sync_cost: Annotated[list[GroupSync], AfterValidator(_distinct_sizes)] = Field(
        default_factory=list,
        description="what synchronising a group costs a step by the compute before the "
        "collective, per measured group size (a group uses the largest measured size not "
        "above its own, the smallest below them all); each blocking collective is charged "
        "the difference from what its calibrated price holds. Empty: no correction (GPU "
        "profiles: a rank per device, nothing shares its cores)",
    )

    @field_validator("gemm_efficiency", "attention_curve", "gemm_columns")
    @classmethod
    def _sorted_points(cls, points: list[Any] | None, info: ValidationInfo) -> list[Any] | None:
        """A curve's points in strictly increasing order of what interpolation indexes."""
        key = {"gemm_efficiency": "flops", "attention_curve": "head_flops", "gemm_columns": "columns"}[info.field_name]
        if points is not None:
            xs = [getattr(p, key) for p in points]
            if not xs or xs != sorted(set(xs)):
                raise ValueError(f"points must have strictly increasing {key}")
        return points

    @model_validator(mode="before")
    @classmethod
    def _cpu_exposure(cls, data: Any) -> Any:
        """A CPU profile that gives no ``overlap_exposure`` exposes FSDP2's collectives in
        full: FSDP2 issues them synchronously there (no streams to overlap them on)."""
        if isinstance(data, dict) and data.get("device_type") == "cpu" and "overlap_exposure" not in data:
            return {**data, "overlap_exposure": 1.0}
        return data

    @model_validator(mode="after")
    def _nested_levels(self) -> Profile:
        # Hierarchical costing assumes each level groups whole units of the level inside it.
        prev = 1
        for i, level in enumerate(self.levels):
            if level.devices is None:
                if i != len(self.levels) - 1:
                    raise ValueError(f"levels.{i}.devices: only the outermost level may be null")
                continue
            if (i > 0 and level.devices <= prev) or level.devices % prev:
                raise ValueError(
                    f"levels.{i}.devices: {level.devices} must be a larger multiple of the "
                    f"level inside it ({prev})"
                )
            prev = level.devices
        return self

    @property
    def max_devices(self) -> int | None:
        """Largest cluster the profile describes (None = unbounded)."""
        return self.levels[-1].devices


def _shipped_dir() -> Path:
    return Path(str(resources.files("profiles")))


def shipped_profiles() -> list[str]:
    """Names of the profiles shipped in the ``profiles`` package."""
    return sorted(p.stem for p in _shipped_dir().glob("*.json"))


def load_profile(spec: str | Path | dict | Profile, allow_paths: bool = True) -> Profile:
    """A profile from a shipped name, a JSON file path, an inline dict or a Profile.

    Raises ValueError with the shipped names when a string is neither a shipped
    name nor (with ``allow_paths``) an existing file, and pydantic's
    ValidationError (which names the field) for malformed content.  Services
    pass ``allow_paths=False`` so a request cannot make the server read its files.
    """
    if isinstance(spec, Profile):
        return _own_name(spec)
    if isinstance(spec, dict):
        return _own_name(Profile.model_validate(spec))
    if not isinstance(spec, (str, Path)):
        raise TypeError(
            f"profile: expected a name, path, dict or Profile, got {type(spec).__name__}"
        )
    shipped = shipped_profiles()
    if isinstance(spec, str) and spec in shipped:
        path = _shipped_dir() / f"{spec}.json"
    elif allow_paths and Path(spec).is_file():
        path = Path(spec)
    else:
        kind = "a shipped profile nor a JSON file" if allow_paths else "a shipped profile"
        raise ValueError(
            f"profile: {str(spec)!r} is neither {kind}; shipped profiles: {', '.join(shipped)}"
        )
    try:
        data = path.read_bytes()
    except OSError as e:  # no permission, /proc/self/mem (a traceback from the CLI before)
        raise ValueError(f"profile: cannot read {str(spec)!r}: {e.strerror or e}") from None
    # pydantic reports malformed JSON (bytes that are not UTF-8 too) and bad values as a
    # ValidationError naming the field.
    profile = Profile.model_validate_json(data)
    return profile if path.parent == _shipped_dir() else _own_name(profile)


@functools.cache
def shipped_profile(name: str) -> Profile:
    """Shipped profile ``name``, read once per process (the package's files do not change
    while it runs); shared, so callers must not change it (``load_profile`` gives a copy
    of one's own)."""
    return load_profile(name)


def _own_name(profile: Profile) -> Profile:
    """``profile``, unless it carries a shipped profile's name with other numbers: a plan
    records its profile by name only, so it would read as planned for that hardware (a
    copy of h100-sxm-80g with 1 TiB of memory planned a layout needing 130 GiB per device
    as "h100-sxm-80g ... fits")."""
    if profile.name in shipped_profiles() and profile != shipped_profile(profile.name):
        raise ValueError(f"profile.name: {profile.name!r} is a shipped profile's name, but the numbers "
                         "differ from it; give the profile a name of its own")
    return profile


ECHO_CHARS = 64


def shown(text: str, quote: bool = False) -> str:
    """``text`` (a name or key a user gave) as an error message echoes it: whole when
    short, else its first ``ECHO_CHARS`` characters and its length.  Echoed whole, a
    900 kB preset name or key made a 900 kB answer (audit)."""
    show = repr if quote else str
    if len(text) <= ECHO_CHARS:
        return show(text)
    return f"{show(text[:ECHO_CHARS])}... ({len(text)} characters)"


def problem_lines(error: ValidationError, data: object = None) -> list[str]:
    """pydantic's errors as ``field.path: problem`` lines, the form docs/cost_model.md
    promises (``levels.0.busbw.all_reduce: Input should be greater than 0``).  The raw
    ``str(error)`` spreads each problem over lines with a URL, which neither an HTTP
    ``detail`` nor a one-line CLI error can carry; callers prefix where the profile came
    from.  A model validator's message already names its field (``levels.1.devices: ...``),
    so an error without a location is taken as is.  With ``data``, the input that failed,
    an error inside an entry of a list that names itself (a plan's parameter ``fqn`` or
    ``module``) leads with that name: ``parameters.3.placements.0`` alone left a user
    counting through hundreds of entries (audit)."""
    lines = []
    for e in error.errors(include_url=False):
        problem = e["msg"].removeprefix("Value error, ")
        # "[key]": pydantic's mark on a dict key's own error (peak_flops.fp9.[key]: fp9 is wrong)
        where = ".".join(shown(str(part)) for part in e["loc"] if part != "[key]")
        name = _entry_name(data, e["loc"])
        lines.append(f"{shown(name)} ({where}): {problem}" if name else f"{where}: {problem}" if where else problem)
    return lines


def _entry_name(data: object, loc: tuple[int | str, ...]) -> str | None:
    """The ``fqn`` or ``module`` of the entry ``data[loc[0]][loc[1]]``, where there is one."""
    if len(loc) < 2 or not isinstance(data, dict) or not isinstance(loc[1], int):
        return None
    entries = data.get(loc[0])
    entry = entries[loc[1]] if isinstance(entries, list) and loc[1] < len(entries) else None
    name = entry.get("fqn", entry.get("module")) if isinstance(entry, dict) else None
    return name if isinstance(name, str) else None
