"""executor.apply: N-device training equals the single-device run, and bad plans are refused.

Each world size is spawned once for the module (gloo, CPU); every rank trains every
scenario and returns per-step losses and the final full parameters, which are compared
with the same training loop run here with a 1-device plan and no process group.
"""

from __future__ import annotations

import gc
import math
import re
import warnings
import weakref
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _dist import Collectives, laid_out_and_issued, make_plan, run_on_ranks
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.overrides import TorchFunctionMode
from torch.testing._internal.distributed.fake_pg import FakeStore

import executor
import planner
from cost_model.step import fsdp_step_gathers
from executor import dtensor_rules
from executor.data import DataParallelBatch
from planner.presets import PRESETS, build_model, load_config
from planner.schema import ParameterPlacement, Plan

STEPS = 10
BATCH, SEQ = 8, 16
SEED = 1234


class MLP(nn.Module):
    """A plain (non-HF) model whose loss the training loop computes from its output."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.up_proj = nn.Linear(16, 64)
        self.down_proj = nn.Linear(64, 16)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.drop(torch.relu(self.up_proj(x))))


class CenteredMLP(nn.Module):
    """An MLP block that centres its hidden activations: under a column-parallel
    ``up_proj`` the mean runs over a sharded dim, which DTensor reduces and a local shard
    cannot, so the block must stay on DTensor."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.block = MLP(dropout)
        self.block.forward = self.centred  # type: ignore[method-assign]

    def centred(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.block.up_proj(x))
        return self.block.down_proj(self.block.drop(h - h.mean(-1, keepdim=True)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x)


@dataclass(frozen=True)
class Case:
    model: str  # "llama", "qwen2", "mistral" (tiny Llama shapes), "gpt2", "mlp" or "centered-mlp"
    mesh: dict[str, int] = field(default_factory=lambda: {"dp": 1})
    fsdp: bool = False
    sp: bool = False
    dropout: float = 0.0
    meta: bool = False  # build on the meta device, materialise through apply
    checkpointing: str = "none"  # the plan's activation checkpointing
    logits_loss: bool = False  # the loop computes the loss from .logits, not labels=
    vocab_embedding: bool = False  # embed_tokens sharded by vocabulary row (TorchTitan's)
    padded: bool = False  # right padding (attention_mask, labels -100), uneven over the ranks
    bias: bool = False  # Llama with attention and MLP biases (row-parallel o_proj / down_proj biases)
    rows: int = BATCH  # global batch in sequences
    unfreeze: bool = False  # embedding and layer 0 frozen before apply, trained from the second step
    tied: bool = False  # tie_word_embeddings: the plan leaves the head replicated
    microbatches: int = 1  # the plan's micro-batches (run inside the model's call)

    @property
    def name(self) -> str:
        mesh = "x".join(f"{k}{v}" for k, v in self.mesh.items())
        flags = [f for f, on in (("fsdp", self.fsdp), ("sp", self.sp), ("meta", self.meta),
                                 ("logits-loss", self.logits_loss),
                                 ("vocab-embedding", self.vocab_embedding), ("padded", self.padded),
                                 ("bias", self.bias), (f"rows{self.rows}", self.rows != BATCH),
                                 ("unfreeze", self.unfreeze), ("tied", self.tied),
                                 (f"mb{self.microbatches}", self.microbatches > 1)) if on]
        ac = [] if self.checkpointing == "none" else [f"ac-{self.checkpointing}"]
        return "-".join([self.model, mesh, *flags, *ac, f"drop{self.dropout}"])

    def reference(self) -> Case:
        return Case(self.model, dropout=self.dropout, logits_loss=self.logits_loss, padded=self.padded,
                    bias=self.bias, rows=self.rows, unfreeze=self.unfreeze, tied=self.tied)


def build(case: Case) -> nn.Module:
    device = "meta" if case.meta else "cpu"
    if case.model in ("mlp", "centered-mlp"):
        with torch.device(device):
            model = (MLP if case.model == "mlp" else CenteredMLP)(case.dropout)
    elif case.model in ("llama", "qwen2", "mistral"):  # qwen2 adds q/k/v biases
        cfg = {**PRESETS["llama-tiny"], "model_type": case.model, "attention_dropout": case.dropout,
               **({"attention_bias": True, "mlp_bias": True} if case.bias else {}),
               **({"tie_word_embeddings": True} if case.tied else {})}
        model = build_model(load_config(cfg), device=device)
    else:
        p = case.dropout
        cfg = {**PRESETS["gpt2-tiny"], "resid_pdrop": p, "embd_pdrop": p, "attn_pdrop": p}
        model = build_model(load_config(cfg), device=device)
    return model.train()


def batches(case: Case) -> list[tuple[torch.Tensor, torch.Tensor]]:
    with executor.rng.suspended():
        g = torch.Generator().manual_seed(7)
        if case.model.endswith("mlp"):
            return [(torch.randn(case.rows, 16, generator=g), torch.randn(case.rows, 16, generator=g))
                    for _ in range(STEPS)]
        ids = [torch.randint(0, 128, (case.rows, SEQ), generator=g) for _ in range(STEPS)]
        return [(x, x) for x in ids]


def loss_of(model: nn.Module, case: Case, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if case.model.endswith("mlp"):
        return F.mse_loss(model(x), y)  # computed from the (global) output in the loop
    if case.padded:  # row i padded by i tokens: the data-parallel slices count unequally
        mask = (torch.arange(SEQ) < SEQ - torch.arange(len(x))[:, None]).long()
        return model(input_ids=x, attention_mask=mask, labels=y.masked_fill(mask == 0, -100)).loss
    if case.logits_loss:  # reads the logits, which the executor then gathers
        return F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())
    return model(input_ids=x, labels=y).loss  # as a user's loop: use_cache left to the model


def train(case: Case, plan_json: str | None = None) -> dict[str, Any]:
    """The user's loop: identical on 1 and N devices except for the plan (``plan_json``, or
    the hand-written plan for ``case``)."""
    data = batches(case)
    executor.rng.manual_seed(SEED)
    model = build(case)
    if case.unfreeze:
        for n, p in model.named_parameters():
            p.requires_grad_(not n.startswith(("model.embed_tokens.", "model.layers.0.")))
    if plan_json is not None:
        plan = Plan.from_json(plan_json)
    else:
        plan = make_plan(model, case.mesh, fsdp=case.fsdp, sp=case.sp, checkpointing=case.checkpointing,
                         vocab_embedding=case.vocab_embedding, microbatches=case.microbatches)
    model = executor.apply(plan, model)
    # eps 1e-6, not 1e-8: some gradients are mathematically zero (GPT-2's key bias:
    # softmax ignores a per-query constant), and Adam would turn their rounding noise,
    # which differs between any two summation orders, into full-size steps; lr 1e-3
    # keeps that amplification of rounding noise in tiny gradients below 1e-5.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    losses, grads, rows = [], {}, []
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    seen = embed.register_forward_hook(lambda m, a, o: rows.append(a[0].shape[0])) if embed else None
    for i, (x, y) in enumerate(data):
        if case.unfreeze and i == 1:
            model.requires_grad_(True)
        loss = loss_of(model, case, x, y)
        loss.backward()
        if seen is not None:  # the rows of the first step's forward calls
            seen.remove()
            seen = None
        if i == case.unfreeze:  # Adam ignores a constant factor on gradients: compare them directly
            grads = _full({n: p.grad for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    model.eval()  # validation after training: no dropout, no gradients
    with torch.no_grad():
        evaluation = loss_of(model, case, *data[0]).item()
    if not case.padded:  # as eval loops often run it (its tensors have no version counter);
        with torch.inference_mode():  # a padding mask is a known limit there (docs)
            assert loss_of(model, case, *data[0]).item() == evaluation
    return {"losses": losses, "grads": grads, "params": _full(dict(model.named_parameters())),
            "local": executor.local_regions.running_locally(model), "eval": evaluation, "rows": rows}


def _full(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
            for n, t in tensors.items()}


def train_all(cases: list[Case]) -> dict[str, Any]:
    rank = torch.distributed.get_rank()
    out = {}
    for case in cases:
        result = train(case)
        out[case.name] = result if rank == 0 else None
    return out


def uneven_batch() -> str:
    """A global batch the data-parallel ranks cannot split evenly."""
    case = Case("mlp", {"dp": 4})
    executor.rng.manual_seed(SEED)
    model = build(case)
    model = executor.apply(make_plan(model, case.mesh), model)
    with pytest.raises(executor.BatchError) as e:
        model(torch.zeros(6, 16))
    return str(e.value)


def spawn_world4(cases: list[Case], planned: dict[str, str]) -> dict[str, Any]:
    rank = torch.distributed.get_rank()
    by_planner = {name: train(PLANNED_CASE, plan) for name, plan in planned.items()}
    return {"train": train_all(cases), "uneven": uneven_batch(),
            "planned": by_planner if rank == 0 else None}


CASES_4 = [
    Case("llama", {"dp": 4}, dropout=0.1),
    Case("llama", {"dp": 4}, fsdp=True, meta=True, dropout=0.1),
    Case("llama", {"dp": 2, "tp": 2}, fsdp=True, sp=True, dropout=0.1, checkpointing="selective"),
    Case("gpt2", {"dp": 2, "tp": 2}, dropout=0.1, logits_loss=True),
    Case("gpt2", {"dp": 4}, fsdp=True, dropout=0.1, checkpointing="full"),
    Case("mlp", {"dp": 2, "tp": 2}, fsdp=True, dropout=0.1),
    # a padding mask with attention dropout (a DTensor mask under data parallelism), and a
    # loss that is exact although the slices count different numbers of tokens
    Case("llama", {"dp": 4}, dropout=0.1, padded=True),
    Case("llama", {"dp": 2, "tp": 2}, fsdp=True, sp=True, dropout=0.1, padded=True),
    # the plan's micro-batches, run inside the model's call: FSDP2 reduces every part's gradients
    Case("llama", {"dp": 2, "tp": 2}, fsdp=True, sp=True, dropout=0.1, padded=True, microbatches=2),
]
CASES_2 = [
    Case("llama", {"tp": 2}, dropout=0.1),
    Case("llama", {"tp": 2}, sp=True, meta=True, dropout=0.1, checkpointing="full"),
    Case("gpt2", {"tp": 2}, dropout=0.1, logits_loss=True),
    Case("qwen2", {"tp": 2}, sp=True, dropout=0.1),
    # a vocabulary-sharded embedding's output is a MaskPartial, reduced where it leaves
    # the module; without SP its gradient comes back a pending sum
    Case("mistral", {"tp": 2}, dropout=0.1, vocab_embedding=True),
    Case("mlp", {"tp": 2}),
    Case("centered-mlp", {"tp": 2}, dropout=0.1),
    # selective recomputation under pure data parallelism: Hugging Face's default cache,
    # appended to again by the recomputation, made it run other ops than the forward
    Case("llama", {"dp": 2}, dropout=0.1, checkpointing="selective", padded=True),
    # no dropout: attention runs torch's CPU kernel on DTensors, whose sharding rule
    # lacked the padding mask (a crash in training and in every TP model's validation)
    Case("llama", {"tp": 2}, padded=True),
    # row-parallel biases: zero at the first call, where a local replay that added them on
    # every rank (tp x the bias) passed the check, then drifted as they trained
    Case("llama", {"tp": 2}, dropout=0.1, bias=True),
    # GPT-2 without dropout: its attention output's strides disagreed with its local shard's
    Case("gpt2", {"tp": 2}),
    # one sequence per rank with attention dropout (crashed: the query was not taken as batched)
    Case("llama", {"dp": 2}, dropout=0.1, rows=2),
    # gradual unfreezing: layers learned their local shards while their parameters or
    # inputs needed no gradient, and replayed that after unfreezing (gradients off by ~90%)
    Case("llama", {"tp": 2}, sp=True, dropout=0.1, unfreeze=True),
    # a replicated head under sequence parallelism hands the loss sequence-split logits,
    # whose mean DTensor took per shard (the reported loss was a mean of shard means)
    Case("llama", {"tp": 2}, sp=True, padded=True, tied=True),
    # the plan's micro-batches inside the model's call, under data parallelism (uneven
    # token counts over the parts) and under tensor parallelism with recomputation (each
    # part's layers recomputed with its rows' dropout masks)
    Case("llama", {"dp": 2}, dropout=0.1, padded=True, microbatches=2),
    Case("llama", {"tp": 2}, dropout=0.1, checkpointing="full", microbatches=4),
]


@pytest.fixture(scope="module")
def references() -> dict[str, Any]:
    refs = {}
    try:
        for case in {c.reference().name: c.reference() for c in CASES_4 + CASES_2}.values():
            refs[case.name] = train(case)
    finally:
        executor.rng.deactivate()  # leave other test modules with torch's own RNG
    return refs


PLANNED_CASE = Case("llama", dropout=0.1)
# name -> (mesh, profile): 4 ranks with 2 KV heads (uneven head sharding) planned for H100s.
PLANNER_MESHES = {"tp4": ({"tp": 4}, "h100-sxm-80g")}
# name -> planner.hand_plan's arguments: its TorchTitan layout shards the vocabulary of the
# embedding and keeps its output a pending sum (a MaskPartial), whose gradient arrives
# sharded with SP, and as a pending sum without (which DTensor cannot turn back into one)
HAND_LAYOUTS = {"hand fsdp2 x tp2+SP": {"dp": 2, "tp": 2, "fsdp": True, "sp": True},
                "hand dp2 x tp2": {"dp": 2, "tp": 2}}


@pytest.fixture(scope="module")
def world4() -> dict[str, Any]:
    planned = {}
    for name, (mesh, profile) in PLANNER_MESHES.items():
        plan = planner.plan("llama-tiny", devices=4, profile=profile, batch_size=BATCH,
                            seq_len=SEQ, mesh=mesh)
        plan.mesh.device_type = "cpu"  # the same plan, run on this machine's gloo ranks
        planned[name] = plan.to_json()
    for name, layout in HAND_LAYOUTS.items():
        planned[name] = planner.hand_plan("llama-tiny", devices=4, profile="cpu-gloo-local",
                                          batch_size=BATCH, seq_len=SEQ, **layout).to_json()
    return run_on_ranks(4, spawn_world4, CASES_4, planned)[0]


@pytest.fixture(scope="module")
def world2() -> dict[str, Any]:
    return run_on_ranks(2, train_all, CASES_2)[0]


def _assert_matches(result: dict[str, Any], ref: dict[str, Any]) -> None:
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref["losses"]),
                               rtol=1e-5, atol=0)
    assert result["eval"] == pytest.approx(ref["eval"], rel=1e-5)
    for kind in ("grads", "params"):
        assert result[kind].keys() == ref[kind].keys()
        for name, value in result[kind].items():
            torch.testing.assert_close(value, ref[kind][name], rtol=1e-5, atol=1e-5,
                                       msg=lambda m, name=name, kind=kind: f"{kind} of {name}: {m}")


@pytest.mark.parametrize("case", CASES_4, ids=lambda c: c.name)
def test_four_ranks_match_single_device(case: Case, world4: dict, references: dict) -> None:
    _assert_matches(world4["train"][case.name], references[case.reference().name])


@pytest.mark.parametrize("case", CASES_2, ids=lambda c: c.name)
def test_two_ranks_match_single_device(case: Case, world2: dict, references: dict) -> None:
    _assert_matches(world2[case.name], references[case.reference().name])


def autocast_grads(mesh: dict[str, int], microbatches: int) -> dict[str, torch.Tensor]:
    """One bf16-autocast step of a dropout-free Llama under FSDP: its full gradients."""
    case = Case("llama", mesh, fsdp="dp" in mesh)
    executor.rng.manual_seed(SEED)
    model = build(case)
    model = executor.apply(make_plan(model, mesh, fsdp=case.fsdp, microbatches=microbatches), model)
    ids = batches(case)[0][0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return _full({n: p.grad for n, p in model.named_parameters()})


def test_micro_batches_under_autocast_keep_every_parts_gradient() -> None:
    """autocast keeps a weight's bf16 copy for its whole block, keyed by the tensor FSDP2
    refills on every call: the second part backpropagated through the first part's copy
    and its gradient was lost (the layers' weights 0.69 off, relative)."""
    try:
        whole = autocast_grads({"dp": 1}, 1)
    finally:
        executor.rng.deactivate()
    parts = run_on_ranks(2, autocast_grads, {"dp": 2}, 2)[0]
    for name, g in parts.items():  # bf16 rounding of different summation orders: ~2e-3
        assert (g - whole[name]).norm() <= 1e-2 * whole[name].norm(), name


def test_micro_batches_run_in_parts_on_each_rank(world2: dict, world4: dict) -> None:
    """The cases above match one device's whole-batch step; the plan's micro-batches made
    each rank's step run its slice in that many forward calls (one before)."""
    for case in CASES_2 + CASES_4:
        result = (world2 if case in CASES_2 else world4["train"])[case.name]
        if not case.model.endswith("mlp"):
            per_rank = case.rows // case.mesh.get("dp", 1)
            assert result["rows"] == [per_rank // case.microbatches] * case.microbatches, case.name


def test_tensor_parallel_blocks_run_on_local_shards(world2: dict, world4: dict) -> None:
    """Regions pass their check and run locally in the cases above (which match one
    device): under sequence parallelism whole transformer layers (norms and residual adds
    included); without it attention and MLP blocks, since a layer's normed hidden state
    is replicated and its gradient a pending sum that no boundary inside the layer
    reduces.  A block whose local run would differ stays on DTensor."""
    layers = range(PRESETS["llama-tiny"]["num_hidden_layers"])
    whole = [f"model.layers.{i}" for i in layers]
    blocks = [f"model.layers.{i}.{b}" for i in layers for b in ("self_attn", "mlp")]
    checked = 0
    for name, result in {**world2, **world4["train"]}.items():
        if name.startswith(("llama-tp2", "qwen2-tp2", "mistral-tp2", "llama-dp2xtp2")) and "-bias-" not in name:
            assert result["local"] == (whole if "-sp-" in name else blocks), name
            checked += 1
    assert checked == 11
    assert world2[Case("centered-mlp", {"tp": 2}, dropout=0.1).name]["local"] == []
    # a row-parallel bias is added once to the sum of the shards' products; the local run
    # adds it on every rank, which the check, run on parameters of a fixed pattern rather
    # than Hugging Face's zero-initialised biases, now sees
    assert world2[Case("llama", {"tp": 2}, dropout=0.1, bias=True).name]["local"] == []
    # the planner's plans convert each block's input at its boundary, which reduces the
    # pending gradient there (Megatron's f): whole layers run locally with or without SP
    for name in (*PLANNER_MESHES, *HAND_LAYOUTS):
        assert world4["planned"][name]["local"] == whole, name


@pytest.mark.parametrize("mesh", [*PLANNER_MESHES, *HAND_LAYOUTS])
def test_plans_from_the_planner_match_single_device(mesh: str, world4: dict, references: dict) -> None:
    _assert_matches(world4["planned"][mesh], references[PLANNED_CASE.name])


def router_warnings() -> list[str]:
    """The warnings of applying a data-parallel plan to a tiny Mixtral with its router's
    load-balancing loss (not a mean over batch rows) and noise on."""
    cfg = {**PRESETS["llama-tiny"], "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2,
           "output_router_logits": True, "router_aux_loss_coef": 0.02, "router_jitter_noise": 0.1}
    executor.rng.manual_seed(SEED)
    model = build_model(load_config(cfg), device="cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        executor.apply(make_plan(model, {"dp": 2}), model)
    return [str(w.message) for w in caught]


def test_router_loss_that_does_not_split_by_rows_warns() -> None:
    caught = run_on_ranks(2, router_warnings)[0]
    assert any(m.startswith("output_router_logits: the router's load-balancing loss is computed on each "
                            "data-parallel rank's slice") for m in caught), caught
    # the jitter is drawn as on one device (test_routers_drawing_on_flattened_tokens_...)
    assert not any(m.startswith("router_jitter_noise") for m in caught), caught


# Tiny mixtures of experts.  Their experts run on torch's grouped GEMM (transformers'
# default), which under DTensor takes bf16 only, or on batched matmuls, which take fp32
MIXTRAL = {**PRESETS["llama-tiny"], "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 4}
# Qwen3-MoE's experts are Mixtral's; its first layer a dense MLP here (mlp_only_layers), so
# the layers differ and the whole model is traced; q/k normed per head
QWEN3_MOE = {**PRESETS["llama-tiny"], "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 4,
             "moe_intermediate_size": 32, "head_dim": 8, "norm_topk_prob": True, "mlp_only_layers": [0]}
# Qwen2-MoE: a shared expert beside the routed ones, scaled by its own sigmoid gate
QWEN2_MOE = {**PRESETS["llama-tiny"], "model_type": "qwen2_moe", "num_experts": 4, "num_experts_per_tok": 4,
             "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64, "norm_topk_prob": False}
# OLMoE: q and k normed over all heads
OLMOE = {**PRESETS["llama-tiny"], "model_type": "olmoe", "num_experts": 4, "num_experts_per_tok": 4,
         "intermediate_size": 32, "eos_token_id": 1, "pad_token_id": None}
# GraniteMoE: Granite's multipliers; its forward takes use_cache through **kwargs only
GRANITEMOE = {**PRESETS["llama-tiny"], "model_type": "granitemoe", "num_local_experts": 4, "num_experts_per_tok": 4,
              "intermediate_size": 32, "embedding_multiplier": 12.0, "logits_scaling": 8.0,
              "residual_multiplier": 0.22, "attention_multiplier": 0.0078125}
# PhiMoE: in training its router samples 2 experts (Gumbel: exponential_ and rand_like on
# the [batch * seq, experts] scores), and its backward scatter_adds the routes' gradients
PHIMOE = {**PRESETS["llama-tiny"], "model_type": "phimoe", "num_local_experts": 4, "num_experts_per_tok": 2,
          "intermediate_size": 32, "input_jitter_noise": 0.1}
# ERNIE 4.5 MoE: a shared expert, a dense first layer, a router scored with a bias
ERNIE_MOE = {**PRESETS["llama-tiny"], "model_type": "ernie4_5_moe", "head_dim": 8, "moe_intermediate_size": 32,
             "moe_num_experts": 4, "moe_k": 2, "moe_layer_start_index": 1, "moe_num_shared_experts": 1,
             "tie_word_embeddings": False}
# GPT-OSS: experts stored [experts, in, out] with biases, attention sinks (eager attention)
GPT_OSS = {**PRESETS["llama-tiny"], "model_type": "gpt_oss", "intermediate_size": 32, "head_dim": 8,
           "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8, "attention_bias": True,
           "layer_types": ["sliding_attention", "full_attention"], "swiglu_limit": 7.0,
           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
# DeepSeek-V3: low-rank q and kv projections (q_b_proj, kv_b_proj split by head), a dense
# first layer, a shared expert, routes limited to 1 group of 2
DEEPSEEK_V3 = {**PRESETS["llama-tiny"], "model_type": "deepseek_v3", "num_key_value_heads": 4,
               "num_hidden_layers": 3, "moe_intermediate_size": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
               "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1,
               "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
               "v_head_dim": 8, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "rope_interleave": True}
# The MoE types added in session 40 (fp32, 2 of 4 experts per token), each with what sets it
# apart; the DeepSeek-V3-style routers score groups of experts (n_group, topk_group)
_T, _MLA = PRESETS["llama-tiny"], {"num_key_value_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 16,
                                   "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8}
_LINEAR = {"num_hidden_layers": 3, "head_dim": 8, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 8,
           "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
           "layer_types": ["linear_attention", "full_attention", "linear_attention"], "pad_token_id": None}
_SHARED = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16}
_SL3, _IDS = ["sliding_attention", "full_attention", "sliding_attention"], {"bos_token_id": 0, "eos_token_id": 1}
_GROUPED = {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
            "moe_intermediate_size": 16, "routed_scaling_factor": 2.5}
MORE_MOE: dict[str, dict[str, Any]] = {
    # DeepSeek-V3's router and shared expert, a dense first layer, GQA attention, q/k norm, partial rotary
    "glm4_moe": {**_T, **_GROUPED, "model_type": "glm4_moe", "num_hidden_layers": 3, "head_dim": 8,
                 "n_shared_experts": 1, "first_k_dense_replace": 1, "norm_topk_prob": True, "use_qk_norm": True},
    # GLM-4-MoE with latent attention, dense or sparse per mlp_layer_types
    "glm4_moe_lite": {**_T, **_MLA, **_GROUPED, "model_type": "glm4_moe_lite", "num_hidden_layers": 3,
                      "n_shared_experts": 1, "mlp_layer_types": ["dense", "sparse", "sparse"],
                      "norm_topk_prob": True},
    # latent attention with complex-number rotary, a softmax router limited to groups
    "deepseek_v2": {**_T, **_MLA, **_GROUPED, "model_type": "deepseek_v2", "num_hidden_layers": 3,
                    "n_shared_experts": 1, "first_k_dense_replace": 1, "topk_method": "group_limited_greedy"},
    # Mixtral's experts beside a shared MLP, an fp32 router, q and k normed per head
    "hunyuan_v1_moe": {**_T, "model_type": "hunyuan_v1_moe", "head_dim": 8, "intermediate_size": 32,
                       "num_experts": 4, "moe_topk": 2},
    # Qwen3's attention, DeepSeek-V3's MoE
    "dots1": {**_T, **_GROUPED, "model_type": "dots1", "num_hidden_layers": 3, "head_dim": 8,
              "n_shared_experts": 1, "first_k_dense_replace": 1, "norm_topk_prob": True},
    # a sigmoid router with a correction bias, q and k normed over all heads, partial rotary
    "minimax_m2": {**_T, "model_type": "minimax_m2", "head_dim": 8, "intermediate_size": 32,
                   "num_local_experts": 4, "num_experts_per_tok": 2,
                   "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
    # GraniteMoE with a shared MLP (its fused gate|up input_linear stays whole)
    "granitemoeshared": {**_T, "model_type": "granitemoeshared", "num_local_experts": 4, "num_experts_per_tok": 2,
                         "intermediate_size": 32, "shared_intermediate_size": 32, "embedding_multiplier": 12.0,
                         "logits_scaling": 8.0, "residual_multiplier": 0.22, "attention_multiplier": 0.0078125},
    # OLMoE's experts, OLMo 2's norms after attention and MLP
    "flex_olmo": {**_T, "model_type": "flex_olmo", "num_experts": 4, "num_experts_per_tok": 2,
                  "intermediate_size": 32, "eos_token_id": 1, "pad_token_id": None},
    # EXAONE 4's attention (sliding and full layers), DeepSeek-V3's MoE after a dense layer
    "exaone_moe": {**_T, "model_type": "exaone_moe", "num_hidden_layers": 3, "head_dim": 8,
                   "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2, "num_shared_experts": 1,
                   "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1, "sliding_window": 8,
                   "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    # Cohere 2's parallel block and sliding layers, a shared expert averaged in
    "cohere2_moe": {**_T, "model_type": "cohere2_moe", "num_hidden_layers": 3, "head_dim": 8, "intermediate_size": 32,
                    "num_experts": 4, "num_experts_per_tok": 2, "num_shared_experts": 1, "sliding_window": 8,
                    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
                    "mlp_layer_types": ["dense", "sparse", "sparse"], "bos_token_id": 0, "eos_token_id": 1},
    # GLM-4-MoE's model under its own config: full rotary, q/k norm
    "sarvam_moe": {**_T, **_GROUPED, "model_type": "sarvam_moe", "num_hidden_layers": 3, "head_dim": 8,
                   "n_shared_experts": 1, "first_k_dense_replace": 1, "use_qk_norm": True, "pad_token_id": None},
    # attention gated by a sigmoid (self_attn.gate_proj), sliding layers, a router with a frozen expert bias
    "afmoe": {**_T, "model_type": "afmoe", "num_hidden_layers": 3, "head_dim": 8, "moe_intermediate_size": 16,
              "num_experts": 4, "num_experts_per_tok": 2, "num_shared_experts": 1, "num_dense_layers": 1,
              "route_scale": 2.5, "global_attn_every_n_layers": 2, "sliding_window": 8},
    # GLM-4-MoE's MoE in every layer, Llama's attention
    "solar_open": {**_T, **_GROUPED, "model_type": "solar_open", "head_dim": 8, "n_shared_experts": 1},
    # an output gate per head (g_proj, softplus), heads per layer, a Qwen2-MoE shared expert
    "laguna": {**_T, "model_type": "laguna", "num_hidden_layers": 3, "head_dim": 8, "moe_intermediate_size": 16,
               "shared_expert_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
               "num_attention_heads_per_layer": [4, 8, 4], "sliding_window": 8,
               "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    # attention sinks on the sliding layers (eager), which have twice the key/value heads; v_head_dim != head_dim
    "mimo_v2_flash": {**_T, "model_type": "mimo_v2_flash", "num_hidden_layers": 3, "num_key_value_heads": 2,
                      "head_dim": 8, "v_head_dim": 4, "moe_intermediate_size": 16, "n_routed_experts": 4,
                      "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "sliding_window": 8,
                      "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
                      "mlp_layer_types": ["dense", "sparse", "sparse"]},
    # sliding and full layers, dense or sparse per mlp_layer_types
    "mellum": {**_T, "model_type": "mellum", "num_hidden_layers": 3, "head_dim": 8, "moe_intermediate_size": 16,
               "num_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8,
               "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
               "mlp_layer_types": ["dense", "sparse", "sparse"]},
    # a shared expert, the experts' sum in fp32
    "hy_v3": {**_T, "model_type": "hy_v3", "num_hidden_layers": 3, "head_dim": 8, "moe_intermediate_size": 16,
              "num_experts": 4, "num_experts_per_tok": 2, "num_shared_experts": 1,
              "mlp_layer_types": ["dense", "sparse", "sparse"]},
    # Gated DeltaNet's linear attention (kept whole on tp) in layers 0 and 2, experts in every layer
    "qwen3_next": {**_T, **_LINEAR, **_SHARED, "model_type": "qwen3_next"},
    "qwen3_5_moe_text": {**_T, **_LINEAR, **_SHARED, "model_type": "qwen3_5_moe_text"},
    # DeepSeek-V3 under its own model_type
    "sarvam_mla": {**_T, **_MLA, **_GROUPED, "model_type": "sarvam_mla", "num_hidden_layers": 3,
                   "n_shared_experts": 1, "first_k_dense_replace": 1},
    # latent attention, dense or sparse per mlp_layer_types
    "axk1": {**_T, **_MLA, **_GROUPED, "model_type": "axk1", "num_hidden_layers": 3, "n_shared_experts": 1,
             "mlp_layer_types": ["dense", "sparse", "sparse"], **_IDS},
    # grouped routes, a gate on attention's output, sliding layers, the logits soft-capped
    "beam": {**_T, "model_type": "beam", "num_hidden_layers": 3, "head_dim": 8, "moe_intermediate_size": 16,
             "num_experts": 4, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1, "sliding_window": 8,
             "layer_types": _SL3, "mlp_layer_types": ["dense", "sparse", "sparse"], **_IDS},
    # a shared expert of its own width, sliding layers
    "kolibri1": {**_T, "model_type": "kolibri1", "num_hidden_layers": 3, "head_dim": 8, "moe_intermediate_size": 16,
                 "num_experts": 4, "num_experts_per_tok": 2, "shared_expert_intermediate_size": 16,
                 "sliding_window": 8, "layer_types": _SL3, **_IDS},
    "flint": {**_T, "model_type": "flint", "num_hidden_layers": 3, "head_dim": 8, "moe_intermediate_size": 16,
              "num_experts": 4, "num_experts_per_tok": 2, "shared_expert_intermediate_size": 16,
              "sliding_window": 8, "layer_types": _SL3, **_IDS},  # eager attention
}
TOP2 = {"num_experts_per_tok": 2}
# Aria's text model: experts stored [experts, in, out] (as GPT-OSS's, without biases), a shared expert
ARIA = {**_T, "model_type": "aria_text", "intermediate_size": 16, "moe_num_experts": 4, "moe_topk": 2,
        "moe_num_shared_experts": 1, "pad_token_id": None}
# The hand layout's experts: gate_up_proj split by its 2 x ffn outputs, so the gate and up
# halves land on different ranks before the model's chunk(2); down_proj by its ffn inputs,
# a pending sum out.  Stored [experts, out, in], or [experts, in, out] (GPT-OSS, whose
# expert biases stay whole)
COLUMN_THEN_ROW = {("gate_up_proj", ("R", "S(1)")), ("down_proj", ("R", "S(2)"))}
IN_OUT_SPLIT = {("gate_up_proj", ("R", "S(2)")), ("down_proj", ("R", "S(1)"))}
GPT_OSS_SPLIT = IN_OUT_SPLIT | {("gate_up_proj_bias", ("R", "R")), ("down_proj_bias", ("R", "R"))}


def moe_steps(plan_json: str | None, config: dict[str, Any] = MIXTRAL, experts: str = "grouped_mm",
              ) -> dict[str, Any]:
    """Three AdamW steps with the experts on ``experts`` (bf16 for the grouped GEMM, else
    fp32); the losses, the first step's gradients, whole, and the elements of each
    expert parameter this rank holds."""
    executor.rng.manual_seed(SEED)
    cfg = load_config(config)
    cfg._experts_implementation = experts
    model = build_model(cfg, device="cpu").to(torch.bfloat16 if experts == "grouped_mm" else torch.float32)
    model.train()
    if plan_json is not None:
        model = executor.apply(Plan.from_json(plan_json), model)
    held = {n: (p.to_local() if isinstance(p, DTensor) else p).numel()
            for n, p in model.named_parameters() if ".experts." in n}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, grads = [], {}
    for x, _ in batches(Case("llama"))[:3]:
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        grads = grads or _full({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "grads": grads, "held": held, "local": executor.local_regions.running_locally(model)}


def _moe_reference(config: dict[str, Any], experts: str) -> dict[str, Any]:
    try:
        return moe_steps(None, config, experts)
    finally:
        executor.rng.deactivate()


def _tp_experts_plan(config: dict[str, Any], checkpointing: str = "none",
                     split: set[tuple[str, tuple[str, ...]]] = COLUMN_THEN_ROW) -> Plan:
    plan = planner.hand_plan(config, devices=2, profile="cpu-gloo-local", tp=2, batch_size=BATCH,
                             seq_len=SEQ, checkpointing=checkpointing)
    assert {(p.fqn.rsplit(".", 1)[-1], tuple(p.placements)) for p in plan.parameters
            if ".experts." in p.fqn} == split
    return plan


@pytest.mark.parametrize(("config", "split"), [
    ({**MIXTRAL, **TOP2}, COLUMN_THEN_ROW), ({**QWEN3_MOE, **TOP2}, COLUMN_THEN_ROW),
    ({**QWEN2_MOE, **TOP2}, COLUMN_THEN_ROW), ({**OLMOE, **TOP2}, COLUMN_THEN_ROW),
    ({**GRANITEMOE, **TOP2}, COLUMN_THEN_ROW), (PHIMOE, COLUMN_THEN_ROW), (ERNIE_MOE, COLUMN_THEN_ROW),
    (GPT_OSS, GPT_OSS_SPLIT), (DEEPSEEK_V3, COLUMN_THEN_ROW), (ARIA, IN_OUT_SPLIT),
    *((c, COLUMN_THEN_ROW) for c in MORE_MOE.values())],
    ids=["mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "granitemoe", "phimoe", "ernie4_5_moe", "gpt_oss",
         "deepseek_v3", "aria_text", *MORE_MOE])
def test_experts_split_over_tp_train_as_on_one_device(config: dict[str, Any],
                                                      split: set[tuple[str, tuple[str, ...]]]) -> None:
    """In fp32, every gradient (routers', shared experts' and norms' too) matches one
    device's to float32 rounding, routing 2 tokens of 4.  Before session 25 PhiMoE's
    router gradient came out 21x one device's (DTensor's in-place scatter_add_ on
    pending sums: executor.dtensor_rules) and its routes were drawn by torch's generator
    (exponential_, now executor.rng's)."""
    plan = _tp_experts_plan(config, split=split)
    tp = plan.mesh.names.index("tp")
    whole = [p.fqn for p in plan.parameters if ".layers." in p.fqn and p.fqn.endswith("proj.weight")
             and "_a_proj" not in p.fqn and ".linear_attn." not in p.fqn and p.placements[tp] == "R"]
    # (DeepSeek's down-projections and linear attention stay whole)
    assert not whole, whole
    ref = _moe_reference(config, "batched_mm")
    got = run_on_ranks(2, moe_steps, plan.to_json(), config, "batched_mm")[0]
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
    assert got["grads"].keys() == ref["grads"].keys()
    for name, grad in ref["grads"].items():
        # relative, but to at least 1e-5: Gated DeltaNet's A_log and dt_bias get gradients
        # of norm ~1e-7 here, which float32 rounding moves by ~4e-11 (3e-4 of them)
        miss = (got["grads"][name] - grad).norm() / max(grad.norm(), 1e-5)
        assert miss < 1e-5, (name, miss)


def test_an_in_place_random_op_replays_on_local_shards() -> None:
    """PhiMoE's router draws ``empty_like(g).exponential_()``, in place: the local replay
    (executor.local_regions) handed back its arguments for it, since the recording got
    back what went in, and the first step died in the model ("'tuple' object has no
    attribute 'log'").  The planner's tp=2 plan of it (everything whole on tp) trains as
    on one device."""
    plan = planner.plan(PHIMOE, 2, "cpu-gloo-local", batch_size=BATCH, seq_len=SEQ, mesh={"tp": 2})
    ref = _moe_reference(PHIMOE, "batched_mm")
    got = run_on_ranks(2, moe_steps, plan.to_json(), PHIMOE, "batched_mm")[0]
    assert got["local"] == ["model.layers.0", "model.layers.1"]  # replayed, not left on DTensor
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
    for name, grad in ref["grads"].items():
        assert (got["grads"][name] - grad).norm() / grad.norm() < 1e-5, name


@pytest.mark.parametrize(("config", "checkpointing"), [
    (MIXTRAL, "none"),
    # recomputed in backward, outside the forward's implicit_replication: the experts'
    # inv_perm[perm] = arange(...) mixed a plain tensor with DTensors (black-box review)
    (OLMOE, "full"), (QWEN2_MOE, "selective")],
    ids=["mixtral", "olmoe-full", "qwen2_moe-selective"])
def test_grouped_gemm_experts_split_over_tp_match_single_device(config: dict[str, Any], checkpointing: str) -> None:
    """The experts on torch's grouped GEMM, in bf16, every token routed to every expert:
    with fewer, bf16 rounding flips near-tied routes between two runs, on one device too,
    which moves a layer's expert gradients by ~5%."""
    plan = _tp_experts_plan(config, checkpointing)
    ref = _moe_reference(config, "grouped_mm")
    got = run_on_ranks(2, moe_steps, plan.to_json(), config)[0]
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-4, atol=0)
    for name, grad in ref["grads"].items():  # bf16: sums in another order, 0.7% apart (each 0.75% from fp32)
        if ".experts." in name:
            miss = (got["grads"][name].float() - grad.float()).norm() / grad.float().norm()
            assert miss < 1e-2, (name, miss)


@pytest.mark.parametrize("layout", [{"dp": 2, "microbatches": 2}, {"pp": 2, "microbatches": 2}],
                         ids=["dp2-parts2", "pp2"])
def test_routers_drawing_on_flattened_tokens_match_single_device(layout: dict[str, int]) -> None:
    """PhiMoE's Gumbel routing draws (exponential_, rand_like) on its [batch * seq,
    experts] scores, and Mixtral's router_jitter_noise (uniform_ on [batch, seq,
    hidden]) fills a tensor made inside the forward.  Under data parallelism both were
    drawn from each rank's rows as a tensor of their own (apply warned for the jitter),
    and in micro-batches and pipeline stages the folded scores were: other routes than
    one device's.  They now draw the global batch's values for the rank's rows."""
    mixtral = {**MIXTRAL, **TOP2, "router_jitter_noise": 0.1}
    for config in (PHIMOE, mixtral):
        plan = planner.hand_plan(config, devices=2, profile="cpu-gloo-local", batch_size=BATCH, seq_len=SEQ,
                                 **layout)
        ref = _moe_reference(config, "batched_mm")
        got = run_on_ranks(2, moe_steps, plan.to_json(), config, "batched_mm")[0]
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)


def first_losses(configs: list[dict[str, Any]]) -> list[float]:
    """The first step's loss of each config under tensor parallelism, one after another
    in this process (a sweep)."""
    out = []
    for config in configs:
        plan = planner.hand_plan(config, devices=2, profile="cpu-gloo-local", tp=2, batch_size=BATCH, seq_len=SEQ)
        out.append(moe_steps(plan.to_json(), config)["losses"][0])
    executor.rng.deactivate()
    return out


def test_models_with_other_top_k_train_one_after_another() -> None:
    """DTensor caches topk's sharding without its k (torch registers it from dim on): a
    top-2 model after a top-4 one in the same process got the top-4 routing shapes, and
    failed in the experts ("value tensor of shape [512] cannot be broadcast to ... [256]";
    black-box review).  executor.apply keys topk by k."""
    configs = [OLMOE, {**OLMOE, "num_experts_per_tok": 2}, {**OLMOE, "num_experts_per_tok": 3}]
    reference = [_moe_reference(config, "grouped_mm")["losses"][0] for config in configs]
    got = run_on_ranks(2, first_losses, configs)[0]
    # bf16, and with fewer routes than experts near-tied routes may flip: the first loss only
    torch.testing.assert_close(torch.tensor(got), torch.tensor(reference), rtol=1e-3, atol=0)


class _Draws(nn.Module):
    """Random draws inside a forward: a fill of an activation (autograd must see it: the
    gradient through it is 0), noise on a tensor that is not the batch's rows, and noise
    on the rows folded with the features."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (x * self.w * 2).uniform_()
        return y + torch.rand(()) * 0, torch.rand_like(torch.zeros(5, 5)), torch.randn_like(x.flatten())


def draws(plan_json: str | None) -> dict[str, Any]:
    executor.rng.manual_seed(SEED)
    model = _Draws()
    if plan_json is not None:
        model = executor.apply(Plan.from_json(plan_json), model)
    y, noise, folded = model(torch.ones(4, 3))
    y.sum().backward()
    executor.rng.deactivate()
    grad = model.w.grad
    return {"grad": grad.full_tensor() if isinstance(grad, DTensor) else grad, "noise": noise, "folded": folded}


def test_draws_inside_a_data_parallel_forward_follow_the_global_batch() -> None:
    """Each rank draws the rows of one device's values for tensors of the batch's rows
    (or those rows folded with the dims after them), one device's values for others, and
    an in-place fill stays in autograd's view (review: drawn through the slice's view, it
    was not, and the gradient through the filled tensor came out 2 instead of 0)."""
    ref = draws(None)
    got = run_on_ranks(2, draws, make_plan(_Draws(), {"dp": 2}, batch_size=4).to_json())
    for rank, part in zip(got, ref["folded"].chunk(2), strict=True):
        assert torch.equal(rank["grad"], torch.zeros(3)) and torch.equal(ref["grad"], torch.zeros(3))
        assert torch.equal(rank["noise"], ref["noise"])
        assert torch.equal(rank["folded"], part)  # the rank's 2 rows x 3 features, not gathered


_UNEVEN_DRAWS = {"dropout": lambda t: F.dropout(t + 1, 0.5), "rand_like": torch.rand_like,
                 "uniform_": lambda t: t.clone().uniform_(),
                 "bernoulli_": lambda t: t.clone().bernoulli_(torch.sigmoid(t)),  # p split as the tensor is
                 "bernoulli_ p=": lambda t: t.clone().bernoulli_(p=torch.sigmoid(t)),
                 "out=": lambda t: torch.bernoulli(torch.sigmoid(t), out=t.clone())}


def uneven_draws() -> dict[str, torch.Tensor]:
    """Draws on a dp2 x tp2 rank's rows of a [4, 15, 4] activation split 8 + 7 over tp."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    batch = DataParallelBatch(mesh, ("dp",), ("tp",))
    batch.slice((torch.zeros(4, 15),), {})  # the rank's 2 rows
    rows = DTensor.from_local(torch.zeros(2, 15, 4).tensor_split(2, dim=1)[mesh.get_local_rank("tp")].contiguous(),
                              mesh["tp"], [Shard(1)], run_check=False, shape=(2, 15, 4), stride=(60, 4, 1))
    out = {}
    for name, draw in _UNEVEN_DRAWS.items():
        executor.rng.manual_seed(SEED)
        with batch.randomness():
            out[name] = draw(rows).to_local()
    executor.rng.deactivate()
    return {**out, "rank": torch.tensor([mesh.get_local_rank("dp"), mesh.get_local_rank("tp")])}


def test_draws_on_an_uneven_split_under_data_parallelism_match_single_device() -> None:
    """The global batch's view of a rank's slice was built without its global shape, which
    DTensor inferred from the shard: 16 columns on one tp rank and 14 on the other for 15
    split 8 + 7, so the draws differed from one device's and in-place fills failed (review).
    bernoulli_ with probabilities split as the tensor is stopped on "placements differ",
    and a draw into ``out=`` was drawn on the rank's rows as if they were the batch."""
    reference = {}
    for name, draw in _UNEVEN_DRAWS.items():
        executor.rng.manual_seed(SEED)
        reference[name] = draw(torch.zeros(4, 15, 4))
    executor.rng.deactivate()
    for rank in run_on_ranks(4, uneven_draws):
        dp, tp = rank["rank"].tolist()
        for name, full in reference.items():
            assert torch.equal(rank[name], full[2 * dp:2 * dp + 2].tensor_split(2, dim=1)[tp]), (name, dp, tp)


def scatter_add_in_place() -> dict[str, Any]:
    """``grad.scatter_add_(-1, index, src)`` on pending sums, as PhiMoE's router backward
    does, against the same op on the summed tensors; and on a tensor split along the
    scattered dim."""
    dtensor_rules.install()
    mesh = init_device_mesh("cpu", (2,))
    share = 0.25 if torch.distributed.get_rank() == 0 else 0.75
    grad, src = torch.linspace(-1, 2, 24).view(6, 4), torch.linspace(3, -2, 6).view(6, 1)
    index = torch.tensor([[3], [0], [1], [3], [2], [0]])
    out = DTensor.from_local(grad * share, mesh, [Partial()], run_check=False)
    out.scatter_add_(-1, DTensor.from_local(index, mesh, [Replicate()], run_check=False),
                     DTensor.from_local(src * share, mesh, [Partial()], run_check=False))
    split = DTensor.from_local(grad[:, :2], mesh, [Shard(1)], run_check=False)
    try:
        split.scatter_add_(-1, DTensor.from_local(index, mesh, [Replicate()], run_check=False),
                           DTensor.from_local(src, mesh, [Replicate()], run_check=False))
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    rows = [DTensor.from_local(t.chunk(2)[torch.distributed.get_rank()].clone(), mesh, [Shard(0)], run_check=False)
            for t in (grad, index, src)]  # split alike on a dim other than the scattered one
    rows[0].scatter_add_(-1, rows[1], rows[2])
    return {"placements": out.placements, "got": out.full_tensor(), "rows": (rows[0].placements, rows[0].full_tensor()),
            "expected": grad.clone().scatter_add_(-1, index, src), "refused": refused}


def test_in_place_scatter_add_on_pending_sums_adds_them() -> None:
    """torch 2.13 derives ``scatter_add_``'s rule from its decomposition, which
    redistributed ``self`` into a copy and relabelled the original: PhiMoE's router
    gradient came out 21x one device's.  executor.dtensor_rules gives it a rule; a
    placement no rule keeps is refused by DTensor, not computed wrong."""
    for rank in run_on_ranks(2, scatter_add_in_place):
        assert rank["placements"] == (Partial(),)
        torch.testing.assert_close(rank["got"], rank["expected"])
        assert rank["rows"][0] == (Shard(0),)
        torch.testing.assert_close(rank["rows"][1], rank["expected"])
        assert "in-place operations that require placement changes are not supported" in rank["refused"]


def test_fsdp_cuts_fewer_experts_than_ranks_across_their_rows() -> None:
    """FSDP2 pads every rank's chunk to ceil(rows / ranks) rows: cut on dim 0, one expert
    over 2 ranks left one rank the whole expert and the other padding, and the planner
    priced half each (Mixtral 8x7B on 64 ranks "fit" with an eighth of its experts' state
    per rank, not a sixty-fourth; review).  The plan cuts them on dim 1, and they train as
    on one device."""
    config = {**MIXTRAL, "num_local_experts": 1, "num_experts_per_tok": 1}
    plan = planner.hand_plan(config, devices=2, profile="cpu-gloo-local", dp=2, fsdp=True, batch_size=BATCH,
                             seq_len=SEQ)
    assert {p.fqn: p.placements for p in plan.parameters if ".experts." in p.fqn} == {
        "model.layers.*.mlp.experts.gate_up_proj": ["S(1)"], "model.layers.*.mlp.experts.down_proj": ["S(1)"]}
    ref = _moe_reference(config, "grouped_mm")
    # beside tensor parallelism on dim 1 (gate_up_proj) or 2 (down_proj), FSDP takes the other
    both = planner.hand_plan(config, devices=4, profile="cpu-gloo-local", dp=2, tp=2, fsdp=True, batch_size=BATCH,
                             seq_len=SEQ)
    assert {p.fqn: p.placements for p in both.parameters if ".experts." in p.fqn} == {
        "model.layers.*.mlp.experts.gate_up_proj": ["S(2)", "S(1)"],
        "model.layers.*.mlp.experts.down_proj": ["S(1)", "S(2)"]}
    for ranks, layout in ((2, plan), (4, both)):
        got = run_on_ranks(ranks, moe_steps, layout.to_json(), config)
        for rank in got:
            assert rank["held"] == {n: numel // ranks for n, numel in ref["held"].items()}, rank["held"]
        torch.testing.assert_close(torch.tensor(got[0]["losses"]), torch.tensor(ref["losses"]), rtol=1e-4, atol=0)
        for name, grad in ref["grads"].items():
            if ".experts." in name:  # (one expert: the router's gradient is 0)
                miss = (got[0]["grads"][name].float() - grad.float()).norm() / grad.float().norm()
                assert miss < 1e-2, (ranks, name, miss)


def test_dropout_is_on_in_the_reference(references: dict) -> None:
    """The dropout cases really draw masks: the same loop without dropout differs."""
    with_dropout = references[Case("llama", dropout=0.1).name]["losses"]
    try:
        without = train(Case("llama"))["losses"]
    finally:
        executor.rng.deactivate()
    assert with_dropout != without


def test_uneven_batch_is_refused(world4: dict) -> None:
    assert "global batch 6 is not divisible by the data-parallel size 4" in world4["uneven"]


# -- bad plans: refused before anything changes ---------------------------------------

def _llama() -> nn.Module:
    return build(Case("llama"))


def _refused(plan: Any, model: nn.Module, **kwargs: Any) -> str:
    before = {n: p for n, p in model.named_parameters()}
    with pytest.raises(executor.PlanError) as e:
        executor.apply(plan, model, **kwargs)
    after = dict(model.named_parameters())
    assert all(after[n] is p and not isinstance(p, DTensor) for n, p in before.items())
    return str(e.value)


def test_plan_for_another_model_names_every_mismatch() -> None:
    gpt2 = build(Case("gpt2"))
    msg = _refused(make_plan(gpt2, {"dp": 1}), _llama())
    assert "model.layers.*.self_attn.q_proj.weight: in the model, not in the plan" in msg
    assert "transformer.h.*.attn.c_attn.weight: in the plan, not in the model" in msg


def test_wrong_world_size() -> None:
    model = _llama()
    msg = _refused(make_plan(model, {"dp": 2}), model)
    assert "devices: the plan is for 2 devices, no process group (plain single process) has 1" in msg


def test_unknown_fqn() -> None:
    model = _llama()
    plan = make_plan(model, {"dp": 1})
    plan.parameters.append(ParameterPlacement(fqn="model.layers.*.mlp.nope.weight", placements=["R"]))
    assert "model.layers.*.mlp.nope.weight: matches no parameter of the model" in _refused(plan, model)


def test_hugging_face_gradient_checkpointing_is_refused() -> None:
    """Its recomputation redrew dropout from executor.rng's advanced counter: other masks
    than the forward's, so gradients of another function (the 1-device run too), and
    under tensor parallelism a crash."""
    model = _llama()
    with warnings.catch_warnings():  # transformers 5 renamed it activation_checkpointing_enable
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable()
    msg = _refused(make_plan(model, {"dp": 1}), model)
    assert re.search(r"model: Hugging Face activation checkpointing is on; call model\.(activation|gradient)"
                     r"_checkpointing_disable\(\)", msg), msg
    # turned on after apply: refused at the next forward (it was accepted silently)
    model = executor.apply(make_plan(_llama(), {"dp": 1}), _llama())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        model.gradient_checkpointing_enable()
    with pytest.raises(executor.PlanError, match="model: Hugging Face activation checkpointing is on"):
        model(input_ids=torch.zeros(1, 4, dtype=torch.long))


def test_parameter_without_placement() -> None:
    model = _llama()
    plan = make_plan(model, {"dp": 1})
    plan.parameters = [p for p in plan.parameters if p.fqn != "model.norm.weight"]
    assert "model.norm.weight: no placement in the plan" in _refused(plan, model)


def test_unknown_placement_is_named_by_its_parameter() -> None:
    """It read ``plan: parameters.3.placements.0: String should match pattern '^(R|P|...'``:
    an index into the plan and a regex (audit)."""
    model = _llama()
    plan = make_plan(model, {"dp": 1})
    entry = plan.parameters[3]
    entry.placements = ["S(7)x"]
    assert (f"{entry.fqn} (parameters.3.placements.0): 'S(7)x' is not a placement: R (replicated), "
            "P (partial sums) or S(<dim>)") in _refused(plan, model)


def test_indivisible_shard() -> None:
    model = _llama()
    msg = _refused(make_plan(model, {"tp": 3}), model)
    assert ("model.layers.0.self_attn.q_proj.weight: dim 0 of size 32 does not split evenly "
            "into 3 tensor-parallel shards") in msg


def test_float32_experts_split_over_tp_are_refused_naming_the_dtype() -> None:
    """torch's grouped GEMM under DTensor takes bfloat16 only: an fp32 MoE (the README's
    loop builds fp32 models) failed at the first forward with "Expected inputs of BF16
    type" from deep inside torch (black-box review)."""
    plan = planner.hand_plan(OLMOE, devices=2, profile="cpu-gloo-local", tp=2, batch_size=BATCH, seq_len=SEQ)
    msg = _refused(plan, build_model(load_config(OLMOE), device="meta"))
    says = ("model.layers.0.mlp.experts.gate_up_proj (and 3 more): float32 experts on the model dims (DTensors "
            "there, split or whole); torch's grouped GEMM under DTensor takes bfloat16 only")
    assert says in msg
    # kept whole on tp they are DTensors all the same (the planner's tp=2 plan of a tiny
    # MoE keeps everything whole: it died in the first forward, a sweep found in session 39)
    data = plan.model_dump(mode="json")
    for entry in data["parameters"]:
        entry["placements"] = ["R"] * len(entry["placements"])
    assert says in _refused(Plan.model_validate(data), build_model(load_config(OLMOE), device="meta"))


def test_what_torch_2_11_cannot_run_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.11's DTensor fails experts split over tp and eager attention split by heads
    deep inside torch (a helper's run of the suite there); apply names them instead."""
    monkeypatch.setattr(executor.dtensor_rules, "FLATTENS_INNER_SHARDS", False)
    plan = planner.hand_plan(OLMOE, devices=2, profile="cpu-gloo-local", tp=2, batch_size=BATCH, seq_len=SEQ)
    model = build_model(load_config(OLMOE), device="meta").to(torch.bfloat16)
    assert re.search(r"model\.layers\.0\.mlp\.experts\.\w+: experts split over the model dims need torch >= "
                     r"2\.13 \(torch [\d.]+'s DTensor has no rule", _refused(plan, model))
    gemma2 = {**PRESETS["llama-tiny"], "model_type": "gemma2", "head_dim": 8}
    plan = planner.hand_plan(gemma2, devices=2, profile="cpu-gloo-local", tp=2, batch_size=BATCH, seq_len=SEQ)
    assert "self_attn.q_proj.weight: eager attention split by heads needs torch >= 2.13" in _refused(
        plan, build_model(load_config(gemma2), device="meta"))
    fsdp = planner.hand_plan(gemma2, devices=2, profile="cpu-gloo-local", dp=2, fsdp=True, batch_size=BATCH,
                             seq_len=SEQ)
    assert "torch >= 2.13" not in _refused(fsdp, build_model(load_config(gemma2), device="meta"))


def test_replicated_parameter_on_a_fully_shard_dim() -> None:
    model = _llama()
    plan = make_plan(model, {"dp": 2}, fsdp=True)
    plan.parameters[0].placements = ["R"]
    fqn = plan.parameters[0].fqn.replace("*", "0")
    assert f"{fqn}: R on fully_shard dim 'dp'; FSDP shards every parameter" in _refused(plan, model)


def test_arguments_of_the_wrong_type_are_named() -> None:
    model = _llama()
    plan = make_plan(model, {"dp": 1})
    for args, expected in (((plan.to_json(), model), "plan: expected a planner.Plan, got str"),
                           ((plan.model_dump(), model), "plan: expected a planner.Plan, got dict"),
                           ((plan, None), "model: expected a torch.nn.Module, got NoneType")):
        with pytest.raises(TypeError, match=expected):
            executor.apply(*args)
    with pytest.raises(TypeError, match="mesh: expected a torch DeviceMesh"):
        executor.apply(plan, model, mesh={"dp": 1})


def test_a_plan_changed_in_python_is_checked_again() -> None:
    """pydantic validates on construction only: an assignment made after reading a plan
    used to reach apply's checks and fail inside them (a ValueError from zip)."""
    model = _llama()
    plan = make_plan(model, {"dp": 1})
    plan.parameters[0].placements = ["R", "R"]
    assert (f"plan: parameters: {plan.parameters[0].fqn} has 2 placements for a 1-D mesh"
            in _refused(plan, model))


def test_dropout_without_a_seed_warns() -> None:
    """Unseeded, dropout comes from torch's generator, whose masks depend on the sharding:
    the run silently differed from one device's."""
    torch.distributed.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        executor.rng.deactivate()
        model = build(Case("llama", {"tp": 2}, dropout=0.1))
        with pytest.warns(UserWarning, match=r"executor.rng is not seeded \(or not active\), so dropout draws from torch's"):
            executor.apply(make_plan(model, {"tp": 2}), model)
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize(("mesh", "fsdp", "expected"), [
    ({"dp": 2}, True, {"all_gather", "reduce_scatter"}),
    ({"dp": 2}, False, {"all_reduce"}),  # replicate: HSDP's all-reduce of the gradients
    ({"dp": 2, "tp": 2}, True, {"all_gather", "reduce_scatter"}),
])
def test_fsdp2_collectives_are_synchronous_on_a_cpu(monkeypatch, mesh, fsdp, expected) -> None:
    """The cost model charges FSDP2's all-gathers and gradient reductions in full on a CPU
    (a calibrated profile's ``overlap_exposure`` is 1, not measured) because FSDP2 issues
    them synchronously there: it overlaps them with compute only through CUDA streams.  A
    lent 16-core machine showed the rank blocked in each (session 27) while an
    asynchronous gloo collective hid behind matmuls (exposure 0.02).  If a torch release
    issues them asynchronously on a CPU, this fails and the exposure must be measured."""
    import inspect
    import sys

    import torch.distributed as dist

    calls: list[tuple[str, bool]] = []
    for name in ("all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
                 "reduce_scatter_single", "all_reduce"):
        if not hasattr(dist, name):  # the names FSDP2 calls differ between torch releases
            continue
        fn = getattr(dist, name)

        def recorded(*args: Any, _name: str = name, _fn: Any = fn, **kw: Any) -> Any:
            if sys._getframe(1).f_code.co_filename.endswith("_fsdp_collectives.py"):  # FSDP2's own
                bound = inspect.signature(_fn).bind(*args, **kw)
                calls.append((_name, bound.arguments.get("async_op", False)))
            return _fn(*args, **kw)
        monkeypatch.setattr(dist, name, recorded)
    torch.distributed.init_process_group("fake", rank=0, world_size=math.prod(mesh.values()),
                                         store=FakeStore())
    try:
        executor.rng.manual_seed(SEED)
        model = build(Case("llama", mesh, fsdp=fsdp))
        model = executor.apply(make_plan(model, mesh, fsdp=fsdp), model)
        ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
        model(input_ids=ids, labels=ids).loss.backward()
    finally:
        torch.distributed.destroy_process_group()
        executor.rng.deactivate()
    assert {"_".join(name.split("_")[:2]) for name, _ in calls} == expected, calls
    assert not [c for c in calls if c[1]], calls


def test_a_module_layout_the_activation_cannot_take_is_named() -> None:
    """A plan's module layout sharding a dim the activation lacks raised an IndexError
    from inside DTensor's redistribution, naming no module."""
    torch.distributed.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        executor.rng.manual_seed(SEED)
        model = build(Case("llama", {"tp": 2}))
        plan = make_plan(model, {"tp": 2}, sp=True)
        down = next(m for m in plan.modules if m.module.endswith("mlp.down_proj"))
        down.output = ["S(5)"]
        model = executor.apply(plan, model)
        ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
        with pytest.raises(executor.PlanError, match=re.escape(
                f"modules: {down.module} output ['S(5)'] shards a dim that its 3-D activation")):
            model(input_ids=ids, labels=ids)
    finally:
        torch.distributed.destroy_process_group()
        executor.rng.deactivate()


def test_apply_twice_is_refused() -> None:
    """A second apply on an applied model failed inside torch (FSDP2's contract, or a
    bad MRO on the next forward), the model half changed."""
    torch.distributed.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        case = Case("llama", {"tp": 2})
        executor.rng.manual_seed(SEED)
        model = build(case)
        plan = make_plan(model, case.mesh)
        model = executor.apply(plan, model)
        with pytest.raises(executor.PlanError, match="model: executor.apply already ran on this model"):
            executor.apply(plan, model)
    finally:
        torch.distributed.destroy_process_group()
        executor.rng.deactivate()


def models_built_apart() -> list[bool]:
    """Per layout: whether every rank holds rank 0's initial weights after apply, when each
    rank built its real model from a seed of its own (as ranks that load a checkpoint on
    rank 0 only differ)."""
    rank = torch.distributed.get_rank()
    same = []
    for mesh, fsdp in (({"dp": 4}, False), ({"dp": 4}, True), ({"dp": 2, "tp": 2}, True)):
        executor.rng.manual_seed(SEED + rank)
        model = build(Case("llama", mesh))
        first: list[dict[str, torch.Tensor] | None] = [_full(dict(model.named_parameters()))]
        torch.distributed.broadcast_object_list(first, src=0)
        model = executor.apply(make_plan(model, mesh, fsdp=fsdp), model)
        held = _full(dict(model.named_parameters()))
        same.append(all(torch.equal(held[n], t) for n, t in first[0].items()))
    executor.rng.deactivate()
    return same


def test_real_models_built_apart_start_from_the_first_ranks_weights() -> None:
    """FSDP2 sharded each rank's own copy and a replicated dim kept it, so the copies
    trained apart without an error (review); apply now broadcasts them, as DDP does."""
    assert run_on_ranks(4, models_built_apart) == [[True, True, True]] * 4


def threads_per_apply() -> list[int]:
    """gloo's threads in this rank (by name, from Linux's /proc/self/task) after each of
    three applies of one 2-D plan to new models."""
    def gloo_threads() -> int:
        return sum("gloo" in task.joinpath("comm").read_text() for task in Path("/proc/self/task").iterdir())

    counts = []
    for _ in range(3):
        model = build(Case("llama", {"dp": 2, "tp": 2}))
        executor.apply(make_plan(model, {"dp": 2, "tp": 2}, fsdp=True), model)
        counts.append(gloo_threads())
    executor.rng.deactivate()
    return counts


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in Linux's /proc")
def test_applies_share_their_mesh_and_its_process_groups() -> None:
    """init_device_mesh made new process groups at every apply, each with gloo's threads
    and sockets for good: ranks that applied plans again and again (the architecture
    stress job, ~200 applies) ran 1,360 threads each and every apply ~5x slower."""
    for counts in run_on_ranks(4, threads_per_apply):
        assert counts[0] > 0 and counts[0] == counts[1] == counts[2]


def test_an_optimizer_built_before_apply_is_refused_at_its_first_step() -> None:
    """Its parameters are the ones apply replaced, which no gradient reaches: the N-device
    run trained nothing while the 1-device run trained (review)."""
    torch.distributed.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        executor.rng.manual_seed(SEED)
        model = build(Case("llama", {"dp": 2}))
        early = torch.optim.AdamW(model.parameters())
        model = executor.apply(make_plan(model, {"dp": 2}, fsdp=True), model)
        ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
        model(input_ids=ids, labels=ids).loss.backward()
        with pytest.raises(RuntimeError, match="parameter model.embed_tokens.weight is the one executor.apply "
                                               "replaced.*build the optimizer .* after apply"):
            early.step()
        torch.optim.AdamW(model.parameters()).step()  # built after apply: steps
    finally:
        torch.distributed.destroy_process_group()
        executor.rng.deactivate()


def test_a_meta_model_without_a_seed_says_which_call_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(executor.rng._STATE, "seed", None)
    meta = build_model(load_config("llama-tiny"), "meta")
    with pytest.raises(RuntimeError, match=r"call executor.rng.manual_seed\(seed\) before building it"):
        executor.apply(make_plan(meta, {"dp": 1}), meta)


def test_a_model_partly_on_meta_is_refused_naming_its_meta_tensors() -> None:
    """Weights loaded into a meta model with assign=True leave Hugging Face's
    non-persistent buffers on meta; apply took the model for a meta one and replaced every
    loaded weight with its init program's values, silently (audit, session 37)."""
    executor.rng.manual_seed(SEED)
    try:
        real = _llama()
        meta = build(Case("llama", meta=True))
        meta.load_state_dict(real.state_dict(), assign=True)
        msg = _refused(make_plan(meta, {"dp": 1}), meta)
    finally:
        executor.rng.deactivate()
    assert re.search(r"model\.rotary_emb\.\w*inv_freq \(and 1 more\): on the meta device while the model's "
                     r"other tensors hold values", msg), msg


def ranks_refusing_apart() -> str:
    """The PlanError each rank raises when only rank 1's model has a parameter the plan
    lacks (rank 0's checks pass)."""
    executor.rng.manual_seed(SEED)
    model = build(Case("llama", {"dp": 2}))
    plan = make_plan(model, {"dp": 2}, fsdp=True)
    if torch.distributed.get_rank() == 1:
        model.model.extra = nn.Linear(2, 2)
    try:
        executor.apply(plan, model)
    except executor.PlanError as e:
        return str(e)
    finally:
        executor.rng.deactivate()
    return "applied"


def test_ranks_whose_checks_pass_learn_that_another_refused() -> None:
    """Rank 0 waited in the first rank's broadcast for rank 1, which had raised, until
    the process group's timeout (audit, session 37)."""
    first, second = run_on_ranks(2, ranks_refusing_apart)
    assert first.startswith("plan: rank 1 refused it (its error names the problem); this rank's checks passed")
    assert "model.extra.weight: in the model, not in the plan" in second, second


def test_single_device_plan_without_process_group_is_the_plain_model() -> None:
    model = _llama()
    before = [p for p in model.parameters()]
    assert executor.apply(make_plan(model, {"dp": 1}), model) is model
    assert all(a is b for a, b in zip(before, model.parameters(), strict=True))


def test_a_given_mesh_runs_the_plan_on_a_subgroup_of_the_world() -> None:
    """``apply(plan, model, mesh=)`` runs a tp=2 plan on two ranks of a 4-rank world (a
    job with a mesh of its own); a mesh that is not the plan's is refused, naming both.
    (The dim is named ``pair``: DTensor's caches tell meshes apart by ranks and names,
    not groups, so a later test's ``tp`` mesh on ranks 0-1 must not equal this one.)"""
    torch.distributed.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        pair = torch.distributed.new_group([0, 1])
        model = build(Case("llama", {"pair": 2}))
        plan = make_plan(model, {"pair": 2})
        assert "devices: the plan is for 2 devices, the process group has 4" in _refused(plan, model)
        wrong = DeviceMesh.from_group(pair, "cpu", mesh_dim_names=("dp",))
        assert ("mesh: the plan's mesh is {'pair': 2}, the given mesh is {'dp': 2}"
                in _refused(plan, model, mesh=wrong))
        unnamed = DeviceMesh.from_group(pair, "cpu")
        assert ("mesh: the given mesh (2,) has no dim names; the plan's mesh is {'pair': 2}"
                in _refused(plan, model, mesh=unnamed))
        mesh = DeviceMesh.from_group(pair, "cpu", mesh_dim_names=("pair",))
        model = executor.apply(plan, model, mesh=mesh)
        weight = model.model.layers[0].self_attn.q_proj.weight
        assert weight.device_mesh == mesh and weight.placements == (Shard(0),)
        ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        assert weight.grad.placements == (Shard(0),)
    finally:
        torch.distributed.destroy_process_group()
        executor.rng.deactivate()


# -- collectives the plan implies, and no more -----------------------------------------

@contextmanager
def on_fake_group(case: Case) -> Iterator[nn.Module]:
    """Rank 0 of ``case``'s model applied in one process, on torch's fake process group
    (where collectives cost nothing and CommDebugMode still counts them)."""
    torch.distributed.init_process_group("fake", rank=0, world_size=math.prod(case.mesh.values()), store=FakeStore())
    try:
        executor.rng.manual_seed(SEED)
        model = build(case)
        yield executor.apply(make_plan(model, case.mesh, fsdp=case.fsdp, sp=case.sp, checkpointing=case.checkpointing,
                                       microbatches=case.microbatches), model)
    finally:
        torch.distributed.destroy_process_group()
        executor.rng.deactivate()


def tp2_on_fake_group(sp: bool, checkpointing: str = "none") -> Iterator[nn.Module]:
    """Rank 0 of a tp=2 tiny Llama (``on_fake_group``)."""
    return on_fake_group(Case("llama", {"tp": 2}, sp=sp, checkpointing=checkpointing))


def test_a_training_call_in_micro_batches_says_why_it_has_no_logits() -> None:
    """``out.logits`` was None, so a loop that reads them failed on a micro-batch plan only,
    without the reason (review); a call that runs whole still returns them."""
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    with on_fake_group(Case("llama", {"dp": 2}, microbatches=2)) as model:
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        with pytest.raises(AttributeError, match=r"logits: this training call ran the plan's microbatches=2 "
                                                 r"in parts .* under torch.no_grad\(\), runs its batch whole"):
            getattr(out, "logits")  # noqa: B009 (the read is the test)
        with torch.no_grad():
            assert model(input_ids=ids, labels=ids).logits.shape == (BATCH, SEQ, 128)


@pytest.mark.parametrize("microbatches", [1, 2])
def test_fsdp_gathers_what_the_cost_model_charges(microbatches: int) -> None:
    """FSDP2's all-gathers in one training step of dp=2 fully sharded, with the plan's
    micro-batches run inside the call: a gather per micro-batch's forward and backward
    for each block but the last, one per micro-batch for the last block and the root,
    which keep their parameters from forward to backward (cost_model.step.fsdp_gathers)."""
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    with on_fake_group(Case("llama", {"dp": 2}, fsdp=True, microbatches=microbatches)) as model:
        model(input_ids=ids, labels=ids).loss.backward()  # the first step initialises FSDP2 lazily
        with Collectives("c10d") as comm:
            model(input_ids=ids, labels=ids).loss.backward()
    layers = PRESETS["llama-tiny"]["num_hidden_layers"]
    assert comm.counts["_allgather_base_"] == \
        fsdp_step_gathers(microbatches, False, layers, kept_layers=1) == microbatches * (2 * (layers - 1) + 2)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp-sp"])
def test_a_layer_runs_on_local_shards_only_where_its_gradients_cross_boundaries(sp: bool) -> None:
    """Without sequence parallelism the normed hidden state a layer feeds its attention and
    MLP is replicated and made inside the layer, and its gradient is a pending sum that no
    boundary converts: replayed locally as one region, the layer would add it to the
    residual stream's replicated gradient unreduced.  On the fake process group, where the
    check cannot compare values, the recording itself must refuse it (no dropout here,
    so nothing else fails), leaving the attention and MLP regions."""
    layers = range(PRESETS["llama-tiny"]["num_hidden_layers"])
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    with tp2_on_fake_group(sp=sp) as model:
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        locally = executor.local_regions.running_locally(model)
    blocks = [f"model.layers.{i}.{b}" for i in layers for b in ("self_attn", "mlp")]
    assert locally == ([f"model.layers.{i}" for i in layers] if sp else blocks)


def test_two_forwards_of_new_shapes_before_one_backward() -> None:
    """A loop that sums the losses of two batches of different lengths (chosen and rejected
    sequences, dynamically padded micro-batches): the second shape makes every region check
    itself again, in the middle of the first forward's graph.  The check once wrote its
    parameter pattern into the live parameters, which the first forward had saved for its
    backward (an in-place modification error)."""
    with tp2_on_fake_group(sp=False) as model:
        ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
        model(input_ids=ids, labels=ids).loss.backward()
        short = ids[:, : SEQ // 2]
        (model(input_ids=ids, labels=ids).loss + model(input_ids=short, labels=short).loss).backward()
        assert executor.local_regions.running_locally(model)


def test_a_loop_that_leaves_use_cache_alone_trains_on_local_shards() -> None:
    """Hugging Face models build a key/value cache on every call unless told not to, and
    each layer appends to it: a region's check appended its extra runs' keys too, and the
    real backward then ran into the check's freed graph (the README's loop, which passes
    no use_cache, crashed on tensor-parallel plans).  Under tensor parallelism the model
    is now called without a cache: training runs on local shards, a validation pass in
    eval mode works (the cache's empty start tensor cannot join DTensor keys: an
    IndexError), and asking for a cache is refused by name."""
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    layers = range(PRESETS["llama-tiny"]["num_hidden_layers"])
    with tp2_on_fake_group(sp=True) as model:
        for _ in range(2):
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
        assert out.past_key_values is None
        assert executor.local_regions.running_locally(model) == [f"model.layers.{i}" for i in layers]
        model.eval()
        with torch.no_grad():
            assert model(input_ids=ids, labels=ids).loss.shape == ()
        with pytest.raises(ValueError, match=r"^use_cache=True: a key/value cache is not supported"):
            model(input_ids=ids, use_cache=True)


def test_nothing_of_a_training_step_outlives_its_backward() -> None:
    """The layout hooks cache each conversion of a module's input while its source lives,
    for the next module that reads it.  Megatron's ``f`` on the final norm's replicated
    output (the column-parallel lm_head's input under TorchTitan's tp plan) is a view of
    it, which kept its source alive, so the cache never let go: every step kept the last
    one's normed hidden state and its autograd graph for good (the fidelity bench's
    4-rank TP Llama: ~30 MB more per step and rank, and the pages faulted in again each
    step).  The cache is now emptied when the forward returns: after its backward, nothing
    of a step is left."""
    torch.distributed.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        executor.rng.manual_seed(SEED)
        plan = planner.hand_plan("llama-tiny", devices=2, profile="cpu-gloo-local", tp=2, batch_size=BATCH,
                                 seq_len=SEQ)
        model = executor.apply(plan, build_model(load_config("llama-tiny")).train())
        optimizer = torch.optim.AdamW(model.parameters())
        normed: list[weakref.ref] = []
        model.model.norm.register_forward_hook(lambda module, args, out: normed.append(weakref.ref(out)))
        ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
        for _ in range(3):
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        gc.collect()
        assert [ref() is None for ref in normed] == [True, True, True]
    finally:
        torch.distributed.destroy_process_group()


class _Tally:
    """A mutable argument: counts the calls it rides along with; falsy while empty, as
    Hugging Face's empty cache is."""

    def __init__(self) -> None:
        self.calls = 0

    def __len__(self) -> int:
        return self.calls


class _TallyMLP(MLP):
    def forward(self, x: torch.Tensor, tally: _Tally) -> torch.Tensor:  # type: ignore[override]
        tally.calls += 1
        return super().forward(x)


class _CallsTallyMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block, self.tally = _TallyMLP(0.0), _Tally()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x, self.tally)


def test_a_region_called_with_a_mutable_object_stays_on_dtensor() -> None:
    """The check runs a region's body twice more on its first call; an object the body
    changes (here a counter; in Hugging Face models a cache) would see those runs."""
    torch.distributed.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        executor.rng.manual_seed(SEED)
        model = _CallsTallyMLP()
        model = executor.apply(make_plan(model, {"tp": 2}), model)
        for _ in range(2):
            model(torch.randn(BATCH, 16)).sum().backward()
        assert model.tally.calls == 2
        assert executor.local_regions.running_locally(model) == []
    finally:
        torch.distributed.destroy_process_group()
        executor.rng.deactivate()


class _ScaledReLU(nn.Module):
    """Apertus' xIELU in small: a replicated scalar scales the activations."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.softplus(self.alpha) * torch.relu(x)


class _ScaledMLP(MLP):
    def __init__(self) -> None:
        super().__init__(0.0)
        self.act = _ScaledReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class _Layers(nn.Module):
    """A block in a layer list: a region (a repeated block) whatever it holds."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleList([block])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[0](x)


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "scaled"])
def test_on_the_fake_group_a_region_stays_on_dtensor_where_a_real_one_would(scaled: bool) -> None:
    """On torch's ``fake`` process group collectives return garbage, so a region's check
    cannot compare values.  The scaled block's scalar gets a gradient summed over the
    column-parallel features, which DTensor reduces in the middle of the backward (at
    softplus's) and a local shard's backward cannot.  On the fake group that block passed
    the structural check and ran locally, its scalar's gradient one rank's share, and the
    collectives a fake-group step issued (what the plans' counts are checked against)
    lacked that reduction; a real group's check compares values and keeps it on DTensor
    (Apertus, 8 all-reduces per step fewer on the fake group).  The check now also
    compares the collectives each run issues; the plain block still runs locally."""
    torch.distributed.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        executor.rng.manual_seed(SEED)
        model = _Layers(_ScaledMLP() if scaled else MLP(0.0))
        model = executor.apply(make_plan(model, {"tp": 2}), model)
        for _ in range(2):
            model(torch.randn(BATCH, 16)).sum().backward()
        assert executor.local_regions.running_locally(model) == ([] if scaled else ["layers.0"])
    finally:
        torch.distributed.destroy_process_group()
        executor.rng.deactivate()


@pytest.mark.parametrize("lifted", [True, False], ids=["as-planned", "per-projection"])
@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_the_planners_sequence_parallel_plan_issues_the_collectives_it_prices(checkpointing: str,
                                                                             lifted: bool) -> None:
    """``planner.hand_plan``'s TP+SP layout writes a layout per projection and keeps
    row-parallel outputs as pending sums; run as written it issued an all-gather per
    projection (q, k, v: three of one tensor) and an all-reduce at each residual add.
    The planner prices one reshard per tensor and layout, and a reduce-scatter into the
    residual stream: per layer one all-gather before attention and one before the MLP,
    one reduce-scatter after each, forward and mirrored backward; plus the embedding's
    reduce-scatter and the head's all-gather.  The same after a training step (whole
    layers then run on local shards, replaying the conversions), without grad,
    and in a full recomputation (which re-issues a layer's two gathers and o_proj's
    reduce-scatter, test_recomputation_reissues_the_collectives_the_planner_charges).
    ``per-projection``: without the layouts the planner lifts onto attention and MLP
    (their projections' shared input layout), the attention stays on DTensor (it reads
    its input's sharded shape) and the MLP replays gate's and up's conversions of one
    tensor as one, as DTensor did.  The backward also reduces the norm weights' Partial
    gradients (each rank saw its share of the sequence) in one all-reduce, as the planner
    prices them (``search._partial_grads``, bucketed without data parallelism); counted
    after ``zero_grad``, as an optimizer step leaves the gradients.  Into gradients kept
    from the warm-up step (as this test counted until session 44), DTensor all-reduces
    each one as it adds it instead, 5 here, which ``Collectives`` did not see until it let
    DTensor issue its collectives first."""
    layers = PRESETS["llama-tiny"]["num_hidden_layers"]
    torch.distributed.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        plan = planner.hand_plan("llama-tiny", devices=2, profile="cpu-gloo-local", tp=2, sp=True,
                                 checkpointing=checkpointing, batch_size=BATCH, seq_len=SEQ)
        if not lifted:
            plan.modules = [m for m in plan.modules if not m.module.endswith(("self_attn", "mlp"))]
        model = executor.apply(plan, build(Case("llama")))
        ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        model.zero_grad()
        locally = executor.local_regions.running_locally(model)
        with Collectives() as forward:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        with Collectives() as backward:
            loss.backward()
        with torch.no_grad(), Collectives() as evaluation:
            model(input_ids=ids, use_cache=False)
    finally:
        torch.distributed.destroy_process_group()
        executor.rng.deactivate()
    assert locally == [f"model.layers.{i}" if lifted else f"model.layers.{i}.mlp" for i in range(layers)]
    each = 2 * layers + 1
    assert forward.counts == evaluation.counts == {"all_gather_into_tensor": each, "reduce_scatter_tensor": each}
    rerun = {"all_gather_into_tensor": 2 * layers, "reduce_scatter_tensor": layers} if checkpointing == "full" else {}
    assert backward.counts == Counter(forward.counts) + Counter(rerun) + Counter(all_reduce=1)


def test_gpt2_tensor_parallel_forward_gathers_only_its_qkv_split() -> None:
    """GPT-2's Conv1D flattens its input for ``addmm`` inside the module, and the plan placed
    its boundaries by the flat 2-D product (features ``S(1)``), which on the 3-D tensors
    the module takes and gives is the sequence: c_fc's output was re-laid by sequence and
    gathered again for c_proj, 6 all-gathers per layer in the forward.  What remains is
    the q/k/v split of c_attn's column-parallel output (DTensor gathers a tensor it cuts on
    the sharded dim, which the planner prices), one per layer, and the all-reduces after
    the row-parallel projections."""
    layers = PRESETS["gpt2-tiny"]["n_layer"]
    torch.distributed.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        plan = planner.hand_plan("gpt2-tiny", devices=2, profile="cpu-gloo-local", tp=2, batch_size=BATCH,
                                 seq_len=SEQ)
        assert {m.module: m.output for m in plan.modules}["transformer.h.*.mlp.c_fc"][-1] == "S(2)"  # features
        executor.rng.manual_seed(SEED)
        model = executor.apply(plan, build(Case("gpt2")))
        ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
        model(input_ids=ids, labels=ids).loss.backward()
        with CommDebugMode() as comm:  # a local replay issues c10d collectives: count both kinds
            model(input_ids=ids, labels=ids)
    finally:
        torch.distributed.destroy_process_group()
        executor.rng.deactivate()
    gathers = sum(n for op, n in comm.get_comm_counts().items() if "all_gather" in str(op))
    assert gathers == layers, comm.get_comm_counts()


@pytest.mark.parametrize("mesh", [{"tp": 2}, {"dp": 2, "tp": 2}], ids=["tp2", "dp2xtp2"])
def test_block_inputs_reduce_their_pending_gradients_at_the_boundary(mesh: dict[str, int]) -> None:
    """Without sequence parallelism attention's and the MLP's input is replicated and its
    gradient comes back from the column-parallel projections a pending sum.  It is
    reduced where the block is entered (Megatron's f: one all-reduce per block input and
    the head's), so the norm before it, and its weight's gradient, see whole values.  Left
    pending to the residual stream, each norm weight's gradient needed an all-reduce of
    its own, which FSDP2 issues one by one: dp2 x tp2 backward had 10 all-reduces, now 5
    (tp2: 6, the norms' in one bucket).  (The norm weights' gradients end whole either
    way, reduced by then; the count is what tells.)"""
    layers = PRESETS["llama-tiny"]["num_hidden_layers"]
    devices = mesh.get("dp", 1) * mesh["tp"]
    torch.distributed.init_process_group("fake", rank=0, world_size=devices, store=FakeStore())
    try:
        plan = planner.hand_plan("llama-tiny", devices=devices, profile="cpu-gloo-local", batch_size=BATCH,
                                 seq_len=SEQ, **mesh)
        executor.rng.manual_seed(SEED)
        model = executor.apply(plan, build(Case("llama")))
        ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        with Collectives() as backward:
            loss.backward()
    finally:
        torch.distributed.destroy_process_group()
        executor.rng.deactivate()
    assert backward.counts["all_reduce"] == 2 * layers + 1, backward.counts


class _AttentionSpy(TorchFunctionMode):
    """Records the query's placements of every attention call."""

    def __init__(self) -> None:
        super().__init__()
        self.placements: list[tuple[Any, ...]] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func is F.scaled_dot_product_attention and isinstance(args[0], DTensor):
            self.placements.append(tuple(args[0].placements))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("model", ["gpt2", "llama"])
def test_attention_runs_in_the_layout_the_planner_prices(model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ILP may not price attention head-sharded behind a free chunk of replicated
    q/k/v: GPT-2's split gathers them, and DTensor then runs attention replicated (the
    planner priced it 1/tp, hand tp4 of GPT-2 at 20.4 ms where it is 21.7).  Llama's
    column-parallel q/k/v arrive head-sharded, and attention runs so."""
    import planner.search

    searched: list[Any] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        searched.append(found := search(*args, **kwargs))
        return found

    search = planner.search._search
    monkeypatch.setattr(planner.search, "_search", spy)
    preset = {"gpt2": "gpt2-tiny", "llama": "llama-tiny"}[model]
    plan = planner.hand_plan(preset, devices=2, profile="cpu-gloo-local", tp=2, batch_size=BATCH, seq_len=SEQ)
    best = searched[-1].best
    (priced,) = {c.inp[-1] for key, c in best.solution.choice.items()
                 if best.units[key].kind == "anchor" and best.units[key].choices[0].weights == {}
                 and "attn" in best.units[key].module}
    torch.distributed.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        executor.rng.manual_seed(SEED)
        sharded = executor.apply(plan, build(Case(model)))
        with _AttentionSpy() as attention:
            sharded(input_ids=torch.zeros(BATCH, SEQ, dtype=torch.long))
    finally:
        torch.distributed.destroy_process_group()
        executor.rng.deactivate()
    ran = {p[-1] for p in attention.placements}
    assert ran == {Replicate() if priced == "R" else Shard(1)}, (priced, ran)
    assert priced == {"gpt2": "R", "llama": "H"}[model]


@pytest.mark.parametrize("learned", [False, True], ids=["dtensor", "local-blocks"])
def test_sequence_parallel_rowwise_outputs_are_reduce_scattered(learned: bool) -> None:
    """o_proj / down_proj leave a pending sum that the plan wants as S(1): one reduce-scatter
    each, not an all-reduce (twice the bytes) followed by a slice.  Blocks running on local
    shards (after a training step taught them) issue exactly the same collectives."""
    layers = PRESETS["llama-tiny"]["num_hidden_layers"]
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    with tp2_on_fake_group(sp=True) as model:
        if learned:
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            assert len(executor.local_regions.running_locally(model)) == layers  # whole layers
        with CommDebugMode() as comm:
            out = model(input_ids=ids, use_cache=False)
            forward = {op.__name__: n for op, n in comm.get_comm_counts().items()}
            out.logits.sum()
            out["logits"].sum()  # read again: no second gather
            read = {op.__name__: n for op, n in comm.get_comm_counts().items()}
    # per layer: gather before attention and MLP, reduce-scatter after them; then the
    # final norm's output gathered for lm_head; on the model's first call, one all-reduce
    # of the ranks' batch fingerprints (executor.data.SameBatch)
    first = {} if learned else {"allreduce_": 1}
    assert forward == {"all_gather_into_tensor": 2 * layers + 1, "reduce_scatter_tensor": 2 * layers, **first}
    # the vocab-sharded logits are gathered when the loop reads them, once
    assert read == {**forward, "all_gather_into_tensor": 2 * layers + 2}


def test_reading_the_loss_by_key_gathers_no_other_output() -> None:
    """Hugging Face's Trainer reads ``outputs["loss"]``: under data parallelism that must
    not all-gather the global batch's logits (the step's largest collective), which a
    read of ``outputs["logits"]`` does, once."""
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    with on_fake_group(Case("llama", {"dp": 2})) as model:
        out = model(input_ids=ids, labels=ids)
        with Collectives("c10d") as comm:
            loss = out["loss"]
            gathered_for_loss = comm.counts["_allgather_base_"]
            assert out["logits"].shape[0] == out.logits.shape[0] == BATCH
    assert loss.dim() == 0 and gathered_for_loss == 0 and comm.counts["_allgather_base_"] == 1


@pytest.mark.parametrize("checkpointing", ["selective", "full"])
def test_recomputation_reissues_the_collectives_the_planner_charges(checkpointing: str) -> None:
    """A checkpointed layer's recomputation runs its module hooks again, as far as its
    backward needs: per sequence-parallel layer, the gathers before attention and MLP
    and the reduce-scatter after o_proj, not the one after down_proj (only the next
    layer reads it).  planner.tracer marks exactly those (``rerun``; the planner's
    side: tests/test_planner.py::test_checkpointing_charges_the_redistributions_it_reissues)."""
    layers = PRESETS["llama-tiny"]["num_hidden_layers"]
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    backward = {}
    for mode in ("none", checkpointing):
        with tp2_on_fake_group(sp=True, checkpointing=mode) as model:
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # blocks learn
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            with Collectives() as comm:
                loss.backward()
            backward[mode] = comm.counts
    assert backward[checkpointing] - backward["none"] == {
        "all_gather_into_tensor": 2 * layers, "reduce_scatter_tensor": layers}


def test_loss_on_vocabulary_shards_gathers_no_logits() -> None:
    """With labels=, the loss runs on the column-parallel lm_head's vocabulary shards: a
    forward issues the collectives of a call without labels plus two all-reduces (the max
    logit, then the sum of exps with the target's logit, per token).  The loss's backward
    communicates nothing: test_partial_gradients_are_reduced_once_in_backward counts it."""
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    with tp2_on_fake_group(sp=True) as model:
        with CommDebugMode() as plain:
            model(input_ids=ids, use_cache=False)
        with CommDebugMode() as labelled:
            model(input_ids=ids, labels=ids, use_cache=False)
    counts = {op.__name__: n for op, n in labelled.get_comm_counts().items()}
    assert counts == {**{op.__name__: n for op, n in plain.get_comm_counts().items()}, "allreduce_": 2}


def vocab_parallel_losses() -> dict[str, tuple[float, float]]:
    """executor.loss's cross-entropy on 7 classes sharded 4 + 3 over 2 ranks, against
    torch's on the whole logits: (max |loss diff|, max |grad diff|) per call."""
    from executor.loss import _cross_entropy

    mesh = init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 7, generator=g) * 3
    target = torch.tensor([0, 6, 3, -100, 4, 2])
    out = {}
    for name, kwargs in {"mean": {}, "sum": {"reduction": "sum"}, "none": {"reduction": "none"},
                         "ignore 2": {"ignore_index": 2}, "smoothing (gathers)": {"label_smoothing": 0.1}}.items():
        if "ignore_index" in kwargs:  # -100 is then an out-of-range class
            target = torch.tensor([0, 6, 3, 2, 4, 2])
        whole = logits.clone().requires_grad_()
        expected = F.cross_entropy(whole, target, **kwargs)
        expected.sum().backward()
        sharded = DTensor.from_local(logits.chunk(2, dim=1)[mesh.get_local_rank()].clone(), mesh,
                                     [Shard(1)], run_check=False, shape=logits.shape,
                                     stride=logits.stride()).requires_grad_()
        got = _cross_entropy(sharded, DTensor.from_local(target, mesh, [Replicate()]), **kwargs)
        got.sum().backward()
        out[name] = (float((got.full_tensor() - expected).abs().max()),
                     float((sharded.grad.full_tensor() - whole.grad).abs().max()))
    # one class: torch.chunk leaves rank 1 an empty shard, which takes the gathering path
    one, zeros = torch.randn(6, 1, generator=g), torch.zeros(6, dtype=torch.long)
    local = one if mesh.get_local_rank() == 0 else one[:, :0]
    empty = DTensor.from_local(local, mesh, [Shard(1)], run_check=False, shape=one.shape,
                               stride=one.stride())
    got = _cross_entropy(empty, DTensor.from_local(zeros, mesh, [Replicate()]))
    out["empty shard (gathers)"] = (float((got.full_tensor() - F.cross_entropy(one, zeros)).abs()), 0.0)
    try:  # torch's own error, not a silent mean
        _cross_entropy(sharded, DTensor.from_local(target, mesh, [Replicate()]), reduction="avg")
    except ValueError as e:
        out["bad reduction"] = str(e)
    return out


def test_vocab_parallel_cross_entropy_is_torchs() -> None:
    """Loss and logits gradient equal torch's cross-entropy on the whole vocabulary, for
    every reduction, ignored targets, uneven and empty shards, and the gathering fallback;
    a bad reduction gets torch's error."""
    errors = run_on_ranks(2, vocab_parallel_losses)[0]
    assert "not a valid value" in errors.pop("bad reduction")
    assert len(errors) == 6
    for name, (loss_err, grad_err) in errors.items():
        assert loss_err < 1e-5 and grad_err < 1e-6, (name, loss_err, grad_err)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp-sp"])
def test_vocabulary_parallel_head_computes_its_gradients_on_its_shard(sp: bool) -> None:
    """With labels=, the column-parallel lm_head's weight gradient is a local GEMM over
    its half of the vocabulary: the loss runs on the shards (executor.loss).  Left to
    DTensor, the logits were gathered inside the loss's dispatch, and their gradient
    reached the head whole: a GEMM over the whole vocabulary."""
    ids = torch.zeros(3, SEQ, dtype=torch.long)  # 48 tokens: no model dim has that size

    def local_mm_lhs(prof: torch.profiler.profile) -> list[list[int]]:
        def wraps_mm(e: Any) -> bool:  # DTensor's record of a GEMM wraps the local one
            return any(c.name == "aten::mm" or wraps_mm(c) for c in e.cpu_children)
        return [e.input_shapes[0] for e in prof.events() if e.name == "aten::mm" and not wraps_mm(e)]

    with tp2_on_fake_group(sp) as model:
        vocab = model.config.vocab_size
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()  # blocks learn
        with torch.profiler.profile(record_shapes=True) as prof:
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    lhs = local_mm_lhs(prof)
    assert [vocab // 2, ids.numel()] in lhs
    assert [vocab, ids.numel()] not in lhs


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp-sp"])
def test_partial_gradients_are_reduced_once_in_backward(sp: bool) -> None:
    """Norm weights and the embedding (replicated, activations split) get Partial
    gradients; apply reduces them once per backward, all in one all-reduce when the
    backward ends, so AdamW's step issues no collective (DTensor would otherwise reduce
    one per read, three per tensor)."""
    layers = PRESETS["llama-tiny"]["num_hidden_layers"]
    with tp2_on_fake_group(sp) as model:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        with CommDebugMode() as backward:
            loss.backward()
        partial = [n for n, p in model.named_parameters()
                   if any(pl.is_partial() for pl in p.grad.placements)]
        with CommDebugMode() as comm:
            opt.step()
    assert partial == []
    assert comm.get_total_counts() == 0
    # without SP, each attention / MLP block's input gradient is all-reduced (Megatron's
    # f); the 2 * layers + 1 norm weights and the embedding's gradients: one all-reduce
    reduces = {op.__name__: n for op, n in backward.get_comm_counts().items()}["all_reduce"]
    assert reduces == (0 if sp else 2 * layers) + 1


@pytest.mark.parametrize("dim", [0, 1], ids=["batch-sharded", "head-sharded"])
def test_attention_dropout_on_local_shards_is_the_single_device_slice(dim: int) -> None:
    """q, k, v sharded alike on batch or heads attend as plain local tensors (no DTensor
    dispatch), and the dropout mask is still drawn for the shard's place in the global
    scores: rank 1's output is bitwise the matching slice of the one-device result,
    grouped-query attention included."""
    with executor.rng.suspended():
        g = torch.Generator().manual_seed(0)
        q = torch.randn(2, 4, 8, 8, generator=g)
        k, v = torch.randn(2, 2, 8, 8, generator=g), torch.randn(2, 2, 8, 8, generator=g)
    attend = {"dropout_p": 0.5, "is_causal": True, "enable_gqa": True}
    try:
        executor.rng.manual_seed(SEED)
        reference = F.scaled_dot_product_attention(q, k, v, **attend)
        torch.distributed.init_process_group("fake", rank=1, world_size=2, store=FakeStore())
        mesh = init_device_mesh("cpu", (2,))
        executor.rng.manual_seed(SEED)
        shards = [DTensor.from_local(t.chunk(2, dim)[1], mesh, [Shard(dim)], run_check=False)
                  for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*shards, **attend)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        executor.rng.deactivate()
    assert out.placements == (Shard(dim),)
    assert torch.equal(out.to_local(), reference.chunk(2, dim)[1])


def test_micro_batches_run_inside_the_models_call() -> None:
    """The planner raises micro-batches until activations fit; without pipeline stages
    apply used to run each call on the whole batch (the step then needed the memory of
    all parts).  A training call from labels= now runs the parts (the N-rank cases above
    check their values against one device); other calls run the batch whole."""
    plan = planner.hand_plan("llama-tiny", devices=1, profile="cpu-gloo-local", microbatches=2,
                             batch_size=BATCH, seq_len=SEQ)
    model = executor.apply(plan, build(Case("llama")))
    rows: list[int] = []
    model.model.embed_tokens.register_forward_hook(lambda m, args, out: rows.append(args[0].shape[0]))
    ids = batches(Case("llama"))[0][0]
    loss = model(input_ids=ids, labels=ids).loss
    assert rows == [BATCH // 2] * 2 and model.lm_head.weight.grad is None  # held until loss.backward()
    loss.backward()
    assert model.lm_head.weight.grad is not None
    with pytest.raises(RuntimeError, match=r"^loss\.backward\(\): the model's forward already ran this step's"):
        loss.backward()  # a second backward would scale the gradients again
    with torch.no_grad():
        model(input_ids=ids, labels=ids)
    with pytest.warns(UserWarning, match=r"^plan\.microbatches: 2 parts run inside the model's call only when "
                                         r"it trains from labels="):
        model(input_ids=ids)
    assert rows[2:] == [BATCH, BATCH]
    embeds = model.model.embed_tokens(ids).detach().requires_grad_()  # a soft prompt the loop trains
    with pytest.warns(UserWarning, match=r"\(an input that requires grad\) runs its whole batch"):
        out = model(inputs_embeds=embeds, labels=ids)
    (out.loss / 2).backward()  # its gradient is the loss's / 2 (the parts' backward did not scale it)
    with pytest.raises(executor.PlanError, match="executor.apply already ran on this model"):
        executor.apply(plan, model)  # it would run each part in parts
    with pytest.raises(executor.BatchError, match=r"^batch: the global batch 7 does not split into microbatches=2 "
                                                  r"\(the plan's micro-batch count\) x 1 data-parallel ranks$"):
        model(input_ids=ids[:7], labels=ids[:7])
    model.requires_grad_(False)  # nothing to backpropagate (a frozen phase): one forward, the loss
    assert model(input_ids=ids, labels=ids).loss.item() == pytest.approx(loss.item(), rel=1e-6)


def test_micro_batches_of_a_model_whose_loss_is_the_loops_are_left_to_the_loop() -> None:
    case = Case("mlp")
    model = build(case)
    plan = make_plan(model, {"dp": 1}, microbatches=2)
    with pytest.warns(UserWarning, match=r"^plan\.microbatches: 2 \(gradient accumulation\) is the loop's to do "
                                         r"for a model that is not a Hugging Face causal LM"):
        executor.apply(plan, model)


@pytest.mark.parametrize("checkpointing", ["full", "selective"])
def test_a_one_device_plan_checkpoints_as_it_says(checkpointing: str) -> None:
    """A 1-device plan's memory assumes its checkpointing (the planner picks it to fit one
    device as on many): apply recomputes the blocks, and the losses and gradients are the
    plain model's."""
    def step(ac: str) -> tuple[float, dict[str, torch.Tensor], int]:
        executor.rng.manual_seed(SEED)
        model = build(Case("llama", dropout=0.1))
        plan = make_plan(model, {"dp": 1}, checkpointing=ac)
        model = executor.apply(plan, model)
        calls: list[int] = []
        model.model.layers[0].mlp.act_fn.register_forward_hook(lambda m, a, o: calls.append(1))
        ids = batches(Case("llama"))[0][0]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.item(), {n: p.grad for n, p in model.named_parameters()}, len(calls)

    plain_loss, plain_grads, plain_calls = step("none")
    loss, grads, calls = step(checkpointing)
    assert (plain_calls, calls) == (1, 2)  # the block's forward runs again in backward
    assert loss == plain_loss
    for n, g in grads.items():
        torch.testing.assert_close(g, plain_grads[n], rtol=1e-6, atol=1e-7, msg=n)
    model = build(Case("llama"))
    plan = make_plan(model, {"dp": 1}, checkpointing=checkpointing)
    with pytest.raises(executor.PlanError, match="executor.apply already ran on this model"):
        executor.apply(plan, executor.apply(plan, model))  # torch's checkpoint refused a second wrap


@pytest.mark.skipif(torch.cuda.is_available(), reason="tests/test_cuda.py covers a machine with CUDA")
def test_a_one_device_gpu_plan_runs_on_the_cpu_without_cuda() -> None:
    """The single-device reference of a GPU plan on a CPU-only machine: the model stays
    on the CPU (where CUDA exists, tests/test_cuda.py checks it moves to the GPU)."""
    plan = planner.hand_plan("llama-tiny", devices=1, profile="h100-sxm-80g", batch_size=BATCH, seq_len=SEQ)
    assert plan.mesh.device_type == "cuda"
    executor.rng.manual_seed(SEED)
    model = executor.apply(plan, build(Case("llama", meta=True)))
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    ids = batches(Case("llama"))[0][0]
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)


# tests/test_architectures.py's cases whose plans the lays-out test below checks under
# their layout and dp 2 x tp 2, and the counts (laid out, issued) where those differ, as
# found and not fixed: OLMo 2 and 3 under sequence parallelism, whose first layer reads
# the embedding's pending sum with its q/k/v projections and its residual add: the plan
# prices an all-reduce for the one and a reduce-scatter for the other, the executor issues
# the all-reduce only; low-rank attention (YouTu: one all-gather per layer at its rotary
# key's in-place copy, which the plan prices in backward only); Apertus (xIELU's two
# scalar parameters per layer priced as pending gradients one by one; the executor
# reduces them otherwise); BitNet, where the plan gathers the gate and up products for the
# segment that holds their product and the sub-norm, and the executor gathers the product
# once, at the norm (planner.search._settled leaves it so: the executor's way is the
# cheaper).
LAID_OUT_CASES = ("gemma", "cohere", "phi3", "persimmon", "bitnet", "olmo2", "youtu", "apertus", "gpt-bigcode",
                  "bloom", "mpt", "phi", "olmo3", "nanochat", "gemma4", "cohere-compass")
# planned / issued communication seconds under the bandwidth-only profile, to 1%
KNOWN_MISPRICED = {
    "bitnet {'dp': 2, 'tp': 2, 'sp': True, 'fsdp': True}": 1.14, "bitnet {'dp': 2, 'tp': 2}": 1.1,
    "olmo2 {'dp': 2, 'tp': 2, 'sp': True, 'fsdp': True}": 1.02,
    "olmo3 {'dp': 2, 'tp': 2, 'sp': True, 'fsdp': True}": 0.99, "olmo3 {'dp': 2, 'tp': 2}": 0.98,
    "youtu {'dp': 2, 'tp': 2, 'sp': True, 'fsdp': True}": 0.95, "youtu {'dp': 2, 'tp': 2}": 0.94,
    "gemma4 {'dp': 2, 'tp': 2, 'sp': True, 'fsdp': True}": 0.99, "gemma4 {'dp': 2, 'tp': 2}": 0.99,
}
KNOWN_MISCOUNTS = {
    "youtu {'dp': 2, 'tp': 2, 'sp': True, 'fsdp': True}": (97, 101), "youtu {'dp': 2, 'tp': 2}": (34, 38),
    "bitnet {'dp': 2, 'tp': 2, 'sp': True, 'fsdp': True}": (109, 101), "bitnet {'dp': 2, 'tp': 2}": (46, 42),
}


def test_the_planned_step_lays_out_the_collectives_the_executor_issues() -> None:
    """``planner.timeline`` charges each collective of a step by the compute before it,
    and the ILP prices the same resharding, so a plan must lay out the collectives the
    executor issues (``_dist.laid_out_and_issued``): for the fidelity bench's Llama and
    layouts, the tiny presets, and ``LAID_OUT_CASES``, on one fake process group of 4.
    Counts miss a collective of the wrong size or kind, so the plan's communication
    seconds are also compared with the issued collectives priced by the same model, on
    a profile of bus bandwidth only (to 1%: ``KNOWN_MISPRICED`` holds the others).
    (Run after the other tests here, it failed with "Could not resolve the process group
    registered under the name 3" until ``executor.apply`` cleared DTensor's sharding
    propagation cache with each new default group: see ``_build_mesh``.)  What the cases
    found, laid out against issued, before the fix:

    * the embedding's all-reduce counted once per instance of the first layer (bench TP:
      21 against 20);
    * the loss priced gathered where the executor runs it vocabulary-parallel
      (llama-tiny dp 2 x tp 2: 15 against 16);
    * Gemma's norm weights (``1 + weight``, computed outside the units) priced as
      pending gradients (dp 2 x tp 2: 35 against 26);
    * a parallel block's MLP converting its input again after the attention (Cohere
      under its layout: 49 against 57; the executor now converts it once);
    * a fused q/k/v product gathered for each of its three slices (Phi-3 dp 2 x tp 2:
      42 against 50; the plan now has the projection hand it over gathered once);
    * GPT-2's replicated position embeddings cut by sequence by DTensor inside the
      residual stream's segment, whose gradient then stayed cut (the weight's reduced
      with the norms') where the plan priced its all-gather (tp 4 with sp: 28 against
      27; the embedding now hands them over cut, as priced);
    * MPT's layers, in ``transformer.blocks``, unknown to the tracer: 2 of its 4 layers
      traced and priced (dp 2 x tp 2: 18 against 34);
    * the embedding's output, read by OLMo 2's q/k/v projections and its residual add,
      redistributed once per consumer layout and gradient kind (twice) where the executor
      converts it once, and the all-reduce of its Partial gradient not priced;
    * a repeated layer's output laid out and priced as often as its producer runs, for
      every consumer: the last traced layer's to the final norm ``w`` times, and no layer
      input for the later instances of the first traced layer (OLMo 2 dp 2 x tp 2: 41
      against 42, after the embedding's fix);
    * GPT-BigCode's multi-query ``c_attn`` output, unsqueezed to ``[b, 1, s, f]`` before
      its split, where the plan's feature layout named the one-head dim: the split's
      gather was not priced (dp 2 x tp 2: 26 against 34);
    * BLOOM's eager ALiBi attention, which folds the heads into the batch: DTensor
      gathers q, k and v there, the plan priced it split by heads (dp 2 x tp 2: 26
      against 54; the plan now has its fused q/k/v gathered once, 34 against 34);
    * Apertus' layers run on local shards on the fake group only, whose check cannot
      compare values, without the all-reduces of the xIELU scalars' gradients that
      DTensor makes inside them (dp 2 x tp 2: 42 laid out against 34; a real gloo group
      issued 42; the fake group's check now compares the collectives each run issues);
    * OLMo 2's embedding output under sequence parallelism, read replicated by q/k/v and
      by sequence by the residual add: the executor all-reduces it once and slices the
      add's share, the plan priced a reduce-scatter besides (101 against 100;
      ``ilp.summed_first``);
    * (priced, not counted) an MLP region's first projection, under sequence
      parallelism, took the MLP's gathered input for a fresh replicated one in the
      region's recording, which runs on copies, and added an all-reduce of its gradient
      where the gather's backward reduce-scatters it (Persimmon under its layout: the
      plan priced 0.94 of the issued; ``local_regions.original``);
    * (priced, not counted) GPT-2's position embeddings, ``[1, s, h]`` whatever the
      batch, priced as if their first dim were the batch (traced at 1, scaled to the
      micro-batch): their gradient's all-gather 8 times too large (gpt2-tiny tp 4 with
      sp: 1.03; ``ilp._batched``).

    ``KNOWN_MISCOUNTS`` holds those not fixed, so that a change to either side shows here."""
    from test_architectures import CASES, _config

    from bench.costmodel_fidelity import BATCH, MODEL, SEQ

    dp_tp = {"dp": 2, "tp": 2}
    cases = [("bench", MODEL, layout, BATCH, SEQ) for layout in (
        {"dp": 4}, {"dp": 4, "fsdp": True}, {"tp": 4}, {"tp": 4, "sp": True}, dp_tp,
        {"dp": 2, "tp": 2, "sp": True, "fsdp": True})]
    cases += [("llama-tiny", "llama-tiny", dp_tp, 8, 32), ("gpt2-tiny", "gpt2-tiny", {"tp": 4}, 8, 32),
              ("gpt2-tiny", "gpt2-tiny", {"tp": 4, "sp": True}, 8, 32)]
    cases += [(name, _config(name), layout, 8, 16) for name in LAID_OUT_CASES for layout in (CASES[name][2], dp_tp)]
    counts, seconds = {}, {}
    torch.distributed.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        for name, config, layout, batch, seq in cases:
            laid, issued, planned_s, issued_s = laid_out_and_issued(config, layout, batch, seq)
            counts[f"{name} {layout}"] = (laid, issued)
            seconds[f"{name} {layout}"] = round(planned_s / issued_s, 2)
    finally:
        torch.distributed.destroy_process_group()
    assert {k: v for k, v in counts.items() if v[0] != v[1]} == KNOWN_MISCOUNTS, counts
    assert {k: v for k, v in seconds.items() if v != 1.0} == KNOWN_MISPRICED, seconds
