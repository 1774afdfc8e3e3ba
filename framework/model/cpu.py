"""Process-level tuning for running the model on CPU.

glibc's malloc serves every block over 128 KiB-32 MiB with a fresh `mmap` and returns it with
`munmap` on free. Activations are such blocks, so without tuning every element-wise op of a
prefill pays page faults on its whole output: measured here, a bf16 multiply on [16384, 576]
took 5.1 ms with the default allocator and 1.4 ms with mmap off, and a 16k-token prefill of
SmolLM2 ran ~2x faster overall. `tune_allocator` switches mmap off and raises the trim threshold,
so freed blocks stay in the heap and are reused.

The price: a long-running server keeps every page it ever used for an activation, and under
continuous batching (ever-new batch shapes, two threads with their own malloc arenas under the
overlap worker) the heaps fragment and the process grows for many minutes. `HeapTrimmer` gives
the free pages back with `malloc_trim(0)` (~10 ms) when the scheduler is idle, at most every
`idle_interval_s`, and every `busy_interval_s` even when it never is.

Under tcmalloc (preloaded by the `batchyard` command where the system has it: framework.preload)
there is nothing to tune: it keeps per-size free lists of its own. `tune_allocator` then only
points `trim_heap` at tcmalloc's `MallocExtension_ReleaseFreeMemory`, so the trimmer keeps a
server's RSS in check there too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time

import torch

from framework.model.cpu_kernels import cpu_has_any
from framework.preload import running_allocator

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
# Keep up to this much freed memory in the heap instead of giving it back to the OS.
_TRIM_THRESHOLD_BYTES = 1 << 30

_tuned = False
_release = None  # gives the allocator's free pages back to the OS (tune_allocator)


def tune_allocator() -> bool:
    """Make glibc reuse large blocks instead of mapping them anew, or, under tcmalloc, find its
    call that gives free memory back; True when done (then `trim_heap` works).

    Once per process; a no-op (False) where the allocator is neither glibc's nor tcmalloc.
    """
    global _tuned, _release
    if _tuned:
        return True
    if running_allocator() == "tcmalloc":
        try:
            release = ctypes.CDLL(None).MallocExtension_ReleaseFreeMemory
        except (OSError, AttributeError):
            return False
        release.restype = None
        _release = lambda: release() or True  # (returns nothing: counted as released)
        _tuned = True
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
        malloc_trim = libc.malloc_trim
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES) == 1
    if ok:
        logger.debug("glibc malloc: mmap off, trim threshold %d bytes", _TRIM_THRESHOLD_BYTES)
        _release = lambda: bool(malloc_trim(0))
    _tuned = ok
    return ok


def allocator_tuned() -> bool:
    """True once `tune_allocator` has set up the allocator (glibc: mmap off; tcmalloc) in this
    process."""
    return _tuned


def trim_heap() -> bool:
    """Return the allocator's free pages to the OS (glibc `malloc_trim(0)`, tcmalloc
    `MallocExtension_ReleaseFreeMemory`); True when something was released (always under tcmalloc,
    which does not say). False before `tune_allocator`."""
    return _release() if _release is not None else False


class HeapTrimmer:
    """Calls `trim_heap` now and then from the scheduler loop (see the module docstring).

    `tick(idle)` is called once per scheduler iteration and costs a clock read. A trim happens
    when the allocator was tuned, work ran since the last trim, and either the loop is idle and
    `idle_interval_s` passed, or `busy_interval_s` passed. An interval of 0 turns that case off.
    """

    def __init__(self, idle_interval_s: float = 10.0, busy_interval_s: float = 120.0, clock=time.monotonic):
        self.idle_interval_s = idle_interval_s
        self.busy_interval_s = busy_interval_s
        self.clock = clock
        self.last = clock()
        self.dirty = False
        self.num_trims = 0

    def tick(self, idle: bool) -> bool:
        """True when this call trimmed."""
        if not idle:
            self.dirty = True
        if not self.dirty or not allocator_tuned():
            return False
        waited = self.clock() - self.last
        due = (idle and self.idle_interval_s > 0 and waited >= self.idle_interval_s) or (
            self.busy_interval_s > 0 and waited >= self.busy_interval_s)
        if not due:
            return False
        start = self.clock()
        trim_heap()
        self.last = self.clock()
        self.dirty = not idle
        self.num_trims += 1
        logger.debug("malloc_trim took %.1f ms", (self.last - start) * 1e3)
        return True


# CPU flags (/proc/cpuinfo) of bf16 arithmetic: without one, PyTorch's bf16 GEMMs widen to fp32 in
# loops of their own and run several times slower than float32 (model.dtype = "auto" then picks float32).
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def has_bf16_arithmetic(flags: str | None = None) -> bool:
    """Whether the CPU has bf16 arithmetic (`flags`: /proc/cpuinfo's flags line; default this machine's)."""
    return cpu_has_any(BF16_FLAGS, flags)


def packed_linear_supported() -> bool:
    """Whether this torch build and CPU run oneDNN's bf16 linear on prepacked weights."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
                    and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    except (AttributeError, RuntimeError):
        return False


