"""Cost model: hand-computed values, monotonicity, DTensor agreement, profile validation."""

from __future__ import annotations

import copy
import itertools
from dataclasses import fields
from typing import Any

import pytest
from _dist import run_on_ranks
from pydantic import ValidationError

from cost_model.comm import (
    backward_placements,
    bus_factor,
    collective_latency,
    collective_time,
    local_shape,
    partial_gradient_target,
    redistribute_cost,
    redistribute_time,
    step_collective,
    sync_correction,
    transitions,
)
from cost_model.compute import attention_efficiency, gemm_efficiency, op_time
from cost_model.memory import (
    DEFAULT_HEADROOM,
    fits,
    fsdp_gathered_bytes,
    inflight_microbatches,
    korthikanti_activation_bytes,
    model_state_bytes,
    usable_bytes,
)
from cost_model.model_spec import ModelSpec, mfu, training_flops
from cost_model.profile import (
    AttentionPoint,
    Profile,
    load_profile,
    problem_lines,
    shipped_profiles,
)
from cost_model.step import (
    StageCost,
    StepBreakdown,
    bucket_latency,
    compose_step,
    exposed,
    fsdp_copy_bytes,
    fsdp_copy_time,
    fsdp_gathers,
    fsdp_step_gathers,
    loss_mean_time,
    optimizer_time,
    partial_grad_time,
)

GB = 1e9
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")

# Round numbers so every expected value below can be checked by hand.
TOY = {
    "name": "toy",
    "device_type": "cuda",
    "peak_flops": {"bf16": 100e12, "fp32": 10e12},
    "gemm_efficiency": [{"flops": 1e9, "efficiency": 0.2}, {"flops": 1e11, "efficiency": 0.8}],
    "memory_bytes": 80 * 10**9,
    "memory_bandwidth": 2e12,
    "memory_efficiency": 0.5,
    "kernel_floor_s": 5e-6,
    "levels": [
        {"name": "nvlink", "devices": 4, "latency_s": 1e-5,
         "busbw": {k: 100 * GB for k in KINDS}},
        {"name": "ib", "devices": None, "latency_s": 1e-4,
         "busbw": {k: 10 * GB for k in KINDS}},
    ],
}  # fmt: skip


@pytest.fixture(scope="module")
def toy() -> Profile:
    return load_profile(TOY)


# -- profiles ---------------------------------------------------------------------


def test_shipped_profiles_load_by_name_path_dict_and_instance(tmp_path):
    names = shipped_profiles()
    assert {"a100-sxm-80g", "h100-sxm-80g", "h200-sxm-141g", "cpu-gloo-local"} <= set(names)
    for name in names:
        p = load_profile(name)
        assert p.name == name and p.source, f"{name} must say where its numbers come from"
    h100 = load_profile("h100-sxm-80g")
    path = tmp_path / "mine.json"
    path.write_text(h100.model_dump_json())
    assert load_profile(path) == h100
    assert load_profile(str(path)) == h100
    assert load_profile(h100.model_dump()) == h100
    assert load_profile(h100) is h100
    assert h100.peak_flops["bf16"] == pytest.approx(989.4e12)
    assert load_profile("h200-sxm-141g").memory_bandwidth == 4.8e12
    assert load_profile("cpu-gloo-local").device_type == "cpu"


def test_unknown_profile_name_lists_shipped_names(tmp_path):
    with pytest.raises(ValueError) as e:
        load_profile("h100-typo")
    assert "h100-typo" in str(e.value)
    for name in shipped_profiles():
        assert name in str(e.value)
    path = tmp_path / "mine.json"
    path.write_text(load_profile("h100-sxm-80g").model_dump_json())
    with pytest.raises(ValueError, match="neither a shipped profile;"):
        load_profile(str(path), allow_paths=False)  # what the HTTP service does
    assert load_profile("a100-sxm-80g", allow_paths=False).name == "a100-sxm-80g"


@pytest.mark.parametrize(
    ("path", "value", "loc"),
    [
        (("levels", 0, "busbw", "all_reduce"), -1.0, "levels.0.busbw.all_reduce"),
        (("levels", 1, "latency_s"), -1e-6, "levels.1.latency_s"),
        (("memory_efficiency",), 1.5, "memory_efficiency"),
        (("peak_flops", "bf16"), 0, "peak_flops.bf16"),
        (("gemm_efficiency", 1, "efficiency"), 0.0, "gemm_efficiency.1.efficiency"),
        (("memory_bytes",), -5, "memory_bytes"),
        (("overlap_exposure",), -0.1, "overlap_exposure"),
        (("overlap_exposure",), 5.0, "overlap_exposure"),
        # JSON's 1e400 reads as inf, which gt=0 let through to the ILP (a PuLP traceback)
        (("kernel_floor_s",), float("inf"), "kernel_floor_s: Input should be a finite number"),
        (("levels", 0, "latency_s"), float("nan"), "levels.0.latency_s: Input should be a finite number"),
        (("peak_flops", "bf16"), float("inf"), "peak_flops.bf16: Input should be a finite number"),
        # a misspelt dtype was taken and never read: the peak it meant to give went missing (audit)
        (("peak_flops", "fp9"), 1e12,
         "peak_flops.fp9: Input should be 'fp64', 'fp32', 'tf32', 'bf16', 'fp16', 'fp8', 'fp4' or 'int8'"),
        # printed raw in one-line notes, or 100 KB of it in every plan list entry (review)
        (("name",), "toy\nnote: fits", "name: String should match pattern"),
        (("name",), "x" * 256, "name: String should have at most 255 characters"),
        (("levels", 0, "name"), "", "levels.0.name: String should have at least 1 character"),
    ],
)
def test_profile_errors_name_the_field(path, value, loc):
    bad = copy.deepcopy(TOY)
    target = bad
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(ValidationError) as e:
        load_profile(bad)
    assert loc in "\n".join(problem_lines(e.value))


def test_profile_structure_errors(tmp_path):
    extra = {**copy.deepcopy(TOY), "peak_tflops": 3}
    with pytest.raises(ValidationError, match="peak_tflops"):
        load_profile(extra)
    inner_unbounded = copy.deepcopy(TOY)
    inner_unbounded["levels"][0]["devices"] = None
    with pytest.raises(ValidationError, match="levels.0.devices"):
        load_profile(inner_unbounded)
    not_nested = copy.deepcopy(TOY)
    not_nested["levels"][1]["devices"] = 6  # not a multiple of 4
    with pytest.raises(ValidationError, match="levels.1.devices"):
        load_profile(not_nested)
    twice = copy.deepcopy(TOY)
    group = {"size": 2, "latency_s": {k: 1e-5 for k in KINDS}, "busbw": {k: GB for k in KINDS}}
    twice["levels"][0]["groups"] = [group, group]
    with pytest.raises(ValidationError, match=r"levels.0.groups[\s\S]*distinct, got \[2, 2\]"):
        load_profile(twice)
    unsorted = copy.deepcopy(TOY)
    unsorted["gemm_efficiency"].reverse()
    with pytest.raises(ValidationError, match="increasing flops"):
        load_profile(unsorted)
    curve = [{"head_flops": 1e8, "efficiency": 0.4}, {"head_flops": 1e6, "efficiency": 0.1}]
    with pytest.raises(ValidationError, match="attention_curve[\\s\\S]*increasing head_flops"):
        load_profile({**copy.deepcopy(TOY), "attention_curve": curve})
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValidationError):
        load_profile(broken)
    latin1 = tmp_path / "latin1.json"  # not UTF-8: was a bare UnicodeDecodeError naming no file
    latin1.write_bytes('{"name": "caf\u00e9"}'.encode("latin-1"))
    with pytest.raises(ValidationError, match="Invalid JSON"):
        load_profile(latin1)


# -- compute ----------------------------------------------------------------------


def test_op_time_roofline(toy):
    assert op_time(toy, 0, 0) == 0.0  # views are free
    assert op_time(toy, 10, 10) == 5e-6  # tiny kernels pay the floor
    # 1e11 FLOPs at 80% of 100 TFLOP/s; memory side negligible
    assert op_time(toy, 1e11, 1e6) == pytest.approx(1e11 / 80e12)
    # memory bound: 1e10 bytes at 50% of 2 TB/s
    assert op_time(toy, 1e6, 1e10) == pytest.approx(1e10 / 1e12)
    assert op_time(toy, 1e11, 0, dtype="fp32") == pytest.approx(1e11 / 8e12)
    # log-linear interpolation: 1e10 is halfway between 1e9 and 1e11
    assert gemm_efficiency(toy, 1e10) == pytest.approx(0.5)
    assert gemm_efficiency(toy, 1e15) == 0.8 and gemm_efficiency(toy, 1) == 0.2
    with pytest.raises(ValueError, match="peak_flops.fp8: profile 'toy' has none.*it has bf16"):
        op_time(toy, 1e9, 0, dtype="fp8")
    with pytest.raises(ValueError, match="flops"):
        op_time(toy, -1, 0)


def test_op_time_monotone_in_flops_and_bytes(toy):
    sizes = [10.0**e for e in range(3, 15)]
    times = [op_time(toy, f, 0) for f in sizes]
    assert times == sorted(times)
    times = [op_time(toy, 0, b) for b in sizes]
    assert times == sorted(times)


