"""executor.deferred_init: meta model -> sharded model, bitwise equal to a 1-device init.

4 gloo ranks are spawned once; each materialises the same meta-device tiny Llama
under several layouts and returns its local shards, which this process (no
process group) compares with the model built for real on CPU.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from _dist import run_on_ranks
from torch import nn
from transformers import GPT2Config, LlamaConfig

from executor import rng
from executor.deferred_init import materialize, register_init_draws
from planner.presets import build_model, load_config

SEED = 4321
LLAMA = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=100,  # init zeroes this row of the embedding: in rank 3's shard under Shard(0)
)
GPT2 = dict(vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=2)  # tied lm_head


@pytest.fixture(autouse=True, scope="module")
def _interception_off_afterwards() -> Iterator[None]:
    yield
    rng.deactivate()


def _reference(config: dict, model_type: str) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    cfg = LlamaConfig(**config) if model_type == "llama" else GPT2Config(**config)
    rng.manual_seed(SEED)
    model = build_model(cfg, "cpu")
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, rng.get_state()


class _IndexedInit(nn.Module):
    """An init that writes through indexes of its weight, as nn.Embedding's padding row."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(10, 6))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)
        with torch.no_grad():
            self.weight[1:9:3].fill_(2.0)  # rows 1, 4 and 7: in three of the shards
            self.weight[-2] = 0.5  # an assignment, into the last full shard
            self.weight[..., 2:4][5:].mul_(3.0)  # a column slice (a view), then rows of it
            self.weight[6][1:3].zero_()  # a row (a copy under Shard(0)), then a slice of that copy


def _indexed(device: str) -> nn.Module:
    with torch.device(device):
        return _IndexedInit()


# ----------------------------------------------------------------------------- rank side

LAYOUTS = ("S0", "S1", "2d", "gpt2")


def _rank_cases() -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh1 = init_device_mesh("cpu", (4,))
    mesh2 = init_device_mesh("cpu", (2, 2))

    def layout(name: str, meta: nn.Module):
        shapes = {n: t.shape for n, t in meta.named_parameters()}

        def placements(fqn: str):
            if fqn not in shapes:
                return None  # buffers (rotary inv_freq) stay plain tensors
            ndim = len(shapes[fqn])
            if name == "2d":
                return mesh2, [Shard(0), Shard(1) if ndim > 1 else Replicate()]
            if name == "S1" and ndim > 1:
                return mesh1, [Shard(1)]
            return mesh1, [Shard(0)]

        return placements

    results: dict = {"rank": dist.get_rank()}
    for name, mesh, places in (("indexed-S0", mesh1, [Shard(0)]), ("indexed-2d", mesh2, [Shard(0), Shard(1)])):
        meta = materialize(_indexed("meta"), lambda fqn, mesh=mesh, places=places: (mesh, places), seed=SEED)
        weight = meta.weight
        _, offset = compute_local_shape_and_global_offset(weight.shape, weight.device_mesh, weight.placements)
        results[name] = (weight.to_local().clone(), tuple(offset))
    for name in LAYOUTS:
        model_type, config = ("gpt2", GPT2) if name == "gpt2" else ("llama", LLAMA)
        cfg = LlamaConfig(**config) if model_type == "llama" else GPT2Config(**config)
        rng.manual_seed(99)  # a different stream before building: materialize's seed must win
        meta = build_model(cfg, "meta")
        materialize(meta, layout(name, meta), seed=SEED)
        shards = {}
        for fqn, t in meta.state_dict().items():
            if hasattr(t, "to_local"):
                _, offset = compute_local_shape_and_global_offset(
                    t.shape, t.device_mesh, t.placements
                )
                shards[fqn] = (t.to_local().clone(), tuple(offset), tuple(t.shape))
            else:
                shards[fqn] = (t.clone(), (0,) * t.dim(), tuple(t.shape))
        tied = meta.lm_head.weight is meta.get_input_embeddings().weight
        results[name] = (shards, rng.get_state(), tied)
    return results


@pytest.fixture(scope="module")
def rank_results() -> list[dict]:
    return run_on_ranks(4, _rank_cases)


# ----------------------------------------------------------------------------- checks


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sharded_init_equals_single_device(rank_results: list[dict], layout: str) -> None:
    model_type, config = ("gpt2", GPT2) if layout == "gpt2" else ("llama", LLAMA)
    expected, state = _reference(config, model_type)
    for res in rank_results:
        shards, rank_state, tied = res[layout]
        assert rank_state == state  # training draws continue from the same counter
        assert tied == (layout == "gpt2")
        assert set(shards) == set(expected)
        for fqn, (local, offset, shape) in shards.items():
            box = tuple(slice(o, o + n) for o, n in zip(offset, local.shape, strict=True))
            assert shape == tuple(expected[fqn].shape), fqn
            assert torch.equal(local, expected[fqn][box]), f"rank {res['rank']} {layout} {fqn}"


