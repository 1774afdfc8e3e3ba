"""Process-level tuning for running the model on CPU.

glibc's malloc serves every block over 128 KiB-32 MiB with a fresh `mmap` and returns it with
`munmap` on free. Activations are such blocks, so without tuning every element-wise op of a
prefill pays page faults on its whole output: measured here, a bf16 multiply on [16384, 576]
took 5.1 ms with the default allocator and 1.4 ms with mmap off, and a 16k-token prefill of
SmolLM2 ran ~2x faster overall. `tune_allocator` switches mmap off and raises the trim threshold,
so freed blocks stay in the heap and are reused.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

import torch

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
# Keep up to this much freed memory in the heap instead of giving it back to the OS.
_TRIM_THRESHOLD_BYTES = 1 << 30

_tuned = False


def tune_allocator() -> bool:
    """Make glibc reuse large blocks instead of mapping them anew; True when applied.

    Once per process; a no-op (False) where libc is not glibc.
    """
    global _tuned
    if _tuned:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_MAX, 0) == 1 and mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES) == 1
    if ok:
        logger.debug("glibc malloc: mmap off, trim threshold %d bytes", _TRIM_THRESHOLD_BYTES)
    _tuned = ok
    return ok


def to_float32(x: torch.Tensor, *, copy: bool = False) -> torch.Tensor:
    """`x.float()`, but through `copy_`: on this CPU torch's bf16 -> fp32 `.to` takes a slow path
    (~5x slower than `copy_` into an fp32 buffer, measured on [8192, 576]). An fp32 `x` comes back
    as is unless `copy` asks for a new tensor (one the caller may modify in place)."""
    if x.dtype == torch.float32 and not copy:
        return x
    return torch.empty(x.shape, dtype=torch.float32, device=x.device).copy_(x)