def test_op_time_host_overlaps_a_gpu_and_adds_on_a_cpu(toy):
    dt = load_profile({**TOY, "dtensor_op_overhead_s": 20e-6})
    # GPU: the host issues asynchronously; a tiny op costs the host time, a big one its kernel
    assert op_time(dt, 10, 10, dtensor=True) == pytest.approx(25e-6)
    assert op_time(dt, 1e11, 0, dtensor=True) == op_time(toy, 1e11, 0)
    assert op_time(dt, 10, 10) == 5e-6  # plain tensors: no DTensor dispatch
    # CPU: one thread dispatches, then runs the kernel, so the host time adds to the roofline
    cpu = load_profile({**TOY, "device_type": "cpu", "dtensor_op_overhead_s": 20e-6})
    assert op_time(cpu, 1e11, 0) == pytest.approx(5e-6 + 1e11 / 80e12)
    assert op_time(cpu, 0, 1e10, dtensor=True) == pytest.approx(25e-6 + 1e10 / 1e12)
    assert op_time(cpu, 0, 0, dtensor=True) == 0.0  # views still launch nothing


def test_attention_curve_prices_fused_attention_by_its_work_per_head(toy):
    """A profile's attention_curve (by forward FLOPs per (sequence, head) pair) is
    interpolated in log and clamped like the GEMM curve, and prices a fused attention op
    whose figure is given instead of attention_efficiency; without the figure, or without
    a curve, attention_efficiency does (None: the GEMM curve)."""
    curve = [AttentionPoint(head_flops=1e6, efficiency=0.1), AttentionPoint(head_flops=1e8, efficiency=0.4)]
    cpu = toy.model_copy(update={"device_type": "cpu", "attention_efficiency": 0.5, "attention_curve": curve})
    assert attention_efficiency(cpu, 1e7) == pytest.approx(0.25)
    assert (attention_efficiency(cpu, 1e4), attention_efficiency(cpu, 1e10)) == (0.1, 0.4)
    assert attention_efficiency(cpu, None) == 0.5 and attention_efficiency(toy, 1e7) is None
    flops, host = 1e10, cpu.kernel_floor_s
    assert op_time(cpu, flops, 0, "fp32", attention=True, head_flops=1e7) == pytest.approx(host + flops / 2.5e12)
    assert op_time(cpu, flops, 0, "fp32", attention=True) == pytest.approx(host + flops / 5e12)
    assert op_time(cpu, flops, 0, "fp32", head_flops=1e7) == op_time(cpu, flops, 0, "fp32")  # not attention


def test_the_fidelity_bench_times_each_step_right_after_one_of_its_own():
    """A training loop's step follows its own last step; the bench's round robin runs an
    untimed step of the same layout before each timed one, not right after the others."""
    from bench.costmodel_fidelity import _timed_round_robin

    ran: list[str] = []

    def case(name: str):
        def step() -> list[float]:
            ran.append(name)
            return [float(len(ran))]
        return step

    out = _timed_round_robin({"a": case("a"), "b": case("b")}, warmup=1, steps=2, barrier=lambda: None)
    assert ran == ["a", "b"] + ["a", "a", "b", "b"] * 2
    assert out == {"a": [[4.0], [8.0]], "b": [[6.0], [10.0]]}


def _collectives_switched() -> dict[str, Any]:
    """On each of 2 ranks: every kind of collective the fidelity bench's steps issue
    (c10d's, and DTensor's functional ones), with the switch on, off, and after it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DeviceMesh, DTensor, Partial, Replicate, Shard

    from bench.costmodel_fidelity import CollectivesSwitch

    rank = dist.get_rank()
    mesh = DeviceMesh("cpu", [0, 1])

    def collectives() -> list[list[float]]:
        summed = torch.full((2,), rank + 1.0)
        dist.all_reduce(summed)
        gathered = torch.empty(4)
        dist.all_gather_into_tensor(gathered, torch.full((2,), float(rank)))
        scattered = torch.empty(2)
        dist.reduce_scatter_tensor(scattered, torch.arange(4.0) + rank)
        dt_gathered = DTensor.from_local(torch.full((2,), float(rank)), mesh, [Shard(0)]).full_tensor()
        partial = DTensor.from_local(torch.full((2,), rank + 1.0), mesh, [Partial()])
        dt_summed = partial.redistribute(mesh, [Replicate()]).to_local()
        partial = DTensor.from_local(torch.arange(4.0) + rank, mesh, [Partial()])
        dt_scattered = partial.redistribute(mesh, [Shard(0)]).to_local()
        return [t.tolist() for t in (summed, gathered, scattered, dt_gathered, dt_summed, dt_scattered)]

    switch = CollectivesSwitch()
    with switch:
        out: dict[str, Any] = {"on": collectives(), "off": switch.without(collectives)()}
    with switch:  # again, as the bench enters it around each third of its steps
        out["off again"] = switch.without(collectives)()
    switch.skipping = True  # no kernel left to read it
    out["after"] = collectives()
    try:
        switch.without(collectives)()
    except RuntimeError as e:
        out["outside"] = str(e)
    return out


def test_the_fidelity_bench_switches_every_collective_off_and_back_on():
    """The bench times each layout's step with its collectives off in the same gloo job:
    off, each returns at once with the rank's own data in the output's shape; on, and
    after the switch is gone, each communicates; outside the switch a step cannot be run
    as switched off."""
    for rank, got in enumerate(run_on_ranks(2, _collectives_switched)):
        chunk = [[1.0, 3.0], [5.0, 7.0]][rank]  # (0, 1, 2, 3) + (1, 2, 3, 4), split
        real = [[3.0, 3.0], [0.0, 0.0, 1.0, 1.0], chunk, [0.0, 0.0, 1.0, 1.0], [3.0, 3.0], chunk]
        own = float(rank)
        alone = [[own + 1] * 2, [own] * 4, [own, own + 1], [own] * 4, [own + 1] * 2, [own, own + 1]]
        assert got.pop("outside").endswith("a step run outside the switch's with block")
        assert got == {"on": real, "off": alone, "off again": alone, "after": real}


def _collectives_clocked() -> list[Any]:
    """On each of 2 ranks: a c10d all-reduce, then a DTensor all-reduce, rank 1 issuing
    each 0.1 s late, then a c10d reduce-scatter and a DTensor all-gather, as
    ``CollectiveClock`` records them; then the clock's error outside its block."""
    import time

    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DeviceMesh, DTensor, Partial, Replicate, Shard

    from bench.collective_wait import CollectiveClock

    rank = dist.get_rank()
    mesh = DeviceMesh("cpu", [0, 1])

    def step() -> None:
        dist.barrier()  # the ranks start the test apart
        time.sleep(0.1 * rank)
        dist.all_reduce(torch.ones(2))
        time.sleep(0.1 * rank)
        DTensor.from_local(torch.ones(2), mesh, [Partial()]).redistribute(mesh, [Replicate()]).to_local() + 0
        dist.reduce_scatter_tensor(torch.empty(2), torch.ones(4))
        DTensor.from_local(torch.ones(2), mesh, [Shard(0)]).full_tensor()

    clock = CollectiveClock()
    with clock:
        out: list[Any] = [clock.record(step)]
    try:
        clock.record(step)
    except RuntimeError as e:
        out.append(str(e))
    return out


def test_the_collective_wait_bench_clocks_each_collective_on_every_rank():
    """Each collective of a step, c10d's and DTensor's, with its group and the shared
    clock's issue and return; the ranks' records decompose into the segment before a
    collective, the wait for the group's last rank and the transfer after it."""
    from bench.collective_wait import decompose

    records, errors = zip(*run_on_ranks(2, _collectives_clocked), strict=True)
    assert all(e.endswith("called outside the clock's with block") for e in errors)
    for log in records:
        # with their nccl-tests sizes: the all-gather's output, the reduce-scatter's input
        assert [entry[:3] for entry in log] == [("allreduce_", (0, 1), 8), ("all_reduce", (0, 1), 8),
                                                ("_reduce_scatter_base_", (0, 1), 16),
                                                ("all_gather_into_tensor", (0, 1), 16)]
        assert all(issued <= returned for *_, issued, returned in log)
    *_, issued, returned = records[0][0]
    assert returned - issued > 0.05  # c10d's: rank 0 returned once rank 1 had come
    ((segment, wait, transfer),) = decompose(records)[("all_reduce", 2, 8)]
    assert segment > 0.03 and wait > 0.03  # rank 1 computed (slept) 0.1 s; rank 0 waited for it
    assert segment - wait == pytest.approx(0.0, abs=0.02) and transfer >= 0


