"""A GPU profile's compute constants, and its one-device training step, against a CUDA device.

The GPU profiles' compute constants come from datasheets and public kernel sweeps
(each profile's ``source``); this measures them on the device at hand and prints
measured against what the cost model predicts for the same work.  It is a validation,
not a calibration: nothing here writes a profile.

* **GEMMs**: bf16 products at square sizes and at the shapes of a Llama 3 8B layer
  (forward, and backward's transposed operands), each against ``op_time`` (the
  profile's ``gemm_efficiency`` curve at the product's FLOPs).
* **Copy bandwidth** against ``memory_efficiency * memory_bandwidth``.
* **Attention**: torch's causal SDPA forward and backward against
  ``attention_efficiency``.
* **One training step** (forward with the loss, backward, AdamW) of Llama 3 8B's
  layers, cut to a few so the whole model and its AdamW state fit on one device,
  against ``planner.estimate`` on one device (plus, for the FSDP2 run, FSDP2's copy
  kernels as ``cost_model.step.fsdp_copy_time`` prices them over one rank, which a
  one-device plan does not run).  The step runs two ways:
  ``fsdp2-bf16`` is what GPU plans price (bf16 compute from fp32 master weights,
  TorchTitan's mixed precision: FSDP2 over a one-rank mesh with a bf16
  ``MixedPrecisionPolicy``); ``autocast`` is fp32 weights under ``torch.autocast``
  (what a user's loop around ``executor.apply`` runs, since the executor leaves the
  model's precision alone), and once more with ``AdamW(fused=True)``.  torch.profiler
  then splits one ``fsdp2-bf16`` step's kernel time by kind (GEMMs, attention, the
  optimizer, the rest) and by aten op, beside the model's split of its prediction (the
  traced graph's nodes priced one by one, as the planner does on one device).

Timings are medians of CUDA-event-timed repeats after warm-ups.

    python -m bench.gpu_step [--profile h100-sxm-80g] [--layers 4] [--out DIR]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import planner
from cost_model.compute import gemm_efficiency, op_time, peak_flops
from cost_model.profile import Profile, load_profile
from cost_model.step import fsdp_copy_time
from executor import rng
from planner.presets import PRESETS, build_model, load_config
from planner.tracer import layer_weight
from service.terminal import table

WARMUP, REPEATS = 3, 10
# (label, batch, seq): the same 8192 tokens, causal attention's share differs
WORKLOADS = (("1 x 8192", 1, 8192), ("2 x 4096", 2, 4096))
# attention dropout under executor.rng materialises each layer's probabilities: 4 x 2048
# keeps them (fp32 under autocast, 2 GiB a layer) within the device beside the states
DROPOUT_WORKLOAD = (4, 2048)


def cuda_seconds(fn: Callable[[], object], warmup: int = WARMUP, repeats: int = REPEATS) -> float:
    """Median seconds of ``fn`` on the current stream, each repeat timed by CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    print(f"\n{title}\n{table(header, rows)}")


# -- kernels ---------------------------------------------------------------------------------

def gemm_shapes() -> list[tuple[str, int, int, int, bool]]:
    """(label, m, n, k, transposed A): squares, then a Llama 3 8B layer's products over
    8192 tokens forward (x @ W^T) and backward (dX = dY @ W, dW = dY^T @ X)."""
    out: list[tuple[str, int, int, int, bool]] = [(f"square {n}", n, n, n, False)
                                                   for n in (512, 1024, 2048, 4096, 8192)]
    t = 8192
    for name, n_out, n_in in (("q/o proj", 4096, 4096), ("k/v proj", 1024, 4096),
                              ("gate/up", 14336, 4096), ("down", 4096, 14336)):
        out += [(f"{name} fwd", t, n_out, n_in, False), (f"{name} dX", t, n_in, n_out, False),
                (f"{name} dW", n_out, n_in, t, True)]
    out.append(("lm head fwd (vocab 128256)", t, 128256, 4096, False))
    return out


