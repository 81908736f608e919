"""Communication time: collectives along one mesh dim, and DTensor redistributions.

Collectives use the nccl-tests bus-bandwidth model, costed hierarchically.

Model: ``t = latency + S * f(n) / busbw`` per network level (nccl-tests
definitions, measured rather than line-rate busbw).  ``S`` ("size" in
nccl-tests) is, per rank:

* all_reduce: the buffer being reduced (input = output size);
* all_gather: the gathered *output* (n times the local input);
* reduce_scatter: the *input* to be scattered (n times the local output);
* all_to_all: the whole send buffer of one rank (= its receive buffer);
* send_recv: the message one rank sends.

A level's ``groups`` (written by ``meshplan calibrate``) override its latency and
busbw for a phase among that many members; among a number no group measured, the
group of the most members below it does (see ``_alpha_beta``).

On a CPU profile gloo's all-gather and reduce-scatter also pay ``staging_time``: both
run through a flat buffer of the whole ``S`` that ProcessGroupGloo allocates per call
(``newLikeFlat``: the all-gather gathers into it and copies out, the reduce-scatter
reduces a copy of its input), and from the profile's ``fresh_alloc_bytes`` up that
buffer gets fresh pages every call.  Measured on 4 ranks here: calls of 64 MB fault in
exactly ``S`` bytes, of 32-40 MB most of it (the model charges all of ``S`` from 32
MiB), of 8-24 MB almost none; all-reduce, all-to-all and send/recv none at any size; a
64 MB all-gather then takes ~2x what the latency and bandwidth fit of the smaller sizes
predicts.  Staging is gloo's (NCCL writes into the caller's buffers); the fresh pages of
the tensors DTensor itself allocates are charged wherever the profile sets
``fresh_page_byte_s``.

A group that spans several levels is costed hierarchically, one phase per level,
innermost first: the phase at level ``l`` runs among the ``k_l`` group members
that differ only at that level, on ``S / g_{l-1}`` bytes, where ``g_{l-1}`` is
the number of members inside one unit of the level below (the inner phases
already reduced/split the data by that factor).  All-to-all does not shrink
like that (each rank's traffic to remote peers is ``S*(n-g)/n`` whatever the
inner phase did), and its intra- and inter-level transfers proceed in parallel,
so its time is the slowest level's transfer plus the outermost latency.

Redistribution (``redistribute_time`` forward, ``redistribute_cost`` both directions)
-------------------------------------------------------------------------------------
We replay the transition sequence DTensor itself runs (the greedy planner in
``torch/distributed/tensor/_redistribute.py``, ``generate_greedy_transform_infos``)
rather than inventing one, so a plan is charged for the collectives the
executor will actually issue.  Each per-mesh-dim step is then costed with the
collective it lowers to (``redistribute_local_tensor``):

=========  =====================================  =================================
step       collective                             ``nbytes`` passed (local = before)
=========  =====================================  =================================
P -> R     all_reduce                             local bytes
P -> S(d)  reduce_scatter                         local bytes
S(d) -> R  all_gather                             local bytes * n
S(i)->S(j) all_to_all (CPU: all_gather + chunk)   local bytes (CPU: local bytes * n)
R -> S(d)  local chunk + clone (memory traffic)   -
R -> P     local divide (sum partial: v / n)      -
S -> P     unsupported by DTensor                 ValueError
=========  =====================================  =================================

Each collective step also costs the profile's ``dtensor_redistribute_s``: the host time
DTensor spends around the collective beyond the ``torch.distributed`` call the
collective constants were calibrated on (0 in the GPU profiles), and the fresh pages of
the new tensor it returns where that is at least ``fresh_alloc_bytes`` (calibration's
collectives reuse their output buffers).

Backward: DTensor's ``Redistribute.backward`` redistributes the gradient, which
arrives in the forward's *destination* placements, back to the *source*
placements, except that a source ``P`` becomes ``R`` when the gradient is ``S``
or ``R`` there (``_redistribute_backward``: keeping grads replicate is cheaper
than partial).  ``redistribute_cost`` returns both directions.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cost_model.compute import fresh_pages_time, op_time
from cost_model.profile import COLLECTIVE_KINDS, NetworkLevel, Profile


def bus_factor(kind: str, n: int) -> float:
    """nccl-tests busbw/algbw factor f(n) for ``n`` ranks."""
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"kind: unknown collective {kind!r}; expected one of {COLLECTIVE_KINDS}")
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind == "send_recv":
        return 1.0
    return (n - 1) / n


GLOO_STAGED = ("all_gather", "reduce_scatter")  # through a new flat buffer of S per call


def staging_time(profile: Profile, kind: str, nbytes: float) -> float:
    """Seconds the fresh pages of gloo's per-call staging buffer add to one ``kind``
    collective of ``nbytes`` (module doc); 0 off CPU profiles."""
    if profile.device_type != "cpu" or kind not in GLOO_STAGED:
        return 0.0
    return fresh_pages_time(nbytes, profile.fresh_page_byte_s, profile.fresh_alloc_bytes)


def _alpha_beta(level: NetworkLevel, kind: str, k: int) -> tuple[float, float]:
    """(latency s, busbw B/s) of ``kind`` among ``k`` members at ``level``.

    A calibration's constants win over the level's size-independent ones: where ranks
    share cores or a link, neither constant is independent of the group size.  Those
    measured with exactly ``k`` ranks, else with the most ranks below ``k``: a group larger
    than any measured costs at least the largest measured one (the bus factor grows with
    ``k``), where the level's fit over all sizes put 5 CPU ranks below 4.
    """
    below = [g for g in level.groups if g.size <= k]
    if below:
        group = max(below, key=lambda g: g.size)
        return getattr(group.latency_s, kind), getattr(group.busbw, kind)
    return level.latency_s, getattr(level.busbw, kind)


@functools.cache
def _members_per_unit(devices: tuple[int | None, ...], mesh_shape: tuple[int, ...], dim: int) -> tuple[int, ...]:
    """For each level (its ``devices`` per unit, None: all), how many members of a group
    of mesh dim ``dim`` share one unit of that level, in the group and unit with fewest.

    Ranks are laid out row-major, so a group's members are ascending and those in one unit
    consecutive.  A group split unevenly (9 ranks on 8-device nodes: 8 + 1; the dp group
    {6, 8, 10} of pp2 x dp3 x tp2 on 12 devices: 1 + 2) has the phase of that level run
    among all of them across the level above: the ring passes its slowest link, and one
    node's worth cannot be reduced first.  (It assumed ``devices // stride`` members per
    unit, full and aligned units, and priced both at NVLink speed.)  numpy counts the
    runs; the result is cached per mesh, since the ILP asks for the same ones many times."""
    n = mesh_shape[dim]
    groups = np.moveaxis(np.arange(math.prod(mesh_shape)).reshape(mesh_shape), dim, -1).reshape(-1, n)
    out = []
    for d in devices:
        if d is None:
            out.append(n)
            continue
        unit = groups // d
        starts = np.ones(unit.shape, dtype=bool)
        starts[:, 1:] = unit[:, 1:] != unit[:, :-1]
        first = np.flatnonzero(starts)
        out.append(int(np.diff(np.append(first, unit.size)).min()))
    return tuple(out)


def _check_mesh(profile: Profile, mesh_shape: Sequence[int], dim: int) -> None:
    if not mesh_shape or any(int(s) < 1 for s in mesh_shape):
        raise ValueError(f"mesh_shape: every dim must be >= 1, got {list(mesh_shape)}")
    if not 0 <= dim < len(mesh_shape):
        raise ValueError(f"dim: {dim} is out of range for mesh_shape {list(mesh_shape)}")
    cap = profile.max_devices
    if cap is not None and math.prod(mesh_shape) > cap:
        raise ValueError(
            f"mesh_shape: {list(mesh_shape)} needs {math.prod(mesh_shape)} devices, "
            f"profile {profile.name!r} describes at most {cap}"
        )


def collective_time(
    profile: Profile,
    kind: str,
    nbytes: float,
    mesh_shape: Sequence[int],
    dim: int,
    latency: bool = True,
) -> float:
    """Seconds for collective ``kind`` of ``nbytes`` (see module doc) over mesh dim ``dim``.

    Ranks are laid out row-major over ``mesh_shape`` (the last dim holds adjacent
    ranks), so mesh dim ``dim`` groups ranks at stride ``prod(mesh_shape[dim+1:])``.
    ``latency=False`` leaves out the fixed costs: for a tensor that travels in a
    bucket with others (FSDP's per-module collectives), whose caller charges
    ``collective_latency`` once per bucket.
    """
    if nbytes < 0:
        raise ValueError(f"nbytes: must be >= 0, got {nbytes}")
    fixed, transfer = _phases(profile, kind, nbytes, mesh_shape, dim)
    if nbytes == 0 or int(mesh_shape[dim]) == 1:
        return 0.0
    return (fixed if latency else 0.0) + transfer + staging_time(profile, kind, nbytes)


def collective_latency(profile: Profile, kind: str, mesh_shape: Sequence[int], dim: int) -> float:
    """The fixed part of ``collective_time``: what one more collective costs, whatever its size."""
    return _phases(profile, kind, 0.0, mesh_shape, dim)[0]


def sync_added(points: Sequence[tuple[float, float]], compute_s: float) -> float:
    """Seconds a group's synchronisation adds after ``compute_s`` of compute, from
    (compute s, added s) points sorted by compute from 0: linear between points, the
    last point's beyond it (a loop of 12 chunks on each side measures the longest
    stretch; past it nothing says how the cost grows)."""
    for (a, ya), (b, yb) in itertools.pairwise(points):
        if compute_s <= b:
            return ya + (yb - ya) * (max(compute_s, 0.0) - a) / (b - a)
    return points[-1][1]


def sync_correction(profile: Profile, group: int, compute_s: float) -> float:
    """Seconds a blocking collective among ``group`` ranks costs beyond ``collective_time``
    when the rank computed ``compute_s`` since its previous collective (any group's).

    Ranks that share cores drift apart while they compute, and a collective first waits
    for its group's slowest rank (session 36 measured those waits in the fidelity bench's
    steps: ~6.5 ms for a group of 4 behind a whole block, ~1.3 ms for a pair right after
    another collective), while other ranks may use its core.  ``Profile.sync_cost`` holds
    what a synchronisation adds by the compute before it, timed as calibrate times the
    collectives; their fitted constants hold ``held_s`` of it, so the correction is the
    difference: positive behind long stretches of compute, negative right after another
    collective.  0 where the profile measured none (GPU profiles) or for a group of 1.
    """
    if not profile.sync_cost or group < 2:
        return 0.0
    below = [g for g in profile.sync_cost if g.size <= group]
    fit = max(below, key=lambda g: g.size) if below else min(profile.sync_cost, key=lambda g: g.size)
    return sync_added([(p.compute_s, p.added_s) for p in fit.points], compute_s) - fit.held_s


def _phases(
    profile: Profile, kind: str, nbytes: float, mesh_shape: Sequence[int], dim: int
) -> tuple[float, float]:
    """(fixed seconds, transfer seconds) of one collective, level by level."""
    _check_mesh(profile, mesh_shape, dim)
    if kind not in COLLECTIVE_KINDS:  # checked before the trivial-group shortcut
        raise ValueError(f"kind: unknown collective {kind!r}; expected one of {COLLECTIVE_KINDS}")
    n = int(mesh_shape[dim])
    if n == 1:
        return 0.0, 0.0
    per_unit = _members_per_unit(tuple(level.devices for level in profile.levels),
                                 tuple(int(s) for s in mesh_shape), dim)

    if kind == "all_to_all":
        slowest, fixed, inner = 0.0, 0.0, 1
        for level, g in zip(profile.levels, per_unit, strict=True):
            if g > inner:
                lat, bw = _alpha_beta(level, kind, g)
                remote = nbytes * (g - inner) / n  # bytes this rank sends over this level
                slowest = max(slowest, remote / bw)
                fixed = lat
            inner = g
            if g == n:
                break
        return fixed, slowest

    if kind == "send_recv":
        # The slowest pair bounds a pipeline: the outermost level the group reaches.
        level = next(lv for lv, g in zip(profile.levels, per_unit, strict=True) if g == n)
        lat, bw = _alpha_beta(level, kind, n)  # n ranks exchanging at once, as calibrated
        return lat, nbytes / bw

    fixed, transfer, inner = 0.0, 0.0, 1
    for level, g in zip(profile.levels, per_unit, strict=True):
        k = math.ceil(g / inner)  # members that differ only at this level (ceil: 6 = 4 + 2)
        if k > 1:
            lat, bw = _alpha_beta(level, kind, k)
            fixed += lat
            transfer += (nbytes / inner) * bus_factor(kind, k) / bw
        inner = g
        if g == n:
            break
    return fixed, transfer


# Same grammar as planner.schema.PLACEMENT_RE; not imported from there because the
# planner imports this module and the cost model must not depend on the planner.
_PLACEMENT = re.compile(r"^(R|P|S\((0|[1-9][0-9]*)\))$")


@dataclass(frozen=True)
class RedistributeCost:
    """Seconds for a redistribution in the forward pass and for its gradient."""

    forward_s: float
    backward_s: float

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


@functools.cache
def _shard_dim(p: str) -> int | None:
    return int(p[2:-1]) if p.startswith("S(") else None


def _check(
    name: str, placements: Sequence[str], mesh_shape: Sequence[int], shape: Sequence[int]
) -> None:
    if len(placements) != len(mesh_shape):
        raise ValueError(
            f"{name}: {len(placements)} placements {list(placements)} for a "
            f"{len(mesh_shape)}-D mesh {list(mesh_shape)}"
        )
    for p in placements:
        if not _PLACEMENT.match(p):
            raise ValueError(f"{name}: {p!r} is not a placement (R, P or S(d))")
        d = _shard_dim(p)
        if d is not None and d >= len(shape):
            raise ValueError(f"{name}: {p} shards dim {d} of a {len(shape)}-D tensor {list(shape)}")


def local_shape(
    mesh_shape: Sequence[int], placements: Sequence[str], shape: Sequence[int]
) -> list[int]:
    """Shape of the largest local shard (ceil division: the most loaded rank sets the time)."""
    out = [int(s) for s in shape]
    for size, p in zip(mesh_shape, placements, strict=True):
        d = _shard_dim(p)
        if d is not None:
            out[d] = math.ceil(out[d] / int(size))
    return out


def transitions(
    mesh_shape: Sequence[int], src: Sequence[str], dst: Sequence[str]
) -> list[tuple[int, str, str]]:
    """(mesh dim, from, to) steps in the order DTensor's greedy planner issues them."""
    return list(_transitions(tuple(int(n) for n in mesh_shape), tuple(src), tuple(dst)))


