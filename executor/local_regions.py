"""Module bodies on local shards: DTensor's per-op dispatch skipped where one DTensor run
shows what it would do.

Under tensor parallelism every op of a transformer layer (views, transposes, the
rotary embedding, activations, norms, residual adds) dispatches through DTensor: tens of
microseconds of Python per op and again in backward, about 10% of a small Llama's step
on CPU.  TorchTitan hands plain local tensors between its parallel modules, which is
right only because its author knows the model.  Here each *region* (a repeated block,
i.e. an ``nn.ModuleList`` entry, or a module whose parameters all sit in direct
``nn.Linear`` children: HF attention and MLP blocks) learns it instead:

1. **Record.**  The first grad-enabled call runs through DTensor as before, while every
   executor boundary inside it (the hooks that convert activations, executor.apply; the
   random ops, executor.rng) writes on a *tape* the DTensor layout (mesh, placements,
   global shape and stride) of what it receives and returns, and, in a backward over that
   run for a fixed cotangent, the placements of their gradients.
2. **Check.**  The region runs again on local tensors, the tape replayed at the same
   boundaries (a local tensor is wrapped with the recorded layout, converted as recorded,
   and unwrapped), from the same random state.  Outputs and the gradients of inputs and
   parameters must match the DTensor run; the ranks of the model mesh agree (all-reduce
   MIN) before the region goes local.  A region that fails, or whose body does anything
   the tape cannot replay, stays on DTensor (logged).  On torch's ``fake`` process group
   collectives return garbage, so there the check is structural only: the replay runs,
   matches the tape and issues the collectives the recording issued.  (A reduction
   DTensor makes inside the body, which the replay lacks, shows there only by that count:
   Apertus' xIELU scalars, whose gradients DTensor sums over the tp ranks mid-backward.)
   Learning waits while a tool hooks every module (CommDebugMode,
   FlopCounterMode), which the extra runs would confuse.
3. **Replay.**  Later calls with the same input shapes run locally with the tape: the
   same collectives at the same boundaries, none of DTensor's dispatch in between.

The check runs with saved-tensor hooks and dispatch modes lifted (activation
checkpointing must not see it) on detached copies of the inputs, and the random state is
restored afterwards, so the real call draws what the DTensor call would have drawn.

Hand-written: torch has no way to run a module on local shards with DTensor's semantics
other than TorchTitan's per-model parallel styles, which assume what is checked here.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._redistribute import redistribute_local_tensor
from torch.distributed.tensor.placement_types import Placement
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from executor import rng
from executor.collectives import Collectives

_LOG = logging.getLogger(__name__)
_NAMESPACES = ("_c10d_functional", "c10d")  # the collectives DTensor and torch.distributed issue
MAX_SHAPES = 4  # signatures (input shapes, what needs a gradient) learned per region; others run on DTensor
# What a region's call may carry besides tensors for it to learn and replay: values no run
# can change (a cache object, which the body appends to, keeps the region on DTensor).
_VALUES = (torch.Tensor, type(None), bool, int, float, complex, str, torch.dtype, torch.device,
           torch.memory_format)


class _Mismatch(Exception):
    """The replay left the recorded path."""


@dataclass
class _Layout:
    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]
    local_shape: torch.Size
    grad: tuple[Placement, ...] | None = None  # filled in the recording's backward

    @staticmethod
    def of(t: DTensor) -> _Layout:
        return _Layout(t.device_mesh, tuple(t.placements), t.shape, t.stride(), t.to_local().shape)

    def wrap(self, local: torch.Tensor) -> DTensor:
        if local.shape != self.local_shape:
            raise _Mismatch(f"local shape {tuple(local.shape)}, recorded {tuple(self.local_shape)}")
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False,
                                  shape=self.shape, stride=self.stride)

    def unwrap(self, t: DTensor) -> torch.Tensor:
        return t.to_local(grad_placements=self.grad or self.placements)

    def watch(self, t: torch.Tensor) -> None:
        """Record the placements of ``t``'s gradient when the recording's backward runs."""
        if t.requires_grad:
            t.register_hook(self._seen)

    def _seen(self, grad: torch.Tensor) -> None:
        if isinstance(grad, DTensor):
            self.grad = tuple(grad.placements)


@dataclass
class _Step:
    """One boundary crossing: the layouts of what went in and what came out (None: a
    plain tensor), and whether the boundary changed anything."""

    ins: list[_Layout | None]
    outs: list[_Layout | None]
    changed: bool
    # per dtype, set on the first replay with it: _direct_specs, or () for the round trip
    direct: dict[torch.dtype, tuple[DTensorSpec, ...]] = field(default_factory=dict)


def _direct_specs(step: _Step, dtype: torch.dtype) -> tuple[DTensorSpec, ...] | None:
    """(from, to, gradient from, gradient to) specs where ``step`` moves one tensor
    between placements on one mesh: the replay runs it as DTensor's own
    ``redistribute_local_tensor`` on the local shard, forward and backward, without the
    three autograd functions, the wrapper objects and the placement planning of a
    ``from_local`` -> ``redistribute`` -> ``to_local`` round trip.  The gradient goes from
    the placements the recording's backward delivered to the input's, pending sums made
    Replicate, as ``redistribute``'s and ``from_local``'s backward do together.  Anything
    else (random ops, several tensors) takes the round trip; the check in
    ``Region._learn`` compares either with the DTensor run."""
    if len(step.ins) != 1 or len(step.outs) != 1:
        return None
    a, b = step.ins[0], step.outs[0]
    if a is None or b is None or a.mesh != b.mesh or a.shape != b.shape or a.placements == b.placements:
        return None

    def spec(lay: _Layout, placements: tuple[Placement, ...]) -> DTensorSpec:
        return DTensorSpec(lay.mesh, placements, tensor_meta=TensorMeta(lay.shape, lay.stride, dtype))

    grad_to = tuple(Replicate() if p.is_partial() else p for p in a.placements)
    return spec(a, a.placements), spec(b, b.placements), spec(b, b.grad or b.placements), spec(a, grad_to)


class _Redistribute(torch.autograd.Function):
    """A local shard moved as ``_direct_specs`` says."""

    @staticmethod
    def forward(ctx: Any, local: torch.Tensor, specs: tuple[DTensorSpec, ...]) -> torch.Tensor:
        ctx.specs = specs
        return redistribute_local_tensor(local, specs[0], specs[1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return redistribute_local_tensor(grad.contiguous(), ctx.specs[2], ctx.specs[3]), None


def _moved(step: _Step, local: torch.Tensor) -> torch.Tensor | None:
    """``local`` moved directly (``_direct_specs``), or None where the step takes the round
    trip.  (A conversion the executor shares, q, k and v or a parallel block's attention
    and MLP reading one hidden state, is one step: its later readers hit the shared
    result before reaching a boundary.)"""
    if local.dtype not in step.direct:
        step.direct[local.dtype] = _direct_specs(step, local.dtype) or ()
    specs = step.direct[local.dtype]
    if not specs:
        return None
    if local.shape != step.ins[0].local_shape:
        raise _Mismatch(f"local shape {tuple(local.shape)}, recorded {tuple(step.ins[0].local_shape)}")
    return _Redistribute.apply(local, specs)


@dataclass
class _Tape:
    inputs: list[_Layout | None] = field(default_factory=list)
    steps: list[_Step] = field(default_factory=list)
    outputs: list[_Layout | None] = field(default_factory=list)
    # the placements of a parameter's gradient on local shards, by name in the region,
    # where they are not the parameter's own (_pending_grads)
    grads: dict[str, tuple[Placement, ...]] = field(default_factory=dict)
    # recording only: tensors the body made that crossed a boundary unchanged, whose
    # gradients the replay cannot convert (_unconverted)
    unmarked: list[_Layout] = field(default_factory=list)


class _State(threading.local):
    def __init__(self) -> None:
        self.mode: str | None = None  # "record" or "replay"
        self.whole = 0  # inside a module kept whole (Whole): the hooks within convert nothing
        self.tape: _Tape | None = None
        self.at = 0
        # recording: the region's inputs and what changed boundaries returned, whose
        # gradients the replay converts as recorded (by id, each checked by a weak reference)
        self.marked: dict[int, weakref.ref] = {}
        # recording: the detached copies of the region's inputs it runs on, by id, with the
        # tensors they were copied from (``original``)
        self.copies: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


_STATE = _State()


def active() -> bool:
    """Whether a region is being recorded or replayed on this thread: the executor's hooks
    then convert every tensor through :func:`convert`, so both runs cross the same steps."""
    return _STATE.mode is not None


def original(t: torch.Tensor) -> torch.Tensor:
    """The tensor a recording's input ``t`` was copied from, else ``t``.  The check records
    a region on detached copies of its inputs, and a hook that asks where a tensor came
    from (``executor.apply``: whether a module's input is its parent's conversion) must
    get the answer the real call would: else the MLP region's first projection took its
    converted input for a fresh one, and the recording added an all-reduce of its
    gradient where the conversion's backward reduce-scatters it (sequence parallelism)."""
    entry = _STATE.copies.get(id(t))
    return entry[1] if entry is not None and entry[0] is t else t


