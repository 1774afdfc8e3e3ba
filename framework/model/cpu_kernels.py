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

logger = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).with_name("kernels")
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


_PTR, _I64, _INT, _FLOAT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


def load_extend_kernel():
    """`extend_attention` of kernels/extend_attention.c (prefill attention on AMX tiles, see
    TorchNativeAttention.use_extend_kernel), or None where it cannot be built or there is no AMX."""
    lib = load("extend_attention")
    if lib is None:
        return None
    lib.extend_attention_supported.restype = _INT
    if not lib.extend_attention_supported():
        return None
    fn = lib.extend_attention
    fn.restype = _INT
    fn.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _I64, _INT, _INT, _INT, _FLOAT, _INT]
    return fn


def load_decode_kernel():
    """`decode_attention` of kernels/decode_attention.c (see TorchNativeAttention), or None."""
    lib = load("decode_attention")
    if lib is None:
        return None
    fn = lib.decode_attention
    fn.restype = _INT
    fn.argtypes = [_PTR] * 4 + [_I64] + [_PTR] * 3 + [_INT] * 6 + [_FLOAT, _INT, _INT]
    return fn


class FusedOps:
    """The bf16 element-wise ops of kernels/fused_ops.c, on torch tensors."""

    def __init__(self, lib: ctypes.CDLL):
        self._rms_norm = lib.rms_norm_bf16
        self._rms_norm.restype = _INT
        self._rms_norm.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _FLOAT, _INT]
        self._silu_mul = lib.silu_mul_bf16
        self._silu_mul.restype = _INT
        self._silu_mul.argtypes = [_PTR, _I64, _PTR, _I64, _I64, _INT]
        self._argmax = lib.argmax_bf16
        self._argmax.restype = None
        self._argmax.argtypes = [_PTR, _I64, _I64, _I64, _PTR]
        self._argmax_masked = lib.argmax_masked
        self._argmax_masked.restype = None
        self._argmax_masked.argtypes = [_PTR, _INT, _I64, _PTR, _I64, _I64, _I64, _PTR]
        self._rope_kv = lib.rope_kv_bf16
        self._rope_kv.restype = _INT
        self._rope_kv.argtypes = [_PTR, _I64] + [_PTR] * 6 + [_I64] + [_INT] * 4

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

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[rows, 2 * d] = [gate | up] -> silu(gate) * up, [rows, d] bf16."""
        rows, d2 = gate_up.shape
        out = torch.empty((rows, d2 // 2), dtype=torch.bfloat16)
        self._silu_mul(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, d2 // 2, torch.get_num_threads())
        return out


    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """torch.argmax(logits, dim=-1) of bf16 rows [n, vocab] -> int64 [n] (the first index on
        ties; NaN counts as the largest, as in torch)."""
        rows, d = logits.shape
        out = torch.empty(rows, dtype=torch.int64)
        self._argmax(logits.data_ptr(), logits.stride(0), rows, d, out.data_ptr())
        return out

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

    def rope_kv(self, qkv, cos, sin, loc, k_pool, v_pool, heads: int, kv_heads: int) -> torch.Tensor:
        """From the fused projection qkv [T, (heads + 2 kv_heads) * D]: rotate q and k by the
        bf16 tables cos/sin ([T, 1, D/2], contiguous), write k and v into the bf16 pools
        ([slots, kv_heads, D]) at `loc` [T] int64; returns q [T, heads * D]."""
        rows = qkv.shape[0]
        head_dim = k_pool.shape[-1]
        q = torch.empty((rows, heads * head_dim), dtype=torch.bfloat16)
        loc = loc.to(torch.int64).contiguous()
        self._rope_kv(qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), loc.data_ptr(), q.data_ptr(),
                      k_pool.data_ptr(), v_pool.data_ptr(), rows, heads, kv_heads, head_dim, torch.get_num_threads())
        return q


# The epilogue codes of skinny_gemm.c and amx_gemm.c.
_GEMM_EPILOGUES = {"none": 0, "add": 1, "gate_up": 2}


def _run_gemm(fn, name: str, x: torch.Tensor, weight: torch.Tensor, other: torch.Tensor | None, y: torch.Tensor,
              n_out: int, epilogue: str) -> int:
    """Call a C GEMM `fn` (skinny_gemm_bf16 / amx_gemm_bf16: the same arguments) for
    y = epilogue(x @ weight^T); `other` is the added tensor of the "add" epilogue. Returns its code."""
    if other is not None and (other.dtype != torch.bfloat16 or other.stride(1) != 1 or other.shape != y.shape):
        raise ValueError(f"{name}: the added tensor must be bf16 {tuple(y.shape)} with unit stride")
    return fn(
        x.data_ptr(), x.stride(0), weight.data_ptr(), None if other is None else other.data_ptr(),
        0 if other is None else other.stride(0), y.data_ptr(), y.stride(0), x.shape[0], x.shape[1], n_out,
        _GEMM_EPILOGUES[epilogue], torch.get_num_threads(),
    )


class SkinnyGemm:
    """bf16 GEMMs of at most MAX_ROWS rows on the nn.Linear weights (kernels/skinny_gemm.c), for
    CPUs with AVX512-BF16 but no AMX tiles (AmxGemm does them there).

    `rows` is how many rows the model gives it. Where it runs there are no AMX tiles, so the
    comparison is oneDNN's AVX512-BF16 kernels: measured on a 2-core Xeon with oneDNN held to
    them (ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16), the 120 GEMMs of a decode step's layers as four
    plain GEMMs each: 1 row 11.1 ms against oneDNN's 12.1, 2 rows 12.2 vs 13.6, 3 rows 13.3 vs
    13.9, 4 rows 14.7 vs 15.9, 6 rows 17.4 vs 16.9, 16 rows 26.2 vs 24.8 (the model's MLP on
    oneDNN takes three calls where this kernel takes two). Not measured on an AMD CPU yet.
    """

    MAX_ROWS = 16
    rows = 4

    def __init__(self, lib: ctypes.CDLL):
        self._gemm = lib.skinny_gemm_bf16
        self._gemm.restype = _INT
        self._gemm.argtypes = [_PTR, _I64, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _INT, _INT]

    def supports(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether x [rows, k] @ weight^T runs here: bf16 rows with unit stride, at most MAX_ROWS
        of them, and a contiguous bf16 weight."""
        return (FusedOps.supports(x) and 0 < x.shape[0] <= self.MAX_ROWS
                and weight.dtype == torch.bfloat16 and weight.is_contiguous())

    def linear(self, x: torch.Tensor, weight: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight^T (+ `add`, [rows, n_out] bf16 with unit stride), rounded to bf16 once."""
        rows, n_out = x.shape[0], weight.shape[0]
        y = torch.empty((rows, n_out), dtype=torch.bfloat16)
        epilogue = "none" if add is None else "add"
        self._run(x, weight, add, y, n_out, epilogue)
        return y

    def gate_up(self, x: torch.Tensor, gate_up_weight: torch.Tensor) -> torch.Tensor:
        """bf16(bf16(silu(x @ gate^T)) * (x @ up^T)) for the [gate; up] weight [2 * d, k] -> [rows, d]."""
        n_out = gate_up_weight.shape[0] // 2
        y = torch.empty((x.shape[0], n_out), dtype=torch.bfloat16)
        self._run(x, gate_up_weight, None, y, n_out, "gate_up")
        return y

    def _run(self, x, weight, other, y, n_out: int, epilogue: str) -> None:
        rows, k = x.shape
        if weight.shape[1] != k or weight.shape[0] != (2 * n_out if epilogue == "gate_up" else n_out):
            raise ValueError(f"skinny GEMM: weight {tuple(weight.shape)} does not fit x {tuple(x.shape)}")
        if _run_gemm(self._gemm, "skinny GEMM", x, weight, other, y, n_out, epilogue) != 0:
            raise ValueError(f"skinny GEMM kernel refused {rows} rows (at most {self.MAX_ROWS})")


def load_skinny_gemm() -> SkinnyGemm | None:
    """The skinny GEMM kernel, or None where it cannot be built or the CPU lacks AVX512-BF16."""
    lib = load("skinny_gemm")
    if lib is None:
        return None
    lib.skinny_supported.restype = _INT
    return SkinnyGemm(lib) if lib.skinny_supported() else None


class AmxGemm:
    """bf16 GEMMs on AMX tiles from weights packed for them (kernels/amx_gemm.c).

    `pack` makes the tile-layout copy of a [n, k] weight once (k a multiple of 32); `rows` is the
    most rows the model gives the kernel (oneDNN does larger GEMMs). Measured on a 2-core Xeon
    with AMX, a decode step's 151 GEMMs of SmolLM2-135M (LM head included), oneDNN's packed
    kernels against these: 1 row 14.7 / 9.7 ms, 16 rows 14.5 / 9.4, 200 rows 45.0 / 34.6, 512
    rows 78.4 / 69.2, 1,024 rows 158 / 154; the 150 layer GEMMs alone at 2,048 rows 168 / 235
    (oneDNN wins there: prefill tiles).
    """

    rows = 1024

    def __init__(self, lib: ctypes.CDLL):
        self._gemm = lib.amx_gemm_bf16
        self._gemm.restype = _INT
        self._gemm.argtypes = [_PTR, _I64, _PTR, _PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _INT, _INT]
        self._pack = lib.amx_pack_bf16
        self._pack.restype = None
        self._pack.argtypes = [_PTR, _I64, _I64, _PTR]

    @staticmethod
    def packs(weight: torch.Tensor) -> bool:
        """Whether `weight` can be packed: a contiguous bf16 [n, k] with k a multiple of 32."""
        return (weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.is_contiguous()
                and weight.shape[1] % 32 == 0 and weight.shape[1] > 0 and weight.shape[0] > 0)

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """The tile-layout copy of `weight` (see `packs`), with n rounded up to 16 (zero rows)."""
        if not self.packs(weight):
            raise ValueError(f"AMX GEMM: cannot pack a {weight.dtype} weight {tuple(weight.shape)} (needs "
                             "contiguous bf16 with k a multiple of 32)")
        n, k = weight.shape
        packed = torch.empty(((n + 15) // 16 * 16, k), dtype=torch.bfloat16)
        self._pack(weight.data_ptr(), n, k, packed.data_ptr())
        return packed

    def supports(self, x: torch.Tensor, packed: torch.Tensor) -> bool:
        """Whether x [rows, k] runs against `packed` here: bf16 rows with unit stride, at most `rows`."""
        return FusedOps.supports(x) and 0 < x.shape[0] <= self.rows and x.shape[1] == packed.shape[1]

    def linear(self, x: torch.Tensor, packed: torch.Tensor, n_out: int, add: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight^T (+ `add`, [rows, n_out] bf16 with unit stride) for the weight [n_out, k]
        that `packed` was made from, rounded to bf16 once."""
        y = torch.empty((x.shape[0], n_out), dtype=torch.bfloat16)
        self._run(x, packed, add, y, n_out, "none" if add is None else "add")
        return y

    def gate_up(self, x: torch.Tensor, packed: torch.Tensor, d: int) -> torch.Tensor:
        """bf16(bf16(silu(x @ gate^T)) * (x @ up^T)) for the packed [gate; up] weight [2 * d, k],
        d a multiple of 16."""
        y = torch.empty((x.shape[0], d), dtype=torch.bfloat16)
        self._run(x, packed, None, y, d, "gate_up")
        return y

    def _run(self, x, packed, other, y, n_out: int, epilogue: str) -> None:
        k = x.shape[1]
        columns = 2 * n_out if epilogue == "gate_up" else (n_out + 15) // 16 * 16
        if packed.shape[1] != k or packed.shape[0] != columns or (epilogue == "gate_up" and n_out % 16):
            raise ValueError(f"AMX GEMM: packed weight {tuple(packed.shape)} does not fit x {tuple(x.shape)}")
        if _run_gemm(self._gemm, "AMX GEMM", x, packed, other, y, n_out, epilogue) != 0:
            raise ValueError(f"AMX GEMM kernel refused x {tuple(x.shape)}")


def load_amx_gemm() -> AmxGemm | None:
    """The AMX GEMM kernel, or None where it cannot be built or the CPU or OS gives no AMX tiles."""
    lib = load("amx_gemm")
    if lib is None:
        return None
    lib.amx_gemm_supported.restype = _INT
    return AmxGemm(lib) if lib.amx_gemm_supported() else None


@dataclass
class CpuKernels:
    """The kernels a model uses (see `pick`)."""

    decode_attention: Any  # ctypes function
    fused: FusedOps
    # bf16 decode-sized GEMMs: on AMX tiles where there are (`amx`), else up to 4 rows on AVX512-BF16
    # (`skinny`); oneDNN does the rest, and every GEMM where neither is there
    skinny: SkinnyGemm | None = None
    amx: AmxGemm | None = None
    # bf16 prefill attention on AMX tiles (ctypes function); None: PyTorch's SDPA
    extend_attention: Any = None


def kernels_note(kernels: CpuKernels) -> str:
    """The GEMM and attention kernels in use, for the start-up log line."""
    prefill = ", bf16 prefill attention" if kernels.extend_attention is not None else ""
    if kernels.amx is not None:
        return (f", bf16 GEMMs of up to {kernels.amx.rows} rows{prefill} and bf16 decode attention (up to 16 "
                "query heads) on AMX tiles")
    if kernels.skinny is not None:
        return f", bf16 GEMMs of up to {kernels.skinny.rows} rows"
    return "; no AVX512-BF16: oneDNN does every GEMM"


def pick(setting: str, device: str) -> CpuKernels | None:
    """The C kernels for worker.cpu_kernels ("auto", "on", "off") on `device`; None: PyTorch only."""
    if setting == "off":
        return None
    kernels = None
    if str(device) == "cpu":
        decode, fused = load_decode_kernel(), load("fused_ops")
        if decode is not None and fused is not None:
            kernels = CpuKernels(decode, FusedOps(fused), load_skinny_gemm(), load_amx_gemm(), load_extend_kernel())
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