@functools.cache  # the planner asks for the same few placement pairs thousands of times
def _transitions(
    mesh_shape: tuple[int, ...], src: tuple[str, ...], dst: tuple[str, ...]
) -> tuple[tuple[int, str, str], ...]:
    cur, dst = list(src), list(dst)
    steps: list[tuple[int, str, str]] = []
    ndim = len(cur)
    sharded = (
        math.prod(int(n) for n, p in zip(mesh_shape, src, strict=True) if _shard_dim(p) is not None)
        > 1
    )
    if ndim > 1 and sharded:
        # Inner to outer: undo nested shardings that are misaligned with the target.
        for m in reversed(range(ndim)):
            target = dst[m]
            d = _shard_dim(target)
            if d is not None:
                before_cur = [i for i in range(m) if _shard_dim(cur[i]) == d]
                before_dst = [i for i in range(m) if _shard_dim(dst[i]) == d]
                if before_cur != before_dst:
                    target = "R"
            if cur[m] != target:
                steps.append((m, cur[m], target))
                cur[m] = target
    for m in range(ndim):
        if cur[m] != dst[m]:
            steps.append((m, cur[m], dst[m]))
            cur[m] = dst[m]
    return tuple(steps)


def redistribute_collectives(
    mesh_shape: Sequence[int], src: Sequence[str], dst: Sequence[str], device_type: str = "cuda"
) -> list[tuple[str, int]]:
    """(collective, mesh dim) of each collective a redistribution issues, in order."""
    return [(kind, m) for m, a, b in transitions(mesh_shape, src, dst)
            if int(mesh_shape[m]) > 1 and (kind := step_collective(a, b, device_type)) is not None]


