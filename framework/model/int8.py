"""W8A8 int8 GEMMs for a model's layers (model.quantization = "w8a8").

Each linear weight of the layers (qkv, o, gate-up, down; not the embedding, nor the LM head unless
model.int8_lm_head) is kept as int8 with one fp32 scale per output column (`Int8Weight`: max|w| /
127 of the column), and each GEMM's input rows are quantized as they are made, one scale per row
(token). The product is `torch._int_mm` (oneDNN's int8 GEMM, `vpdpbusd` on AVX512-VNNI: twice the
multiply-adds of bf16's `vdpbf16ps` per instruction) and its int32 sums become bf16 again in one
pass with what follows them (`Int8Ops`, kernels/int8_ops.c):

    x (bf16) --RMSNorm + quantize--> int8 rows --_int_mm--> int32 --dequantize--> qkv (bf16)
    attention out --quantize--> int8 --_int_mm--> int32 --dequantize--> o (bf16)
    o + residual --RMSNorm + quantize--> int8 --_int_mm--> int32 --SiLU(gate) * up + quantize--> int8
        --_int_mm--> int32 --dequantize + residual--> the layer's output (bf16)

Before they are quantized the weights are smoothed (SmoothQuant): each input channel's weights
are multiplied by a factor (`smoothing`) and its inputs divided by it as they are quantized (the
quantizing kernels take the weight's `inv`), so a channel whose inputs run large no longer takes
a token's whole int8 range; the factors come from the input ranges of a calibration pass at load
(`input_maxima`, random token ids).

Where the CPU has AVX512-VNNI and no AMX (AMD Zen 4 and later, Xeons before Sapphire Rapids), the
GEMMs run on kernels/int8_ops.c's own kernel instead of torch._int_mm (`Int8Ops.pack` gives each
weight a packed copy at load; `own_gemm_wanted`, BATCHYARD_INT8_GEMM): the same int32 sums and
the same ends, so the same bits, with the dequantize and SiLU ends fused into the GEMM, ~10-30 %
faster than oneDNN's on a 2-core AMD EPYC Zen 4 (not measured on Intel CPUs with VNNI and no AMX).
With AMX-INT8 (Intel Sapphire Rapids and later) the kernel runs a pass's rows 32 at a time on the
tiles (`tdpbsud` on the same packed copy, the same sums and ends: the same bits), the rest of the
rows on its vectors; where it cannot have the tiles (worker.cpu_kernels = "no_amx", or a build
without them) oneDNN's AMX-INT8 GEMMs keep them. On CPUs with AVX2 and no int8 dot product (AMD Zen 3)
the kernel's AVX2 build takes them (exact sums by `vpmaddubsw` with the sign trick), where
torch._int_mm runs on torch's own slow loops.

A model in float32 (the fast dtype where the CPU has no bf16 arithmetic) runs the same way with
fp32 activations (`Int8Ops(dtype=torch.float32)`): its rows are quantized from fp32 (the norms
are the model's fp32 RMSNorms, then `quantize`), and the GEMMs give fp32 (`int8_gemm_f32`, the
residual add fused); the int8 rows between gate-up and down are the same as in bf16.

It changes the outputs: docs/performance.md has what it costs in perplexity and agreement with
float32 on the embedded model, and what it gains in speed. Passes of fewer than `min_rows` rows
(32 on torch._int_mm, 8 on the own kernel) keep the bf16 (or GGUF Q4_1, `worker.gguf_decode`)
path, where the weights' bytes, not the multiply-adds, set the time; a float32 model's passes take
the own kernel from one row (MIN_ROWS_OWN_GEMM_F32: its fp32 weights are 4 bytes a weight). Without the C kernels the
same arithmetic runs in PyTorch (`Int8Ops(None)`), which is also what the kernels are tested
against.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import torch
import torch.nn.functional as F

from framework.model.cpu_kernels import _FLOAT, _I64, _INT, _PTR, _cpu_id, cpu_has_any, load

# Passes of fewer rows keep the bf16 weights (see the module docstring; measured in
# docs/performance.md, "Issue 17, eighteenth session"), on torch._int_mm; on the own kernel
# (Int8Ops.packs) from MIN_ROWS_OWN_GEMM rows, where its decode steps were faster than the bf16 and
# GGUF Q4_1 paths ("Issue 17, twenty-first session"; below it, `worker.gguf_decode = "exact"` is).
MIN_ROWS = 32
MIN_ROWS_OWN_GEMM = 8
# A float32 model's passes take the own kernel (and w4a8's) from one row: its smaller passes would
# read the fp32 weights, 4 bytes a weight against 1 (1.25 for w4a8's blocks); on a 2-core AMD EPYC
# Zen 3 a decode step of 1 / 2 / 4 requests took 15.7 / 17.7 / 21.2 ms in w4a8 and 18.7 / 16.9 / 21.3
# in w8a8 against 29.2 / 28.5 / 40.1 and 28.0 / 27.2 / 35.4 on the fp32 weights (docs/performance.md,
# "Issue 17, thirty-third session").
MIN_ROWS_OWN_GEMM_F32 = 1
QUANTIZATIONS = ("none", "w8a8", "w4a8")


@dataclass
class Int8Weight:
    """A linear weight [n, k] as int8 values `q` [k, n] (transposed: torch._int_mm's second
    operand) and fp32 column scales `scale` [n]: weight[c, j] ~ q[j, c] * scale[c] / smooth[j].
    `inv` (fp32 [k], or None: no smoothing) is 1 / smooth, what the layer's input rows are
    multiplied by before they are quantized, so the product is unchanged. `packed` (uint8, or
    None): the copy `Int8Ops.pack` makes for kernels/int8_ops.c's own GEMM, which then takes the
    weight's passes instead of torch._int_mm (`gate_up`: q's columns are [gate | up])."""

    q: torch.Tensor
    scale: torch.Tensor
    inv: torch.Tensor | None = None
    packed: torch.Tensor | None = None
    gate_up: bool = False

    @property
    def out_features(self) -> int:
        return self.q.shape[1]


class QuantizedRows(NamedTuple):
    """Activations [m, k] as int8 values `q` [m, k] and fp32 row scales `scale` [m]:
    row r ~ q[r] * scale[r]."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def quantize_weight(weight: torch.Tensor, smooth: torch.Tensor | None = None) -> Int8Weight:
    """Symmetric int8 of each output column (row of `weight` [n, k]): scale max|w| / 127, values
    round(w / scale) (a column of zeros: scale 0, values 0); with `smooth` ([k], > 0) of the
    weight times it, each input channel j scaled by smooth[j] (see `smoothing`)."""
    w = weight.detach().float()
    if smooth is not None:
        w = w * smooth[None, :]
    q, scale = quantize_rows(w)
    inv = None if smooth is None else (1 / smooth).float().contiguous()
    return Int8Weight(q.t().contiguous(), scale, inv)


