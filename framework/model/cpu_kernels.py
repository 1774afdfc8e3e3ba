"""Small C kernels for the CPU, built on first use and called through ctypes.

The source files live in `framework/model/kernels/` (shared helpers in `common.h`). Each is compiled once per machine with the
system C compiler (`cc -O3 -march=native`, with `-fopenmp` where torch runs on libgomp: see
`torch_openmp`) into a cache folder (`BATCHYARD_KERNEL_CACHE`, default
`~/.cache/batchyard/kernels`), keyed by a hash of the source, the command and the CPU. Without a
compiler, or when the build fails, `load` returns None and callers use their PyTorch path: the
kernels are an optimisation, never a requirement. ctypes releases the GIL during a call.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from framework.memory import kv_scales

logger = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).with_name("kernels")
# How the attention kernels read a KV pool's buffers, by their dtype (kernels/common.h's KV_F32,
# KV_BF16, KV_E5M2; a float8_e5m2 pool stores uint8, see TokenToKVPool).
KV_FORMATS = {torch.float32: 0, torch.bfloat16: 1, torch.uint8: 2, torch.int8: 3}
COMPILE_FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-pthread"]
# Tried first: the kernels then split their work over torch's own OpenMP threads (kernels/common.h).
OPENMP_FLAGS = ["-fopenmp"]


def cache_dir() -> Path:
    env = os.environ.get("BATCHYARD_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "batchyard" / "kernels"


def _cpu_id() -> str:
    """The first CPU's model name and feature flags: the kernels are built with -march=native, and
    under a hypervisor different CPUs can share one model name ("Intel(R) Xeon(R) Processor")."""
    try:
        with open("/proc/cpuinfo") as f:
            lines: dict[str, str] = {}
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("model name", "flags"):
                    lines.setdefault(key, line)
                if len(lines) == 2:
                    break
            return "".join(lines.values())
    except OSError:
        return platform.processor()


def _build(source: Path, compiler: str, extra_flags: list[str]) -> Path:
    flags = [*COMPILE_FLAGS, *extra_flags]
    # The shared headers are part of every kernel's key.
    text = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(KERNEL_DIR.glob("*.h")))
    key = hashlib.sha256(text + " ".join([compiler, *flags, _cpu_id()]).encode()).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [compiler, *flags, str(source), "-o", tmp, "-lm"]
        subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
        os.replace(tmp, target)  # atomic: concurrent builders all end with a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    logger.info("Built CPU kernel %s", target)
    return target


@lru_cache(maxsize=None)
def load(name: str) -> ctypes.CDLL | None:
    """The compiled kernel library `kernels/<name>.c`, or None where it cannot be built."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.info("No C compiler found: using the PyTorch path instead of the %s kernel", name)
        return None
    source = KERNEL_DIR / f"{name}.c"
    if torch_openmp() is not None:
        try:
            return ctypes.CDLL(str(_build(source, compiler, OPENMP_FLAGS)))
        except (OSError, subprocess.SubprocessError) as exc:
            logger.info("The %s CPU kernel does not build with OpenMP (using pthreads): %s", name,
                        getattr(exc, "stderr", "") or exc)
    try:
        return ctypes.CDLL(str(_build(source, compiler, [])))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("Cannot build the %s CPU kernel (using the PyTorch path): %s", name, detail)
        return None


@lru_cache(maxsize=None)
def torch_openmp() -> str | None:
    """The path of the GNU OpenMP runtime (libgomp.so.1) torch has loaded, or None where there is
    not exactly one: then an OpenMP-built kernel could bring a second runtime, so none is built."""
    try:
        with open("/proc/self/maps") as f:
            libs = {line.split()[-1] for line in f if "libgomp" in line}
    except OSError:
        return None
    return next(iter(libs)) if len(libs) == 1 else None


def cpu_has_any(names: tuple[str, ...], flags: str | None = None) -> bool:
    """Whether the CPU has any of the feature flags `names` (`flags`: /proc/cpuinfo's flags line;
    default this machine's, `_cpu_id`)."""
    if flags is None:
        flags = _cpu_id()
    return any(name in flags.split() for name in names)


_PTR, _I64, _INT, _FLOAT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


class ExtendAttention:
    """`extend_attention` of kernels/extend_attention.c on one path: prefill attention of one
    request straight from the KV pool, on AMX tiles (`tiles`) or AVX512-BF16 vectors. Called with
    the C function's arguments but the last (see TorchNativeAttention._kernel_extend); returns
    its code (0, or -1 where it does not take the call)."""

    def __init__(self, fn, tiles: bool):
        self._fn = fn
        self.tiles = tiles

    def __call__(self, *args) -> int:
        return self._fn(*args, int(self.tiles))


