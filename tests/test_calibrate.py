"""Calibration: the fit recovers a known model exactly; a real (small) run writes a usable profile."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch

from cost_model.calibrate import (
    _UPDATE_NUMEL,
    ATTENTION_SHAPES,
    COLD_BYTES,
    COLUMN_SIZES,
    COPY_BYTES,
    FRESH_ALLOC_BYTES,
    OperandSizes,
    _adamw_ops,
    _note_other_load,
    calibrate,
    fit_collectives,
    fit_group,
    last_level_cache_bytes,
    measure_fresh_pages,
    measure_op_overhead,
    profile_from_job,
)
from cost_model.comm import bus_factor, collective_time
from cost_model.profile import COLLECTIVE_KINDS, load_profile


def test_fit_recovers_latency_and_busbw_of_synthetic_samples():
    latency = 3e-4
    busbw = {k: (i + 1) * 1e9 for i, k in enumerate(COLLECTIVE_KINDS)}
    samples = [
        (k, w, n, latency + n * bus_factor(k, w) / busbw[k])
        for k in COLLECTIVE_KINDS
        for w in (2, 4)
        for n in (2**16, 2**20, 2**23)
    ]
    got_latency, got_busbw, unfit = fit_collectives(samples)
    assert unfit == []
    assert got_latency == pytest.approx(latency, rel=1e-6)
    for k in COLLECTIVE_KINDS:
        assert got_busbw[k] == pytest.approx(busbw[k], rel=1e-6)


def test_fit_falls_back_when_noise_hides_the_bandwidth():
    # all_gather runs faster than the latency every other kind shows (noise):
    # no positive slope explains it
    samples = [(k, 2, n, 1e-4 + n / 1e9) for k in COLLECTIVE_KINDS for n in (2**16, 2**20)]
    samples = [s for s in samples if s[0] != "all_gather"]
    samples += [("all_gather", 2, 2**16, 5e-5), ("all_gather", 2, 2**20, 4e-5)]
    _, busbw, unfit = fit_collectives(samples)
    assert unfit == ["all_gather"]
    # the fallback bandwidth is the median of S*f(n)/t over its two samples
    assert busbw["all_gather"] == pytest.approx((2**15 / 5e-5 + 2**19 / 4e-5) / 2)
    assert busbw["all_reduce"] == pytest.approx(1e9 / bus_factor("all_reduce", 2), rel=1e-6)


def test_fit_refits_until_every_kind_has_a_bandwidth():
    # every kind got faster with size (a machine getting quieter during the run): the
    # first fit leaves all_reduce a slope, the refit without the other two takes it away
    samples = [("all_reduce", 2, 2**16, 0.017), ("all_reduce", 2, 2**20, 0.015),
               ("all_gather", 2, 2**16, 0.009), ("all_gather", 2, 2**20, 0.006),
               ("reduce_scatter", 2, 2**16, 0.011), ("reduce_scatter", 2, 2**20, 0.009)]
    latency, busbw, unfit = fit_collectives(samples)
    assert sorted(unfit) == ["all_gather", "all_reduce", "reduce_scatter"]
    assert latency == 0.0 and all(bw > 0 for bw in busbw.values())


def test_group_fit_recovers_a_latency_per_kind():
    latency = {k: (i + 1) * 1e-4 for i, k in enumerate(COLLECTIVE_KINDS)}
    busbw = {k: (i + 1) * 1e9 for i, k in enumerate(COLLECTIVE_KINDS)}
    samples = [(k, 4, n, latency[k] + n * bus_factor(k, 4) / busbw[k])
               for k in COLLECTIVE_KINDS for n in (2**16, 2**20, 2**23, 2**26)]
    got_latency, got_busbw, unfit = fit_group(samples)
    assert unfit == []
    for k in COLLECTIVE_KINDS:
        assert got_latency[k] == pytest.approx(latency[k], rel=1e-6)
        assert got_busbw[k] == pytest.approx(busbw[k], rel=1e-6)


def test_fit_excludes_the_staging_pages_comm_adds_back():
    """Collectives timed with gloo's staging buffer's fresh pages in them (all-gather and
    reduce-scatter from 32 MiB): the fitted profile gives back latency + bandwidth + those
    pages exactly; without the subtraction the 64 MiB pages would skew busbw."""
    latency, busbw, byte_s = 2e-3, {k: (i + 1) * 1e8 for i, k in enumerate(COLLECTIVE_KINDS)}, 1e-9
    sizes = (2**16, 2**20, 2**23, 2**26)

    def measured(k: str, n: int) -> float:
        pages = n * byte_s if k in ("all_gather", "reduce_scatter") and n >= FRESH_ALLOC_BYTES else 0.0
        return latency + n * bus_factor(k, 4) / busbw[k] + pages

    rank = {"floor": 2e-6, "dtensor": 3e-5, "redistribute": 1e-3, "bandwidth": 1e10, "update": 6e9,
            "fresh_pages": byte_s, "exp": 5e8, "attention": [(1e6, 8e9), (1e8, 2e10)], "node_host": 1e-4,
            "dtensor_node": 2e-4, "fp32": [(1e6, 2e10), (1e9, 4e10)], "bf16": None, "columns": [(32, 0.5), (256, 1.0)],
            "fsdp": {"replicate": (1e-3, 1e-10), "fully_shard": (2e-3, 2e-10)},
            "operands": {"cache": 2**25, "gemm_pool": 2**26, "copy": 2**24, "update_tensors": 4}}
    result = {"ranks": 4, "device": [rank] * 4,
              "collectives": {4: [(k, n, measured(k, n)) for k in COLLECTIVE_KINDS for n in sizes]}}
    profile = profile_from_job("synthetic", result, sizes, progress=lambda _: None)
    assert profile.fresh_page_byte_s == byte_s and profile.fresh_alloc_bytes == FRESH_ALLOC_BYTES
    (group,) = profile.levels[0].groups
    for k in COLLECTIVE_KINDS:
        assert getattr(group.busbw, k) == pytest.approx(busbw[k], rel=1e-6)
        for n in sizes:
            assert collective_time(profile, k, n, [4], 0) == pytest.approx(measured(k, n), rel=1e-6)


def _cache(cpu_dir, index, level, kind, size, shared):
    d = cpu_dir / "cache" / f"index{index}"
    d.mkdir(parents=True)
    for name, value in (("level", level), ("type", kind), ("size", size), ("shared_cpu_list", shared)):
        (d / name).write_text(f"{value}\n")


def test_last_level_cache_counts_each_instance_of_the_highest_level_once(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    for layout, shared in (("one", lambda cpu: "0-3"), ("per-pair", lambda cpu: cpu // 2)):
        for cpu in range(4):  # private L1 and L2; a 32 MiB L3 shared by the CPUs `shared` names alike
            _cache(tmp_path / layout / f"cpu{cpu}", 0, 1, "Data", "48K", cpu)
            _cache(tmp_path / layout / f"cpu{cpu}", 1, 1, "Instruction", "32K", cpu)
            _cache(tmp_path / layout / f"cpu{cpu}", 2, 2, "Unified", "2M", cpu)
            _cache(tmp_path / layout / f"cpu{cpu}", 3, 3, "Unified", "32768K", shared(cpu))
    assert last_level_cache_bytes(tmp_path / "one") == 32 * 2**20
    assert last_level_cache_bytes(tmp_path / "per-pair") == 2 * 32 * 2**20
    assert last_level_cache_bytes(tmp_path / "absent") == 0


def test_operands_overflow_the_last_level_cache_twice_over_all_ranks(monkeypatch):
    monkeypatch.setattr("cost_model.calibrate.last_level_cache_bytes", lambda: 300 * 2**20)
    sizes = OperandSizes.for_job(4)  # the lent 16-core machine: 4 ranks share 300 MiB of L3
    assert sizes.gemm_pool == 150 * 2**20
    assert sizes.copy == 75 * 2**20  # read and written: 150 MiB per rank
    assert sizes.update_tensors == 9  # of 2^20 elements and 4 fp32 states: 144 of the 150 MiB
    monkeypatch.setattr("cost_model.calibrate.last_level_cache_bytes", lambda: 32 * 2**20)
    small = OperandSizes.for_job(4)  # this machine: the floors already overflow it
    assert (small.gemm_pool, small.copy, small.update_tensors) == (COLD_BYTES, COPY_BYTES, 4)
    # a VM listing each of 64 vCPUs' 300 MiB as its own: capped at 1/8 of the free memory per rank
    monkeypatch.setattr("cost_model.calibrate.last_level_cache_bytes", lambda: 64 * 300 * 2**20)
    monkeypatch.setattr("psutil.virtual_memory", lambda: type("Memory", (), {"available": 16 * 2**30})())
    assert OperandSizes.for_job(4).gemm_pool == 16 * 2**30 // 8 // 4


def test_fresh_pages_are_measured_in_a_process_whose_heap_has_room():
    # A long-running rank's heap grows and fragments; glibc then serves a 64 MB block
    # from a free heap chunk whose pages exist, and a fresh-vs-reused fill measured
    # through torch.empty read 0 there (the fidelity bench's ranks after training).
    # Here: the mmap threshold raised to 30 MB by freeing such a block, 320 MB taken
    # from the heap below a live block and freed.
    del_me = torch.empty(30 * 2**20 // 4)
    del del_me
    blocks = [torch.empty(8 * 2**20 // 4) for _ in range(40)]
    above = torch.empty(2**20 // 4)
    del blocks
    try:
        assert measure_fresh_pages() > 1e-11  # 0.3-0.5 ms/MB here, one rank alone
    finally:
        del above


def test_dtensor_op_extra_is_priced_on_model_sized_shards_against_the_same_plain_kernels(monkeypatch):
    # DTensor's Python code runs several times slower after a kernel that streamed the
    # core's L2 (as in a step) than between tiny ops, so its extra per op is measured on
    # AdamW steps over shards of a model's size, against plain parameters as large so
    # that the kernels cancel.  The timer is stubbed: each AdamW step records the local
    # sizes it updates and costs 1 ms, plus 40 us per op on DTensors; the add costs 5 us.
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    seen: dict[bool, set[int]] = {True: set(), False: set()}

    def timed(fn, window_s=0.04, windows=9):
        opt = getattr(fn, "__self__", None)
        if not isinstance(opt, torch.optim.Optimizer):
            return 5e-6
        params = opt.param_groups[0]["params"]
        dtensor = isinstance(params[0], DTensor)
        seen[dtensor].update((p.to_local() if dtensor else p).numel() for p in params)
        return 1e-3 + (_adamw_ops(len(params)) * 40e-6 if dtensor else 0.0)

    monkeypatch.setattr("cost_model.calibrate._median_time", timed)
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        floor, extra = measure_op_overhead(2)
    finally:
        dist.destroy_process_group()
    assert floor == 5e-6 and extra == pytest.approx(40e-6)
    assert seen[True] == seen[False] == {_UPDATE_NUMEL}


def test_other_work_is_noted_before_measuring_by_the_cores_busy_now(monkeypatch):
    """Before the job the note reads the cores' use now, not the one-minute load average,
    which still counts a job that ended a minute ago (it warned after every earlier
    calibrate): with every core spinning it speaks, and of the cores, not of the (here
    absurd) average.  That it keeps quiet on idle cores is not asserted: a shared test
    machine's cores are not reliably idle."""
    cpus = os.cpu_count() or 1
    monkeypatch.setattr(os, "getloadavg", lambda: (4.0 * cpus,) * 3)
    notes: list[str] = []
    spin = "print('spinning', flush=True)\nwhile True: pass"
    spinners = [subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE, text=True)
                for _ in range(cpus)]
    try:
        for p in spinners:  # each interpreter is up and spinning before the sample
            assert p.stdout is not None and p.stdout.readline() == "spinning\n"
        _note_other_load(notes.append, "before measuring", own=0)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert len(notes) == 1 and f"of {cpus} cores busy before measuring: other work is running" in notes[0]