@pytest.mark.parametrize("layout", ["indexed-S0", "indexed-2d"])
def test_init_writes_through_an_index_reach_the_shard_that_holds_them(rank_results: list[dict],
                                                                      layout: str) -> None:
    """DTensor answers an index on a sharded dim with a gathered copy; materialize writes
    what the init does to it back into the shards (the padding row above is one case)."""
    rng.manual_seed(SEED)
    expected = _indexed("cpu").weight.detach()
    assert expected[4].eq(2.0).all() and expected[8, :2].eq(0.5).all() and expected[6, 1:3].eq(0).all()
    for res in rank_results:
        local, offset = res[layout]
        box = tuple(slice(o, o + n) for o, n in zip(offset, local.shape, strict=True))
        assert torch.equal(local, expected[box]), f"rank {res['rank']} {layout}"


def test_no_rank_holds_a_full_sharded_parameter(rank_results: list[dict]) -> None:
    for res in rank_results:
        shards, _, _ = res["S0"]
        weight, _, shape = shards["model.layers.0.mlp.up_proj.weight"]
        assert weight.shape == (shape[0] // 4, shape[1])


def test_single_process_materialize_and_native_rng_independence() -> None:
    """Plain tensors (no mesh): same values; torch's own seed has no influence on them."""
    expected, state = _reference(LLAMA, "llama")
    rng.manual_seed(SEED)
    torch.manual_seed(12345)  # if any init draw used torch's generator, values would change
    model = build_model(LlamaConfig(**LLAMA), "cpu")
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())
    rng.manual_seed(SEED)
    meta = build_model(LlamaConfig(**LLAMA), "meta")
    materialize(meta)  # seed defaults to the last manual_seed
    assert all(torch.equal(v, expected[k]) for k, v in meta.state_dict().items())
    assert rng.get_state() == state


def test_a_meta_model_equals_the_cpu_build_at_the_same_point_of_the_stream() -> None:
    """Draws between the seed call and building the model: materialize replays from
    where building the meta model began drawing, as the CPU build would have drawn (it
    restarted at the seed, redoing the earlier draws' counters)."""
    rng.manual_seed(SEED)
    first = torch.rand(3)
    cpu = build_model(LlamaConfig(**LLAMA), "cpu")
    after_cpu = torch.rand(2)
    rng.manual_seed(SEED)
    assert torch.equal(torch.rand(3), first)
    meta = materialize(build_model(LlamaConfig(**LLAMA), "meta"))
    assert all(torch.equal(v, cpu.state_dict()[k]) for k, v in meta.state_dict().items())
    assert torch.equal(torch.rand(2), after_cpu)


@pytest.mark.parametrize("config", [
    {"model_type": "qwen3_5_text", "layer_types": ["linear_attention", "full_attention"]},
    {"model_type": "olmo_hybrid", "layer_types": ["linear_attention", "full_attention"]},
    {"model_type": "qwen3_next", "layer_types": ["linear_attention", "full_attention"], "num_experts": 4,
     "num_experts_per_tok": 2, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16},
    {"model_type": "apertus"},
], ids=lambda c: c["model_type"])
def test_modules_that_draw_in_their_init_build_as_on_cpu(config: dict) -> None:
    """Gated DeltaNet draws A (and OLMo Hybrid's dt) in ``__init__``, outside
    ``reset_parameters``, which a meta build skips: every later draw of the model came
    out shifted, the same on every rank, so the tests that compare ranks with a meta
    build on one device could not see it.  Apertus' xIELU sets constants there."""
    config = load_config({**config, "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
                          "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                          "head_dim": 8, "linear_conv_kernel_dim": 4, "linear_key_head_dim": 8,
                          "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                          "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": None})
    rng.manual_seed(SEED)
    cpu = build_model(config, "cpu").state_dict()
    meta = materialize(build_model(config, "meta"), seed=SEED).state_dict()
    assert cpu.keys() == meta.keys()
    assert [k for k, v in meta.items() if not torch.equal(v, cpu[k])] == []


class _DrawsInInit(nn.Module):
    """Draws in __init__ (not reset_parameters) and has a buffer nothing initialises."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(4, 3))
        nn.init.uniform_(self.weight)
        self.register_buffer("table", torch.arange(3.0))


def test_unwritten_tensors_are_named_and_registered_draws_replay() -> None:
    rng.manual_seed(SEED)
    reference = nn.Sequential(nn.Linear(3, 4), _DrawsInInit())
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(3, 4), _DrawsInInit())
    with pytest.raises(ValueError, match=r"1\.weight, 1\.table"):
        materialize(meta, seed=SEED)

    register_init_draws(
        _DrawsInInit, lambda m: (nn.init.uniform_(m.weight), m.table.copy_(torch.arange(3.0)))
    )
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(3, 4), _DrawsInInit())
    materialize(meta, seed=SEED)
    for (name, got), want in zip(
        meta.state_dict().items(), reference.state_dict().values(), strict=True
    ):
        assert torch.equal(got, want), name


def test_bad_placements_are_reported_with_the_fqn() -> None:
    with torch.device("meta"):
        meta = nn.Linear(3, 4)
    with pytest.raises(
        TypeError, match=r"placements\('weight'\) must return \(DeviceMesh, placements\)"
    ):
        materialize(meta, lambda fqn: ("not a mesh", []), seed=SEED)
