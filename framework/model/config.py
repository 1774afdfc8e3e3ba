"""Model hyper-parameters, read once from a Hugging Face config.

Only the llama family is supported (Llama, Mistral, Qwen2): they share one architecture and differ
in a few switches (attention bias, tied embeddings, RoPE scaling), which all live here so that the
model code never looks at the HF config itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# HF architecture name -> whether q/k/v projections carry a bias.
_SUPPORTED_ARCHS = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
}
# Embedding architectures (reference Y1, llama family): the decoder without its LM head, named
# here by the generation architecture with the same decoder.
_EMBEDDING_ARCHS = {
    "LlamaModel": "LlamaForCausalLM",
    "LlamaEmbeddingModel": "LlamaForCausalLM",
    "MistralModel": "MistralForCausalLM",
    "Qwen2Model": "Qwen2ForCausalLM",
}


@dataclass
class ModelConfig:
    """Everything the model, the KV pool and the runner need to know about a checkpoint."""

    architecture: str  # the generation architecture of the decoder (see _EMBEDDING_ARCHS)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    context_len: int
    tie_word_embeddings: bool
    attention_bias: bool
    # RoPE scaling: "default" or "llama3" (with its parameters in rope_scaling).
    rope_type: str = "default"
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # The checkpoint is a decoder without LM head: an embedding model.
    is_embedding: bool = False
    hf_config: Any = None

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> "ModelConfig":
        archs = getattr(hf_config, "architectures", None) or []
        arch = archs[0] if archs else _arch_from_model_type(hf_config.model_type)
        is_embedding = arch in _EMBEDDING_ARCHS
        arch = _EMBEDDING_ARCHS.get(arch, arch)
        if arch not in _SUPPORTED_ARCHS:
            supported = sorted(_SUPPORTED_ARCHS) + sorted(_EMBEDDING_ARCHS)
            raise ValueError(f"Unsupported architecture {arch!r}; supported: {supported}")
        num_heads = hf_config.num_attention_heads
        num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or num_heads
        # Mistral configs may carry head_dim=None; derive it like HF does.
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
        if getattr(hf_config, "mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported")
        rope = _rope_parameters(hf_config)
        rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"Unsupported rope_type {rope_type!r}")
        # Llama has an explicit attention_bias switch; Qwen2 always has q/k/v bias.
        attention_bias = bool(getattr(hf_config, "attention_bias", False)) or _SUPPORTED_ARCHS[arch]
        eos = getattr(hf_config, "eos_token_id", None)
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            architecture=arch,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=hf_config.rms_norm_eps,
            rope_theta=float(rope["rope_theta"]),
            context_len=hf_config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=attention_bias,
            rope_type=rope_type,
            rope_scaling=dict(rope),
            bos_token_id=getattr(hf_config, "bos_token_id", None),
            eos_token_ids=eos_ids,
            is_embedding=is_embedding,
            hf_config=hf_config,
        )


def _arch_from_model_type(model_type: str) -> str:
    return {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}.get(
        model_type, model_type
    )


def _rope_parameters(hf_config: Any) -> dict[str, Any]:
    """RoPE settings from either transformers 5 (`rope_parameters`) or older configs.

    transformers 5 folds `rope_theta` and `rope_scaling` into one `rope_parameters` dict; older
    versions keep `rope_theta` as an attribute and the scaling dict (if any) in `rope_scaling`.
    """
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return dict(params)
    out: dict[str, Any] = dict(getattr(hf_config, "rope_scaling", None) or {})
    out["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    return out
