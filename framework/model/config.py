"""Model hyper-parameters, read once from a Hugging Face config.

Only the llama family is supported (Llama, Mistral, Qwen2): they share one architecture and differ
in a few switches (attention bias, tied embeddings, RoPE scaling), which all live here so that the
model code never looks at the HF config itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from framework.config import SettingsError

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
    # The model's own max_position_embeddings; `context_len` is less where a sliding window caps it.
    max_position_embeddings: int = 0
    # Attention to only the last this many tokens (Mistral 7B v0.1, Qwen2 with use_sliding_window);
    # None: full attention. Our attention is full, the same within the window (see context_len).
    sliding_window: int | None = None
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
        act = getattr(hf_config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"Unsupported hidden_act {act!r}: the llama family's MLP is SiLU(gate) * up")
        rope = _rope_parameters(hf_config)
        rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"Unsupported rope_type {rope_type!r}; supported: 'default', 'llama3'")
        # Llama has an explicit attention_bias switch; Qwen2 always has q/k/v bias.
        attention_bias = bool(getattr(hf_config, "attention_bias", False)) or _SUPPORTED_ARCHS[arch]
        eos = getattr(hf_config, "eos_token_id", None)
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        window = _sliding_window(hf_config)
        max_positions = hf_config.max_position_embeddings
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
            # Up to the window, full attention sees what the window does: the same outputs.
            context_len=min(max_positions, window) if window else max_positions,
            max_position_embeddings=max_positions,
            sliding_window=window,
            tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            attention_bias=attention_bias,
            rope_type=rope_type,
            rope_scaling=dict(rope),
            bos_token_id=getattr(hf_config, "bos_token_id", None),
            eos_token_ids=eos_ids,
            is_embedding=is_embedding,
            hf_config=hf_config,
        )


def context_len_to_serve(config: ModelConfig, context_length: int | None) -> int:
    """`context_length` (model.context_length), or the model's when None. A longer one is refused,
    as the reference does: positions the model was not trained on (or, with a sliding window,
    attention past the window, which ours does not implement) give wrong outputs."""
    if context_length is None:
        return config.context_len
    if context_length > config.context_len:
        if config.sliding_window is not None:
            why = ("its sliding attention window: our attention is full, which gives the model's outputs only "
                   "within the window")
        else:
            why = "its max_position_embeddings"
        raise SettingsError(f"invalid settings:\nmodel.context_length: {context_length} is longer than the "
                            f"model's context of {config.context_len} tokens ({why})")
    return context_length


def _arch_from_model_type(model_type: str) -> str:
    return {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}.get(
        model_type, model_type
    )


def _sliding_window(hf_config: Any) -> int | None:
    """The window of a config whose layers (all or some) attend to only the last `sliding_window`
    tokens, else None. Qwen2 configs carry a window that only `use_sliding_window` turns on, and
    transformers 5 says per layer (`layer_types`)."""
    window = getattr(hf_config, "sliding_window", None)
    if not window or getattr(hf_config, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


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
