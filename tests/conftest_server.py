"""Helpers for the server tests: a real `batchyard serve` subprocess on a free local port.

Every server is started in its own process group and always torn down (SIGTERM, then SIGKILL of
the whole group), so a failing test leaves no processes behind. Its log goes to a file that is
printed when start-up fails.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tiny_server_args(model_folder: str) -> list[str]:
    return [
        "--model.path", model_folder, "--model.dtype", "float32",
        "--cache.max-total-tokens", "20000", "--scheduler.check-leaks", "true",
    ]


class ServerProcess:
    def __init__(self, args: list[str], log_path: Path, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "framework.cli", "serve", "--server.host", "127.0.0.1",
               "--server.port", str(self.port), *args]
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", **(env or {}))
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def wait_ready(self, headers: dict | None = None) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"server not ready after {START_TIMEOUT_S} s:\n{self.log()}")

    def stop(self) -> int | None:
        """SIGTERM and wait; SIGKILL the process group if it does not stop. Returns the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait(5)
        self._log.close()
        return self.proc.returncode


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
