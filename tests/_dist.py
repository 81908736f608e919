"""Run a function on N gloo ranks on CPU and collect what each rank returns.

Starting ranks is the expensive part on 2 cores (each process imports torch and
transformers), so the ranks of a world size are started once per test session and
reused: every ``run_on_ranks`` call with that world size is one job for the same
processes, which keep their gloo process group.  A test module still runs all its
scenarios inside one call and asserts on the returned results.  A failure on any rank
is re-raised in the parent with the rank's traceback, instead of a hang or a bare exit
code, and retires those processes (their process group may be broken).
"""

from __future__ import annotations

import atexit
import os
import queue
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from executor.collectives import Collectives

# A short timeout turns a rank stuck in a collective (its peer failed) into an error.
_COLLECTIVE_TIMEOUT = timedelta(seconds=120)
# A job whose ranks wait on each other for good (seen once, session 26: in the
# architecture job, one rank at a new step's FSDP all-gather while the others waited in
# a layer's tensor-parallel all-gather, 13 minutes, gloo's timeout not firing) fails the
# test instead of holding the suite until CI's limit.  The longest job, the architecture
# one, takes ~3 minutes here (171 s with the pool's start and the references, 52 cases, in
# session 40; 65 cases since session 41, 508 s of setup beside two other 4-rank jobs).
_JOB_DEADLINE_S = 1200.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(rank: int, world_size: int, port: int, jobs: Any, done: Any) -> None:
    """A rank: run jobs ``(fn, args, out_path)`` until told to stop (``None``)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=_COLLECTIVE_TIMEOUT)
    ok = True
    while ok and (job := jobs.get()) is not None:
        fn, args, out_path = job
        try:
            result: Any = ("ok", fn(*args))
        except BaseException:  # report every failure to the parent
            result = ("error", traceback.format_exc())
        ok = result[0] == "ok"
        torch.save(result, out_path)
        done.put(rank)
    if ok:
        dist.barrier()  # gloo: a barrier before destroy, or a peer may see a reset
    dist.destroy_process_group()


class _Ranks:
    """``world_size`` started ranks waiting for jobs."""

    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.jobs = [ctx.Queue() for _ in range(world_size)]
        self.done = ctx.Queue()
        port = _free_port()
        self.procs = [ctx.Process(target=_serve, args=(r, world_size, port, self.jobs[r], self.done),
                                  daemon=True) for r in range(world_size)]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable[..., Any], args: tuple) -> list[tuple[str, Any]]:
        with tempfile.TemporaryDirectory() as out_dir:
            paths = [os.path.join(out_dir, f"rank{r}.pt") for r in range(self.world_size)]
            for r, q in enumerate(self.jobs):
                q.put((fn, args, paths[r]))
            finished, start = 0, time.monotonic()
            while finished < self.world_size:
                try:
                    self.done.get(timeout=5)
                    finished += 1
                except queue.Empty:
                    dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                    if dead:
                        raise RuntimeError(f"ranks {dead} died without a result") from None
                    if time.monotonic() - start > _JOB_DEADLINE_S:
                        raise RuntimeError(f"{fn.__name__}: {self.world_size - finished} of {self.world_size} "
                                           f"ranks gave no result in {_JOB_DEADLINE_S:.0f} s") from None
            return [torch.load(p, weights_only=False) for p in paths]

    def stop(self) -> None:
        for q, p in zip(self.jobs, self.procs, strict=True):
            if p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


_RANKS: dict[int, _Ranks] = {}


@atexit.register
def _stop_all() -> None:
    while _RANKS:
        _RANKS.popitem()[1].stop()


def run_on_ranks(world_size: int, fn: Callable[..., Any], *args: Any) -> list[Any]:
    """``fn(*args)`` on every rank of a gloo group of ``world_size``; the per-rank results.

    ``fn`` must be a module-level function (it is pickled into the rank processes).
    The ranks may have run other jobs before: ``fn`` must not rely on fresh processes.
    """
    if world_size not in _RANKS:
        _RANKS[world_size] = _Ranks(world_size)
    try:
        results = _RANKS[world_size].run(fn, args)
    except BaseException:
        _RANKS.pop(world_size).stop()
        raise
    errors = [f"rank {r}:\n{res[1]}" for r, res in enumerate(results) if res[0] == "error"]
    if errors:
        _RANKS.pop(world_size).stop()
        raise RuntimeError("\n".join(errors))
    return [res[1] for res in results]


# -- plans for tests -------------------------------------------------------------------------
# Real plans in the planner's schema, written by hand the way Megatron/TorchTitan shard
# these models, so executor tests do not depend on the planner's search.

_COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head", "c_fc", "c_attn")
_ROWWISE = ("o_proj", "down_proj", "c_proj")


def _tp_placement(fqn: str, conv1d: bool) -> str:
    """Megatron placement on the tensor-parallel dim.  Linear weights are [out, in];
    GPT-2's Conv1D weights are [in, out], so its shard dims are swapped."""
    parts = fqn.split(".")
    owner, kind = parts[-2], parts[-1]
    out_dim, in_dim = (1, 0) if conv1d else (0, 1)
    if owner in _COLWISE:
        return f"S({out_dim})" if kind == "weight" else "S(0)"
    if owner in _ROWWISE and kind == "weight":
        return f"S({in_dim})"
    return "R"


