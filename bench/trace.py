"""Trace wall time and node count per preset (issue 2's targets: llama3-8b <= 3 s,
llama3-405b <= 2x llama3-8b).  Each preset is traced in a fresh process so that
one-off import and first-export costs are counted the same for every row.

    python -m bench.trace [--seq-len 4096] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

from planner.presets import PRESETS

CHILD = """
import sys, time
import planner.tracer as t
from planner.presets import load_config, PRESETS
name, seq = sys.argv[1], int(sys.argv[2])
cfg = load_config(name)
pos = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
seq = min(seq, pos)
t.trace("llama-tiny", 1, 8)  # warm torch.export in this process
t0 = time.perf_counter()
g = t.trace(name, 1, seq)
wall = time.perf_counter() - t0
tot = t.totals(g)
print(wall, tot["nodes"], g.number_of_nodes(), g.graph["layers"], g.graph["traced_layers"], tot["train_flops"], seq)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"{'preset':14} {'seq':>5} {'median s':>9} {'nodes':>6} {'exported':>8} {'layers':>9} {'train TFLOP/seq':>16}")
    for name in PRESETS:
        walls = []
        for _ in range(args.repeats):
            out = subprocess.run([sys.executable, "-c", CHILD, name, str(args.seq_len)],
                                 capture_output=True, text=True, check=True).stdout.split()
            walls.append(float(out[0]))
        nodes, exported, layers, traced, flops, seq = out[1:]
        print(f"{name:14} {seq:>5} {statistics.median(walls):9.2f} {nodes:>6} {exported:>8} "
              f"{traced + '/' + layers:>9} {float(flops) / 1e12:16.1f}")


if __name__ == "__main__":
    main()