def convert(values: Any, fn: Callable[[Any], Any], op: bool = False) -> Any:
    """``fn(values)`` (a tensor, or a pytree of them), taped inside a region.  ``op``: ``fn``
    computes something of its own (a random op), which the replay runs even where the
    recording got back what went in (``exponential_``, in place)."""
    if _STATE.whole:
        return values
    if _STATE.mode is None:
        return fn(values)
    tape = _STATE.tape
    if _STATE.mode == "record":
        out = fn(values)
        leaves_in, _ = tree_flatten(values)
        leaves_out, _ = tree_flatten(out)
        step = _Step(_layouts(leaves_in), _layouts(leaves_out),
                     any(a is not b for a, b in zip(leaves_in, leaves_out, strict=False))
                     or len(leaves_in) != len(leaves_out))
        for t, layout in zip(leaves_out, step.outs, strict=True):
            if layout is None:
                continue
            if step.changed:
                _mark(t)
            elif not _is_marked(t):
                tape.unmarked.append(layout)
            layout.watch(t)
        tape.steps.append(step)
        return out
    if _STATE.at >= len(tape.steps):
        raise _Mismatch("more boundary crossings than recorded")
    step = tape.steps[_STATE.at]
    _STATE.at += 1
    if not step.changed and not op:
        return values
    leaves, spec = tree_flatten(values)
    if len(leaves) != len(step.ins):
        raise _Mismatch("a boundary received another number of values than recorded")
    if len(leaves) == 1 and isinstance(leaves[0], torch.Tensor) and not isinstance(leaves[0], DTensor):
        moved = _moved(step, leaves[0])
        if moved is not None:
            return tree_unflatten([moved], spec)
    wrapped = [lay.wrap(t) if lay is not None else t for t, lay in zip(leaves, step.ins, strict=True)]
    out_leaves, out_spec = tree_flatten(fn(tree_unflatten(wrapped, spec)))
    if len(out_leaves) != len(step.outs):
        raise _Mismatch("a boundary returned another number of values than recorded")
    return tree_unflatten([lay.unwrap(t) if isinstance(t, DTensor) and lay is not None else t
                           for t, lay in zip(out_leaves, step.outs, strict=True)], out_spec)


