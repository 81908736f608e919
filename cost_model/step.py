"""Compose per-stage costs into a training-step time with overlap and pipeline bubble.

Assumptions (each is what the executor's runtime does, or a stated simplification):

* Blocking communication (TP/SP collectives, activation resharding, pipeline
  send/recv) sits on the critical path: it is never overlapped.
* Where ranks share cores (a CPU profile's ``sync_cost``), each collective also waits
  for its group's slowest rank, longer the longer the compute since the rank's previous
  collective (``sync_correction_s``, ``planner.timeline``): added to the exposed
  communication, negative where collectives follow one another more closely than
  calibration's.
* FSDP parameter all-gathers (``fsdp_gathers`` per unit and step) are prefetched one
  layer ahead (FSDP2's default forward/backward prefetch): with ``layers`` equal
  units, the first unit's gather is exposed and every later one runs concurrently
  with the previous unit's compute.  What a concurrent collective still costs is the profile's
  ``overlap_exposure`` x (0 on GPUs, where FSDP2 runs them on streams of their own and
  NCCL has its own engines; 1 on a CPU, where FSDP2 has no streams and issues them
  synchronously, so they cannot hide however many cores are free), so exposed =
  c/L + (max(0, c - compute) + x * min(c, compute)) * (L - 1)/L.
* Gradient reduction (reduce-scatter or all-reduce): without a pipeline in every
  micro-batch's backward (``grad_reduce_parts``: ``executor.apply`` runs the parts
  inside the model's call and lets FSDP2 reduce each, as TorchTitan does, so that
  fully sharded gradients stay sharded), overlapped the same way and sharing the
  network with the backward's re-gathers.  Under a pipeline once per step, after the
  stage's last backward (``grad_reduce_overlapped=False``: torch's schedules run every
  backward without the sync and then ``perform_reduce_grad``), exposed in full;
  interleaved 1F1B reduces each virtual stage after its last backward, which may hide
  part of it behind the other's: not modelled.
* Pipeline: step = m * t_max + bubble, bubble = (sum(t) - t_max) / v (Alpa's
  "sum of stages + (m - 1) * slowest", GPipe and 1F1B alike; interleaving with
  v virtual stages per rank divides the fill/drain by v, Narayanan et al. 2021).
* The optimizer step runs after everything, per device, unoverlapped, including the
  reductions of gradients left Partial (``partial_grad_time``).

``step_time_s = compute_s + exposed_communication_s + pipeline_bubble_s + optimizer_s``;
``resharding_s`` is the blocking part of ``exposed_communication_s``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from cost_model.comm import collective_latency, collective_time
from cost_model.compute import op_time
from cost_model.memory import Schedule, model_state_bytes, state_bytes_per_param
from cost_model.profile import Profile


@dataclass(frozen=True)
class StageCost:
    """One pipeline stage (the whole model when pp = 1) on one device, per micro-batch."""

    forward_compute_s: float
    backward_compute_s: float  # including activation recomputation
    recompute_s: float = 0.0  # the recomputation alone
    blocking_comm_s: float = 0.0  # TP/SP collectives + resharding, forward and backward
    gather_forward_s: float = 0.0  # FSDP parameter all-gathers in the forward
    gather_backward_s: float = 0.0  # re-gathers in the backward (reshard_after_forward)
    p2p_s: float = 0.0  # pipeline send/recv of activations and their gradients
    grad_reduce_s: float = 0.0  # gradient reduce-scatter / all-reduce per step
    grad_reduce_parts: int = 1  # micro-batches it runs in: 1 = the last one's, m = each one's
    grad_reduce_overlapped: bool = True  # behind the backward (False: after it, a pipeline's)
    optimizer_s: float = 0.0  # optimizer step, once per step
    layers: int = 1  # equal units that FSDP prefetch pipelines over
    overlap_exposure: float = 0.0  # Profile.overlap_exposure: cost of a collective run behind compute
    # what the collectives' waits for their group's slowest rank add to their prices
    # (planner.timeline, cost_model.comm.sync_correction; negative where they follow
    # other collectives closely)
    sync_correction_s: float = 0.0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value < 0 and name != "sync_correction_s":
                raise ValueError(f"StageCost.{name}: must be >= 0, got {value}")
        if self.layers < 1:
            raise ValueError(f"StageCost.layers: must be >= 1, got {self.layers}")
        if self.grad_reduce_parts < 1:
            raise ValueError(f"StageCost.grad_reduce_parts: must be >= 1, got {self.grad_reduce_parts}")


@dataclass(frozen=True)
class StepBreakdown:
    """Same fields as planner.schema.TimeBreakdown (build it with ``TimeBreakdown(**b.as_dict())``).

    Seconds on one device of the bottleneck (slowest) pipeline stage, for the whole step.
    """

    step_time_s: float
    compute_s: float
    recompute_s: float
    communication_s: float
    exposed_communication_s: float
    resharding_s: float
    pipeline_bubble_s: float
    optimizer_s: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def exposed(comm_s: float, compute_s: float, layers: int, overlap_exposure: float = 0.0) -> float:
    """Communication left exposed when prefetched one unit ahead of ``layers`` units of compute.

    The first unit's share waits in full; each later one runs beside a unit of compute,
    exposing what outlasts it plus ``overlap_exposure`` times the part that ran
    concurrently (0: free overlap; 1: the two serialise).
    """
    per_comm, per_compute = comm_s / layers, compute_s / layers
    concurrent = max(0.0, per_comm - per_compute) + overlap_exposure * min(per_comm, per_compute)
    return per_comm + concurrent * (layers - 1)


def _microbatch(stage: StageCost, last: bool) -> tuple[float, float]:
    """(compute, exposed communication) of one micro-batch on ``stage``."""
    compute = stage.forward_compute_s + stage.backward_compute_s
    reduce = stage.grad_reduce_s / stage.grad_reduce_parts if last or stage.grad_reduce_parts > 1 else 0.0
    behind = reduce if stage.grad_reduce_overlapped else 0.0
    x = stage.overlap_exposure
    hidden = exposed(stage.gather_forward_s, stage.forward_compute_s, stage.layers, x) + exposed(
        stage.gather_backward_s + behind, stage.backward_compute_s, stage.layers, x
    )
    comm = stage.blocking_comm_s + stage.p2p_s + hidden + reduce - behind
    return compute, max(0.0, comm + stage.sync_correction_s)


def compose_step(
    stages: Sequence[StageCost],
    microbatches: int = 1,
    schedule: Schedule = "1f1b",
    virtual_stages: int = 1,
) -> StepBreakdown:
    """Step time and its breakdown for ``stages`` (one entry per pipeline rank)."""
    if not stages:
        raise ValueError("stages: at least one stage is required")
    if microbatches < 1:
        raise ValueError(f"microbatches: must be >= 1, got {microbatches}")
    if schedule not in ("gpipe", "1f1b", "interleaved-1f1b"):
        raise ValueError(f"schedule: expected gpipe, 1f1b or interleaved-1f1b, got {schedule!r}")
    if virtual_stages < 1 or (virtual_stages > 1 and schedule != "interleaved-1f1b"):
        raise ValueError(
            f"virtual_stages: {virtual_stages} needs schedule interleaved-1f1b and >= 1"
        )
    bad = [s.grad_reduce_parts for s in stages if s.grad_reduce_parts not in (1, microbatches)]
    if bad:
        raise ValueError(f"StageCost.grad_reduce_parts: {bad[0]} is neither 1 nor microbatches={microbatches}")
    m = microbatches
    # per stage: (compute, exposed comm) of an ordinary and of the last micro-batch
    per_stage = [(*_microbatch(s, last=False), _microbatch(s, last=True)[1]) for s in stages]
    totals = [m * c + (m - 1) * e + e_last for c, e, e_last in per_stage]
    bottleneck = totals.index(max(totals))
    c, e, e_last = per_stage[bottleneck]
    t_mb = [pc + pe for pc, pe, _ in per_stage]
    bubble = (sum(t_mb) - max(t_mb)) / virtual_stages
    slow = stages[bottleneck]
    compute = m * c
    exposed_comm = (m - 1) * e + e_last
    optimizer = max(s.optimizer_s for s in stages)
    communication = m * max(0.0, slow.blocking_comm_s + slow.sync_correction_s + slow.p2p_s
                            + slow.gather_forward_s + slow.gather_backward_s)
    return StepBreakdown(
        step_time_s=compute + exposed_comm + bubble + optimizer,
        compute_s=compute,
        recompute_s=m * slow.recompute_s,
        communication_s=communication + slow.grad_reduce_s,
        exposed_communication_s=exposed_comm,
        resharding_s=m * max(0.0, slow.blocking_comm_s + slow.sync_correction_s),
        pipeline_bubble_s=bubble,
        optimizer_s=optimizer,
    )


def optimizer_time(
    profile: Profile,
    params: float,
    optimizer: str = "adam-mixed",
    shard_degree: int = 1,
    tensors: int = 1,
    dtensor: bool = False,
) -> float:
    """Seconds of ``optimizer.step()`` over ``params`` (before FSDP sharding) on one device.

    The update is ``update_ops`` element-wise ops per parameter tensor
    (memory.OPTIMIZERS), each an eager op (``compute.op_time``) moving its share of
    the update's bytes (at the profile's ``update_bandwidth`` where calibration measured
    the update itself: its ops read two or three tensors and allocate, and ran at 0.6x
    a copy's bandwidth on a 16-core machine): memory bound for big tensors, dispatch bound for the many
    small ones (norm weights, biases), and much more so when the parameters are
    DTensors (``dtensor``), whose every op pays DTensor's host-side dispatch.  A foreach
    update (``StateBytes.foreach``: torch's default on CUDA) issues each op once for all
    tensors, its kernels each covering many; DTensor still unwraps every tensor of the
    list, so its dispatch is charged per tensor.  ``tensors`` is how many parameter
    tensors the device updates; each FSDP rank updates only its shard of every tensor.
    """
    if tensors < 1:
        raise ValueError(f"tensors: must be >= 1, got {tensors}")
    per = state_bytes_per_param(optimizer)
    traffic = model_state_bytes(params, optimizer, shard_degree).update_traffic
    if per.foreach:
        host = profile.kernel_floor_s + (tensors * profile.dtensor_op_overhead_s if dtensor else 0.0)
        return per.update_ops * op_time(profile, 0, traffic / per.update_ops, host_s=host,
                                        bandwidth=profile.update_bandwidth)
    ops = tensors * per.update_ops
    return ops * op_time(profile, 0, traffic / ops, dtensor=dtensor, bandwidth=profile.update_bandwidth)


def partial_grad_time(
    profile: Profile,
    mesh_shape: Sequence[int],
    partial: Sequence[tuple[str, float, int]],
    bucketed: bool = True,
) -> float:
    """Seconds one backward spends reducing gradients that come out Partial.

    ``partial``: per parameter tensor and mesh dim on which its gradient is a
    pending sum, (collective that resolves it: ``all_reduce`` to a replicated or
    ``reduce_scatter`` to a sharded parameter, local gradient bytes, mesh dim).
    Once per micro-batch, not overlapped.  Without data-parallel dims ``executor.apply``
    reduces them when the backward ends (``bucketed``): the all-reduces on one mesh dim
    (replicated parameters) as one all-reduce of their concatenation, each
    reduce-scatter on its own.  With data-parallel dims FSDP2 owns the gradients and each
    is reduced on its own (``bucketed=False``).  Left Partial, DTensor would reduce a
    gradient again in every optimizer op that reads it.  Either way each reduction is a
    DTensor redistribution (``Profile.dtensor_redistribute_s`` of host time on top).
    """
    return sum(collective_time(profile, kind, nbytes, mesh_shape, dim) + profile.dtensor_redistribute_s
               for kind, nbytes, dim in partial_grad_collectives(partial, bucketed))


def partial_grad_collectives(partial: Sequence[tuple[str, float, int]], bucketed: bool
                             ) -> list[tuple[str, float, int]]:
    """The (collective, bytes, mesh dim) ``partial_grad_time`` prices, in the order
    ``executor.apply`` issues them: each reduce-scatter (or, not ``bucketed``, each
    all-reduce) on its own, then one all-reduce per mesh dim of the bucketed ones."""
    buckets: dict[int, float] = {}
    out = []
    for kind, nbytes, dim in partial:
        if kind == "all_reduce" and bucketed:
            buckets[dim] = buckets.get(dim, 0.0) + nbytes
        else:
            out.append((kind, nbytes, dim))
    return out + [("all_reduce", nbytes, dim) for dim, nbytes in buckets.items()]


def fsdp_host_time(profile: Profile, mode: str, units: int, param_bytes: float,
                   microbatches: int = 1) -> float:
    """Host seconds FSDP2 adds per step in ``mode`` (``replicate`` or ``fully_shard``) over
    ``units`` units holding ``param_bytes`` of unsharded parameters
    (``Profile.fsdp_overhead``; 0 where the profile has none for the mode)."""
    over = profile.fsdp_overhead.get(mode)
    return 0.0 if over is None else microbatches * (units * over.unit_s + param_bytes * over.byte_s)


def fsdp_copy_bytes(optimizer: str, shard: int) -> tuple[float, float, float]:
    """(bytes per parameter of one all-gather, of one gradient reduction, of accumulating a
    reduced gradient into the step's earlier ones) that FSDP2's own copy kernels read and
    write on a GPU, for a unit sharded over ``shard`` ranks (1: the size-1 shard dim of
    HSDP's replicate-only mode).

    From torch's ``_fully_shard/_fsdp_collectives.py`` and ``_fsdp_param_group.py``,
    with ``w`` the gathered (compute) bytes and ``g`` the gradient bytes per parameter
    (``StateBytes.weights`` and ``.grads``), the sharded parameter and the reduction in
    fp32 (mixed precision's ``reduce_dtype``, TorchTitan's default, and the master copy):

    * all-gather: the copy-in of the local shard into the flat input buffer, cast from
      fp32 on the way where ``w`` < 4 (read 4, write ``w``) and copied (read and write
      ``w``), on ``1/shard`` of the parameters; the copy-out of the flat output into the
      unsharded parameters (read and write ``w``).  With one rank there is no flat
      buffer: the cast shard is copied into the unsharded parameter once.
    * reduction: ``_chunk_cat`` of the unsharded gradients into the fp32 buffer (read
      ``g``, write 4); the reduced shard is then viewed, not copied.  With one rank the
      buffer is copied into the output (read and write 4) in place of the collective.
    * accumulation: a later micro-batch's reduced shard added to the sharded gradient the
      step's first reduction left (read 4 twice, write 4, over ``1/shard``).

    The copy-out and the reduction's copy-in run on the compute stream, between a layer's
    kernels.  Checked op by op on CPU (FSDP2's Python is the same there; torch 2.11 and
    2.13, 2 ranks, 1 rank and HSDP 2 x 1, both optimizers): the aten copies FSDP2 issued
    moved exactly these bytes.  Not counted: the unsharded fp32 gradients a pipeline
    schedule accumulates between reductions (``set_requires_gradient_sync(False)``).
    """
    per = state_bytes_per_param(optimizer)
    w, g = per.weights, per.grads
    copy_in = (4 + w if w < 4 else 0) + 2 * w
    if shard == 1:
        return copy_in, g + 4 + 8, 12
    return 2 * w + copy_in / shard, g + 4, 12 / shard


def fsdp_copy_time(profile: Profile, optimizer: str, shard: int, gathered: float, reduced: float,
                   reductions: int = 1) -> float:
    """Device seconds per step of FSDP2's copy kernels (``fsdp_copy_bytes``), at the
    profile's copy bandwidth: ``gathered`` parameters all-gathered (each unit's unsharded
    parameters times its all-gathers in the step, ``fsdp_gathers``), ``reduced``
    parameters whose gradients are reduced ``reductions`` times, all but the first
    accumulated.  0 on a CPU profile, whose calibrated ``fsdp_overhead`` byte constant
    holds the copies (the host runs them there)."""
    if profile.device_type == "cpu":
        return 0.0
    gather, reduce, accumulate = fsdp_copy_bytes(optimizer, shard)
    moved = gathered * gather + reduced * (reductions * reduce + (reductions - 1) * accumulate)
    return op_time(profile, 0, moved, host_s=0.0)


def fsdp_gathers(microbatches: int, pipelined: bool, kept: bool) -> int:
    """All-gathers of one FSDP2 unit's parameters per step, as ``executor.apply`` runs FSDP2.

    A unit that reshards after its forward (every repeated block but the last) gathers in
    each micro-batch's forward and again in its backward.  ``kept`` units hold their
    parameters from forward to backward and gather once per micro-batch: the root (FSDP2
    never reshards it after forward) and the last block (``executor.apply`` keeps it, as
    TorchTitan does, since the backward starts with it).  Under a pipeline torch's
    schedules leave every unit gathered after each backward but the last
    (``set_reshard_after_backward(False)``), so a forward that follows a backward finds its
    parameters there (and reshards them after) and a backward that follows a backward
    does too: what gathers is the first forward and every step that follows a forward,
    m + 1 in any order of the m forwards and m backwards (GPipe, 1F1B, one virtual stage
    of interleaved 1F1B), and once per step for a kept unit.
    """
    if kept:
        return 1 if pipelined else microbatches
    return microbatches + 1 if pipelined else 2 * microbatches


def fsdp_step_gathers(microbatches: int, pipelined: bool, layers: int, kept_layers: int) -> int:
    """All-gathers per step of ``layers`` repeated blocks' units, ``kept_layers`` of them
    kept, and of the root's (``fsdp_gathers``)."""
    return ((layers - kept_layers) * fsdp_gathers(microbatches, pipelined, kept=False)
            + (kept_layers + 1) * fsdp_gathers(microbatches, pipelined, kept=True))


def bucket_latency(
    profile: Profile,
    mesh_shape: Sequence[int],
    data_dims: Sequence[int],
    fsdp: bool,
    gathers: float,
    reductions: float,
) -> tuple[float, float]:
    """(parameter-gather, gradient-reduction) latency per step of FSDP2's collectives.

    FSDP2 (which also runs replicate-mode data parallelism, as HSDP) issues one
    collective per unit for all its parameters, so the fixed cost of a collective is
    paid per unit, not per parameter: ``gathers`` all-gathers per step over all units
    (``fsdp_gathers``; none in replicate mode) and ``reductions`` reductions (one per
    unit and reduced micro-batch: 1 under a pipeline, each without one,
    ``StageCost.grad_reduce_parts``).
    """
    gather = reduce = 0.0
    for dim in data_dims:
        if mesh_shape[dim] == 1:
            continue
        if fsdp:
            gather += gathers * collective_latency(profile, "all_gather", mesh_shape, dim)
        kind = "reduce_scatter" if fsdp else "all_reduce"
        reduce += reductions * collective_latency(profile, kind, mesh_shape, dim)
    return gather, reduce


def loss_mean_time(profile: Profile, mesh_shape: Sequence[int], data_dims: Sequence[int]) -> float:
    """Seconds per micro-batch to hand the loop the single-device loss under data parallelism.

    ``executor.data`` all-reduces the scalar loss over the data-parallel dims; it blocks
    the step.  The logits are gathered only if the loop reads them (executor.outputs), so
    the step time assumes a loop that trains from ``labels=`` and does not: a loop that
    reads them pays an all-gather of the global micro-batch's logits on top.
    """
    return sum(collective_time(profile, "all_reduce", 4, mesh_shape, dim) for dim in data_dims)