def measure_gemms(profile: Profile) -> list[dict[str, Any]]:
    results = []
    for label, m, n, k, transposed in gemm_shapes():
        a = (torch.randn(k, m, device="cuda", dtype=torch.bfloat16).t() if transposed
             else torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        flops = 2.0 * m * n * k
        nbytes = 2.0 * (m * k + k * n + m * n)
        seconds = cuda_seconds(lambda a=a, b=b: torch.mm(a, b))
        results.append({"label": label, "m": m, "n": n, "k": k, "flops": flops,
                        "measured_s": seconds, "predicted_s": op_time(profile, flops, nbytes, "bf16"),
                        "measured_eff": flops / seconds / peak_flops(profile, "bf16"),
                        "profile_eff": gemm_efficiency(profile, flops)})
        del a, b
    return results


def measure_copy(profile: Profile, nbytes: int = 2**30) -> dict[str, float]:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    seconds = cuda_seconds(lambda: dst.copy_(src))
    return {"bytes_moved": 2.0 * nbytes, "measured_s": seconds,
            "measured_bw": 2.0 * nbytes / seconds,
            "profile_bw": profile.memory_efficiency * profile.memory_bandwidth}


def measure_attention(profile: Profile, batch: int, seq: int, heads: int = 32,
                      head_dim: int = 128) -> dict[str, Any]:
    """Causal SDPA forward, and forward + backward, against the planner's charge for
    the node (tracer: 4·B·H·S²·D FLOPs halved for causal; backward twice that)."""
    q, k, v = (torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    grad = torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16)

    def fwd() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def fwd_bwd() -> None:
        torch.autograd.backward(fwd(), grad)

    flops = 4.0 * batch * heads * seq * seq * head_dim / 2
    nbytes = 4.0 * q.numel() * q.element_size()
    with torch.no_grad():
        t_fwd = cuda_seconds(fwd)
    t_both = cuda_seconds(fwd_bwd)
    return {"label": f"{batch} x {seq}, {heads} heads x {head_dim}", "flops_fwd": flops,
            "fwd_s": t_fwd, "bwd_s": t_both - t_fwd,
            "pred_fwd_s": op_time(profile, flops, nbytes, "bf16", attention=True),
            "pred_bwd_s": op_time(profile, 2 * flops, 2 * nbytes, "bf16", attention=True)}


# -- the training step -----------------------------------------------------------------------

def llama_config(layers: int) -> dict[str, Any]:
    return {**PRESETS["llama3-8b"], "num_hidden_layers": layers}


def _one_rank_group() -> None:
    """FSDP2 needs a process group; one rank of NCCL on this device."""
    if not dist.is_initialized():
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="meshplan-gpu-step-"), "store"), 1)
        dist.init_process_group("nccl", store=store, rank=0, world_size=1)


