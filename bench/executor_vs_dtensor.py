"""executor.apply against a TorchTitan-style DTensor setup: the same Llama, mesh and loop.

Three setups train the same small Llama (fp32, attention dropout on, AdamW, the same
global batch and sequence length):

(a) ``titan``:   TorchTitan's Llama plan rebuilt with ``parallelize_module`` (embedding
                 rowwise, norms SequenceParallel, attention/MLP inputs gathered with
                 PrepareModuleInput, q/k/v/gate/up colwise, o/down rowwise to Shard(1),
                 lm_head colwise with its default loss parallelism: logits left
                 vocabulary-sharded, the step under ``loss_parallel()``) and FSDP2
                 ``fully_shard`` per block and root, on dp x tp;
(b) ``forced``:  ``executor.apply`` with that layout (tests/_dist.make_plan: FSDP on dp,
                 Megatron TP + sequence parallel on tp);
(c) ``planned``: ``executor.apply`` with ``planner.plan(..., profile="cpu-gloo-local")``.

Part 1 runs the three setups on the same 4 gloo processes, their steps taking turns (a
shared machine's changing load then hits all alike), and prints tokens/s, the median step
time (warm-up excluded) and the ratios; peak RSS per rank comes from a short run of each
setup alone in fresh processes.  It also prints the CPU time all 4 ranks spend per step
(the processes', gloo's threads included) and how busy that keeps the machine's cores:
with more ranks than cores a step is bound by the work all ranks do, so a setup is
faster only by doing less.
Part 2 measures eager overhead: CPU time per step of (a) and (b) in ONE process with
torch's fake process group at world size 4 (collectives cost nothing), next to the plain
local model with this rank's shard shapes, steps interleaved so background load hits all
alike.  A fourth row wraps that local model in FSDP2 on the dp dim, as (a) and (b) wrap
theirs: torch's FSDP2 alone, which both setups pay, so that the share tensor parallelism
adds is visible beside it.

    python -m bench.executor_vs_dtensor [--steps 12] [--warmup 3] [--part 1|2]
                                        [--eager-rng] [--hidden 256]

``--hidden`` sizes the Llama (8 heads / 4 KV heads of hidden/8, FFN 4 x hidden): the
per-op overheads are fixed, so their share of a step falls as the model grows.

Timings on a shared machine are noisy: compare the ratios, and read the load average
printed with each table.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

import executor
import planner
from planner.presets import build_model, load_config
from planner.schema import Plan
from tests._dist import make_plan

WORLD, DP, TP = 4, 2, 2
BATCH, SEQ = 8, 128
SEED = 1234
CONFIG: dict[str, Any] = {
    "model_type": "llama", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 1024,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32,
    "max_position_embeddings": SEQ, "attention_dropout": 0.1, "tie_word_embeddings": False,
}
SETUP_LABELS = {"titan": "(a) titan", "forced": "(b) forced", "planned": "(c) planned"}


def configure(hidden: int) -> None:
    """Size CONFIG's Llama (in every process: spawned ranks import the defaults)."""
    CONFIG.update(hidden_size=hidden, intermediate_size=4 * hidden, head_dim=hidden // 8)


# -- the three setups -----------------------------------------------------------------------

def titan_parallelize(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """TorchTitan's parallelize_llama (TP + SP, then FSDP2), with HF Llama's module names.

    One deviation: HF Llama derives position ids from the embedding output's sequence
    length, which is the local shard under sequence parallelism, so the training loop
    passes ``position_ids`` (TorchTitan's own model passes ``freqs_cis`` the same way)."""
    tp = mesh["tp"]
    parallelize_module(model, tp, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "model.norm": SequenceParallel(),
        # TorchTitan's default (loss parallelism on): the loss runs on vocabulary shards
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                   use_local_output=False),
    })
    for block in model.model.layers:
        parallelize_module(block, tp, {
            "input_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        })
    for i, block in enumerate(model.model.layers):  # TorchTitan's default reshard policy
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=i < len(model.model.layers) - 1)
    fully_shard(model, mesh=mesh["dp"])
    return model


def forced_plan() -> Plan:
    """TorchTitan's layout written as a meshplan plan (FSDP on dp, TP + SP on tp), with its
    vocabulary-sharded (rowwise) embedding."""
    model = build_model(load_config(CONFIG), device="meta")
    return make_plan(model, {"dp": DP, "tp": TP}, fsdp=True, sp=True, batch_size=BATCH, seq_len=SEQ,
                     vocab_embedding=True)


def planner_plan() -> Plan:
    return planner.plan(CONFIG, devices=WORLD, profile="cpu-gloo-local", batch_size=BATCH, seq_len=SEQ)


@dataclass
class Trainer:
    """One setup's model, optimizer and loop step, and its random stream."""

    name: str
    step_fn: Callable[[torch.Tensor], torch.Tensor]
    rng_state: dict[str, int] | None  # executor.rng's (single-device-equal dropout), or torch's RNG

    def step(self, ids: torch.Tensor) -> float:
        """One training step; setups built in one process take turns with executor.rng."""
        if self.rng_state is None:
            executor.rng.deactivate()
        else:
            executor.rng.set_state(self.rng_state)
        loss = self.step_fn(ids)
        if self.rng_state is not None:
            self.rng_state = executor.rng.get_state()
        return loss.item()


def make_trainer(name: str, plan_json: str | None = None, local: dict[str, Any] | None = None,
                 our_rng: bool = True) -> Trainer:
    """``titan`` / ``forced`` / ``planned`` under the current process group, or ``local``:
    the plain model built from ``local`` (a config with this rank's shard shapes), or
    ``local+fsdp``: that model under FSDP2 on the dp dim as TorchTitan wraps it (FSDP2's own
    share of (a)'s and (b)'s overhead).  TorchTitan draws dropout from torch's RNG; the
    executor's setups from executor.rng."""
    executor.rng.manual_seed(SEED)
    state = executor.rng.get_state() if our_rng and name != "titan" else None
    if name in ("local", "local+fsdp"):
        model = build_model(load_config(local), device="cpu").train()
        position_ids = None
        if name == "local+fsdp":
            dp_mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))["dp"]
            for i, block in enumerate(model.model.layers):  # as titan_parallelize and executor.apply
                fully_shard(block, mesh=dp_mesh, reshard_after_forward=i < len(model.model.layers) - 1)
            fully_shard(model, mesh=dp_mesh)
    elif name == "titan":
        executor.rng.deactivate()
        model = build_model(load_config(CONFIG), device="cpu").train()
        mesh = init_device_mesh("cpu", (DP, TP), mesh_dim_names=("dp", "tp"))
        model = titan_parallelize(model, mesh)
        position_ids = torch.arange(SEQ).unsqueeze(0)
    else:
        model = build_model(load_config(CONFIG), device="meta").train()
        model = executor.apply(Plan.from_json(plan_json), model)
        position_ids = None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dp_slice = name in ("titan", "local", "local+fsdp")  # the loop slices the batch itself; executor does
    rank = dist.get_rank() if dist.is_initialized() else 0
    vocab = model.config.vocab_size

    def step(ids: torch.Tensor) -> torch.Tensor:
        ids = ids % vocab  # the local model's vocabulary is the rank's shard of it
        if dp_slice:
            n = ids.shape[0] // DP
            ids = ids[(rank // TP) * n:(rank // TP + 1) * n]
        kwargs = {} if position_ids is None else {"position_ids": position_ids}
        with loss_parallel() if name == "titan" else nullcontext():  # backward inside, as TorchTitan
            loss = model(input_ids=ids, labels=ids, use_cache=False, **kwargs).loss
            loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    return Trainer(name, step, state)


def batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=g) for _ in range(n)]


