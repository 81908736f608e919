"""Cost of single-device-identical randomness: time and peak memory of sharded dropout.

One process plays rank 1 of a 4-rank world (torch's fake process group: no
communication exists to measure, and our generator needs none), so the
numbers are the per-rank cost of drawing the mask for *its* shard, next to
torch's native dropout on the very same local tensor.

    python -m bench.rng [--rows 4096] [--cols 4096] [--repeats 7] [--no-compiled]

Prints medians; timings on a shared machine are noisy, compare the ratios.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import threading
import time
from collections.abc import Callable

import psutil
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from executor import rng

WORLD, RANK, P = 4, 1, 0.1


def median_ms(*fns: Callable[[], object], repeats: int) -> list[float]:
    """Median wall time of each ``fn``, run interleaved.

    Interleaving puts every function under the same background load (the
    machine is shared), so the ratios stay meaningful when the absolute
    times drift.
    """
    for fn in fns:
        fn()  # warm-up (allocator, lazy init, compilation)
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, times in zip(fns, samples, strict=True):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return [statistics.median(times) * 1e3 for times in samples]


def peak_extra_rss(fn: Callable[[], object]) -> int:
    """Peak resident-memory growth while ``fn`` runs.

    tracemalloc does not see torch's allocations, so RSS is sampled instead;
    main() pins glibc's mmap threshold so every large tensor is mapped on
    allocation and unmapped on free, making RSS follow live tensor bytes.
    """
    proc = psutil.Process()
    base = proc.memory_info().rss
    peak, done = base, threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, proc.memory_info().rss)
            time.sleep(0.0005)

    watcher = threading.Thread(target=sample)
    watcher.start()
    try:
        result = fn()
    finally:
        done.set()
        watcher.join()
    del result
    return max(peak - base, 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--cols", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--no-compiled", action="store_true", help="skip the torch.compile'd generator"
    )
    args = parser.parse_args()

    dist.init_process_group("fake", rank=RANK, world_size=WORLD, store=FakeStore())
    mesh = init_device_mesh("cpu", (WORLD,))
    shape = (args.rows, args.cols)
    rng.manual_seed(0)
    rng.use_compiled_generator(False)  # "eager" first; the compiled kernel is timed after it
    layouts = {}
    for dim in (0, 1):
        local_shape = list(shape)
        local_shape[dim] //= WORLD
        local = torch.randn(local_shape)
        layouts[f"Shard({dim})"] = DTensor.from_local(
            local, mesh, [Shard(dim)], run_check=False, shape=shape, stride=(args.cols, 1)
        )

    def native(x: DTensor) -> torch.Tensor:
        with rng.suspended():
            return F.dropout(x.to_local(), P)

    def ours(x: DTensor) -> torch.Tensor:
        return F.dropout(x, P).to_local()

    global_bytes = args.rows * args.cols * 4
    print(
        f"dropout p={P} on rank {RANK}/{WORLD}, global {shape} float32 "
        f"({global_bytes / 2**20:.0f} MiB), local shard {global_bytes / WORLD / 2**20:.0f} MiB; "
        f"{torch.get_num_threads()} threads, medians of {args.repeats}"
    )
    header = f"{'layout':<10} {'native ms':>10} {'eager ms':>10} {'x native':>9}"
    if not args.no_compiled:
        header += f" {'compiled ms':>12} {'x native':>9} {'same bits':>10}"
    print(header)
    for name, x in layouts.items():
        t_native, t_eager = median_ms(
            lambda x=x: native(x), lambda x=x: ours(x), repeats=args.repeats
        )
        row = f"{name:<10} {t_native:>10.1f} {t_eager:>10.1f} {t_eager / t_native:>9.1f}"
        if not args.no_compiled:
            state = rng.get_state()
            eager_out = ours(x)
            rng.use_compiled_generator(True)
            rng.set_state(state)
            same = torch.equal(ours(x), eager_out)
            (t_compiled,) = median_ms(lambda x=x: ours(x), repeats=args.repeats)
            rng.use_compiled_generator(False)
            row += f" {t_compiled:>12.1f} {t_compiled / t_native:>9.1f} {str(same):>10}"
        print(row)

    # Only now: pinning glibc's mmap threshold makes every large temporary a
    # fresh mapping, which the RSS sampling needs but which would slow the
    # timings above with page faults that a normal run does not have.
    try:  # glibc: M_MMAP_THRESHOLD (-3) fixed at 64 KiB, see peak_extra_rss
        ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)
    except OSError:
        print("note: not glibc; the RSS figures may under-report (freed memory is reused)")
    print()
    print(f"{'peak extra RSS while drawing':<34} {'MiB':>8} {'x local':>8} {'x global':>9}")
    local_bytes = global_bytes / WORLD
    for label, fn in (
        ("native dropout, Shard(0) local", lambda: native(layouts["Shard(0)"])),
        ("ours, Shard(0)", lambda: ours(layouts["Shard(0)"])),
        ("ours, Shard(1)", lambda: ours(layouts["Shard(1)"])),
    ):
        extra = statistics.median(peak_extra_rss(fn) for _ in range(3))
        print(
            f"{label:<34} {extra / 2**20:>8.1f} {extra / local_bytes:>8.2f} {extra / global_bytes:>9.2f}"
        )

    a, b = torch.randn(64, 64), torch.randn(64, 64)

    def adds() -> None:
        for _ in range(1000):
            a + b

    def adds_suspended() -> None:
        with rng.suspended():
            adds()

    with_mode, without = median_ms(adds, adds_suspended, repeats=args.repeats)
    print()
    print(
        f"interception cost on a non-random op (64x64 add): {with_mode - without:.2f} us per op "
        f"({without:.2f} -> {with_mode:.2f} us)"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
