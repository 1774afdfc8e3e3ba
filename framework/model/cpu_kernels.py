"""Small C kernels for the CPU, built on first use and called through ctypes.

The source files live in `framework/model/kernels/`. Each is compiled once per machine with the
system C compiler (`cc -O3 -march=native`) into a cache folder (`BATCHYARD_KERNEL_CACHE`, default
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
from functools import lru_cache
from pathlib import Path

logger = logging.getLogger(__name__)

KERNEL_DIR = Path(__file__).with_name("kernels")
COMPILE_FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-pthread"]


def cache_dir() -> Path:
    env = os.environ.get("BATCHYARD_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "batchyard" / "kernels"


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("model name", "flags"))), "")
    except OSError:
        return platform.processor()


def _build(source: Path, compiler: str) -> Path:
    text = source.read_bytes()
    key = hashlib.sha256(text + " ".join([compiler, *COMPILE_FLAGS, _cpu_id()]).encode()).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [compiler, *COMPILE_FLAGS, str(source), "-o", tmp, "-lm"]
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
    try:
        return ctypes.CDLL(str(_build(KERNEL_DIR / f"{name}.c", compiler)))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("Cannot build the %s CPU kernel (using the PyTorch path): %s", name, detail)
        return None
