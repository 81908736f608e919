"""Materialise a meta-device model shard by shard, bitwise equal to a 1-device init.

The reference is ``executor.rng.manual_seed(seed)`` followed by building the
model for real on one device: every random init op then takes the next value
of :mod:`executor.rng`'s op counter, in construction order.  Because values
depend only on ``(seed, counter, global element index)``, :func:`materialize`
reproduces them by *replaying the same init program* on tensors that hold only
each rank's shard: it restarts the counter at ``seed``, runs every module's
``reset_parameters`` in construction order (what ``nn.Module.__init__`` does),
then, for Hugging Face models, ``initialize_weights`` (what ``post_init``
does).  The counter therefore advances exactly as in the reference, no rank
allocates a full tensor, and no communication happens but an all-reduce of the region
an init writes through an index (an embedding's padding row: ``_WriteThrough``).

A global counter was chosen over keying init ops by parameter name because
the reference build cannot know parameter names while modules are being
constructed (a child is named only when its parent attaches it), so name-keyed
draws could not match a plain ``build on CPU``.  The price is the assumption
documented in docs/rng.md: a module's random init lives in its
``reset_parameters`` (torch's convention), or in the HF ``_init_weights``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from executor import rng

__all__ = ["materialize", "register_init_draws", "PlacementFn"]

# (mesh, placements) for a DTensor, or None for a plain (replicated) tensor.
PlacementFn = Callable[[str], "tuple[object, Sequence[object]] | None"]


def _construction_order(module: nn.Module) -> Iterator[nn.Module]:
    """Post-order: a child's ``__init__`` (and its ``reset_parameters``) finishes before its parent's."""
    for child in module.children():
        yield from _construction_order(child)
    yield module


def _xielu(m: nn.Module) -> None:
    """``transformers.activations.XIELUActivation.__init__`` (Apertus' MLP): constants, no
    draws, which a meta-device build loses.  Apertus builds it with the defaults
    ``alpha_p_init = alpha_n_init = 0.8``; ``beta`` and ``eps`` are kept as floats too.
    Computed in the parameters' dtype, as ``__init__`` does in its ``dtype``."""
    def inverse_softplus(x: float) -> float:  # a number: DTensor has no fill_ from a tensor
        return torch.log(torch.expm1(torch.tensor(x, dtype=m.alpha_p.dtype))).item()

    m.alpha_p.fill_(inverse_softplus(0.8))
    m.alpha_n.fill_(inverse_softplus(0.8 - m._beta_scalar))
    m.beta.fill_(m._beta_scalar)
    m.eps.fill_(m._eps_scalar)


def _gated_delta_net(m: nn.Module) -> None:
    """Gated DeltaNet's ``__init__`` (Qwen3.5, Qwen3-Next): ``A_log = log(empty(n).uniform_(0.01, 16))``,
    one draw outside ``reset_parameters`` that ``_init_weights`` redraws anyway; redone so
    that the draws after it (the model's ``post_init``) take the counters they take in a
    CPU build.  (Its children's draws come first here, the A draw between the conv1d's and
    the projections' there: all of those are redrawn by ``_init_weights``, so only the
    number of draws counts.)"""
    m.A_log.copy_(torch.empty(m.A_log.shape, device=_local(m.A_log).device).uniform_(0.01, 16).log())


def _olmo_hybrid_delta_net(m: nn.Module) -> None:
    """OLMo Hybrid's Gated DeltaNet ``__init__``: two draws outside ``reset_parameters``
    (A's ``uniform_``, dt's ``torch.rand``), both redrawn by ``_init_weights``; redone for
    their count, as ``_gated_delta_net``."""
    device = _local(m.A_log).device
    torch.empty(m.A_log.shape, dtype=torch.float32, device=device).uniform_(0.0, 1.0)
    torch.rand(m.dt_bias.shape, device=device)
    # values: _init_weights writes both; fill them so nothing is left unwritten
    m.A_log.fill_(0.0)
    m.dt_bias.fill_(0.0)


# Modules whose __init__ sets parameters outside any reset method (random draws, or
# constants), keyed by "module.qualname" so transformers is not imported here.  Each
# entry redoes exactly what that __init__ does to them, draws in the same order.
_INIT_DRAWS: dict[str, Callable[[nn.Module], None]] = {
    "transformers.models.olmo_hybrid.modeling_olmo_hybrid.OlmoHybridGatedDeltaNet": _olmo_hybrid_delta_net,
    "transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5GatedDeltaNet": _gated_delta_net,
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeGatedDeltaNet": _gated_delta_net,
    "transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextGatedDeltaNet": _gated_delta_net,
    # transformers.pytorch_utils.Conv1D.__init__ (GPT-2): nn.init.normal_(self.weight, std=0.02)
    "transformers.pytorch_utils.Conv1D": lambda m: nn.init.normal_(m.weight, std=0.02),
    "transformers.activations.XIELUActivation": _xielu,
}


def register_init_draws(cls: type[nn.Module], redo: Callable[[nn.Module], None]) -> None:
    """Declare the random draws ``cls.__init__`` makes outside ``reset_parameters``."""
    _INIT_DRAWS[f"{cls.__module__}.{cls.__qualname__}"] = redo


def _reset(module: nn.Module) -> None:
    redo = _INIT_DRAWS.get(f"{type(module).__module__}.{type(module).__qualname__}")
    if redo is not None:
        redo(module)
        return
    # nn.MultiheadAttention's __init__ calls _reset_parameters (with an underscore).
    for name in ("reset_parameters", "_reset_parameters"):
        method = getattr(module, name, None)
        if callable(method):
            method()
            return


def _empty(
    fqn: str, like: torch.Tensor, placements: PlacementFn | None, device: torch.device
) -> torch.Tensor:
    """Uninitialised storage for ``fqn``: the local shard only when it is placed on a mesh."""
    spec = placements(fqn) if placements is not None else None
    if spec is None:
        return torch.empty(like.shape, dtype=like.dtype, device=device)
    from torch.distributed.tensor import DeviceMesh, DTensor, Partial, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, places = spec
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(
            f"materialize: placements({fqn!r}) must return (DeviceMesh, placements) or None"
        )
    places = list(places)
    if len(places) != mesh.ndim:
        raise ValueError(
            f"materialize: {fqn}: {len(places)} placements given for a {mesh.ndim}-D mesh"
        )
    for p in places:
        if isinstance(p, Shard) and not -like.dim() <= p.dim < like.dim():
            raise ValueError(
                f"materialize: {fqn}: {p} is out of range for shape {tuple(like.shape)}"
            )
        if isinstance(p, Partial):
            raise ValueError(f"materialize: {fqn}: a parameter cannot be initialised as {p}")
    places = [Shard(p.dim % like.dim()) if isinstance(p, Shard) else p for p in places]
    local_shape, _ = compute_local_shape_and_global_offset(like.shape, mesh, places)
    local = torch.empty(local_shape, dtype=like.dtype, device=mesh.device_type)
    stride = tuple(math.prod(like.shape[d + 1 :]) for d in range(like.dim()))
    return DTensor.from_local(local, mesh, places, run_check=False, shape=like.shape, stride=stride)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def materialize(
    model: nn.Module,
    placements: PlacementFn | None = None,
    *,
    seed: int | None = None,
    device: str | torch.device = "cpu",
) -> nn.Module:
    """Give every parameter and buffer of ``model`` real, shard-local storage and initialise it.

    ``placements(fqn)`` returns ``(mesh, placements)`` to make that tensor a
    DTensor holding only this rank's shard, or None to keep a plain tensor on
    ``device``.  ``seed`` defaults to the last ``executor.rng.manual_seed``, and the
    replay then starts at the op counter where building the meta model began drawing
    (draws made after the seed call and before the build stay accounted for); with an
    explicit ``seed`` it starts at that seed's counter 0.  Afterwards the generator
    stands where the reference's does after building the model, so training draws
    match too.  Tied parameters stay tied.
    Raises if some tensor is not written by the init program (a meta-device
    model has no values to fall back on).
    """
    if seed is None:
        if not rng.is_seeded():
            raise RuntimeError("a model on the meta device is initialised from executor.rng's seed: "
                               "call executor.rng.manual_seed(seed) before building it (the same "
                               "call as in the single-device run)")
        # The replay starts where building the meta model began drawing, as the CPU build
        # would have: draws made between the seed call and the build are not redone.
        state = rng.get_state()
        start = rng.meta_build_start()
        rng.set_state({"seed": state["seed"], "counter": state["counter"] if start is None else start})
    else:
        rng.manual_seed(seed)
    target = torch.device(device)

    # Every (module, name) slot gets its own storage for the replay, as in the
    # reference, where weights are tied only after initialisation.
    first_name: dict[int, str] = {}
    slots: list[tuple[nn.Module, str, str, bool]] = []  # module, attr, fqn, is_param
    for prefix, module in model.named_modules(remove_duplicate=False):
        for attr, tensor in list(module._parameters.items()) + list(module._buffers.items()):
            if tensor is None:
                continue
            fqn = f"{prefix}.{attr}" if prefix else attr
            first_name.setdefault(id(tensor), fqn)
            slots.append((module, attr, fqn, attr in module._parameters))
    canonical: dict[str, str] = {}  # fqn -> the fqn whose storage it shares after tying
    fresh: dict[str, torch.Tensor] = {}
    for module, attr, fqn, is_param in slots:
        old = module._parameters[attr] if is_param else module._buffers[attr]
        canonical[fqn] = first_name[id(old)]
        if fqn in fresh:  # a module reached twice through named_modules
            continue
        new = _empty(canonical[fqn], old, placements, target)
        if new.is_floating_point():
            _local(new).fill_(float("nan"))  # sentinel: "never written by the init program"
        else:
            _local(new).zero_()
        if is_param:
            new = nn.Parameter(new, requires_grad=old.requires_grad)
            module._parameters[attr] = new
        else:
            module._buffers[attr] = new
        fresh[fqn] = new

    with torch.no_grad():
        _clear_hf_flags(model)
        for module in _construction_order(model):
            with _WriteThrough():  # the gathered copies it remembers live for one module
                _reset(module)
                # A Hugging Face PreTrainedModel's __init__ ends with post_init(), which
                # initialises its subtree there and then (nested models included).
                if callable(getattr(module, "initialize_weights", None)):
                    module.initialize_weights()

    for module, attr, fqn, is_param in slots:
        source = fresh[canonical[fqn]]
        (module._parameters if is_param else module._buffers)[attr] = source
    missing = [
        fqn
        for fqn, t in fresh.items()
        if canonical[fqn] == fqn and t.is_floating_point() and bool(_local(t).isnan().any())
    ]
    if missing:
        raise ValueError(
            "materialize: not initialised by reset_parameters()/_init_weights, so their values "
            f"exist only in the meta model's constructor: {', '.join(missing)}"
        )
    return model


class _WriteThrough(TorchFunctionMode):
    """Make an init's in-place write through an index reach the shard that holds it.

    ``weight[padding_idx].zero_()`` (torch's ``nn.Embedding`` and HF's ``_init_weights``)
    indexes a DTensor on a dim it is sharded by; DTensor answers with a gathered copy of
    the whole tensor, so the write is lost (and ``weight[i] = 0.5`` has no DTensor rule).
    Here such an index gives a replicated copy of the indexed region only, built from
    each rank's part of it by one all-reduce (``_region``); the copy is remembered with
    its base and index, as is any index of it, and after an in-place op on one, each rank
    copies the part that falls in its own shard back into that shard.  Whether an index
    is a copy is decided from the placements, the same on every rank, so that every rank
    joins the same collectives.  Only basic indexing (ints, slices, ``...``) is followed:
    on a plain tensor any other index gives a copy too, and a write into it is lost
    there as well.  Not followed either: a write through ``.data``, ``.detach()`` or a
    ``.view()`` of a copy (no init of the supported models makes one).
    """

    def __init__(self) -> None:
        super().__init__()
        self.copies: dict[int, tuple[torch.Tensor, torch.Tensor, Any]] = {}  # id -> (copy, base, index)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = getattr(func, "__name__", "")
        target = args[0] if args else None
        indexed = name in ("__getitem__", "__setitem__") and _is_dtensor(target) and _basic(args[1])
        if indexed and name == "__setitem__":  # DTensor has no fill_.Tensor: write the shards here
            values = _region(target, args[1]).to_local().clone()
            values[...] = args[2].full_tensor() if _is_dtensor(args[2]) else args[2]
            self._write_back(target, args[1], values)
            return None
        if name == "copy_" and _is_dtensor(target) and len(args) > 1 and isinstance(args[1], torch.Tensor) \
                and not _is_dtensor(args[1]):
            # a whole value built as a plain tensor, copied in (Qwen3.5's A_log:
            # ``init.copy_(A_log, torch.empty(n).uniform_(0.01, 16).log_())``); DTensor refuses
            # the mix. Every rank holds all of it (drawn by global index): each keeps its shard
            from torch.distributed.tensor import distribute_tensor

            whole = args[1].to(target.dtype).expand(target.shape).contiguous()
            shard = distribute_tensor(whole, target.device_mesh, target.placements, src_data_rank=None)
            target.to_local().copy_(shard.to_local())
            return target
        of_copy = indexed and id(target) in self.copies  # an index of a copy is a view of it
        narrows = indexed and not of_copy and _restricts(target, args[1])
        out = _region(target, args[1]) if narrows else func(*args, **(kwargs or {}))
        if of_copy or narrows:
            self.copies[id(out)] = (out, target, args[1])
        elif not indexed and id(target) in self.copies and (name.endswith("_") and not name.startswith("_")
                                                           or _IN_PLACE_OPERATOR.fullmatch(name)):
            copy, base, index = self.copies[id(target)]
            self._write_back(base, index, copy.to_local())
        return out

    def _write_back(self, base: torch.Tensor, index: Any, values: torch.Tensor) -> None:
        """Copy ``values`` (the new ``base[index]``) into this rank's shard of ``base``."""
        local = base.to_local()
        box = _local_box(index, tuple(base.shape), _offset(base), tuple(local.shape))
        if box is not None:
            local[box[0]] = values[box[1]]
        if id(base) in self.copies:  # base is itself a copy of an index: on to its base
            _, outer_base, outer_index = self.copies[id(base)]
            self._write_back(outer_base, outer_index, base.to_local())


_IN_PLACE_OPERATOR = re.compile(r"__i(add|sub|mul|truediv|floordiv|mod|pow|and|or|xor|lshift|rshift)__")


def _is_dtensor(t: Any) -> bool:
    return hasattr(t, "to_local") and hasattr(t, "placements")


def _offset(t: torch.Tensor) -> tuple[int, ...]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    return tuple(compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)[1])


