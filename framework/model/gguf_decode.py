"""Decode steps on the GGUF file's own Q4_1 weights (`worker.gguf_decode`).

The model runs on the bf16 weights converted from its GGUF once (loader.convert_gguf). A decode
step's GEMMs read every layer weight once, ~210 MB of bf16 for SmolLM2-135M, and at decode sizes
they wait on those bytes. The embedded GGUF holds every layer weight as Q4_1 blocks (32 k of one
output column as d q + m, fp16 d and m, 4-bit q: 20 bytes where bf16 takes 64), so the packed
GEMM kernel's Q4_1 path (kernels/packed_gemm.c, q4_gemm_bf16) reads ~66 MB a step instead.
`use_gguf_decode` reads those blocks from the file the folder was converted from (recorded there
by the loader), in the rows of the converted weights (each head's q and k rows reordered back as
transformers' GGUF loader does; checked against the loaded weights on the first and last layers),
and gives the model their packed copies; the decode path (framework/model/decode_path.py) takes
them:

- "auto" (the default): passes of up to WIDEN_ROWS rows widen each block to bf16(d q + m), the
  conversion's own rounding of it, and run the bf16 path's tile or vector products on it: the
  same bits as the bf16 weights, from a third of the bytes.
- "exact": passes of up to EXACT_ROWS rows multiply by d q + m in fp32 (the bf16 activations,
  fp32 sums), the fastest at one request; their logits are the file's weights' rather than their
  bf16 roundings, so they differ from the bf16 layers' in the last bits. Larger passes as "auto".

Prefill and the LM head keep the bf16 weights.
"""

from __future__ import annotations

import json
import logging
import os
import struct

import numpy as np
import torch

logger = logging.getLogger(__name__)

# Written by loader.convert_gguf into each converted folder: the GGUF it came from.
SOURCE_FILE = "batchyard-gguf-source.json"
# Decode passes of up to EXACT_ROWS rows take the exact Q4_1 products with worker.gguf_decode =
# "exact", passes of up to WIDEN_ROWS rows the Q4_1 blocks widened to the bf16 weights (the same
# bits as those weights, on the AMX tiles or the AVX512-BF16 vectors as the bf16 GEMMs); larger
# passes the bf16 weights. Measured on a 2-core Xeon: docs/performance.md.
EXACT_ROWS = 4
WIDEN_ROWS = 256
# The GGUF names of a llama layer's weights, in the order of our fused ones: qkv, o, gate_up, down.
_PARTS = (("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",))


