"""Randomness that is identical to a single-device run, whatever the sharding.

Every random value is a pure function ``f(seed, k, i)`` of the seed, the index
``k`` of the random op in program order (the *counter*) and the element's
linear index ``i`` in the op's global (logical) tensor.  The function is the
Philox4x32-10 counter-based generator (Salmon et al., SC'11), written here in
vectorised torch integer ops: torch has no public stateless Philox usable on
CPU and CUDA alike, and integer arithmetic is bit-exact on every device.  A
DTensor rank evaluates ``f`` only for the global indices of its own shard, so
no rank ever materialises the global tensor and no communication is needed.

User code is unchanged: :func:`manual_seed` pushes a
:class:`torch.overrides.TorchFunctionMode` that reroutes the random ops models
use (dropout, attention dropout, ``torch.rand*``, ``Tensor.uniform_/normal_/
bernoulli_/exponential_`` and the ``nn.init`` functions) to this generator.  See
``docs/rng.md`` for the contract, the activation rules and the limits.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import numbers
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake
from torch.overrides import TorchFunctionMode

__all__ = [
    "manual_seed",
    "get_state",
    "is_seeded",
    "set_state",
    "is_active",
    "deactivate",
    "checkpoint_context_fn",
    "batch_rows",
    "redirected",
    "suspended",
    "use_compiled_generator",
    "dropout",
    "sdpa",
    "philox4x32",
]

_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF
_PHILOX_MUL = (0xD2511F53, 0xCD9E8D57)
_PHILOX_BUMP = (0x9E3779B9, 0xBB67AE85)
_PHILOX_ROUNDS = 10

Word = torch.Tensor | int  # 32-bit unsigned values held in int64 tensors or Python ints


# --------------------------------------------------------------------------- Philox


def _mulhilo(a: Word, m: int) -> tuple[Word, Word]:
    """High and low 32-bit halves of the product ``a * m`` of two 32-bit values.

    Tensors take ONE int64 multiply.  The product needs 64 unsigned bits and
    may exceed 2**63 - 1, but torch's int64 ``*`` wraps modulo 2**64 (two's
    complement: the CPU and CUDA multiply instructions, and the kernels
    torch.compile emits), so the result holds every bit of the product.  The
    halves are returned *unmasked*: ``p >> 32`` is the high half with copies
    of the sign bit above bit 31, and ``p`` is the low half with the high
    half above it.  :func:`_mix` masks once after its xors, which saves two of
    the ten kernels a round needs.  tests/test_rng.py checks the wrap-around
    against exact Python-int products on the extreme values, so a platform
    that broke it would fail there rather than silently change the stream.
    (The previous formulation split ``a`` into 16-bit halves to stay below
    2**63: exact without wrap-around, but eight kernels per product.)
    """
    p = a * m
    return p >> 32, p if isinstance(p, torch.Tensor) else p & _M32


def _mix(hi: Word, word: Word, key: Word) -> Word:
    """``(hi ^ word ^ key) & 0xFFFFFFFF`` in as few kernels as the operand types allow.

    Python ints (the counter words that are the same for every element, and
    the key) fold into one scalar first.  ``hi``, when a tensor, is a fresh
    shift result and is updated in place; ``word`` may be the caller's
    counter, so it is only read.  Only the low 32 bits of tensor operands
    matter: the final mask clears whatever :func:`_mulhilo` left above them.
    """
    scalar, tensors = 0, []
    for operand in (hi, word, key):
        if isinstance(operand, int):
            scalar ^= operand
        else:
            tensors.append(operand)
    if not tensors:
        return scalar & _M32
    acc = tensors[0] if tensors[0] is hi else tensors[0] ^ scalar
    if acc is hi and scalar:
        acc.bitwise_xor_(scalar)
    for operand in tensors[1:]:
        acc.bitwise_xor_(operand)
    return acc.bitwise_and_(_M32)


def philox4x32(counter: Sequence[Word], key: Sequence[Word]) -> tuple[Word, Word, Word, Word]:
    """Philox4x32-10 block function: four 32-bit words per 128-bit counter.

    Counter words may be int64 tensors (values in ``[0, 2**32)``, all of one
    shape) or Python ints; the key is two Python ints or 0-d tensors.  Words
    that are ints stay ints until a tensor reaches them (with the counter
    ``(block, 0, op, 0)`` the first two rounds are half scalar work).
    Matches the Random123 known-answer vectors (see tests/test_rng.py).
    """
    c0, c1, c2, c3 = counter
    k0, k1 = key[0] & _M32, key[1] & _M32
    for r in range(_PHILOX_ROUNDS):
        if r:
            k0 = (k0 + _PHILOX_BUMP[0]) & _M32
            k1 = (k1 + _PHILOX_BUMP[1]) & _M32
        hi0, lo0 = _mulhilo(c0, _PHILOX_MUL[0])
        hi1, lo1 = _mulhilo(c2, _PHILOX_MUL[1])
        c0, c1, c2, c3 = _mix(hi1, c1, k0), lo1, _mix(hi0, c3, k1), lo0
    # c1 and c3 are raw products (see _mulhilo); c0 and c2 are already masked.
    return c0, c1 & _M32, c2, c3 & _M32


@dataclass(frozen=True)
class _Indices:
    """Global linear indices of the elements a rank computes, in local row-major order.

    Three forms, cheapest first: a contiguous range ``start + [0, count)``
    (plain tensors, Shard on the leading dim: Philox blocks are computed once
    and all four output words are used); ``rows`` of ``run`` consecutive
    indices each (Shard on an inner dim: only one int64 per row is stored, so
    chunks materialise their indices on demand); or ``explicit`` indices.
    """

    start: int
    count: int
    device: torch.device
    explicit: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    run: int = 0

    @property
    def index(self) -> torch.Tensor | None:
        """One int64 per element, or None for the range form."""
        if self.rows is None:
            return self.explicit
        steps = torch.arange(self.run, dtype=torch.int64, device=self.device)
        return (self.rows.unsqueeze(-1) + steps).reshape(-1)

    def to(self, device: torch.device) -> _Indices:
        explicit = None if self.explicit is None else self.explicit.to(device)
        rows = None if self.rows is None else self.rows.to(device)
        return _Indices(self.start, self.count, device, explicit, rows, self.run)

    def split(self, size: int) -> Iterator[_Indices]:
        """Consecutive pieces of about ``size`` elements (whole rows), in order."""
        if self.rows is not None:
            per = max(1, size // self.run)
            for at in range(0, len(self.rows), per):
                rows = self.rows[at : at + per]
                yield _Indices(0, len(rows) * self.run, self.device, rows=rows, run=self.run)
            return
        for at in range(0, self.count, size):
            n = min(size, self.count - at)
            if self.explicit is None:
                yield _Indices(self.start + at, n, self.device)
            else:
                yield _Indices(0, n, self.device, explicit=self.explicit[at : at + n])

    def pairs(self) -> _Indices:
        """Indices of the element pairs (Box-Muller yields two normals per draw)."""
        index = self.index
        if index is not None:
            return _Indices(0, self.count, self.device, explicit=index // 2)
        if self.count == 0:
            return self
        first = self.start // 2
        return _Indices(first, (self.start + self.count - 1) // 2 - first + 1, self.device)


def _words(seed: int, op: int, where: _Indices, per: int) -> torch.Tensor:
    """``per`` (1, 2 or 4) random 32-bit words for each index, shape ``(count, per)``.

    Element ``i`` uses lane ``i % (4 // per)`` of Philox block ``i // (4 // per)``;
    the Philox counter is ``(block, op)`` and the key is the seed.
    """
    lanes = 4 // per
    arange = functools.partial(torch.arange, dtype=torch.int64, device=where.device)
    if where.explicit is None and where.rows is None:
        first = where.start // lanes
        last = (where.start + where.count - 1) // lanes if where.count else first - 1
        words = _philox(seed, op, arange(first, last + 1))
        skip = where.start - first * lanes
        return words.reshape(-1, per)[skip : skip + where.count]
    if where.rows is not None and where.run >= 4 * lanes:
        residue = where.rows % lanes
        first = int(residue[0])
        if bool((residue == first).all()):
            # Every row starts on the same lane (the usual case: shard sizes are
            # multiples of 4): a grid of exactly the blocks the rows cover, sliced,
            # with no index tensor; a plain view when rows start on lane 0.
            span = (first + where.run + lanes - 1) // lanes
            blocks = ((where.rows // lanes).unsqueeze(-1) + arange(span)).reshape(-1)
            grid = _philox(seed, op, blocks).view(len(where.rows), span * lanes, per)
            return grid[:, first : first + where.run].reshape(-1, per)
        # Long rows: a (rows x blocks-per-row) grid of blocks, at most one spare block per row.
        span = (where.run + lanes - 1) // lanes + 1
        words = _philox(seed, op, ((where.rows // lanes).unsqueeze(-1) + arange(span)).reshape(-1))
        take = (where.rows % lanes).unsqueeze(-1) + arange(where.run)
        grid = words.view(len(where.rows), span * lanes, per)
        return grid.gather(1, take.unsqueeze(-1).expand(-1, -1, per)).reshape(-1, per)
    index = where.index
    # The indices are increasing, so equal blocks are adjacent: compute each once.
    blocks, which = torch.unique_consecutive(index // lanes, return_inverse=True)
    return _philox(seed, op, blocks).view(-1, lanes, per)[which, index % lanes]


def _philox(seed: int, op: int, blocks: torch.Tensor) -> torch.Tensor:
    """``(len(blocks), 4)`` words, from the compiled kernel where it is on and works."""
    key = (seed & _M32, seed >> 32)
    compiled = _compiled_kernel(blocks)
    if compiled is not None and blocks.is_cuda and _COMPILED["triton"]:
        try:  # triton's 32-bit multiply-high: torch.compile's int64 products are slow on GPUs
            from executor.rng_triton import philox_words

            with torch._C.DisableTorchFunction():
                return philox_words(blocks, key, op)
        except Exception as e:  # no triton: the compiled torch kernel below, same bits
            _LOG.warning("executor.rng: the triton Philox kernel failed (%s: %s); using the "
                         "torch.compile'd one from now on", type(e).__name__,
                         str(e).splitlines()[0] if str(e) else "")
            _COMPILED["triton"] = False
    if compiled is not None:
        as_tensor = functools.partial(torch.tensor, dtype=torch.int64, device=blocks.device)
        try:
            # The kernel is integer arithmetic with nothing for a torch-function mode to
            # reroute.  Traced under this module's mode (or local_regions'), dynamo guards
            # on the mode's Python state, which its own tracing mutates (_NOT_RANDOM
            # learns the kernel's ops): "Guard failed on the same frame it was created",
            # and the generator fell back to eager ops for the rest of the process.
            with torch._C.DisableTorchFunction():
                return compiled(blocks, as_tensor(key[0]), as_tensor(key[1]),
                                as_tensor(op & _M32), as_tensor(op >> 32))
        except Exception as e:  # no C++ compiler, no triton, an inductor bug: same bits eagerly
            _LOG.warning("executor.rng: the compiled Philox kernel failed (%s: %s); drawing "
                         "with eager torch ops from now on (same bits, slower)",
                         type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            _COMPILED["fn"], _COMPILED["enabled"] = None, False
    # Words equal for every element stay Python ints, which saves most of the
    # first two rounds (see philox4x32); the block's high word is 0 below
    # 2**32 blocks (16 Gi elements), checked here rather than assumed.
    high = blocks >> 32 if blocks.numel() and int(blocks.max()) >> 32 else 0
    words = philox4x32((blocks & _M32, high, op & _M32, op >> 32), key)
    return torch.stack(words, dim=-1)


def _philox_blocks(
    blocks: torch.Tensor, k0: Word, k1: Word, op_lo: Word, op_hi: Word
) -> torch.Tensor:
    """``(len(blocks), 4)`` words for counters ``(block, op)`` under key ``(k0, k1)``.

    The compiled form: every argument is a tensor, so one kernel serves every
    seed and op (the eager path in :func:`_philox` keeps scalars as ints).
    """
    zero = torch.zeros_like(blocks)
    out = philox4x32((blocks & _M32, blocks >> 32, zero + op_lo, zero + op_hi), (k0, k1))
    return torch.stack(out, dim=-1)


_LOG = logging.getLogger(__name__)
# enabled: None = not decided yet (the default: on unless MESHPLAN_RNG_KERNEL=eager).
_COMPILED: dict[str, Any] = {"fn": None, "enabled": None, "triton": True}


def _kernel_enabled() -> bool:
    if _COMPILED["enabled"] is None:
        _COMPILED["enabled"] = os.environ.get("MESHPLAN_RNG_KERNEL", "compiled") != "eager"
    return _COMPILED["enabled"]


def _compiled_kernel(blocks: torch.Tensor) -> Callable[..., torch.Tensor] | None:
    """The compiled kernel for real tensors (meta and fake tensors of a dry run draw
    eagerly: there is nothing to compute), built on first use."""
    if not _kernel_enabled() or blocks.is_meta or is_fake(blocks):
        return None
    if _COMPILED["fn"] is None:
        _LOG.info("executor.rng: compiling the Philox kernel (once per process; seconds with "
                  "a warm inductor cache, about 30 s cold)")
        _COMPILED["fn"] = torch.compile(_philox_blocks, dynamic=True)
    return _COMPILED["fn"]


def use_compiled_generator(enabled: bool = True) -> None:
    """Draw with one ``torch.compile``'d Philox kernel (the default; on CUDA a triton
    kernel of its own, executor.rng_triton) or ~95 eager torch ops.

    On a CPU the compiled kernel runs at the speed of torch's native dropout
    (bench/rng.py); the eager ops cost 2-3x that, which is most of what consistent
    dropout costs a step (on an H100 the triton kernel's dropout took 12x native:
    docs/rng.md, "On a GPU").  Integer ops are exact, so the bits are the same either
    way.  The kernel is compiled on the first draw of the process (seconds with a warm inductor cache,
    about 30 s cold); where compiling fails (no C++ compiler for CPU, no triton for
    CUDA) the generator logs a warning and stays eager.  ``MESHPLAN_RNG_KERNEL=eager``
    in the environment makes eager the default (the test suite uses it, to spare every
    spawned rank the compile).  Seed and counter are passed as tensors, so the kernel is
    compiled once, not once per op.
    """
    _COMPILED.update(fn=None, enabled=enabled, triton=True)


def _mantissa_bits(dtype: torch.dtype) -> int:
    if not dtype.is_floating_point:
        raise TypeError(f"random floating-point values requested with dtype {dtype}")
    return round(-math.log2(torch.finfo(dtype).eps)) + 1  # eps = 2**-(stored mantissa bits)


def _unit(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Integers in ``[0, 2**bits)`` built from 1 or 2 words (int64, exact)."""
    if bits <= 32:
        return words[:, 0] >> (32 - bits)
    return (words[:, 0] << (bits - 32)) | (words[:, 1] >> (64 - bits))