def _basic(index: Any) -> bool:
    """Ints, slices and one ``...``: the indexes that view a plain tensor."""
    parts = index if isinstance(index, tuple) else (index,)
    return parts.count(Ellipsis) <= 1 and all(
        p is Ellipsis or isinstance(p, slice) or (isinstance(p, int) and not isinstance(p, bool)) for p in parts)


def _parts(index: Any, ndim: int) -> list[Any]:
    """A basic index as one int or slice per dim."""
    parts = list(index) if isinstance(index, tuple) else [index]
    if Ellipsis in parts:
        at = parts.index(Ellipsis)
        parts[at:at + 1] = [slice(None)] * (ndim - len(parts) + 1)
    return parts + [slice(None)] * (ndim - len(parts))


def _restricts(base: torch.Tensor, index: Any) -> bool:
    """Whether ``base[index]`` narrows a dim a mesh dim shards: then it is no view of the
    shard.  Decided from the placements, so every rank agrees."""
    from torch.distributed.tensor import Shard

    parts = _parts(index, base.ndim)
    sharded = {p.dim % base.ndim for p in base.placements if isinstance(p, Shard)}
    return any(isinstance(parts[d], int) or parts[d].indices(base.shape[d]) != (0, base.shape[d], 1)
               for d in sharded)