def test_calibrate_argument_errors(tmp_path):
    with pytest.raises(ValueError, match="world_sizes"):
        calibrate(tmp_path / "x.json", world_sizes=(1,))
    with pytest.raises(ValueError, match=r"world_sizes: every group size must divide the largest, got \[3, 4\]"):
        calibrate(tmp_path / "x.json", world_sizes=(3, 4))
    with pytest.raises(ValueError, match="message_sizes"):
        calibrate(tmp_path / "x.json", message_sizes=(2**16,))


def test_calibrate_small_run_writes_a_loadable_profile(tmp_path):
    messages: list[str] = []
    out = tmp_path / "here.json"
    profile = calibrate(
        out, world_sizes=(2,), progress=messages.append, message_sizes=(2**16, 2**20)
    )
    assert load_profile(out) == profile
    assert profile.name == "here" and profile.device_type == "cpu"
    assert profile.peak_flops["fp32"] > 1e9  # any CPU that runs torch does a GFLOP/s
    assert all(0 < p.efficiency <= 1 for p in profile.gemm_efficiency)
    # eager dispatch costs a CPU rank between a tenth of a microsecond and a millisecond
    assert 1e-7 < profile.kernel_floor_s < 1e-3 and profile.dtensor_op_overhead_s < 1e-2
    # a DTensor redistribution's Python around its collective: more than nothing, less than 0.1 s
    assert 0 < profile.dtensor_redistribute_s < 0.1
    # a fresh 64 MB allocation's pages cost more than nothing, less than 100 ns per byte
    assert 0 < profile.fresh_page_byte_s < 1e-7 and profile.fresh_alloc_bytes == FRESH_ALLOC_BYTES
    # the 2-process group was measured and is what comm uses for it
    (level,) = profile.levels
    assert [g.size for g in level.groups] == [2]
    assert any("groups of [2]" in m for m in messages) and messages[-1].startswith("wrote")
    # the ranks' phases reach the caller as they start, with the seconds since the job began
    phases = [re.fullmatch(r"  \[ *\d+ s\] (.+) \.\.\.", m) for m in messages[1:-1]]
    names = ["collectives in groups of 2", "synchronisation after compute", "op dispatch", "GEMMs", "memory", "fused attention", "host time"]
    started = [m[1] for m in phases if m]
    assert len(started) == len(names), started
    assert all(s.startswith(n) for s, n in zip(started, names, strict=True)), started
    # FSDP2's collectives are synchronous on a CPU: nothing hides behind compute, and the
    # profile says why
    assert profile.overlap_exposure == 1.0 and "synchronously" in profile.source
    # the fitted profile predicts a 1 MB all-reduce between 2 processes within an order of magnitude
    t = collective_time(profile, "all_reduce", 2**20, [2], 0)
    assert 1e-6 < t < 1.0
    group = level.groups[0]
    assert t == pytest.approx(group.latency_s.all_reduce + 2**20 / group.busbw.all_reduce)
    # the CPU-only constants: exps per second no more than 10x a copy's elements per second
    # (4 bytes read + 4 written each), fused attention at most the GEMM peak, eager host
    # time per graph node above a bare add's, FSDP2's host work for both data-parallel modes
    assert 0 < profile.transcendental_rate < profile.memory_bandwidth / 8 * 10
    # AdamW's update moves its bytes, within a factor of 4 of a copy's speed (0.6x on a
    # lent 16-core machine, 1.4-1.5x here with 4 ranks at once)
    assert profile.memory_bandwidth / 4 < profile.update_bandwidth < profile.memory_bandwidth * 4
    # fused attention by work per head, measured at every shape (how it grows is not
    # asserted: a small run is noisy)
    assert [p.head_flops for p in profile.attention_curve] == [2.0 * s * s * d for *_, s, d in ATTENTION_SHAPES]
    # narrow GEMM outputs, measured for every width; the narrowest is the slowest relative
    # to the curve (a half-speed 32-column output here; loose, a small run is noisy)
    columns = {p.columns: p.factor for p in profile.gemm_columns}
    assert sorted(columns) == list(COLUMN_SIZES)
    assert columns[COLUMN_SIZES[0]] < columns[COLUMN_SIZES[-1]]
    assert profile.node_host_s > profile.kernel_floor_s
    # DTensor activations (tensor parallel over the 2 ranks, on a fake process group) add
    # host time per node (~150 us here, against ~5 us of a 1-element add; the measurement
    # clamps at 0, so a broken one reads 0)
    assert profile.dtensor_node_host_s > profile.kernel_floor_s
    assert set(profile.fsdp_overhead) == {"replicate", "fully_shard"}
    assert all(o.unit_s + o.byte_s > 0 for o in profile.fsdp_overhead.values())
    # what synchronising a group costs after compute, for the group size measured: a point
    # at no compute and one per length of calibrate's chunks; the prices hold some of it
    (sync,) = profile.sync_cost
    assert sync.size == 2 and [p.compute_s > 0 for p in sync.points] == [False, True, True, True]
    assert 0 <= sync.held_s < 1.0
    assert any(m.startswith("  synchronising groups of 2 adds") for m in messages)


def test_ctrl_c_stops_every_rank_at_once(tmp_path):
    """SIGINT (Ctrl-C reaches the whole process group) killed some ranks mid-collective;
    the others waited in gloo and the interpreter's exit joined them for its 30-minute
    timeout, then left them running (review).  Now the ranks ignore it and the parent
    stops them: one line, status 130, no process left."""
    # SIGINT at its default, as at a terminal: a shell's background job (`cmd &` without job
    # control, as CI may be started) runs with SIGINT ignored, which a child inherits and
    # keeps, so calibrate rightly ignores Ctrl-C there (this test timed out so twice)
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "calibrate", "-o", str(tmp_path / "p.json")],
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    parent = psutil.Process(proc.pid)

    def ranks() -> list[psutil.Process]:  # torch.multiprocessing's spawned ranks (not its resource tracker)
        return [p for p in parent.children() if "spawn_main" in " ".join(p.cmdline())]

    deadline = time.monotonic() + 60
    while len(ranks()) < 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    started = ranks()
    assert len(started) == 4, started  # else the check below would pass on no ranks at all
    time.sleep(2)  # into the ranks' start-up and first measurements
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and err.strip().endswith("meshplan: interrupted"), err
    assert "Traceback" not in err
    assert not [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