def build(config: dict[str, Any], mode: str) -> torch.nn.Module:
    model = build_model(load_config(config), device="cuda", dtype=torch.float32).train()
    if mode == "fsdp2-bf16":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        _one_rank_group()
        mesh = init_device_mesh("cuda", (1,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def measure_step(config: dict[str, Any], mode: str, batch: int, seq: int, fused: bool = False,
                 profiled: bool = False, out: Path | None = None, consistent: bool = False) -> dict[str, Any]:
    """Median forward (with the loss), backward and AdamW seconds, and the peak memory;
    ``fused``: AdamW's one-kernel update instead of torch's default (foreach) path;
    ``consistent``: the step draws from executor.rng (seeded after the model is built);
    ``profiled``: two more steps under torch.profiler (``kernel_split``)."""
    torch.manual_seed(0)
    model = build(config, mode)
    if consistent:
        rng.manual_seed(1234)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=fused or None)
    ids = torch.randint(0, config["vocab_size"], (batch, seq), device="cuda")
    def cast() -> torch.autocast:
        return torch.autocast("cuda", dtype=torch.bfloat16, enabled=mode == "autocast")

    def step() -> list[float]:
        events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        events[0].record()
        with cast():
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        events[1].record()
        loss.backward()
        events[2].record()
        opt.step()
        opt.zero_grad(set_to_none=True)
        events[3].record()
        events[3].synchronize()
        return [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(3)]

    for _ in range(WARMUP):
        step()
    torch.cuda.reset_peak_memory_stats()
    phases = [step() for _ in range(REPEATS)]
    fwd, bwd, optim = (statistics.median(p[i] for p in phases) for i in range(3))
    result = {"mode": mode + (", fused AdamW" if fused else ""), "batch": batch, "seq": seq, "fwd_s": fwd, "bwd_s": bwd, "opt_s": optim,
              "step_s": statistics.median(sum(p) for p in phases),
              "peak_bytes": torch.cuda.max_memory_allocated()}
    if profiled:
        result["kernels"], result["ops"] = kernel_split(step, out, f"{mode}-{batch}x{seq}")
    rng.deactivate()
    return result


KINDS = ("gemm", "attention", "other", "optimizer", "nccl")
GEMM_OPS = {"linear", "mm", "addmm", "bmm", "matmul", "baddbmm", "grouped_mm"}


def kernel_category(name: str) -> str:
    low = name.lower()
    if "nccl" in low:
        return "nccl"
    if "multi_tensor" in low or "foreach" in low:  # torch's AdamW (foreach)
        return "optimizer"
    if "flash" in low or "fmha" in low or "attention" in low:
        return "attention"
    if any(s in low for s in ("gemm", "nvjet", "cutlass", "xmma", "cublas", "sm90_")):
        return "gemm"
    return "other"


def kernel_split(step: Callable[[], object], out: Path | None, label: str,
                 ) -> tuple[dict[str, float], dict[str, float]]:
    """Two steps under torch.profiler: the first's CUDA kernels' seconds per kind (CUDA
    activity alone: with CPU activity the profiler also reports annotations such as
    ``Optimizer.step`` and ``FSDP::pre_forward`` as device time, which would count their
    kernels twice), the second's per aten op, the seconds of the kernels each launched
    itself (forward and backward ops apart, by their aten names); both tables in full
    under ``out`` where given."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    def profiled(activities: list[ProfilerActivity]) -> Any:
        with profile(activities=activities) as prof:
            step()
            torch.cuda.synchronize()
        return prof.key_averages()

    def seconds(e: Any, own: bool) -> float:
        name = "self_device_time_total" if own else "device_time_total"
        us = getattr(e, name, None)
        return (getattr(e, name.replace("device", "cuda")) if us is None else us) / 1e6

    kinds, kernels = dict.fromkeys(KINDS, 0.0), {}
    for e in profiled([ProfilerActivity.CUDA]):
        if e.device_type == DeviceType.CUDA and seconds(e, False):
            kinds[kernel_category(e.key)] += seconds(e, False)
            kernels[f"{e.key} ({e.count} calls)"] = seconds(e, False)
    ops = {e.key: seconds(e, True) for e in profiled([ProfilerActivity.CPU, ProfilerActivity.CUDA])
           if e.key.startswith("aten::") and seconds(e, True)}
    for name, seconds_of in (("kernels", kernels), ("ops", ops)) if out is not None else ():
        (out / f"{name}-{label}.txt").write_text("\n".join(
            f"{s * 1e3:10.3f} ms  {key}" for key, s in sorted(seconds_of.items(), key=lambda o: -o[1])))
    return kinds, ops


def predicted_ops(config: dict[str, Any], profile: Profile, batch: int, seq: int) -> dict[str, float]:
    """The model's one-device forward + backward seconds per traced op (``short`` name):
    every node priced as ``planner.strategies`` prices it unsharded on a GPU profile."""
    graph = planner.trace(config, batch, seq, torch.bfloat16)
    ops: dict[str, float] = {}
    for n, d in graph.nodes(data=True):
        if d["kind"] != "call_function":
            continue
        attention = d["short"] == "scaled_dot_product_attention"
        seconds = (op_time(profile, d["fwd_flops"], d["bytes"], "bf16", attention=attention)
                   + op_time(profile, d["bwd_flops"], d["bwd_bytes"], "bf16", attention=attention))
        ops[d["short"]] = ops.get(d["short"], 0.0) + layer_weight(graph, n) * seconds
    return ops


def fsdp2_copies(config: dict[str, Any], profile: Profile) -> float:
    """What ``cost_model.step.fsdp_copy_time`` prices for ``build``'s FSDP2 over one rank
    per step: every layer's unit gathers in forward and again in backward (resharded
    after forward), the root's once, and every gradient is reduced once."""
    model = build_model(load_config(config), device="meta")
    params = sum(p.numel() for p in model.parameters())
    in_layers = sum(p.numel() for p in model.model.layers.parameters())
    return fsdp_copy_time(profile, "adam-mixed", 1, params + in_layers, params)


def predicted_split(ops: dict[str, float]) -> dict[str, float]:
    split = dict.fromkeys(KINDS, 0.0)
    for short, seconds in ops.items():
        kind = ("attention" if short == "scaled_dot_product_attention" else "gemm" if short in GEMM_OPS
                else "other")
        split[kind] += seconds
    return split