def _region(base: torch.Tensor, index: Any) -> torch.Tensor:
    """``base[index]`` as a replicated DTensor: each rank fills its part of the region and
    one all-reduce over the mesh dims that shard ``base`` completes it, where DTensor
    would all-gather the whole of ``base`` (a 256000-row embedding for one padding row)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    local = base.to_local()
    region = torch.zeros(torch.empty(base.shape, device="meta")[index].shape, dtype=base.dtype, device=local.device)
    box = _local_box(index, tuple(base.shape), _offset(base), tuple(local.shape))
    if box is not None:
        region[box[1]] = local[box[0]]
    mesh = base.device_mesh
    pending = [Partial() if isinstance(p, Shard) else Replicate() for p in base.placements]
    return DTensor.from_local(region, mesh, pending, run_check=False).redistribute(mesh, [Replicate()] * mesh.ndim)


def _local_box(index: Any, shape: tuple[int, ...], offset: tuple[int, ...],
               local: tuple[int, ...]) -> tuple[tuple, tuple] | None:
    """(index into the local shard, index into ``base[index]``) of their common part,
    or None when this rank's shard holds none of it.  ``index`` is basic (``_basic``)."""
    into_local: list[Any] = []
    into_copy: list[Any] = []
    for part, size, start, count in zip(_parts(index, len(shape)), shape, offset, local, strict=True):
        if isinstance(part, int):
            i = part + size if part < 0 else part
            if not start <= i < start + count:
                return None
            into_local.append(i - start)
            continue
        positions = torch.arange(size)[part]
        held = ((positions >= start) & (positions < start + count)).nonzero().flatten()
        if held.numel() == 0:
            return None
        first, last = int(held[0]), int(held[-1])
        into_local.append(slice(int(positions[first]) - start, int(positions[last]) - start + 1, part.step))
        into_copy.append(slice(first, last + 1))
    return tuple(into_local), tuple(into_copy)


def _clear_hf_flags(model: nn.Module) -> None:
    """HF skips modules/tensors marked initialised; the replay must run them all."""
    for module in model.modules():
        module.__dict__.pop("_is_hf_initialized", None)
        for t in list(module._parameters.values()) + list(module._buffers.values()):
            if t is not None and "_is_hf_initialized" in t.__dict__:
                del t._is_hf_initialized