# SmoothQuant's migration strength: smooth[j] = max|x_j| ** ALPHA / max|w_j| ** (1 - ALPHA).
SMOOTH_ALPHA = 0.5


def smoothing(input_max: torch.Tensor, weight: torch.Tensor, alpha: float = SMOOTH_ALPHA) -> torch.Tensor:
    """Per input channel j of a linear weight [n, k], the factor that moves part of the input's
    range into the weight (SmoothQuant): x_j / s_j times w_j * s_j is the same product, but a channel
    whose inputs run large (an outlier channel, which would take most of a token's int8 range)
    gets a smaller range, and its weights a larger one. `input_max` [k]: max |x_j| measured."""
    a = input_max.float().clamp_min(1e-5)
    w = weight.detach().float().abs().amax(dim=0).clamp_min(1e-5)
    return (a.pow(alpha) / w.pow(1 - alpha)).clamp_min(1e-5)


# The calibration pass (`input_maxima`): sequences of random token ids. What the factors come out
# to hardly depends on the text: on the embedded model, the KL divergence of w8a8 from float32 was
# 0.0401 without smoothing, 0.0132 calibrated on random ids, 0.0117 on ShareGPT conversations
# (docs/performance.md, issue 17's eighteenth session).
CALIBRATION_SEQUENCES = 4
CALIBRATION_TOKENS = 256


