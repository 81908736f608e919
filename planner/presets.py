"""Model presets and config loading.

Presets are Hugging Face configs built in code from the published shapes, so
planning never downloads anything.  Any ``config.json`` of a supported
``model_type`` works too; the config is validated here, before a model is built,
so that a typo gives a one-line error instead of an OOM or a hang.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from torch import nn
from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

# Each trains on N ranks as on one device under tensor, sequence, fully sharded and
# pipeline parallelism (tests/test_executor.py, test_pipeline.py, test_architectures.py).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "gpt2", "mixtral", "qwen3", "gemma", "gemma3_text",
                         "olmo", "granite", "starcoder2", "gpt_neox", "phi", "phi3", "cohere", "stablelm",
                         "olmo2", "qwen3_moe", "qwen2_moe", "olmoe", "granitemoe", "gemma2", "glm", "glm4",
                         "helium", "nemotron", "exaone4", "smollm3", "ministral", "phimoe", "ernie4_5",
                         "ernie4_5_moe", "seed_oss", "hunyuan_v1_dense", "arcee", "gpt_oss",
                         "deepseek_v3",
                         "olmo3", "ministral3", "cohere2", "internlm3", "exaone", "jais2", "nanochat",
                         "bitnet", "persimmon", "cwm", "hyperclovax", "vaultgemma", "granite_swa", "youtu",
                         "minicpm3", "gemma4_text", "apertus", "apertus1p5_text", "iquestcoder",
                         "glm4_moe", "glm4_moe_lite", "deepseek_v2", "hunyuan_v1_moe", "dots1", "minimax_m2",
                         "granitemoeshared", "flex_olmo", "exaone_moe", "cohere2_moe", "sarvam_moe", "afmoe",
                         "solar_open", "laguna", "mimo_v2_flash", "mellum", "hy_v3",
                         "gpt_bigcode", "gptj", "opt", "codegen", "cohere_compass_text", "biogpt", "mpt", "bloom",
                         "sarvam_mla", "aria_text", "axk1", "beam", "kolibri1", "flint",
                         "qwen3_5_text", "olmo_hybrid", "qwen3_next", "qwen3_5_moe_text")
# Model types whose modelling code reads head_dim as given: a null one is not derived
# (Ministral's attention computes ``None ** -0.5``).
_HEAD_DIM_GIVEN = ("ministral", "hunyuan_v1_moe")
# Model types whose attention never reads a head_dim from the config: the heads are
# hidden_size / num_attention_heads wide (GPT-2 and the models of its time).
_HEAD_DIM_DERIVED = ("gpt2", "gpt_bigcode", "gptj", "opt", "codegen", "biogpt", "mpt", "bloom")
# Model types whose attention output projection takes hidden_size features (not
# num_attention_heads x head_dim), so the two must be equal; Helium's head_dim defaults to
# 128 rather than being derived, which a tiny config's hidden_size does not match.
_HEADS_SPAN_HIDDEN = ("helium",)
# Model types whose attention projects keys and values for every head from a shared
# latent (multi-head latent attention): num_key_value_heads groups nothing there, and
# the heads' width is their own (qk_nope_head_dim + qk_rope_head_dim), not hidden_size's
# share (GLM-4.7-Flash: hidden_size 2048, 20 heads).
_LATENT_ATTENTION = ("deepseek_v3", "deepseek_v2", "glm4_moe_lite", "sarvam_mla", "axk1")
# Model types whose rotary settings are read per layer type (rope_parameters["full_attention"]),
# with no default in the class.
_ROPE_PER_LAYER_TYPE = ("cohere_compass_text",)
# The number of routed experts under each model type's name for it.
_EXPERTS_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")


class ConfigError(ValueError):
    """A model config a user gave is unusable; the message names the field."""


_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _llama3(hidden: int, inter: int, layers: int, heads: int) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 8,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_scaling": _LLAMA3_ROPE,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
    }


PRESETS: dict[str, dict[str, Any]] = {
    "gpt2": {"model_type": "gpt2", "vocab_size": 50257, "n_positions": 1024, "n_embd": 768,
             "n_layer": 12, "n_head": 12},
    "llama3-8b": _llama3(4096, 14336, 32, 32),
    "llama3-70b": _llama3(8192, 28672, 80, 64),
    "llama3-405b": _llama3(16384, 53248, 126, 128),
    "mistral-7b": {"model_type": "mistral", "vocab_size": 32000, "hidden_size": 4096,
                   "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8,
                   "max_position_embeddings": 32768, "rope_theta": 1000000.0,
                   "sliding_window": None, "tie_word_embeddings": False},
    "qwen2-7b": {"model_type": "qwen2", "vocab_size": 152064, "hidden_size": 3584,
                 "intermediate_size": 18944, "num_hidden_layers": 28,
                 "num_attention_heads": 28, "num_key_value_heads": 4,
                 "max_position_embeddings": 131072, "rope_theta": 1000000.0,
                 "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
    "mixtral-8x7b": {"model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
                     "intermediate_size": 14336, "num_hidden_layers": 32,
                     "num_attention_heads": 32, "num_key_value_heads": 8,
                     "num_local_experts": 8, "num_experts_per_tok": 2,
                     "max_position_embeddings": 32768, "rope_theta": 1000000.0,
                     "tie_word_embeddings": False},
    "gpt2-tiny": {"model_type": "gpt2", "vocab_size": 128, "n_positions": 64, "n_embd": 32,
                  "n_layer": 2, "n_head": 4, "bos_token_id": 0, "eos_token_id": 0},
    "llama-tiny": {"model_type": "llama", "vocab_size": 128, "hidden_size": 32,
                   "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "max_position_embeddings": 128,
                   "tie_word_embeddings": False},
}

# Sanity limits: far above any real model, low enough that a typo (hidden 10**7)
# is rejected before it allocates anything.
_LIMITS = {
    "hidden_size": 131072,
    "intermediate_size": 1048576,
    "num_hidden_layers": 1024,
    "num_attention_heads": 2048,
    "num_key_value_heads": 2048,
    "head_dim": 16384,
    "vocab_size": 4194304,
    "max_position_embeddings": 1 << 24,
    "num_local_experts": 1024,  # Mixtral's name
    "num_experts": 1024,  # Qwen3-MoE's
    "n_routed_experts": 1024,  # DeepSeek's
    "moe_intermediate_size": 1048576,
    "num_experts_per_tok": 64,
}
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
# Sizes Hugging Face derives when null: key/value heads default to the attention heads,
# head_dim to hidden_size / num_attention_heads.  Any other null size is a mistake.
_NULLABLE = ("num_key_value_heads", "head_dim")
# The experts' sizes, null where an optional MoE block is off: the key that switches it
# on, per model type (Gemma 4's).
_MOE_SIZES = ("num_experts", "moe_intermediate_size", "num_experts_per_tok")
_MOE_SWITCH = {"gemma4_text": "enable_moe_block"}
# Model types whose causal LM's embedding has no padding row (no padding_idx): any
# pad_token_id builds.
_NO_PADDING_ROW = ("gpt2", "gpt_neox")
# The sizes above that a config class may store under a name of its own (its
# attribute_map: GPT-2's n_embd, BLOOM's n_layer, MPT's d_model), as its to_dict() writes them.
_ALIASED = (*_REQUIRED, "max_position_embeddings")
# The RoPE types a model can be built with: HF's default plus its init-function registry.
_ROPE_TYPES = ("default", *ROPE_INIT_FUNCTIONS)


def _read_mapping(source: str | Path | Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    if isinstance(source, Mapping):
        return "hf_config", dict(source)
    text = str(source)
    if text in PRESETS:
        return text, dict(PRESETS[text])
    path = Path(text)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(
            f"model: {text!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json file"
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:  # ValueError: not UTF-8, not JSON, or an int past Python's digits limit
        raise ConfigError(f"model: cannot read {path} as JSON: {str(e).split(';')[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"model: {path} must hold a JSON object")
    return str(path), data


def _check(data: dict[str, Any]) -> None:
    """Reject what transformers would turn into a TypeError or KeyError deep inside the
    model, or a truncated message; errors name the key as the user wrote it."""
    model_type = data.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        text = data.get("text_config")
        hint = ""
        if isinstance(text, Mapping) and text.get("model_type") in SUPPORTED_MODEL_TYPES:
            # a multimodal config (Gemma 3's) around a supported language model, whose
            # text_config may leave sizes this check requires to its class's defaults
            hint = (f"; its text_config is a {text['model_type']} config: give that object to plan the "
                    f"language model alone")
            missing = {k: _default(text["model_type"], k) for k in _REQUIRED if k not in text}
            if missing:
                hint += (f", adding {', '.join(missing)}, which it leaves to transformers' defaults "
                         f"({', '.join(f'{k}={v!r}' for k, v in missing.items())})")
        what = "missing from the config" if model_type is None else f"{model_type!r} is not supported"
        raise ConfigError(f"model_type: {what} (supported: {', '.join(SUPPORTED_MODEL_TYPES)}){hint}")
    aliases = {own: key for key, own in CONFIG_MAPPING[model_type].attribute_map.items() if key in _ALIASED}
    written = {v: k for k, v in aliases.items()}  # canonical name -> the user's name
    data = {aliases.get(k, k): v for k, v in data.items()}
    for key in _REQUIRED:
        if key not in data:
            raise ConfigError(f"{written.get(key, key)}: missing from the {model_type} config")
    for key, limit in _LIMITS.items():
        if key not in data or (data[key] is None and (key in _NULLABLE
                                                      or key in _MOE_SIZES and _moe_off(data, model_type))):
            continue
        value, name = data[key], written.get(key, key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{name}: must be a positive integer, got {value!r}")
        if value > limit:
            raise ConfigError(f"{name}: {value} is beyond the sanity limit {limit}")
    heads = data["num_attention_heads"]
    if model_type == "exaone4" and "sliding_window" in data and data["sliding_window"] is None \
            and data.get("layer_types") is None:
        # its config then sets sliding_window_pattern to 0 and derives layer_types modulo it
        raise ConfigError("layer_types: missing from an exaone4 config whose sliding_window is null; "
                          "transformers derives them modulo a sliding_window_pattern of 0 there (a "
                          "ZeroDivisionError): give layer_types, e.g. all \"full_attention\"")
    if model_type in _HEAD_DIM_GIVEN and data.get("head_dim") is None:
        raise ConfigError(f"head_dim: missing from the {model_type} config; transformers' {model_type} model does "
                          "not derive it from hidden_size / num_attention_heads")
    head_dim = data.get("head_dim", _default(model_type, "head_dim"))
    if model_type in _HEADS_SPAN_HIDDEN and head_dim is not None and heads * head_dim != data["hidden_size"]:
        # torch.export's "a and b must have same reduction dim" against model.hf_config whole before
        raise ConfigError(f"head_dim: {head_dim}{_defaulted(data, model_type, 'head_dim')} x num_attention_heads "
                          f"{heads} must equal hidden_size {data['hidden_size']}: {model_type}'s attention output "
                          f"projection takes hidden_size features")
    if data.get("head_dim") is None and model_type not in _LATENT_ATTENTION and data["hidden_size"] % heads:
        hint = "" if model_type in _HEAD_DIM_DERIVED else ": give head_dim, the width of a head"
        raise ConfigError(f"{written.get('hidden_size', 'hidden_size')}: {data['hidden_size']} is not "
                          f"divisible by {written.get('num_attention_heads', 'num_attention_heads')} {heads}{hint}")
    # a key left out takes its class's default, which several classes do not derive from
    # num_attention_heads (Helium's 20, Mistral's 8, DeepSeek-V3's 128): a tiny config
    # that gives 4 heads otherwise failed in torch.export, naming no key
    kv = data.get("num_key_value_heads", _default(model_type, "num_key_value_heads"))
    if model_type in _LATENT_ATTENTION and kv is not None and kv != heads:
        raise ConfigError(
            f"num_key_value_heads: {kv}{_defaulted(data, model_type, 'num_key_value_heads')} must equal "
            f"num_attention_heads {heads} in a {model_type} config (or be null): its latent attention gives "
            f"every head its own keys and values, which transformers' attention then repeats "
            f"num_attention_heads / num_key_value_heads times over (SDPA without a mask aside; torch.export "
            f"passes one)")
    if kv and heads % kv:
        raise ConfigError(f"num_key_value_heads: {kv}{_defaulted(data, model_type, 'num_key_value_heads')} "
                          f"does not divide num_attention_heads {heads}")
    _check_experts(data, model_type)
    pad, vocab = data.get("pad_token_id", _default(model_type, "pad_token_id")), data["vocab_size"]
    if (model_type not in _NO_PADDING_ROW and isinstance(pad, int) and not isinstance(pad, bool)
            and not -vocab <= pad < vocab):
        # the embedding's padding row: torch.nn.Embedding asserts it (an AssertionError)
        given = "" if "pad_token_id" in data else f" ({model_type}'s default; set it, or null)"
        raise ConfigError(f"pad_token_id: {pad}{given} is not a token of the vocabulary (vocab_size {vocab})")
    _check_rates(data)
    for key in ("hidden_act", "activation_function"):  # (GPT-2's, GPT-J's, BLOOM-era names)
        if key in _init_parameters(model_type):
            _check_activation(data, key)
    _check_rope(data)
    if model_type in _ROPE_PER_LAYER_TYPE:
        _check_rope_per_layer_type(data, model_type)
    _check_dtype(data)


def _moe_off(data: dict[str, Any], model_type: str) -> bool:
    """Whether the config switches off an optional MoE block (Gemma 4's), whose sizes are
    then null and unused."""
    switch = _MOE_SWITCH.get(model_type)
    return switch is not None and not data.get(switch, _default(model_type, switch))


def _check_experts(data: dict[str, Any], model_type: str) -> None:
    """What a mixture of experts' config must hold that transformers does not check: each
    failed in torch.export or the build, naming no key.  The routing settings under any
    name (transformers' attribute_map: ERNIE 4.5's moe_num_experts and moe_k), given where
    the class leaves them null (DeepSeek-V2's num_experts_per_tok, dots1's experts); the
    experts' width and the hidden size in multiples of 8, which torch's grouped GEMM
    (transformers' default experts kernel) reads as 16-byte rows in bfloat16
    (DeepSeek-V2's default moe_intermediate_size is 1407)."""
    own, params = CONFIG_MAPPING[model_type].attribute_map, _init_parameters(model_type)
    names = (*(own.get(k, k) for k in _EXPERTS_KEYS), *_EXPERTS_KEYS)
    if not any(k in params for k in names) or _moe_off(data, model_type):
        return
    experts_key, experts = _setting(data, model_type, names)
    routed_key, routed = _setting(data, model_type, (own.get("num_experts_per_tok", "num_experts_per_tok"),
                                                   "num_experts_per_tok"))
    width_key = "moe_intermediate_size" if "moe_intermediate_size" in params else "intermediate_size"
    shared = ("n_shared_experts",) if "n_shared_experts" in params else ()
    for key in (experts_key, routed_key, width_key, *shared):
        if data.get(key, _default(model_type, key)) is None:
            raise ConfigError(f"{key}: missing from the {model_type} config (its class has no default)"
                              if key not in data else f"{key}: must be a positive integer, got None")
    if isinstance(routed, int) and isinstance(experts, int) and routed > experts:  # (Hunyuan's may be per layer)
        # torch.export's "k not in range for dimension" from the router's topk otherwise
        raise ConfigError(f"{routed_key}: {routed}{_defaulted(data, model_type, routed_key)} "
                          f"exceeds {experts_key} {experts}{_defaulted(data, model_type, experts_key)}")
    for key in (width_key, "hidden_size"):
        value = data.get(key, _default(model_type, key))
        if isinstance(value, int) and value % 8:
            raise ConfigError(f"{key}: {value}{_defaulted(data, model_type, key)} must be a multiple of 8 in a "
                              f"mixture of experts: torch's grouped GEMM (transformers' default experts kernel) "
                              f"reads 16-byte rows in bfloat16")
    _check_expert_groups(data, model_type, experts_key)


def _setting(data: dict[str, Any], model_type: str, names: Sequence[str]) -> tuple[str, Any]:
    """(name, value) of one setting that goes by several ``names``: the first the config
    gives, else the first its class takes, with that default."""
    name = next((k for k in names if k in data), None)
    if name is None:
        name = next((k for k in names if k in _init_parameters(model_type)), names[0])
    return name, data.get(name, _default(model_type, name))


def _defaulted(data: dict[str, Any], model_type: str, key: str) -> str:
    """What a message adds after a value the config left to its class's default."""
    return "" if key in data else f" ({model_type}'s default; set it)"


def _check_expert_groups(data: dict[str, Any], model_type: str, experts_key: str) -> None:
    """DeepSeek-V3's router picks ``topk_group`` of ``n_group`` equal groups of experts,
    each scored by its best two, then ``num_experts_per_tok`` experts in them; its defaults
    are sized for 256 experts, so a small ``n_routed_experts`` with them failed in
    torch.export (a view to ``[-1, 8, 0]``, "k not in range"), naming no key.  A model
    whose every layer is dense (``first_k_dense_replace``) builds no router."""
    if "n_group" not in _init_parameters(model_type):
        return
    value = {k: data.get(k, _default(model_type, k))
             for k in (experts_key, "n_group", "topk_group", "first_k_dense_replace")}
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value.values()):
        return  # transformers' own type checks, or the build's, name what is wrong
    experts, groups, chosen, dense = value.values()
    if dense >= data["num_hidden_layers"]:
        return
    if groups <= 0 or experts % groups or experts // groups < 2:
        raise ConfigError(f"n_group: {groups}{_defaulted(data, model_type, 'n_group')} must split {experts_key} "
                          f"{experts}{_defaulted(data, model_type, experts_key)} into equal groups of at least 2 "
                          f"experts: the router scores each group by its best two")
    if not 0 < chosen <= groups:
        raise ConfigError(f"topk_group: {chosen}{_defaulted(data, model_type, 'topk_group')} must be between 1 "
                          f"and n_group {groups}{_defaulted(data, model_type, 'n_group')}: the groups the "
                          f"router picks experts from")


def _init_parameters(model_type: str) -> Mapping[str, inspect.Parameter]:
    """The parameters of a model type's config class: what transformers fills in for a key
    left out, read without building a default config (starcoder2's warns that its own bos
    is not a token)."""
    return inspect.signature(CONFIG_MAPPING[model_type].__init__).parameters


def _default(model_type: str, key: str) -> Any:
    """A config class's default for ``key`` (None where its __init__ takes it as ``**kwargs``)."""
    parameter = _init_parameters(model_type).get(key)
    return None if parameter is None or parameter.default is inspect.Parameter.empty else parameter.default


def _check_rates(data: dict[str, Any]) -> None:
    """Dropout rates (``attention_dropout``, GPT-2's ``resid_pdrop``, ...) and norm epsilons
    (``rms_norm_eps``, ``layer_norm_epsilon``, ...): torch's dropout refuses a rate outside
    [0, 1] only when training starts, and a negative epsilon turns a norm to NaN; both
    planned without a word before."""
    for key, value in data.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if (key.endswith("dropout") or key.endswith("_pdrop")) and not 0 <= value <= 1:
            raise ConfigError(f"{key}: a dropout probability must be between 0 and 1, got {value!r}")
        if key.endswith(("_eps", "_epsilon")) and value < 0:
            raise ConfigError(f"{key}: a norm's epsilon must not be negative, got {value!r}")


def _check_dtype(data: dict[str, Any]) -> None:
    """transformers looks a dtype name up as an attribute of ``torch`` (an AttributeError
    for a name that is not there; ``"Tensor"`` or a number pass through unchecked); a
    dict from Python may hold the ``torch.dtype`` itself."""
    for key in ("torch_dtype", "dtype"):
        value = data.get(key)
        dtype = getattr(torch, value, None) if isinstance(value, str) else value
        if value is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ConfigError(f"{key}: expected a floating-point torch dtype name such as \"bfloat16\" or "
                              f"\"float32\", got {value!r}")


def _check_activation(data: dict[str, Any], key: str) -> None:
    """The model looks its activation up in transformers' ``ACT2FN`` (a KeyError there)."""
    if key in data and (not isinstance(data[key], str) or data[key] not in ACT2FN):
        raise ConfigError(f"{key}: unknown activation {data[key]!r} (transformers' ACT2FN has: "
                          f"{', '.join(sorted(ACT2FN))})")


def _check_rope(data: dict[str, Any]) -> None:
    """The rotary embedding looks ``rope_type`` up in transformers' ``ROPE_INIT_FUNCTIONS``
    (a KeyError there); ``rope_scaling`` is the older name of ``rope_parameters``, and
    ``type`` of ``rope_type``.  A dict of dicts holds one per layer type."""
    for field in ("rope_parameters", "rope_scaling"):
        params = data.get(field)
        if params is None:
            continue
        if not isinstance(params, Mapping):
            raise ConfigError(f"{field}: must be an object, got {params!r}")
        nested = bool(params) and all(isinstance(v, Mapping) or v is None for v in params.values())
        entries = ([(f"{field}.{k}", v) for k, v in params.items() if v is not None] if nested
                   else [(field, params)])
        for where, entry in entries:
            key = "rope_type" if "rope_type" in entry or "type" not in entry else "type"
            rope_type = entry.get(key, "default")
            if rope_type not in _ROPE_TYPES:
                raise ConfigError(f"{where}.{key}: unknown RoPE type {rope_type!r} "
                                  f"(supported: {', '.join(_ROPE_TYPES)})")


def _check_rope_per_layer_type(data: dict[str, Any], model_type: str) -> None:
    """A model that looks its rotary settings up by layer type, with none in its class's
    defaults, failed to build with a bare ``KeyError: 'full_attention'``."""
    params = data.get("rope_parameters")
    kinds = sorted(set(data.get("layer_types") or ("full_attention", "sliding_attention")))
    missing = [k for k in kinds if not isinstance(params, Mapping) or not isinstance(params.get(k), Mapping)]
    if missing:
        example = ", ".join(f'"{k}": {{"rope_type": "default", "rope_theta": 10000.0}}' for k in kinds)
        raise ConfigError(f"rope_parameters: a {model_type} config needs one object per layer type, and there "
                          f"is none for {', '.join(missing)} (its class gives no default): e.g. {{{example}}}")


_CONFIG_ERRORS = (TypeError, ValueError, LookupError, AttributeError, ArithmeticError, AssertionError,
                  StrictDataclassError)


def _config_error(e: Exception, data: dict[str, Any], kwargs: dict[str, Any]) -> ConfigError:
    """transformers' own rejection as a ConfigError naming the field.  Its strict-dataclass
    errors print the field on one line and the problem (the cause) on the next; a rule
    across fields (RoPE's) names the fields it checks in backquotes.  Where the message
    names none (a ZeroDivisionError in a ``__post_init__``), the key without which the
    config builds is named."""
    cause = e.__cause__ or e
    problem = (str(cause.args[0]) if isinstance(cause, KeyError) and cause.args else str(cause)).strip()
    problem = problem.splitlines()[0] if problem else type(cause).__name__
    if isinstance(cause, (ArithmeticError, AssertionError, IndexError)):  # a crash, not a check
        problem = f"transformers fails on it ({type(cause).__name__}: {problem})"
    field = re.search(r"(?:field|property) '(\w+)'", str(e))
    names = [field[1]] if field else re.findall(r"`(\w+)`", problem)
    for name in names:
        if name == "rope_parameters" and "rope_scaling" in data:
            name = "rope_scaling"
        if name in data:
            return ConfigError(f"{name}: {problem}")
    for key in kwargs:  # building a config takes milliseconds: try each key at its default
        try:
            _for_model(data["model_type"], {k: v for k, v in kwargs.items() if k != key})
        except _CONFIG_ERRORS:
            continue
        value = repr(kwargs[key])
        value = value if len(value) <= 60 else value[:57] + "..."
        return ConfigError(f"{key}: {value} is not a valid {data['model_type']} {key}: {problem}")
    return ConfigError(f"model: invalid {data['model_type']} config: {problem}")


def _for_model(model_type: str, kwargs: dict[str, Any]) -> PretrainedConfig:
    """``AutoConfig.for_model``, with a whole number given for a float field taken as that
    float: JSON has one number type, and a client serialising 1.0 sends 1, which
    transformers' strict dataclass fields refuse ("expected float, got int")."""
    while True:
        try:
            return AutoConfig.for_model(model_type, **kwargs)
        except StrictDataclassError as e:
            field = re.search(r"field '(\w+)' expected float, got int", str(e), re.IGNORECASE)
            value = kwargs.get(field[1]) if field else None
            if not isinstance(value, int) or isinstance(value, bool) or abs(value) > 1e308:
                raise  # (float() of an int past the largest float overflows)
            kwargs = {**kwargs, field[1]: float(value)}


def load_config(source: str | Path | Mapping[str, Any] | PretrainedConfig) -> PretrainedConfig:
    """A validated Hugging Face config from a preset name, a config.json path or a dict."""
    if isinstance(source, PretrainedConfig):
        _check(source.to_dict())
        return source
    name, data = _read_mapping(source)
    _check(data)
    kwargs = {k: v for k, v in data.items() if k not in ("model_type", "transformers_version")}
    try:
        config = _for_model(data["model_type"], kwargs)
    except _CONFIG_ERRORS as e:
        # AttributeError: a key naming a read-only property (sub_configs), or one of the
        # wrong type that the config's own __init__ reads (id2label as a string);
        # ArithmeticError: a value its __post_init__ divides by (EXAONE 4's null
        # sliding_window_pattern, a 500 over HTTP before; black-box review)
        raise _config_error(e, data, kwargs) from None
    config.name_or_path = name
    return config


DEFAULT_SEQ_LEN_CAP = 4096


def default_seq_len(source: Any) -> int:
    """The sequence length used where none is given (plan, estimate, trace, the service):
    the model's maximum positions, capped at ``DEFAULT_SEQ_LEN_CAP``; the cap for a
    module without a config."""
    config = getattr(source, "config", None) if isinstance(source, nn.Module) else load_config(source)
    return min(DEFAULT_SEQ_LEN_CAP, max_positions(config) or DEFAULT_SEQ_LEN_CAP)


def max_positions(config: Any) -> int | None:
    """The longest sequence the model takes, where its config says (GPT-2's n_positions is
    its max_position_embeddings through the attribute_map; MPT's alibi table is built for
    max_seq_len)."""
    return getattr(config, "max_position_embeddings", None) or getattr(config, "max_seq_len", None)


def model_name(source: Any) -> str:
    """What a plan records as ``model``."""
    if isinstance(source, nn.Module):
        return type(source).__name__
    if isinstance(source, PretrainedConfig):
        return source.name_or_path or source.model_type
    if isinstance(source, Mapping):
        return f"hf_config:{source.get('model_type', '?')}"
    return str(source)


_BUILD_ERRORS = (TypeError, ValueError, KeyError, AttributeError, RuntimeError, ArithmeticError,
                 AssertionError)  # torch.nn.Embedding asserts its padding_idx is in the vocabulary
_CULPRIT_TRIALS = 32  # keys tried at most when naming the one a build fails on


def _given(config: PretrainedConfig) -> dict[str, Any]:
    return {k: v for k, v in config.to_dict().items() if k not in ("model_type", "transformers_version")}


def _builds(config_type: type[PretrainedConfig], kwargs: dict[str, Any]) -> bool:
    """Whether a model builds on the meta device from these settings (nothing allocated)."""
    try:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(config_type(**kwargs), trust_remote_code=False)
    except Exception:  # noqa: BLE001 - any failure counts
        return False
    return True


def _culprit(config: PretrainedConfig) -> str | None:
    """The one key of ``config`` without which (at its class's default) its model builds:
    what a message about a model transformers cannot build names.  Only on that error's
    path; one meta-device build per key the config sets (~1 s each for Llama 3 405B),
    the keys its class knows first, at most ``_CULPRIT_TRIALS``."""
    given, kind = _given(config), type(config)
    if _builds(kind, given):  # the round trip through to_dict lost what failed: no key to blame
        return None
    defaults = kind().to_dict()
    changed = [k for k in given if not (k in defaults and defaults[k] == given[k])]
    changed.sort(key=lambda k: k not in defaults)
    return next((k for k in changed[:_CULPRIT_TRIALS] if _builds(kind, {n: v for n, v in given.items() if n != k})),
                None)


def build_model(config: PretrainedConfig, device: str | torch.device = "meta",
                dtype: torch.dtype = torch.float32) -> nn.Module:
    """The unchanged Hugging Face causal LM for ``config``; never runs remote code."""
    # SDPA where the model class takes it; eager where transformers refuses it (Gemma 2's and
    # VaultGemma's logit soft-capping, the attention sinks of GPT-OSS, Granite-SWA, MiMo-V2-Flash)
    supports_sdpa = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]._supports_sdpa
    config._attn_implementation = "sdpa" if supports_sdpa else "eager"
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=False, dtype=dtype)
    except _BUILD_ERRORS as e:
        if torch.device(device).type != "meta" and _builds(type(config), _given(config)):
            raise  # the config builds: the device failed (out of memory, ...), not the config
        # transformers checks a config's fields only as far as its dataclass types go; a
        # value it accepted may still break the modules it builds (a string rope_theta in a
        # power, a dict where a sub-config object is read, a negative width)
        problem = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        key = _culprit(config)
        if key is None:
            raise ConfigError(f"model: transformers cannot build a {config.model_type} model from this "
                              f"config: {problem}") from e
        raise ConfigError(f"{key}: transformers cannot build a {config.model_type} model with "
                          f"{key}={getattr(config, key, None)!r}: {problem}") from e
    if model.loss_type is None:
        # transformers derives the loss from the class name, which GPT2LMHeadModel does not
        # match, and then warns on every trace that it falls back to the causal-LM loss.
        # Naming that same loss here keeps the computation and silences only that warning.
        model.loss_type = "ForCausalLM"
    return model