def step_collective(a: str, b: str, device_type: str = "cuda") -> str | None:
    """The collective DTensor issues for one per-mesh-dim step ``a -> b`` (None: local only)."""
    sa, sb = _shard_dim(a), _shard_dim(b)
    if a == "P" and (b == "R" or sb is not None):
        return "all_reduce" if b == "R" else "reduce_scatter"
    if sa is not None and b == "R":
        return "all_gather"
    if sa is not None and sb is not None:  # gloo has no all_to_all for DTensor: gather + chunk
        return "all_gather" if device_type == "cpu" else "all_to_all"
    if a == "R" and (sb is not None or b == "P"):
        return None
    raise ValueError(f"redistribute: {a} -> {b} is not supported by DTensor")


def _step_time(
    profile: Profile, mesh_shape: Sequence[int], m: int, a: str, b: str, local_bytes: float
) -> float:
    n = int(mesh_shape[m])
    if n == 1:  # DTensor skips size-1 dims before looking at the placements
        return 0.0

    def new_tensor(nbytes: float) -> float:  # written once, read once, maybe fresh pages
        return op_time(profile, 0, 2 * nbytes) + fresh_pages_time(
            nbytes, profile.fresh_page_byte_s, profile.fresh_alloc_bytes)

    kind = step_collective(a, b, profile.device_type)
    if kind is None:  # R -> S(d): chunk + clone of 1/n; R -> P: divide the whole tensor
        return new_tensor(local_bytes / (n if b != "P" else 1))
    gathered = kind == "all_gather"
    t = collective_time(profile, kind, local_bytes * n if gathered else local_bytes, mesh_shape, m)
    t += profile.dtensor_redistribute_s  # DTensor's own host work around the collective
    # the functional collective returns a new tensor (the all-reduce's is a clone of its
    # input), written by the collective itself: only its pages can cost beyond the transfer
    out = local_bytes * n if gathered else local_bytes / n if kind == "reduce_scatter" else local_bytes
    t += fresh_pages_time(out, profile.fresh_page_byte_s, profile.fresh_alloc_bytes)
    if gathered and b != "R":  # the CPU all-to-all fallback then keeps one chunk
        t += new_tensor(local_bytes)
    # collectives move dim 0: DTensor gathers a shard of another dim along dim 0 and
    # concatenates the chunks along its own (a copy of the gathered tensor), and lays a
    # Partial tensor's chunks of another dim out along dim 0 before reduce-scattering it
    # (a copy of the input); measured on a TP rank: 8 ms of cat and 7 ms of copies per
    # step around the vocabulary-sharded logits' gather alone
    if gathered and _shard_dim(a) not in (0, None):
        t += new_tensor(local_bytes * n)
    elif kind == "reduce_scatter" and _shard_dim(b) not in (0, None):
        t += new_tensor(local_bytes)
    return t


