"""The llama family (Llama, Mistral, Qwen2) over the paged KV cache.

Weights load from `LlamaForCausalLM`-named checkpoints. q/k/v and gate/up are fused into one
matmul each (fewer, larger GEMMs are faster on CPU); `load_weights` writes each HF tensor into its
slice of the fused weight.

Tensor parallelism (framework/distributed.py) shards at load time, each rank reading its slice
of every HF tensor:
* `qkv_proj`: column-parallel; rank r holds its q heads, then its k heads, then its v heads, so
  the fused weight is sharded per part (q, k, v) rather than as one block.
* `gate_up_proj`: column-parallel, sharded per part (gate, up) like qkv.
* `o_proj`, `down_proj`: row-parallel, followed by an all-reduce of the output.
* `embed_tokens` and `lm_head` stay replicated. The KV pool holds `num_kv_heads // tp` heads.
With DP attention, attention is whole on every rank (its own requests) and only the MLP is
sharded: it runs on all ranks' tokens (all-gathered), and each rank keeps its own rows.
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from framework.batch import ModelWorkerBatch
from framework.distributed import ParallelContext, check_model_fits
from framework.memory import ReqToTokenPool, TokenToKVPool
from framework.model.attention import TorchNativeAttention
from framework.model.config import ModelConfig
from framework.model.cpu import (gemm_rows, pack_linear_weight, packed_linear, packed_linear_binary,
                                 packed_linear_unary, pad_rows, to_float32)
from framework.model.cpu_kernels import CpuKernels, FusedOps
from framework.model.decode_path import DecodePath, W4DecodePath
from framework.model.int8 import Int8Ops, Int8Weight, QuantizedRows, rescore_head_top
from framework.model.int8 import min_rows as int8_min_rows
from framework.model.int8 import takes as takes_int8
from framework.model.w4a8 import QuantizedBlocks
from framework.model.rotary import RopeTables, RotaryEmbedding

logger = logging.getLogger(__name__)

# The int8 rows the quantized layers pass between them: w8a8's and w4a8's.
QUANTIZED_ROWS = (QuantizedRows, QuantizedBlocks)


class RMSNorm(nn.Module):
    """RMS norm computed in fp32 and cast back before the weight, as HF llama does (same ops in
    the same order, so fp32 results are bit-identical); in place where the input is not touched.
    With the C kernels (`fused`), bf16 rows take their one-pass kernel with the same roundings, and
    fp32 rows theirs, whose sum of squares goes in another order (HF's values to fp32 rounding)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.fused: FusedOps | None = None  # see use_cpu_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and self.fused.supports_norm(x, self.weight):
            return self.fused.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:
            if self.fused is not None and self.fused.supports_f32(x, self.weight):
                return self.fused.rms_norm_f32(x, self.weight, self.eps)[0]
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        xf = to_float32(x)  # a new tensor, normalized in place
        xf.mul_(torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))
        return torch.empty_like(x).copy_(xf).mul_(self.weight)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(h), h) for h = x + residual; x may be modified (it is a sublayer's fresh output)."""
        fused = self.fused
        if (fused is not None and fused.supports_norm(x, self.weight) and residual.dtype == torch.bfloat16
                and residual.is_contiguous()):
            return fused.add_rms_norm(x, residual, self.weight, self.eps)
        if (fused is not None and fused.supports_f32(x, self.weight) and residual.dtype == torch.float32
                and residual.is_contiguous() and residual.shape == x.shape):
            return fused.rms_norm_f32(x, self.weight, self.eps, residual)
        h = x.add_(residual)
        return self(h), h


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor | None,
           kernels: CpuKernels | None = None, tiles: torch.Tensor | None = None, stream: bool = False,
           int8: Int8Weight | None = None, int8_ops: Int8Ops | None = None,
           int8_fewest: int | None = None, f32: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`, on `packed` (weight's prepacked copy for oneDNN,
    `use_packed_weights`) when there is one and x is bf16. Without a bias, GEMMs of up to
    `kernels.gemm.rows` rows run on the packed GEMM kernel instead, from `tiles` (weight's copy
    in its layout); `stream`: that kernel stores the output past the caches (`PackedGemm.linear`,
    for the LM head). With `int8` (weight's int8 copy, model.quantization = "w8a8", or its 4-bit
    blocks, "w4a8"), passes of rows that `int8.takes` run on `int8_ops` (framework/model/int8.py,
    w4a8.py; `int8_fewest`: its `fewest`), as do rows quantized already (QUANTIZED_ROWS).
    With `f32` (weight's copy for the fp32 GEMM kernel, `use_f32_gemm`), fp32 rows run on it."""
    if int8 is not None and (isinstance(x, QUANTIZED_ROWS) or takes_int8(x, int8.packed is not None, int8_fewest)):
        y = int8_ops.linear(x if isinstance(x, QUANTIZED_ROWS) else int8_ops.quantize(x, int8.inv), int8)
        return y if bias is None else y.add_(bias)
    if f32 is not None and kernels is not None and kernels.f32_gemm is not None:
        if kernels.f32_gemm.supports(x, f32, weight.shape[1]):
            return kernels.f32_gemm.linear(x, f32, weight.shape[0], bias)
    if packed is not None and x.dtype == torch.bfloat16:
        gemm = kernels.gemm if kernels is not None and bias is None and tiles is not None else None
        if gemm is not None and gemm.supports(x, tiles):
            return gemm.linear(x, tiles, weight.shape[0], stream=stream)
        return packed_linear(x, packed, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear that runs on a prepacked copy of its weight when one is set (`use_packed_weights`)."""

    packed: torch.Tensor | None = None
    tiles: torch.Tensor | None = None  # the packed GEMM kernel's copy, see use_packed_weights
    kernels: CpuKernels | None = None  # see use_cpu_kernels
    int8: Int8Weight | None = None  # see framework/model/int8.py's use_int8_weights
    int8_ops: Int8Ops | None = None
    f32: torch.Tensor | None = None  # the fp32 GEMM kernel's copy, see use_f32_gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed, self.kernels, self.tiles, int8=self.int8,
                      int8_ops=self.int8_ops, f32=self.f32)


class RowParallelLinear(nn.Module):
    """A linear layer whose input dimension is split over the ranks: `reduce(x @ W_r^T) + b`.

    The parameters and sizes are named as nn.Linear's, so checkpoints load into it unchanged and
    LoRA wraps it like any linear layer (`in_features` is this rank's shard).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, par: ParallelContext, shard_size: int):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        self.par = par
        self.shard_size = shard_size
        self.packed: torch.Tensor | None = None  # see use_packed_weights
        self.tiles: torch.Tensor | None = None  # the packed GEMM kernel's copy, see use_packed_weights
        self.kernels: CpuKernels | None = None  # see use_cpu_kernels
        self.int8: Int8Weight | None = None  # see framework/model/int8.py's use_int8_weights
        self.int8_ops: Int8Ops | None = None
        self.f32: torch.Tensor | None = None  # the fp32 GEMM kernel's copy, see use_f32_gemm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shard_size == 1:
            return linear(x, self.weight, self.bias, self.packed, self.kernels, self.tiles, int8=self.int8,
                          int8_ops=self.int8_ops, f32=self.f32)
        # The bias is added once, after the sum of the ranks' partial products.
        y = self.par.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, backend: TorchNativeAttention, par: ParallelContext):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_heads // par.attn_tp_size
        self.num_kv_heads = config.num_kv_heads // par.attn_tp_size
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        # Qwen2 has q/k/v bias but no o_proj bias; Llama's attention_bias covers both.
        o_bias = config.attention_bias and config.architecture == "LlamaForCausalLM"
        self.o_proj = RowParallelLinear(self.q_size, config.hidden_size, o_bias, par, par.attn_tp_size)
        self.backend = backend
        self.fused: FusedOps | None = None  # see use_cpu_kernels

    def project(
        self, hidden: torch.Tensor, rope: RopeTables, out_cache_loc: torch.Tensor, kv_pool: TokenToKVPool,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q/k/v of some tokens: rotates q and k, writes k/v into the pool; returns q [T, q_size]
        (in `out` when given: contiguous rows of a larger q, as a prefill tile's)."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        fused = self.fused
        k_buf, v_buf = kv_pool.k_buffer[self.layer_id], kv_pool.v_buffer[self.layer_id]
        if (fused is not None and (fused.supports(qkv) or fused.supports_f32(qkv))
                and fused.supports_rope_kv(k_buf, qkv.dtype) and rope.cos.is_contiguous()
                and rope.cos.dtype == qkv.dtype and (out is None or out.dtype == qkv.dtype)):
            return fused.rope_kv(qkv, rope.cos, rope.sin, out_cache_loc, k_buf, v_buf, self.num_heads,
                                 self.num_kv_heads, out=out)
        # q and k heads are rotated together: [T, heads + kv_heads, D] is a view of qkv.
        num_qk_heads = self.num_heads + self.num_kv_heads
        qk = rope.apply(qkv[:, : self.q_size + self.kv_size].view(num_tokens, num_qk_heads, self.head_dim))
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        kv_pool.set_kv(self.layer_id, out_cache_loc, qk[:, self.num_heads :], v)
        q = qk[:, : self.num_heads].reshape(num_tokens, self.q_size)
        return q if out is None else out.copy_(q)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, par: ParallelContext):
        super().__init__()
        self.par = par
        self.intermediate_size = config.intermediate_size // par.tp_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate_size, bias=False)
        self.down_proj = RowParallelLinear(self.intermediate_size, config.hidden_size, False, par, par.tp_size)
        self.fused: FusedOps | None = None  # see use_cpu_kernels
        self.kernels: CpuKernels | None = None  # see use_cpu_kernels
        # Prepacked gate and up halves (use_packed_weights): SiLU, the product and the residual add
        # then happen inside the three GEMMs.
        self.packed_gate: torch.Tensor | None = None
        self.packed_up: torch.Tensor | None = None
        self.int8_ops: Int8Ops | None = None  # with the projections' int8 weights (use_int8_weights)

    def forward(self, x: torch.Tensor, batch: ModelWorkerBatch, residual: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """MLP(x), plus `residual` when given; in `out` when given (rows of a larger output, as a
        prefill tile's: the packed GEMM kernel writes them in place, other paths copy)."""
        gathers = self.par.gathers_mlp_tokens
        if isinstance(x, QUANTIZED_ROWS) or (not gathers and self.int8_ops is not None
                                            and takes_int8(x, self.int8_ops.packs) and self._int8_layers()):
            y = self._int8_mlp(x, residual, out)
        elif not gathers and self.packed_gate is not None and x.dtype == torch.bfloat16 and self._plain_layers():
            y = self._packed_mlp(x, residual, out)  # (the residual added in its last GEMM)
        else:
            if gathers:
                counts = batch.global_num_tokens
                y = self.par.own_rows(self._mlp(self.par.gather_rows(x, counts)), counts)
            else:
                y = self._mlp(x)
            if residual is not None:
                y.add_(residual)
        return y if out is None or y is out else out.copy_(y)

    def _plain_layers(self) -> bool:
        # A LoRA-wrapped projection must run its own forward (the packed copies lack the deltas).
        return type(self.gate_up_proj) is Linear and type(self.down_proj) is RowParallelLinear

    def _int8_layers(self) -> bool:
        return self._plain_layers() and self.gate_up_proj.int8 is not None and self.down_proj.int8 is not None

    def _int8_mlp(self, x: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
        """The MLP in int8 (framework/model/int8.py): SiLU(gate) * up quantized straight from the
        gate-up sums, the residual added in the down projection's dequantization."""
        ops = self.int8_ops
        gate_up, down = self.gate_up_proj.int8, self.down_proj.int8
        act = ops.gate_up(x if isinstance(x, QUANTIZED_ROWS) else ops.quantize(x, gate_up.inv), gate_up, mul=down.inv)
        if residual is not None and residual.stride(1) != 1:
            residual = residual.contiguous()
        in_place = out is not None and out.dtype == torch.bfloat16 and out.stride(1) == 1
        return ops.linear(act, down, add=residual, out=out if in_place else None)

    def _packed_mlp(
        self, x: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The MLP on prepacked weights; `out` (bf16 with unit stride): where the packed GEMM kernel
        writes the result (the caller copies what the other paths return)."""
        m = x.shape[0]
        kernels = self.kernels
        if kernels is not None and (residual is None or residual.stride(1) == 1):
            gate_up, down = self.gate_up_proj.tiles, self.down_proj.tiles
            # (the gate-up epilogue takes whole blocks of 16 columns)
            if (gate_up is not None and down is not None and self.intermediate_size % 16 == 0
                    and kernels.gemm is not None and kernels.gemm.supports(x, gate_up)):
                act = kernels.gemm.gate_up(x, gate_up, self.intermediate_size)
                in_place = out is not None and out.dtype == torch.bfloat16 and out.stride(1) == 1
                return kernels.gemm.linear(act, down, self.down_proj.out_features, add=residual,
                                           out=out if in_place else None)
        # The GEMMs run at gemm_rows(m) rows: x (and the residual) are padded once, not per call.
        x = pad_rows(x, gemm_rows(m))
        gate = packed_linear_unary(x, self.packed_gate, "swish")
        act = packed_linear_binary(x, gate, self.packed_up, "mul")
        if residual is None:
            return packed_linear(act, self.down_proj.packed, None)[:m]
        return packed_linear_binary(act, pad_rows(residual, x.shape[0]), self.down_proj.packed, "add")[:m]

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fused is not None and self.fused.supports(gate_up):
            return self.down_proj(self.fused.silu_mul(gate_up))
        if self.fused is not None and self.fused.supports_f32(gate_up):
            return self.down_proj(self.fused.silu_mul_f32(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention + MLP with residuals.

    Everything but attention itself works token by token, so a large pass runs it in tiles of
    `PREFILL_TILE` tokens: on CPU an element-wise op on a [16384, 576] bf16 tensor streams from
    memory and is ~7x slower than the same op over eight cache-resident [2048, 576] tiles
    (measured here), while the GEMMs lose little at 2048 rows. Under DP attention the MLP is one
    collective call per layer (the ranks' tile counts would differ), so the pass is one tile.
    """

    def __init__(self, config: ModelConfig, layer_id: int, backend: TorchNativeAttention, par: ParallelContext):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, backend, par)
        self.mlp = LlamaMLP(config, par)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.int8_ops: Int8Ops | None = None  # see framework/model/int8.py's use_int8_weights

    def forward(self, hidden, rope, batch, meta, kv_pool) -> torch.Tensor:
        if hidden.shape[0] == 0:
            # An IDLE pass under DP attention: no attention, but the MLP joins the collectives.
            return self.mlp(hidden, batch)
        attn = self.self_attn
        tiles = [slice(None)] if self.mlp.par.gathers_mlp_tokens else token_tiles(hidden.shape[0])
        norm_in, norm_post = self._norms(hidden)
        if len(tiles) == 1:
            q = attn.project(norm_in(hidden), rope, batch.out_cache_loc, kv_pool)
        else:  # the tiles' q and outputs go straight into the pass's (no torch.cat, no copies)
            q = hidden.new_empty((hidden.shape[0], attn.q_size))
            for t in tiles:
                attn.project(norm_in(hidden[t]), rope.tile(t), batch.out_cache_loc[t], kv_pool, out=q[t])
        attn_out = attn.backend.forward(q, attn.layer_id, meta, kv_pool)
        out = torch.empty_like(hidden) if len(tiles) > 1 else None
        for t in tiles:
            # The sublayers return fresh tensors, so the residual adds can be in place (the MLP adds h).
            normed, h = norm_post(attn.o_proj(attn_out[t]), hidden[t])
            if len(tiles) == 1:
                return self.mlp(normed, batch, residual=h)
            self.mlp(normed, batch, residual=h, out=out[t])
        return out

    def _norms(self, hidden: torch.Tensor):
        """(input norm, post-attention add-and-norm) for this pass: with int8 weights
        (use_int8_weights) and a pass the int8 GEMMs take, the norms give the int8 rows of their
        output (`Int8Ops.rms_norm_quantize`: QuantizedRows, which the projections take as they are)."""
        ops = self.int8_ops
        attn, mlp = self.self_attn, self.mlp
        if (ops is None or not takes_int8(hidden, ops.packs) or type(attn.qkv_proj) is not Linear
                or attn.qkv_proj.int8 is None
                or type(attn.o_proj) is not RowParallelLinear or attn.o_proj.int8 is None or not mlp._int8_layers()
                or mlp.par.gathers_mlp_tokens):
            return self.input_layernorm, self.post_attention_layernorm.add_and_norm
        norm_in, norm_post = self.input_layernorm, self.post_attention_layernorm
        qkv_inv, gate_up_inv = attn.qkv_proj.int8.inv, mlp.gate_up_proj.int8.inv  # (each for its weight's rows)
        if hidden.dtype == torch.float32:  # (the fp32 norms, then their rows quantized)
            # w4a8's kernel does both in one pass (the same bits): W4Ops.rms_norm_quantize_f32
            one_pass = getattr(ops, "takes_norm_f32", None)

            def pre(x):
                if one_pass is not None and one_pass(x, norm_in):
                    return ops.rms_norm_quantize_f32(x, norm_in)[0]
                return ops.quantize(norm_in(x), qkv_inv)

            def post(x, residual):
                if one_pass is not None and one_pass(x, norm_post, residual):
                    return ops.rms_norm_quantize_f32(x, norm_post, residual)
                normed, h = norm_post.add_and_norm(x, residual)
                return ops.quantize(normed, gate_up_inv), h
            return pre, post
        return (lambda x: ops.rms_norm_quantize(x, norm_in.weight, norm_in.eps, mul=qkv_inv)[0],
                lambda x, residual: ops.rms_norm_quantize(x, norm_post.weight, norm_post.eps, residual,
                                                          mul=gate_up_inv))


def use_cpu_kernels(model: nn.Module, kernels: CpuKernels | None) -> None:
    """Run `model`'s decode attention, RMSNorms, SiLU*up and RoPE + KV writes with the C kernels
    (None: PyTorch), and its decode-sized bf16 GEMMs with the packed GEMM kernel where there is one
    (the prepacked weights must be on too: `worker.packed_weights`)."""
    for module in model.modules():
        if isinstance(module, (RMSNorm, LlamaMLP, LlamaAttention)):
            module.fused = kernels.fused if kernels else None
        if isinstance(module, (Linear, RowParallelLinear, LlamaMLP, LlamaForCausalLM)):
            module.kernels = kernels
        if isinstance(module, LlamaForCausalLM):
            module.reset_decode_path()
    model.attn_backend.use_decode_kernel(kernels.decode_attention if kernels else None)
    model.attn_backend.decode_tiles = kernels is None or kernels.decode_tiles
    model.attn_backend.use_extend_kernel(kernels.extend_attention if kernels else None)
    model.attn_backend.use_f32_extend_kernel(kernels.f32_gemm.extend_attention if kernels and kernels.f32_gemm else None)


def use_packed_weights(model: "LlamaForCausalLM", enabled: bool) -> int:
    """Give every bf16 linear layer of `model` (and the LM head) a prepacked copy of its weight for
    oneDNN, and one in the packed GEMM kernel's layout where the model has that kernel
    (`use_cpu_kernels` first), or drop them (`enabled` False); returns how many weights were
    packed for oneDNN. The copies are not parameters: they cost memory beside the weights (~270 MB
    each for SmolLM2) and are rebuilt with the model (`update_weights` builds a new one)."""
    gemm = model.kernels.gemm if enabled and model.kernels is not None else None
    model.reset_decode_path()

    def tiles(weight: torch.Tensor) -> torch.Tensor | None:
        return gemm.pack(weight) if gemm is not None and gemm.packs(weight) else None

    count = 0
    for module in model.modules():
        if isinstance(module, (Linear, RowParallelLinear)):
            eligible = enabled and module.weight.dtype == torch.bfloat16 and getattr(module, "shard_size", 1) == 1
            module.packed = pack_linear_weight(module.weight) if eligible else None
            module.tiles = tiles(module.weight) if eligible else None
            count += eligible
        elif isinstance(module, LlamaMLP):
            weight, size = module.gate_up_proj.weight, module.intermediate_size
            eligible = enabled and weight.dtype == torch.bfloat16 and module.down_proj.shard_size == 1
            module.packed_gate = pack_linear_weight(weight[:size]) if eligible else None
            module.packed_up = pack_linear_weight(weight[size:]) if eligible else None
    head = model.lm_head_weight
    eligible = enabled and head.dtype == torch.bfloat16
    model.packed_lm_head = pack_linear_weight(head) if eligible else None
    model.lm_head_tiles = tiles(head) if eligible else None
    return count + (model.packed_lm_head is not None)


def use_f32_gemm(model: "LlamaForCausalLM", enabled: bool) -> int:
    """Give every fp32 linear layer of `model` whose input is not split over ranks (and the LM
    head) a copy of its weight packed for the fp32 GEMM kernel, where the model has that kernel
    (`use_cpu_kernels` first: kernels/f32_gemm.c on CPUs without AVX-512), or drop them (`enabled`
    False); returns how many weights were packed. The copies cost as much memory as the fp32
    weights (~540 MB for SmolLM2) and are rebuilt with the model (`update_weights` builds a new one)."""
    gemm = model.kernels.f32_gemm if enabled and model.kernels is not None else None

    def copy(weight: torch.Tensor) -> torch.Tensor | None:
        return gemm.pack(weight) if gemm is not None and gemm.packs(weight) else None

    count = 0
    for module in model.modules():
        if isinstance(module, (Linear, RowParallelLinear)):
            module.f32 = copy(module.weight) if getattr(module, "shard_size", 1) == 1 else None
            count += module.f32 is not None
    model.lm_head_f32 = copy(model.lm_head_weight)
    return count + (model.lm_head_f32 is not None)


# Rows of the token-wise part of a layer processed at once (see LlamaDecoderLayer).
PREFILL_TILE = 2048
# The LM head runs on one row per sequence (more with logprobs): its kernels are built ahead up to
# this many rows (`warm_packed_gemms`), the rest on first use.
WARM_HEAD_ROWS = 256


def token_tiles(num_tokens: int) -> list[slice]:
    return [slice(i, min(i + PREFILL_TILE, num_tokens)) for i in range(0, max(num_tokens, 1), PREFILL_TILE)]


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: TorchNativeAttention, par: ParallelContext):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, backend, par) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)


class LlamaForCausalLM(nn.Module):
    """Decoder plus LM head; `forward` returns final hidden states, `compute_logits` the logits."""

    def __init__(self, config: ModelConfig, par: ParallelContext | None = None):
        super().__init__()
        self.config = config
        self.par = par or ParallelContext()
        check_model_fits(config, self.par.tp_size, self.par.dp_attention)
        attn_shards = self.par.attn_tp_size
        self.attn_backend = TorchNativeAttention(
            config.num_heads // attn_shards, config.num_kv_heads // attn_shards, config.head_dim
        )
        self.model = LlamaModel(config, self.attn_backend, self.par)
        if config.tie_word_embeddings or config.is_embedding:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.packed_lm_head: torch.Tensor | None = None  # see use_packed_weights
        self.lm_head_tiles: torch.Tensor | None = None  # the packed GEMM kernel's copy, see use_packed_weights
        self.lm_head_f32: torch.Tensor | None = None  # the fp32 GEMM kernel's copy, see use_f32_gemm
        self.kernels: CpuKernels | None = None  # see use_cpu_kernels
        # the LM head's int8 copy and its GEMMs (model.int8_lm_head: int8.use_int8_weights(..., lm_head=True))
        self.lm_head_int8: Int8Weight | None = None
        self.lm_head_int8_ops: Int8Ops | None = None
        # per layer, packed Q4_1 copies of (qkv, o, gate_up, down) for decode steps, and whether the
        # few-row ones take their exact products (framework/model/gguf_decode.py)
        self.q4_layers: list[list[torch.Tensor]] | None = None
        self.q4_exact = False
        # decode_path(): None until built, False where the layers do not fit it
        self._decode_path: DecodePath | None | bool = None

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: ModelWorkerBatch,
        kv_pool: TokenToKVPool,
        req_to_token_pool: ReqToTokenPool,
        input_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run all layers, writing this pass's K/V into `kv_pool`; returns [num_tokens, hidden].
        Pure decode steps take the decode path where it fits (`decode_path`: same results)."""
        if input_embeds is not None:
            hidden = input_embeds.to(self.model.embed_tokens.weight.dtype)
        else:
            hidden = self.model.embed_tokens(input_ids)
        if hidden.shape[0] == 0 and not self.par.gathers_mlp_tokens:
            return hidden
        if hidden.shape[0] == 0:  # an IDLE pass under DP attention (see LlamaDecoderLayer)
            meta = rope = None
        else:
            meta = self.attn_backend.prepare(batch, req_to_token_pool)
            rope = self.model.rotary.tables(positions, hidden.dtype)
        if meta is not None and batch.forward_mode.is_decode():
            path = self.decode_path()
            if path is not None and path.takes(hidden, meta, rope, kv_pool):
                return path.run(hidden, batch.out_cache_loc, meta, rope, kv_pool)
        for layer in self.model.layers:
            hidden = layer(hidden, rope, batch, meta, kv_pool)
        return self.model.norm(hidden)

    def decode_path(self) -> DecodePath | None:
        """The layers as straight kernel calls for decode steps (framework/model/decode_path.py),
        built on first use; None where the model's layers do not fit it."""
        if self._decode_path is None:
            self._decode_path = DecodePath.build(self) or W4DecodePath.build(self) or False
            if self._decode_path:
                logger.info("Decode steps run their layers as straight kernel calls (decode path)")
        return self._decode_path or None

    def reset_decode_path(self) -> None:
        """Build the decode path again on the next decode step: call after changing the layers'
        modules, kernels or packed weights (use_cpu_kernels, use_packed_weights and LoRA do)."""
        self._decode_path = None

    @torch.inference_mode()
    def warm_packed_gemms(self, max_rows: int = PREFILL_TILE, max_head_rows: int = WARM_HEAD_ROWS) -> int:
        """Run the prepacked GEMMs once at every `gemm_rows` bucket up to `max_rows` rows (the LM
        head up to `max_head_rows`), so oneDNN builds their kernels now rather than inside the
        first requests (~1 s for SmolLM2 here); returns the number of buckets. Row counts a C
        kernel takes (`c_gemm_rows`) need no warming. The kernels depend on the shapes only, so
        one layer stands for all. No-op without packed weights."""
        if self.packed_lm_head is None:
            return 0
        layer = self.model.layers[0]
        attn, mlp = layer.self_attn, layer.mlp
        hidden = self.config.hidden_size
        dtype = self.packed_lm_head.dtype
        buckets = sorted({gemm_rows(m) for m in range(self.c_gemm_rows() + 1, max_rows + 1)})
        for rows in buckets:
            x = torch.zeros((rows, hidden), dtype=dtype)
            if attn.qkv_proj.packed is not None:
                attn.qkv_proj(x)
            if attn.o_proj.packed is not None:
                attn.o_proj(torch.zeros((rows, attn.q_size), dtype=dtype))
            if mlp.packed_gate is not None and mlp._plain_layers():
                mlp._packed_mlp(x, x)
            if rows <= max_head_rows:
                self.compute_logits(x)
        return len(buckets)

    def c_gemm_rows(self) -> int:
        """Up to how many rows the bf16 GEMMs run on a C kernel rather than oneDNN (`linear`)."""
        kernels = self.kernels
        if kernels is None or self.packed_lm_head is None:
            return 0
        return kernels.gemm.rows if kernels.gemm is not None and self.lm_head_tiles is not None else 0

    def int8_head_fewest(self) -> int | None:
        """The fewest rows a compute_logits pass runs the int8 LM head on (model.int8_lm_head), or
        None without one. On the own int8 kernel every pass, as the head's int8 bytes (half of
        bf16's) win where they set the time too (one-stream decode steps, docs/configuration.md)."""
        head8 = self.lm_head_int8
        if head8 is None:
            return None
        return 1 if head8.packed is not None else int8_min_rows(False)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] in the model's dtype (callers widen to fp32 where they need it)."""
        head8, fewest = self.lm_head_int8, self.int8_head_fewest()
        # The logits are read once, by the sampler after the whole GEMM: streamed past the caches.
        logits = linear(hidden, self.lm_head_weight, None, self.packed_lm_head, self.kernels, self.lm_head_tiles,
                        stream=True, int8=head8, int8_ops=self.lm_head_int8_ops, int8_fewest=fewest,
                        f32=self.lm_head_f32)
        if head8 is not None and takes_int8(hidden, head8.packed is not None, fewest):
            # the columns that decide the next token get the bf16 head's values back
            rescore_head_top(logits, hidden, self.lm_head_weight, self.kernels.fused if self.kernels else None)
        return logits

    # -- weights --------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into our (partly fused, partly sharded) parameters; every
        parameter must be set. Each rank keeps its slice (see the module docstring)."""
        params = dict(self.named_parameters())
        attn = self.model.layers[0].self_attn if len(self.model.layers) else None
        par = self.par
        attn_shard = (par.attn_tp_rank, par.attn_tp_size)
        mlp_shard = (par.tp_rank, par.tp_size)
        # HF part -> (our fused parameter, offset in it, shard of the part's output rows).
        fused_parts = {}
        if attn is not None:
            q, kv, inter = attn.q_size, attn.kv_size, self.model.layers[0].mlp.intermediate_size
            fused_parts = {
                "q_proj": ("qkv_proj", 0, attn_shard),
                "k_proj": ("qkv_proj", q, attn_shard),
                "v_proj": ("qkv_proj", q + kv, attn_shard),
                "gate_proj": ("gate_up_proj", 0, mlp_shard),
                "up_proj": ("gate_up_proj", inter, mlp_shard),
            }
        # Row-parallel weights: shard of the input columns.
        row_parallel = {"o_proj.weight": attn_shard, "down_proj.weight": mlp_shard}
        # Count rows written per parameter so a missing shard is caught, not left random.
        num_rows_loaded: dict[str, int] = {}
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if not name.startswith(("model.", "lm_head.")):
                name = "model." + name  # a decoder-only checkpoint (LlamaModel, an embedding model)
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            target, start = name, None
            for part, (fused, offset, shard) in fused_parts.items():
                if f".{part}." in name:
                    target, start = name.replace(part, fused), offset
                    tensor = shard_of(tensor, 0, *shard)
                    break
            for suffix, shard in row_parallel.items():
                if name.endswith(suffix):
                    tensor = shard_of(tensor, 1, *shard)
            if target not in params:
                raise KeyError(f"Unexpected weight {name!r}")
            param = params[target]
            with torch.no_grad():
                if start is None:
                    param.copy_(tensor)
                else:
                    param[start : start + tensor.shape[0]].copy_(tensor)
            num_rows_loaded[target] = num_rows_loaded.get(target, 0) + tensor.shape[0]
        missing = [n for n, p in params.items() if num_rows_loaded.get(n, 0) != p.shape[0]]
        if missing:
            raise ValueError(f"Weights missing or incomplete for: {missing[:8]}")


def shard_of(tensor: torch.Tensor, dim: int, rank: int, num_shards: int) -> torch.Tensor:
    """Rank `rank`'s equal slice of `tensor` along `dim`."""
    if num_shards == 1:
        return tensor
    size = tensor.shape[dim] // num_shards
    return tensor.narrow(dim, rank * size, size)