def test_collective_wait_decomposes_each_collective_per_group():
    from bench.collective_wait import decompose

    world = (0, 1, 2, 3)
    first = [("c", world, 8, 0.5, r) for r in (1.0, 1.0, 1.1, 1.0)]
    second = [("a", (0, 1), 64, 1.2, 1.6), ("a", (0, 1), 64, 1.5, 1.6),
              ("a", (2, 3), 64, 1.3, 1.4), ("a", (2, 3), 64, 1.3, 1.5)]
    logs = [[f, s] for f, s in zip(first, second, strict=True)]
    got = decompose(logs)
    assert list(got) == [("a", 2, 64)]  # the step's first collective has no segment before it
    assert got[("a", 2, 64)] == [pytest.approx((0.35, 0.15, 0.1)), pytest.approx((0.25, 0.0, 0.15))]
    logs[1][1] = ("a", (0, 1), 32, 1.5, 1.6)
    with pytest.raises(ValueError, match="collective 1 differs between the ranks of group"):
        decompose(logs)
    with pytest.raises(ValueError, match=r"recorded \[2, 1, 2, 2\] collectives"):
        decompose([logs[0], logs[1][:1], logs[2], logs[3]])


def test_collective_wait_drift_tables():
    from bench.collective_wait import drift_at, drift_table

    table = [(0.01, 0.004), (0.04, 0.008)]  # shares 40% and 20%
    assert drift_at(table, 0.02) == pytest.approx(0.02 * (0.4 * 0.2) ** 0.5)  # halfway, log-log
    assert drift_at(table, 0.04) == pytest.approx(0.008)
    assert drift_at(table, 0.005) == pytest.approx(0.002) and drift_at(table, 0.08) == pytest.approx(0.016)
    per_rank = [[(2, a), (10, b)] for a, b in ((1.0, 4.0), (2.0, 4.0), (3.0, 4.0), (6.0, 4.0))]
    assert drift_table(per_rank, [(0, 1), (2, 3)]) == [(2, 3.0, 3.0, 1.0), (10, 4.0, 0.0, 0.0)]


