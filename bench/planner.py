"""Planner wall time, peak RSS and ILP size for every preset at 8, 64 and 512 devices,
and the plan's predicted step time against hand layouts evaluated by the same cost
model (issue 4).  Each (preset, devices) runs in a fresh process so wall time
includes tracing and peak RSS is that run's own.

    python -m bench.planner [--profile h100-sxm-80g] [--presets llama3-8b,...] [--devices 8,64,512]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from planner.presets import PRESETS

CHILD = r"""
import json, resource, sys, time
import planner
name, devices, profile = sys.argv[1], int(sys.argv[2]), sys.argv[3]
batch = max(16, 2 * devices)
t0 = time.perf_counter()
out = {"batch": batch}
try:
    plan = planner.plan(name, devices, profile, batch_size=batch)
    out.update(wall=time.perf_counter() - t0, step=plan.prediction.time.step_time_s,
               mesh="x".join(f"{d.name}{d.size}" for d in plan.mesh.dims),
               dp_mode=plan.data_parallel[0].mode if plan.data_parallel else "-",
               micro=plan.microbatches, ckpt=plan.activation_checkpointing,
               vars=plan.solver.variables, cons=plan.solver.constraints, seq=plan.seq_len)
except planner.PlanningError as e:
    out.update(wall=time.perf_counter() - t0, error=str(e))
out["rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
hands = {"DDP": dict(dp=devices), "FSDP": dict(dp=devices, fsdp=True)}
cfg = planner.load_config(name)
heads = getattr(cfg, "num_key_value_heads", None) or getattr(cfg, "n_head", 1)
tp = min(8, devices, heads)

def sequence_parallel() -> bool:
    # whether hand_plan can shard this model's residual stream by sequence (not GPT-2's or
    # Mixtral's, whose norms share a segment with ops on flattened tokens)
    try:
        planner.estimate(name, devices, profile, dp=devices // tp, tp=tp, sp=True, batch_size=batch,
                         require_fit=False)
    except planner.PlanningError as e:
        return not str(e).startswith("sp:")
    return True


if tp > 1:
    sp = sequence_parallel()
    if devices > tp:  # FSDP shards over dp: with dp 1 this is Megatron's layout below
        hands["FSDP+TP (TorchTitan)"] = dict(dp=devices // tp, tp=tp, fsdp=True, sp=sp)
    hands["TP+SP (Megatron)" if sp else "TP (Megatron, no SP)"] = dict(dp=devices // tp, tp=tp, sp=sp)
best = {}
for label, hand in hands.items():
    best[label] = None
    for ckpt in ("none", "full"):
        for m in (1, 2, 4, 8, 16, 32):
            if (batch // hand["dp"]) % m:
                continue
            try:
                e = planner.estimate(name, devices, profile, microbatches=m, checkpointing=ckpt,
                                     batch_size=batch, **hand)
            except planner.PlanningError:
                continue
            if e.memory.fits:
                best[label] = e.time.step_time_s
                break
        if best[label] is not None:
            break
out["hands"] = best
print(json.dumps(out))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--profile", default="h100-sxm-80g")
    ap.add_argument("--presets", default=",".join(p for p in PRESETS if not p.endswith("tiny")))
    ap.add_argument("--devices", default="8,64,512")
    args = ap.parse_args()
    rows = []
    for name in args.presets.split(","):
        for n in map(int, args.devices.split(",")):
            res = subprocess.run([sys.executable, "-c", CHILD, name, str(n), args.profile],
                                 capture_output=True, text=True)
            if res.returncode:
                print(f"{name} {n}: failed\n{res.stderr[-2000:]}", file=sys.stderr)
                continue
            r = json.loads(res.stdout.strip().splitlines()[-1])
            rows.append((name, n, r))
            hands = r["hands"]
            if "error" in r:
                print(f"{name:13} {n:4} {r['wall']:6.1f}s {r['rss_mb']:6.0f}MB  no plan: {r['error'][:90]}")
                continue
            worse = [k for k, v in hands.items() if v is not None and v < r["step"] * (1 - 1e-9)]
            hs = " ".join(f"{k.split()[0]}={v * 1e3:.0f}" if v else f"{k.split()[0]}=-" for k, v in hands.items())
            print(f"{name:13} {n:4} {r['wall']:6.1f}s {r['rss_mb']:6.0f}MB vars={r['vars']:5} cons={r['cons']:5} "
                  f"{r['mesh']:>9} {r['dp_mode']:11} m={r['micro']:<2} ckpt={r['ckpt']:4} "
                  f"plan={r['step'] * 1e3:8.1f}ms | hand ms: {hs} | {'PLAN<=HAND' if not worse else 'WORSE THAN ' + ','.join(worse)}",
                  flush=True)


if __name__ == "__main__":
    main()
