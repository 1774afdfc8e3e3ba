"""The clock the scheduler and the timed driver read.

Every timestamp of a run comes from one `Clock`. The default is the wall clock. A worker may carry
its own clock as an optional attribute ``worker.clock`` (the `sim` worker's `VirtualClock`, which
its `launch` advances by each batch's predicted duration); the scheduler reads it through
`clock_of(worker)`, so the core never imports the worker that provides it.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    #: True when time only moves when someone advances it (a run may then jump over idle gaps).
    is_virtual: bool

    def now(self) -> float:
        """Seconds on this clock (any origin; runs subtract their start)."""
        ...


class WallClock:
    is_virtual = False

    def now(self) -> float:
        return time.perf_counter()


class VirtualClock:
    """Time that moves only by `advance` (a batch ran) or `jump_to` (idle until an arrival)."""

    is_virtual = True

    def __init__(self, start: float = 0.0):
        self.t = start

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock cannot go back ({seconds} s)")
        self.t += seconds

    def jump_to(self, t: float) -> None:
        self.t = max(self.t, t)


WALL_CLOCK = WallClock()


def clock_of(worker) -> Clock:
    """The worker's own clock, or the wall clock."""
    return getattr(worker, "clock", None) or WALL_CLOCK