def _layouts(leaves: list[Any]) -> list[_Layout | None]:
    return [_Layout.of(t) if isinstance(t, DTensor) else None for t in leaves]


class _RandomOps(TorchFunctionMode):
    """Random ops are boundaries too: executor.rng draws a shard's values from its global
    layout, which a local tensor has lost."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if rng._handler(func) is None or kwargs.get("generator") is not None or not rng.is_active():
            return func(*args, **kwargs)
        return convert((args, kwargs), lambda a: func(*a[0], **a[1]), op=True)


def _mark(t: torch.Tensor) -> None:
    _STATE.marked[id(t)] = weakref.ref(t)


def _is_marked(t: torch.Tensor) -> bool:
    ref = _STATE.marked.get(id(t))
    return ref is not None and ref() is t


@contextmanager
def _taping(mode: str, tape: _Tape, inputs: Sequence[Any] = ()) -> Iterator[None]:
    saved = (_STATE.mode, _STATE.tape, _STATE.at, _STATE.marked)
    _STATE.mode, _STATE.tape, _STATE.at, _STATE.marked = mode, tape, 0, {}
    for t in inputs:
        if isinstance(t, torch.Tensor):
            _mark(t)
    try:
        with _RandomOps():
            yield
        if mode == "replay" and _STATE.at != len(tape.steps):
            raise _Mismatch("fewer boundary crossings than recorded")
    finally:
        _STATE.mode, _STATE.tape, _STATE.at, _STATE.marked = saved


class Region:
    """One module whose forward runs on local shards once its tape is checked."""

    def __init__(self, fqn: str, module: nn.Module, mesh: DeviceMesh) -> None:
        self.fqn, self.module, self.mesh = fqn, module, mesh
        self.forward = module.forward
        self.tapes: dict[tuple, _Tape | None] = {}
        self.told_stateful = False  # logged that a call's mutable argument keeps it on DTensor
        module.forward = self  # an instance attribute: module hooks still run around it

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _STATE.mode is not None:  # inside another region's recording or replay
            return self.forward(*args, **kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        stateful = next((t for t in leaves if not isinstance(t, _VALUES)), None)
        if stateful is not None:  # (an empty cache is falsy)
            # An object the body may change (a key/value cache it appends to): the check's
            # extra runs would change it too, and a replay could not restore it.
            if not self.told_stateful:
                self.told_stateful = True
                _LOG.info("executor: %s stays on DTensor while its call carries a %s "
                          "(use_cache=False keeps it local)", self.fqn, type(stateful).__name__)
            return self.forward(*args, **kwargs)
        shapes = (str(spec), *((type(t).__name__, tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t)
                               for t in leaves))
        if not torch.is_grad_enabled():  # no gradients to place: any tape of these shapes replays
            tape = next((t for (s, _), t in self.tapes.items() if s == shapes and t is not None), None)
            return self.forward(*args, **kwargs) if tape is None else self._replay(tape, args, kwargs)
        # what needs a gradient is part of the key: a tape recorded while a parameter or an
        # input was frozen holds no layout for its gradient (unfreezing later replayed wrong ones)
        key = (shapes, tuple(p.requires_grad for p in self.module.parameters())
               + tuple(t.requires_grad for t in leaves if isinstance(t, torch.Tensor)))
        if key not in self.tapes:
            if len(self.tapes) >= MAX_SHAPES or _hooked_globally():
                return self.forward(*args, **kwargs)
            self.tapes[key] = self._learn(args, kwargs)
        tape = self.tapes[key]
        if tape is None:
            return self.forward(*args, **kwargs)
        return self._replay(tape, args, kwargs)

    # -- the three runs -----------------------------------------------------------------

    def _record(self, args: tuple, kwargs: dict) -> tuple[_Tape, Any]:
        tape = _Tape()
        leaves, _ = tree_flatten((args, kwargs))
        tape.inputs = _layouts(leaves)
        for t, layout in zip(leaves, tape.inputs, strict=True):
            if layout is not None:
                layout.watch(t)
        with _taping("record", tape, leaves):
            out = self.forward(*args, **kwargs)
        tape.outputs = _layouts(tree_flatten(out)[0])
        return tape, out

    def _replay(self, tape: _Tape, args: tuple, kwargs: dict) -> Any:
        leaves, spec = tree_flatten((args, kwargs))
        local = [lay.unwrap(t) if lay is not None and isinstance(t, DTensor) else t
                 for t, lay in zip(leaves, tape.inputs, strict=True)]
        largs, lkwargs = tree_unflatten(local, spec)
        with _taping("replay", tape), _local_parameters(self.module, tape.grads):
            out = self.forward(*largs, **lkwargs)
        out_leaves, out_spec = tree_flatten(out)
        if len(out_leaves) != len(tape.outputs):
            raise _Mismatch("another number of outputs than recorded")
        return tree_unflatten([lay.wrap(t) if lay is not None else t
                               for t, lay in zip(out_leaves, tape.outputs, strict=True)], out_spec)

    def _learn(self, args: tuple, kwargs: dict) -> _Tape | None:
        state = rng.get_state() if rng.is_active() else None
        leaves, spec = tree_flatten((args, kwargs))
        try:
            with _isolated(), _generic_values(self.module):
                named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
                params = [p for _, p in named]
                inputs = [t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
                          for t in leaves]
                dargs, dkwargs = tree_unflatten(inputs, spec)
                _STATE.copies = {id(c): (c, t) for c, t in zip(inputs, leaves, strict=True)
                                 if isinstance(t, torch.Tensor) and c is not t}
                try:
                    with Collectives(*_NAMESPACES) as recorded:
                        tape, expected = self._record(dargs, dkwargs)
                        expected_grads = _vjp(expected, inputs, params)
                finally:
                    _STATE.copies = {}
                if expected_grads:
                    tape.grads = _pending_grads(named, expected_grads[len(expected_grads) - len(named):])
                _unconverted(tape)
                if state is not None:
                    rng.set_state(state)
                with Collectives(*_NAMESPACES) as replayed:
                    got = self._replay(tape, dargs, dkwargs)
                    got_grads = _vjp(got, inputs, params)
                ok = _matches(expected, got) and _matches(expected_grads, got_grads)
                reason = "" if ok else "local run differs from DTensor's"
                if ok and _fake() and replayed.counts != recorded.counts:
                    ok, reason = False, (f"local run issues {dict(replayed.counts)}, DTensor's "
                                         f"{dict(recorded.counts)}")
        except Exception as e:  # noqa: BLE001
            # whatever the check met, the region stays on DTensor, and every rank reaches
            # the agreement below (a rank that raised left the others waiting in it: an
            # AttributeError from a replay did); the DTensor forward that follows raises
            # any error of the model's own
            tape, ok, reason = None, False, f"{type(e).__name__}: {e}"
        finally:
            if state is not None:
                rng.set_state(state)
        ok = _all_agree(ok, self.mesh)
        if not ok:
            _LOG.info("executor: %s stays on DTensor (%s)", self.fqn, reason or "another rank's check failed")
            return None
        _LOG.info("executor: %s runs on local shards", self.fqn)
        return tape


def regions(model: nn.Module, mesh: DeviceMesh) -> list[Region]:
    """Make every region of ``model`` learn to run locally: a repeated block (an
    ``nn.ModuleList`` entry: a transformer layer, its norms and residual adds included)
    or a module whose parameters all sit in direct ``nn.Linear`` children (attention, MLP),
    with every parameter a DTensor on ``mesh``.  Regions nest; the outermost whose check
    passes runs locally, and the ones inside it learn only if it fails."""
    repeated = {id(block) for block in blocks(model)}
    found = []
    for fqn, module in model.named_modules():
        if module is model or any(True for _ in module.parameters(recurse=False)):
            continue
        holders = [m for m in module.modules() if any(True for _ in m.parameters(recurse=False))]
        children = set(module.children())
        linear = all(isinstance(m, nn.Linear) and m in children for m in holders)
        if holders and (linear or id(module) in repeated) and all(
                isinstance(p, DTensor) for p in module.parameters()):
            found.append(Region(fqn, module, mesh))
    return found


def blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of ``model``: ``nn.ModuleList`` entries that hold parameters
    (transformer layers; also what apply wraps in FSDP2 and checkpoints)."""
    return [child for m in model.modules() if isinstance(m, nn.ModuleList)
            for child in m if any(True for _ in child.parameters())]


