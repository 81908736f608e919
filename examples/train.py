"""Train a model with a meshplan plan; the loop is the same on 1 and N devices.

    meshplan plan llama-tiny --devices 2 --profile cpu-gloo-local --batch-size 8 --seq-len 64 -o plan2.json
    meshplan plan llama-tiny --devices 1 --profile cpu-gloo-local --batch-size 8 --seq-len 64 -o plan1.json
    torchrun --nproc_per_node 2 examples/train.py plan2.json    # 2 processes (gloo on CPU, NCCL on CUDA)
    python examples/train.py plan1.json                          # the 1-device reference: the same losses

The model is the plan's own (a preset name or a config.json path), built on the meta
device so that no rank holds it whole; attention dropout is switched on to show that
the random numbers, too, are the single-device run's.  Every rank reads the same global
batch (here synthetic token ids from a seeded generator); ``executor.apply`` takes each
rank's slice.  Rank 0 prints one line per step.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

import executor
import planner
from planner.presets import build_model, load_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plan", help="plan JSON written by `meshplan plan`")
    parser.add_argument("--steps", type=int, default=5, help="training steps (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default: %(default)s)")
    parser.add_argument("--dropout", type=float, default=0.1,
                        help="attention dropout probability (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=1234, help="executor.rng seed (default: %(default)s)")
    parser.add_argument("--save", metavar="DIR", help="write a distributed checkpoint here at the end")
    args = parser.parse_args()

    with open(args.plan) as f:
        plan = planner.Plan.from_json(f.read())
    try:
        config = load_config(plan.model)
    except planner.ConfigError as e:
        sys.exit(f"train.py: the plan's model {plan.model!r} is not a preset or config.json path "
                 f"this example can rebuild: {e}")
    for field in ("attention_dropout", "attn_pdrop"):  # Llama-family, GPT-2
        if hasattr(config, field):
            setattr(config, field, args.dropout)

    executor.rng.manual_seed(args.seed)  # before the model is built: its initial weights come from it
    model = executor.apply(plan, build_model(config, device="meta"))
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = torch.Generator().manual_seed(args.seed)
    device = next(model.parameters()).device  # the plan's: a GPU under a GPU profile
    rank = dist.get_rank() if dist.is_initialized() else 0
    for step in range(args.steps):
        ids = torch.randint(0, config.vocab_size, (plan.batch_size, plan.seq_len), generator=data).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
    if args.save:
        executor.save(args.save, model=model, optimizer=opt)
        if rank == 0:
            print(f"saved {args.save}", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
