"""Transformer shape facts from a Hugging Face config, and analytic training FLOPs.

Used to validate the graph-level cost (FLOPs, parameter counts) and to compute
MFU; it reads the config, never builds a model, so it works for 405B instantly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only for annotations: importing transformers costs seconds
    from transformers import PretrainedConfig

# Model families whose decoder layer is attention + SwiGLU MLP (gate, up, down) with
# RMSNorm (weight only); GPT-2 is attention + GELU MLP (fc, proj) with biased LayerNorm.
_LLAMA_LIKE = ("llama", "mistral", "qwen2", "mixtral")
_QKV_BIAS_DEFAULT = {"qwen2": True}


@dataclass(frozen=True)
class ModelSpec:
    """Shapes and parameter counts of a decoder-only transformer."""

    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    experts: int  # 1 for dense models
    experts_per_token: int  # 1 for dense models
    tied_embeddings: bool
    num_params: int  # exact, as the HF model has them
    active_params: int  # parameters one token uses (MoE: top-k experts only)
    embedding_params: int  # lookup tables (token + learned position), no matmul FLOPs

    @classmethod
    def from_hf_config(cls, config: PretrainedConfig) -> ModelSpec:
        """Counts follow the HF modelling code of each supported ``model_type``."""
        mt = config.model_type
        if mt not in (*_LLAMA_LIKE, "gpt2"):
            raise ValueError(f"model_type: {mt!r} is not supported by the cost model")
        h, layers, heads = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or h // heads
        vocab, tied = config.vocab_size, bool(getattr(config, "tie_word_embeddings", False))
        q, k = heads * head_dim, kv * head_dim
        if mt == "gpt2":
            ffn = config.n_inner or 4 * h
            attn = h * 3 * h + 3 * h + h * h + h  # c_attn and c_proj, with biases
            expert = h * ffn + ffn + ffn * h + h  # c_fc and c_proj, with biases
            router, norms = 0, 2 * 2 * h  # ln_1, ln_2 weight + bias
            embed = vocab * h + config.n_positions * h
            final_norm = 2 * h
            experts, top_k = 1, 1
        else:
            ffn = config.intermediate_size
            qkv_bias = getattr(config, "attention_bias", _QKV_BIAS_DEFAULT.get(mt, False))
            o_bias = getattr(config, "attention_bias", False) if mt != "qwen2" else False
            attn = h * q + 2 * h * k + q * h + (q + 2 * k if qkv_bias else 0) + (h if o_bias else 0)
            mlp_bias = getattr(config, "mlp_bias", False)
            expert = 3 * h * ffn + ((2 * ffn + h) if mlp_bias else 0)
            experts = getattr(config, "num_local_experts", None) or 1
            top_k = (getattr(config, "num_experts_per_tok", None) or 1) if experts > 1 else 1
            router = h * experts if experts > 1 else 0
            norms, embed, final_norm = 2 * h, vocab * h, h
        head = 0 if tied else vocab * h
        shared = attn + router + norms
        total = layers * (shared + experts * expert) + embed + final_norm + head
        active = layers * (shared + top_k * expert) + embed + final_norm + head
        return cls(
            model_type=mt, layers=layers, hidden=h, heads=heads, kv_heads=kv, head_dim=head_dim,
            ffn=ffn, vocab=vocab, experts=experts, experts_per_token=top_k, tied_embeddings=tied,
            num_params=total, active_params=active, embedding_params=embed,
        )  # fmt: skip

    @property
    def matmul_params(self) -> int:
        """Parameters a token multiplies by: active minus lookup tables plus the output head.

        The embedding lookup costs no FLOPs, but the LM head is a vocab x hidden
        matmul even when it shares the embedding's storage (tied).
        """
        head = self.vocab * self.hidden if self.tied_embeddings else 0  # untied: already counted
        return self.active_params - self.embedding_params + head


def training_flops(spec: ModelSpec, batch: int, seq: int, causal: bool = False) -> float:
    """FLOPs of one training step (forward + backward) on ``batch`` sequences of ``seq``.

    6*N*T for the weight matmuls (N = matmul parameters, T = tokens) plus the
    attention score/value matmuls, 12 * layers * seq * (heads*head_dim) per token.
    ``causal=True`` halves the attention term as causal kernels skip the masked
    half; the default counts it whole, the convention MFU figures use (PaLM,
    Megatron), so our MFU is comparable with theirs.
    """
    if batch < 1 or seq < 1:
        raise ValueError(f"batch={batch} and seq={seq} must be >= 1")
    tokens = batch * seq
    attention = 12 * spec.layers * seq * spec.heads * spec.head_dim * tokens
    return 6 * spec.matmul_params * tokens + (attention / 2 if causal else attention)


def mfu(
    flops_per_step: float, step_time_s: float, devices: int, peak_flops_per_device: float
) -> float:
    """Model FLOPs utilisation: useful FLOP/s over the cluster's dense peak."""
    if step_time_s <= 0 or devices < 1 or peak_flops_per_device <= 0:
        raise ValueError(
            f"mfu: step_time_s={step_time_s}, devices={devices}, peak={peak_flops_per_device} must be positive"
        )
    return flops_per_step / (step_time_s * devices * peak_flops_per_device)
