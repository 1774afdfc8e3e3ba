"""The torch profiler behind /start_profile and /stop_profile (reference R5), in the scheduler
process, so the trace shows the scheduler loop and the forward passes.

The reference profiles only when SGLANG_TORCH_PROFILER_DIR is set and otherwise crashes the server
on /start_profile (QUIRK 7). Here the directory is `server.profile_dir`; when it is empty, traces
go to `<tempdir>/batchyard-profiles` and the path is logged and returned.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time

import torch

logger = logging.getLogger(__name__)


def default_profile_dir() -> str:
    return os.path.join(tempfile.gettempdir(), "batchyard-profiles")


class TorchProfiler:
    """One profiling session at a time: `start`, then `stop` writes a Chrome trace."""

    def __init__(self, output_dir: str | None):
        self.output_dir = output_dir or default_profile_dir()
        self._profiler: torch.profiler.profile | None = None

    @property
    def is_running(self) -> bool:
        return self._profiler is not None

    def start(self) -> tuple[bool, str]:
        if self._profiler is not None:
            return False, "The profiler is already running; call /stop_profile first."
        try:
            os.makedirs(self.output_dir, exist_ok=True)
            # A directory that exists but takes no files (permissions, a read-only mount) is
            # refused now, not when /stop_profile writes the trace at the end of the session.
            with tempfile.TemporaryFile(dir=self.output_dir):
                pass
        except OSError as exc:
            return False, (f"Cannot write to the profile directory {self.output_dir} (server.profile_dir): "
                           f"{exc.strerror or exc}")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(activities=activities, with_stack=True)
        self._profiler.start()
        logger.info("Profiling started; the trace goes to %s", self.output_dir)
        return True, f"Profiling started; the trace goes to {self.output_dir}"

    def stop(self) -> tuple[bool, str]:
        if self._profiler is None:
            return False, "The profiler is not running; call /start_profile first."
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        path = os.path.join(self.output_dir, f"{time.time():.3f}-{os.getpid()}.trace.json.gz")
        try:
            profiler.export_chrome_trace(path)
        except OSError as exc:
            return False, f"Cannot write the trace to {path}: {exc}"
        logger.info("Profiling stopped; trace written to %s", path)
        return True, path