def make_plan(model: Any, mesh: dict[str, int], fsdp: bool = False, sp: bool = False,
              batch_size: int = 8, seq_len: int = 16, checkpointing: str = "none",
              vocab_embedding: bool = False, microbatches: int = 1) -> Any:
    """A plan for an HF Llama-family / GPT-2 model or a plain MLP on ``mesh``, each
    data-parallel rank's batch in ``microbatches`` parts.

    Dims named ``dp`` are data parallel (FSDP when ``fsdp``), ``tp`` is tensor parallel
    (with sequence parallelism when ``sp``; a Llama's ``embed_tokens`` sharded by
    vocabulary row, TorchTitan's rowwise embedding, when ``vocab_embedding``)."""
    from planner import schema as s

    names = list(mesh)
    conv1d = type(model).__name__.startswith("GPT2")
    params = []
    for fqn, _ in model.named_parameters():
        pl = []
        for name in names:
            if name == "dp":
                pl.append("S(0)" if fsdp else "R")
            elif vocab_embedding and fqn == "model.embed_tokens.weight":
                pl.append("S(0)")
            else:
                pl.append(_tp_placement(fqn, conv1d))
        params.append(s.ParameterPlacement(fqn=s.fqn_pattern(fqn), placements=pl))
    params = list({p.fqn: p for p in params}.values())
    modules = _sp_layouts(model, names) if sp else []
    zero_time = s.TimeBreakdown(step_time_s=0, compute_s=0, communication_s=0, exposed_communication_s=0)
    zero_mem = s.MemoryBreakdown(parameters=0, gradients=0, optimizer=0, activations=0, total=0,
                                 capacity=0, fits=True)
    devices = 1
    for v in mesh.values():
        devices *= v
    return s.Plan(
        schema_version=s.SCHEMA_VERSION,
        model=type(model).__name__, profile="cpu-test", devices=devices, batch_size=batch_size,
        seq_len=seq_len, microbatches=microbatches,
        mesh=s.Mesh(dims=[s.MeshDim(name=n, size=v) for n, v in mesh.items()], device_type="cpu"),
        parameters=params, modules=modules,
        data_parallel=[s.DataParallelDim(dim="dp", mode="fully_shard" if fsdp else "replicate")]
        if "dp" in mesh else [],
        activation_checkpointing=checkpointing,
        prediction=s.Prediction(time=zero_time, memory=zero_mem, tokens_per_s_per_device=0, mfu=0),
        fingerprint=s.Fingerprint.of((n, p.shape) for n, p in model.named_parameters()),
        solver=s.SolverStats(solver="hand", status="given", variables=0, constraints=0,
                             solve_time_s=0, total_time_s=0, objective=0),
    )