def running_locally(model: nn.Module) -> list[str]:
    """FQNs of the regions of ``model`` that run on local shards (for at least one input shape)."""
    return [fqn for fqn, m in model.named_modules()
            if isinstance(vars(m).get("forward"), Region) and any(vars(m)["forward"].tapes.values())]


# -- helpers ------------------------------------------------------------------------------

def _hooked_globally() -> bool:
    """Whether a tool hooks every module (CommDebugMode's module tracker, FlopCounterMode):
    the check's extra runs and backward would confuse it, so learning waits for a call
    it does not watch.  (Reads torch's private hook registries; if they move, this
    answers no, and such a tool sees the check.)"""
    from torch.nn.modules import module

    return any(getattr(module, name, None) for name in (
        "_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
        "_global_backward_hooks"))


@contextmanager
def _swapped_parameters(module: nn.Module, replace: Callable[[str, torch.Tensor], torch.Tensor | None]
                        ) -> Iterator[None]:
    """Each parameter of the region (by FQN within it) swapped for ``replace``'s tensor
    (kept where it answers None), the originals put back afterwards: the parameter
    objects are swapped, never written, so graphs that saved them stay valid."""
    swapped = []
    for prefix, sub in module.named_modules():
        for name, p in list(sub._parameters.items()):
            new = None if p is None else replace(f"{prefix}.{name}" if prefix else name, p)
            if new is not None:
                swapped.append((sub, name, p))
                sub._parameters[name] = new
    try:
        yield
    finally:
        for sub, name, p in swapped:
            sub._parameters[name] = p