# The batch size oneDNN is told to expect when it lays a weight out (any batch size runs).
PACK_BATCH_HINT = 256


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 [out, in] weight in oneDNN's blocked layout for `packed_linear`.

    `F.linear` reorders the weight into that layout on every call; prepacked, a decode-sized GEMM
    (M <= 256) runs 1.3-2x faster on AVX512-BF16/AMX (measured in docs/performance.md).
    """
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), PACK_BATCH_HINT)


# A packed GEMM of up to this many rows runs at its exact row count (decode batches).
EXACT_GEMM_ROWS = 16


def gemm_rows(rows: int) -> int:
    """The row count a packed GEMM of `rows` rows runs at: `rows` up to EXACT_GEMM_ROWS, above
    that rounded up to one of 8 steps per power of two (at most 1/8 more rows, ~6 % on average).

    oneDNN builds (JIT-compiles) a new kernel for every new row count, 0.4 ms at 5 rows and 2-5 ms
    at 100-360 rows for each of a layer's five GEMM shapes (measured here), and a server sees a new
    row count with nearly every prefill: unpadded, a 112-token prefill took 53-69 ms instead of
    43. Padded, the kernels are built once per bucket (72 buckets up to 2,048 rows) and reused.
    """
    if rows <= EXACT_GEMM_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [m, n] with zero rows appended up to `rows` (x itself when it has them)."""
    if x.shape[0] == rows:
        return x
    out = x.new_empty((rows, x.shape[1]))
    out[: x.shape[0]] = x
    out[x.shape[0] :].zero_()
    return out


def _bucketed(x: torch.Tensor, *others: torch.Tensor):
    """(rows of x, rows to run at, x and `others` padded to them) for a 2-D x; 3-D and larger
    inputs run as they are."""
    m = x.shape[0] if x.dim() == 2 else -1
    rows = gemm_rows(m) if m > 0 else m
    if rows == m:
        return m, rows, (x, *others)
    return m, rows, tuple(pad_rows(t, rows) for t in (x, *others))


def _pointwise(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, op: str) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, op, [], "")


def _pointwise_binary(x: torch.Tensor, other: torch.Tensor, packed: torch.Tensor, op: str) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise.binary(x, other, packed, None, op)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, W, bias)` with W given by `pack_linear_weight` (run at `gemm_rows` rows)."""
    m, rows, (x,) = _bucketed(x)
    y = _pointwise(x, packed, bias, "none")
    return y if rows == m else y[:m]


def packed_linear_unary(x: torch.Tensor, packed: torch.Tensor, op: str) -> torch.Tensor:
    """`op(x @ W^T)` in one oneDNN call, the activation applied to the fp32 accumulator
    (`op`: "swish" = SiLU)."""
    m, rows, (x,) = _bucketed(x)
    y = _pointwise(x, packed, None, op)
    return y if rows == m else y[:m]


def packed_linear_binary(x: torch.Tensor, other: torch.Tensor, packed: torch.Tensor, op: str) -> torch.Tensor:
    """`(x @ W^T) op other` in one oneDNN call (`op`: "add" or "mul"; `other` has the output's
    shape and dtype), rounded to bf16 once."""
    m, rows, (x, other) = _bucketed(x, other)
    y = _pointwise_binary(x, other, packed, op)
    return y if rows == m else y[:m]


def to_float32(x: torch.Tensor, *, copy: bool = False) -> torch.Tensor:
    """`x.float()`, but through `copy_`: on this CPU torch's bf16 -> fp32 `.to` takes a slow path
    (~5x slower than `copy_` into an fp32 buffer, measured on [8192, 576]). An fp32 `x` comes back
    as is unless `copy` asks for a new tensor (one the caller may modify in place)."""
    if x.dtype == torch.float32 and not copy:
        return x
    return torch.empty(x.shape, dtype=torch.float32, device=x.device).copy_(x)
