"""What a plan's micro-batches buy without a pipeline: peak memory and time of one step.

``executor.apply`` runs a plan's ``microbatches`` inside the model's training call
(executor.accumulate).  This times one training step (forward, backward) of a small
Llama under a 1-device plan with 1, 2 and 4 micro-batches, the loop unchanged, and
samples the process's resident memory while the step runs (``bench.rng.peak_extra_rss``,
glibc's mmap threshold pinned so RSS follows live tensor bytes), beside the activation
bytes the plan predicts (``prediction.memory.activations``).  The steps take turns
(``--repeats`` rounds) so the machine's load drift hits them alike; medians.

    python -m bench.microbatches [--batch 8] [--seq 512] [--repeats 5]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from collections.abc import Callable

import torch

import executor
import planner
from bench.rng import peak_extra_rss
from planner.presets import build_model, load_config

MODEL = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 8192,
         "max_position_embeddings": 2048, "tie_word_embeddings": False}


def _step(parts: int, ids: torch.Tensor) -> tuple[Callable[[], None], float]:
    executor.rng.manual_seed(0)
    model = build_model(load_config(MODEL), device="cpu").train()
    plan = planner.hand_plan(MODEL, devices=1, profile="cpu-gloo-local", microbatches=parts,
                             batch_size=ids.shape[0], seq_len=ids.shape[1], require_fit=False)
    model = executor.apply(plan, model)

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up: gradient tensors, allocator
    return step, plan.prediction.memory.activations


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    try:  # glibc: M_MMAP_THRESHOLD (-3) fixed at 64 KiB, see bench.rng.peak_extra_rss
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)
    except OSError:
        print("note: not glibc; the RSS figures may under-report (freed memory is reused)")
    ids = torch.randint(0, MODEL["vocab_size"], (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    counts = [m for m in (1, 2, 4) if args.batch % m == 0]
    made = {m: _step(m, ids) for m in counts}
    steps = {m: step for m, (step, _) in made.items()}
    peaks: dict[int, list[int]] = {m: [] for m in counts}
    times: dict[int, list[float]] = {m: [] for m in counts}
    for _ in range(args.repeats):
        for m, step in steps.items():
            t0 = time.perf_counter()
            peaks[m].append(peak_extra_rss(step))
            times[m].append(time.perf_counter() - t0)
    print(f"Llama h{MODEL['hidden_size']} L{MODEL['num_hidden_layers']} vocab {MODEL['vocab_size']}, "
          f"batch {args.batch} x seq {args.seq}, 1 process, forward + backward; medians of {args.repeats}")
    print(f"{'micro-batches':>13} {'peak extra RSS MiB':>19} {'x whole':>8} {'predicted activations MiB':>26} "
          f"{'step s':>8} {'x whole':>8}")
    base_peak, base_time = statistics.median(peaks[1]), statistics.median(times[1])
    for m in counts:
        peak, t = statistics.median(peaks[m]), statistics.median(times[m])
        print(f"{m:>13} {peak / 2**20:>19.1f} {peak / base_peak:>8.2f} {made[m][1] / 2**20:>26.1f} "
              f"{t:>8.3f} {t / base_time:>8.2f}")


if __name__ == "__main__":
    main()
