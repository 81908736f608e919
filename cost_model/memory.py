"""Memory per device: model states, activations (Korthikanti et al. 2022), pipeline depth."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from cost_model.profile import Profile

Checkpointing = Literal["none", "selective", "full"]
Schedule = Literal["gpipe", "1f1b", "interleaved-1f1b"]

# Fraction of device memory a plan may not use: the CUDA context and NCCL
# buffers (~1-2 GB on an 80 GB GPU), caching-allocator fragmentation and
# temporary workspaces (cuBLAS, collectives' staging) that no per-tensor model
# sees.  10% is the margin Megatron/TorchTitan users commonly leave.
DEFAULT_HEADROOM = 0.10


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each model-state kind, and what one optimizer update costs."""

    weights: float
    grads: float
    optimizer: float
    update_traffic: float = 0.0  # bytes read + written per parameter by optimizer.step()
    update_ops: int = 1  # eager ops optimizer.step() issues per parameter tensor
    # the ops take every tensor at once (torch's foreach path: one dispatch per op, its
    # kernels each covering many tensors), so there are update_ops of them per step
    foreach: bool = False

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer


OPTIMIZERS: dict[str, StateBytes] = {
    # bf16 weights and grads, fp32 master weights + Adam m and v (ZeRO paper's 16 B/param);
    # update: torch.optim.AdamW as a loop constructs it, whose default on CUDA is the
    # foreach path (torch/optim/adam.py _multi_tensor_adam) over the fp32 parameters the
    # executor's runs hold (FSDP2's sharded fp32 master, or an fp32 model under autocast)
    # and their fp32 gradients: the same 8 passes and 20 accesses x 4 B as the per-tensor
    # path below.  Measured on an H100 (bench.gpu_step, docs/cost_model.md "On a GPU"):
    # 57.7 ms for 1.92e9 parameters, 80 B each at 2.66 TB/s, where the copy ran at 2.95.
    # A fused update (AdamW(fused=True), Megatron's, TorchTitan's default) moves 28 B in
    # one kernel: read grad, read + write master, m and v.
    "adam-mixed": StateBytes(2, 2, 12, 80, 8, foreach=True),
    # fp32 weights and grads, fp32 Adam m and v, updated by torch.optim.AdamW's
    # per-tensor path (the default on CPU, torch/optim/adam.py _single_tensor_adam):
    # step += 1, then 8 element-wise passes with their element reads + writes:
    # param.mul_ 2, m.lerp_ 3, v.mul_ 2, v.addcmul_ 3, sqrt 2, div 2, add_ 2,
    # param.addcdiv_ 4 = 20 accesses x 4 B
    "adam-fp32": StateBytes(4, 4, 8, 80, 9),
    # fp32 weights and grads; plain SGD keeps no state (param.add_: read grad,
    # read+write w); momentum: buf.mul_ 2 + buf.add_ 3 + param.add_ 3 accesses x 4 B
    "sgd": StateBytes(4, 4, 0, 12, 1),
    "sgd-momentum": StateBytes(4, 4, 4, 32, 3),
}


def state_bytes_per_param(optimizer: str) -> StateBytes:
    """The per-parameter byte table of ``optimizer`` (a key of ``OPTIMIZERS``)."""
    try:
        return OPTIMIZERS[optimizer]
    except KeyError:
        raise ValueError(
            f"optimizer: unknown {optimizer!r}; expected one of {sorted(OPTIMIZERS)}"
        ) from None


def model_state_bytes(
    params: float, optimizer: str = "adam-mixed", shard_degree: int = 1, zero_stage: int = 3
) -> StateBytes:
    """Bytes of weights, grads and optimizer state on one device.

    ``params`` is the parameter count the device holds before data-parallel
    sharding (already divided by tensor/pipeline parallelism).  ``shard_degree``
    is the FSDP/ZeRO group size; ``zero_stage`` 1 shards optimizer state, 2 also
    gradients, 3 (FSDP) also weights.
    """
    if shard_degree < 1:
        raise ValueError(f"shard_degree: must be >= 1, got {shard_degree}")
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage: must be 0, 1, 2 or 3, got {zero_stage}")
    per = state_bytes_per_param(optimizer)
    div = [shard_degree if zero_stage >= s else 1 for s in (3, 2, 1)]
    return StateBytes(
        params * per.weights / div[0],
        params * per.grads / div[1],
        params * per.optimizer / div[2],
        params * per.update_traffic / div[2],
    )


