"""IPC plumbing shared by the server's processes (reference A3).

Every socket is PUSH/PULL over ``ipc://`` files in a fresh temporary directory, so two servers on
one machine never collide and nothing is left behind in a fixed path. PULL sockets bind, PUSH
sockets connect; high-water marks are 0 (unbounded) so a send never blocks or drops.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import zmq

LOG_FORMAT = "[%(asctime)s %(processName)s] %(levelname)s %(name)s: %(message)s"
LOG_DATE_FORMAT = "%Y-%m-%d %H:%M:%S"


@dataclass(frozen=True)
class IpcNames:
    """The three endpoints: each names the process that binds (PULLs) it."""

    tokenizer: str
    scheduler: str
    detokenizer: str

    @classmethod
    def in_new_temp_dir(cls) -> tuple["IpcNames", str]:
        folder = tempfile.mkdtemp(prefix="batchyard-ipc-")
        names = cls(*(f"ipc://{os.path.join(folder, n)}" for n in ("tokenizer", "scheduler", "detokenizer")))
        return names, folder

    @property
    def controller(self) -> str:
        """Where the data-parallel controller collects the replicas' replies and reports."""
        return f"{self.scheduler}-controller"

    def for_replica(self, dp_rank: int) -> "IpcNames":
        """A replica's endpoints behind the data-parallel controller: its own input socket, control
        replies to the controller, outputs to the shared detokenizer."""
        return IpcNames(tokenizer=self.controller, scheduler=f"{self.scheduler}-dp{dp_rank}",
                        detokenizer=self.detokenizer)


def make_socket(context: zmq.Context, kind: int, endpoint: str) -> zmq.Socket:
    """A PULL socket bound to `endpoint` or a PUSH socket connected to it."""
    sock = context.socket(kind)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    # Closing a socket must not wait for undelivered messages (a dead peer would block exit).
    sock.setsockopt(zmq.LINGER, 0)
    if kind == zmq.PULL:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock


def recv_waiting(sock: zmq.Socket) -> list:
    """Every message waiting on a PULL socket, without blocking."""
    received = []
    while True:
        try:
            received.append(sock.recv_pyobj(zmq.NOBLOCK))
        except zmq.Again:
            return received


def configure_logging(level: str) -> None:
    """One readable line per record: time, process, level, logger ("trace", uvicorn's finest level,
    is DEBUG here)."""
    logging.basicConfig(
        level=logging.DEBUG if level.lower() == "trace" else getattr(logging, level.upper(), logging.INFO),
        format=LOG_FORMAT,
        datefmt=LOG_DATE_FORMAT, force=True,
    )


def setup_child_process(name: str, log_level: str) -> None:
    """Common start of a spawned child: logging, signals, and dying with the parent.

    Ctrl-C (and a terminal's hangup) reaches the whole process group; children ignore SIGINT and
    SIGHUP and let the main process end them in order (SIGTERM). If the main process dies without doing so (SIGKILL), the kernel's
    parent-death signal, or failing that a watcher thread, ends the child: no orphans.
    """
    import multiprocessing

    multiprocessing.current_process().name = name
    configure_logging(log_level)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # (a terminal's hangup: the main process stops them)
    signal.signal(signal.SIGTERM, _exit_now)
    parent = os.getppid()
    if not _set_parent_death_signal():
        threading.Thread(target=_exit_when_orphaned, args=(parent,), daemon=True).start()
    elif os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def freeze_startup_objects() -> int:
    """Take every object alive now out of the garbage collector's walks; returns how many.

    Called once a process has started (the scheduler with its model and pools, the main process
    with its tokenizer). Python's oldest-generation collection walks every tracked object: ~310,000
    of them in a scheduler on SmolLM2, ~90-110 ms during which no step runs and every running
    request's next token waits. Frozen, they are not walked (a full collection then takes well under
    a millisecond); they are still freed by reference counting, and garbage made from now on is
    collected as usual. What start-up left as cyclic garbage is collected first.
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def _exit_now(signum, frame) -> None:
    """SIGTERM: the main process is stopping the server, and a child has nothing to save. A normal
    interpreter exit would tear down native threads still running (torch's pools, the forward and
    grammar threads, gloo's), and C++ aborts on that (SIGABRT, "terminate called without an active
    exception"); so flush the logs and leave with status 0 at once."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _set_parent_death_signal() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        return libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL) == 0
    except OSError:
        return False


def _exit_when_orphaned(parent: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)
