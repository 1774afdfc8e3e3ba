"""The memory allocator a `batchyard` process runs on: tcmalloc where the system has it.

Every op of a forward pass takes its output from torch.empty, that is from glibc's
posix_memalign (with mmap off: framework.model.cpu.tune_allocator). Steady decoding asks for the
same few dozen sizes every layer, and glibc's bins serve that stream slowly: in W200 (200 ShareGPT
requests, bf16, 2-core Xeon) `_int_malloc` held ~1.4 % of all CPU samples, nearly all on the
thread that runs the model between kernels. tcmalloc keeps a free list per size class: W200
25.46 / 24.49 s (BATCHYARD_MALLOC=system) -> 24.18 / 23.26 s with it, runs alternating.

The dynamic loader takes an allocator only when a program starts (LD_PRELOAD), so the
`batchyard` command starts itself again, once, with tcmalloc preloaded when it finds the library
(Debian/Ubuntu: `apt-get install libtcmalloc-minimal4`). `BATCHYARD_MALLOC=system` keeps glibc's
malloc, `tcmalloc` makes a missing library an error, `auto` (the default) uses it where found.
vLLM's CPU backend is run with the same preload (bench/vllm_runner.py, which runs under vLLM's
own interpreter and so keeps its own copy of the paths). Embedding the engine in another program
(`framework.Engine()`) leaves that program's allocator alone.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from collections.abc import Mapping

logger = logging.getLogger(__name__)

TCMALLOC_PATHS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4")
CHOICE_ENV = "BATCHYARD_MALLOC"
CHOICES = ("auto", "tcmalloc", "system")
PRELOADED_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")  # in LD_PRELOAD already: left as it is
_RESTARTED = "_BATCHYARD_MALLOC_PRELOADED"  # set in the restarted process: restart once only
_PRELOAD_BEFORE = "_BATCHYARD_LD_PRELOAD_BEFORE"  # LD_PRELOAD as the user had it
# tcmalloc prints a line for every block over this (default 1 GiB: a big KV cache's per-layer pools).
_REPORT_THRESHOLD_ENV = "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"


def tcmalloc_path() -> str | None:
    """The first tcmalloc library of TCMALLOC_PATHS on this system, or None."""
    return next((p for p in TCMALLOC_PATHS if os.path.exists(p)), None)


def preload_env(environ: Mapping[str, str]) -> dict[str, str] | None:
    """The environment to start the program again with tcmalloc preloaded, or None to go on as is:
    BATCHYARD_MALLOC=system, an allocator already in LD_PRELOAD (tcmalloc, jemalloc, mimalloc),
    already restarted once, or (auto) no tcmalloc on the system. ValueError for an unknown
    choice, or tcmalloc asked for and missing."""
    choice = environ.get(CHOICE_ENV, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise ValueError(f"{CHOICE_ENV}={environ[CHOICE_ENV]!r}: expected one of {', '.join(CHOICES)}")
    current = environ.get("LD_PRELOAD", "")
    if choice == "system" or environ.get(_RESTARTED) or any(name in current for name in PRELOADED_ALLOCATORS):
        return None  # (an allocator the user preloaded stays the one)
    path = tcmalloc_path()
    if path is None:
        if choice == "tcmalloc":
            raise ValueError(f"{CHOICE_ENV}=tcmalloc, but none of {', '.join(TCMALLOC_PATHS)} exists "
                             "(apt-get install libtcmalloc-minimal4)")
        return None
    env = dict(environ)
    env["LD_PRELOAD"] = ":".join(p for p in (path, current) if p)
    env[_RESTARTED] = "1"
    env[_PRELOAD_BEFORE] = current
    env.setdefault(_REPORT_THRESHOLD_ENV, str(1 << 40))
    return env


def restart_with_tcmalloc() -> None:
    """Replace this process by the same command with tcmalloc preloaded (see preload_env); returns
    only when it goes on as is. For the `batchyard` command's start, before torch is imported."""
    env = preload_env(os.environ)
    if env is None:
        return
    argv = [sys.executable, *sys.orig_argv[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, argv, env)
    except OSError as exc:  # go on with glibc's malloc
        logger.warning("could not start again with tcmalloc preloaded (%s); glibc malloc", exc)


@functools.cache
def running_allocator() -> str:
    """"tcmalloc" when a tcmalloc library is loaded in this process, else "glibc". Read once: the
    allocator is fixed when the process starts (LD_PRELOAD)."""
    try:
        with open("/proc/self/maps") as maps:
            return "tcmalloc" if "tcmalloc" in maps.read() else "glibc"
    except OSError:
        return "glibc"


def peer_env(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` without what restart_with_tcmalloc added: for the peers' processes (llama-server,
    vLLM), which are measured as they are set up on their own."""
    env = dict(environ)
    if env.pop(_RESTARTED, None):
        before = env.pop(_PRELOAD_BEFORE, "")
        if before:
            env["LD_PRELOAD"] = before
        else:
            env.pop("LD_PRELOAD", None)
        if env.get(_REPORT_THRESHOLD_ENV) == str(1 << 40):
            env.pop(_REPORT_THRESHOLD_ENV)
    return env
