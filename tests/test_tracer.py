"""Tracer: real torch.export graphs of every preset, FLOPs, repetition, bad configs."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from planner import ConfigError, trace
from planner.presets import PRESETS, build_model, load_config
from planner.tracer import layer_signature, totals


@pytest.fixture(scope="module")
def graphs():
    out = {}
    for name in PRESETS:
        seq = 64 if name.endswith("tiny") else 512
        out[name] = trace(name, 1, seq)
    return out


def test_every_preset_traces(graphs):
    for name, g in graphs.items():
        t = totals(g)
        config = load_config(name)
        layers = getattr(config, "num_hidden_layers", None) or config.n_layer
        assert g.graph["layers"] == layers, name
        assert g.graph["traced_layers"] == min(layers, 2), name
        assert t["nodes"] > g.number_of_nodes() * 0.5, name
        assert t["train_flops"] > 0
        ops = {d["short"] for _, d in g.nodes(data=True) if d["kind"] == "call_function"}
        assert "scaled_dot_product_attention" in ops, name
        params = [d["params"] for _, d in g.nodes(data=True) if d.get("params")]
        assert params, f"{name}: no parameter inputs recorded"


def test_mixtral_routing_ops_are_traced(graphs):
    ops = {d["short"] for _, d in graphs["mixtral-8x7b"].nodes(data=True) if d["kind"] == "call_function"}
    assert {"topk", "softmax", "grouped_mm"} <= ops  # HF's fallback op in an fp32 trace


def test_node_metadata(graphs):
    g = graphs["llama3-8b"]
    q = [d for _, d in g.nodes(data=True) if d.get("module") == "model.layers.0.self_attn.q_proj"]
    assert len(q) == 1
    q = q[0]
    assert q["op"] == "aten.linear.default"
    assert q["params"] == {1: "model.layers.0.self_attn.q_proj.weight"}
    assert q["in_shapes"][0] == (1, 512, 4096) and q["shape"] == (1, 512, 4096)
    assert q["fwd_flops"] == 2 * 512 * 4096 * 4096
    assert q["bwd_flops"] == 2 * q["fwd_flops"]
    assert q["layer"] == 0 and q["bytes"] > 0


def test_repeated_layers_are_identical(graphs):
    g = graphs["llama3-70b"]
    prefix = g.graph["layer_prefix"]
    assert prefix == "model.layers"
    assert layer_signature(g, 0, prefix) == layer_signature(g, 1, prefix)
    assert len(layer_signature(g, 0, prefix)) > 20


def test_llama3_8b_training_flops_match_6nt_plus_attention():
    seq = 4096
    g = trace("llama3-8b", 1, seq)
    config = load_config("llama3-8b")
    h, layers = config.hidden_size, config.num_hidden_layers
    n_params = sum(math.prod(s) for s in g.graph["param_shapes"].values())
    n_matmul = n_params - config.vocab_size * h  # the input embedding is a lookup, not a matmul
    # 12 * layers * seq * hidden per token for attention, halved for causal kernels
    expected = 6 * n_matmul * seq + 6 * layers * seq * h * seq
    assert totals(g)["train_flops"] == pytest.approx(expected, rel=0.02)


@pytest.mark.parametrize(("config", "sliding"), [
    ({"model_type": "mistral", "sliding_window": 16}, 1.0),  # every layer once sliding_window is set
    # Ministral's layer_types: Mistral's code builds one sliding mask for every layer all the same
    ({"model_type": "mistral", "layer_types": ["sliding_attention", "full_attention"] * 6}, 1.0),
    ({"model_type": "gemma3_text", "sliding_window": 16, "head_dim": 8}, 10 / 12),  # five local to one global
    ({"model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 6}, 0.5),  # layers 6 to 11
    # the types added in session 24 that pick each layer's mask by its layer_types entry
    *[({"model_type": t, "head_dim": 8, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": None,
        "layer_types": ["sliding_attention", "full_attention"] * 6}, 0.5) for t in ("ministral", "exaone4")],
    ({"model_type": "smollm3", "use_sliding_window": True, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": None,
      "layer_types": ["sliding_attention", "full_attention"] * 6}, 0.5),
    ({"model_type": "qwen2_moe", "use_sliding_window": True, "max_window_layers": 6, "num_experts": 4,
      "num_experts_per_tok": 2, "moe_intermediate_size": 32}, 0.25),  # the even layers below 6: 0, 2, 4
    ({"model_type": "phimoe", "num_local_experts": 4, "num_experts_per_tok": 2}, 1.0),  # one mask, as Mixtral
    # and those of session 40
    *[({"model_type": t, "head_dim": 8, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": None,
        "layer_types": ["sliding_attention", "full_attention"] * 6}, 0.5) for t in ("olmo3", "cohere2", "cwm")],
    ({"model_type": "mellum", "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
      "layer_types": ["sliding_attention", "full_attention"] * 6}, 0.5),
    ({"model_type": "exaone_moe", "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "n_group": 2,
      "topk_group": 1, "moe_intermediate_size": 16, "layer_types": ["sliding_attention", "full_attention"] * 6}, 0.5),
    # Dots1's layers slide from max_window_layers on: none of them, by default (62 of 62)
    ({"model_type": "dots1", "head_dim": 8, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2,
      "topk_group": 1, "moe_intermediate_size": 16, "n_shared_experts": 1, "max_window_layers": 12}, 0.0),
    ({"model_type": "dots1", "head_dim": 8, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2,
      "topk_group": 1, "moe_intermediate_size": 16, "n_shared_experts": 1, "max_window_layers": 9}, 0.25),
])
def test_sliding_window_attention_is_priced_as_the_masked_kernel_runs_it(config: dict, sliding: float) -> None:
    """From a sequence as long as the window, Hugging Face hands SDPA the window's mask and
    the kernel computes every block: a sliding layer's attention costs twice the causal
    half (priced as full causal attention before, and the README said overpriced)."""
    def attention_flops(seq: int, window: int) -> float:
        g = trace({**LLAMA, "num_hidden_layers": 12, **config, "sliding_window": window}, 1, seq)
        return sum(d["fwd_flops"] for _, d in g.nodes(data=True) if d.get("short") == "scaled_dot_product_attention")

    causal = attention_flops(32, 64)  # the window is longer than the sequence
    assert attention_flops(32, 16) == pytest.approx(causal * (1 + sliding))
    assert attention_flops(32, 32) == pytest.approx(causal * (1 + sliding))  # as long as the window


def test_a_kind_of_layer_is_priced_at_its_own_share_of_sliding_layers() -> None:
    """Qwen2-MoE's dense layers (``mlp_only_layers``) are one kind, its MoE layers another,
    each traced twice: a traced layer's sliding share is its kind's, not every layer's
    (the dense layers here all full, the MoE ones 3 of 4 sliding: 0.5 for all before)."""
    types = ["full_attention"] * 2 + ["sliding_attention"] * 3 + ["full_attention"]
    config = {**LLAMA, "model_type": "qwen2_moe", "num_hidden_layers": 6, "num_experts": 4, "num_experts_per_tok": 2,
              "moe_intermediate_size": 16, "mlp_only_layers": [0, 1], "use_sliding_window": True,
              "sliding_window": 8, "layer_types": types}
    g = trace(config, 1, 16)
    assert g.graph["layer_weights"] == [1, 1, 2, 2]
    flops = {d["layer"]: d["fwd_flops"] for _, d in g.nodes(data=True)
             if d.get("short") == "scaled_dot_product_attention"}
    assert flops[2] == pytest.approx(flops[0] * 1.75) and flops[1] == flops[0] and flops[3] == flops[2]


def test_hf_module_input():
    model = build_model(load_config("llama-tiny"), "meta")
    g = trace(model, 1, 16)
    assert g.graph["layers"] == 2 and g.graph["model"] == "LlamaForCausalLM"


LLAMA, GPT2 = PRESETS["llama-tiny"], PRESETS["gpt2-tiny"]
# Tiny configs that leave the rest to transformers' defaults, as a user's may
HELIUM = {"model_type": "helium", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "vocab_size": 128, "intermediate_size": 128, "head_dim": 16}
DEEPSEEK = {**{k: v for k, v in HELIUM.items() if k != "head_dim"}, "model_type": "deepseek_v3"}
ERNIE_MOE = {**LLAMA, "model_type": "ernie4_5_moe", "head_dim": 8, "moe_intermediate_size": 32, "moe_num_experts": 4,
             "moe_layer_start_index": 1, "tie_word_embeddings": False}
DEEPSEEK_V2 = {**LLAMA, "model_type": "deepseek_v2", "num_key_value_heads": 4, "n_routed_experts": 4,
               "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 16, "qk_rope_head_dim": 4,
               "qk_nope_head_dim": 4, "v_head_dim": 8, "kv_lora_rank": 16, "q_lora_rank": 16}
GPTJ = {"model_type": "gptj", "vocab_size": 128, "n_embd": 32, "n_layer": 2, "n_head": 4, "rotary_dim": 4}
DEEPSEEK_MOE = {**DEEPSEEK, "num_key_value_heads": 4, "first_k_dense_replace": 0, "n_routed_experts": 8,
                "num_experts_per_tok": 2, "moe_intermediate_size": 16, "n_group": 4}


@pytest.mark.parametrize(
    "config, field, says",
    [
        ({"model_type": "bert", "hidden_size": 8}, "model_type", "'bert' is not supported"),
        ({"hidden_size": 8}, "model_type", "missing from the config (supported: "),
        ({"model_type": "gemma3", "text_config": {"model_type": "gemma3_text", "hidden_size": 2560,
                                                   "num_hidden_layers": 34}}, "model_type",
         "its text_config is a gemma3_text config: give that object to plan the language model alone, adding "
         "num_attention_heads, vocab_size, which it leaves to transformers' defaults (num_attention_heads=8, "
         "vocab_size=262208)"),
        ({**LLAMA, "hidden_size": -4}, "hidden_size", "must be a positive integer, got -4"),
        ({**LLAMA, "num_hidden_layers": 0}, "num_hidden_layers", "must be a positive integer, got 0"),
        ({**LLAMA, "hidden_size": 10**7}, "hidden_size", "beyond the sanity limit"),
        ({**LLAMA, "vocab_size": "big"}, "vocab_size", "must be a positive integer, got 'big'"),
        ({k: v for k, v in LLAMA.items() if k != "num_attention_heads"}, "num_attention_heads", "missing"),
        ({**LLAMA, "num_key_value_heads": 3}, "num_key_value_heads", "does not divide"),
        # null sizes: a TypeError in the divisibility check, or transformers' truncated message
        ({**LLAMA, "hidden_size": None}, "hidden_size", "must be a positive integer, got None"),
        ({**LLAMA, "num_attention_heads": None}, "num_attention_heads", "must be a positive integer, got None"),
        ({**LLAMA, "intermediate_size": None}, "intermediate_size", "must be a positive integer, got None"),
        ({**GPT2, "n_embd": None}, "n_embd", "must be a positive integer, got None"),
        ({**GPT2, "n_embd": 30}, "n_embd", "30 is not divisible by n_head 4"),
        # a KeyError from transformers' registries, or a message that names nothing
        ({**LLAMA, "hidden_act": "nosuchact"}, "hidden_act", "unknown activation 'nosuchact'"),
        ({**GPT2, "activation_function": "nosuchact"}, "activation_function", "ACT2FN has: "),
        ({**LLAMA, "rope_parameters": {"rope_type": "nonsense"}}, "rope_parameters.rope_type",
         "unknown RoPE type 'nonsense' (supported: default, "),
        ({**LLAMA, "rope_scaling": {"type": "nonsense"}}, "rope_scaling.type", "unknown RoPE type"),
        # an AttributeError of torch's (HTTP 500 until session 18), or passed through unchecked
        ({**LLAMA, "torch_dtype": "float8"}, "torch_dtype", "got 'float8'"),
        ({**LLAMA, "dtype": "Tensor"}, "dtype", "floating-point torch dtype"),
        ({**GPT2, "torch_dtype": 5}, "torch_dtype", "got 5"),
        ({**LLAMA, "rope_scaling": {"rope_type": "llama3"}}, "rope_scaling", "Missing required keys"),
        ({**LLAMA, "head_dim": 7}, "head_dim", "RoPE requires an even rotary dimension"),
        # accepted before, and the plan silently used the default sequence length
        ({**LLAMA, "max_position_embeddings": 0}, "max_position_embeddings", "must be a positive integer, got 0"),
        ({**LLAMA, "max_position_embeddings": -8}, "max_position_embeddings", "got -8"),
        ({**GPT2, "n_positions": 0}, "n_positions", "must be a positive integer, got 0"),
        # torch.export's "k not in range for dimension" from the router's topk
        ({**LLAMA, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 8},
         "num_experts_per_tok", "8 exceeds num_local_experts 4"),
        ({**LLAMA, "model_type": "mixtral", "num_experts_per_tok": 12},  # transformers' 8 experts
         "num_experts_per_tok", "12 exceeds num_local_experts 8"),
        ({**LLAMA, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 8},
         "num_experts_per_tok", "8 exceeds num_experts 4"),
        ({**LLAMA, "model_type": "qwen3_moe", "num_experts": 10**6}, "num_experts", "beyond the sanity limit 1024"),
        ({**LLAMA, "model_type": "qwen3_moe", "num_local_experts": 4, "num_experts_per_tok": 8},  # the alias
         "num_experts_per_tok", "8 exceeds num_local_experts 4"),
        ({**LLAMA, "model_type": "mixtral", "num_experts": 1}, "num_experts_per_tok",
         "2 (mixtral's default; set it) exceeds num_experts 1"),
        # planned before, and refused only when training started (dropout) or never (a NaN norm)
        ({**LLAMA, "attention_dropout": 1.5}, "attention_dropout", "must be between 0 and 1, got 1.5"),
        ({**GPT2, "resid_pdrop": -0.1}, "resid_pdrop", "must be between 0 and 1, got -0.1"),
        ({**LLAMA, "rms_norm_eps": -1}, "rms_norm_eps", "must not be negative, got -1"),
        # transformers' Ministral reads head_dim as given: None ** -0.5, "cannot build" before
        ({**LLAMA, "model_type": "ministral"}, "head_dim", "missing from the ministral config"),
        # a ZeroDivisionError in transformers' EXAONE 4 config: a traceback on the CLI, a 500
        # over HTTP (black-box review)
        ({**LLAMA, "model_type": "exaone4", "sliding_window": None, "sliding_window_pattern": None},
         "layer_types", "missing from an exaone4 config whose sliding_window is null"),
        ({**LLAMA, "model_type": "exaone4", "sliding_window": 8, "sliding_window_pattern": 0},
         "sliding_window_pattern", "transformers fails on it (ZeroDivisionError: integer modulo by zero)"),
        # a key left to a default sized for the full model: torch.export's broadcast or
        # view error before, which the service reported against model.hf_config whole
        (HELIUM, "num_key_value_heads", "20 (helium's default; set it) does not divide num_attention_heads 4"),
        ({**HELIUM, "model_type": "mistral"}, "num_key_value_heads", "8 (mistral's default; set it) does not"),
        ({k: v for k, v in HELIUM.items() if k != "head_dim"}, "head_dim",
         "128 (helium's default; set it) x num_attention_heads 4 must equal hidden_size 64"),
        (DEEPSEEK, "num_key_value_heads", "128 (deepseek_v3's default; set it) must equal num_attention_heads 4"),
        # eager transformers runs this only without a mask, where SDPA's enable_gqa hides it
        ({**DEEPSEEK, "num_key_value_heads": 2, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4, "v_head_dim": 8},
         "num_key_value_heads", "2 must equal num_attention_heads 4 in a deepseek_v3 config (or be null)"),
        ({**{k: v for k, v in DEEPSEEK_MOE.items() if k != "num_experts_per_tok"}, "n_routed_experts": 4},
         "num_experts_per_tok", "8 (deepseek_v3's default; set it) exceeds n_routed_experts 4"),
        ({k: v for k, v in DEEPSEEK_MOE.items() if k != "n_group"}, "n_group",
         "8 (deepseek_v3's default; set it) must split n_routed_experts 8 into equal groups of at least 2"),
        ({**DEEPSEEK_MOE, "n_routed_experts": 6}, "n_group", "4 must split n_routed_experts 6 into equal groups"),
        ({**DEEPSEEK_MOE, "n_group": 2}, "topk_group",
         "4 (deepseek_v3's default; set it) must be between 1 and n_group 2"),
        # ERNIE 4.5 names the routing moe_num_experts and moe_k (transformers' aliases)
        (ERNIE_MOE, "moe_k", "6 (ernie4_5_moe's default; set it) exceeds moe_num_experts 4"),
        ({**ERNIE_MOE, "num_experts_per_tok": 5}, "num_experts_per_tok", "5 exceeds moe_num_experts 4"),
        # keyless errors in torch.export or the build before (a full-size planning sweep, session 40):
        # routing the class leaves null, an experts' width torch's grouped GEMM cannot read
        ({**DEEPSEEK_V2, "num_experts_per_tok": None}, "num_experts_per_tok", "must be a positive integer, got None"),
        ({k: v for k, v in DEEPSEEK_V2.items() if k != "num_experts_per_tok"}, "num_experts_per_tok",
         "missing from the deepseek_v2 config (its class has no default)"),
        ({k: v for k, v in DEEPSEEK_V2.items() if k != "moe_intermediate_size"}, "moe_intermediate_size",
         "1407 (deepseek_v2's default; set it) must be a multiple of 8 in a mixture of experts"),
        ({**DEEPSEEK_V2, "model_type": "dots1", "n_routed_experts": None}, "n_routed_experts",
         "must be a positive integer, got None"),
        ({**DEEPSEEK_V2, "model_type": "dots1", "n_shared_experts": None}, "n_shared_experts",
         "must be a positive integer, got None"),
        ({**LLAMA, "model_type": "mixtral", "num_local_experts": 4, "intermediate_size": 30}, "intermediate_size",
         "30 must be a multiple of 8 in a mixture of experts"),
        ({**LLAMA, "model_type": "gemma4_text", "enable_moe_block": True, "head_dim": 8}, "num_experts",
         "missing from the gemma4_text config (its class has no default)"),
        ({**LLAMA, "model_type": "hunyuan_v1_moe", "num_experts": 4, "moe_topk": 2, "intermediate_size": 32},
         "head_dim", "missing from the hunyuan_v1_moe config"),
        ({**LLAMA, "num_attention_heads": 6}, "hidden_size",
         "32 is not divisible by num_attention_heads 6: give head_dim, the width of a head"),
        # sizes under a config class's own names (its attribute_map): "hidden_size: missing
        # from the gptj config" before session 41, whatever the user wrote
        ({**GPTJ, "n_embd": 30}, "n_embd", "30 is not divisible by n_head 4"),
        ({**GPTJ, "activation_function": "nosuchact"}, "activation_function", "unknown activation 'nosuchact'"),
        ({"model_type": "bloom", "vocab_size": 128, "hidden_size": 32, "n_head": 4, "n_layer": 0}, "n_layer",
         "must be a positive integer, got 0"),
        ({"model_type": "mpt", "vocab_size": 128, "n_heads": 4, "n_layers": 2}, "d_model", "missing from the mpt"),
        # a bare KeyError: 'full_attention' from the build before
        ({**LLAMA, "model_type": "cohere_compass_text"}, "rope_parameters",
         "a cohere_compass_text config needs one object per layer type, and there is none for full_attention"),
    ],
)
def test_bad_configs_give_one_line_errors(config, field, says):
    with pytest.raises(ConfigError) as err:
        trace(config, 1, 16)
    msg = str(err.value)
    assert msg.startswith(f"{field}: ") and "\n" not in msg
    assert says in msg


@pytest.mark.parametrize("config", [{**LLAMA, "max_position_embeddings": 64}, {**GPT2, "n_positions": 64},
                                    {"model_type": "mpt", "vocab_size": 128, "d_model": 32, "n_heads": 4,
                                     "n_layers": 2, "max_seq_len": 64}], ids=["llama", "gpt2", "mpt"])
def test_a_sequence_beyond_the_models_positions_is_refused(config) -> None:
    with pytest.raises(ConfigError, match=r"^seq_len: 128 exceeds the model's 64 positions$"):
        trace(config, 1, 128)


def test_sizes_the_checks_let_through() -> None:
    """Refused before session 40 though transformers builds them: GLM-4.7-Flash's latent
    attention, whose 20 heads have a width of their own ("hidden_size: 2048 is not
    divisible by num_attention_heads 20"), and the null expert sizes Gemma 4's config
    writes where its MoE block is off, as a traced config's to_dict() has them
    ("num_experts: must be a positive integer, got None")."""
    glm = {"model_type": "glm4_moe_lite", "vocab_size": 154880, "hidden_size": 2048, "num_hidden_layers": 47,
           "num_attention_heads": 20, "num_key_value_heads": 20, "q_lora_rank": 768, "kv_lora_rank": 512,
           "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256, "n_routed_experts": 64,
           "num_experts_per_tok": 4, "n_group": 1, "topk_group": 1, "moe_intermediate_size": 1536}
    assert load_config(glm).num_attention_heads == 20
    gemma4 = {**LLAMA, "model_type": "gemma4_text", "head_dim": 8, "global_head_dim": 16,
              "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 128, "bos_token_id": 0,
              "eos_token_id": 1, "pad_token_id": None, "num_experts": None, "moe_intermediate_size": None}
    assert trace(gemma4, 1, 16).graph["layers"] == LLAMA["num_hidden_layers"]
    with pytest.raises(ConfigError, match="^num_local_experts: must be a positive integer, got None$"):
        load_config({**LLAMA, "model_type": "mixtral", "num_local_experts": None})  # its default is 8


def test_deepseek_v3_routing_defaults_trace_where_they_fit() -> None:
    """The routing checks refuse only what fails: 8 experts in 4 groups of 2 (its default
    topk_group of 4), or the default 8 groups of 256 experts' where no layer routes."""
    assert trace(DEEPSEEK_MOE, 1, 16).graph["layers"] == 2
    dense = {**DEEPSEEK, "num_key_value_heads": None, "n_routed_experts": 4, "num_experts_per_tok": 2,
             "first_k_dense_replace": 2}
    assert trace(dense, 1, 16).graph["layers"] == 2


def test_layers_of_each_kind_stand_for_the_rest_of_their_kind() -> None:
    """DeepSeek-V3's first ``first_k_dense_replace`` layers are dense (3 by default): its
    two traced layers matched, both dense, and stood for every layer, the MoE layers'
    experts and router missing from the graph.  Exporting every layer instead took the
    full model's plan from ~20 s to ~6 minutes: two layers of each kind are exported, each
    standing for its share of its kind, and the whole model's figures are the same."""
    config = {**DEEPSEEK_MOE, "num_hidden_layers": 7, "first_k_dense_replace": 2}
    g = trace(config, 1, 16)
    assert (g.graph["traced_layers"], g.graph["layer_weights"]) == (4, [1, 1, 3, 2])
    routed = {d["layer"] for _, d in g.nodes(data=True) if d.get("short") == "grouped_mm"}
    assert routed == {2, 3}
    whole = trace(build_model(load_config(config), "meta", torch.float32), 1, 16)  # a module: every layer
    assert whole.graph["traced_layers"] == 7
    assert totals(g) == pytest.approx(totals(whole), rel=1e-9)


MPT = {"model_type": "mpt", "d_model": 32, "n_heads": 4, "n_layers": 4, "expansion_ratio": 2,
       "max_seq_len": 64, "vocab_size": 128}


def test_a_layer_list_by_another_name_is_not_left_truncated(monkeypatch: pytest.MonkeyPatch) -> None:
    """MPT keeps its layers in ``transformer.blocks``, which the tracer did not know: its
    two traced layers stood for nothing, so the planner priced 2 of 4 layers (the plan
    laid out 18 collectives of the 34 a dp 2 x tp 2 step issues).  Now ``blocks`` are
    layers, and a truncated export whose layers are not found in its graph is redone with
    every layer."""
    import planner.tracer

    whole = trace(build_model(load_config(MPT), "meta", torch.float32), 1, 16)
    g = trace(MPT, 1, 16)
    assert (g.graph["traced_layers"], g.graph["layer_weights"]) == (2, [2, 2])
    assert totals(g) == pytest.approx(totals(whole), rel=1e-9)
    monkeypatch.setattr(planner.tracer, "_LAYER_RE", re.compile(r"^(?P<prefix>.*?\.layers)\.(?P<idx>\d+)(?:\.|$)"))
    unknown = trace(MPT, 1, 16)
    assert unknown.graph["layer_weights"] == []
    assert {d["module"] for _, d in unknown.nodes(data=True)} >= {f"transformer.blocks.{i}.attn.Wqkv" for i in range(4)}
    assert totals(unknown) == pytest.approx(totals(whole), rel=1e-9)


def test_null_key_value_heads_mean_as_many_as_attention_heads():
    """Hugging Face derives a null num_key_value_heads (and head_dim): not a mistake."""
    config = load_config({**LLAMA, "num_key_value_heads": None, "head_dim": None})
    assert config.num_key_value_heads == LLAMA["num_attention_heads"]


def test_gpt2_builds_without_the_loss_type_warning(monkeypatch):
    """GPT2LMHeadModel's class name names no loss, so transformers warned on every trace
    that it falls back to the causal-LM loss; planning names that loss itself."""
    from transformers import modeling_utils

    warned: list[str] = []
    monkeypatch.setattr(modeling_utils.logger, "warning_once", lambda msg, *a, **k: warned.append(msg))
    trace("gpt2-tiny", 1, 16)
    assert not [w for w in warned if "loss_type" in w]


def test_bad_model_names_and_files(tmp_path):
    with pytest.raises(ConfigError, match="neither a preset"):
        load_config("llama-99b")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(str(bad))
    good = tmp_path / "good.json"
    good.write_text(json.dumps(PRESETS["llama-tiny"]))
    assert load_config(str(good)).hidden_size == 32


def test_seq_len_beyond_positions():
    with pytest.raises(ConfigError, match="seq_len"):
        trace("gpt2-tiny", 1, 4096)
    with pytest.raises(ConfigError, match="batch_size"):
        trace("gpt2-tiny", 0, 16)


def test_trace_defaults_seq_len_as_plan_does():
    """The SPEC's ``planner.trace(preset)`` with no length: the model's positions capped at
    4096, as plan / estimate / the service default (was a fixed 2048, over llama-tiny's 128)."""
    g = trace("llama-tiny")
    assert g.graph["seq_len"] == load_config("llama-tiny").max_position_embeddings == 128


def test_a_config_dict_may_hold_the_torch_dtype_itself() -> None:
    import torch

    for key in ("torch_dtype", "dtype"):
        assert load_config({**LLAMA, key: torch.bfloat16}).model_type == "llama"
    with pytest.raises(ConfigError, match="^dtype: "):
        load_config({**LLAMA, "dtype": torch.int64})


class _KernelBytes(TorchDispatchMode):
    """Bytes the aten kernels run under it read and write (views move nothing; a
    broadcast operand is read at its storage's size)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        views = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
        if views or func is torch.ops.aten.detach.default:
            return out
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        self.total += sum(min(t.numel() * t.element_size(), t.untyped_storage().nbytes()) for t in tensors)
        return out


class _Elementwise(nn.Module):
    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.embed, self.w, self.fn = nn.Embedding(16, 32), nn.Parameter(torch.ones(32)), fn

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.fn(self.embed(input_ids), self.w)


# the elementwise ops of Llama's and GPT-2's layers and their mixes: a broadcast weight,
# an input read twice, casts, reductions, quotients
_ELEMENTWISE = {
    "x * w": lambda x, w: x * w,
    "x * tanh(x)": lambda x, w: x * torch.tanh(x),
    "rsqrt(x * x + 1)": lambda x, w: torch.rsqrt(x * x + 1),
    "x.pow(2).mean(-1)": lambda x, w: x.pow(2).mean(-1, keepdim=True),
    "silu(x) * x": lambda x, w: F.silu(x) * x,
    "casts": lambda x, w: (x.to(torch.float64) * 2).to(torch.float32),
    "x - w * x": lambda x, w: x - w * x,
    "x / (w + 2)": lambda x, w: x / (w + 2),
    "sqrt(exp(x))": lambda x, w: torch.sqrt(torch.exp(x)),
    "-x + x": lambda x, w: -x + x,
    "split": lambda x, w: torch.cat([a * b for a, b in zip(x.split(8, -1), w.split(8), strict=True)], -1),
}


@pytest.mark.parametrize("case", list(_ELEMENTWISE))
def test_elementwise_backward_bytes_are_autograds(case: str) -> None:
    """The traced graph's backward bytes against the bytes autograd's own kernels move
    for the same function (an H100 ran autograd's mul kernels at 2.3x the old charge,
    which was each op's forward bytes): per op's derivative, plus the adds of a value's
    gradients where several ops read it."""
    fn = _ELEMENTWISE[case]
    model = _Elementwise(fn)
    g = trace(model, 2, 64)
    predicted = sum(d["bwd_bytes"] - (d["bytes"] if d["short"] == "embedding" else 0)  # its backward aside
                    for _, d in g.nodes(data=True) if d["kind"] == "call_function")
    x = model.embed(torch.randint(0, 16, (2, 64))).detach().requires_grad_()
    y = fn(x, model.w)
    dy = torch.ones_like(y)
    with _KernelBytes() as measured:
        torch.autograd.grad(y, [x, model.w], dy, allow_unused=True)
    assert predicted == pytest.approx(measured.total, rel=1e-3), (predicted, measured.total)


def test_backward_of_a_llama_layer() -> None:
    """On the bf16 graph GPU plans price: SwiGLU's product of two activations costs twice
    its forward, the residual stream's fork an add of gradients, and values that need no
    gradient (the rotary tables) no backward at all."""
    g = trace("llama-tiny", 2, 16, torch.bfloat16)
    layer0 = [d for _, d in g.nodes(data=True) if d["kind"] == "call_function" and d["layer"] == 0]
    act = 2 * 16 * 32 * 2  # a hidden-size bf16 activation
    swiglu, = [d for d in layer0 if d["short"] == "mul" and d["module"] == "model.layers.0.mlp"]
    assert swiglu["bwd_bytes"] == 2 * swiglu["bytes"] == 2 * 3 * (2 * 16 * 64 * 2)
    for residual in [d for d in layer0 if d["short"] == "add" and d["module"] == "model.layers.0"]:
        assert residual["bwd_bytes"] == 3 * act  # its own gradient passes; the fork adds two
    rotary = [d for _, d in g.nodes(data=True) if d["kind"] == "call_function" and d["short"] in ("cos", "sin")]
    assert rotary and all(d["bwd_bytes"] == d["bwd_flops"] == 0 < d["bytes"] for d in rotary)


def test_a_module_torch_export_cannot_trace_is_one_line(capfd: pytest.CaptureFixture[str]) -> None:
    """torch's fake tensors logged ~20 lines of traceback to stderr before it (review)."""
    import planner
    from planner.presets import ConfigError

    with pytest.raises(ConfigError, match=r"^model: torch.export failed on Linear: "):
        planner.plan(torch.nn.Linear(4, 4), devices=2, profile="cpu-gloo-local", batch_size=4, seq_len=16)
    assert "Traceback" not in capfd.readouterr().err


QWEN3_5 = {"model_type": "qwen3_5_text", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
           "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 8,
           "linear_num_key_heads": 2, "linear_num_value_heads": 4,
           "layer_types": ["linear_attention", "full_attention"], "bos_token_id": 0, "eos_token_id": 1,
           "pad_token_id": None}


def test_the_delta_rule_is_traced_as_the_kernel_a_gpu_runs() -> None:
    """Gated DeltaNet's chunked delta rule, as transformers' PyTorch fallback (what a CPU
    runs), exports as ~1,000 ops here (~2,000 at 4,096 tokens), each priced with its
    launch and its traffic: on an H100 its layer cost 51 ms against 4.7 ms for a full
    attention layer.  For a GPU it is one node, with the fallback's matmul FLOPs plus its
    triangular solve's (which the fallback runs as a forward substitution of muls and
    sums), and its inputs kept for the backward; the model itself still runs the fallback."""
    def linear_attention(g):
        return [d for _, d in g.nodes(data=True) if d["kind"] == "call_function" and ".linear_attn" in d["module"]]

    eager = linear_attention(trace(QWEN3_5, 2, 200))
    fused = linear_attention(trace(QWEN3_5, 2, 200, fused_kernels=True))
    (kernel,) = [d for d in fused if d["short"] == "chunk_gated_delta_rule"]
    assert len(fused) * 10 < len(eager)
    solve = 2 * 4 * 256 * 2 * 64**2 / 3  # batch x value heads x tokens padded to 4 chunks x 2C^2 / 3
    assert kernel["fwd_flops"] - solve == sum(d["fwd_flops"] for d in eager if d["short"] in ("matmul", "bmm"))
    assert kernel["saved"]
    import transformers.models.qwen3_5.modeling_qwen3_5 as qwen3_5

    q, v, g = torch.randn(1, 70, 2, 16), torch.randn(1, 70, 4, 8), -torch.rand(1, 70, 4)
    out, _ = qwen3_5.torch_chunk_gated_delta_rule(q, q, v, g=g, beta=torch.rand(1, 70, 4))
    assert out.shape == v.shape