@torch.no_grad()
def input_maxima(model, sequences: int = CALIBRATION_SEQUENCES, tokens: int = CALIBRATION_TOKENS,
                 seed: int = 0) -> tuple[list[tuple[torch.Tensor, ...]], torch.Tensor]:
    """Per decoder layer of a llama-family `model` (LlamaForCausalLM), the largest |input| of each
    channel of its four GEMMs (qkv, o, gate-up, down), and the same of the LM head's input (the
    final norm's output), over `sequences` of `tokens` random token ids: the layers run in fp32 from
    their weights, causal attention over each sequence (no KV pool)."""
    layers = model.model.layers
    embed = model.model.embed_tokens.weight
    gen = torch.Generator().manual_seed(seed)
    rope = model.model.rotary.tables(torch.arange(tokens, device=embed.device), torch.float32)
    maxima: list[list[torch.Tensor | None]] = [[None] * 4 for _ in layers]
    head = torch.zeros(embed.shape[1], dtype=torch.float32, device=embed.device)
    norm = model.model.norm

    def seen(i: int, part: int, x: torch.Tensor) -> None:
        m = x.abs().amax(dim=0)
        maxima[i][part] = m if maxima[i][part] is None else torch.maximum(maxima[i][part], m)

    def lin(module, x):
        return F.linear(x, module.weight.float(), None if module.bias is None else module.bias.float())

    for _ in range(sequences):
        ids = torch.randint(0, embed.shape[0], (tokens,), generator=gen).to(embed.device)
        h = embed[ids].float()
        for i, layer in enumerate(layers):
            attn, mlp = layer.self_attn, layer.mlp
            x = rms_norm_fp32(h, layer.input_layernorm.weight, layer.input_layernorm.eps)
            seen(i, 0, x)
            q, k, v = lin(attn.qkv_proj, x).split([attn.q_size, attn.kv_size, attn.kv_size], dim=1)
            q = rope.apply(q.view(tokens, attn.num_heads, attn.head_dim)).transpose(0, 1)
            k = rope.apply(k.view(tokens, attn.num_kv_heads, attn.head_dim)).transpose(0, 1)
            v = v.reshape(tokens, attn.num_kv_heads, attn.head_dim).transpose(0, 1)
            group = attn.num_heads // attn.num_kv_heads
            a = F.scaled_dot_product_attention(q, k.repeat_interleave(group, 0), v.repeat_interleave(group, 0),
                                               is_causal=True, scale=attn.backend.scaling)
            a = a.transpose(0, 1).reshape(tokens, attn.q_size)
            seen(i, 1, a)
            h = h + lin(attn.o_proj, a)
            x = rms_norm_fp32(h, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
            seen(i, 2, x)
            gate, up = lin(mlp.gate_up_proj, x).split(mlp.intermediate_size, dim=1)
            act = F.silu(gate) * up
            seen(i, 3, act)
            h = h + lin(mlp.down_proj, act)
        head = torch.maximum(head, rms_norm_fp32(h, norm.weight, norm.eps).abs().amax(dim=0))
    return [tuple(m) for m in maxima], head


def rms_norm_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of fp32 rows times the norm's weight, kept in fp32 (what the int8 rows are made of)."""
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.float()


def quantize_rows(x: torch.Tensor) -> QuantizedRows:
    """fp32 rows [m, k] as int8 rows, as kernels/int8_ops.c's quantize_row."""
    amax = x.abs().amax(dim=1)
    # (a true division: `127 / amax` would be torch's reciprocal times 127, which rounds differently)
    inv = torch.where(amax > 0, torch.full_like(amax, 127).div_(amax), torch.zeros_like(amax))
    return QuantizedRows(torch.round(x * inv[:, None]).clamp_(-127, 127).to(torch.int8), amax / 127)


class Int8Ops:
    """The int8 GEMMs and their ends, on the C kernels of kernels/int8_ops.c (`lib`) or, with
    `lib` None, the same arithmetic in PyTorch. Activations are 2-D tensors of `dtype` (the
    model's: bf16, or fp32) with unit stride along their rows; int8 rows come with their fp32
    scales (QuantizedRows). `rms_norm_quantize` takes bf16 rows only: in fp32 the layers run the
    model's RMSNorm, then `quantize`."""

    packs = False  # whether `pack` gives weights their packed copy (see own_gemm_wanted)
    tiles = False  # whether the own GEMM runs passes of 32+ rows on AMX-INT8 tiles
    gate_up_block = 0  # rows the packed gate-up GEMM takes at a time (the rows of its fp32 scratch)

    def __init__(self, lib: ctypes.CDLL | None, dtype: torch.dtype = torch.bfloat16, tiles: bool = True):
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"int8 GEMMs take bf16 or fp32 activations, not {dtype}")
        self.lib = lib
        self.dtype = dtype
        if lib is None:
            return
        self._quantize = lib.quantize_bf16
        self._quantize.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _INT]
        self._quantize_f32 = lib.quantize_f32
        self._quantize_f32.argtypes = self._quantize.argtypes
        self._rms_quantize = lib.rms_norm_quantize
        self._rms_quantize.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _FLOAT, _PTR, _PTR, _PTR, _I64, _I64, _INT]
        self._dequantize = lib.dequantize_bf16
        self._dequantize.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _INT]
        self._silu_mul_quantize = lib.silu_mul_quantize
        self._silu_mul_quantize.argtypes = [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _INT]
        for fn in (self._quantize, self._quantize_f32, self._rms_quantize, self._dequantize, self._silu_mul_quantize):
            fn.restype = _INT
        lib.int8_gemm_packed_bytes.argtypes = [_I64, _I64, _INT]
        lib.int8_gemm_packed_bytes.restype = _I64
        self._pack = lib.int8_gemm_pack
        self._pack.argtypes = [_PTR, _I64, _I64, _INT, _PTR]
        self._gemm = lib.int8_gemm_bf16
        self._gemm.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64, _INT]
        self._gemm_f32 = lib.int8_gemm_f32
        self._gemm_f32.argtypes = self._gemm.argtypes
        self._gemm_gate_up = lib.int8_gemm_gate_up
        self._gemm_gate_up.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _INT]
        for fn in (self._pack, self._gemm, self._gemm_f32, self._gemm_gate_up):
            fn.restype = _INT
        lib.int8_gemm_gate_up_block.restype = _I64
        self.gate_up_block = lib.int8_gemm_gate_up_block()
        # (the kernel's AMX tiles, where it has them: `tiles` False, worker.cpu_kernels = "no_amx",
        # leaves them off, so such a CPU keeps oneDNN's GEMMs, as before the tiles were there; the
        # setting is the process's, the last Int8Ops made sets it: the same bits either way)
        lib.int8_gemm_tiles.argtypes = [_INT]
        lib.int8_gemm_tiles.restype = _INT
        self.tiles = bool(lib.int8_gemm_tiles(int(tiles)))
        self.packs = own_gemm_wanted(tiles=self.tiles) and lib.int8_gemm_packed_bytes(4, 16, 0) > 0

    def pack(self, w: Int8Weight, gate_up: bool = False) -> Int8Weight:
        """Give `w` the packed copy kernels/int8_ops.c's GEMM runs on, where `packs` (and the
        kernel takes its shape: columns in 16s, 32s for `gate_up`, k in 4s); returns w."""
        if not self.packs:
            return w
        k, n = w.q.shape
        size = self.lib.int8_gemm_packed_bytes(k, n, int(gate_up))
        if size <= 0:
            return w
        packed = torch.empty(size, dtype=torch.uint8)
        if self._pack(w.q.data_ptr(), k, n, int(gate_up), packed.data_ptr()) == 0:
            w.packed, w.gate_up = packed, gate_up
        return w

    @classmethod
    def load(cls, dtype: torch.dtype = torch.bfloat16, tiles: bool = True) -> "Int8Ops":
        """On the C kernels where they build, else in PyTorch; activations of `dtype`; `tiles`:
        whether the own GEMM may take the AMX tiles."""
        return cls(load("int8_ops"), dtype, tiles)

    @staticmethod
    def _check(rc: int, op: str) -> None:
        if rc != 0:
            raise MemoryError(f"int8 {op} kernel: no memory for its row buffer")

    @staticmethod
    def _empty_rows(m: int, k: int) -> QuantizedRows:
        return QuantizedRows(torch.empty((m, k), dtype=torch.int8), torch.empty(m, dtype=torch.float32))

    @staticmethod
    def _times(x: torch.Tensor, mul: torch.Tensor | None) -> torch.Tensor:
        return x if mul is None else x * mul

    def quantize(self, x: torch.Tensor, mul: torch.Tensor | None = None) -> QuantizedRows:
        """bf16 or fp32 rows [m, k] (times `mul` [k] when given: the next weight's `inv`) as int8
        rows; x is not changed."""
        if self.lib is None:
            return quantize_rows(self._times(x.float(), mul))
        m, k = x.shape
        q, s = self._empty_rows(m, k)
        fn = self._quantize_f32 if x.dtype == torch.float32 else self._quantize
        self._check(fn(x.data_ptr(), x.stride(0), _ptr(mul), q.data_ptr(), s.data_ptr(), m, k,
                                   torch.get_num_threads()), "quantize")
        return QuantizedRows(q, s)

    def rms_norm_quantize(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                          residual: torch.Tensor | None = None, mul: torch.Tensor | None = None):
        """(int8 rows of RMSNorm(h) * weight [* mul], h), h = x, or bf16(x + residual) with a
        residual (contiguous, x's shape); the normed rows are quantized from fp32."""
        if x.dtype != torch.bfloat16:
            raise ValueError(f"rms_norm_quantize takes bf16 rows, not {x.dtype} (fp32: RMSNorm, then quantize)")
        if self.lib is None:
            h = x if residual is None else (x.float() + residual.float()).to(torch.bfloat16)
            return quantize_rows(self._times(rms_norm_fp32(h.float(), weight, eps), mul)), h
        m, d = x.shape
        q, s = self._empty_rows(m, d)
        h = x if residual is None else torch.empty((m, d), dtype=torch.bfloat16)
        res, res_out = (None, None) if residual is None else (residual.data_ptr(), h.data_ptr())
        self._check(self._rms_quantize(x.data_ptr(), x.stride(0), res, res_out, weight.data_ptr(), eps, _ptr(mul),
                                       q.data_ptr(), s.data_ptr(), m, d, torch.get_num_threads()), "RMSNorm")
        return QuantizedRows(q, s), h

    def linear(self, x: QuantizedRows, w: Int8Weight, add: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W^T [+ add] in `dtype` for int8 rows x; `add`: [m, n] in `dtype` (unit stride along
        rows), added before the one rounding; `out`: an [m, n] in `dtype` with unit stride along
        rows to write into."""
        q, s = x
        m, n = q.shape[0], w.out_features
        if w.packed is not None and not w.gate_up and q.is_contiguous():
            if out is None:
                out = torch.empty((m, n), dtype=self.dtype)
            gemm = self._gemm_f32 if self.dtype == torch.float32 else self._gemm
            self._check(gemm(q.data_ptr(), s.data_ptr(), w.packed.data_ptr(), w.scale.data_ptr(), m, q.shape[1],
                                   n, None if add is None else add.data_ptr(), 0 if add is None else add.stride(0),
                                   out.data_ptr(), out.stride(0), torch.get_num_threads()), "GEMM")
            return out
        acc = torch._int_mm(q, w.q)
        if self.lib is None or self.dtype == torch.float32:
            y = acc.float() * (s[:, None] * w.scale[None, :])
            if add is not None:
                y += add.float()
            return y.to(self.dtype) if out is None else out.copy_(y)
        if out is None:
            out = torch.empty((m, n), dtype=torch.bfloat16)
        self._check(self._dequantize(acc.data_ptr(), s.data_ptr(), w.scale.data_ptr(),
                                     None if add is None else add.data_ptr(), 0 if add is None else add.stride(0),
                                     out.data_ptr(), out.stride(0), m, n, torch.get_num_threads()), "dequantize")
        return out

    def gate_up(self, x: QuantizedRows, w: Int8Weight, mul: torch.Tensor | None = None) -> QuantizedRows:
        """The int8 rows of SiLU(gate) * up [* mul] for int8 rows x and the fused [gate | up]
        weight (`mul`: the down projection's `inv`)."""
        q, s = x
        m, d = q.shape[0], w.out_features // 2
        if w.packed is not None and w.gate_up and q.is_contiguous():
            aq, a_s = self._empty_rows(m, d)
            h = torch.empty((min(m, self.gate_up_block), d), dtype=torch.float32)  # (aq is not q's memory)
            self._check(self._gemm_gate_up(q.data_ptr(), s.data_ptr(), w.packed.data_ptr(), w.scale.data_ptr(), m,
                                           q.shape[1], d, _ptr(mul), h.data_ptr(), aq.data_ptr(), a_s.data_ptr(),
                                           torch.get_num_threads()), "gate-up GEMM")
            return QuantizedRows(aq, a_s)
        acc = torch._int_mm(q, w.q)
        if self.lib is None:
            y = acc.float() * (s[:, None] * w.scale[None, :])
            gate, up = y[:, :d], y[:, d:]
            return quantize_rows(self._times(gate / (1 + torch.exp(-gate)) * up, mul))
        aq, a_s = self._empty_rows(m, d)
        self._check(self._silu_mul_quantize(acc.data_ptr(), s.data_ptr(), w.scale.data_ptr(), _ptr(mul),
                                            aq.data_ptr(), a_s.data_ptr(), m, d, torch.get_num_threads()),
                    "SiLU-mul")
        return QuantizedRows(aq, a_s)


# CPU flags (/proc/cpuinfo) of the int8 dot-product instructions oneDNN's int8 GEMM is fast with.
INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


def has_int8_dot(flags: str | None = None) -> bool:
    """Whether the CPU has an int8 dot-product instruction (`flags`: /proc/cpuinfo's flags line;
    default this machine's). Without one the int8 GEMMs are slow: oneDNN multiplies int8 with
    several instructions a step, and on CPUs with AVX2 only torch keeps torch._int_mm on loops of
    its own (an AMD EPYC Zen 3: 2-3 GOP/s, ~50x slower than float32)."""
    return cpu_has_any(INT8_DOT_FLAGS, flags)


@lru_cache(maxsize=None)
def int_mm_is_exact() -> bool:
    """Whether torch._int_mm gives the exact int32 sums of full-range int8 operands on this machine.

    oneDNN's int8 kernels for CPUs without an int8 dot product (AVX2, or AVX-512 before VNNI; also
    where ONEDNN_MAX_CPU_ISA caps oneDNN below it) add u8 x s8 products in pairs into 16 bits,
    which saturate unless the weights keep to 7 bits: the sums come out wrong, silently. Probed with
    the worst case (every value 127: pairs of 255 x 127 after oneDNN's +128) and with random values,
    at a decode and a prefill shape, against float64 sums (exact at these sizes)."""
    gen = torch.Generator().manual_seed(0)
    cases = [(torch.full((32, 64), 127, dtype=torch.int8), torch.full((64, 32), 127, dtype=torch.int8))]
    for m, k, n in ((32, 576, 64), (256, 1536, 48)):
        cases.append((torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=gen),
                      torch.randint(-127, 128, (k, n), dtype=torch.int8, generator=gen)))
    for a, b in cases:
        if not torch.equal(torch._int_mm(a, b).double(), a.double() @ b.double()):
            return False
    return True


# BATCHYARD_INT8_GEMM: "auto" (kernels/int8_ops.c's own GEMM where the CPU has AVX512-VNNI and
# no AMX, or AVX2 and no int8 dot product at all) or "onednn" (torch._int_mm always; for comparisons).
INT8_GEMM_ENV = "BATCHYARD_INT8_GEMM"


def own_gemm_wanted(flags: str | None = None, tiles: bool | None = None) -> bool:
    """Whether the int8 GEMMs should run on kernels/int8_ops.c's own kernel rather than
    torch._int_mm: on AVX512-VNNI vectors it gives the same sums with the ends fused, faster than
    oneDNN on a 2-core AMD EPYC Zen 4 (docs/performance.md, issue 17's twenty-first session). Where
    the CPU has AMX-INT8, only where the kernel runs on the tiles too (`tiles`; None: ask the built
    kernel, `int8_gemm_tiles`): its tiles with the ends fused beat oneDNN's AMX GEMMs (issue 17's
    thirty-seventh session), its vectors do not. On CPUs with AVX2 and no int8 dot product (AMD
    Zen 3: torch keeps torch._int_mm on loops of its own, 2-3 GOP/s) its AVX2 build (`vpmaddubsw`
    with the sign trick) takes them; with AVX-VNNI (256-bit dot products, no AVX-512) oneDNN
    keeps them. Where the kernel is not built (no AVX2 and FMA) Int8Ops.packs stays False."""
    choice = os.environ.get(INT8_GEMM_ENV, "auto")
    if choice not in ("auto", "onednn"):
        raise ValueError(f"{INT8_GEMM_ENV}={choice!r}: expected 'auto' or 'onednn'")
    if flags is None:
        flags = _cpu_id()
    names = flags.split()
    if "amx_int8" in names:
        if tiles is None:
            lib = load("int8_ops") if choice == "auto" else None
            tiles = lib is not None and bool(lib.int8_gemm_tiles(-1))
        return choice == "auto" and tiles
    avx2_only = "avx2" in names and "fma" in names and not {"avx_vnni", "avx512_vnni"} & set(names)
    return choice == "auto" and ("avx512_vnni" in names or avx2_only)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def min_rows(own_gemm: bool, dtype: torch.dtype = torch.bfloat16) -> int:
    """The fewest rows a pass of `dtype` activations runs its GEMMs in int8 with: on the own kernel
    (w8a8's, or w4a8's) or on torch._int_mm."""
    if not own_gemm:
        return MIN_ROWS
    return MIN_ROWS_OWN_GEMM_F32 if dtype == torch.float32 else MIN_ROWS_OWN_GEMM


def takes(x: torch.Tensor, own_gemm: bool = False, fewest: int | None = None) -> bool:
    """Whether a layer's pass of activations x runs its GEMMs in int8 (bf16 or fp32 rows, at least
    `fewest` of them, by default `min_rows(own_gemm, x.dtype)`; `own_gemm`: the weights have the
    own kernel's packed copies)."""
    if fewest is None:
        fewest = min_rows(own_gemm, x.dtype)
    return (x.dtype in (torch.bfloat16, torch.float32) and x.dim() == 2 and x.shape[0] >= fewest
            and x.stride(1) == 1)


# How far below a row's largest int8-head logit a column may lie and still be recomputed in bf16
# (rescore_head_top). On the embedded model's own final hidden states (3,680 rows of 100 ShareGPT
# greedy generations) the int8 head's logits were off the bf16 head's by 0.15 on average (standard
# deviation), 1.43 at most, and 0.83 at most among each row's 64 largest; the bf16 head's argmax lay
# at most 0.50 below the int8 head's largest value, and 2.0 took 3.2 columns a row on average (52
# at most).
HEAD_RESCORE_MARGIN = 2.0


def rescore_head_top(logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, fused=None,
                     margin: float = HEAD_RESCORE_MARGIN) -> torch.Tensor:
    """Give an int8 LM head's logits [n, vocab] the bf16 head's values where they decide the next
    token, in place: every column within `margin` of its row's largest value is recomputed as
    hidden_r . weight_c (hidden [n, k] and weight [vocab, k] in bf16, the exact products summed in
    fp32) and stored in the logits' dtype. The bf16 head's largest logit is then among them unless
    the int8 logits are off by more than margin / 2 at both columns, so greedy rows take the bf16
    head's token, and sampling's most likely tokens get its values; the rest keep the int8 values.
    A row with a NaN is left as it is. `fused` (FusedOps, or None) runs it on kernels/fused_ops.c
    where it takes the tensors (bf16, or all three fp32 for a float32 model: there "bf16" above
    reads "fp32"). Returns how many columns each row recomputed (int64 [n])."""
    if fused is not None and weight.is_contiguous() and (
            (fused.supports(logits) and fused.supports(hidden) and weight.dtype == torch.bfloat16)
            or (fused.supports_f32(logits, weight) and fused.supports_f32(hidden, weight))):
        return fused.head_rescore(logits, hidden, weight, margin)
    wide = logits.float()
    top = wide.max(dim=1, keepdim=True).values
    rows, cols = (wide >= top - margin).nonzero(as_tuple=True)
    logits[rows, cols] = (hidden[rows].float() * weight[cols].float()).sum(dim=1).to(logits.dtype)
    return torch.bincount(rows, minlength=logits.shape[0])


def use_int8_weights(model, ops: Int8Ops | None, smooth: bool = True, lm_head: bool = False, w4_ops=None) -> int:
    """Give the linear layers of `model`'s decoder layers their int8 weights (`ops` the int8
    GEMMs to run them with), or take them away (`ops` None); returns how many weights were made.
    With `smooth`, each weight is first smoothed (`smoothing`) by the input ranges of a calibration
    pass (`input_maxima`). Under TP the row-parallel layers (o, down: split by their inputs) keep
    their bf16 GEMMs, and the column-parallel ones (qkv, gate-up: each rank its own output columns)
    take int8; under LoRA the base product is int8 and the adapters' deltas are added in bf16, as on
    the bf16 weights. With `lm_head` (model.int8_lm_head) the LM head gets an int8 copy too
    (smoothed the same way), which `compute_logits` then runs every pass on where it has the own
    kernel's packed copy, passes of `min_rows` rows or more on torch._int_mm; without it the LM head
    has none. With `w4_ops` (a w4a8.W4Ops: model.quantization = "w4a8") the layers' weights are
    its 4-bit blocks instead (not smoothed) and the layers run on it; `ops` then gives the LM
    head its int8 copy only."""
    from framework.model.llama import Linear, LlamaDecoderLayer, LlamaMLP, RowParallelLinear

    calibrate = ops is not None and smooth and (w4_ops is None or lm_head)
    maxima, head_maxima = input_maxima(model) if calibrate else (None, None)
    layer_ops = w4_ops if w4_ops is not None and ops is not None else ops
    count = 0
    for i, layer in enumerate(model.model.layers):
        parts = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
        for part, module in enumerate(parts):
            for linear in (m for m in module.modules() if isinstance(m, (Linear, RowParallelLinear))):
                plain = type(linear) in (Linear, RowParallelLinear) and getattr(linear, "shard_size", 1) == 1
                made = None
                if layer_ops is not None and plain and layer_ops is w4_ops:
                    made = w4_ops.make(linear.weight, gate_up=part == 2)
                elif ops is not None and plain:
                    factors = None if maxima is None else smoothing(maxima[i][part], linear.weight)
                    made = ops.pack(quantize_weight(linear.weight, factors), gate_up=part == 2)
                linear.int8, linear.int8_ops = made, (layer_ops if made is not None else None)
                count += made is not None
    head = None
    if ops is not None and lm_head:
        weight = model.lm_head_weight
        head = ops.pack(quantize_weight(weight, None if head_maxima is None else smoothing(head_maxima, weight)))
    model.lm_head_int8, model.lm_head_int8_ops = head, (ops if head is not None else None)
    count += head is not None
    for module in model.modules():
        if isinstance(module, (LlamaMLP, LlamaDecoderLayer)):
            module.int8_ops = layer_ops
    if hasattr(model, "reset_decode_path"):
        model.reset_decode_path()
    return count