def _sp_layouts(model: Any, names: list[str]) -> list[Any]:
    """Sequence parallel (TorchTitan's Llama plan): the residual stream is sharded on the
    sequence dim, gathered before attention / MLP, reduce-scattered after them."""
    from planner.schema import ModuleLayout, fqn_pattern

    def on_tp(p: str) -> list[str]:
        return [p if n == "tp" else "S(0)" for n in names]

    seq, rep = on_tp("S(1)"), on_tp("R")
    out: dict[str, ModuleLayout] = {}
    for name, _ in model.named_modules():
        pat, last = fqn_pattern(name), name.rsplit(".", 1)[-1]
        if last in ("embed_tokens", "o_proj", "down_proj"):
            out[pat] = ModuleLayout(module=pat, output=seq)
        elif last in ("self_attn", "mlp"):
            out[pat] = ModuleLayout(module=pat, input=rep)
        elif last.endswith("norm") or last.endswith("layernorm"):
            out[pat] = ModuleLayout(module=pat, input=seq, output=seq)
    return list(out.values())


def pipeline_variant(plan: Any, schedule: str, second: str, checkpointing: str) -> str:
    """A planner-made ``pp x N`` pipeline plan (JSON) with the schedule, the role of the
    second mesh dim and the recomputation a user picked, for the CPU.

    Interleaving deals each rank's layers out in two, so for it, and for a plan the
    planner made interleaved (it lists every virtual stage), the layers are re-split
    evenly, one stage per rank (the planner may have balanced a 3 + 1 split).
    ``second``: the data-parallel mode (``replicate``, ``fully_shard``), or ``tp`` (the dim turned tensor-parallel with Megatron's placements, as in ``make_plan``)."""
    plan = plan.model_copy(deep=True)
    plan.pipeline.schedule = schedule
    plan.pipeline.virtual_stages = 2 if schedule == "interleaved-1f1b" else 1
    pp = plan.mesh.size_of(plan.pipeline.dim)
    if schedule == "interleaved-1f1b" or len(plan.pipeline.stages) != pp:
        _split_layers_evenly(plan.pipeline, pp)
    if second == "tp":
        plan.mesh.dims[1].name = "tp"
        plan.data_parallel = []
    else:
        plan.data_parallel[0].mode = second
    for p in plan.parameters:
        p.placements[1] = {"replicate": "R", "fully_shard": "S(0)"}.get(second) or _tp_placement(p.fqn, False)
    plan.activation_checkpointing = checkpointing
    plan.mesh.device_type = "cpu"
    return plan.to_json()


def _split_layers_evenly(pipeline: Any, pp: int) -> None:
    """One stage per pp rank, the ``model.layers.N`` modules dealt out in equal contiguous
    runs, the modules before the layers (embedding) on the first, those after (norm,
    head) on the last."""
    modules = [m for st in pipeline.stages for m in st.modules]
    layers = [m for m in modules if m.startswith("model.layers.")]
    first = modules.index(layers[0])
    before, after = modules[:first], [m for m in modules[first:] if m not in layers]
    per = len(layers) // pp
    pipeline.stages = [type(pipeline.stages[0])(index=i, modules=layers[i * per:(i + 1) * per])
                       for i in range(pp)]
    pipeline.stages[0].modules[:0] = before
    pipeline.stages[-1].modules.extend(after)