def load_extend_kernel(tiles: bool | None = None) -> ExtendAttention | None:
    """Prefill attention (kernels/extend_attention.c, see TorchNativeAttention.use_extend_kernel)
    on AMX tiles where the CPU and OS give them, else on AVX512-BF16 vectors (`tiles` False: the
    vectors even where there are tiles, True: tiles or None); None where it cannot be built or
    the CPU lacks AVX512-BF16 (PyTorch's SDPA then).

    Measured on a 2-core AMD EPYC (Zen 4, family 25 model 17: AVX512-BF16, no AMX), W200's
    prefill attention (200 ShareGPT prompts, 30 layers) in the engine: SDPA 15.0 s, the vectors
    3.4 s (one request of 1,024 tokens, 9 heads: 12.3 against 3.6 ms)."""
    lib = load("extend_attention")
    if lib is None:
        return None
    lib.extend_attention_supported.restype = _INT
    paths = lib.extend_attention_supported()
    if paths == 0 or (tiles and paths < 2):
        return None
    fn = lib.extend_attention
    fn.restype = _INT
    fn.argtypes = [_PTR, _I64] + [_PTR] * 4 + [_INT, _PTR, _I64, _I64, _PTR, _I64, _INT, _INT, _INT, _FLOAT, _INT, _INT]
    return ExtendAttention(fn, paths == 2 if tiles is None else tiles)


def kv_format(buf: torch.Tensor) -> int:
    """The KV_FORMATS code of a pool buffer."""
    return KV_FORMATS[buf.dtype]


def scale_ptrs(k_buf: torch.Tensor, v_buf: torch.Tensor) -> tuple[int | None, int | None]:
    """The kernels' k_scale and v_scale arguments: an int8 pool's scales, None (NULL) for others."""
    k, v = kv_scales(k_buf), kv_scales(v_buf)
    return (None if k is None else k.data_ptr()), (None if v is None else v.data_ptr())


def load_decode_kernel():
    """`decode_attention` of kernels/decode_attention.c (see TorchNativeAttention), or None."""
    lib = load("decode_attention")
    return None if lib is None else decode_kernel_of(lib)


def decode_int_query_bits() -> int:
    """The bits the decode kernel rounds an int8 pool's query heads to, reading the pool's rows as
    integers: 8 on AVX512-VNNI (bf16 queries; the scores on `vpdpbusd`), 16 on AVX2 without AVX-512
    (any queries; `vpmaddwd`), P V then with P as int16 a chunk; 0 where it widens the rows (and
    without the kernel)."""
    lib = load("decode_attention")
    if lib is None:
        return 0
    lib.decode_attention_int_query_bits.restype = _INT
    return int(lib.decode_attention_int_query_bits())


def decode_kernel_of(lib: ctypes.CDLL):
    """The `decode_attention` function of a built decode_attention library, typed for ctypes."""
    fn = lib.decode_attention
    fn.restype = _INT
    fn.argtypes = [_PTR] * 6 + [_I64] + [_PTR] * 3 + [_INT] * 6 + [_FLOAT, _INT, _INT]
    return fn


