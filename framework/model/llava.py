"""A llava-style vision-language model: a CLIP vision encoder, a two-layer projector, our llama.

Loads `LlavaForConditionalGeneration` checkpoints (config with `vision_config`, `text_config`,
`image_token_index`). The vision encoder is transformers' own module (it runs once per image, not
per token, so it needs no paged KV); the language model is `LlamaForCausalLM` over the KV pool.

In an extend pass, each request's image features overwrite the embeddings of the pad ids that
`framework.multimodal.expand_image_tokens` put in the prompt; only the rows inside the pass's
range (after the cached prefix, within this chunk) are written, so a prefix that ends inside an
image or a chunk boundary inside one both line up.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from framework.batch import ModelWorkerBatch
from framework.distributed import ParallelContext
from framework.memory import ReqToTokenPool, TokenToKVPool
from framework.model.config import ModelConfig
from framework.model.llama import LlamaForCausalLM
from framework.multimodal import ImageInputs, ImageTokenInfo

ARCHITECTURE = "LlavaForConditionalGeneration"
# Checkpoint name prefixes (transformers >= 4.52 first, then the older layout) -> our submodule.
_PREFIXES = (
    ("model.vision_tower.", "vision_tower"),
    ("vision_tower.", "vision_tower"),
    ("model.multi_modal_projector.", "multi_modal_projector"),
    ("multi_modal_projector.", "multi_modal_projector"),
    ("model.language_model.", "language_model.model."),
    ("language_model.model.", "language_model.model."),
    ("language_model.lm_head.", "language_model.lm_head."),
    ("lm_head.", "language_model.lm_head."),
)


class LlavaProjector(nn.Module):
    def __init__(self, vision_hidden: int, text_hidden: int, bias: bool):
        super().__init__()
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias)
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x)))


class LlavaForCausalLM(nn.Module):
    def __init__(self, hf_config: Any, config: ModelConfig, par: ParallelContext | None = None):
        super().__init__()
        from transformers import AutoModel

        vision = hf_config.vision_config
        if getattr(hf_config, "projector_hidden_act", "gelu") != "gelu":
            raise ValueError(f"Unsupported projector_hidden_act {hf_config.projector_hidden_act!r}")
        if not isinstance(hf_config.vision_feature_layer, int):
            raise ValueError("Only one vision_feature_layer is supported")
        self.config = config
        self.language_model = LlamaForCausalLM(config, par)
        self.vision_tower = AutoModel.from_config(vision)
        self.multi_modal_projector = LlavaProjector(
            vision.hidden_size, config.hidden_size, getattr(hf_config, "multimodal_projector_bias", True)
        )
        self.feature_layer = hf_config.vision_feature_layer
        self.keep_cls = hf_config.vision_feature_select_strategy == "full"
        num_patches = (vision.image_size // vision.patch_size) ** 2
        self.image_info = ImageTokenInfo(hf_config.image_token_index, num_patches + int(self.keep_cls))

    @property
    def attn_backend(self):
        return self.language_model.attn_backend

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: ModelWorkerBatch,
        kv_pool: TokenToKVPool,
        req_to_token_pool: ReqToTokenPool,
        input_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if input_embeds is None and batch.forward_mode.is_extend() and any(batch.image_inputs or ()):
            input_embeds = self.embed_with_images(input_ids, batch)
        return self.language_model(
            input_ids, positions, batch, kv_pool, req_to_token_pool, input_embeds=input_embeds
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)

    # -- images ---------------------------------------------------------------------------------

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[num_images, C, H, W] -> [num_images, num_image_tokens, text_hidden]."""
        weight = self.multi_modal_projector.linear_1.weight
        out = self.vision_tower(pixel_values.to(weight.device, weight.dtype), output_hidden_states=True)
        features = out.hidden_states[self.feature_layer]
        if not self.keep_cls:
            features = features[:, 1:]
        return self.multi_modal_projector(features)

    def embed_with_images(self, input_ids: torch.Tensor, batch: ModelWorkerBatch) -> torch.Tensor:
        embeds = self.language_model.model.embed_tokens(input_ids)
        start = 0
        for images, pre_len, ext_len in zip(batch.image_inputs, batch.prefix_lens, batch.extend_lens):
            if images is not None:
                self._write_features(embeds[start : start + ext_len], images, pre_len, ext_len)
            start += ext_len
        return embeds

    def _write_features(self, rows: torch.Tensor, images: ImageInputs, pre_len: int, ext_len: int) -> None:
        """Overwrite the rows of `rows` (positions pre_len .. pre_len + ext_len) that hold image pads."""
        n = images.num_image_tokens
        needed = [j for j, off in enumerate(images.image_offsets) if off < pre_len + ext_len and off + n > pre_len]
        if not needed:  # every image of this request is in the cached prefix
            return
        features = self.encode_images(images.pixel_values[needed])
        for feature, j in zip(features, needed):
            off = images.image_offsets[j]
            lo, hi = max(off, pre_len), min(off + n, pre_len + ext_len)
            rows[lo - pre_len : hi - pre_len] = feature[lo - off : hi - off].to(rows.dtype)

    # -- weights --------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Route checkpoint tensors to the vision tower, the projector and the language model;
        every parameter must be set."""
        text: list[tuple[str, torch.Tensor]] = []
        vision: dict[str, torch.Tensor] = {}
        projector: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            for prefix, target in _PREFIXES:
                if name.startswith(prefix):
                    rest = name[len(prefix):]
                    break
            else:
                raise KeyError(f"Unexpected weight {name!r}")
            if target == "vision_tower":
                vision[rest] = tensor
            elif target == "multi_modal_projector":
                projector[rest] = tensor
            else:
                text.append((target[len("language_model."):] + rest, tensor))
        self.language_model.load_weights(text)
        self.vision_tower.load_state_dict(_match_nesting(vision, self.vision_tower), strict=True)
        self.multi_modal_projector.load_state_dict(projector, strict=True)


def _match_nesting(state: dict[str, torch.Tensor], module: nn.Module) -> dict[str, torch.Tensor]:
    """Add or drop the `vision_model.` level: transformers versions and checkpoints differ on it."""
    nested = next(iter(module.state_dict())).startswith("vision_model.")
    out = {}
    for name, tensor in state.items():
        bare = name[len("vision_model."):] if name.startswith("vision_model.") else name
        out["vision_model." + bare if nested else bare] = tensor
    return out


def is_llava(hf_config: Any) -> bool:
    return ARCHITECTURE in (getattr(hf_config, "architectures", None) or [])


def language_model_config(hf_config: Any) -> ModelConfig:
    """The config of the language model: a llava checkpoint's `text_config`, else the config itself."""
    return ModelConfig.from_hf_config(hf_config.text_config if is_llava(hf_config) else hf_config)


def build_model(hf_config: Any, par: ParallelContext | None = None) -> tuple[ModelConfig, nn.Module]:
    """The model for a checkpoint's config: llava for `LlavaForConditionalGeneration`, else llama;
    its language model sharded for this rank of `par` (the vision tower is whole on every rank)."""
    config = language_model_config(hf_config)
    if is_llava(hf_config):
        return config, LlavaForCausalLM(hf_config, config, par)
    return config, LlamaForCausalLM(config, par)
