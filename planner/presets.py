"""Model presets and config loading.

Presets are Hugging Face configs built in code from the published shapes, so
planning never downloads anything.  Any ``config.json`` of a supported
``model_type`` works too; the config is validated here, before a model is built,
so that a typo gives a one-line error instead of an OOM or a hang.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "gpt2", "mixtral")


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
    "vocab_size": 4194304,
    "num_local_experts": 1024,
    "num_experts_per_tok": 64,
}
_REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


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
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"model: cannot read {path} as JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"model: {path} must hold a JSON object")
    return str(path), data


def _check(data: dict[str, Any]) -> None:
    model_type = data.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"model_type: {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    if model_type == "gpt2":
        aliases = {"n_embd": "hidden_size", "n_layer": "num_hidden_layers", "n_head": "num_attention_heads"}
        data = {aliases.get(k, k): v for k, v in data.items()}
    for key in _REQUIRED:
        if key not in data:
            raise ConfigError(f"{key}: missing from the {model_type} config")
    for key, limit in _LIMITS.items():
        if key not in data or data[key] is None:
            continue
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: must be an integer, got {value!r}")
        if value <= 0:
            raise ConfigError(f"{key}: must be positive, got {value}")
        if value > limit:
            raise ConfigError(f"{key}: {value} is beyond the sanity limit {limit}")
    heads = data["num_attention_heads"]
    if data["hidden_size"] % heads and "head_dim" not in data:
        raise ConfigError(f"hidden_size: {data['hidden_size']} is not divisible by num_attention_heads {heads}")
    kv = data.get("num_key_value_heads")
    if kv and heads % kv:
        raise ConfigError(f"num_key_value_heads: {kv} does not divide num_attention_heads {heads}")


def load_config(source: str | Path | Mapping[str, Any] | PretrainedConfig) -> PretrainedConfig:
    """A validated Hugging Face config from a preset name, a config.json path or a dict."""
    if isinstance(source, PretrainedConfig):
        _check(source.to_dict())
        return source
    name, data = _read_mapping(source)
    _check(data)
    kwargs = {k: v for k, v in data.items() if k not in ("model_type", "transformers_version")}
    try:
        config = AutoConfig.for_model(data["model_type"], **kwargs)
    except (TypeError, ValueError, StrictDataclassError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"model: invalid {data['model_type']} config: {first}") from None
    config.name_or_path = name
    return config


def model_name(source: Any) -> str:
    """What a plan records as ``model``."""
    if isinstance(source, nn.Module):
        return type(source).__name__
    if isinstance(source, PretrainedConfig):
        return source.name_or_path or source.model_type
    if isinstance(source, Mapping):
        return f"hf_config:{source.get('model_type', '?')}"
    return str(source)


def build_model(config: PretrainedConfig, device: str | torch.device = "meta",
                dtype: torch.dtype = torch.float32) -> nn.Module:
    """The unchanged Hugging Face causal LM for ``config``; never runs remote code."""
    config._attn_implementation = "sdpa"
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=False, dtype=dtype)