def _local_parameters(module: nn.Module, grads: dict[str, tuple[Placement, ...]]) -> AbstractContextManager:
    """The region's DTensor parameters swapped for their local shards (differentiable:
    gradients reach the DTensor parameters with the placements ``grads`` recorded, else
    their own)."""
    return _swapped_parameters(module, lambda fqn, p: p.to_local(grad_placements=grads.get(fqn))
                               if isinstance(p, DTensor) else None)


@contextmanager
def _isolated() -> Iterator[None]:
    """The check's runs save their tensors normally and escape dispatch modes (activation
    checkpointing's, a debug mode's), so the forward around it is unaffected."""
    from torch.utils._python_dispatch import _disable_current_modes

    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t), _disable_current_modes():
        yield


def _generic_values(module: nn.Module) -> AbstractContextManager:
    """The region's parameters swapped for copies holding a fixed pattern, for the check.

    The check must tell a wrong replay from DTensor's semantics whatever values the
    parameters take later in training.  Hugging Face initialises biases to zero, and a
    row-parallel bias that the replay adds on every rank before the sum (tp x the bias;
    DTensor adds it once) matched at the first call, then drifted from one device's
    training as the bias moved.  The pattern (a low-discrepancy sequence in [-0.1, 0.1)
    over each local tensor's elements) is the same on every rank that holds a tensor of
    that shape, so replicated parameters stay replicated.  Swapped, not written in place:
    a forward earlier in the same graph may have saved the live ones for its backward."""
    def pattern(_fqn: str, p: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            local = p.to_local() if isinstance(p, DTensor) else p
            values = (torch.arange(local.numel(), dtype=torch.float64, device=local.device) * 0.6180339887498949
                      ).remainder(1.0).sub(0.5).mul(0.2).to(local.dtype).view(local.shape)
            if isinstance(p, DTensor):
                values = DTensor.from_local(values, p.device_mesh, p.placements, run_check=False,
                                            shape=p.shape, stride=p.stride())
        return nn.Parameter(values, requires_grad=p.requires_grad)

    return _swapped_parameters(module, pattern)


def _vjp(out: Any, inputs: list[Any], params: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """Gradients of ``out`` for a fixed cotangent (a function of each element's global index)."""
    outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    wrt = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad] + params
    if not outs or not wrt:
        return []
    cotangents = [_cotangent(t) for t in outs]
    return list(torch.autograd.grad(outs, wrt, cotangents, allow_unused=True))


def _cotangent(t: torch.Tensor) -> torch.Tensor:
    full = torch.sin(torch.arange(t.numel(), dtype=t.dtype, device=_device(t)) * 0.37).view(t.shape)
    if not isinstance(t, DTensor):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, t.device_mesh, t.placements)