def redistribute_time(
    profile: Profile,
    mesh_shape: Sequence[int],
    src: Sequence[str],
    dst: Sequence[str],
    shape: Sequence[int],
    itemsize: int,
) -> float:
    """Forward seconds to redistribute a tensor of global ``shape`` from ``src`` to ``dst``."""
    _check("src", src, mesh_shape, shape)
    _check("dst", dst, mesh_shape, shape)
    cur, total = list(src), 0.0
    for m, a, b in transitions(mesh_shape, src, dst):
        local_bytes = math.prod(local_shape(mesh_shape, cur, shape)) * itemsize
        total += _step_time(profile, mesh_shape, m, a, b, local_bytes)
        cur[m] = b
    return total


def backward_placements(src: Sequence[str], dst: Sequence[str]) -> list[str]:
    """Where DTensor sends the gradient of a redistribution from ``src`` to ``dst``."""
    return ["R" if s == "P" and g != "P" else s for s, g in zip(src, dst, strict=True)]


def partial_gradient_target(src: Sequence[str], grad: Sequence[str]) -> list[str]:
    """Where a gradient arriving Partial from column-parallel consumers (``grad``) must go
    for the producer of a tensor redistributed from ``src``: DTensor's backward
    (``backward_placements``), except that a Partial gradient of a Partial output is
    all-reduced too.  DTensor's redistribution leaves it Partial, but the producer's
    backward (the vocabulary-parallel embedding's) cannot take it so, and a real step
    reduces it once: OLMo 2's first layer reads the embedding's output with its q/k/v
    projections, one all-reduce per step that the plan had not priced."""
    return ["R" if p == "P" else p for p in backward_placements(src, grad)]


def redistribute_cost(
    profile: Profile,
    mesh_shape: Sequence[int],
    src: Sequence[str],
    dst: Sequence[str],
    shape: Sequence[int],
    itemsize: int,
    grad_placements: Sequence[str] | None = None,
) -> RedistributeCost:
    """Forward and backward seconds of one redistribution.

    ``grad_placements`` is how the gradient arrives; by default the forward's
    ``dst`` (the usual case; pass the consumer's gradient placements when its
    backward produces e.g. a Partial gradient for a Replicate input).
    """
    grad = list(dst if grad_placements is None else grad_placements)
    _check("grad_placements", grad, mesh_shape, shape)
    forward = redistribute_time(profile, mesh_shape, src, dst, shape, itemsize)
    backward = redistribute_time(
        profile, mesh_shape, grad, backward_placements(src, grad), shape, itemsize
    )
    return RedistributeCost(forward, backward)
