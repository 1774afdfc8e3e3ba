"""LoRA adapters served side by side in one batch (reference section AB).

Adapters are PEFT folders (`adapter_config.json` + `adapter_model.safetensors` or `.bin`) loaded
once at start-up. Each linear layer an adapter targets is wrapped in a `LoraLinear` that holds the
A and B weights of *every* adapter stacked along a leading adapter axis; B is pre-multiplied by
the adapter's scaling. Our q/k/v and gate/up projections are fused, so an adapter's A matrices of
the parts are stacked along the rank axis and its B matrices placed block-diagonally.

A forward pass carries one adapter name (or None, the base model) per request. `LoraManager.prepare`
turns that into an adapter index per token; each wrapped layer then adds, for each adapter present,
``(x[rows] @ A[a].T) @ B[a].T`` to that adapter's rows only. One base matmul serves the whole batch
and the LoRA part is one gather + two small matmuls per adapter present (at most
max_loras_per_batch); tokens of base-model requests get nothing added.

The model may run a layer's token-wise parts in tiles of rows (llama.py's prefill tiling), so a
wrapped layer sees the pass's tokens in one call or in consecutive row blocks, in order. Each
wrapper keeps its own row cursor over the pass for that reason; the model code needs no LoRA hook.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from framework.batch import ModelWorkerBatch

# Our module -> the HF modules fused into it, in order.
FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
PART_TO_MODULE = {part: module for module, parts in FUSED_MODULES.items() for part in parts}
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


def parse_lora_paths(entries: list[str]) -> dict[str, str]:
    """``["name=path", "path", ...]`` -> {name: path}; a bare path is its own name (as the reference)."""
    adapters: dict[str, str] = {}
    for entry in entries:
        name, sep, path = entry.partition("=")
        if not sep:
            name = path = entry
        name, path = name.strip(), path.strip()
        if not name or not path:
            raise ValueError(f"lora_paths: expected name=path or path, got {entry!r}")
        if name in adapters:
            raise ValueError(f"lora_paths: adapter name {name!r} is given twice")
        adapters[name] = path
    return adapters


@dataclass
class LoraAdapter:
    """One adapter's weights by (layer, HF part name): (A [r, in], B [out, r] * scaling)."""

    name: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def _read_config(path: str) -> dict:
    config_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_file):
        raise FileNotFoundError(f"LoRA adapter {path}: no adapter_config.json")
    try:
        with open(config_file) as f:
            config = json.load(f)
    except ValueError as exc:
        raise ValueError(f"LoRA adapter {path}: adapter_config.json is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {path}: adapter_config.json must hold an object")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {path}: a {config['peft_type']} adapter, not LoRA")
    rank, alpha = config.get("r"), config.get("lora_alpha", 1)
    if type(rank) is not int or rank <= 0:
        raise ValueError(f"LoRA adapter {path}: adapter_config.json: r must be a positive integer, got {rank!r}")
    if type(alpha) not in (int, float):
        raise ValueError(f"LoRA adapter {path}: adapter_config.json: lora_alpha must be a number, got {alpha!r}")
    if config.get("use_dora"):
        raise ValueError(f"LoRA adapter {path}: DoRA adapters are not supported")
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError(f"LoRA adapter {path}: per-module rank_pattern/alpha_pattern are not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {path}: bias={config['bias']!r} is not supported")
    return config


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    st_file = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(st_file):
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(st_file)
        except SafetensorError as exc:
            raise ValueError(f"LoRA adapter {path}: cannot read adapter_model.safetensors ({exc})") from None
    bin_file = os.path.join(path, "adapter_model.bin")
    if os.path.isfile(bin_file):
        return torch.load(bin_file, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"LoRA adapter {path}: no adapter_model.safetensors or adapter_model.bin")


def load_adapter(name: str, path: str) -> LoraAdapter:
    """Read a PEFT LoRA folder; B is scaled by lora_alpha / r (or / sqrt(r) with rsLoRA)."""
    config = _read_config(path)
    rank = int(config["r"])
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in _read_tensors(path).items():
        match = _KEY.search(key)
        if match is None or match.group(2) not in PART_TO_MODULE:
            raise ValueError(f"LoRA adapter {path}: unsupported weight {key!r} "
                             f"(supported targets: {', '.join(PART_TO_MODULE)})")
        layer, part, half = int(match.group(1)), match.group(2), match.group(3)
        halves.setdefault((layer, part), {})[half] = tensor.float()
    adapter = LoraAdapter(name=name, rank=rank)
    for where, pair in halves.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path}: layer {where[0]} {where[1]} lacks lora_A or lora_B")
        adapter.weights[where] = (pair["A"], pair["B"] * scaling)
    return adapter


class LoraBatchState:
    """What the wrapped layers read during one pass: the adapter index of every token (-1: base
    model), None when no token has an adapter, and the adapters present."""

    def __init__(self):
        self.token_adapters: torch.Tensor | None = None
        self.adapters: list[int] = []
        self.pass_id = 0

    def start_pass(self, token_adapters: torch.Tensor | None) -> None:
        self.token_adapters = token_adapters
        present = [] if token_adapters is None else token_adapters.unique().tolist()
        self.adapters = [a for a in present if a >= 0]
        self.pass_id += 1


