"""executor.rng's Philox4x32-10 words for CUDA tensors as one triton kernel: the same bits.

Written by hand because torch has no 32-bit multiply-high: ``torch.compile`` of
executor.rng's formulation (each 32 x 32 -> 64-bit product one int64 multiply) runs
64-bit integer multiplies, which a GPU executes at a small fraction of its 32-bit rate;
on an H100 a dropout over 117M elements took 6.8 ms against torch's own 0.25 ms
(docs/rng.md, "On a GPU").  triton has ``umulhi``, the instruction Philox is built on.
The rounds are Random123's, as in ``executor.rng.philox4x32``: the words equal the
eager path's, which ``tests/test_cuda.py`` checks against the CPU's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _philox_kernel(blocks, out, n, k0, k1, c2, c3, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    b = tl.load(blocks + offs, mask=mask, other=0)
    x0 = (b & 0xFFFFFFFF).to(tl.uint32)
    x1 = (b >> 32).to(tl.uint32)
    x2 = tl.full([BLOCK], c2, tl.int64).to(tl.uint32)
    x3 = tl.full([BLOCK], c3, tl.int64).to(tl.uint32)
    y0 = tl.full([BLOCK], k0, tl.int64).to(tl.uint32)
    y1 = tl.full([BLOCK], k1, tl.int64).to(tl.uint32)
    m0 = tl.full([BLOCK], 0xD2511F53, tl.int64).to(tl.uint32)
    m1 = tl.full([BLOCK], 0xCD9E8D57, tl.int64).to(tl.uint32)
    w0 = tl.full([BLOCK], 0x9E3779B9, tl.int64).to(tl.uint32)
    w1 = tl.full([BLOCK], 0xBB67AE85, tl.int64).to(tl.uint32)
    for _ in tl.static_range(10):
        a0, a2 = x0, x2
        x0 = tl.umulhi(m1, a2) ^ x1 ^ y0
        x2 = tl.umulhi(m0, a0) ^ x3 ^ y1
        x1 = m1 * a2
        x3 = m0 * a0
        y0 = y0 + w0
        y1 = y1 + w1
    row = out + offs * 4
    tl.store(row, x0.to(tl.int64), mask=mask)
    tl.store(row + 1, x1.to(tl.int64), mask=mask)
    tl.store(row + 2, x2.to(tl.int64), mask=mask)
    tl.store(row + 3, x3.to(tl.int64), mask=mask)


def philox_words(blocks: torch.Tensor, key: tuple[int, int], op: int) -> torch.Tensor:
    """``(len(blocks), 4)`` int64 words for counters ``(block, op)`` under ``key``, as
    executor.rng's ``_philox`` returns them; ``blocks``: int64 block indices on CUDA."""
    blocks = blocks.contiguous()
    out = torch.empty((blocks.numel(), 4), dtype=torch.int64, device=blocks.device)
    if blocks.numel():
        grid = (triton.cdiv(blocks.numel(), _BLOCK),)
        _philox_kernel[grid](blocks, out, blocks.numel(), key[0], key[1], op & 0xFFFFFFFF, op >> 32,
                             BLOCK=_BLOCK)
    return out