def test_the_planner_prices_attention_at_its_work_per_head():
    """The fidelity bench's Llama (heads 8, head dim 32, sequence 128): its attention does
    2 x 128^2 x 32 forward FLOPs per (sequence, head) pair, whatever the batch or the
    heads a rank holds, so the curve's point there alone decides its price."""
    import json

    import planner
    from bench.costmodel_fidelity import BATCH, MODEL, SEQ

    cpu = json.loads(load_profile("cpu-gloo-local").model_dump_json())
    heads = MODEL["num_attention_heads"]
    pair = 2.0 * SEQ**2 * (MODEL["hidden_size"] // heads)

    def compute_s(efficiency: float, **layout: int) -> float:
        curve = [{"head_flops": h, "efficiency": e} for h, e in ((pair / 10, 0.9), (pair, efficiency), (pair * 10, 0.9))]
        profile = {**cpu, "name": "attn", "attention_curve": curve}
        return planner.estimate(MODEL, 4, profile, batch_size=BATCH, seq_len=SEQ, **layout).time.compute_s

    layers, peak = MODEL["num_hidden_layers"], cpu["peak_flops"]["fp32"]
    for layout, rank_seqs, rank_heads in (({"dp": 4}, BATCH // 4, heads), ({"tp": 4}, BATCH, heads // 4)):
        flops = 3 * layers * rank_seqs * rank_heads * pair  # forward + backward, on one rank
        assert compute_s(0.1, **layout) - compute_s(0.2, **layout) == pytest.approx(
            flops / (0.1 * peak) - flops / (0.2 * peak))


# -- collectives --------------------------------------------------------------------


def test_bus_factors():
    assert bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    for kind in ("all_gather", "reduce_scatter", "all_to_all"):
        assert bus_factor(kind, 4) == pytest.approx(3 / 4)
    assert bus_factor("send_recv", 2) == 1.0
    with pytest.raises(ValueError, match="broadcast"):
        bus_factor("broadcast", 2)


def test_collective_inside_one_node(toy):
    s = 1e9
    assert collective_time(toy, "all_reduce", s, [4], 0) == pytest.approx(1e-5 + s * 1.5 / 100e9)
    assert collective_time(toy, "all_gather", s, [4], 0) == pytest.approx(1e-5 + s * 0.75 / 100e9)
    # mesh (2, 2): dim 0 has stride 2, still inside the 4-device node
    assert collective_time(toy, "reduce_scatter", s, [2, 2], 0) == pytest.approx(
        1e-5 + s * 0.5 / 100e9
    )
    assert collective_time(toy, "all_reduce", s, [1, 4], 0) == 0.0  # size-1 dim
    assert collective_time(toy, "all_reduce", 0, [4], 0) == 0.0


def test_collective_hierarchical_split(toy):
    s = 1e9
    # 8 ranks = 2 nodes x 4: intra phase on S among 4, inter phase on S/4 among 2
    intra = 1e-5 + s * (2 * 3 / 4) / 100e9
    inter = 1e-4 + (s / 4) * (2 * 1 / 2) / 10e9
    assert collective_time(toy, "all_reduce", s, [8], 0) == pytest.approx(intra + inter)
    intra = 1e-5 + s * (3 / 4) / 100e9
    inter = 1e-4 + (s / 4) * (1 / 2) / 10e9
    assert collective_time(toy, "all_gather", s, [8], 0) == pytest.approx(intra + inter)
    # mesh (2, 4): dim 0 has stride 4, one member per node, all traffic on IB
    assert collective_time(toy, "all_reduce", s, [2, 4], 0) == pytest.approx(1e-4 + s * 1.0 / 10e9)
    # all-to-all: 3/8 of S to node-mates over nvlink, 4/8 to the other node over IB, in parallel
    a2a = 1e-4 + max(s * 3 / 8 / 100e9, s * 4 / 8 / 10e9)
    assert collective_time(toy, "all_to_all", s, [8], 0) == pytest.approx(a2a)
    # 6 ranks = 4 + 2: the node with 2 bounds it, as if every node held 2: a phase among 2
    # inside it on S, then among 3 across nodes on S/2 (its 2 NICs bring in the other
    # node's 4/6 of an all-gather: S/3 each).  It was priced as 2 full nodes (S/4 on IB).
    six = 1e-5 + s * (2 * 1 / 2) / 100e9 + 1e-4 + (s / 2) * (2 * 2 / 3) / 10e9
    assert collective_time(toy, "all_reduce", s, [6], 0) == pytest.approx(six)
    # send/recv: the pipeline is bounded by its slowest (inter-node) pair
    assert collective_time(toy, "send_recv", s, [2, 4], 0) == pytest.approx(1e-4 + s / 10e9)
    assert collective_time(toy, "send_recv", s, [4, 2], 1) == pytest.approx(1e-5 + s / 100e9)


def test_measured_group_sizes_override_the_level_constants(toy):
    measured = copy.deepcopy(TOY)
    measured["levels"][0]["groups"] = [
        {"size": 4, "latency_s": {k: 1e-3 for k in KINDS}, "busbw": {k: 1 * GB for k in KINDS}}]
    p = load_profile(measured)
    s = 2**20
    # 4 members at the inner level: the measured constants, per kind
    assert collective_time(p, "all_gather", s, [4], 0) == pytest.approx(1e-3 + s * 0.75 / GB)
    # 2 members: no measurement for that size, the level's defaults
    assert collective_time(p, "all_gather", s, [2, 2], 0) == collective_time(toy, "all_gather", s, [2, 2], 0)
    # hierarchical: the inner phase among 4 uses the group, the outer phase the ib defaults
    assert collective_time(p, "all_reduce", s, [8], 0) == pytest.approx(
        1e-3 + s * 1.5 / GB + 1e-4 + (s / 4) * 1.0 / (10 * GB))
    # a pipeline's send/recv among 4 ranks at once uses the 4-rank constants
    assert collective_time(p, "send_recv", s, [4], 0) == pytest.approx(1e-3 + s / GB)


def test_groups_split_unevenly_across_nodes_pay_the_lone_members_link():
    """On 8-GPU nodes, 9 ranks are 8 + 1: the lone rank's one NIC brings in 8/9 of an
    all-gather (it cost as much as 16 ranks, 3.7 ms for 1 GB, where that NIC alone needs
    19 ms).  And a group that crosses a node boundary at an offset (the dp group {6, 8,
    10} of pp2 x dp3 x tp2 on 12 devices) runs on InfiniBand, not NVLink (it cost as
    much as dp3 inside one node)."""
    h100 = load_profile("h100-sxm-80g")
    nvlink, ib = h100.levels
    s = 1e9
    assert collective_time(h100, "all_gather", s, [9], 0) == pytest.approx(
        ib.latency_s + s * (8 / 9) / ib.busbw.all_gather)
    assert collective_time(h100, "all_gather", s, [16], 0) == pytest.approx(
        nvlink.latency_s + s * (7 / 8) / nvlink.busbw.all_gather + ib.latency_s + (s / 8) * (1 / 2) / ib.busbw.all_gather)
    across = ib.latency_s + s * (2 * 2 / 3) / ib.busbw.all_reduce
    assert collective_time(h100, "all_reduce", s, [2, 3, 2], 1) == pytest.approx(across)
    assert collective_time(h100, "all_reduce", s, [1, 3, 2], 1) == pytest.approx(
        nvlink.latency_s + s * (2 * 2 / 3) / nvlink.busbw.all_reduce)


def test_dim_spanning_nodes_costs_more(toy):
    for kind in KINDS:
        for profile in (toy, load_profile("h100-sxm-80g")):
            inside = collective_time(profile, kind, 1e8, [8, 4], 1)
            across = collective_time(profile, kind, 1e8, [4, 8], 0)  # size 4, stride 8
            assert across > inside, (kind, profile.name)


def test_bigger_messages_never_cheaper(toy):
    sizes = [2.0**e for e in range(10, 34, 2)]
    for profile in (toy, load_profile("a100-sxm-80g"), load_profile("cpu-gloo-local")):
        for kind in KINDS:
            for mesh, dim in (([8], 0), ([2, 4], 0), ([4, 2], 1), ([16, 8], 0), ([2, 2, 2], 1)):
                times = [collective_time(profile, kind, s, mesh, dim) for s in sizes]
                assert times == sorted(times), (profile.name, kind, mesh, dim)
                assert times[0] > 0


def test_more_ranks_never_cheaper_past_the_calibrated_groups():
    """The shipped CPU profile calibrated groups of 2 and 4; 5 or 8 ranks took the level's
    fit over all sizes, whose latency is below the 4-rank one (a 64 KB all-reduce among 5
    cost 3.0 ms, among 4 7.1 ms)."""
    cpu = load_profile("cpu-gloo-local")
    assert sorted(g.size for g in cpu.levels[0].groups) == [2, 4]
    for kind in KINDS:
        for nbytes in (2**16, 2**20, 2**26):
            times = [collective_time(cpu, kind, nbytes, [n], 0) for n in (4, 5, 6, 8, 16)]
            assert times == sorted(times), (kind, nbytes, times)


def test_h100_large_all_reduce_reaches_datasheet_busbw():
    h100 = load_profile("h100-sxm-80g")
    s = 8e9
    t = collective_time(h100, "all_reduce", s, [8], 0)
    assert s * bus_factor("all_reduce", 8) / t == pytest.approx(370e9, rel=1e-3)


def test_collective_input_errors(toy):
    with pytest.raises(ValueError, match="kind"):
        collective_time(toy, "gossip", 1e6, [4], 0)
    with pytest.raises(ValueError, match="dim"):
        collective_time(toy, "all_reduce", 1e6, [4], 1)
    with pytest.raises(ValueError, match="mesh_shape"):
        collective_time(toy, "all_reduce", 1e6, [0, 4], 1)
    bounded = copy.deepcopy(TOY)
    bounded["levels"][1]["devices"] = 16
    with pytest.raises(ValueError, match="at most 16"):
        collective_time(load_profile(bounded), "all_reduce", 1e6, [32], 0)


# -- redistribution --------------------------------------------------------------------


def test_redistribute_1d_transitions(toy):
    shape, item = [1024, 512], 2
    full = 1024 * 512 * 2
    mesh = [4]

    def coll(kind, nbytes):
        return collective_time(toy, kind, nbytes, mesh, 0)

    assert redistribute_time(toy, mesh, ["P"], ["R"], shape, item) == coll("all_reduce", full)
    assert redistribute_time(toy, mesh, ["P"], ["S(0)"], shape, item) == coll(
        "reduce_scatter", full
    )
    assert redistribute_time(toy, mesh, ["S(0)"], ["R"], shape, item) == coll("all_gather", full)
    # a shard of another dim than 0 is gathered along dim 0, then concatenated along its own
    # (one copy of the gathered tensor); a Partial tensor is laid out along dim 0 first
    assert redistribute_time(toy, mesh, ["S(1)"], ["R"], shape, item) == pytest.approx(
        coll("all_gather", full) + op_time(toy, 0, 2 * full))
    assert redistribute_time(toy, mesh, ["P"], ["S(1)"], shape, item) == pytest.approx(
        coll("reduce_scatter", full) + op_time(toy, 0, 2 * full))
    assert redistribute_time(toy, mesh, ["S(0)"], ["S(1)"], shape, item) == coll(
        "all_to_all", full / 4
    )
    assert redistribute_time(toy, mesh, ["R"], ["S(0)"], shape, item) == op_time(
        toy, 0, 2 * full / 4
    )
    assert redistribute_time(toy, mesh, ["R"], ["P"], shape, item) == op_time(toy, 0, 2 * full)
    assert redistribute_time(toy, mesh, ["S(0)"], ["S(0)"], shape, item) == 0.0
    with pytest.raises(ValueError, match="S\\(0\\) -> P"):
        redistribute_time(toy, mesh, ["S(0)"], ["P"], shape, item)


def test_redistribute_on_cpu_gathers_instead_of_all_to_all():
    cpu = load_profile("cpu-gloo-local")
    got = redistribute_time(cpu, [2], ["S(0)"], ["S(1)"], [64, 64], 4)
    gather = collective_time(cpu, "all_gather", 64 * 64 * 4, [2], 0)
    assert got == pytest.approx(gather + cpu.dtensor_redistribute_s + op_time(cpu, 0, 2 * 64 * 32 * 4))


def test_dtensor_host_time_per_collective_step(toy):
    """A profile's DTensor redistribution overhead is charged once per collective a
    redistribution issues, forward and backward, and once per Partial-gradient reduction;
    local steps (chunks, divides) issue none."""
    h = 1e-3
    slow = toy.model_copy(update={"dtensor_redistribute_s": h})
    shape, item = [64, 128], 4
    for src, dst, steps in ((["P"], ["R"], 1), (["S(1)"], ["R"], 1), (["R"], ["S(0)"], 0),
                            (["S(0)", "P"], ["R", "R"], 2), (["R", "R"], ["S(0)", "S(1)"], 0)):
        mesh = [4] * len(src)
        assert redistribute_time(slow, mesh, src, dst, shape, item) == pytest.approx(
            redistribute_time(toy, mesh, src, dst, shape, item) + steps * h)
    # sequence-parallel entry with a Partial gradient: all-gather forward, reduce-scatter back
    c0 = redistribute_cost(toy, [4], ["S(1)"], ["R"], shape, item, grad_placements=["P"])
    c1 = redistribute_cost(slow, [4], ["S(1)"], ["R"], shape, item, grad_placements=["P"])
    assert (c1.forward_s - c0.forward_s, c1.backward_s - c0.backward_s) == pytest.approx((h, h))
    norms = [("all_reduce", 1024, 1)] * 9
    assert partial_grad_time(slow, [2, 4], norms) == pytest.approx(partial_grad_time(toy, [2, 4], norms) + h)
    assert partial_grad_time(slow, [2, 4], norms, bucketed=False) == pytest.approx(
        partial_grad_time(toy, [2, 4], norms, bucketed=False) + 9 * h)


def test_gloo_staging_buffer_pays_fresh_pages_from_the_threshold(toy):
    """On a CPU profile gloo's all-gather and reduce-scatter allocate a buffer of the whole
    size per call: from fresh_alloc_bytes up its pages cost fresh_page_byte_s per byte.
    Other kinds, smaller sizes and GPU profiles pay nothing; DTensor's new output does."""
    mib, byte_s = 2**20, 1e-9
    cpu = toy.model_copy(update={"device_type": "cpu", "fresh_page_byte_s": byte_s,
                                 "fresh_alloc_bytes": 32 * mib})
    plain = toy.model_copy(update={"device_type": "cpu"})
    for kind in KINDS:
        for s in (16 * mib, 32 * mib, 64 * mib):
            extra = s * byte_s if kind in ("all_gather", "reduce_scatter") and s >= 32 * mib else 0.0
            assert collective_time(cpu, kind, s, [4], 0) == pytest.approx(
                collective_time(plain, kind, s, [4], 0) + extra), (kind, s)
    gpu = cpu.model_copy(update={"device_type": "cuda"})
    assert collective_time(gpu, "all_gather", 64 * mib, [4], 0) == collective_time(toy, "all_gather", 64 * mib, [4], 0)
    # a DTensor gather of a 16 MiB shard among 4: gloo's 64 MiB staging buffer and the
    # 64 MiB tensor the functional collective returns, both fresh
    shape = [4 * 2**22]  # 64 MiB of fp32
    assert redistribute_time(cpu, [4], ["S(0)"], ["R"], shape, 4) == pytest.approx(
        redistribute_time(plain, [4], ["S(0)"], ["R"], shape, 4) + 2 * 64 * mib * byte_s)
    # its all-reduce clones 64 MiB (fresh) and stages nothing
    assert redistribute_time(cpu, [4], ["P"], ["R"], shape, 4) == pytest.approx(
        redistribute_time(plain, [4], ["P"], ["R"], shape, 4) + 64 * mib * byte_s)


def test_redistribute_2d_uses_local_sizes(toy):
    # (S(0), P) -> (S(0), R): the all-reduce on dim 1 moves the dim-0 shard only
    got = redistribute_time(toy, [2, 4], ["S(0)", "P"], ["S(0)", "R"], [64, 128], 4)
    assert got == collective_time(toy, "all_reduce", 32 * 128 * 4, [2, 4], 1)
    # nested sharding: (S(0), S(0)) -> (R, S(0)) goes through R on dim 1 first (DTensor's greedy order)
    assert transitions([2, 2], ["S(0)", "S(0)"], ["R", "S(0)"]) == [
        (1, "S(0)", "R"), (0, "S(0)", "R"), (1, "R", "S(0)"),
    ]  # fmt: skip
    assert local_shape([2, 3], ["S(0)", "S(0)"], [13, 5]) == [3, 5]


def test_redistribute_backward_follows_dtensor():
    assert backward_placements(["P"], ["R"]) == ["R"]  # grad R stays R, no partial again
    assert backward_placements(["P", "S(0)"], ["S(1)", "R"]) == ["R", "S(0)"]
    assert backward_placements(["R"], ["S(0)"]) == ["R"]
    # a column-parallel consumer's Partial gradient: all-reduced onto a replicated or a
    # Partial source (whose producer cannot take it Partial), reduce-scattered onto a shard
    assert backward_placements(["P"], ["P"]) == ["P"]
    assert partial_gradient_target(["P"], ["P"]) == partial_gradient_target(["R"], ["P"]) == ["R"]
    assert partial_gradient_target(["S(0)", "P"], ["P", "S(1)"]) == ["S(0)", "R"]


def test_redistribute_cost_forward_and_backward(toy):
    shape, item = [4096, 4096], 2
    full = 4096 * 4096 * 2
    # Sequence-parallel entry: S(0) -> R forward (all-gather); backward gets R and goes back to S(0)
    c = redistribute_cost(toy, [4], ["S(0)"], ["R"], shape, item)
    assert c.forward_s == collective_time(toy, "all_gather", full, [4], 0)
    assert c.backward_s == op_time(toy, 0, 2 * full / 4)
    # ... and with a Partial gradient (a colwise matmul consumed the R input): reduce-scatter
    c = redistribute_cost(toy, [4], ["S(0)"], ["R"], shape, item, grad_placements=["P"])
    assert c.backward_s == collective_time(toy, "reduce_scatter", full, [4], 0)
    assert c.total_s == c.forward_s + c.backward_s
    # P -> R forward all-reduces; the R gradient goes back as R (free)
    c = redistribute_cost(toy, [4], ["P"], ["R"], shape, item)
    assert (c.forward_s > 0, c.backward_s) == (True, 0.0)


def test_redistribute_errors_name_the_argument(toy):
    with pytest.raises(ValueError, match="src: 1 placements"):
        redistribute_time(toy, [2, 2], ["R"], ["R", "R"], [4], 4)
    with pytest.raises(ValueError, match="dst: 'Shard\\(0\\)'"):
        redistribute_time(toy, [2], ["R"], ["Shard(0)"], [4], 4)
    with pytest.raises(ValueError, match="shards dim 2 of a 2-D tensor"):
        redistribute_time(toy, [2], ["R"], ["S(2)"], [4, 4], 4)
    with pytest.raises(ValueError, match="grad_placements"):
        redistribute_cost(toy, [2], ["R"], ["S(0)"], [4, 4], 4, grad_placements=["R", "R"])


@pytest.fixture(scope="module")
def fake_world():
    """An in-process fake process group of 8 ranks: DTensor's own planner, no communication."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.fail("a process group leaked from another test")
    dist.init_process_group("fake", rank=0, world_size=8, store=FakeStore())
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("mesh_shape", [(2, 4), (2, 2, 2)])
def test_transitions_match_dtensor_planner(fake_world, mesh_shape):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._redistribute import _gen_transform_infos_non_cached

    mesh = init_device_mesh("cpu", mesh_shape)
    meta = TensorMeta(torch.Size([16, 16]), (16, 1), torch.float32)
    to_torch = {"R": Replicate(), "P": Partial(), "S(0)": Shard(0), "S(1)": Shard(1)}
    to_str = {v: k for k, v in to_torch.items()}
    options = list(to_torch)
    checked = 0
    for src in itertools.product(options, repeat=len(mesh_shape)):
        for dst in itertools.product(options, repeat=len(mesh_shape)):
            if any(s.startswith("S") and d == "P" for s, d in zip(src, dst, strict=True)):
                continue  # DTensor cannot do these either
            spec = [
                DTensorSpec(mesh, tuple(to_torch[p] for p in pl), tensor_meta=meta)
                for pl in (src, dst)
            ]
            theirs = [
                (t.mesh_dim, to_str[t.src_dst_placements[0]], to_str[t.src_dst_placements[1]])
                for t in _gen_transform_infos_non_cached(*spec)
            ]
            assert transitions(mesh_shape, src, dst) == theirs, (src, dst)
            checked += 1
    assert checked > 100


_TORCH_NAMES = {
    "all_reduce": "c10d_functional.all_reduce",
    "all_gather": "c10d_functional.all_gather_into_tensor",
    "reduce_scatter": "c10d_functional.reduce_scatter_tensor",
}


def _predicted_collectives(mesh_shape, src, dst) -> dict[str, int]:
    counts: dict[str, int] = {}
    for m, a, b in transitions(mesh_shape, src, dst):
        kind = step_collective(a, b, "cpu") if mesh_shape[m] > 1 else None
        if kind is not None:
            counts[_TORCH_NAMES[kind]] = counts.get(_TORCH_NAMES[kind], 0) + 1
    return counts


def test_forward_and_backward_collectives_match_dtensor(fake_world):
    """What DTensor actually issues (counted by CommDebugMode) in both directions."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.debug import CommDebugMode

    mesh_shape = (2, 4)
    mesh = init_device_mesh("cpu", mesh_shape)
    to_torch = {"R": Replicate(), "P": Partial(), "S(0)": Shard(0), "S(1)": Shard(1)}
    checked = 0
    for src in itertools.product(to_torch, repeat=2):
        for dst in itertools.product(to_torch, repeat=2):
            if any(d == "P" != s for s, d in zip(src, dst, strict=True)):
                continue  # the public redistribute refuses to produce Partial
            x = DTensor.from_local(
                torch.ones(8, 8, requires_grad=True), mesh, [to_torch[p] for p in src]
            )
            forward, backward = CommDebugMode(), CommDebugMode()
            with forward:
                y = x.redistribute(mesh, [to_torch[p] for p in dst])
            with backward:
                y.to_local().sum().backward()  # the gradient arrives in dst placements
            counts = {str(k): v for k, v in forward.get_comm_counts().items()}
            assert counts == _predicted_collectives(mesh_shape, src, dst), ("fwd", src, dst)
            counts = {str(k): v for k, v in backward.get_comm_counts().items()}
            expected = _predicted_collectives(mesh_shape, dst, backward_placements(src, dst))
            assert counts == expected, ("bwd", src, dst)
            checked += 1
    assert checked > 100


# -- memory ----------------------------------------------------------------------------


def test_model_state_bytes():
    n = 1_000_000
    assert model_state_bytes(n).total == 16 * n  # mixed-precision Adam
    assert model_state_bytes(n, "adam-fp32").total == 16 * n
    assert model_state_bytes(n, "sgd").total == 8 * n
    fsdp = model_state_bytes(n, shard_degree=8)
    assert (fsdp.weights, fsdp.grads, fsdp.optimizer) == (2 * n / 8, 2 * n / 8, 12 * n / 8)
    zero1 = model_state_bytes(n, shard_degree=8, zero_stage=1)
    assert (zero1.weights, zero1.grads, zero1.optimizer) == (2 * n, 2 * n, 12 * n / 8)
    per_device = [model_state_bytes(8e9, shard_degree=d).total for d in (1, 2, 4, 8, 64, 512)]
    assert per_device == sorted(per_device, reverse=True)
    with pytest.raises(ValueError, match="optimizer: unknown 'lion'"):
        model_state_bytes(n, "lion")
    with pytest.raises(ValueError, match="shard_degree"):
        model_state_bytes(n, shard_degree=0)


def test_fsdp_gathered_units_on_top_of_the_shards():
    """FSDP2 holds the root unit gathered with its gradients through the step, and a layer
    computing plus one prefetched: Llama 3 8B's root (embedding, head, final norm) and
    one of its 32 layers, in bf16 mixed precision, on 8 fully sharded ranks."""
    root, layer = 2 * 128256 * 4096 + 4096, (8_030_261_248 - (2 * 128256 * 4096 + 4096)) // 32
    assert layer == 218_112_000
    assert fsdp_gathered_bytes(root, layer, "adam-mixed", 8) == root * (2 + 2) + layer * (2 * 2 + 2)
    assert fsdp_gathered_bytes(root, layer, "adam-fp32", 8) == root * (4 + 4) + layer * (2 * 4 + 4)
    assert fsdp_gathered_bytes(root, layer, "adam-mixed", 1) == 0  # nothing fully sharded
    # a pipeline stage of 6 layers keeps them all unsharded from its first backward to the
    # step's last (torch's PipelineStage skips the reshard and the sync before it)
    assert fsdp_gathered_bytes(root, layer, "adam-mixed", 8, stage_layers=6) == (root + 6 * layer) * (2 + 2)
    import planner

    kw = dict(batch_size=16, seq_len=4096, microbatches=2)
    fsdp = planner.estimate("llama3-8b", 8, "h100-sxm-80g", dp=8, fsdp=True, **kw).memory
    assert fsdp.fsdp_gathered == root * 4 + layer * 6  # ~5.1 GiB: was left to the headroom
    parts = fsdp.parameters + fsdp.gradients + fsdp.optimizer + fsdp.activations + fsdp.fsdp_gathered
    assert abs(fsdp.total - parts) <= 4  # each field rounded down on its own
    tp = planner.estimate("llama3-8b", 8, "h100-sxm-80g", dp=1, tp=8, sp=True, **kw).memory
    assert tp.fsdp_gathered == 0


def test_korthikanti_formulas():
    s, b, h, a, L = 2048, 4, 4096, 32, 2
    sbh = s * b * h
    att = 5 * a * s / h
    assert korthikanti_activation_bytes(s, b, h, a, L) == pytest.approx(L * sbh * (34 + att))
    assert korthikanti_activation_bytes(s, b, h, a, L, tp=8) == pytest.approx(
        L * sbh * (10 + 24 / 8 + att / 8)
    )
    assert korthikanti_activation_bytes(s, b, h, a, L, tp=8, sp=True) == pytest.approx(
        L * sbh * (34 + att) / 8
    )
    assert korthikanti_activation_bytes(
        s, b, h, a, L, tp=8, sp=True, checkpointing="selective"
    ) == (pytest.approx(L * sbh * 34 / 8))
    assert korthikanti_activation_bytes(s, b, h, a, L, checkpointing="full") == 2 * L * sbh
    # fp32 activations: tensors double, the 1-byte dropout masks do not
    fp32 = korthikanti_activation_bytes(s, b, h, a, L, bytes_per_elem=4)
    assert fp32 == pytest.approx(L * (sbh * (64 + 2) + a * s * s * b * (8 + 1)))
    with pytest.raises(ValueError, match="checkpointing"):
        korthikanti_activation_bytes(s, b, h, a, L, checkpointing="some")


def test_inflight_microbatches():
    assert inflight_microbatches("gpipe", 4, 16) == 16
    assert [inflight_microbatches("1f1b", 4, 16, stage=i) for i in range(4)] == [4, 3, 2, 1]
    assert inflight_microbatches("1f1b", 4, 2) == 2
    p, v = 4, 2  # stage 0 holds L(1 + (p-1)/(p v)) layers = p + (p-1)/v stages' worth
    assert inflight_microbatches("interleaved-1f1b", p, 16, virtual_stages=v) == pytest.approx(
        p + (p - 1) / v
    )
    with pytest.raises(ValueError, match="stage"):
        inflight_microbatches("1f1b", 4, 8, stage=4)


def test_fits_with_headroom(toy):
    assert usable_bytes(toy) == int(80e9 * (1 - DEFAULT_HEADROOM))
    assert fits(70e9, toy) and not fits(75e9, toy)
    assert fits(75e9, toy, headroom=0.0)


# -- model spec ------------------------------------------------------------------------


def test_model_spec_matches_hf_parameter_counts():
    from planner.presets import build_model, load_config

    for name in ("llama-tiny", "gpt2-tiny", "gpt2"):
        config = load_config(name)
        n = sum(p.numel() for p in build_model(config).parameters())
        assert ModelSpec.from_hf_config(config).num_params == n, name
    # published sizes, from the config alone (no model built)
    assert ModelSpec.from_hf_config(load_config("llama3-8b")).num_params == 8_030_261_248
    assert ModelSpec.from_hf_config(load_config("llama3-70b")).num_params == 70_553_706_496
    mixtral = ModelSpec.from_hf_config(load_config("mixtral-8x7b"))
    assert (mixtral.num_params, mixtral.experts, mixtral.experts_per_token) == (
        46_702_792_704,
        8,
        2,
    )
    assert mixtral.active_params == 12_879_925_248
    qwen = ModelSpec.from_hf_config(load_config("qwen2-7b"))
    assert qwen.num_params == 7_615_616_512  # q/k/v carry biases in Qwen2
    assert ModelSpec.from_hf_config(load_config("gpt2")).tied_embeddings


def test_moe_and_tied_parameter_counts_against_built_models():
    from transformers import MixtralConfig, Qwen2Config

    from planner.presets import build_model

    for config in (
        MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                      num_experts_per_tok=2),
        Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    ):  # fmt: skip
        n = sum(p.numel() for p in build_model(config).parameters())
        assert ModelSpec.from_hf_config(config).num_params == n, config.model_type


def test_training_flops_and_mfu():
    from planner.presets import load_config

    spec = ModelSpec.from_hf_config(load_config("llama3-8b"))
    b, s = 8, 4096
    dense = 6 * (spec.num_params - spec.vocab * spec.hidden) * b * s  # the lookup table is free
    attention = 12 * 32 * s * 4096 * b * s
    assert training_flops(spec, b, s) == pytest.approx(dense + attention)
    assert training_flops(spec, b, s, causal=True) == pytest.approx(dense + attention / 2)
    # ~6 * 8e9 * tokens: within 20% of the textbook number at this sequence length
    assert 1.0 < training_flops(spec, b, s) / (6 * 8.03e9 * b * s) < 1.2
    gpt2 = ModelSpec.from_hf_config(load_config("gpt2"))  # tied: the head still multiplies
    assert gpt2.matmul_params == gpt2.num_params - 1024 * 768
    assert mfu(1e15, 1.0, 4, 1e15) == 0.25
    with pytest.raises(ValueError, match="step_time_s"):
        mfu(1e15, 0.0, 4, 1e15)


# -- step composition ------------------------------------------------------------------


def test_step_breakdown_fields_match_plan_schema():
    from planner.schema import TimeBreakdown

    b = compose_step([StageCost(1.0, 2.0)])
    assert {f.name for f in fields(StepBreakdown)} == set(TimeBreakdown.model_fields)
    TimeBreakdown(**b.as_dict())


def test_exposed_overlap():
    assert exposed(1.0, 10.0, layers=10) == pytest.approx(0.1)  # only the first prefetch shows
    assert exposed(10.0, 1.0, layers=10) == pytest.approx(1.0 + 0.9 * 9)  # comm-bound
    assert exposed(3.0, 0.0, layers=1) == 3.0
    # a CPU whose collectives need the compute's cores: the concurrent part shows too
    assert exposed(1.0, 10.0, layers=10, overlap_exposure=1.0) == pytest.approx(1.0)  # serialised
    assert exposed(1.0, 10.0, layers=10, overlap_exposure=0.5) == pytest.approx(0.1 + 0.9 * 0.5)
    assert exposed(10.0, 1.0, layers=10, overlap_exposure=1.0) == pytest.approx(10.0)
    # contention that also slows the compute costs more than the collective alone
    assert exposed(1.0, 10.0, layers=10, overlap_exposure=2.0) == pytest.approx(1.9)


def test_compose_step_charges_the_stage_overlap_exposure():
    hidden = StageCost(1.0, 2.0, gather_forward_s=0.4, gather_backward_s=0.4, layers=4)
    serial = StageCost(1.0, 2.0, gather_forward_s=0.4, gather_backward_s=0.4, layers=4,
                       overlap_exposure=1.0)
    assert compose_step([hidden]).exposed_communication_s == pytest.approx(0.2)  # first units only
    assert compose_step([serial]).exposed_communication_s == pytest.approx(0.8)
    assert load_profile("h100-sxm-80g").overlap_exposure == 0.0  # NCCL runs beside the kernels
    # FSDP2 issues its collectives synchronously on a CPU: a CPU profile that does not say
    # otherwise exposes them in full; one that does keeps its own figure
    assert load_profile({**TOY, "name": "toy-cpu", "device_type": "cpu"}).overlap_exposure == 1.0
    assert load_profile({**TOY, "name": "toy-cpu", "device_type": "cpu",
                         "overlap_exposure": 0.5}).overlap_exposure == 0.5


def test_compose_step_single_stage():
    st = StageCost(forward_compute_s=1.0, backward_compute_s=2.0, blocking_comm_s=0.5,
                   gather_forward_s=0.4, gather_backward_s=0.4, grad_reduce_s=4.0,
                   optimizer_s=0.3, layers=4)  # fmt: skip
    b = compose_step([st], microbatches=2)
    fwd = 0.1  # 0.4/4 exposed, rest hidden behind 1.0 s of forward compute
    bwd_mid = 0.1
    bwd_last = exposed(4.4, 2.0, 4)  # re-gathers + gradient reduction behind 2.0 s
    assert b.compute_s == pytest.approx(6.0)
    assert b.exposed_communication_s == pytest.approx(2 * 0.5 + 2 * fwd + bwd_mid + bwd_last)
    assert b.resharding_s == pytest.approx(1.0)
    assert b.communication_s == pytest.approx(2 * (0.5 + 0.8) + 4.0)
    assert b.pipeline_bubble_s == 0.0 and b.optimizer_s == 0.3
    total = b.compute_s + b.exposed_communication_s + b.pipeline_bubble_s + b.optimizer_s
    assert b.step_time_s == pytest.approx(total)


def test_compose_step_pipeline_bubble():
    stages = [StageCost(1.0, 2.0)] * 4
    m = 8
    gpipe = compose_step(stages, m, "gpipe")
    assert gpipe.pipeline_bubble_s == pytest.approx(3 * 3.0)  # (pp - 1) * stage time
    assert gpipe.step_time_s == pytest.approx((m + 3) * 3.0)
    assert compose_step(stages, m, "1f1b").step_time_s == gpipe.step_time_s
    inter = compose_step(stages, m, "interleaved-1f1b", virtual_stages=2)
    assert inter.pipeline_bubble_s == pytest.approx(3 * 3.0 / 2)
    # an unbalanced pipeline runs at its slowest stage
    slow = compose_step([StageCost(1.0, 2.0), StageCost(2.0, 4.0)], m, "1f1b")
    assert slow.compute_s == pytest.approx(m * 6.0) and slow.pipeline_bubble_s == pytest.approx(3.0)
    with pytest.raises(ValueError, match="virtual_stages"):
        compose_step(stages, m, "1f1b", virtual_stages=2)
    with pytest.raises(ValueError, match="StageCost.p2p_s"):
        StageCost(1.0, 1.0, p2p_s=-1)


def test_optimizer_time(toy):
    # mixed Adam: torch's foreach AdamW, 80 B/param in 8 passes; FSDP over 4 divides it
    assert optimizer_time(toy, 1e9) == pytest.approx(80e9 / 1e12)
    assert optimizer_time(toy, 1e9, shard_degree=4) == pytest.approx(20e9 / 1e12)
    # foreach: 8 ops for all tensors, each issued once (its kernels cover many tensors),
    # so many small tensors cost 8 launches, not 8 per tensor; DTensor's dispatch still
    # unwraps each tensor of every op
    small = 8 * toy.kernel_floor_s
    assert optimizer_time(toy, 1e3, tensors=300) == pytest.approx(small)
    dispatch = load_profile({**TOY, "name": "toy-dtensor", "dtensor_op_overhead_s": 4e-6})
    assert optimizer_time(dispatch, 1e3, tensors=300, dtensor=True) == pytest.approx(small + 8 * 300 * 4e-6)
    with pytest.raises(ValueError, match="tensors"):
        optimizer_time(toy, 1e9, tensors=0)


def test_optimizer_time_counts_torch_adamw_ops_per_tensor():
    # torch.optim.AdamW's per-tensor path on CPU: 9 ops per tensor moving 80 B/param in all
    cpu = load_profile({**TOY, "device_type": "cpu", "dtensor_op_overhead_s": 20e-6})
    bw = 0.5 * 2e12
    assert optimizer_time(cpu, 1e6, "adam-fp32", tensors=10) == pytest.approx(90 * 5e-6 + 80e6 / bw)
    # DTensor parameters pay DTensor's dispatch on each of the 90 ops
    assert optimizer_time(cpu, 1e6, "adam-fp32", tensors=10, dtensor=True) == pytest.approx(
        90 * 25e-6 + 80e6 / bw)
    # many small tensors cost more than one big one of the same size
    assert optimizer_time(cpu, 1e6, "adam-fp32", tensors=100) > optimizer_time(
        cpu, 1e6, "adam-fp32", tensors=1)
    # a calibrated profile's measured update bandwidth replaces the copy's for the bytes
    measured = load_profile({**TOY, "name": "toy-update", "device_type": "cpu", "update_bandwidth": 2e11})
    assert optimizer_time(measured, 1e6, "adam-fp32", tensors=10) == pytest.approx(90 * 5e-6 + 80e6 / 2e11)


def test_gpu_profiles_describe_8_gpu_nodes_on_infiniband():
    for name in ("a100-sxm-80g", "h100-sxm-80g", "h200-sxm-141g"):
        p = load_profile(name)
        assert [lv.devices for lv in p.levels] == [8, None], name
        nvlink, ib = p.levels
        assert nvlink.busbw.all_reduce > 4 * ib.busbw.all_reduce, name
        assert 46e9 <= ib.busbw.all_reduce <= 49e9, name
        assert p.gemm_efficiency[-1].efficiency <= 0.9, name  # never the full datasheet peak


def test_collective_latency_is_the_fixed_part(toy):
    s = 2**24
    for kind in KINDS:
        for mesh, dim in (([4], 0), ([8], 0), ([2, 4], 0)):
            lat = collective_latency(toy, kind, mesh, dim)
            assert collective_time(toy, kind, s, mesh, dim) == pytest.approx(
                lat + collective_time(toy, kind, s, mesh, dim, latency=False))
    assert collective_latency(toy, "all_reduce", [8], 0) == pytest.approx(1e-5 + 1e-4)  # two phases
    assert collective_latency(toy, "all_reduce", [1, 4], 0) == 0.0  # a size-1 dim costs nothing


def test_fsdp_latency_is_charged_per_collective_not_per_parameter(toy):
    # 12 all-gathers and 5 reduce-scatters per step on a dp dim of 4 inside one node
    gather, reduce = bucket_latency(toy, [4], [0], fsdp=True, gathers=12, reductions=5)
    assert gather == pytest.approx(12 * 1e-5) and reduce == pytest.approx(5 * 1e-5)
    # replicate-mode DP (HSDP): no gathers, one all-reduce per unit
    assert bucket_latency(toy, [4], [0], fsdp=False, gathers=12, reductions=5) == (0.0, pytest.approx(5e-5))
    assert bucket_latency(toy, [1, 4], [0], fsdp=True, gathers=12, reductions=5) == (0.0, 0.0)


def test_fsdp_gathers_per_unit_follow_fsdp2s_resharding():
    """A unit that reshards after forward gathers in every micro-batch's forward and
    backward; the root and the last block keep theirs (once per micro-batch).  Under a
    pipeline a backward leaves every unit gathered but the last: m + 1, and 1 if kept."""
    assert [fsdp_gathers(m, False, kept=False) for m in (1, 4)] == [2, 8]
    assert [fsdp_gathers(m, False, kept=True) for m in (1, 4)] == [1, 4]
    assert [fsdp_gathers(m, True, kept=False) for m in (1, 4)] == [2, 5]
    assert [fsdp_gathers(m, True, kept=True) for m in (1, 4)] == [1, 1]
    # 4 layers, the last kept, and the root: 3 x 2 + 2 per micro-batch (what FSDP2 ran
    # in the fidelity bench's FSDP step: _allgather_base_ 8)
    assert fsdp_step_gathers(1, False, 4, kept_layers=1) == 8
    assert fsdp_step_gathers(4, True, 4, kept_layers=2) == 2 * 5 + 2 + 1


def test_fsdp_copy_kernels_by_hand(toy):
    """FSDP2's copies per parameter (torch's _fsdp_collectives): an all-gather's copy-in of
    the shard (cast from fp32 under mixed precision: read 4, write 2; then read 2, write 2)
    over the shard count and its copy-out (read 2, write 2); a reduction's _chunk_cat of
    bf16 gradients into fp32 (read 2, write 4); a later micro-batch's reduced shard added
    to the first's (read 4 twice, write 4).  One rank has no flat buffer to copy out of,
    and copies the reduced buffer instead (read 4, write 4)."""
    assert fsdp_copy_bytes("adam-mixed", 8) == (2 * 2 + (4 + 2 + 2 * 2) / 8, 2 + 4, 12 / 8)
    assert fsdp_copy_bytes("adam-mixed", 1) == (4 + 2 + 2 * 2, 2 + 4 + 8, 12)
    assert fsdp_copy_bytes("adam-fp32", 8) == (2 * 4 + 2 * 4 / 8, 4 + 4, 12 / 8)  # no cast
    assert fsdp_copy_bytes("adam-fp32", 1) == (2 * 4, 4 + 4 + 8, 12)
    # more shards never copy more
    for opt in ("adam-mixed", "adam-fp32"):
        per = [sum(fsdp_copy_bytes(opt, n)) for n in (1, 2, 8, 64)]
        assert per == sorted(per, reverse=True)
    # 3e9 parameter-gathers, 1e9 parameters reduced twice (once accumulated), at the toy's
    # 0.5 x 2 TB/s copy rate
    assert fsdp_copy_time(toy, "adam-mixed", 8, 3e9, 1e9, reductions=2) == pytest.approx(
        (3e9 * 5.25 + 1e9 * (2 * 6 + 1.5)) / 1e12)
    assert fsdp_copy_time(load_profile("cpu-gloo-local"), "adam-mixed", 8, 3e9, 1e9) == 0  # in fsdp_overhead


def _llama3_8b_parameters() -> tuple[int, int, int]:
    """Parameters of one Llama 3 8B layer, of its embeddings (as many in the untied head),
    and of its final norm, by hand."""
    from planner.presets import load_config

    config = load_config("llama3-8b")
    h, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    kv = config.num_key_value_heads * h // config.num_attention_heads
    layer = h * (2 * h + 2 * kv) + 3 * h * f + 2 * h  # q, o, k, v, gate, up, down, two norms
    assert ModelSpec.from_hf_config(config).num_params == 32 * layer + 2 * v * h + h
    return layer, v * h, h


@pytest.mark.parametrize("microbatches", [1, 2])
def test_fsdp_copies_are_in_a_gpu_plans_compute(microbatches):
    """The only compute a fully sharded data-parallel layout adds over a replicated one of
    the same local batch is the copies' difference (GPU profiles have no FSDP2 host time):
    per micro-batch, every layer's unit gathers twice and reduces once, the last layer's
    and the root's (embeddings, head, final norm) gather once."""
    import planner

    kw = dict(batch_size=8 * microbatches, seq_len=4096, microbatches=microbatches,
              require_fit=False)  # replicated, the states need 128 GB
    shard = planner.estimate("llama3-8b", 8, "h100-sxm-80g", dp=8, fsdp=True, **kw).time
    whole = planner.estimate("llama3-8b", 8, "h100-sxm-80g", dp=8, **kw).time
    layer, embeddings, norm = _llama3_8b_parameters()
    root = 2 * embeddings + norm  # the root's unit: embeddings, head, final norm
    params = 32 * layer + root
    gathered = microbatches * (31 * 2 * layer + layer + root)  # the last layer and the root gather once

    def copies(n: int) -> float:
        return fsdp_copy_time(load_profile("h100-sxm-80g"), "adam-mixed", n, gathered, params, microbatches)

    assert copies(1) - copies(8) > 0.03 * microbatches  # ~46 ms a micro-batch: 34 against 16.6 B a parameter
    assert whole.compute_s - shard.compute_s == pytest.approx(copies(1) - copies(8), rel=1e-4)


def test_fsdp_copies_of_a_pipeline_stage():
    """Under a pipeline a stage's unkept layers gather m + 1 times, its last layer and its
    root (the embeddings on the first stage, the head and norm on the last) once, and every
    gradient is reduced once (torch's schedules; cost_model.step.fsdp_gathers)."""
    import planner

    m, kw = 4, dict(batch_size=16, seq_len=4096, microbatches=4, require_fit=False)
    shard = planner.hand_plan("llama3-8b", 8, "h100-sxm-80g", dp=4, pp=2, fsdp=True, **kw)
    whole = planner.hand_plan("llama3-8b", 8, "h100-sxm-80g", dp=4, pp=2, **kw)
    layer, embeddings, norm = _llama3_8b_parameters()
    roots = (embeddings, embeddings + norm)  # the first stage's embeddings; the last's head and norm
    profile = load_profile("h100-sxm-80g")

    def difference(stage) -> float:  # its copies replicated less fully sharded, per step
        n = sum(mod.startswith("model.layers.") for mod in stage.modules)
        weights = n * layer + roots[stage.index]
        gathered = weights + (n - 1) * m * layer
        return (fsdp_copy_time(profile, "adam-mixed", 1, gathered, weights)
                - fsdp_copy_time(profile, "adam-mixed", 4, gathered, weights))

    assert [len(s.modules) for s in shard.pipeline.stages] == [len(s.modules) for s in whole.pipeline.stages]
    # the step's compute is its slowest stage's
    got = whole.prediction.time.compute_s - shard.prediction.time.compute_s
    assert any(got == pytest.approx(difference(s), rel=1e-4) for s in shard.pipeline.stages), (
        got, [difference(s) for s in shard.pipeline.stages])


def test_gradient_reduction_in_every_micro_batch_hides_behind_each_backward():
    """Without a pipeline the data-parallel reduction runs in every micro-batch's backward,
    a share behind each; under one only in the last's, where it outlasts the compute."""
    once = StageCost(1.0, 2.0, grad_reduce_s=8.0, layers=4)
    each = StageCost(1.0, 2.0, grad_reduce_s=8.0, layers=4, grad_reduce_parts=4)
    # last backward: 8 s over 4 units behind 0.5 s each; in each of 4: 2 s behind 0.5 s each
    assert compose_step([once], microbatches=4).exposed_communication_s == pytest.approx(2 + 1.5 * 3)
    assert compose_step([each], microbatches=4).exposed_communication_s == pytest.approx(4 * 0.5)
    assert compose_step([each], microbatches=4).communication_s == pytest.approx(8.0)  # the step's total
    with pytest.raises(ValueError, match="grad_reduce_parts"):
        StageCost(1.0, 2.0, grad_reduce_parts=0)
    with pytest.raises(ValueError, match="grad_reduce_parts: 4 is neither 1 nor microbatches=2"):
        compose_step([each], microbatches=2)
    # a pipeline stage reduces after its last backward (torch's perform_reduce_grad): all exposed
    after = StageCost(1.0, 2.0, grad_reduce_s=8.0, layers=4, grad_reduce_overlapped=False)
    assert compose_step([after, after], microbatches=4).exposed_communication_s == pytest.approx(8.0)


def test_loss_mean_and_partial_gradients(toy):
    s = 2**24
    # executor.data: all-reduce of the 4-byte loss per dp dim (logits are gathered only if read)
    assert loss_mean_time(toy, [4, 2], [0]) == pytest.approx(collective_time(toy, "all_reduce", 4, [4, 2], 0))
    assert loss_mean_time(toy, [4], []) == 0.0
    # executor.apply reduces each Partial gradient once, to the parameter's placements
    grads = [("all_reduce", s, 1), ("reduce_scatter", 2 * s, 1)]
    one = collective_time(toy, "all_reduce", s, [2, 4], 1) + collective_time(toy, "reduce_scatter", 2 * s, [2, 4], 1)
    assert partial_grad_time(toy, [2, 4], grads) == pytest.approx(one)
    assert partial_grad_time(toy, [2, 4], []) == 0.0
    # the all-reduces on one dim go out as one, of their concatenation (one latency)
    norms = [("all_reduce", 1024, 1)] * 9
    assert partial_grad_time(toy, [2, 4], norms) == pytest.approx(
        collective_time(toy, "all_reduce", 9 * 1024, [2, 4], 1))
    # ... unless FSDP2 owns the gradients (data-parallel dims): one each
    assert partial_grad_time(toy, [2, 4], norms, bucketed=False) == pytest.approx(
        9 * collective_time(toy, "all_reduce", 1024, [2, 4], 1))


def test_profile_numbers_are_numbers_and_whole_floats_are_ints():
    """Strict: a bool or a string where a number goes is refused (memory_bytes true was
    1 byte); a whole float for an int is its int, as JSON clients send 80e9 (code review)."""
    from pydantic import ValidationError

    from cost_model.profile import load_profile

    base = {**load_profile("h100-sxm-80g").model_dump(mode="json"), "name": "mine"}
    assert load_profile({**base, "memory_bytes": 80e9}).memory_bytes == 80_000_000_000
    for bad in (True, "80000000000", 80e9 + 0.5):
        with pytest.raises(ValidationError, match="memory_bytes"):
            load_profile({**base, "memory_bytes": bad})


def _synced(groups: dict[int, tuple[float, list[tuple[float, float]]]]) -> Profile:
    return Profile.model_validate({**load_profile("cpu-gloo-local").model_dump(), "name": "synced", "sync_cost": [
        {"size": g, "held_s": held, "points": [{"compute_s": t, "added_s": a} for t, a in pts]}
        for g, (held, pts) in groups.items()]})


def test_sync_correction_is_what_synchronising_adds_after_the_compute_less_what_the_price_holds():
    """Hand-computed: synchronising adds 1 ms after no compute, 3 ms after 10 ms and 9 ms
    after 40 ms (linear between, the last point's beyond); the prices hold 2 ms."""
    prof = _synced({2: (0.002, [(0.0, 0.001), (0.01, 0.003), (0.04, 0.009)])})
    assert sync_correction(prof, 2, 0.02) == pytest.approx(0.003 + 0.006 / 3 - 0.002)
    assert sync_correction(prof, 2, 0.0) == pytest.approx(-0.001)  # right after another collective
    assert sync_correction(prof, 2, 0.1) == pytest.approx(0.009 - 0.002)  # held past the last point
    corrections = [sync_correction(prof, 2, t) for t in (0.0, 0.001, 0.005, 0.01, 0.03, 0.1, 1.0)]
    assert corrections == sorted(corrections)  # more compute never costs less here
    assert sync_correction(prof, 1, 0.02) == 0.0
    # none on a GPU profile: a rank per device
    assert all(not load_profile(name).sync_cost for name in shipped_profiles() if "cpu" not in name)
    assert sync_correction(load_profile("h100-sxm-80g"), 8, 0.05) == 0.0


def test_sync_correction_takes_the_largest_measured_group_not_above_its_own():
    prof = _synced({2: (0.0, [(0.0, 0.0), (0.01, 0.001)]), 4: (0.0, [(0.0, 0.0), (0.01, 0.003)])})
    assert sync_correction(prof, 2, 0.005) == pytest.approx(0.0005)
    assert sync_correction(prof, 3, 0.005) == pytest.approx(0.0005)
    assert sync_correction(prof, 8, 0.005) == pytest.approx(0.0015)
    only4 = _synced({4: (0.0, [(0.0, 0.0), (0.01, 0.003)])})
    assert sync_correction(only4, 2, 0.005) == pytest.approx(0.0015)


@pytest.mark.parametrize("points", [[(0.04, 0.004), (0.01, 0.002)], [(0.01, 0.002), (0.04, 0.004)], [(0.0, 0.001)]])
def test_sync_cost_errors_name_the_field(points):
    with pytest.raises(ValidationError, match=r"sync_cost\.0\.points"):
        _synced({2: (0.0, points)})


def test_sync_cost_group_sizes_are_distinct():
    data = _synced({2: (0.0, [(0.0, 0.0), (0.01, 0.001)])}).model_dump()
    data["sync_cost"].append(data["sync_cost"][0])
    with pytest.raises(ValidationError, match=r"sync_cost\n.*group sizes must be distinct"):
        Profile.model_validate(data)