def korthikanti_activation_bytes(
    seq: int,
    batch: int,
    hidden: int,
    heads: int,
    layers: int,
    tp: int = 1,
    sp: bool = False,
    checkpointing: Checkpointing = "none",
    bytes_per_elem: int = 2,
) -> float:
    """Stored activations of ``layers`` transformer layers (Korthikanti et al. 2022, Table 2).

    Per layer, in units of s*b*h bytes at 16 bit: 34 + 5as/h without parallelism,
    10 + 24/t + 5as/(ht) with tensor parallelism, (34 + 5as/h)/t with sequence
    parallelism; selective recompute drops the 5as/h attention-score term; full
    recompute keeps only the layer input (2, divided by t under SP).  The paper's
    counts mix 16-bit tensors with 1-byte dropout masks (2sbh + as^2b of them);
    for other ``bytes_per_elem`` only the tensor part scales.  Embeddings, the
    output layer and the transient working set of a recomputed layer are outside
    the paper's per-layer formula and not included.
    """
    for name, v in (
        ("seq", seq),
        ("batch", batch),
        ("hidden", hidden),
        ("heads", heads),
        ("tp", tp),
    ):
        if v < 1:
            raise ValueError(f"{name}: must be >= 1, got {v}")
    if layers < 0:
        raise ValueError(f"layers: must be >= 0, got {layers}")
    if checkpointing not in ("none", "selective", "full"):
        raise ValueError(f"checkpointing: expected none, selective or full, got {checkpointing!r}")
    e, sbh = bytes_per_elem, seq * batch * hidden
    rep = tp if sp else 1  # divisor of the parts TP alone leaves replicated
    if checkpointing == "full":
        return layers * sbh * e / rep
    replicated = 4 * e + 2  # two norm inputs, attention and MLP inputs (elements) + 2 masks (bytes)
    split = 12 * e  # Q, K, V, projection input, GeLU input and output
    per_layer = sbh * (replicated / rep + split / tp)
    if checkpointing == "none":
        per_layer += heads * seq * seq * batch * (2 * e + 1) / tp  # scores, softmax, dropout mask
    return layers * per_layer


def fsdp_gathered_bytes(root_params: float, layer_params: float, optimizer: str, fsdp_degree: int,
                        stage_layers: int = 0) -> float:
    """Bytes FSDP2 holds unsharded, on top of the shards at rest, when the backward starts.

    ``executor.apply`` makes one FSDP2 unit per repeated layer plus the root (embedding,
    final norm, output projection); ``root_params`` and ``layer_params`` are the
    parameters of the root and of the largest layer on one device before FSDP's division
    (after tensor parallelism's).  FSDP2 does not reshard the root after forward and
    reduce-scatters its gradients only when the whole backward is done, so the root's
    unsharded weights and gradients (the output projection's comes first) are held
    throughout; of the layers, the one computing and the one prefetched hold their
    weights, and the computing one its unsharded gradients until their reduce-scatter.
    Without fully sharded dims (``fsdp_degree`` 1) nothing is gathered.

    A pipeline stage of ``stage_layers`` layers holds them all at the end of its last
    backward: torch's ``PipelineStage`` runs every micro-batch's backward without
    resharding and without the gradient sync (``set_reshard_after_backward(False)``,
    ``set_requires_gradient_sync(False)``) and reduces after the last
    (``perform_reduce_grad``), so each unit's unsharded gradients, and the weights a
    backward left gathered, stay until then."""
    if fsdp_degree <= 1:
        return 0.0
    per = state_bytes_per_param(optimizer)
    if stage_layers:
        return (root_params + stage_layers * layer_params) * (per.weights + per.grads)
    return root_params * (per.weights + per.grads) + layer_params * (2 * per.weights + per.grads)


def inflight_microbatches(
    schedule: Schedule, pp: int, microbatches: int, stage: int = 0, virtual_stages: int = 1
) -> float:
    """Micro-batches' worth of one stage's activations held at once on pipeline rank ``stage``.

    GPipe runs all forwards first (m).  1F1B holds at most pp - stage.
    Interleaved 1F1B (Narayanan et al. 2021) warms up (pp - stage - 1)*2 +
    (v - 1)*pp model chunks, plus one in steady state, each chunk 1/v of a
    stage: pp + (pp - 1)/v stages' worth on stage 0, i.e. Korthikanti's
    L(1 + (p-1)/(pm)) layers.
    """
    if pp < 1 or microbatches < 1 or virtual_stages < 1:
        raise ValueError(
            f"pp={pp}, microbatches={microbatches}, virtual_stages={virtual_stages} must be >= 1"
        )
    if not 0 <= stage < pp:
        raise ValueError(f"stage: {stage} is not in [0, {pp})")
    if schedule == "gpipe":
        return float(microbatches)
    if schedule == "1f1b":
        return float(min(microbatches, pp - stage))
    if schedule == "interleaved-1f1b":
        chunks = min(
            microbatches * virtual_stages, (pp - stage - 1) * 2 + (virtual_stages - 1) * pp + 1
        )
        return chunks / virtual_stages
    raise ValueError(f"schedule: expected gpipe, 1f1b or interleaved-1f1b, got {schedule!r}")


def usable_bytes(profile: Profile, headroom: float = DEFAULT_HEADROOM) -> int:
    """Bytes a plan may use on one device after the headroom (see DEFAULT_HEADROOM)."""
    if not 0 <= headroom < 1:
        raise ValueError(f"headroom: must be in [0, 1), got {headroom}")
    return math.floor(profile.memory_bytes * (1 - headroom))


def fits(total_bytes: float, profile: Profile, headroom: float = DEFAULT_HEADROOM) -> bool:
    """Whether ``total_bytes`` per device fit in the profile's memory less the headroom."""
    return total_bytes <= usable_bytes(profile, headroom)