def _uniform01(seed: int, op: int, where: _Indices, dtype: torch.dtype) -> torch.Tensor:
    """Uniform ``[0, 1)`` as float64, with the target dtype's mantissa resolution.

    The integer-to-float conversion is exact, so results are bitwise equal on
    every device; callers do their affine maps in float64 (IEEE-exact ops).
    """
    bits = _mantissa_bits(dtype)
    words = _words(seed, op, where, 2 if bits > 32 else 1)
    return _unit(words, bits).to(torch.float64) * 2.0**-bits


def _standard_normal(seed: int, op: int, where: _Indices, dtype: torch.dtype) -> torch.Tensor:
    """Box-Muller in float64: pair ``j`` gives elements ``2j`` (cos) and ``2j+1`` (sin).

    log/sqrt/cos/sin are not correctly rounded, so unlike the integer path the
    last float64 bit may differ between CPU and CUDA libraries; rounding to
    float32 hides that except with probability about 2**-29 per element.
    """
    bits = min(_mantissa_bits(dtype) + 8, 53)  # a few guard bits keep the tail smooth
    pairs = where.pairs()
    per = 2 if bits > 32 else 1
    words = _words(seed, op, pairs, 2 * per)
    u1 = (_unit(words[:, :per], bits).to(torch.float64) + 1.0) * 2.0**-bits  # (0, 1]
    u2 = _unit(words[:, per:], bits).to(torch.float64) * 2.0**-bits
    radius, cos, sin = _box_muller(u1, u2)
    index = where.index
    if index is not None:
        odd = (index & 1).bool()
        return radius * torch.where(odd, sin, cos)
    both = torch.stack((radius * cos, radius * sin), dim=-1).view(-1)
    skip = where.start - 2 * (where.start // 2)
    return both[skip : skip + where.count]


_CHUNK = 32768  # at::internal::GRAIN_SIZE: smaller inputs are not split across threads
_VECTOR_MULTIPLE = 64  # a multiple of every CPU vector width torch uses, times its unroll of 2


def _length_free(x: torch.Tensor, pad: float, *fns: Callable[..., torch.Tensor]) -> list[torch.Tensor]:
    """``fn(x)`` for each libm op ``fn`` (log, cos, sin), with bits that do not depend on
    ``x``'s length.

    torch's CPU kernels evaluate these with SIMD (Sleef) code but finish each
    thread's chunk with a scalar libm loop, and the two may differ in the last
    bit; which elements land in the scalar tail depends on the tensor's length,
    i.e. on the sharding.  Feeding fixed-size chunks, padded once with ``pad`` (a value
    in every ``fn``'s domain), keeps every element on the SIMD path.  CUDA has no tail.
    """
    if x.device.type != "cpu":
        return [fn(x) for fn in fns]
    count = x.numel()
    x = F.pad(x, (0, -count % _VECTOR_MULTIPLE), value=pad)
    outs = [torch.empty_like(x) for _ in fns]
    for start in range(0, x.numel(), _CHUNK):
        part = slice(start, start + _CHUNK)
        for fn, out in zip(fns, outs, strict=True):
            fn(x[part], out=out[part])
    return [out[:count] for out in outs]


def _box_muller(
    u1: torch.Tensor, u2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sqrt(-2 log u1)``, ``cos(2 pi u2)``, ``sin(2 pi u2)`` independent of the input length."""
    (log_u1,) = _length_free(u1, 1.0, torch.log)
    cos, sin = _length_free((2.0 * math.pi) * u2, 0.0, torch.cos, torch.sin)
    return torch.sqrt(log_u1.mul_(-2.0)), cos, sin


def _standard_exponential(seed: int, op: int, where: _Indices, dtype: torch.dtype) -> torch.Tensor:
    """``-log u`` in float64 for ``u`` uniform on (0, 1): never 0, whose log a Gumbel
    draw (``-exponential_().log()``, PhiMoE's router) would turn into infinity."""
    bits = min(_mantissa_bits(dtype) + 8, 53)  # guard bits, as for the normal's tail
    words = _words(seed, op, where, 2 if bits > 32 else 1)
    u = (_unit(words, bits).to(torch.float64) + 0.5) * 2.0**-bits
    (log_u,) = _length_free(u, 1.0, torch.log)
    return log_u.neg_()


def _bernoulli_keep(seed: int, op: int, where: _Indices, prob: float) -> torch.Tensor:
    """Boolean draw with ``P(True) = prob`` on 24-bit integers (no float on the hot path).

    ``u < prob`` for ``u = m / 2**24`` is exactly ``m < ceil(prob * 2**24)``.
    """
    threshold = math.ceil(prob * 2.0**24)
    # m = word >> 8, and m < t exactly when word < t * 2**8: one compare, no shift.
    return _words(seed, op, where, 1)[:, 0] < threshold << 8


def _randint_values(seed: int, op: int, where: _Indices, low: int, high: int) -> torch.Tensor:
    """``low + r % (high - low)`` with a 63-bit ``r`` (bias below 2**-31 for any int32 range)."""
    if high <= low:
        raise ValueError(f"randint: high ({high}) must be greater than low ({low})")
    words = _words(seed, op, where, 2)
    r = ((words[:, 0] & 0x7FFFFFFF) << 32) | words[:, 1]
    return low + r % (high - low)


# --------------------------------------------------------------------------- state


@dataclass
class _State:
    seed: int | None = None
    counter: int = 0
    # the op of the first draw on the meta device since the seed (or state) was set: where
    # building a meta model began drawing, which deferred_init.materialize replays from
    meta_start: int | None = None
    # set in a process forked from a seeded one (a DataLoader worker): until it seeds
    # anew, its draws are torch's own, which the DataLoader seeds per worker
    forked: bool = False


_STATE = _State()
_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    """A forked child inherits the seed, the counter and the mode: every DataLoader worker
    would draw the parent's next values, the same in each worker.  Such a child is not a
    rank of the SPMD program, so it draws from torch's generator, which DataLoader seeds
    per worker, as it would without this module (spawned children start unseeded alike)."""
    global _LOCK
    _LOCK = threading.Lock()  # another thread may have held it at the fork
    _STATE.forked = True


os.register_at_fork(after_in_child=_after_fork_in_child)


def _next_op(meta: bool = False) -> tuple[int, int]:
    """Reserve the next op counter; every random op (meta tensors too) takes one."""
    with _LOCK:
        if _STATE.seed is None:
            raise RuntimeError("executor.rng: call executor.rng.manual_seed(seed) first")
        op = _STATE.counter
        _STATE.counter += 1
        if meta and _STATE.meta_start is None:
            _STATE.meta_start = op
        return _STATE.seed, op


def meta_build_start() -> int | None:
    """The op counter at which the first random op on the meta device (building a model
    there) drew since the last ``manual_seed`` / ``set_state``; None if none has."""
    return _STATE.meta_start


def manual_seed(seed: int) -> None:
    """Seed the generator, reset the op counter and activate interception.

    Also seeds torch's own generators (``torch.manual_seed``) so the random
    ops this module does not cover stay reproducible on one device.  The
    interception mode is pushed on the calling thread's torch-function mode
    stack (torch keeps that stack per thread); call this outside any ``with``
    block of another torch-function mode.
    """
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):  # numpy's ints too
        raise TypeError(f"executor.rng.manual_seed: seed must be an int, got {seed!r}")
    seed = int(seed)
    with _LOCK:
        _STATE.seed = seed & _M64
        _STATE.counter = 0
        _STATE.meta_start = None
        _STATE.forked = False
    torch.manual_seed(seed & _M64)
    _install()


def is_seeded() -> bool:
    """Whether ``manual_seed`` (or ``set_state``) has given the generator a seed."""
    return _STATE.seed is not None


def get_state() -> dict[str, int]:
    """``{"seed", "counter"}``: all a checkpoint needs to resume the random stream."""
    with _LOCK:
        if _STATE.seed is None:
            raise RuntimeError("executor.rng.get_state: call executor.rng.manual_seed(seed) first")
        return {"seed": _STATE.seed, "counter": _STATE.counter}


def set_state(state: dict[str, int]) -> None:
    """Restore a state from :func:`get_state` (and activate interception)."""
    for field in ("seed", "counter"):
        value = state.get(field) if isinstance(state, dict) else None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(
                f"executor.rng.set_state: field {field!r} must be an int >= 0, got {value!r}"
            )
    with _LOCK:
        _STATE.seed = state["seed"] & _M64
        _STATE.counter = state["counter"]
        _STATE.meta_start = None
        _STATE.forked = False
    _install()


@contextmanager
def preserved() -> Iterator[None]:
    """Run the body, then put the whole state back: seed, counter and where building a
    meta model began drawing.  For executor internals that run the model's random ops
    to count them (a pipeline's dry run inside ``apply``, before ``materialize`` replays
    the build): ``set_state`` alone would forget the meta build's start."""
    with _LOCK:
        saved = _State(_STATE.seed, _STATE.counter, _STATE.meta_start)
    try:
        yield
    finally:
        with _LOCK:
            _STATE.seed, _STATE.counter, _STATE.meta_start = saved.seed, saved.counter, saved.meta_start


def checkpoint_context_fn() -> tuple[Any, Any]:
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``.

    The recomputation must redraw the forward's masks, so it runs with the
    counter the forward started at (and the :func:`batch_rows` window the
    forward ran in: a pipeline recomputes a micro-batch long after its
    forward, while other micro-batches' windows come and go) and then puts
    the counter back.
    """
    start: dict[str, Any] = {}

    @contextmanager
    def forward() -> Iterator[None]:
        start["counter"] = get_state()["counter"]
        start["rows"] = _ROWS
        yield

    @contextmanager
    def recompute() -> Iterator[None]:
        resume = get_state()
        set_state({"seed": resume["seed"], "counter": start["counter"]})
        try:
            with _rows_window(start["rows"]):
                yield
        finally:
            set_state(resume)

    return forward(), recompute()


@dataclass(frozen=True)
class _Rows:
    start: int
    count: int
    total: int


_ROWS: _Rows | None = None


@contextmanager
def _rows_window(rows: _Rows | None) -> Iterator[None]:
    global _ROWS
    outer, _ROWS = _ROWS, rows
    try:
        yield
    finally:
        _ROWS = outer


def batch_rows(start: int, count: int, total: int) -> AbstractContextManager[None]:
    """Draw for tensors of ``count`` rows as rows ``[start, start + count)`` of ``total``.

    A pipeline runs each micro-batch (a row slice of the global batch) on its
    own: inside this window, a random op on a plain tensor
    whose dim 0 is ``count`` (dropout, attention dropout, ``*_like``,
    in-place fills) draws the values of those rows of the ``total``-row
    tensor one device would see (a DTensor whose global dim 0 is ``count``
    likewise, on top of its own sharding).  A dim 0 of ``k * count`` is taken
    as the rows folded with the dims after them, batch outermost (an MoE
    router's ``[batch * seq, experts]`` scores): rows ``[k * start, k * (start
    + count))`` of ``k * total``.  Other tensors and factories given a shape
    (``torch.rand(shape)``) are unaffected.  Process-wide, like the counter.
    """
    if start < 0 or count < 1 or start + count > total:
        raise ValueError(f"batch_rows: rows [{start}, {start + count}) do not lie in a batch of {total}")
    return _rows_window(_Rows(start, count, total))


# --------------------------------------------------------------------------- layouts


def _dtensor_type() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    return DTensor


def _is_dtensor(t: object) -> bool:
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(t, dtensor)


def _contiguous_strides(shape: Sequence[int]) -> list[int]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= size
    return strides[::-1]


def _box_indices(
    global_shape: Sequence[int],
    local_shape: Sequence[int],
    offset: Sequence[int],
    device: torch.device,
) -> _Indices:
    """Global row-major indices of the sub-box ``offset + [0, local_shape)``."""
    count = math.prod(local_shape)
    strides = _contiguous_strides(global_shape)
    start = sum(o * s for o, s in zip(offset, strides, strict=True))
    cut = [d for d, (n, g) in enumerate(zip(local_shape, global_shape, strict=True)) if n != g]
    if count == 0 or not cut:
        return _Indices(start if count else 0, count, device)
    # Dims after the last cut one are whole, so each row of the box is one run.
    last = cut[-1]
    run = local_shape[last] * strides[last]
    rows = torch.tensor(offset[last] * strides[last], dtype=torch.int64, device=device)
    for n, o, s in zip(local_shape[:last], offset[:last], strides[:last], strict=True):
        axis = (torch.arange(n, dtype=torch.int64, device=device) + o) * s
        rows = (rows.unsqueeze(-1) + axis) if rows.dim() else rows + axis
    rows = rows.reshape(-1)
    if rows.numel() == 1:
        return _Indices(int(rows), count, device)
    return _Indices(0, count, device, rows=rows, run=run)


def _layout(
    t: torch.Tensor, op_name: str, allow_partial: bool = False
) -> tuple[_Indices, tuple[int, ...]]:
    """Which global indices ``t``'s local values stand for, and the local shape."""
    if not _is_dtensor(t):
        if _ROWS is None:
            return _Indices(0, t.numel(), t.device), tuple(t.shape)
        shape, start = _in_rows_window(tuple(t.shape), (0,) * t.dim())
        return _box_indices(shape, t.shape, start, t.device), tuple(t.shape)
    from torch.distributed.tensor import Partial, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    for mesh_dim, p in enumerate(t.placements):
        exact_shard = type(p) is Shard
        if not (exact_shard or isinstance(p, (Replicate, Partial))):
            raise NotImplementedError(
                f"executor.rng.{op_name}: placement {p} on mesh dim {mesh_dim} is not supported "
                "(Replicate, Shard(d) and, for dropout, Partial are)"
            )
        if isinstance(p, Partial) and not allow_partial:
            raise ValueError(
                f"executor.rng.{op_name}: a DTensor with placement {p} on mesh dim {mesh_dim} "
                "holds partial sums, so filling it with random values is ambiguous; "
                "redistribute it to Replicate or Shard first"
            )
    local = t.to_local()
    local_shape, offset = compute_local_shape_and_global_offset(
        t.shape, t.device_mesh, t.placements
    )
    if tuple(local_shape) != tuple(local.shape):
        raise ValueError(
            f"executor.rng.{op_name}: local shard shape {tuple(local.shape)} does not match "
            f"{tuple(local_shape)} expected for global shape {tuple(t.shape)} with {t.placements}"
        )
    shape, offset = _in_rows_window(tuple(t.shape), tuple(offset))
    return _box_indices(shape, local_shape, offset, local.device), tuple(local_shape)


def _in_rows_window(shape: tuple[int, ...], offset: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Global shape and offset of a box inside the :func:`batch_rows` window (unchanged outside it)."""
    rows = _ROWS
    if rows is None or not shape or shape[0] % rows.count:
        return shape, offset
    folded = shape[0] // rows.count  # rows folded with the dims after them, batch outermost
    return (rows.total * folded, *shape[1:]), (offset[0] + rows.start * folded, *offset[1:])


def _rewrap(like: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """Put local values back into ``like``'s layout (no communication)."""
    if not _is_dtensor(like):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local,
        like.device_mesh,
        like.placements,
        run_check=False,
        shape=like.shape,
        stride=like.stride(),
    )


# --------------------------------------------------------------------------- ops


Sampler = Callable[[int, int, _Indices], torch.Tensor]

# Elements per generation pass on CPU.  Eager Philox is ~100 elementwise
# kernels per pass; torch splits a kernel of GRAIN_SIZE (32768) elements or
# more across its OpenMP threads, and every such kernel ends in a barrier.
# On a busy machine (or with several ranks per host) a barrier waits for a
# descheduled thread, costing milliseconds per kernel: measured 10-20x slower
# than keeping each pass's kernels (8192 Philox blocks for dropout) below
# GRAIN_SIZE, where they run serially and stay in L2 (bench/rng.py).
_DRAW_CHUNK = 1 << 15
# Accelerators have no such barrier but pay a launch per kernel, and the compiled
# kernel is one pass whatever the device, paying its call overhead (tens of us of
# guards) per pass: large passes.
_DRAW_CHUNK_ONE_KERNEL = 1 << 22


def _draw(sampler: Sampler, seed: int, op: int, where: _Indices) -> torch.Tensor:
    """``sampler`` over ``where`` in chunks, so temporaries never scale with the shard.

    Philox needs about 16 bytes of int64 scratch per element; chunking bounds
    that whatever the shard size (see _DRAW_CHUNK for the CPU size).
    """
    one_kernel = where.device.type != "cpu" or _kernel_enabled()
    chunk = _DRAW_CHUNK_ONE_KERNEL if one_kernel else _DRAW_CHUNK
    if where.count <= chunk:
        return sampler(seed, op, where)
    return torch.cat([sampler(seed, op, part) for part in where.split(chunk)])


def _keep_sampler(prob: float) -> Sampler:
    return lambda seed, op, where: _bernoulli_keep(seed, op, where, prob)


Finish = Callable[[torch.Tensor], torch.Tensor]  # applied to the whole local shard after the draw


def _sample_into(
    t: torch.Tensor, sampler: Sampler, op_name: str, finish: Finish | None = None
) -> torch.Tensor:
    """In-place fill of ``t`` (plain, meta or DTensor) with one op's values."""
    seed, op = _next_op(meta=t.device.type == "meta")
    if t.device.type == "meta":
        return t
    where, local_shape = _layout(t, op_name)
    values = _draw(sampler, seed, op, where).view(local_shape)
    if finish is not None:
        values = finish(values)
    return t.copy_(_rewrap(t, values))


def _sample_new(
    like: torch.Tensor | None,
    shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    sampler: Sampler,
    op_name: str,
    finish: Finish | None = None,
) -> torch.Tensor:
    """New tensor (with ``like``'s layout when given) holding one op's values."""
    seed, op = _next_op(meta=device.type == "meta")
    if device.type == "meta":
        return torch.empty(shape, dtype=dtype, device=device)
    if like is None:
        where, local_shape = _Indices(0, math.prod(shape), device), tuple(shape)
    else:
        where, local_shape = _layout(like, op_name)
        where = where.to(device)
    values = _draw(sampler, seed, op, where).view(local_shape)
    if finish is not None:
        values = finish(values)
    values = values.to(dtype)
    return values if like is None else _rewrap(like, values)


def _uniform_sampler(low: float, high: float, dtype: torch.dtype) -> Sampler:
    def sample(seed: int, op: int, where: _Indices) -> torch.Tensor:
        return (_uniform01(seed, op, where, dtype) * (high - low) + low).to(dtype)

    return sample


def _normal_sampler(mean: float, std: float, dtype: torch.dtype) -> Sampler:
    def sample(seed: int, op: int, where: _Indices) -> torch.Tensor:
        return (_standard_normal(seed, op, where, dtype) * std + mean).to(dtype)

    return sample


def _exponential_sampler(lambd: float, dtype: torch.dtype) -> Sampler:
    def sample(seed: int, op: int, where: _Indices) -> torch.Tensor:
        return (_standard_exponential(seed, op, where, dtype) / lambd).to(dtype)

    return sample


def dropout(
    input: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False
) -> torch.Tensor:
    """``F.dropout`` with a single-device-identical mask (the intercepted op).

    A Partial input keeps its placement: every rank draws the same mask, and
    scaling partial sums by a common mask commutes with the pending sum.
    """
    if p < 0.0 or p > 1.0:
        raise ValueError(f"dropout probability has to be between 0 and 1, but got {p}")
    if not training or p == 0.0:
        return input
    seed, op = _next_op()
    if input.device.type == "meta":
        return input if inplace else torch.empty_like(input)
    where, local_shape = _layout(input, "dropout", allow_partial=True)
    keep = _draw(_keep_sampler(1.0 - p), seed, op, where).view(local_shape)
    local = input.to_local() if _is_dtensor(input) else input
    mask = keep.to(local.dtype) * (0.0 if p == 1.0 else 1.0 / (1.0 - p))
    if inplace:
        if _is_dtensor(input):
            return input.mul_(_rewrap(input, mask))
        return input.mul_(mask)
    return _rewrap(input, local * mask)


def _bernoulli_values(probs: torch.Tensor | float, dtype: torch.dtype) -> tuple[Sampler, Finish]:
    """Sampler for a Bernoulli draw and the map from its values to the 0/1 result.

    Tensor probabilities (aligned with the local shard) are compared after the
    draw, on the whole shard: the sampler sees one chunk at a time (_draw) and
    does not know where in the shard that chunk lies.
    """
    if not isinstance(probs, torch.Tensor):
        return _keep_sampler(float(probs)), lambda keep: keep.to(dtype)
    return _uniform_sampler(0.0, 1.0, torch.float32), lambda u: (u < probs).to(dtype)


def _local_probs(p: torch.Tensor | float, like: torch.Tensor) -> torch.Tensor | float:
    """Probabilities aligned with ``like``'s local shard."""
    if not isinstance(p, torch.Tensor):
        return p
    if _is_dtensor(p):
        if _is_dtensor(like) and p.placements != like.placements:
            raise ValueError(
                f"bernoulli: probability placements {p.placements} differ from the output's {like.placements}"
            )
        p = p.to_local()
    return p.expand(like.to_local().shape if _is_dtensor(like) else like.shape)


def sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention``; with dropout it runs as explicit ops.

    Fused kernels draw their attention-dropout mask from torch's generator in
    a kernel-specific order, so the softmax/dropout/matmul decomposition is the
    only way to give the probabilities our mask.

    DTensor q, k and v that arrive split differently (OLMo2's q_norm and k_norm span all
    heads, so the plan leaves q and k replicated or split by sequence on tp, while v comes
    out of its column-parallel projection split by heads) are first brought to one layout
    that splits only batch and heads (:func:`_aligned_heads`).
    """
    query, key, value = _aligned_heads(query, key, value)
    if is_causal and attn_mask is not None:
        raise ValueError("scaled_dot_product_attention: attn_mask and is_causal cannot both be set")
    if (dropout_p or attn_mask is not None) and _heads_sharded_alike(query, key, value):
        mask = None if attn_mask is None else _mask_for_shards(attn_mask, query)
        if attn_mask is None or mask is not None:
            return _sdpa_on_shards(query, key, value, mask, dropout_p, is_causal, scale, enable_gqa)
    if dropout_p == 0.0:
        return _layouts_agree(F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attn_mask,
            dropout_p=0.0,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        ))
    return _attention(query, key, value, attn_mask, is_causal, scale, enable_gqa,
                      lambda weights: dropout(weights, dropout_p, training=True))


def _layouts_agree(out: torch.Tensor) -> torch.Tensor:
    """A DTensor attention output whose global strides disagree with its local tensor's,
    made contiguous in both.  DTensor takes an output's strides from the kernel's meta
    function, and for GPT-2's strided q/k/v (split from one projection) the CPU kernel's
    meta function answered another layout than the kernel returned; ``.contiguous()``
    then trusted the global strides and left the local tensor as it was, and the next
    ``view`` failed on it."""
    if not _is_dtensor(out):
        return out
    with torch.no_grad():  # the local tensor itself, no autograd node for the look
        agree = out.to_local().is_contiguous() == out.is_contiguous()
    if agree:
        return out
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(out.to_local().contiguous(), out.device_mesh, out.placements, run_check=False,
                              shape=out.shape, stride=tuple(_contiguous_strides(out.shape)))


def _attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    drop: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Attention as explicit ops, with ``drop`` applied to the probabilities."""
    if enable_gqa:
        groups = query.size(-3) // key.size(-3)
        key = key.repeat_interleave(groups, dim=-3)
        value = value.repeat_interleave(groups, dim=-3)
    factor = 1.0 / math.sqrt(query.size(-1)) if scale is None else scale
    scores = query @ key.transpose(-2, -1) * factor
    if is_causal:
        length, source = query.size(-2), key.size(-2)
        attn_mask = torch.ones(length, source, dtype=torch.bool, device=_local_device(query)).tril()
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            # zeros_like: a DTensor mask (a padding mask split with the batch) stays one
            attn_mask = torch.zeros_like(attn_mask, dtype=scores.dtype).masked_fill(~attn_mask, float("-inf"))
        scores = scores + _like_layout(attn_mask, scores)
    # torch's SDPA gives a query that may attend to nothing (a left-padded position) zero
    # weights, as its math path does with this op; softmax would give NaN, which spreads
    # through the backward to every parameter.  In fp32, as fused kernels and autocast
    # compute it: under CUDA's bf16 autocast the op on bf16 scores came out of autocast with
    # an fp32 gradient its backward refused ("expected input and grad types to match").
    weights = torch.ops.aten._safe_softmax(scores.float(), -1).to(scores.dtype)
    return drop(weights) @ value


def _aligned_heads(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k and v on one layout where DTensors on one mesh arrive in different ones: of
    their own layouts, the one that splits most among those that split only batch and heads
    (evenly, for all three), value's first; the others are redistributed to it.

    Attention is independent per batch element and head, so such a layout runs it on the
    shards (:func:`_sdpa_on_shards` with dropout; DTensor's own SDPA rule without).  Left
    to DTensor, q split by sequence (or replicated) against v split by heads reached the
    decomposition's ``probabilities @ value`` bmm with v flattened to a ``_StridedShard``
    of batch x heads, for which DTensor prices every candidate strategy with its
    graph-search redistribution planner: seconds per op on a 2-D mesh, and over ten minutes
    for one op on the 3-D mesh of a replicate-only data-parallel plan (its size-1 shard dim).
    Without dropout, DTensor's SDPA on such inputs gave an output whose local strides broke
    the ``reshape`` after it."""
    tensors = (query, key, value)
    if not all(_is_dtensor(t) for t in tensors):
        return query, key, value
    mesh = query.device_mesh
    if any(t.device_mesh != mesh or t.ndim != query.ndim for t in tensors) or query.ndim < 3:
        return query, key, value
    if query.placements == key.placements == value.placements:
        return query, key, value
    from torch.distributed.tensor import Shard

    layouts = [tuple(t.placements) for t in (value, key, query)]
    target = max((pl for pl in layouts if _splits_batch_and_heads(tensors, mesh.shape, pl)), default=None,
                 key=lambda pl: math.prod(size for size, p in zip(mesh.shape, pl, strict=True) if type(p) is Shard))
    if target is None:
        return query, key, value
    q, k, v = (t if tuple(t.placements) == target else t.redistribute(mesh, target) for t in tensors)
    return q, k, v


def _splits_batch_and_heads(tensors: Sequence[torch.Tensor], mesh_shape: Sequence[int],
                            placements: Sequence[Any]) -> bool:
    """Whether ``placements`` shard only the leading dims (batch and heads) of every one of
    ``tensors``, each evenly."""
    from torch.distributed.tensor import Replicate, Shard

    for t in tensors:
        pieces = [1] * t.ndim
        for size, p in zip(mesh_shape, placements, strict=True):
            if type(p) is Shard and p.dim % t.ndim < t.ndim - 2:
                pieces[p.dim % t.ndim] *= size
            elif not isinstance(p, Replicate):
                return False
        if any(n % k for n, k in zip(t.shape, pieces, strict=True)):
            return False
    return True


def _heads_sharded_alike(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether q, k and v are DTensors on one mesh with the same placements, sharding
    only (and evenly) their leading dims: batch and heads.  Attention is independent per
    batch element and head, so each rank can then attend its own shards as plain
    tensors, skipping DTensor's dispatch for the dozen ops of the decomposition."""
    tensors = (query, key, value)
    if not all(_is_dtensor(t) for t in tensors):
        return False
    mesh, placements = query.device_mesh, query.placements
    return (all(t.device_mesh == mesh and t.placements == placements for t in tensors)
            and _splits_batch_and_heads(tensors, mesh.shape, placements))


def _mask_for_shards(mask: torch.Tensor, query: torch.Tensor) -> torch.Tensor | None:
    """The part of ``mask`` (aligned with the query's dims from the right, broadcast where
    it has size 1) for the query's local shards, cut without communication; None where it
    cannot be.  With a mask, the attention left to DTensor flattens batch and heads, which
    torch 2.11's DTensor refuses where heads are split ("Attempted to flatten multiple
    dimensions, with dimension 1 being sharded")."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = query.device_mesh, query.placements
    if _is_dtensor(mask) and mask.device_mesh != mesh:
        return None
    own = mask.placements if _is_dtensor(mask) else [Replicate()] * mesh.ndim
    part = mask.to_local() if _is_dtensor(mask) else mask
    local, offset = compute_local_shape_and_global_offset(query.shape, mesh, placements)
    lead = query.ndim - mask.ndim
    cut: dict[int, bool] = {}  # per mask dim the query splits: whether the mask arrives cut as the query is
    for p, m in zip(placements, own, strict=True):
        d = -1 if isinstance(p, Replicate) else p.dim % query.ndim - lead  # the mask's dim, if any
        if d < 0 or mask.shape[d] == 1:  # whole on this mesh dim, or broadcast over what it splits
            if not isinstance(m, Replicate):
                return None
        elif not (m == Shard(d) or isinstance(m, Replicate)) or cut.setdefault(d, m == Shard(d)) != (m == Shard(d)):
            return None
    for d in (d for d, alike in cut.items() if not alike):
        part = part.narrow(d, offset[d + lead], local[d + lead])
    return part


def _sdpa_on_shards(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> torch.Tensor:
    """:func:`sdpa` on local shards (see :func:`_heads_sharded_alike`), ``mask`` their part
    of the attention mask; the dropout mask of the local probabilities is drawn for their
    place in the global scores tensor.  Without dropout, torch's fused kernel runs on the
    shards: DTensor's own attention with a mask failed in backward where the mask came
    expanded over the batch (Laguna's sliding window under a layout that keeps attention
    whole on tp: "shape '[1, 1, 16, 16]' is invalid for input of size 1024")."""
    from torch.distributed.tensor import DTensor

    mesh, placements = query.device_mesh, query.placements

    def wrap(local: torch.Tensor, shape: tuple[int, ...]) -> DTensor:
        return DTensor.from_local(local.contiguous(), mesh, placements, run_check=False, shape=shape,
                                  stride=tuple(_contiguous_strides(shape)))

    q, k, v = query.to_local(), key.to_local(), value.to_local()
    if dropout_p == 0.0:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                             enable_gqa=enable_gqa)
    else:
        scores = (*query.shape[:-1], key.shape[-2])
        out = _attention(q, k, v, mask, is_causal, scale, enable_gqa,
                         lambda weights: dropout(wrap(weights, scores), dropout_p, training=True).to_local())
    return wrap(out, (*query.shape[:-1], value.shape[-1]))


def _local_device(t: torch.Tensor) -> torch.device:
    return t.to_local().device if _is_dtensor(t) else t.device


def _like_layout(bias: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """A plain mask added to DTensor scores is replicated on the scores' mesh."""
    if _is_dtensor(scores) and not _is_dtensor(bias):
        from torch.distributed.tensor import DTensor, Replicate

        return DTensor.from_local(
            bias, scores.device_mesh, [Replicate()] * scores.device_mesh.ndim, run_check=False
        )
    return bias


# --------------------------------------------------------------------------- interception


@functools.cache
def _signature(func: Callable[..., Any]) -> inspect.Signature:
    return inspect.signature(func)


def _bind(func: Callable[..., Any], args: tuple, kwargs: dict) -> dict[str, Any]:
    bound = _signature(func).bind(*args, **kwargs)
    bound.apply_defaults()
    return bound.arguments


def _factory_options(
    kwargs: dict[str, Any], op_name: str
) -> tuple[torch.dtype | None, torch.device, bool]:
    """dtype/device/requires_grad of a factory call; refuse options we would silently drop."""
    if kwargs.get("layout", torch.strided) not in (None, torch.strided):
        raise NotImplementedError(
            f"executor.rng: torch.{op_name} with layout={kwargs['layout']} is not supported"
        )
    if kwargs.get("pin_memory"):
        raise NotImplementedError(
            f"executor.rng: torch.{op_name} with pin_memory=True is not supported"
        )
    device = kwargs.get("device")
    device = torch.device(device) if device is not None else torch.get_default_device()
    return kwargs.get("dtype"), device, bool(kwargs.get("requires_grad", False))


def _size(args: tuple, kwargs: dict) -> tuple[int, ...]:
    if "size" in kwargs:
        return tuple(kwargs["size"])
    if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)):
        return tuple(args[0])
    return tuple(int(a) for a in args)


def _finish(t: torch.Tensor, out: torch.Tensor | None, requires_grad: bool) -> torch.Tensor:
    if out is not None:
        return out.copy_(t)
    return t.requires_grad_(requires_grad) if requires_grad else t


def _rand_factory(normal: bool) -> Callable[..., torch.Tensor]:
    name = "randn" if normal else "rand"

    def factory(*args: Any, **kwargs: Any) -> torch.Tensor:
        shape = _size(args, kwargs)
        dtype, device, requires_grad = _factory_options(kwargs, name)
        out = kwargs.get("out")
        dtype = dtype or (out.dtype if out is not None else torch.get_default_dtype())
        sampler = _normal_sampler(0.0, 1.0, dtype) if normal else _uniform_sampler(0.0, 1.0, dtype)
        return _finish(_sample_new(None, shape, dtype, device, sampler, name), out, requires_grad)

    return factory


def _rand_like(normal: bool) -> Callable[..., torch.Tensor]:
    name = "randn_like" if normal else "rand_like"

    def like_factory(input: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        dtype, _, requires_grad = _factory_options(kwargs, name)
        dtype = dtype or input.dtype
        device = (
            torch.device(kwargs["device"])
            if kwargs.get("device") is not None
            else _local_device(input)
        )
        sampler = _normal_sampler(0.0, 1.0, dtype) if normal else _uniform_sampler(0.0, 1.0, dtype)
        return _finish(
            _sample_new(input, input.shape, dtype, device, sampler, name), None, requires_grad
        )

    return like_factory


def _split_randint(ints: list[Any], kwargs: dict[str, Any]) -> tuple[int, int]:
    if "high" in kwargs:
        return int(kwargs.get("low", ints[0] if ints else 0)), int(kwargs["high"])
    if len(ints) == 1:
        return int(kwargs.get("low", 0)), int(ints[0])
    if len(ints) == 2:
        return int(ints[0]), int(ints[1])
    raise TypeError(f"randint: expected (high, size) or (low, high, size), got {len(ints)} bounds")


def _randint_factory(*args: Any, **kwargs: Any) -> torch.Tensor:
    positional = list(args)
    if "size" in kwargs:
        shape = tuple(kwargs["size"])
    elif positional and isinstance(positional[-1], (tuple, list, torch.Size)):
        shape = tuple(positional.pop())
    else:
        raise TypeError("randint: missing the size argument")
    low, high = _split_randint(positional, kwargs)
    dtype, device, requires_grad = _factory_options(kwargs, "randint")
    out = kwargs.get("out")
    dtype = dtype or (out.dtype if out is not None else torch.int64)
    sampler = _int_sampler(low, high)
    return _finish(_sample_new(None, shape, dtype, device, sampler, "randint"), out, requires_grad)


def _int_sampler(low: int, high: int) -> Sampler:
    def sample(seed: int, op: int, where: _Indices) -> torch.Tensor:
        return _randint_values(seed, op, where, low, high)

    return sample


def _randint_like(input: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    low, high = _split_randint(list(args), kwargs)
    dtype, _, requires_grad = _factory_options(kwargs, "randint_like")
    device = (
        torch.device(kwargs["device"]) if kwargs.get("device") is not None else _local_device(input)
    )
    values = _sample_new(
        input, input.shape, dtype or input.dtype, device, _int_sampler(low, high), "randint_like"
    )
    return _finish(values, None, requires_grad)


def _uniform_(
    t: torch.Tensor, a: float = 0.0, b: float = 1.0, *, generator: Any = None
) -> torch.Tensor:
    return _sample_into(t, _uniform_sampler(a, b, t.dtype), "uniform_")


def _normal_(
    t: torch.Tensor, mean: float = 0.0, std: float = 1.0, *, generator: Any = None
) -> torch.Tensor:
    if std < 0:
        raise RuntimeError(f"normal expects std >= 0.0, but found std {std}")
    return _sample_into(t, _normal_sampler(mean, std, t.dtype), "normal_")


def _exponential_(t: torch.Tensor, lambd: float = 1.0, *, generator: Any = None) -> torch.Tensor:
    if not lambd > 0:
        raise RuntimeError(f"exponential_ expects lambda > 0.0, but found lambda={lambd}")
    return _sample_into(t, _exponential_sampler(lambd, t.dtype), "exponential_")


def _bernoulli_(
    t: torch.Tensor, p: torch.Tensor | float = 0.5, *, generator: Any = None
) -> torch.Tensor:
    sampler, finish = _bernoulli_values(_local_probs(p, t), t.dtype)
    return _sample_into(t, sampler, "bernoulli_", finish)


def _bernoulli(
    input: torch.Tensor, p: float | None = None, *, generator: Any = None, out: Any = None
) -> torch.Tensor:
    probs = input if p is None else p
    sampler, finish = _bernoulli_values(_local_probs(probs, input), input.dtype)
    result = _sample_new(
        input, input.shape, input.dtype, _local_device(input), sampler, "bernoulli", finish
    )
    return _finish(result, out, False)


def _init_uniform(
    tensor: torch.Tensor, a: float = 0.0, b: float = 1.0, generator: Any = None
) -> torch.Tensor:
    with torch.no_grad():
        return _uniform_(tensor, a, b)


def _init_normal(
    tensor: torch.Tensor, mean: float = 0.0, std: float = 1.0, generator: Any = None
) -> torch.Tensor:
    with torch.no_grad():
        return _normal_(tensor, mean, std)


def _init_trunc_normal(
    tensor: torch.Tensor,
    mean: float = 0.0,
    std: float = 1.0,
    a: float = -2.0,
    b: float = 2.0,
    generator: Any = None,
) -> torch.Tensor:
    """torch's inverse-CDF algorithm (nn.init._no_grad_trunc_normal_) on our uniform."""

    def cdf(x: float) -> float:
        return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0

    low, high = cdf((a - mean) / std), cdf((b - mean) / std)
    with torch.no_grad():
        _uniform_(tensor, 2 * low - 1, 2 * high - 1)
        tensor.erfinv_()
        tensor.mul_(std * math.sqrt(2.0))
        tensor.add_(mean)
        tensor.clamp_(min=a, max=b)
    return tensor


def _kaiming_std(tensor: torch.Tensor, a: float, mode: str, nonlinearity: str) -> float:
    fan = nn.init._calculate_correct_fan(tensor, mode)
    return nn.init.calculate_gain(nonlinearity, a) / math.sqrt(fan)


def _init_kaiming_uniform(
    tensor: torch.Tensor,
    a: float = 0.0,
    mode: str = "fan_in",
    nonlinearity: str = "leaky_relu",
    generator: Any = None,
) -> torch.Tensor:
    if 0 in tensor.shape:
        return tensor
    bound = math.sqrt(3.0) * _kaiming_std(tensor, a, mode, nonlinearity)
    return _init_uniform(tensor, -bound, bound)


def _init_kaiming_normal(
    tensor: torch.Tensor,
    a: float = 0.0,
    mode: str = "fan_in",
    nonlinearity: str = "leaky_relu",
    generator: Any = None,
) -> torch.Tensor:
    if 0 in tensor.shape:
        return tensor
    return _init_normal(tensor, 0.0, _kaiming_std(tensor, a, mode, nonlinearity))


def _xavier_std(tensor: torch.Tensor, gain: float) -> float:
    fan_in, fan_out = nn.init._calculate_fan_in_and_fan_out(tensor)
    return gain * math.sqrt(2.0 / float(fan_in + fan_out))


def _init_xavier_uniform(
    tensor: torch.Tensor, gain: float = 1.0, generator: Any = None
) -> torch.Tensor:
    bound = math.sqrt(3.0) * _xavier_std(tensor, gain)
    return _init_uniform(tensor, -bound, bound)


def _init_xavier_normal(
    tensor: torch.Tensor, gain: float = 1.0, generator: Any = None
) -> torch.Tensor:
    return _init_normal(tensor, 0.0, _xavier_std(tensor, gain))


def _bound(
    impl: Callable[..., torch.Tensor], original: Callable[..., Any]
) -> Callable[..., torch.Tensor]:
    """Accept exactly the original's arguments, positional or keyword, across torch versions."""

    accepted = inspect.signature(impl).parameters

    def call(*args: Any, **kwargs: Any) -> torch.Tensor:
        arguments = _bind(original, args, kwargs)
        return impl(**{k: v for k, v in arguments.items() if k in accepted})

    return call


def _dropout_entry(*args: Any, **kwargs: Any) -> torch.Tensor:
    return dropout(**_bind(F.dropout, args, kwargs))


def _sdpa_entry(*args: Any, **kwargs: Any) -> torch.Tensor:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    arguments = dict(zip(names, args, strict=False))
    arguments.update(kwargs)
    return sdpa(**arguments)


def _torch_dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    return dropout(input, p, train)


# The composite ``nn.init`` functions are reimplemented (from torch's own formulas)
# because a torch-function mode is switched off while it handles a call, so the
# Tensor.uniform_/normal_ they call inside would not be seen.
_HANDLERS: dict[Callable[..., Any], Callable[..., Any]] = {
    F.dropout: _dropout_entry,
    torch.dropout: _torch_dropout,
    F.scaled_dot_product_attention: _sdpa_entry,
    torch.rand: _rand_factory(normal=False),
    torch.randn: _rand_factory(normal=True),
    torch.rand_like: _rand_like(normal=False),
    torch.randn_like: _rand_like(normal=True),
    torch.randint: _randint_factory,
    torch.randint_like: _randint_like,
    torch.bernoulli: _bernoulli,
    torch.Tensor.bernoulli: _bernoulli,
    torch.Tensor.uniform_: _uniform_,
    torch.Tensor.normal_: _normal_,
    torch.Tensor.bernoulli_: _bernoulli_,
    torch.Tensor.exponential_: _exponential_,
    nn.init.uniform_: _bound(_init_uniform, nn.init.uniform_),
    nn.init.normal_: _bound(_init_normal, nn.init.normal_),
    nn.init.trunc_normal_: _bound(_init_trunc_normal, nn.init.trunc_normal_),
    nn.init.kaiming_uniform_: _bound(_init_kaiming_uniform, nn.init.kaiming_uniform_),
    nn.init.kaiming_normal_: _bound(_init_kaiming_normal, nn.init.kaiming_normal_),
    nn.init.xavier_uniform_: _bound(_init_xavier_uniform, nn.init.xavier_uniform_),
    nn.init.xavier_normal_: _bound(_init_xavier_normal, nn.init.xavier_normal_),
}


# By name, captured at import: while HF's guard is active, nn.init.<name> is its wrapper.
_INIT_BY_NAME = {
    f.__name__: h
    for f, h in _HANDLERS.items()
    if getattr(f, "__module__", None) == nn.init.__name__
}


def _hf_guarded(name: str) -> Callable[..., torch.Tensor] | None:
    """Handler for ``transformers.initialization.<name>``.

    While HF initialises weights it patches ``torch.nn.init.*`` with these
    wrappers (they skip tensors flagged ``_is_hf_initialized``), so torch's
    own dispatch hands the mode the wrapper, not the torch function.  The
    wrapper's skip rule is kept; the draw is ours.
    """
    handler = _INIT_BY_NAME.get(name)
    if handler is None:
        return None

    def guarded(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if getattr(tensor, "_is_hf_initialized", False):
            return tensor
        return handler(tensor, *args, **kwargs)

    return guarded


_NOT_RANDOM: set[Any] = set()  # functions seen and not covered: every op of a step passes here


def _handler(func: Callable[..., Any]) -> Callable[..., Any] | None:
    handler = _HANDLERS.get(func)
    if handler is not None or func in _NOT_RANDOM:
        return handler
    if getattr(func, "__module__", None) == "transformers.initialization":
        handler = _hf_guarded(func.__name__)
    if handler is None:
        _NOT_RANDOM.add(func)
    else:
        _HANDLERS[func] = handler
    return handler


class _Redirect(threading.local):
    fn: Callable[[Any, tuple, dict], Any] | None = None


_REDIRECT = _Redirect()
# The covered ops that draw in the layout of their first argument: a redirect can hand
# them another view of it (executor.data: the global batch's)
FOLLOW_INPUT = frozenset({
    torch.rand_like, torch.randn_like, torch.randint_like, torch.bernoulli, torch.Tensor.bernoulli,
    torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.bernoulli_, torch.Tensor.exponential_,
})
_REDIRECTABLE = frozenset({F.dropout, torch.dropout, F.scaled_dot_product_attention, *FOLLOW_INPUT})


def draw(func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """A covered random op (one of :data:`FOLLOW_INPUT`) drawn here, past any redirect:
    the redirect's own draw."""
    return _HANDLERS[func](*args, **kwargs)


@contextmanager
def redirected(fn: Callable[[Any, tuple, dict], Any]) -> Iterator[None]:
    """While active on this thread, the dropout, attention and :data:`FOLLOW_INPUT` calls
    this module intercepts go to ``fn(func, args, kwargs)`` instead (executor.data draws
    them for the rank's batch slice, through :func:`dropout`, :func:`sdpa` and :func:`draw`)."""
    saved, _REDIRECT.fn = _REDIRECT.fn, fn
    try:
        yield
    finally:
        _REDIRECT.fn = saved


class _RandomMode(TorchFunctionMode):
    """Reroutes covered random ops; everything else passes straight through.

    Ops given an explicit ``generator=`` keep torch's semantics: the caller
    asked for that generator (e.g. a DataLoader's shuffling).
    """

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        handler = _handler(func)
        if handler is None or kwargs.get("generator") is not None or _STATE.forked:
            return func(*args, **kwargs)
        if _REDIRECT.fn is not None and func in _REDIRECTABLE:
            return _REDIRECT.fn(func, args, kwargs)
        return handler(*args, **kwargs)


_MODE = _RandomMode()


def is_active() -> bool:
    """Whether interception is on in this thread (not in a forked child until it seeds)."""
    return not _STATE.forked and _on_stack()


def _on_stack() -> bool:
    return any(m is _MODE for m in torch.overrides._get_current_function_mode_stack())


def deactivate() -> None:
    """Stop interception in this thread (the state is kept; ``manual_seed``/``set_state`` resume it)."""
    stack = torch.overrides._get_current_function_mode_stack()
    if stack and stack[-1] is _MODE:
        _MODE.__exit__(None, None, None)
    elif is_active():
        raise RuntimeError("executor.rng.deactivate: another torch-function mode is above ours")


def _install() -> None:
    """Push the mode for good (no ``__exit__``): the seed call is the only switch users need."""
    if not _on_stack():
        _MODE.__enter__()


@contextmanager
def suspended() -> Iterator[None]:
    """Run a block with torch's native RNG (benchmarks and comparisons against it)."""
    stack = torch.overrides._get_current_function_mode_stack()
    if not stack or stack[-1] is not _MODE:
        if is_active():
            raise RuntimeError("executor.rng.suspended: another torch-function mode is above ours")
        yield
        return
    with torch.overrides._pop_mode_temporarily():
        yield