# -- part 1: 4 gloo processes -----------------------------------------------------------------

def _rank(rank: int, port: int, plans: dict[str, str | None], args: argparse.Namespace,
          results: Any) -> None:
    """Every setup in ``plans`` on this rank; timed steps take turns, so that the load of a
    shared machine hits all setups alike; then the process's peak RSS."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    configure(args.hidden)
    torch.set_num_threads(1)  # 4 ranks share this machine's cores
    executor.rng.use_compiled_generator(not args.eager_rng)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    trainers = [make_trainer(name, plan) for name, plan in plans.items()]
    times: list[list[float]] = [[] for _ in trainers]
    cpu: list[list[float]] = [[] for _ in trainers]  # the process's, gloo's threads included
    losses: list[list[float]] = [[] for _ in trainers]
    for i, ids in enumerate(batches(args.warmup + args.steps)):
        for t, ts, cs, ls in zip(trainers, times, cpu, losses, strict=True):
            dist.barrier()
            start, start_cpu = time.perf_counter(), time.process_time()
            ls.append(t.step(ids))
            if i >= args.warmup:
                ts.append(time.perf_counter() - start)
                cs.append(time.process_time() - start_cpu)
    dist.barrier()
    results.put((rank, times, losses, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, cpu))
    dist.destroy_process_group()


def run_gloo(plans: dict[str, str | None], args: argparse.Namespace) -> list[tuple]:
    """``_rank`` on 4 fresh processes; each rank's result, by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_rank, args=(r, port, plans, args, results), daemon=True)
             for r in range(WORLD)]
    for p in procs:
        p.start()
    got = sorted(results.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join()
    return got


def part1(args: argparse.Namespace) -> None:
    plans = {"titan": None, "forced": forced_plan().to_json(), "planned": planner_plan().to_json()}
    planned = Plan.from_json(plans["planned"])
    mesh = "x".join(f"{d.name}{d.size}" for d in planned.mesh.dims)
    print(f"planner's plan for cpu-gloo-local: mesh {mesh}, data parallel "
          f"{[(d.dim, d.mode) for d in planned.data_parallel]}, {len(planned.modules)} module "
          f"layouts, checkpointing {planned.activation_checkpointing}")
    got = run_gloo(plans, args)
    # A step ends when the slowest rank ends it (the next step starts at a barrier).
    median = {name: statistics.median(max(ts) for ts in zip(*(g[1][k] for g in got), strict=True))
              for k, name in enumerate(plans)}
    # CPU seconds all ranks spend on a step: with more ranks than cores the step is
    # bound by it (cores busy ~ cpu / step), not by waiting
    cpu = {name: statistics.median(sum(cs) for cs in zip(*(g[4][k] for g in got), strict=True))
           for k, name in enumerate(plans)}
    cores = os.cpu_count() or 1
    losses = {name: got[0][2][k] for k, name in enumerate(plans)}
    # Peak RSS needs a process per setup: a short run of each alone.
    short = argparse.Namespace(**{**vars(args), "steps": 1, "warmup": 1})
    rss = {name: [g[3] for g in run_gloo({name: plans[name]}, short)] for name in plans}
    print(f"\n4 gloo ranks, Llama {CONFIG['num_hidden_layers']}x{CONFIG['hidden_size']}, "
          f"global batch {BATCH} x seq {SEQ}, fp32, AdamW; median of {args.steps} steps after "
          f"{args.warmup} warm-up, setups taking turns; load {_load()}")
    print(f"{'setup':<12} {'step ms':>9} {'tokens/s':>10} {'CPU ms, 4 ranks':>16} "
          f"{f'of {cores} cores':>11} {'peak RSS MiB, ranks 0-3':>26} {'loss 0':>8}")
    for name in plans:
        ranks = " ".join(f"{r / 2**20:.0f}" for r in rss[name])
        print(f"{SETUP_LABELS[name]:<12} {median[name] * 1e3:>9.1f} {BATCH * SEQ / median[name]:>10.0f} "
              f"{cpu[name] * 1e3:>16.0f} {cpu[name] / median[name] / cores:>11.0%} "
              f"{ranks:>26} {losses[name][0]:>8.4f}")
    print(f"tokens/s ratios: (b)/(a) {median['titan'] / median['forced']:.2f}x, "
          f"(c)/(b) {median['forced'] / median['planned']:.2f}x")
    diff = max(abs(x - y) for x, y in zip(losses["forced"], losses["planned"], strict=True))
    print(f"(b) vs (c) losses (both single-device-equal): max |diff| {diff:.2e}")


# -- part 2: eager overhead in one process ----------------------------------------------------

def local_config() -> dict[str, Any]:
    """The plain model a tensor-parallel rank computes: heads, MLP width and vocabulary /TP."""
    return {**CONFIG, "vocab_size": CONFIG["vocab_size"] // TP,
            "intermediate_size": CONFIG["intermediate_size"] // TP,
            "num_attention_heads": CONFIG["num_attention_heads"] // TP,
            "num_key_value_heads": CONFIG["num_key_value_heads"] // TP}


def part2(args: argparse.Namespace) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # fake collectives leave garbage; keep it from slowing math
    executor.rng.use_compiled_generator(not args.eager_rng)
    dist.init_process_group("fake", rank=0, world_size=WORLD, store=FakeStore())
    trainers = [make_trainer("local", local=local_config(), our_rng=False),
                make_trainer("local", local=local_config()),
                make_trainer("local+fsdp", local=local_config()),
                make_trainer("titan"),
                make_trainer("forced", forced_plan().to_json())]
    labels = ["local, torch RNG", "local, executor.rng", "local + FSDP2 on dp", "(a) titan", "(b) forced"]
    cpu: list[list[float]] = [[] for _ in trainers]
    for i, ids in enumerate(batches(args.warmup + args.steps)):
        for t, samples in zip(trainers, cpu, strict=True):
            start = time.process_time()
            t.step(ids)
            if i >= args.warmup:
                samples.append(time.process_time() - start)
    dist.destroy_process_group()
    medians = [statistics.median(c) for c in cpu]
    print(f"\neager overhead, Llama {CONFIG['num_hidden_layers']}x{CONFIG['hidden_size']}, 1 process, "
          f"fake process group world {WORLD} (dp{DP} x tp{TP}), "
          f"1 thread; CPU ms per step, median of {args.steps}, steps interleaved; load {_load()}")
    print(f"{'setup':<20} {'CPU ms':>8} {'x local, torch RNG':>19} {'x local, executor.rng':>22}")
    for label, m in zip(labels, medians, strict=True):
        print(f"{label:<20} {m * 1e3:>8.1f} {m / medians[0]:>19.2f} {m / medians[1]:>22.2f}")


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--part", type=int, choices=(1, 2), default=None, help="run only this part")
    parser.add_argument("--eager-rng", action="store_true",
                        help="executor.rng draws with eager torch ops instead of its default "
                             "compiled kernel (same bits; the compile happens during warm-up)")
    parser.add_argument("--hidden", type=int, default=256,
                        help="the Llama's hidden size (a multiple of 64)")
    args = parser.parse_args()
    if args.hidden <= 0 or args.hidden % 64:
        parser.error(f"--hidden: need a positive multiple of 64, got {args.hidden}")
    configure(args.hidden)
    if args.part in (None, 1):
        part1(args)
    if args.part in (None, 2):
        part2(args)


if __name__ == "__main__":
    main()
