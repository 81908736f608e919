"""Tracer: real torch.export graphs of every preset, FLOPs, repetition, bad configs."""

from __future__ import annotations

import json
import math

import pytest
import torch

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


def test_hf_module_input():
    model = build_model(load_config("llama-tiny"), "meta")
    g = trace(model, 1, 16)
    assert g.graph["layers"] == 2 and g.graph["model"] == "LlamaForCausalLM"


LLAMA, GPT2 = PRESETS["llama-tiny"], PRESETS["gpt2-tiny"]


@pytest.mark.parametrize(
    "config, field, says",
    [
        ({"model_type": "bert", "hidden_size": 8}, "model_type", "'bert' is not supported"),
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
    ],
)
def test_bad_configs_give_one_line_errors(config, field, says):
    with pytest.raises(ConfigError) as err:
        trace(config, 1, 16)
    msg = str(err.value)
    assert msg.startswith(f"{field}: ") and "\n" not in msg
    assert says in msg


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


def test_backward_bytes_follow_autograds_derivatives() -> None:
    """Elementwise backwards by autograd's formulas (an H100 ran autograd's mul kernels at
    2.3x the old charge, the forward's bytes), on the bf16 graph GPU plans price: a
    product of two activations costs twice its forward, a broadcast weight's gradient a
    full-size product and its sum, a value several ops read the adds of their gradients, a
    same-shape add nothing of its own, and values that need no gradient (the rotary
    tables) no backward at all."""
    g = trace("llama-tiny", 2, 16, torch.bfloat16)
    layer0 = [d for _, d in g.nodes(data=True) if d["kind"] == "call_function" and d["layer"] == 0]

    def only(short: str, module: str) -> list[dict]:
        return [d for d in layer0 if d["short"] == short and d["module"] == module]

    act = 2 * 16 * 32 * 2  # a hidden-size bf16 activation
    swiglu, = only("mul", "model.layers.0.mlp")
    assert swiglu["bwd_bytes"] == 2 * swiglu["bytes"] == 2 * 3 * (2 * 16 * 64 * 2)
    # weight * x: the weight's gradient (the output's gradient times x, then summed over
    # tokens) and x's (times the weight); q, k and v read the result: two adds of gradients
    norm = only("mul", "model.layers.0.input_layernorm")[-1]
    assert norm["in_shapes"][0] == (32,)
    w = 32 * 2
    assert norm["bwd_bytes"] == (act + act + w + 2 * act) + (act + w + act) + 2 * 3 * act
    # the residual stream: each add's gradient passes to both inputs; its output is read
    # by the next norm and the next add, whose gradients one add sums
    for residual in only("add", "model.layers.0"):
        assert residual["bwd_bytes"] == 3 * act
    # the norm's fp32 cast: its gradient cast back (read fp32, write bf16), and the two
    # gradients it gets (variance and scaling) added
    cast = only("to", "model.layers.0.input_layernorm")[0]
    assert cast["copy"] and cast["bwd_bytes"] == (2 * act + act) + 3 * (2 * act)
    rotary = [d for _, d in g.nodes(data=True) if d["kind"] == "call_function" and d["short"] in ("cos", "sin")]
    assert rotary and all(d["bwd_bytes"] == d["bwd_flops"] == 0 < d["bytes"] for d in rotary)