def _device(t: torch.Tensor) -> torch.device:
    return t.to_local().device if isinstance(t, DTensor) else t.device


def _matches(a: Any, b: Any) -> bool:
    xs, ys = tree_flatten(a)[0], tree_flatten(b)[0]
    if len(xs) != len(ys):
        return False
    fake = _fake()
    for x, y in zip(xs, ys, strict=True):
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            if (x is None) != (y is None):
                return False
            continue
        x, y = ((t.full_tensor() if isinstance(t, DTensor) else t).detach() for t in (x, y))
        if x.shape != y.shape:
            return False
        if not fake and not torch.allclose(x, y, rtol=1e-5, atol=1e-6 * max(1.0, float(x.abs().max()))):
            return False
    return True


def _fake() -> bool:
    """Whether this runs on torch's ``fake`` process group, whose collectives return
    garbage: values cannot be compared there."""
    return dist.is_initialized() and dist.get_backend() == "fake"


def _unconverted(tape: _Tape) -> None:
    """Refuse a body whose gradient changes placement where no boundary converts it.

    Without sequence parallelism a replicated activation feeds column-parallel
    projections unchanged (no collective forward), and its gradient is a pending sum
    (Megatron's ``f``: an all-reduce backward only).  When that activation enters the
    region, the replay converts its gradient where it unwraps it; made inside the body (a
    transformer layer's normed hidden state) it is a plain local tensor, and the pending
    sum would meet the residual stream's replicated gradient unreduced.  Such a layer
    runs as its attention and MLP regions instead."""
    for layout in tape.unmarked:
        if layout.grad is not None and layout.grad != layout.placements:
            raise _Mismatch(f"a value made inside the body has placements {list(layout.placements)} and a "
                            f"gradient {list(layout.grad)}, and no boundary converts it")


