"""A decode step of a llama-family model as straight calls of the C kernels.

At a few requests a decode step's kernels are short (the GEMMs wait on the weights, the rest takes
microseconds), and the Python between them is a third of the step: each layer goes through eight
modules and their checks (which path, which dtype, which strides), allocates each output and
converts each kernel's arguments. `DecodePath` does the same layer as `LlamaDecoderLayer` with the
same kernels, on the same inputs, in the same order, so the results are the same bits: the
checks are made once, when it is built (every layer a plain bf16 layer on the packed GEMM kernel
and the fused ops, no LoRA, no sharding), the weights' arguments are kept, and each step allocates
its activations once for all layers.

`LlamaForCausalLM.forward` takes it for pure decode passes whose attention runs on the C decode
kernel, one row per request in batch order (`AttentionMetadata.kernel` with no row gather), of at
most the GEMM kernel's rows; every other pass, and every model it does not fit, keeps the layers.

A model converted from a GGUF may also carry its layers' Q4_1 weights (framework/model/
gguf_decode.py, `worker.gguf_decode`): passes of up to `widen_rows` rows then read those, widened
to the same bf16 weights (the same bits), and with "exact" passes of up to `exact_rows` rows take
their exact products (other bits: the one exception to the above).

With model.quantization = "w8a8" (framework/model/int8.py), passes of at least `int8_rows` rows
run each layer's four GEMMs in int8 instead (`Int8Pass`): the calls the layers make in int8, on
buffers allocated once for the pass, so the same bits as those.

A float32 model with model.quantization = "w4a8" takes `W4DecodePath` instead (`LlamaForCausalLM.
decode_path` tries it where `DecodePath` does not fit): its layers' fp32 norms, 4-bit GEMMs and
fp32 attention as the same straight calls, the same bits. A bf16 model with w4a8 takes neither:
its decode steps run through the layers (which call the 4-bit GEMMs from `int8.min_rows` rows).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from framework.model import gguf_decode
from framework.model.cpu_kernels import _GEMM_EPILOGUES, kv_format, scale_ptrs
from framework.model.int8 import min_rows as min_int8_rows
from framework.model.int8 import Int8Weight, _ptr

logger = logging.getLogger(__name__)

_NONE, _ADD, _GATE_UP = (_GEMM_EPILOGUES[k] for k in ("none", "add", "gate_up"))


@dataclass
class _Weights:
    qkv: int  # pointers of packed GEMM weights
    o: int
    gate_up: int
    down: int


@dataclass
class _Layer:
    input_norm: int  # weight pointers
    post_norm: int
    tiles: _Weights  # the packed bf16 weights (packed_gemm_bf16)
    q4: _Weights | None  # the GGUF's Q4_1 weights (q4_gemm_bf16, see framework/model/gguf_decode.py)
    int8: tuple | None = None  # the int8 weights (qkv, o, gate_up, down: Int8Weight, framework/model/int8.py)


@dataclass
class _Step:
    """What every layer of one decode step passes to RoPE and the decode attention kernel: the
    slots' and the tables' pointers (`loc` kept, as its pointer is passed), the kernel's plan, the
    pool's format, the step's rows (one a request)."""

    loc: torch.Tensor
    cos: int
    sin: int
    ploc: int
    r2t: int
    r2t_stride: int
    pool_idx: int
    seq_lens: int
    kv_fmt: int
    rows: int

    @classmethod
    def of(cls, loc: torch.Tensor, meta, rope, kv_pool, rows: int) -> "_Step":
        loc = loc.to(torch.int64).contiguous()
        plan = meta.kernel
        return cls(loc, rope.cos.data_ptr(), rope.sin.data_ptr(), loc.data_ptr(), plan.req_to_token.data_ptr(),
                   plan.req_to_token.stride(0), plan.pool_idx.data_ptr(), plan.seq_lens.data_ptr(),
                   kv_format(kv_pool.k_buffer[0]), rows)


class DecodePath:
    """The decode layers of one model (see the module docstring); `build` says whether it fits."""

    # None, or a clock `mark(part)` that `bench ... --breakdown` sets while it times a run: called
    # after each kernel with the part it belongs to (framework/bench/breakdown.py), and with None
    # to start.
    mark = None

    def __init__(self, model, layers: list[_Layer], keep: list[torch.Tensor]):
        kernels = model.kernels
        self.fused, self.gemm = kernels.fused, kernels.gemm
        self.backend = model.attn_backend
        self._rope, self._q_bf16 = self.fused._rope_kv, 1  # (bf16 rows)
        self.layers = layers
        self._keep = keep  # the tensors whose pointers the layers hold
        self._take_shapes(model)
        # passes of at most this many rows take the layers' Q4_1 weights (build): their exact
        # products, or their blocks widened to the bf16 weights (the same bits as those)
        self.exact_rows = self.widen_rows = 0
        # passes of at least this many rows take the int8 GEMMs (model.quantization = "w8a8"),
        # before the Q4_1 weights; 0: none do
        self.int8_rows = 0
        self.int8_ops = getattr(model.model.layers[0].mlp, "int8_ops", None)

    def _take_shapes(self, model) -> None:
        """The sizes the layers' calls pass (every layer's as the first's: `build` checks), the
        norms' eps and the final norm."""
        config, attn0 = model.config, model.model.layers[0].self_attn
        self.hidden = config.hidden_size
        self.heads, self.kv_heads, self.head_dim = attn0.num_heads, attn0.num_kv_heads, attn0.head_dim
        self.q_size, self.qkv_size = attn0.q_size, attn0.q_size + 2 * attn0.kv_size
        self.inter = model.model.layers[0].mlp.intermediate_size
        self.eps = model.model.layers[0].input_layernorm.eps
        self.final_norm = model.model.norm

    def _rope_attend(self, step: _Step, i: int, kv_pool, pqkv: int, pq: int, pattn: int, threads: int) -> int:
        """Layer i's RoPE with its K and V written into the pool (`rope_kv` of the fused projection
        at `pqkv`, q into `pq`), then its decode attention into `pattn`, each part marked as it ends;
        returns the kernels' codes or'ed. (`_rope` and `_q_bf16`: the path's row dtype.)"""
        k, v = kv_pool.k_buffer[i], kv_pool.v_buffer[i]
        k_buf, v_buf = k.data_ptr(), v.data_ptr()
        k_scale, v_scale = scale_ptrs(k, v)
        heads, kv_heads, head_dim, backend, mark = self.heads, self.kv_heads, self.head_dim, self.backend, self.mark
        rc = self._rope(pqkv, self.qkv_size, step.cos, step.sin, step.ploc, pq, k_buf, v_buf, k_scale, v_scale,
                        step.kv_fmt, step.rows, heads, kv_heads, head_dim, threads)
        if mark:
            mark("elementwise")
        rc |= backend.decode_kernel(pq, k_buf, v_buf, k_scale, v_scale, step.r2t, step.r2t_stride, step.pool_idx,
                                    step.seq_lens, pattn, step.rows, heads, kv_heads, head_dim, self._q_bf16,
                                    step.kv_fmt, backend.scaling, threads, int(backend.decode_tiles))
        if mark:
            mark("attention")
        return rc

    @classmethod
    def build(cls, model) -> "DecodePath | None":
        """The path for `model`, or None when a layer would not take the kernels the path calls."""
        from framework.model.llama import Linear, LlamaMLP, RMSNorm, RowParallelLinear

        kernels = model.kernels
        if (kernels is None or kernels.gemm is None or model.attn_backend.decode_kernel is None
                or model.par.gathers_mlp_tokens):
            return None
        layers, keep = [], []
        q4_layers = cls._q4_layers(model)
        for i, layer in enumerate(model.model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            plain = (type(attn.qkv_proj) is Linear and type(attn.o_proj) is RowParallelLinear
                     and type(mlp) is LlamaMLP and mlp._plain_layers() and all(type(n) is RMSNorm for n in norms))
            if not plain or attn.o_proj.shard_size != 1 or mlp.down_proj.shard_size != 1:
                return None
            tiles = (attn.qkv_proj.tiles, attn.o_proj.tiles, mlp.gate_up_proj.tiles, mlp.down_proj.tiles)
            if (any(t is None for t in tiles) or attn.qkv_proj.bias is not None or attn.o_proj.bias is not None
                    or mlp.intermediate_size % 16 or attn.fused is None or mlp.kernels is None
                    or any(n.fused is None or n.weight.dtype != torch.bfloat16 or n.eps != norms[0].eps
                           for n in norms)
                    or attn.backend is not model.attn_backend):
                return None
            int8 = (attn.qkv_proj.int8, attn.o_proj.int8, mlp.gate_up_proj.int8, mlp.down_proj.int8)
            if any(w is not None for w in int8) and not all(isinstance(w, Int8Weight) for w in int8):
                return None  # (quantized weights this path does not call, w4a8's: the layers run them)
            q4 = q4_layers[i] if q4_layers else ()
            keep += [*tiles, *q4, *(n.weight for n in norms)]
            layers.append(_Layer(norms[0].weight.data_ptr(), norms[1].weight.data_ptr(),
                                 _Weights(*(t.data_ptr() for t in tiles)),
                                 _Weights(*(t.data_ptr() for t in q4)) if q4 else None,
                                 int8 if int8[0] is not None else None))
        if not layers or model.model.norm.weight.dtype != torch.bfloat16:
            return None
        path = cls(model, layers, keep)
        if path.hidden > path.fused.MAX_NORM_WIDTH or path.eps != model.model.norm.eps:
            return None
        if path.int8_ops is not None and path.int8_ops.lib is not None and all(lay.int8 for lay in layers):
            path.int8_rows = min_int8_rows(all(w.packed is not None for lay in layers for w in lay.int8))
        if q4_layers:
            path.exact_rows = gguf_decode.EXACT_ROWS if getattr(model, "q4_exact", False) else 0
            path.widen_rows = min(gguf_decode.WIDEN_ROWS, path.gemm.rows)
        return path

    @staticmethod
    def _q4_layers(model) -> list | None:
        """The model's packed Q4_1 weights (gguf_decode.use_gguf_decode) where each has the shape of
        the weight it stands for; else None, with a warning where there were some."""
        q4_layers = getattr(model, "q4_layers", None)
        if not q4_layers:
            return None
        if len(q4_layers) != len(model.model.layers):
            logger.warning("Decode steps keep the bf16 weights: %d layers of Q4_1 weights for %d layers",
                           len(q4_layers), len(model.model.layers))
            return None
        block = model.kernels.gemm.Q4_BLOCK
        for i, (layer, q4) in enumerate(zip(model.model.layers, q4_layers)):
            attn, mlp = layer.self_attn, layer.mlp
            weights = (attn.qkv_proj.weight, attn.o_proj.weight, mlp.gate_up_proj.weight, mlp.down_proj.weight)
            for w, packed in zip(weights, q4):
                n, k = w.shape
                if tuple(packed.shape) != (n // 16, k // 32, block) or n % 16 or k % 32:
                    logger.warning("Decode steps keep the bf16 weights: layer %d's Q4_1 weights %s do not fit its "
                                   "weight %s", i, tuple(packed.shape), tuple(w.shape))
                    return None
        return q4_layers

    def takes(self, hidden: torch.Tensor, meta, rope, kv_pool) -> bool:
        """Whether this pass is one the path runs exactly as the layers would."""
        plan = getattr(meta, "kernel", None)
        return (plan is not None and plan.rows is None and hidden.dtype == torch.bfloat16
                and 0 < hidden.shape[0] <= self.gemm.rows and hidden.is_contiguous()
                and rope.cos.is_contiguous() and rope.sin.is_contiguous()
                and self.fused.supports_rope_kv(kv_pool.k_buffer[0]))

    def run(self, hidden: torch.Tensor, loc: torch.Tensor, meta, rope, kv_pool) -> torch.Tensor:
        """All layers and the final norm, as `LlamaForCausalLM.forward` would run them."""
        n, d = hidden.shape
        threads = torch.get_num_threads()
        bf16 = torch.bfloat16
        x = torch.empty((n, d), dtype=bf16)  # a layer's normed input
        qkv = torch.empty((n, self.qkv_size), dtype=bf16)
        q = torch.empty((n, self.q_size), dtype=bf16)
        attn = torch.empty((n, self.q_size), dtype=bf16)
        o = torch.empty((n, d), dtype=bf16)
        h = torch.empty((n, d), dtype=bf16)  # the residual stream after attention
        act = torch.empty((n, self.inter), dtype=bf16)
        outs = (torch.empty((n, d), dtype=bf16), torch.empty((n, d), dtype=bf16))  # layers' outputs in turn
        hid = hidden
        step = _Step.of(loc, meta, rope, kv_pool, n)
        px, pqkv, pq, pattn, po, ph, pact = (t.data_ptr() for t in (x, qkv, q, attn, o, h, act))
        rms = self.fused._rms_norm
        int8 = None
        if 0 < self.int8_rows <= n:
            int8 = Int8Pass(self.int8_ops, n, d, self.q_size, self.inter)
        # the GEMMs: on the Q4_1 weights (`widen` after the epilogue), or on the bf16 ones (tiles, stream)
        q4 = int8 is None and n <= max(self.exact_rows, self.widen_rows)
        gemm, tail = ((self.gemm._q4_gemm, (self.gemm.widen_mode if n > self.exact_rows else 0,)) if q4
                      else (self.gemm._gemm, (int(self.gemm.tiles), 0)))
        eps = self.eps
        inter, qkv_size, q_size = self.inter, self.qkv_size, self.q_size
        mark = self.mark
        if mark:
            mark(None)
        for i, layer in enumerate(self.layers):
            w = layer.q4 if q4 else layer.tiles
            phid = hid.data_ptr()
            out = outs[i % 2]  # never the layer's input (the other one, or `hidden` itself)
            if int8 is not None:
                w8 = layer.int8
                rc = int8.rms_norm(phid, None, None, layer.input_norm, eps, d, w8[0])
                if mark:
                    mark("elementwise")
                rc |= int8.linear(w8[0], pqkv, qkv_size)
            else:
                rc = rms(phid, d, None, None, layer.input_norm, px, n, d, eps, threads)
                if mark:
                    mark("elementwise")
                rc |= gemm(px, d, w.qkv, None, 0, pqkv, qkv_size, n, d, qkv_size, _NONE, threads, *tail)
            if mark:
                mark("gemm")
            rc |= self._rope_attend(step, i, kv_pool, pqkv, pq, pattn, threads)
            if int8 is not None:
                rc |= int8.quantize(pattn, q_size, w8[1])
                rc |= int8.linear(w8[1], po, d)
                if mark:
                    mark("gemm")
                rc |= int8.rms_norm(po, phid, ph, layer.post_norm, eps, d, w8[2])
                if mark:
                    mark("elementwise")
                rc |= int8.gate_up(w8[2], w8[3])
                rc |= int8.linear(w8[3], out.data_ptr(), d, add=ph)
            else:
                rc |= gemm(pattn, q_size, w.o, None, 0, po, d, n, q_size, d, _NONE, threads, *tail)
                if mark:
                    mark("gemm")
                rc |= rms(po, d, phid, ph, layer.post_norm, px, n, d, eps, threads)
                if mark:
                    mark("elementwise")
                rc |= gemm(px, d, w.gate_up, None, 0, pact, inter, n, d, inter, _GATE_UP, threads, *tail)
                rc |= gemm(pact, inter, w.down, ph, d, out.data_ptr(), d, n, inter, d, _ADD, threads, *tail)
            if mark:
                mark("gemm")
            if rc:
                raise RuntimeError(f"decode path: a kernel refused a call of layer {i}")
            hid = out
        return self.final_norm(hid)


class Int8Pass:
    """The buffers and calls of one decode pass's int8 GEMMs (`DecodePath.run` with int8 weights):
    each layer's input rows quantized once into `x` (with their scales `x_scale`); on torch._int_mm
    the int32 sums of every GEMM in a buffer of their shape, on the own kernel silu(gate) * up in
    one fp32 buffer, each made when first needed and reused by all layers."""

    def __init__(self, ops, n: int, d: int, q_size: int, inter: int):
        self.ops, self.n, self.threads = ops, n, torch.get_num_threads()
        widest = max(d, q_size, inter)
        self.x_all = torch.empty((n, widest), dtype=torch.int8)
        self.x_scale = torch.empty(n, dtype=torch.float32)
        self.x = self.x_all[:, :d]  # the rows the next GEMM takes: [n, their width], see _rows
        self.sums: dict[int, torch.Tensor] = {}  # width -> int32 [n, width] (torch._int_mm's output)
        self.h: torch.Tensor | None = None  # fp32 [n, inter]: silu(gate) * up (the own kernel's gate_up)
        self.px, self.pscale = self.x_all.data_ptr(), self.x_scale.data_ptr()

    def _sums(self, width: int) -> torch.Tensor:
        if width not in self.sums:
            self.sums[width] = torch.empty((self.n, width), dtype=torch.int32)
        return self.sums[width]

    def _rows(self, width: int) -> torch.Tensor:
        """`x` as [n, width] rows (the next GEMM's input width), over the same buffer."""
        self.x = self.x_all.view(-1)[: self.n * width].view(self.n, width)
        return self.x

    def rms_norm(self, phid: int, residual: int | None, residual_out: int | None, weight: int, eps: float,
                 d: int, w) -> int:
        """RMSNorm of the hidden rows at `phid` (bf16 [n, d], after the residual add when there is
        one, written to `residual_out`) into `x`, for the int8 weight `w` (its smoothing)."""
        self._rows(d)
        return self.ops._rms_quantize(phid, d, residual, residual_out, weight, eps, _ptr(w.inv), self.px, self.pscale,
                                      self.n, d, self.threads)

    def quantize(self, px: int, width: int, w) -> int:
        """bf16 rows [n, width] at `px` into `x`, for the int8 weight `w` (its smoothing)."""
        self._rows(width)
        return self.ops._quantize(px, width, _ptr(w.inv), self.px, self.pscale, self.n, width, self.threads)

    def linear(self, w, out: int, out_stride: int, add: int | None = None) -> int:
        """bf16(x @ W^T [+ add]) into `out` (`add`: bf16 rows of the output's shape, contiguous)."""
        n_out = w.out_features
        if w.packed is not None and not w.gate_up:
            return self.ops._gemm(self.px, self.pscale, w.packed.data_ptr(), w.scale.data_ptr(), self.n,
                                  self.x.shape[1], n_out, add, n_out if add else 0, out, out_stride, self.threads)
        sums = self._sums(n_out)
        torch._int_mm(self.x, w.q, out=sums)
        return self.ops._dequantize(sums.data_ptr(), self.pscale, w.scale.data_ptr(), add, n_out if add else 0, out,
                                    out_stride, self.n, n_out, self.threads)

    def gate_up(self, w, down) -> int:
        """SiLU(gate) * up of x and the fused gate-up weight `w`, quantized into `x` for the down
        projection's int8 weight `down` (its smoothing)."""
        inter = w.out_features // 2
        if w.packed is not None and w.gate_up:  # (its int8 rows written over x after every sum is made)
            k = self.x.shape[1]
            if self.h is None:
                self.h = torch.empty((self.n, inter), dtype=torch.float32)
            self._rows(inter)
            return self.ops._gemm_gate_up(self.px, self.pscale, w.packed.data_ptr(), w.scale.data_ptr(), self.n, k,
                                          inter, _ptr(down.inv), self.h.data_ptr(), self.px, self.pscale, self.threads)
        sums = self._sums(w.out_features)
        torch._int_mm(self.x, w.q, out=sums)
        self._rows(inter)
        return self.ops._silu_mul_quantize(sums.data_ptr(), self.pscale, w.scale.data_ptr(), _ptr(down.inv), self.px,
                                           self.pscale, self.n, inter, self.threads)


class W4DecodePath(DecodePath):
    """The decode layers of a float32 model with model.quantization = "w4a8" (framework/model/
    w4a8.py) as straight kernel calls: per layer the fp32 RMSNorm with its rows quantized to int8
    blocks (one pass, `W4Ops.rms_norm_quantize_f32`), the 4-bit qkv GEMM, RoPE with the KV writes,
    the decode attention kernel, the o GEMM, the add-and-norm, the gate-up GEMM with SiLU * up
    quantized in its epilogue, and the down GEMM with the residual added: the calls `LlamaDecoderLayer` makes for such a pass (`_norms`, `project`,
    `LlamaMLP._int8_mlp`, `W4Ops`), with the same arguments in the same order, so the same bits.
    What it saves is the Python around them: on a 2-core AMD EPYC Zen 3, a 200-request decode step
    held the GIL ~30 ms of its ~340 (py-spy), while the other core waited."""

    def __init__(self, model, layers: list[tuple], ops, keep: list[torch.Tensor]):
        self.fused = model.kernels.fused
        self.backend = model.attn_backend
        self._rope, self._q_bf16 = self.fused._rope_kv_f32, 0  # (fp32 rows)
        # a layer's pointers: input norm, post norm, then (packed, dm) of qkv, o, gate_up and down
        self.layers = layers
        self._keep = keep  # the tensors whose pointers the layers hold
        self.ops = ops
        self._take_shapes(model)

    @classmethod
    def build(cls, model) -> "W4DecodePath | None":
        """The path for `model`, or None where a layer would not make exactly these calls."""
        from framework.model.llama import Linear, LlamaMLP, RMSNorm, RowParallelLinear
        from framework.model.w4a8 import BLOCK, W4Ops, W4Weight

        kernels = model.kernels
        if (kernels is None or kernels.fused is None or model.attn_backend.decode_kernel is None
                or model.par.gathers_mlp_tokens or not model.model.layers):
            return None
        ops = model.model.layers[0].int8_ops
        if not isinstance(ops, W4Ops) or ops.lib is None or ops.dtype != torch.float32:
            return None
        layers, keep = [], []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            weights = tuple(getattr(lin, "int8", None) for lin in linears)  # (a wrapped layer has none)
            if (type(attn.qkv_proj) is not Linear or type(attn.o_proj) is not RowParallelLinear
                    or type(mlp) is not LlamaMLP or not mlp._plain_layers()
                    or type(mlp.down_proj) is not RowParallelLinear
                    or any(type(n) is not RMSNorm for n in norms)
                    or attn.o_proj.shard_size != 1 or mlp.down_proj.shard_size != 1
                    or layer.int8_ops is not ops or mlp.int8_ops is not ops
                    or any(getattr(lin, "bias", None) is not None or getattr(lin, "int8_ops", None) is not ops
                           for lin in linears)
                    or any(not isinstance(w, W4Weight) or w.packed is None for w in weights)
                    or not weights[2].gate_up or weights[2].n != 2 * mlp.intermediate_size
                    or mlp.intermediate_size % BLOCK or attn.backend is not model.attn_backend
                    or attn.fused is not kernels.fused
                    or any(n.fused is not kernels.fused or n.weight.dtype != torch.float32
                           or not n.weight.is_contiguous() or n.eps != norms[0].eps for n in norms)):
                return None
            layers.append((norms[0].weight.data_ptr(), norms[1].weight.data_ptr(),
                           *((w.packed.data_ptr(), w.dm.data_ptr()) for w in weights)))
            keep += [n.weight for n in norms] + [t for w in weights for t in (w.packed, w.dm)]
        return cls(model, layers, ops, keep)

    def takes(self, hidden: torch.Tensor, meta, rope, kv_pool) -> bool:
        from framework.model.int8 import takes as takes_int8

        plan = getattr(meta, "kernel", None)
        return (plan is not None and plan.rows is None and hidden.dtype == torch.float32
                and hidden.is_contiguous() and takes_int8(hidden, True) and rope.cos.dtype == torch.float32
                and rope.cos.is_contiguous() and rope.sin.is_contiguous()
                and self.fused.supports_rope_kv(kv_pool.k_buffer[0], torch.float32))

    def run(self, hidden: torch.Tensor, loc: torch.Tensor, meta, rope, kv_pool) -> torch.Tensor:
        """All layers and the final norm, as `LlamaForCausalLM.forward` would run them."""
        from framework.model.w4a8 import BLOCK

        n, d = hidden.shape
        threads = torch.get_num_threads()
        f32 = torch.float32
        lib, ops = self.ops.lib, self.ops
        eps = self.eps
        inter, qkv_size, q_size = self.inter, self.qkv_size, self.q_size
        widest = max(d, q_size)
        # the activations, allocated once for all layers
        xq = torch.empty((n, widest), dtype=torch.int8)  # the next GEMM's input rows as int8 blocks
        xs, xsum = torch.empty((n, widest // BLOCK)), torch.empty((n, widest // BLOCK))
        aq = torch.empty((n, inter), dtype=torch.int8)  # SiLU(gate) * up as int8 blocks
        a_s, asum = torch.empty((n, inter // BLOCK)), torch.empty((n, inter // BLOCK))
        gate_h = torch.empty((min(n, ops.gate_up_block), inter))  # the gate-up GEMM's fp32 rows
        qkv = torch.empty((n, qkv_size), dtype=f32)
        q = torch.empty((n, q_size), dtype=f32)
        attn = torch.empty((n, q_size), dtype=f32)
        o = torch.empty((n, d), dtype=f32)
        h = torch.empty((n, d), dtype=f32)  # the residual stream after attention
        outs = (torch.empty((n, d), dtype=f32), torch.empty((n, d), dtype=f32))  # layers' outputs in turn
        step = _Step.of(loc, meta, rope, kv_pool, n)
        pxq, pxs, pxsum = (t.data_ptr() for t in (xq, xs, xsum))
        paq, pas, pasum, pgate = (t.data_ptr() for t in (aq, a_s, asum, gate_h))
        pqkv, pq, pattn, po, ph = (t.data_ptr() for t in (qkv, q, attn, o, h))
        norm_q, quantize, gemm, gate_up = lib.w4_rms_norm_quantize, lib.w4_quantize, lib.w4_gemm, lib.w4_gemm_gate_up
        mark = self.mark
        if mark:
            mark(None)
        hid = hidden
        for i, (norm_in, norm_post, w_qkv, w_o, w_gate_up, w_down) in enumerate(self.layers):
            phid = hid.data_ptr()
            out = outs[i % 2]  # never the layer's input (the other one, or `hidden` itself)
            rc = norm_q(phid, d, None, None, norm_in, eps, n, d, pxq, pxs, pxsum, threads)
            if mark:
                mark("elementwise")
            rc |= gemm(pxq, pxs, pxsum, *w_qkv, n, d, qkv_size, None, 0, pqkv, qkv_size, 0, threads)
            if mark:
                mark("gemm")
            rc |= self._rope_attend(step, i, kv_pool, pqkv, pq, pattn, threads)
            rc |= quantize(pattn, 0, q_size, n, q_size, pxq, pxs, pxsum, threads)
            rc |= gemm(pxq, pxs, pxsum, *w_o, n, q_size, d, None, 0, po, d, 0, threads)
            if mark:
                mark("gemm")
            rc |= norm_q(po, d, phid, ph, norm_post, eps, n, d, pxq, pxs, pxsum, threads)
            if mark:
                mark("elementwise")
            rc |= gate_up(pxq, pxs, pxsum, *w_gate_up, n, d, inter, pgate, paq, pas, pasum, threads)
            rc |= gemm(paq, pas, pasum, *w_down, n, inter, d, ph, d, out.data_ptr(), d, 0, threads)
            if mark:
                mark("gemm")
            if rc:
                raise RuntimeError(f"w4a8 decode path: a kernel refused a call of layer {i}")
            hid = out
        return self.final_norm(hid)
