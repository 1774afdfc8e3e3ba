"""`batchyard serve` as a child process on 127.0.0.1 and a free port (benchmarks, tests).

The server runs in its own process group and `stop()` always tears the whole group down (SIGTERM,
then SIGKILL), so nothing is left behind when the caller fails. Its output goes to a log file.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from framework.server.launch import free_port

START_TIMEOUT_S = 120.0


class LocalServer:
    def __init__(self, args: list[str], log_path: str | Path, env: dict | None = None,
                 cwd: str | Path | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        cmd = [sys.executable, "-m", "framework.cli", "serve", "--server.host", "127.0.0.1",
               "--server.port", str(self.port), *args]
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", **(env or {}))
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def log(self) -> str:
        """Everything the server wrote so far."""
        self._log.flush()
        return self.log_path.read_text()

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until /health answers 200; raises with the log if the server exits or never answers."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} during start-up:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"server not ready after {timeout:g} s:\n{self.log()}")

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
