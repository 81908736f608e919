"""Pipelined training (executor.pipeline) against one device: step time per schedule.

A small Llama (8 layers, attention dropout on, fp32, AdamW) trains on gloo CPU processes
under planner-made plans with a forced mesh, the schedule swapped as a user may:

* ``single``: one process, a 1-device plan (the reference);
* ``pp2 <schedule>``: 2 stages on 2 processes (GPipe, 1F1B, interleaved 1F1B);
* ``pp2xdp2 fsdp 1f1b``: 2 stages x 2 FSDP ranks on 4 processes;
* ``pp2xtp2 megatron 1f1b``: 2 stages x 2 tensor-parallel ranks on 4 processes.

Each setup is one spawn (so peak RSS is that setup's); the table gives the median step
time after warm-up, tokens/s, the ratio to ``single``, the rank-max peak RSS and whether
the losses match ``single`` (max relative difference).  On a 2-core machine more
processes than cores measure contention, not speed-up: read the ratios next to the load
average printed with the table.

    python -m bench.pipeline [--steps 8] [--warmup 2]
"""

from __future__ import annotations

import argparse
import os
import queue
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import executor
import planner
from planner.presets import PRESETS, build_model, load_config
from planner.schema import Plan
from tests._dist import pipeline_variant

CONFIG = {**PRESETS["llama-tiny"], "vocab_size": 512, "hidden_size": 64, "intermediate_size": 256,
          "num_hidden_layers": 8, "attention_dropout": 0.1}
BATCH, SEQ, SEED = 16, 64, 1234


def _planned(mesh: dict[str, int] | None) -> Plan:
    devices = 1 if mesh is None else mesh["pp"] * mesh["dp"]
    return planner.plan(CONFIG, devices=devices, profile="cpu-gloo-local", batch_size=BATCH, seq_len=SEQ,
                        mesh=mesh)


def _train(plan_json: str, steps: int, warmup: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    with executor.rng.suspended():
        g = torch.Generator().manual_seed(7)
        data = [torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=g) for _ in range(steps)]
    executor.rng.manual_seed(SEED)
    model = executor.apply(Plan.from_json(plan_json), build_model(load_config(CONFIG), device="cpu").train())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    losses, times = [], []
    for x in data:
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    return {"losses": losses, "step_s": statistics.median(times[warmup:]), "rss": _peak_rss()}


def _peak_rss() -> int:
    """This process's peak RSS.  Not getrusage's ru_maxrss: Linux keeps that across exec, so
    a spawned rank would report its parent's peak (the planner's) when that is higher."""
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return kib * 1024


def _rank(rank: int, world: int, port: int, plan_json: str, steps: int, warmup: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = _train(plan_json, steps, warmup)
    out.put((rank, result))
    dist.barrier()
    dist.destroy_process_group()


def _spawn(world: int, plan_json: str, steps: int, warmup: int) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, port, plan_json, steps, warmup, out)) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    while len(results) < world:  # a rank that dies (a bad plan) must not leave the bench waiting
        try:
            rank, result = out.get(timeout=5)
            results[rank] = result
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise SystemExit(f"a rank failed (exit code {dead[0]}); its traceback is above") from None
    for p in procs:
        p.join()
    return {"losses": results[0]["losses"], "step_s": max(r["step_s"] for r in results.values()),
            "rss": max(r["rss"] for r in results.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    pp2, pp2xdp2 = _planned({"pp": 2, "dp": 1}), _planned({"pp": 2, "dp": 2})
    setups = {"single": (1, _planned(None).to_json())}
    for schedule in ("gpipe", "1f1b", "interleaved-1f1b"):
        setups[f"pp2 {schedule}"] = (2, pipeline_variant(pp2, schedule, "replicate", "none"))
    setups["pp2xdp2 fsdp 1f1b"] = (4, pipeline_variant(pp2xdp2, "1f1b", "fully_shard", "none"))
    setups["pp2xtp2 megatron 1f1b"] = (4, pipeline_variant(pp2xdp2, "1f1b", "tp", "none"))
    rows = {}
    for name, (world, plan_json) in setups.items():
        rows[name] = _train(plan_json, args.steps, args.warmup) if world == 1 else \
            _spawn(world, plan_json, args.steps, args.warmup)
    ref = rows["single"]
    print(f"Llama {CONFIG['num_hidden_layers']} layers, hidden {CONFIG['hidden_size']}, batch {BATCH} x {SEQ}, "
          f"{args.steps} steps ({args.warmup} warm-up), load average {os.getloadavg()[0]:.1f}")
    print(f"{'setup':<24}{'step ms':>9}{'tokens/s':>10}{'vs single':>10}{'peak RSS MiB':>14}{'max rel loss diff':>19}")
    for name, r in rows.items():
        diff = max(abs(a - b) / abs(b) for a, b in zip(r["losses"], ref["losses"], strict=True))
        print(f"{name:<24}{r['step_s'] * 1e3:>9.1f}{BATCH * SEQ / r['step_s']:>10.0f}"
              f"{ref['step_s'] / r['step_s']:>9.2f}x{r['rss'] / 2**20:>14.0f}{diff:>19.1e}")


if __name__ == "__main__":
    main()
