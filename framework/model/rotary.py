"""Rotary position embedding (the "rotate half" layout HF llama checkpoints use)."""

from __future__ import annotations

import math

import torch
from torch import nn

from framework.model.config import ModelConfig


def _inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if config.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, config.rope_scaling)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths are divided by `factor`, short ones kept,
    and the band in between is interpolated smoothly."""
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables indexed by absolute position; grown on demand past the context length."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.head_dim = config.head_dim
        self.register_buffer("inv_freq", _inv_freq(config), persistent=False)
        # Buffers, so that `model.to(device)` moves the tables too.
        self.register_buffer("_cos", torch.empty(0), persistent=False)
        self.register_buffer("_sin", torch.empty(0), persistent=False)
        self._build(config.context_len)

    def _build(self, max_len: int) -> None:
        t = torch.arange(max_len, dtype=torch.float32, device=self.inv_freq.device)
        freqs = torch.outer(t, self.inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_len, head_dim]
        self._cos, self._sin = emb.cos(), emb.sin()

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> "RopeTables":
        """cos/sin of `positions`, looked up once per forward pass and shared by all layers."""
        if positions.numel() and int(positions.max()) >= self._cos.shape[0]:
            self._build(int(positions.max()) * 2)
        half = self.head_dim // 2
        # The table's two halves are equal (cat(freqs, freqs)); one half is enough.
        cos = self._cos[positions, :half].unsqueeze(1).to(dtype)
        sin = self._sin[positions, :half].unsqueeze(1).to(dtype)
        return RopeTables(cos, sin)


class RopeTables:
    """Per-pass cos/sin, [T, 1, head_dim / 2]."""

    __slots__ = ("cos", "sin")

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        self.cos = cos
        self.sin = sin

    def tile(self, rows: slice) -> "RopeTables":
        return RopeTables(self.cos[rows], self.sin[rows])

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D] (any strides) -> rotated, contiguous, same dtype.

        HF's `x * cos + rotate_half(x) * sin` computed half by half: the first half is
        x1*cos - x2*sin and the second x2*cos + x1*sin, the same roundings as HF's
        `x1*cos + (-x2)*sin`, with no concatenated copy of x.
        """
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        out1, out2 = out[..., :half], out[..., half:]
        torch.mul(x1, self.cos, out=out1).sub_(x2 * self.sin)
        torch.mul(x2, self.cos, out=out2).add_(x1 * self.sin)
        return out