def write_source(folder: str, gguf_path: str) -> None:
    """Record in a converted folder the GGUF file it came from (its path, size and mtime)."""
    st = os.stat(gguf_path)
    record = {"gguf_file": gguf_path, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    path = os.path.join(folder, SOURCE_FILE)
    try:
        with open(path) as f:
            if json.load(f) == record:
                return
    except (OSError, ValueError):
        pass
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


def gguf_source(folder: str | None) -> str | None:
    """The GGUF file `folder` was converted from, while it is still the same file; else None."""
    if folder is None:
        return None
    try:
        with open(os.path.join(folder, SOURCE_FILE)) as f:
            record = json.load(f)
        st = os.stat(record["gguf_file"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if (st.st_size, st.st_mtime_ns) != (record.get("size"), record.get("mtime_ns")):
        return None
    return record["gguf_file"]


def _unpermute_rows(blocks: np.ndarray, heads: int) -> np.ndarray:
    """The rows of a q or k weight in the order of the HF checkpoint: llama.cpp's converter
    interleaves each head's two rotary halves, transformers' GGUF loader undoes it (its
    `_reverse_permute_weights`); the same on whole rows of blocks."""
    half = blocks.shape[0] // heads // 2
    return blocks.reshape(heads, half, 2, *blocks.shape[1:]).swapaxes(1, 2).reshape(blocks.shape)


# GGUF value types (the format's gguf_type) and the sizes of the fixed-size ones; 8: string, 9: array.
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGML_Q4_1 = 3  # ggml_type of Q4_1 blocks


class _Cursor:
    """Little-endian reads from a buffer (the GGUF header)."""

    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str):
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values

    def string(self) -> bytes:
        (size,) = self.unpack("Q")
        if self.pos + size > len(self.buf):
            raise struct.error(f"a string of {size} bytes at {self.pos} past the end")
        self.pos += size
        return bytes(self.buf[self.pos - size:self.pos])

    def skip_value(self, kind: int) -> None:
        if kind in _SCALAR_SIZES:
            self.pos += _SCALAR_SIZES[kind]
        elif kind == 8:
            self.string()
        elif kind == 9:
            item, count = self.unpack("IQ")
            if item in _SCALAR_SIZES:
                self.pos += _SCALAR_SIZES[item] * count
            else:
                for _ in range(count):
                    self.skip_value(item)
        else:
            raise ValueError(f"unknown GGUF value type {kind}")


def gguf_tensors(buf) -> dict[str, tuple[int, tuple[int, ...], int]]:
    """{name: (ggml type, shape as the file gives it (ne0 first), offset of its data in `buf`)}
    from a GGUF file's bytes (v2 or v3). The metadata is skipped but for the data alignment:
    gguf-py's reader builds an object per metadata value, ~3 s for SmolLM2's vocabulary."""
    try:
        return _gguf_tensors(_Cursor(buf))
    except struct.error as exc:  # a header that ends before it should
        raise ValueError(f"not a whole GGUF header: {exc}") from None


def _gguf_tensors(cur: _Cursor) -> dict[str, tuple[int, tuple[int, ...], int]]:
    magic, version = cur.unpack("4sI")
    if magic != b"GGUF" or version < 2:
        raise ValueError(f"not a GGUF v2+ file (magic {magic!r}, version {version})")
    tensor_count, kv_count = cur.unpack("QQ")
    alignment = 32
    for _ in range(kv_count):
        key = cur.string()
        (kind,) = cur.unpack("I")
        if key == b"general.alignment" and kind == 4:
            (alignment,) = cur.unpack("I")
        else:
            cur.skip_value(kind)
    infos = {}
    for _ in range(tensor_count):
        name = cur.string().decode()
        (dims,) = cur.unpack("I")
        shape = cur.unpack("Q" * dims)
        kind, offset = cur.unpack("IQ")
        infos[name] = (kind, shape, offset)
    if alignment <= 0:
        raise ValueError(f"GGUF alignment {alignment}")
    start = -(-cur.pos // alignment) * alignment
    return {name: (kind, shape, start + offset) for name, (kind, shape, offset) in infos.items()}


def read_q4_layers(gguf_path: str, num_layers: int, num_heads: int, num_kv_heads: int) -> list[list[torch.Tensor]]:
    """Each layer's (qkv, o, gate_up, down) weights as the file's Q4_1 blocks: uint8 [n, k / 32,
    20] in the rows of our fused weights. Raises ValueError naming the first tensor that is
    missing or not Q4_1."""
    buf = np.memmap(gguf_path, dtype=np.uint8, mode="r")  # (unmapped once no view of it is left)
    tensors = gguf_tensors(buf)
    layers = []
    for i in range(num_layers):
        fused = []
        for names in _PARTS:
            parts = []
            for name in names:
                full = f"blk.{i}.{name}.weight"
                if full not in tensors:
                    raise ValueError(f"{os.path.basename(gguf_path)} has no {full}")
                kind, shape, offset = tensors[full]
                if kind != _GGML_Q4_1 or len(shape) != 2 or shape[0] % 32:
                    raise ValueError(f"{full} is not a Q4_1 matrix (ggml type {kind}, shape {shape})")
                k, n = shape
                size = n * k // 32 * 20
                if offset + size > len(buf):
                    raise ValueError(f"{full} runs past the end of the file")
                blocks = buf[offset:offset + size].reshape(n, k // 32, 20)
                if name in ("attn_q", "attn_k"):
                    blocks = _unpermute_rows(blocks, num_heads if name == "attn_q" else num_kv_heads)
                parts.append(blocks)
            fused.append(torch.from_numpy(np.concatenate(parts)))  # copies, in memory
        layers.append(fused)
    return layers


def dequantize_q4_1(blocks: np.ndarray) -> np.ndarray:
    """fp32 [n, k] of Q4_1 blocks uint8 [n, k / 32, 20]: d q + m, q of element e the low nibble of
    byte e for e < 16, the high nibble of byte e - 16 above."""
    n, kbs, _ = blocks.shape
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    qs = blocks[..., 4:20]
    q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.float32)
    return (d * q + m).reshape(n, kbs * 32)


def _first_mismatch(model, layers: list[list[torch.Tensor]]) -> str | None:
    """Which of a few weights the blocks do not reproduce (their bf16 rounding against the loaded
    bf16 weight), or None: a guard on the row order for architectures beyond llama's."""
    names = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    for i in sorted({0, len(layers) - 1}):
        layer = model.model.layers[i]
        weights = (layer.self_attn.qkv_proj.weight, layer.self_attn.o_proj.weight,
                   layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight)
        for name, blocks, weight in zip(names, layers[i], weights):
            exact = torch.from_numpy(dequantize_q4_1(blocks.numpy()))
            if exact.shape != weight.shape or not torch.equal(exact.to(weight.dtype), weight.detach()):
                return f"layer {i}'s {name}"
    return None


def use_gguf_decode(model, folder: str | None, mode: str = "auto", lora: bool = False) -> bool:
    """Give `model` (a bf16 LlamaForCausalLM with the packed GEMM kernel, no LoRA adapters: `lora`)
    the packed Q4_1 copies of its layer weights from the GGUF `folder` was converted from, for
    `mode` ("auto" or "exact", see worker.gguf_decode); returns whether it did. Where it cannot,
    the decode path keeps the bf16 weights, and the log says why (a warning for "exact", which was
    asked for by name)."""
    from framework.model.llama import LlamaForCausalLM  # (llama imports the decode path, which imports us)

    if not isinstance(model, LlamaForCausalLM) or lora:
        return _keep_bf16(mode, "it takes a plain llama-family model without LoRA adapters")
    model.q4_layers, model.q4_exact = None, False
    model.reset_decode_path()
    config, gemm = model.config, model.kernels.gemm if model.kernels is not None else None
    gguf_path = gguf_source(folder)
    why = None
    if model.model.embed_tokens.weight.dtype != torch.bfloat16:
        why = "it needs model.dtype = 'bfloat16'"
    elif gemm is None:
        why = "it needs the C kernels on a CPU with AVX512-BF16"
    elif model.model.layers[0].self_attn.qkv_proj.tiles is None:
        why = "it needs worker.packed_weights (the decode path runs on the packed weights)"
    elif model.par.tp_size > 1 or model.par.attn_tp_size > 1:
        why = "it does not shard weights (parallel.tp_size must be 1)"
    elif gguf_path is None:
        why = "the model was not converted from a GGUF file that is still there"
    if why is None:
        try:
            layers = read_q4_layers(gguf_path, config.num_layers, config.num_heads, config.num_kv_heads)
            mismatch = _first_mismatch(model, layers)
            if mismatch is not None:
                raise ValueError(f"its Q4_1 blocks are not the loaded weights ({mismatch})")
            model.q4_layers = [[gemm.q4_pack(w) for w in layer] for layer in layers]
        except (ValueError, OSError) as exc:
            why = f"{os.path.basename(gguf_path)}: {exc}"
    if why is not None:
        return _keep_bf16(mode, why)
    model.q4_exact = mode == "exact"
    size = sum(w.numel() for layer in model.q4_layers for w in layer)
    logger.info("Decode steps read the Q4_1 weights of %s (%.0f MB)%s", os.path.basename(gguf_path), size / 1e6,
                f", exact up to {EXACT_ROWS} requests" if model.q4_exact else "")
    return True


def _keep_bf16(mode: str, why: str) -> bool:
    """Log why decode keeps the bf16 weights (a warning for "exact", asked for by name; "auto" is
    the default, and most models are not GGUF conversions); returns False."""
    log = logger.warning if mode == "exact" else logger.info
    log("worker.gguf_decode = %r: decode steps keep the bf16 weights: %s", mode, why)
    return False
