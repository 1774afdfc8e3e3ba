"""Helpers for the server tests: a real `batchyard serve` subprocess on a free local port.

Every server is started in its own process group and always torn down (SIGTERM, then SIGKILL of
the whole group), so a failing test leaves no processes behind. Its log goes to a file that is
printed when start-up fails.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from framework.server.launch import free_port  # noqa: F401  (tests import it from here)
from framework.server.local import LocalServer

ROOT = Path(__file__).resolve().parent.parent


def tiny_server_args(model_folder: str) -> list[str]:
    return [
        "--model.path", model_folder, "--model.dtype", "float32",
        "--cache.max-total-tokens", "20000", "--scheduler.check-leaks", "true",
    ]


class ServerProcess(LocalServer):
    def __init__(self, args: list[str], log_path: Path, env: dict | None = None):
        super().__init__(args, log_path, env, cwd=ROOT)


@contextlib.contextmanager
def running_server(args: list[str], log_path: Path, env: dict | None = None):
    server = ServerProcess(args, log_path, env)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0); its state in /proc says it is gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def sse_events(lines) -> list:
    """Parsed `data:` payloads of an SSE body (lines without the trailing [DONE])."""
    import json

    events = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        payload = line[len("data: "):]
        if payload == "[DONE]":
            events.append("[DONE]")
        else:
            events.append(json.loads(payload))
    return events
