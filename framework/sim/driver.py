"""Run a timed workload on the `sim` worker (virtual clock) or the real Engine (wall clock).

Stub: the signature is final, the body follows.
"""

from __future__ import annotations

from typing import Any

from framework.workload import RunResult, TimedRequest

BACKENDS = ("sim", "real")


def run_workload(
    settings_overrides: dict[str, Any],
    requests: list[TimedRequest],
    backend: str = "sim",
    progress: bool = False,
) -> RunResult:
    """Inject each request when the run's clock reaches its `arrival_s`, run the scheduler until
    every request finished, and return one `RequestRecord` per request (in `requests` order)."""
    raise NotImplementedError
