"""W4A8 GEMMs for a model's layers (model.quantization = "w4a8").

Each linear weight of the layers (qkv, o, gate-up, down) is kept as 4-bit values in blocks of 32
inputs, the GGUF's Q4_1 layout: column c's block b is d[c, b] q + m[c, b], q in 0..15, d and m in
fp32 (`quantize_weight`: d = (max - min) / 15 and m = min of the block, q rounded). The embedded
model's weights are Q4_1 blocks already, so on it this gives back the file's own weights (each
block's min, max and so d and m are recovered from the converted weights; the q exactly), where
w8a8 rounds them again to int8 per column. Each GEMM's input rows are quantized to int8 in blocks of
32 too (`quantize_blocks`, max|x| / 127 a block, as llama.cpp's Q8 activations), so a channel whose
inputs run large takes the range of its own block only: no smoothing pass is needed.

The products run on kernels/w4_gemm.c (AVX2 + FMA): with q at most 15, a block's 32 products add
up in 16 bits exactly, so its inner loop is one `vpmaddubsw` and one add per 4 inputs of 8 columns,
against four instructions for w8a8's AVX2 int8 GEMM; the block's sum then takes its two scales in
fp32 (the file's header has the arithmetic). Its ends are fused as w8a8's: dequantize + residual add,
SiLU(gate) * up + the next quantization. The LM head keeps model.int8_lm_head's int8 copy (w8a8's,
framework/model/int8.py) or the model's dtype, and bf16 passes of fewer than 8 rows the model's
dtype, as in w8a8 (a float32 model's passes take the kernel from one row: int8.min_rows). Without
the kernel (no AVX2, no C compiler) the same quantized operands are multiplied in PyTorch
(dequantized to fp32: the same values, summed in another order).

It changes the outputs: docs/performance.md has what it costs in perplexity and what it gains.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import NamedTuple

import torch

from framework.model.cpu_kernels import _FLOAT, _I64, _INT, _PTR, load
from framework.model.int8 import quantize_rows, rms_norm_fp32

BLOCK = 32  # inputs a block: one d and m a weight column, one scale an activation row


class QuantizedBlocks(NamedTuple):
    """Activations [m, k] as int8 values `q` [m, k] in blocks of 32 with their fp32 scales
    `scale` [m, k / 32] and `sum` [m, k / 32] (scale times the block's sum of q): row r's block b
    ~ q[r, 32 b: 32 b + 32] * scale[r, b]."""

    q: torch.Tensor
    scale: torch.Tensor
    sum: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


@dataclass
class W4Weight:
    """A linear weight [n, k] as 4-bit blocks: weight[c, 32 b + i] ~ d[c, b] * q[c, 32 b + i] +
    m[c, b] (q uint8 in 0..15 [n, k], d and m fp32 [n, k / 32]). `packed` and `dm`: the copies
    kernels/w4_gemm.c runs on (`W4Ops.make`; then q is dropped), `dense`: the fp32 weight the
    PyTorch path multiplies by. `gate_up`: the fused [gate | up] weight. `inv` is None: the rows
    are not smoothed (the layers pass it to `quantize` as they do w8a8's)."""

    n: int
    k: int
    d: torch.Tensor
    m: torch.Tensor
    q: torch.Tensor | None = None
    packed: torch.Tensor | None = None
    dm: torch.Tensor | None = None
    dense: torch.Tensor | None = None
    gate_up: bool = False
    inv = None

    @property
    def out_features(self) -> int:
        return self.n


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, d, m) of a weight [n, k] (k a multiple of 32) in 4-bit blocks of 32 inputs, as Q4_1:
    d = (max - min) / 15 and m = min of each block, q = round((w - m) / d) in 0..15 (a constant
    block: d 0, q 0)."""
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"w4a8 takes weights whose inputs come in blocks of {BLOCK}, not {k}")
    w = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    lo, hi = w.amin(dim=2), w.amax(dim=2)
    d = (hi - lo) / 15
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.round((w - lo[..., None]) / safe[..., None]).clamp_(0, 15)
    q = torch.where(d[..., None] > 0, q, torch.zeros_like(q))
    return q.to(torch.uint8).reshape(n, k), d.contiguous(), lo.contiguous()


def dequantize_weight(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [n, k] of 4-bit blocks (d q + m)."""
    n, k = q.shape
    w = q.float().reshape(n, k // BLOCK, BLOCK) * d[..., None] + m[..., None]
    return w.reshape(n, k)


def quantize_blocks(x: torch.Tensor) -> QuantizedBlocks:
    """fp32 rows [m, k] (k a multiple of 32) as int8 blocks, as kernels/w4_gemm.c's w4_quantize:
    each block of 32 as int8.quantize_rows does a row."""
    m, k = x.shape
    q, scale = quantize_rows(x.float().reshape(m * (k // BLOCK), BLOCK))
    total = q.reshape(m * (k // BLOCK), BLOCK).sum(dim=1).float() * scale
    return QuantizedBlocks(q.reshape(m, k), scale.reshape(m, k // BLOCK), total.reshape(m, k // BLOCK))


def dequantize_blocks(x: QuantizedBlocks) -> torch.Tensor:
    """The fp32 rows of int8 blocks."""
    m, k = x.q.shape
    return (x.q.float().reshape(m, k // BLOCK, BLOCK) * x.scale[..., None]).reshape(m, k)


def _gate_up_order(n: int) -> torch.Tensor:
    """The column order of a packed [gate | up] weight of n columns: units of 16 alternating, the
    gate's 16 columns, then the up half's same 16."""
    d = n // 2
    units = torch.arange(d // 16)
    cols = torch.stack([units * 16, d + units * 16], dim=1).reshape(-1)
    return (cols[:, None] + torch.arange(16)[None, :]).reshape(-1)


class W4Ops:
    """The W4A8 GEMMs and their ends on kernels/w4_gemm.c (`lib`), or with `lib` None (or a
    kernel built without AVX2) the same operands multiplied in PyTorch. The interface of
    int8.Int8Ops, which the layers call: `quantize` gives `QuantizedBlocks`, `linear` and
    `gate_up` take them. Activations are 2-D tensors of `dtype` (bf16 or fp32) with unit stride
    along their rows."""

    gate_up_block = 0

    def __init__(self, lib: ctypes.CDLL | None, dtype: torch.dtype = torch.bfloat16):
        if dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"w4a8 GEMMs take bf16 or fp32 activations, not {dtype}")
        self.dtype = dtype
        self.lib = None
        if lib is not None:
            lib.w4_gemm_built.restype = _INT
            if lib.w4_gemm_built():
                self.lib = lib
        # whether the weights get the kernel's packed copies (the layers then take passes of
        # int8.min_rows(True, dtype) rows and more, as on w8a8's own GEMM)
        self.packs = self.lib is not None
        if self.lib is None:
            return
        lib.w4_quantize.argtypes = [_PTR, _INT, _I64, _I64, _I64, _PTR, _PTR, _PTR, _INT]
        lib.w4_gemm.argtypes = [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64, _INT, _INT]
        lib.w4_gemm_gate_up.argtypes = [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR,
                                        _INT]
        lib.w4_rms_norm_quantize.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _FLOAT, _I64, _I64, _PTR, _PTR, _PTR, _INT]
        for fn in (lib.w4_quantize, lib.w4_gemm, lib.w4_gemm_gate_up, lib.w4_rms_norm_quantize):
            fn.restype = _INT
        lib.w4_gate_up_block.restype = _I64
        self.gate_up_block = lib.w4_gate_up_block()

    @classmethod
    def load(cls, dtype: torch.dtype = torch.bfloat16) -> "W4Ops":
        """On the C kernel where it builds (with AVX2 and FMA), else in PyTorch."""
        return cls(load("w4_gemm"), dtype)

    @staticmethod
    def _check(rc: int, op: str) -> None:
        if rc == -1:
            raise MemoryError(f"w4a8 {op} kernel: no memory for its row buffer")
        if rc != 0:
            raise ValueError(f"w4a8 {op} kernel: a shape it does not take")

    def make(self, weight: torch.Tensor, gate_up: bool = False) -> W4Weight | None:
        """The 4-bit copy of a linear weight [n, k] (`gate_up`: the fused [gate | up] weight), with
        the kernel's packed copy where the kernel runs (n a multiple of 16; gate-up: 64, so that
        its d, the down projection's k, comes in 32s); None where k is not a multiple of 32 (the
        layer then keeps the model's dtype)."""
        n, k = weight.shape
        if k % BLOCK or (gate_up and n % 2):
            return None
        q, d, m = quantize_weight(weight)
        w = W4Weight(n, k, d, m, q, gate_up=gate_up)
        if self.lib is not None and n % (64 if gate_up else 16) == 0:
            order = _gate_up_order(n) if gate_up else torch.arange(n)
            nb = k // BLOCK
            w.packed = q[order].reshape(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous().reshape(-1)
            w.dm = torch.stack([d[order].reshape(n // 16, 16, nb).permute(0, 2, 1),
                                m[order].reshape(n // 16, 16, nb).permute(0, 2, 1)], dim=2).contiguous()
            w.q = None
        else:
            w.dense = dequantize_weight(q, d, m)
        return w

    def quantize(self, x: torch.Tensor, mul: torch.Tensor | None = None) -> QuantizedBlocks:
        """bf16 or fp32 rows [m, k] as int8 blocks; x is not changed. (`mul`: the layers pass the
        weight's `inv`, None for 4-bit weights.)"""
        if mul is not None:
            raise ValueError("w4a8 rows are not smoothed: quantize takes no mul")
        if self.lib is None:
            return quantize_blocks(x.float())
        if x.dtype not in (torch.float32, torch.bfloat16):
            x = x.float()
        if x.stride(1) != 1:
            x = x.contiguous()
        m, k = x.shape
        out = QuantizedBlocks(torch.empty((m, k), dtype=torch.int8), torch.empty((m, k // BLOCK)),
                              torch.empty((m, k // BLOCK)))
        self._check(self.lib.w4_quantize(x.data_ptr(), int(x.dtype == torch.bfloat16), x.stride(0), m, k,
                                         out.q.data_ptr(), out.scale.data_ptr(), out.sum.data_ptr(),
                                         torch.get_num_threads()), "quantize")
        return out

    def rms_norm_quantize(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                          residual: torch.Tensor | None = None, mul: torch.Tensor | None = None):
        """(int8 blocks of RMSNorm(h) * weight, h) for bf16 rows, h = x or bf16(x + residual), as
        Int8Ops.rms_norm_quantize (the normed rows in fp32, then `quantize`)."""
        h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
        return self.quantize(rms_norm_fp32(h.float(), weight, eps), mul), h

    def takes_norm_f32(self, x: torch.Tensor, norm, residual: torch.Tensor | None = None) -> bool:
        """Whether `rms_norm_quantize_f32` takes these: the kernel, fp32 rows [m, d] (unit stride
        along them, d a multiple of 32), an RMSNorm module on the C kernels (`norm.fused`, whose
        rms_norm_f32 gives the same values) with an fp32 weight, a contiguous fp32 residual of x's
        shape."""
        return (self.lib is not None and x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1
                and x.shape[1] % BLOCK == 0 and getattr(norm, "fused", None) is not None
                and norm.weight.dtype == torch.float32 and norm.weight.is_contiguous()
                and norm.weight.shape == (x.shape[1],)
                and (residual is None or (residual.dtype == torch.float32 and residual.is_contiguous()
                                          and residual.shape == x.shape)))

    def rms_norm_quantize_f32(self, x: torch.Tensor, norm, residual: torch.Tensor | None = None):
        """(int8 blocks of norm(h), h), h = x or x + residual, for fp32 rows that `takes_norm_f32`:
        kernels/w4_gemm.c's w4_rms_norm_quantize, the bits of `norm` (or its add_and_norm) then
        `quantize` in one pass."""
        m, d = x.shape
        h = x if residual is None else torch.empty((m, d), dtype=torch.float32)
        out = QuantizedBlocks(torch.empty((m, d), dtype=torch.int8), torch.empty((m, d // BLOCK)),
                              torch.empty((m, d // BLOCK)))
        self._check(self.lib.w4_rms_norm_quantize(x.data_ptr(), x.stride(0),
                                                  None if residual is None else residual.data_ptr(),
                                                  None if residual is None else h.data_ptr(), norm.weight.data_ptr(),
                                                  norm.eps, m, d, out.q.data_ptr(), out.scale.data_ptr(),
                                                  out.sum.data_ptr(), torch.get_num_threads()), "RMSNorm")
        return out, h

    def linear(self, x: QuantizedBlocks, w: W4Weight, add: torch.Tensor | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W^T [+ add] in `dtype` (`add`: [m, n] in `dtype` with unit stride along rows, added
        before the one rounding; `out`: an [m, n] in `dtype` with unit stride along rows to fill)."""
        m = x.q.shape[0]
        if w.packed is not None and w.gate_up and x.q.is_contiguous():
            # (a gate-up weight's product on its own, as a pass whose MLP does not run on these GEMMs
            # asks for: its units as plain columns, put back in the weight's order)
            y = torch.empty((m, w.n))
            self._check(self.lib.w4_gemm(x.q.data_ptr(), x.scale.data_ptr(), x.sum.data_ptr(), w.packed.data_ptr(),
                                         w.dm.data_ptr(), m, w.k, w.n, None, 0, y.data_ptr(), y.stride(0), 0,
                                         torch.get_num_threads()), "GEMM")
            y = y[:, torch.argsort(_gate_up_order(w.n))]
            if add is not None:
                y += add.float()
            return y.to(self.dtype) if out is None else out.copy_(y)
        if w.packed is not None and x.q.is_contiguous():
            if out is None:
                out = torch.empty((m, w.n), dtype=self.dtype)
            if add is not None and add.dtype != self.dtype:
                add = add.to(self.dtype)
            self._check(self.lib.w4_gemm(x.q.data_ptr(), x.scale.data_ptr(), x.sum.data_ptr(), w.packed.data_ptr(),
                                         w.dm.data_ptr(), m, w.k, w.n, None if add is None else add.data_ptr(),
                                         0 if add is None else add.stride(0), out.data_ptr(), out.stride(0),
                                         int(self.dtype == torch.bfloat16), torch.get_num_threads()), "GEMM")
            return out
        y = dequantize_blocks(x) @ self._dense(w).t()
        if add is not None:
            y += add.float()
        return y.to(self.dtype) if out is None else out.copy_(y)

    def gate_up(self, x: QuantizedBlocks, w: W4Weight, mul: torch.Tensor | None = None) -> QuantizedBlocks:
        """The int8 blocks of SiLU(gate) * up for int8 blocks x and the fused [gate | up] weight."""
        if mul is not None:
            raise ValueError("w4a8 rows are not smoothed: gate_up takes no mul")
        m, d = x.q.shape[0], w.n // 2
        if w.packed is not None and w.gate_up and x.q.is_contiguous():
            out = QuantizedBlocks(torch.empty((m, d), dtype=torch.int8), torch.empty((m, d // BLOCK)),
                                  torch.empty((m, d // BLOCK)))
            h = torch.empty((min(m, self.gate_up_block), d))
            self._check(self.lib.w4_gemm_gate_up(x.q.data_ptr(), x.scale.data_ptr(), x.sum.data_ptr(),
                                                 w.packed.data_ptr(), w.dm.data_ptr(), m, w.k, d, h.data_ptr(),
                                                 out.q.data_ptr(), out.scale.data_ptr(), out.sum.data_ptr(),
                                                 torch.get_num_threads()), "gate-up GEMM")
            return out
        y = dequantize_blocks(x) @ self._dense(w).t()
        gate, up = y[:, :d], y[:, d:]
        return quantize_blocks(gate / (1 + torch.exp(-gate)) * up)

    @staticmethod
    def _dense(w: W4Weight) -> torch.Tensor:
        if w.dense is None:
            if w.q is None:
                raise ValueError("this w4a8 weight has only the kernel's packed copy")
            w.dense = dequantize_weight(w.q, w.d, w.m)
        return w.dense