# -- report ----------------------------------------------------------------------------------

def _ms(s: float) -> str:
    return f"{s * 1e3:.2f}"


def _err(measured: float, predicted: float) -> str:
    return f"{(predicted - measured) / measured * 100:+.0f}%"


SECTIONS = ("kernels", "step", "dropout")


def kernel_section(profile: Profile, results: dict[str, Any]) -> None:
    results["gemm"] = gemms = measure_gemms(profile)
    print_table("bf16 GEMMs: measured against op_time (gemm_efficiency at the product's FLOPs)",
                ["shape", "m x n x k", "TFLOP/s", "eff", "profile eff", "ms", "pred ms", "error"],
                [[g["label"], f"{g['m']}x{g['n']}x{g['k']}", f"{g['flops'] / g['measured_s'] / 1e12:.0f}",
                  f"{g['measured_eff']:.2f}", f"{g['profile_eff']:.2f}", _ms(g["measured_s"]),
                  _ms(g["predicted_s"]), _err(g["measured_s"], g["predicted_s"])] for g in gemms])

    results["copy"] = copy = measure_copy(profile)
    print(f"\ncopy 1 GiB: {copy['measured_bw'] / 1e12:.2f} TB/s read + written; profile "
          f"{copy['profile_bw'] / 1e12:.2f} TB/s ({_err(copy['measured_bw'], copy['profile_bw'])})")

    results["attention"] = attn = [measure_attention(profile, b, s) for _, b, s in WORKLOADS]
    print_table("causal SDPA (bf16): measured against attention_efficiency",
                ["shape", "fwd ms", "pred", "error", "bwd ms", "pred", "error", "fwd TFLOP/s"],
                [[a["label"], _ms(a["fwd_s"]), _ms(a["pred_fwd_s"]), _err(a["fwd_s"], a["pred_fwd_s"]),
                  _ms(a["bwd_s"]), _ms(a["pred_bwd_s"]), _err(a["bwd_s"], a["pred_bwd_s"]),
                  f"{a['flops_fwd'] / a['fwd_s'] / 1e12:.0f}"] for a in attn])


def step_section(profile: Profile, layers: int, out: Path | None, results: dict[str, Any]) -> None:
    config = llama_config(layers)
    copies = fsdp2_copies(config, profile)  # a one-device plan runs no FSDP2: added to fsdp2-bf16's rows
    steps, rows, splits, op_rows = [], [], [], []
    for w, (label, batch, seq) in enumerate(WORKLOADS):
        pred = planner.estimate(config, devices=1, profile=profile, batch_size=batch, seq_len=seq)
        predicted = {**predicted_ops(config, profile, batch, seq), "FSDP2's copies": copies}
        split = {**predicted_split(predicted), "optimizer": pred.time.optimizer_s}
        runs = [("fsdp2-bf16", False), ("autocast", False)] + ([("autocast", True)] if w == 0 else [])
        for mode, fused in runs:
            profiled = (w, mode, fused) == (0, "fsdp2-bf16", False)
            r = measure_step(config, mode, batch, seq, fused, profiled, out)
            gc.collect()  # FSDP2's hooks hold the model in reference cycles
            torch.cuda.empty_cache()
            r["predicted"] = pred.model_dump()
            steps.append(r)
            t, extra = pred.time, copies if mode == "fsdp2-bf16" else 0.0
            rows.append([label, r["mode"], _ms(r["fwd_s"] + r["bwd_s"]), _ms(t.compute_s + extra),
                         _err(r["fwd_s"] + r["bwd_s"], t.compute_s + extra), _ms(r["opt_s"]), _ms(t.optimizer_s),
                         _err(r["opt_s"], t.optimizer_s), _ms(r["step_s"]), _ms(t.step_time_s + extra),
                         _err(r["step_s"], t.step_time_s + extra), f"{r['peak_bytes'] / 2**30:.1f}",
                         f"{pred.memory.total / 2**30:.1f}"])
            if "kernels" in r:
                k = r["kernels"]
                splits.append([label, *(f"{_ms(k[c])} / {_ms(split[c])}" for c in KINDS),
                               f"{_ms(sum(k.values()))} / {_ms(sum(split.values()))}"])
                measured_ops = sorted(r["ops"].items(), key=lambda o: -o[1])[:25]
                predicted_top = sorted(predicted.items(), key=lambda o: -o[1])[:25]
                op_rows = [[*(m if m else ("", 0.0)), *(p if p else ("", 0.0))]
                           for m, p in itertools.zip_longest(measured_ops, predicted_top)]
    results["steps"] = steps
    print_table(f"training step, Llama 3 8B with {layers} layers on one device: measured against "
                "planner.estimate (ms; memory GiB)",
                ["tokens", "run", "fwd+bwd", "pred", "error", "AdamW", "pred", "error", "step", "pred",
                 "error", "peak", "pred"], rows)
    print_table("one fsdp2-bf16 step's kernel time by kind, measured / predicted (ms)",
                ["tokens", *KINDS, "all kernels"], splits)
    print_table(f"that step's aten ops (their own kernels, {WORKLOADS[0][0]}) beside the model's traced ops "
                "(forward + backward)", ["aten op", "ms", "traced op", "predicted ms"],
                [[m, _ms(ms), p, _ms(ps)] for m, ms, p, ps in op_rows])