def _pending_grads(named: list[tuple[str, torch.Tensor]], grads: list[torch.Tensor | None],
                   ) -> dict[str, tuple[Placement, ...]]:
    """Where a local run's parameter gradient is a pending sum: on the mesh dims where the
    parameter is replicated and the recording's gradient is Partial (a norm weight applied
    to a sequence shard sums over only that shard).  A sharded parameter's local gradient
    is its shard whatever DTensor chose in the recording (it may compute a row-parallel
    weight's gradient whole, as a pending sum of full size)."""
    out = {}
    for (name, p), g in zip(named, grads, strict=True):
        if not isinstance(p, DTensor) or not isinstance(g, DTensor):
            continue
        local = tuple(gp if isinstance(pp, Replicate) and gp.is_partial() else pp
                      for pp, gp in zip(p.placements, g.placements, strict=True))
        if local != tuple(p.placements):
            out[name] = local
    return out


def _all_agree(ok: bool, mesh: DeviceMesh) -> bool:
    flag = torch.tensor([int(ok)], device=_mesh_device(mesh))
    for dim in range(mesh.ndim):
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=mesh.get_group(dim))
    return bool(flag.item())


def _mesh_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.accelerator.current_device_index())


# -- modules kept whole --------------------------------------------------------------------

class Whole:
    """A module kept whole on the model dims (every parameter replicated there, its input
    replicated by its layout): its body runs on local tensors, as on one device.  Left to
    DTensor, a body that makes tensors of its own (Gated DeltaNet's chunked delta rule:
    ``torch.zeros`` recurrent state, ``solve_triangular``) mixes them with DTensors: the
    forward's ``implicit_replication`` lets it, but autograd saves the plain tensors and
    the backward's matmul refuses the mix.  Every rank computes the same values, so the
    input's and the parameters' gradients are replicated, and the output is too."""

    def __init__(self, fqn: str, module: nn.Module, mesh: DeviceMesh) -> None:
        self.fqn, self.module, self.mesh = fqn, module, mesh
        self.forward = module.forward
        module.forward = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if _STATE.mode == "replay":  # inside a region replaying on local tensors already
            with self._inside():
                return self.forward(*args, **kwargs)
        leaves, spec = tree_flatten((args, kwargs))

        def local(t: Any) -> Any:
            if not isinstance(t, DTensor):
                return t
            whole = [Replicate()] * t.device_mesh.ndim
            if list(t.placements) != whole:
                t = t.redistribute(t.device_mesh, whole)
            return t.to_local(grad_placements=whole)

        largs, lkwargs = tree_unflatten([local(t) for t in leaves], spec)
        with _swapped_parameters(self.module, lambda fqn, p: local(p) if isinstance(p, DTensor) else None), \
                self._inside():
            out = self.forward(*largs, **lkwargs)
        replicate = [Replicate()] * self.mesh.ndim
        return tree_map_only(torch.Tensor, lambda t: t if isinstance(t, DTensor) else
                             DTensor.from_local(t, self.mesh, replicate, run_check=False), out)

    @staticmethod
    @contextmanager
    def _inside() -> Iterator[None]:
        _STATE.whole += 1
        try:
            yield
        finally:
            _STATE.whole -= 1


def kept_whole(model: nn.Module, mesh: DeviceMesh, replicated_input: Callable[[str], bool]) -> list[Whole]:
    """Wrap the outermost modules whose parameters are all replicated DTensors on ``mesh``,
    whose layout takes a replicated input (``replicated_input(fqn)``), and which hold
    ``nn.Linear`` children beside parameters of other kinds: a body of more than matmuls
    (Gated DeltaNet's), which DTensor cannot always run."""
    found: list[Whole] = []
    inside: set[str] = set()
    for fqn, module in model.named_modules():
        if module is model or isinstance(module, nn.Linear) or any(fqn.startswith(f + ".") for f in inside):
            continue
        params = list(module.parameters())
        holders = [m for m in module.modules() if any(True for _ in m.parameters(recurse=False))]
        if not params or all(isinstance(m, nn.Linear) for m in holders) \
                or not any(isinstance(m, nn.Linear) for m in holders):
            continue  # a bare linear or norm (or a router's weight), which DTensor runs
        if not all(isinstance(p, DTensor) and all(isinstance(q, Replicate) for q in p.placements) for p in params):
            continue
        if not replicated_input(fqn):
            continue
        inside.add(fqn)
        found.append(Whole(fqn, module, mesh))
    return found
