"""The GPU profiles against published end-to-end training throughputs (a validation set).

`meshplan estimate` predicts tokens/s per GPU for layouts whose throughput TorchTitan
published (``docs/performance.md`` of pytorch/torchtitan), and this prints predicted
against published.  The cost model's constants come from datasheets and kernel
micro-benchmarks (each profile's ``source``); nothing here feeds back into them, so the
error column measures the model and must not be used to tune it.

Only TorchTitan's eager bf16 runs are compared (FSDP2 on every GPU, no torch.compile,
no Float8, AdamW): the model has no compiled-kernel fusion or fp8 GEMMs.  What differs
between their runs and ours, as far as the sources say:

* A100 (64 GPUs, Llama 2 / 3, early 2024): the network between nodes is not stated;
  the profile assumes InfiniBand NDR, one NIC per GPU.  TorchTitan's ``selective op``
  checkpointing saves every other matmul and the reduce-scatter outputs;
  ``executor.apply``'s (the one modelled) saves every matmul and attention output, so it
  needs more memory: TorchTitan's Llama 2 70B at local batch 1 does not fit in the
  model.
* H100 (8 and 128 GPUs, Llama 3.1 8B, December 2024): 96 GB HBM2e parts at 2.4 TB/s and
  a 500 W power limit, whose peak is "between SXM and NVL" (TorchTitan).  These rows use
  ``h100-sxm-80g`` with that memory size and bandwidth (``h100-96g``); its peak stays
  the SXM part's, so they over-predict by construction, by an unknown factor (NVL's bf16
  peak is 84% of SXM's).

Every published run is priced (``require_fit=False``: they ran); ``fits`` says whether
the planner would take the layout, i.e. whether the predicted peak is within 90% of the
memory (``cost_model.memory.DEFAULT_HEADROOM``).  The predicted peak includes what FSDP2
holds gathered (``fsdp_gathered_bytes``).

    python -m bench.costmodel_published
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from typing import Any

import planner
from cost_model.profile import load_profile

# Llama 2 (not a preset): Hugging Face configs of meta-llama/Llama-2-13b-hf and -70b-hf.
LLAMA2_13B = {"model_type": "llama", "vocab_size": 32000, "hidden_size": 5120,
              "intermediate_size": 13824, "num_hidden_layers": 40, "num_attention_heads": 40,
              "num_key_value_heads": 40, "max_position_embeddings": 4096,
              "tie_word_embeddings": False, "rms_norm_eps": 1e-5}
LLAMA2_70B = {**LLAMA2_13B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
              "num_attention_heads": 64, "num_key_value_heads": 8}


# TorchTitan's H100s (docs/performance.md): 96 GB of HBM2e at 2.4 TB/s; peak not stated.
H100_96G = {**json.loads(load_profile("h100-sxm-80g").model_dump_json()), "name": "h100-96g",
            "memory_bytes": 96 * 10**9, "memory_bandwidth": 2.4e12}


@dataclass(frozen=True)
class Published:
    label: str
    model: str | dict[str, Any]
    gpus: int
    profile: str | dict[str, Any]
    local_batch: int
    seq_len: int
    checkpointing: str
    tokens_per_s_per_gpu: float  # TorchTitan's WPS: tokens per second per GPU
    memory_gib: float | None = None  # peak memory per GPU, where published


# TorchTitan docs/performance.md: Llama 3 and Llama 2 on 64 A100 80GB (FSDP2), and
# Table 1 / Table 3 (FSDP, no compile, no Float8) for Llama 3.1 8B on H100.
CASES = [
    Published("Llama 3 8B", "llama3-8b", 64, "a100-sxm-80g", 1, 8192, "selective", 2973),
    Published("Llama 3 70B", "llama3-70b", 64, "a100-sxm-80g", 1, 8192, "full", 331),
    Published("Llama 2 13B", LLAMA2_13B, 64, "a100-sxm-80g", 2, 4096, "none", 2162),
    Published("Llama 2 13B", LLAMA2_13B, 64, "a100-sxm-80g", 2, 4096, "selective", 1904),
    Published("Llama 2 70B", LLAMA2_70B, 64, "a100-sxm-80g", 1, 4096, "selective", 355),
    Published("Llama 2 70B", LLAMA2_70B, 64, "a100-sxm-80g", 2, 4096, "full", 353),
    Published("Llama 3.1 8B", "llama3-8b", 8, H100_96G, 2, 8192, "selective", 5762, 82.4),
    Published("Llama 3.1 8B", "llama3-8b", 128, H100_96G, 2, 8192, "selective", 5605, 67.0),
]


def main() -> None:
    print("TorchTitan's published eager bf16 FSDP2 throughputs against `meshplan estimate` "
          "(dp = GPUs, fsdp, the same checkpointing, global batch = local batch x GPUs)")
    print(f"{'model':<13} {'GPUs':>4} {'profile':<13} {'batch':>5} {'seq':>5} {'ckpt':<9} "
          f"{'published':>9} {'predicted':>9} {'error':>7} {'MFU pred':>8} {'GiB pred':>8} {'fits':>4} "
          f"{'published':>9}")
    errors: dict[str, list[float]] = {}
    for c in CASES:
        name = c.profile if isinstance(c.profile, str) else c.profile["name"]
        start = time.perf_counter()
        try:
            p = planner.estimate(c.model, c.gpus, c.profile, dp=c.gpus, fsdp=True,
                                 checkpointing=c.checkpointing, batch_size=c.local_batch * c.gpus,
                                 seq_len=c.seq_len, require_fit=False)  # they ran: price them anyway
        except planner.PlanningError as e:
            print(f"{c.label:<13} {c.gpus:>4} {name:<13} {c.local_batch:>5} {c.seq_len:>5} "
                  f"{c.checkpointing:<9} {c.tokens_per_s_per_gpu:>9.0f}  not estimated: {e}")
            continue
        error = p.tokens_per_s_per_device / c.tokens_per_s_per_gpu - 1
        errors.setdefault(name, []).append(error)
        print(f"{c.label:<13} {c.gpus:>4} {name:<13} {c.local_batch:>5} {c.seq_len:>5} "
              f"{c.checkpointing:<9} {c.tokens_per_s_per_gpu:>9.0f} {p.tokens_per_s_per_device:>9.0f} "
              f"{error:>+7.0%} {p.mfu:>8.2f} {p.memory.total / 2**30:>8.1f} {'yes' if p.memory.fits else 'no':>4} "
              f"{'' if c.memory_gib is None else c.memory_gib:>9}  ({time.perf_counter() - start:.1f} s)")
    for profile, errs in errors.items():
        print(f"{profile}: median error {statistics.median(errs):+.0%} over {len(errs)} runs, "
              f"MAPE {statistics.mean(abs(e) for e in errs):.0%}")


if __name__ == "__main__":
    main()