def dropout_section(layers: int, results: dict[str, Any]) -> None:
    """What executor.rng's sharding-independent randomness costs here: one dropout over an
    MLP activation (torch's kernel against executor.rng's compiled one), and the autocast
    step with attention dropout 0.1, whose SDPA runs fused with torch's generator and as
    explicit softmax, dropout and matmuls under executor.rng (docs/rng.md)."""
    x = torch.ones(8192, 14336, device="cuda", dtype=torch.bfloat16)
    rng.deactivate()
    native = cuda_seconds(lambda: F.dropout(x, 0.1))
    rng.manual_seed(1234)
    ours = cuda_seconds(lambda: F.dropout(x, 0.1))
    rng.deactivate()
    config = {**llama_config(layers), "attention_dropout": 0.1}
    batch, seq = DROPOUT_WORKLOAD
    steps = {}
    for consistent in (False, True):
        steps[consistent] = measure_step(config, "autocast", batch, seq, consistent=consistent)
        gc.collect()
        torch.cuda.empty_cache()
    results["dropout"] = {"op_native_s": native, "op_rng_s": ours,
                          "step_native": steps[False], "step_rng": steps[True]}
    print_table("executor.rng on this GPU: dropout 0.1 of an 8192 x 14336 bf16 activation, and the autocast "
                f"step at {batch} x {seq} with attention dropout 0.1 (ms; memory GiB)",
                ["", "torch's generator", "executor.rng", "ratio"],
                [["dropout op", _ms(native), _ms(ours), f"{ours / native:.2f}"],
                 *([what, _ms(steps[False][key]), _ms(steps[True][key]), f"{steps[True][key] / steps[False][key]:.2f}"]
                   for what, key in (("forward", "fwd_s"), ("backward", "bwd_s"), ("step", "step_s"))),
                 ["peak memory", f"{steps[False]['peak_bytes'] / 2**30:.1f}", f"{steps[True]['peak_bytes'] / 2**30:.1f}",
                  f"{steps[True]['peak_bytes'] / steps[False]['peak_bytes']:.2f}"]])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="h100-sxm-80g", help="profile predicted (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=4,
                        help="Llama 3 8B layers in the stepped model (default: %(default)s)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help="which of kernels, step, dropout to run (default: all)")
    parser.add_argument("--out", type=Path, help="write gpu_step.json and the per-kernel and per-op tables here")
    args = parser.parse_args(argv)
    sections = args.sections.split(",")
    if unknown := sorted(set(sections) - set(SECTIONS)):
        parser.error(f"--sections: unknown {', '.join(unknown)}; expected some of {', '.join(SECTIONS)}")
    if not torch.cuda.is_available():
        raise SystemExit("bench.gpu_step: needs a CUDA device")
    profile = load_profile(args.profile)
    out = args.out
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, profile {profile.name}: "
          f"bf16 peak {peak_flops(profile, 'bf16') / 1e12:.0f} TFLOP/s")
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                               "profile": profile.name}
    if "kernels" in sections:
        kernel_section(profile, results)
    if "step" in sections:
        step_section(profile, args.layers, out, results)
    if "dropout" in sections:
        dropout_section(args.layers, results)
    if out is not None:
        (out / "gpu_step.json").write_text(json.dumps(results, indent=1))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
