"""How close the placement ILP's pipeline memory bound comes to the stages it lets through.

The ILP runs before the stages are cut and bounds an average stage (model states / pp,
one micro-batch of every layer's activations, FSDP's gathered units estimated before the
placements); ``planner.pipeline.partition`` then prices each stage as it runs.  For each
layout (model preset, H100s, pp x dp x tp with FSDP over dp, 1F1B, 2·pp micro-batches,
with and without full checkpointing) the ILP is solved with the bound lifted, so that
every layout is compared and none is shaped by the bound, and the bound's bytes of that
solution are set against its largest stage's.  No GPU: these are the cost model's own
numbers, compared with each other (docs/cost_model.md, "Pipeline memory in the ILP").

    python -m bench.pipeline_memory_bound
"""

from __future__ import annotations

import statistics

from planner.ilp import _choice_bytes
from planner.search import _feature_divisor, _gathered_estimate, _resolve, _search

CASES = (("llama3-70b", 64, 64, 4096), ("llama3-8b", 8, 32, 8192), ("qwen2-7b", 16, 64, 4096),
         ("mixtral-8x7b", 32, 64, 4096))


def main() -> None:
    print(f"{'model':13s} {'layout':16s} {'ckpt':5s} {'bound GiB':>9s} {'stage GiB':>9s} {'ratio':>6s}  layers per stage")
    ratios = []
    for model, devices, batch, seq in CASES:
        graph, prof, batch, seq, config = _resolve(model, devices, "h100-sxm-80g", batch, seq)
        divisor = _feature_divisor(graph, config)
        for pp in (2, 4, 8, 16):
            for tp in (1, 2, 4, 8):
                if devices % (pp * tp) or divisor % tp or pp > graph.graph["layers"]:
                    continue
                dp = devices // (pp * tp)
                if (batch // dp) % (2 * pp):
                    continue
                for ckpt in ("none", "full"):
                    fixed = {"fsdp": dp > 1, "checkpointing": ckpt, "microbatches": 2 * pp,
                             "schedules": (("1f1b", 1),)}
                    best = _search(graph, prof, devices, batch, seq, [(("pp", "dp", "tp"), (pp, dp, tp))],
                                   divisor, 60, lambda _m: None, fixed=fixed, lift_memory=True).best
                    if best is None:
                        continue
                    bound = (sum(_choice_bytes(c, pp) for c in best.solution.choice.values())
                             + _gathered_estimate(best.ctx, graph, pp))
                    stage = best.prediction.memory.total
                    ratios.append(bound / stage)
                    split = [s.layers[1] - s.layers[0] for s in best.stages]
                    print(f"{model:13s} {f'pp{pp} dp{dp} tp{tp}':16s} {ckpt:5s} {bound / 2**30:9.1f} "
                          f"{stage / 2**30:9.1f} {bound / stage:6.2f}  {split}", flush=True)
    errors = [abs(r - 1) for r in ratios]
    print(f"\n{len(ratios)} layouts: bound / largest stage {min(ratios):.2f}-{max(ratios):.2f}, "
          f"within 5% on {sum(e <= 0.05 for e in errors)}, mean error {statistics.mean(errors):.1%}")


if __name__ == "__main__":
    main()