class _Sized(Collectives):
    """``Collectives`` that also keeps each collective's kind, bytes (``S`` as
    ``cost_model.comm`` defines it) and group size, to price them as the plan would."""

    def __init__(self) -> None:
        super().__init__("_c10d_functional", "c10d")
        self.sized: list[tuple[str, int, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if not isinstance(func, torch._ops.HigherOrderOperator) and func.namespace in self.namespaces:
            name = func.__name__.split(".")[0]
            if func.namespace == "_c10d_functional":  # (input, ..., group size, group name)
                sized = {"all_reduce": lambda: ("all_reduce", _bytes(args[0]), _group_size(args[2])),
                         "all_gather_into_tensor": lambda: ("all_gather", _bytes(args[0]) * args[1], args[1]),
                         "reduce_scatter_tensor": lambda: ("reduce_scatter", _bytes(args[0]), args[2])}
            else:  # c10d's: FSDP2's and replicate's
                sized = {"allreduce_": lambda: ("all_reduce", sum(map(_bytes, args[0])), _group_size(args[1])),
                         "_allgather_base_": lambda: ("all_gather", _bytes(args[0]), _group_size(args[2])),
                         "_reduce_scatter_base_": lambda: ("reduce_scatter", _bytes(args[1]), _group_size(args[2]))}
            if name in sized and not any(issubclass(t, DTensor) for t in types):
                self.sized.append(sized[name]())
        return super().__torch_dispatch__(func, types, args, kwargs)


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _group_size(group: Any) -> int:
    if isinstance(group, str):  # a functional collective's group name
        return dist.distributed_c10d._resolve_process_group(group).size()
    return (group if isinstance(group, dist.ProcessGroup) else dist.ProcessGroup.unbox(group)).size()


def _bandwidth_only(base: Any) -> Any:
    """``base`` with every collective at 1 GB/s of bus bandwidth and nothing else: no
    latency, DTensor host time, staging or fresh pages, no memory traffic (the local
    chunks a resharding also costs), so a step's communication is its collectives' bytes
    times their bus factors."""
    from cost_model.profile import Profile

    data = base.model_dump()
    data["levels"] = [{**level, "latency_s": 0.0, "groups": [], "busbw": dict.fromkeys(level["busbw"], 1e9)}
                      for level in data["levels"]]
    data.update(name="bandwidth-only", memory_bandwidth=1e30, update_bandwidth=1e30, kernel_floor_s=0.0,
                dtensor_redistribute_s=0.0, sync_cost=[], fresh_alloc_bytes=1 << 50, fresh_page_byte_s=0.0)
    return Profile.model_validate(data)


def laid_out_and_issued(config: Any, layout: dict[str, Any], batch: int, seq: int
                        ) -> tuple[int, int, float, float]:
    """(the collectives ``planner.timeline`` lays out in one training step of ``config``
    under the hand ``layout`` on 4 devices, the collectives a forward and backward of it
    under ``executor.apply`` issue, the step's communication seconds the plan prices
    under ``_bandwidth_only``, the issued collectives priced so), on the fake process
    group of 4 the caller set up.

    Laid out: the step priced with a profile whose ``sync_cost`` adds 1 ms to every
    collective, less the step priced without.  Issued: ``Collectives``' count (DTensor's,
    FSDP2's and replicate's) of the second call (the first lets local regions learn and
    checks the batch), after ``zero_grad`` as a training loop's optimizer step leaves the
    gradients.  The seconds compare what the counts cannot: the collectives' sizes, and
    their kinds where the bus factors differ (an all-reduce costs twice a reduce-scatter
    of the same bytes)."""
    import executor
    import planner
    from cost_model.comm import collective_time
    from cost_model.profile import Profile, load_profile
    from planner.presets import build_model, load_config

    base = load_profile("cpu-gloo-local")
    flat = [{"size": g, "held_s": 0.0, "points": [{"compute_s": 0.0, "added_s": 1e-3},
                                                   {"compute_s": 1.0, "added_s": 1e-3}]} for g in (2, 4)]
    profiles = [*(Profile.model_validate({**base.model_dump(), "name": name, "sync_cost": sync})
                  for name, sync in (("flat", flat), ("none", []))), _bandwidth_only(base)]
    steps = [planner.hand_plan(config, 4, profile, batch_size=batch, seq_len=seq, **layout) for profile in profiles]
    laid_out = round((steps[0].prediction.time.step_time_s - steps[1].prediction.time.step_time_s) / 1e-3)

    def issued(step: Any) -> _Sized:
        executor.rng.manual_seed(0)
        model = executor.apply(step, build_model(load_config(config)).train())
        ids = torch.zeros(batch, seq, dtype=torch.long)
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad()
        with _Sized() as comm:
            model(input_ids=ids, labels=ids).loss.backward()
        return comm

    comm = issued(steps[1])
    # without latency the ILP may settle a choice the hand layout leaves open otherwise
    # (Persimmon's); that plan then runs on its own
    same = (steps[2].modules, steps[2].parameters) == (steps[1].modules, steps[1].parameters)
    sized = (comm if same else issued(steps[2])).sized
    issued_s = sum(collective_time(profiles[2], kind, nbytes, (n,), 0) for kind, nbytes, n in sized)
    return laid_out, comm.counts.total(), steps[2].prediction.time.communication_s, issued_s