class LoraLinear(nn.Module):
    """A linear layer plus the LoRA deltas of the adapters present in the current pass.

    `lora_a` is [num_adapters, rank, in], `lora_b` [num_adapters, out, rank] (zeros where an
    adapter does not target this module, or for the unused rows of a smaller rank)."""

    def __init__(self, base: nn.Module, lora_a: torch.Tensor, lora_b: torch.Tensor, state: LoraBatchState):
        super().__init__()
        self.base = base
        self.register_buffer("lora_a", lora_a, persistent=False)
        self.register_buffer("lora_b", lora_b, persistent=False)
        self.state = state
        self._pass_id = -1
        self._cursor = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        state = self.state
        if state.token_adapters is None:
            return out
        if self._pass_id != state.pass_id:
            self._pass_id, self._cursor = state.pass_id, 0
        num_rows = x.shape[0]
        token_adapters = state.token_adapters[self._cursor : self._cursor + num_rows]
        if len(token_adapters) != num_rows:
            raise RuntimeError(
                f"LoraLinear: called on more rows than the pass has ({len(state.token_adapters)})"
            )
        self._cursor += num_rows
        for adapter in state.adapters:
            rows = (token_adapters == adapter).nonzero().squeeze(1)
            if len(rows):
                delta = (x[rows] @ self.lora_a[adapter].T) @ self.lora_b[adapter].T
                out.index_add_(0, rows, delta.to(out.dtype))
        return out


class LoraManager:
    """The loaded adapters, by name, and their wrapped layers inside one model."""

    def __init__(self, model: nn.Module, adapter_paths: dict[str, str]):
        self.names = list(adapter_paths)
        self.index = {name: i for i, name in enumerate(self.names)}
        self.state = LoraBatchState()
        adapters = [load_adapter(name, path) for name, path in adapter_paths.items()]
        self._wrap_layers(model, adapters)

    def _wrap_layers(self, model: nn.Module, adapters: list[LoraAdapter]) -> None:
        layers = getattr(getattr(model, "model", None), "layers", None)
        if layers is None:
            raise ValueError(f"model.lora_paths: LoRA adapters are served on llama-family text models only, "
                             f"not {type(model).__name__}")
        targeted = {(layer, PART_TO_MODULE[part]) for a in adapters for layer, part in a.weights}
        for layer, _ in targeted:
            if layer >= len(layers):
                raise ValueError(f"LoRA adapter targets layer {layer}, the model has {len(layers)}")
        for layer_id, module_name in sorted(targeted):
            layer = layers[layer_id]
            parent = layer.self_attn if hasattr(layer.self_attn, module_name) else layer.mlp
            base = getattr(parent, module_name)
            lora_a, lora_b = self._stack(base, parent, layer_id, module_name, adapters)
            setattr(parent, module_name, LoraLinear(base, lora_a, lora_b, self.state))
        reset = getattr(model, "reset_decode_path", None)
        if reset is not None:  # the decode path calls the layers' kernels itself: not with adapters
            reset()

    @staticmethod
    def _stack(base, parent, layer_id: int, module_name: str, adapters: list[LoraAdapter]):
        parts = FUSED_MODULES[module_name]
        out_sizes = _part_sizes(parent, module_name, base.out_features)
        max_rank = max(a.rank for a in adapters) * len(parts)
        like = dict(dtype=base.weight.dtype, device=base.weight.device)
        lora_a = torch.zeros(len(adapters), max_rank, base.in_features, **like)
        lora_b = torch.zeros(len(adapters), base.out_features, max_rank, **like)
        for i, adapter in enumerate(adapters):
            row = col = 0
            for part, out_size in zip(parts, out_sizes):
                pair = adapter.weights.get((layer_id, part))
                if pair is not None:
                    a, b = pair
                    if a.shape != (adapter.rank, base.in_features) or b.shape != (out_size, adapter.rank):
                        raise ValueError(
                            f"LoRA adapter {adapter.name!r}: layer {layer_id} {part} has shapes "
                            f"{tuple(a.shape)}/{tuple(b.shape)}, expected "
                            f"{(adapter.rank, base.in_features)}/{(out_size, adapter.rank)}"
                        )
                    lora_a[i, col : col + adapter.rank] = a
                    lora_b[i, row : row + out_size, col : col + adapter.rank] = b
                col += adapter.rank
                row += out_size
        return lora_a, lora_b

    def prepare(self, batch: "ModelWorkerBatch") -> None:
        """Give the wrapped layers this pass's adapter index per token."""
        if batch.lora_paths is None:
            self.state.start_pass(None)
            return
        device = batch.input_ids.device
        per_req = torch.tensor([-1 if n is None else self.index[n] for n in batch.lora_paths], device=device)
        per_token = torch.repeat_interleave(per_req, torch.tensor(batch.extend_lens, device=device))
        self.state.start_pass(per_token)


def _part_sizes(parent: nn.Module, module_name: str, out_features: int) -> tuple[int, ...]:
    if module_name == "qkv_proj":
        return (parent.q_size, parent.kv_size, parent.kv_size)
    if module_name == "gate_up_proj":
        return (parent.intermediate_size, parent.intermediate_size)
    return (out_features,)