class FusedOps:
    """The element-wise ops of kernels/fused_ops.c, on torch tensors: bf16 ones, and fp32 RMSNorm and
    SiLU * up (`supports_f32`)."""

    def __init__(self, lib: ctypes.CDLL):
        self._rms_norm = lib.rms_norm_bf16
        self._rms_norm.restype = _INT
        self._rms_norm.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _FLOAT, _INT]
        self._silu_mul = lib.silu_mul_bf16
        self._silu_mul.restype = _INT
        self._silu_mul.argtypes = [_PTR, _I64, _PTR, _I64, _I64, _INT]
        self._argmax = lib.argmax_bf16
        self._argmax.restype = None
        self._argmax.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _INT]
        self._argmax_f32 = lib.argmax_f32
        self._argmax_f32.restype = None
        self._argmax_f32.argtypes = self._argmax.argtypes
        self._argmax_masked = lib.argmax_masked
        self._argmax_masked.restype = None
        self._argmax_masked.argtypes = [_PTR, _INT, _I64, _PTR, _I64, _I64, _I64, _PTR]
        self._rope_kv = lib.rope_kv_bf16
        self._rope_kv.restype = _INT
        self._rope_kv.argtypes = [_PTR, _I64] + [_PTR] * 8 + [_INT, _I64] + [_INT] * 4
        self._head_rescore = lib.head_rescore_bf16
        self._head_rescore.restype = None
        self._head_rescore.argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _FLOAT, _PTR, _INT]
        self._head_rescore_f32 = lib.head_rescore_f32
        self._head_rescore_f32.argtypes = self._head_rescore.argtypes
        self._head_rescore_f32.restype = None
        self._rms_norm_f32 = lib.rms_norm_f32
        self._rms_norm_f32.restype = None
        self._rms_norm_f32.argtypes = self._rms_norm.argtypes  # (the bf16 op's, over fp32 rows)
        self._silu_mul_f32 = lib.silu_mul_f32
        self._silu_mul_f32.restype = None
        self._silu_mul_f32.argtypes = self._silu_mul.argtypes
        self._rope_kv_f32 = lib.rope_kv_f32
        self._rope_kv_f32.restype = _INT
        self._rope_kv_f32.argtypes = self._rope_kv.argtypes  # (the bf16 op's, over fp32 rows)

    # The widest row rms_norm takes (its per-thread row buffer, kernels/fused_ops.c).
    MAX_NORM_WIDTH = 8192

    @staticmethod
    def supports(x: torch.Tensor) -> bool:
        """Whether x ([rows, d]) can be passed: bf16 on the CPU with unit stride along d."""
        return x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 2 and x.stride(1) == 1

    def supports_norm(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return self.supports(x) and x.shape[1] <= self.MAX_NORM_WIDTH and weight.dtype == torch.bfloat16

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of bf16 rows (weight bf16 [d]), rounded as the PyTorch path rounds."""
        rows, d = x.shape
        out = torch.empty((rows, d), dtype=torch.bfloat16)
        rc = self._rms_norm(x.data_ptr(), x.stride(0), None, None, weight.data_ptr(), out.data_ptr(),
                            rows, d, eps, torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"rms_norm kernel: hidden size {d} is larger than it supports")
        return out

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        """(rms_norm(h), h) with h = x + residual in bf16 (residual contiguous, x's shape)."""
        rows, d = x.shape
        out, h = torch.empty((rows, d), dtype=torch.bfloat16), torch.empty((rows, d), dtype=torch.bfloat16)
        rc = self._rms_norm(x.data_ptr(), x.stride(0), residual.data_ptr(), h.data_ptr(), weight.data_ptr(),
                            out.data_ptr(), rows, d, eps, torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"rms_norm kernel: hidden size {d} is larger than it supports")
        return out, h

    @staticmethod
    def supports_f32(x: torch.Tensor, weight: torch.Tensor | None = None) -> bool:
        """Whether the fp32 ops take x ([rows, d] fp32 on the CPU, unit stride along d; and an fp32
        norm weight [d] when given)."""
        return (x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 2 and x.stride(1) == 1
                and (weight is None or (weight.dtype == torch.float32 and weight.is_contiguous())))

    def rms_norm_f32(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                     residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(weight * RMSNorm(h), h) of fp32 rows, h = x or x + residual (contiguous, x's shape), in one
        pass (see `supports_f32`); the values of PyTorch's fp32 path to fp32 rounding."""
        rows, d = x.shape
        out = torch.empty((rows, d), dtype=torch.float32)
        h = x if residual is None else torch.empty((rows, d), dtype=torch.float32)
        self._rms_norm_f32(x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
                           None if residual is None else h.data_ptr(), weight.data_ptr(), out.data_ptr(), rows, d,
                           eps, torch.get_num_threads())
        return out, h

    def silu_mul_f32(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[rows, 2 * d] = [gate | up] fp32 -> silu(gate) * up, [rows, d] fp32."""
        rows, d2 = gate_up.shape
        out = torch.empty((rows, d2 // 2), dtype=torch.float32)
        self._silu_mul_f32(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, d2 // 2,
                           torch.get_num_threads())
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[rows, 2 * d] = [gate | up] -> silu(gate) * up, [rows, d] bf16."""
        rows, d2 = gate_up.shape
        out = torch.empty((rows, d2 // 2), dtype=torch.bfloat16)
        self._silu_mul(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, d2 // 2, torch.get_num_threads())
        return out


    @staticmethod
    def supports_argmax(logits: torch.Tensor) -> bool:
        """Whether `argmax` takes these logits: bf16 or fp32 rows [n, vocab] on the CPU with unit
        stride along the vocabulary."""
        return (logits.dtype in (torch.bfloat16, torch.float32) and logits.device.type == "cpu"
                and logits.dim() == 2 and logits.stride(1) == 1)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """torch.argmax(logits, dim=-1) of bf16 or fp32 rows [n, vocab] (see supports_argmax) ->
        int64 [n] (the first index on ties; NaN counts as the largest, as in torch)."""
        rows, d = logits.shape
        out = torch.empty(rows, dtype=torch.int64)
        fn = self._argmax_f32 if logits.dtype == torch.float32 else self._argmax
        fn(logits.data_ptr(), logits.stride(0), rows, d, out.data_ptr(), torch.get_num_threads())
        return out

    def head_rescore(self, logits: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor,
                     margin: float) -> torch.Tensor:
        """int8.rescore_head_top in place on bf16 logits [n, vocab] and hidden [n, k] (see `supports`)
        with the bf16 head weight [vocab, k] contiguous, or the same three in fp32 (`supports_f32`,
        a float32 model); returns how many columns each row took."""
        rows, vocab = logits.shape
        counts = torch.empty(rows, dtype=torch.int64)
        fn = self._head_rescore_f32 if logits.dtype == torch.float32 else self._head_rescore
        fn(logits.data_ptr(), logits.stride(0), hidden.data_ptr(), hidden.stride(0), weight.data_ptr(), rows, vocab,
           hidden.shape[1], margin, counts.data_ptr(), torch.get_num_threads())
        return counts

    @staticmethod
    def supports_masked_argmax(logits: torch.Tensor, mask: torch.Tensor) -> bool:
        """Whether `argmax_masked` takes these: bf16 or fp32 rows with unit stride on the CPU and
        an int32 bitmask with a row per logits row and a bit per token."""
        return (
            logits.dtype in (torch.bfloat16, torch.float32) and logits.device.type == "cpu" and logits.dim() == 2
            and logits.stride(1) == 1 and mask.dtype == torch.int32 and mask.dim() == 2
            and mask.stride(1) == 1 and mask.shape[0] == logits.shape[0] and mask.shape[1] * 32 >= logits.shape[1]
        )

    def argmax_masked(self, logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """argmax of each row over the tokens its xgrammar bitmask allows -> int64 [n]: what
        `apply_vocab_mask` then `argmax` give, without the fp32 copy (see supports_masked_argmax)."""
        rows, d = logits.shape
        out = torch.empty(rows, dtype=torch.int64)
        self._argmax_masked(logits.data_ptr(), int(logits.dtype == torch.bfloat16), logits.stride(0),
                            mask.data_ptr(), mask.stride(0), rows, d, out.data_ptr())
        return out

    # The widest slot row (kv_heads * head_dim) rope_kv writes from bf16 rows into a pool of one byte
    # a value (float8_e5m2 or int8), and from fp32 rows into any pool (kernels/fused_ops.c's BYTE_ROW_MAX).
    BYTE_ROW_MAX = 4096

    def supports_rope_kv(self, k_pool: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> bool:
        """Whether rope_kv writes `dtype` rows (bf16 or fp32) into this pool buffer: for bf16 rows a
        bf16 pool, or float8_e5m2 bytes or int8 values (with their scales) of rows up to
        BYTE_ROW_MAX values; for fp32 rows any of those or an fp32 pool, rows up to BYTE_ROW_MAX."""
        small = k_pool.shape[-2] * k_pool.shape[-1] <= self.BYTE_ROW_MAX
        byte_pool = k_pool.dtype == torch.uint8 or (k_pool.dtype == torch.int8 and kv_scales(k_pool) is not None)
        if dtype == torch.float32:
            return small and (byte_pool or k_pool.dtype in (torch.float32, torch.bfloat16))
        return dtype == torch.bfloat16 and (k_pool.dtype == torch.bfloat16 or (byte_pool and small))

    def rope_kv(self, qkv, cos, sin, loc, k_pool, v_pool, heads: int, kv_heads: int,
                out: torch.Tensor | None = None) -> torch.Tensor:
        """From the fused projection qkv [T, (heads + 2 kv_heads) * D], bf16 or fp32: rotate q and k
        by the tables cos/sin of qkv's dtype ([T, 1, D/2], contiguous), write k and v into the pools
        ([slots, kv_heads, D]; see supports_rope_kv) as TokenToKVPool.set_kv makes them, at `loc` [T]
        int64; returns q [T, heads * D] in qkv's dtype, written into `out` when given (contiguous, of
        that dtype and shape, e.g. some rows of a larger q). The same bits as RopeTables.apply and
        set_kv."""
        rows = qkv.shape[0]
        head_dim = k_pool.shape[-1]
        if out is None:
            q = torch.empty((rows, heads * head_dim), dtype=qkv.dtype)
        elif out.dtype != qkv.dtype or out.shape != (rows, heads * head_dim) or not out.is_contiguous():
            raise ValueError(f"rope_kv: q goes into contiguous {qkv.dtype} {(rows, heads * head_dim)}, not {out.dtype} "
                             f"{tuple(out.shape)} with strides {out.stride()}")
        else:
            q = out
        if cos.dtype != qkv.dtype or sin.dtype != qkv.dtype:
            raise ValueError(f"rope_kv: the tables are {cos.dtype}, the rows {qkv.dtype}")
        fn = self._rope_kv_f32 if qkv.dtype == torch.float32 else self._rope_kv
        loc = loc.to(torch.int64).contiguous()
        rc = fn(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), loc.data_ptr(), q.data_ptr(),
                k_pool.data_ptr(), v_pool.data_ptr(), *scale_ptrs(k_pool, v_pool), kv_format(k_pool),
                rows, heads, kv_heads, head_dim, torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"rope_kv cannot write {qkv.dtype} rows into a {k_pool.dtype} pool of rows "
                             f"{tuple(k_pool.shape[1:])}")
        return q


# The epilogue codes of packed_gemm.c.
_GEMM_EPILOGUES = {"none": 0, "add": 1, "gate_up": 2}


class PackedGemm:
    """bf16 GEMMs from weights packed in blocks of 16 output columns (kernels/packed_gemm.c): on
    AMX tiles where the CPU has them (`tiles`), else with AVX512-BF16 vectors.

    `pack` makes the packed copy of a [n, k] weight once (k a multiple of 32); `rows` is the most
    rows the model gives the kernel (oneDNN does larger GEMMs). Measured on a 2-core Xeon with AMX,
    a decode step's 151 GEMMs of SmolLM2-135M (LM head included), oneDNN's packed kernels against
    the tiles: 1 row 14.7 / 9.7 ms, 16 rows 14.5 / 9.4, 200 rows 45.0 / 34.6, 512 rows 78.4 / 69.2,
    1,024 rows 158 / 154; the 150 layer GEMMs alone at 2,048 rows (a prefill tile) 168 / 235 then,
    197-211 / 193 once x's tiles were loaded with the no-reuse hint (gate_up with its fused
    epilogue 105-108 / 82 ms, qkv 27 / 29-34), and W200's prefill GEMMs in the engine 5.33-5.44 /
    4.98-5.10 s (one sitting, two runs each), so the tiles take the prefill tiles too. The
    vectors, on the same Xeon with oneDNN held to AVX512-BF16
    (ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16, as on a CPU without AMX), the 150 layer GEMMs, oneDNN
    against the vectors: 1 row 11.2 / 6.5 ms, 4 rows 13.4 / 8.4, 16 rows 24.3 / 18.9, 64 rows
    70.1 / 68.1, 200 rows 211 / 197, 512 rows 481 / 492, 2,048 rows 1,858 / 1,953 (both at the
    CPU's `vdpbf16ps` rate from ~64 rows on). The vectors replaced a kernel that read the
    unpacked weights (up to 4 rows; 1.3-1.5x slower than the vectors at 1-16 rows).
    """

    TILE_ROWS = 2048  # llama.PREFILL_TILE: every prefill tile
    VECTOR_ROWS = 256

    def __init__(self, lib: ctypes.CDLL, tiles: bool):
        self.tiles = tiles
        self.rows = self.TILE_ROWS if tiles else self.VECTOR_ROWS
        # q4_gemm_bf16's `widen` for a Q4_1 weight widened to bf16 on this path's units
        self.widen_mode = 1 if tiles else 2
        self._gemm = lib.packed_gemm_bf16
        self._gemm.restype = _INT
        self._gemm.argtypes = [_PTR, _I64, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _INT, _INT, _INT, _INT]
        self._pack = lib.packed_gemm_pack
        self._pack.restype = None
        self._pack.argtypes = [_PTR, _I64, _I64, _PTR]
        self._q4_gemm = lib.q4_gemm_bf16
        self._q4_gemm.restype = _INT
        self._q4_gemm.argtypes = [_PTR, _I64, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _INT, _INT, _INT]
        self._q4_pack = lib.q4_gemm_pack
        self._q4_pack.restype = _INT
        self._q4_pack.argtypes = [_PTR, _I64, _I64, _PTR]

    @staticmethod
    def packs(weight: torch.Tensor) -> bool:
        """Whether `weight` can be packed: a contiguous bf16 [n, k] with k a multiple of 32."""
        return (weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.is_contiguous()
                and weight.shape[1] % 32 == 0 and weight.shape[1] > 0 and weight.shape[0] > 0)

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """The packed copy of `weight` (see `packs`), with n rounded up to 16 (zero rows)."""
        if not self.packs(weight):
            raise ValueError(f"packed GEMM: cannot pack a {weight.dtype} weight {tuple(weight.shape)} (needs "
                             "contiguous bf16 with k a multiple of 32)")
        n, k = weight.shape
        packed = torch.empty(((n + 15) // 16 * 16, k), dtype=torch.bfloat16)
        self._pack(weight.data_ptr(), n, k, packed.data_ptr())
        return packed

    def supports(self, x: torch.Tensor, packed: torch.Tensor) -> bool:
        """Whether x [rows, k] runs against `packed` here: bf16 rows with unit stride, at most `rows`."""
        return FusedOps.supports(x) and 0 < x.shape[0] <= self.rows and x.shape[1] == packed.shape[1]

    def linear(self, x: torch.Tensor, packed: torch.Tensor, n_out: int, add: torch.Tensor | None = None,
               stream: bool = False, out: torch.Tensor | None = None, widen: bool = False) -> torch.Tensor:
        """x @ weight^T (+ `add`, [rows, n_out] bf16 with unit stride) for the weight [n_out, k]
        that `packed` was made from, rounded to bf16 once; into `out` when given ([rows, n_out]
        bf16 with unit stride, any row stride: e.g. some rows of a larger output; not overlapping
        x, which is read while it is written).

        `stream`: store the output past the caches, for a wide output read once, later (the LM
        head's logits). Same values. A decode step of 200 requests on a 2-core Xeon with AMX,
        SmolLM2's LM head (200 x 49,152 logits, weights from DRAM): 10.7-12.0 -> 5.1 ms, as the
        cached stores read every output line from DRAM before writing it; 64 rows 3.1 -> 2.7,
        1 and 16 rows unchanged (2.0).

        `widen`, for a Q4_1 `packed` (q4_pack): each block widened to the bf16 of its dequantized
        weight, then the products of the bf16 path (tiles or vectors, as `tiles`): the same bits as
        this GEMM on the bf16 copy of that weight (without: its exact weights, on the vectors)."""
        if out is not None and (out.dtype != torch.bfloat16 or out.shape != (x.shape[0], n_out) or out.stride(1) != 1):
            raise ValueError(f"packed GEMM: the output must be bf16 {(x.shape[0], n_out)} with unit stride")
        y = torch.empty((x.shape[0], n_out), dtype=torch.bfloat16) if out is None else out
        self._run(x, packed, add, y, n_out, "none" if add is None else "add", stream, widen)
        return y

    def gate_up(self, x: torch.Tensor, packed: torch.Tensor, d: int, widen: bool = False) -> torch.Tensor:
        """bf16(bf16(silu(x @ gate^T)) * (x @ up^T)) for the packed [gate; up] weight [2 * d, k],
        d a multiple of 16 (`widen`: as in `linear`)."""
        y = torch.empty((x.shape[0], d), dtype=torch.bfloat16)
        self._run(x, packed, None, y, d, "gate_up", widen=widen)
        return y

    def _run(self, x, packed, other, y, n_out: int, epilogue: str, stream: bool = False, widen: bool = False) -> None:
        k = x.shape[1]
        columns = 2 * n_out if epilogue == "gate_up" else (n_out + 15) // 16 * 16
        q4 = packed.dtype == torch.uint8
        shape = (columns // 16, k // 32, self.Q4_BLOCK) if q4 else (columns, k)
        if (tuple(packed.shape) != shape or k % 32 or (epilogue == "gate_up" and n_out % 16)
                or (q4 and (n_out % 16 or stream))):
            raise ValueError(f"packed GEMM: packed weight {tuple(packed.shape)} does not fit x {tuple(x.shape)}")
        if other is not None and (other.dtype != torch.bfloat16 or other.stride(1) != 1 or other.shape != y.shape):
            raise ValueError(f"packed GEMM: the added tensor must be bf16 {tuple(y.shape)} with unit stride")
        args = (x.data_ptr(), x.stride(0), packed.data_ptr(), None if other is None else other.data_ptr(),
                0 if other is None else other.stride(0), y.data_ptr(), y.stride(0), x.shape[0], k, n_out,
                _GEMM_EPILOGUES[epilogue], torch.get_num_threads())
        if q4:
            code = self._q4_gemm(*args, self.widen_mode if widen else 0)
        else:
            code = self._gemm(*args, int(self.tiles), int(stream))
        if code != 0:
            raise ValueError(f"packed GEMM kernel refused x {tuple(x.shape)}")

    # GGUF Q4_1 weights (kernels/packed_gemm.c, q4_gemm_bf16): the file's blocks of 32 k hold 20
    # bytes each; the kernel's copy Q4_BLOCK bytes per 16 columns x 32 k.
    Q4_FILE_BLOCK = 20
    Q4_BLOCK = 320

    def q4_pack(self, blocks: torch.Tensor) -> torch.Tensor:
        """The kernel's copy of a GGUF Q4_1 weight [n, k] from its file rows (`blocks`: uint8 [n,
        k / 32, 20], n a multiple of 16): pass it to `linear` and `gate_up` as `packed` (no
        `stream`). Their products are then those of the file's exact weights (d q + m in fp32)
        with the bf16 x, summed in fp32 and rounded to bf16 once; with `widen`, those of the bf16
        rounding of d q + m, as this GEMM gives them on the bf16 weight."""
        if (blocks.dtype != torch.uint8 or blocks.dim() != 3 or blocks.shape[2] != self.Q4_FILE_BLOCK
                or blocks.shape[0] % 16 or not blocks.shape[0] or not blocks.shape[1]):
            raise ValueError(f"Q4_1 GEMM: cannot pack {blocks.dtype} blocks {tuple(blocks.shape)} (needs uint8 "
                             f"[n, k / 32, {self.Q4_FILE_BLOCK}] with n a multiple of 16)")
        n, kbs = blocks.shape[:2]
        blocks = blocks.contiguous()
        packed = torch.empty((n // 16, kbs, self.Q4_BLOCK), dtype=torch.uint8)
        if self._q4_pack(blocks.data_ptr(), n, kbs * 32, packed.data_ptr()) != 0:
            raise ValueError(f"Q4_1 GEMM: the kernel refused blocks {tuple(blocks.shape)}")
        return packed


def load_packed_gemm(tiles: bool | None = None) -> PackedGemm | None:
    """The packed GEMM kernel on AMX tiles where the CPU and OS give them, else on AVX512-BF16
    vectors (`tiles` False: the vectors even where there are tiles, True: tiles or None); None
    where it cannot be built or the CPU lacks AVX512-BF16."""
    lib = load("packed_gemm")
    if lib is None:
        return None
    lib.packed_gemm_supported.restype = _INT
    paths = lib.packed_gemm_supported()
    if paths == 0 or (tiles and paths < 2):
        return None
    return PackedGemm(lib, paths == 2 if tiles is None else tiles)


class F32Gemm:
    """fp32 GEMMs on AVX2 + FMA vectors from weights packed in units of 16 output columns
    (kernels/f32_gemm.c), for float32 models on CPUs without AVX-512, where MKL's float32 GEMM is
    slow on a decode step's rows: on a 2-core AMD EPYC Zen 3, 200 rows of SmolLM2's shapes at
    126-175 against MKL's 93-149 GFLOP/s, its LM head (49,152 columns) 59-109 against 33-65, and
    about as fast at a prefill tile's 2,048 rows (docs/performance.md, issue 17's thirtieth
    session). Every pass of fp32 rows takes it; `pack` makes a weight's packed copy once
    (`use_f32_gemm`)."""

    def __init__(self, lib: ctypes.CDLL):
        self._floats = lib.f32_gemm_packed_floats
        self._floats.restype = _I64
        self._floats.argtypes = [_I64, _I64]
        self._pack = lib.f32_gemm_pack
        self._pack.restype = None
        self._pack.argtypes = [_PTR, _I64, _I64, _PTR]
        self._gemm = lib.f32_gemm
        self._gemm.restype = _INT
        self._gemm.argtypes = [_PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _PTR, _I64, _INT]
        self._extend = lib.f32_extend_attention
        self._extend.restype = _INT
        self._extend.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _INT, _PTR, _I64, _I64, _PTR, _I64,
                                 _INT, _INT, _INT, _FLOAT, _INT]

    @staticmethod
    def packs(weight: torch.Tensor) -> bool:
        """Whether `weight` can be packed: a float32 [n, k] on the CPU."""
        return weight.dtype == torch.float32 and weight.dim() == 2 and weight.device.type == "cpu" and weight.numel() > 0

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """The packed copy of `weight` [n, k] (see `packs`): n rounded up to 16 (zero columns)."""
        if not self.packs(weight):
            raise ValueError(f"f32 GEMM: cannot pack a {weight.dtype} weight {tuple(weight.shape)} on "
                             f"{weight.device} (needs float32 on the CPU)")
        n, k = weight.shape
        packed = torch.empty(self._floats(n, k), dtype=torch.float32)
        self._pack(weight.detach().contiguous().data_ptr(), n, k, packed.data_ptr())
        return packed

    def supports(self, x: torch.Tensor, packed: torch.Tensor, k: int) -> bool:
        """Whether x runs against `packed` (a weight of k inputs): float32 [rows, k] on the CPU with
        unit stride along its rows."""
        return (x.dtype == torch.float32 and x.dim() == 2 and x.device.type == "cpu" and x.shape[1] == k
                and x.stride(1) == 1 and x.shape[0] > 0 and packed.numel() % max(k, 1) == 0)

    def extend_attention(self, *args) -> int:
        """kernels/f32_gemm.c's `f32_extend_attention` (fp32 prefill attention of one request straight
        from the pool, head_dim 64, an fp32, bf16 or int8 pool) with the C function's arguments but
        the thread count; returns its code (0, or -1 where it does not take the call)."""
        return self._extend(*args, torch.get_num_threads())

    def linear(self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W^T (+ bias) for the weight [n, k] whose packed copy is `packed` (see `supports`)."""
        rows, k = x.shape
        out = torch.empty((rows, n), dtype=torch.float32)
        if bias is not None:
            bias = bias.detach().float().contiguous()
        self._gemm(x.data_ptr(), x.stride(0), packed.data_ptr(), None if bias is None else bias.data_ptr(), rows, k, n,
                   out.data_ptr(), n, torch.get_num_threads())
        return out


def load_f32_gemm() -> F32Gemm | None:
    """The fp32 GEMM kernel where the CPU has AVX2 and FMA but no AVX-512 (there MKL's float32 GEMMs
    run on 16-float vectors, twice the kernel's width); None where it cannot be built or is not
    wanted."""
    if "avx512f" in _cpu_id().split():
        return None
    lib = load("f32_gemm")
    if lib is None:
        return None
    lib.f32_gemm_supported.restype = _INT
    return F32Gemm(lib) if lib.f32_gemm_supported() == 1 else None


@dataclass
class CpuKernels:
    """The kernels a model uses (see `pick`)."""

    decode_attention: Any  # ctypes function
    fused: FusedOps
    # bf16 GEMMs of up to gemm.rows rows on packed weights (AMX tiles or AVX512-BF16); oneDNN does
    # the rest, and every GEMM where there is no AVX512-BF16 (None)
    gemm: PackedGemm | None = None
    # bf16 prefill attention on AMX tiles or AVX512-BF16 vectors; None: PyTorch's SDPA
    extend_attention: ExtendAttention | None = None
    # bf16 decode attention may take the AMX tiles where the CPU has them (TorchNativeAttention.decode_tiles)
    decode_tiles: bool = True
    # fp32 GEMMs on AVX2 + FMA, where the CPU has no AVX-512 (use_f32_gemm); None: MKL's
    f32_gemm: F32Gemm | None = None


def kernels_note(kernels: CpuKernels) -> str:
    """The GEMM and attention kernels in use, for the start-up log line."""
    prefill = ", bf16 prefill attention" if kernels.extend_attention is not None else ""
    if kernels.gemm is not None and kernels.gemm.tiles:
        return (f", bf16 GEMMs of up to {kernels.gemm.rows} rows{prefill} and bf16 decode attention (up to 16 "
                "query heads) on AMX tiles")
    if kernels.gemm is not None:
        amx_off = "" if kernels.decode_tiles else " (AMX tiles not used: worker.cpu_kernels = 'no_amx')"
        return f", bf16 GEMMs of up to {kernels.gemm.rows} rows{prefill} on AVX512-BF16{amx_off}"
    if kernels.f32_gemm is not None:
        return "; no AVX-512: float32 GEMMs on AVX2 + FMA, bf16 GEMMs on oneDNN"
    return "; no AVX512-BF16: oneDNN does every GEMM"


def pick(setting: str, device: str) -> CpuKernels | None:
    """The C kernels for worker.cpu_kernels ("auto", "on", "off", "no_amx") on `device`; None:
    PyTorch only. "no_amx" is "auto" without the AMX tiles: the paths a CPU with AVX512-BF16 but
    no AMX takes (the packed GEMMs, prefill and decode attention on vectors)."""
    if setting == "off":
        return None
    kernels = None
    if str(device) == "cpu":
        decode, fused = load_decode_kernel(), load("fused_ops")
        if decode is not None and fused is not None:
            amx = setting != "no_amx"
            kernels = CpuKernels(decode, FusedOps(fused), load_packed_gemm(None if amx else False),
                                 load_extend_kernel(None if amx else False), decode_tiles=amx,
                                 f32_gemm=load_f32_gemm())
    if kernels is None and setting == "on":
        raise RuntimeError(
            f"worker.cpu_kernels = 'on' but the C kernels are unavailable on {device!r} (they need a CPU "
            "device and a C compiler: set CC or install gcc; the log has the build error); use 'auto' or 'off'"
        )
    if kernels is None:
        logger.info("CPU kernels: PyTorch only")
    else:
        logger.info("CPU kernels: C (decode attention, fused bf16 ops%s)", kernels_note(kernels))
    return kernels
