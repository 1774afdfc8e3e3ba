"""Giving freed heap memory back to the OS (framework/model/cpu.py `HeapTrimmer`, issue 18's soak).

The engine switches glibc's mmap off for speed, so freed activations stay in the heap; the
scheduler loop trims it now and then so a long-running server's RSS stays flat.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from framework.model import cpu
from framework.model.cpu import HeapTrimmer
from framework.testing import SchedulerHarness


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def trims(monkeypatch):
    """Count trim_heap calls instead of trimming; the allocator counts as tuned."""
    calls = []
    monkeypatch.setattr(cpu, "allocator_tuned", lambda: True)
    monkeypatch.setattr(cpu, "trim_heap", lambda: calls.append(1) or True)
    return calls


def test_trims_when_idle_after_work_at_most_every_interval(trims):
    clock = FakeClock()
    trimmer = HeapTrimmer(idle_interval_s=10, busy_interval_s=120, clock=clock)
    assert not trimmer.tick(idle=True)  # no work yet: nothing to give back
    trimmer.tick(idle=False)
    clock.t = 5
    assert not trimmer.tick(idle=True)  # too soon
    clock.t = 10
    assert trimmer.tick(idle=True)
    clock.t = 12
    trimmer.tick(idle=False)
    clock.t = 15
    assert not trimmer.tick(idle=True)  # work again, but within the interval of the last trim
    clock.t = 20
    assert trimmer.tick(idle=True)
    clock.t = 60
    assert not trimmer.tick(idle=True)  # idle since the last trim: nothing new
    assert len(trims) == 2 and trimmer.num_trims == 2


def test_trims_while_never_idle_every_busy_interval(trims):
    clock = FakeClock()
    trimmer = HeapTrimmer(idle_interval_s=10, busy_interval_s=120, clock=clock)
    fired = []
    for step in range(400):
        clock.t = step * 1.0
        fired.append(trimmer.tick(idle=False))
    assert [i for i, f in enumerate(fired) if f] == [120, 240, 360]


def test_zero_intervals_turn_trimming_off(trims):
    clock = FakeClock()
    trimmer = HeapTrimmer(idle_interval_s=0, busy_interval_s=0, clock=clock)
    for step in range(1000):
        clock.t = step
        trimmer.tick(idle=step % 2 == 0)
    assert trims == []


def test_nothing_happens_where_the_allocator_was_not_tuned(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu, "allocator_tuned", lambda: False)
    monkeypatch.setattr(cpu, "trim_heap", lambda: calls.append(1))
    clock = FakeClock()
    trimmer = HeapTrimmer(idle_interval_s=1, busy_interval_s=1, clock=clock)
    trimmer.tick(idle=False)
    clock.t = 100
    assert not trimmer.tick(idle=True) and calls == []


def test_the_scheduler_loop_trims_after_serving_then_idling(trims):
    clock = FakeClock()
    with SchedulerHarness(policy="fcfs", worker={"heap_trim_idle_s": 10.0}) as h:
        assert h.scheduler.heap_trimmer.idle_interval_s == 10.0
        h.scheduler.heap_trimmer = HeapTrimmer(10.0, 120.0, clock=clock)
        h.add([1, 2, 3, 4], max_new_tokens=3)
        h.run()
        assert trims == []  # the run took no (fake) time
        clock.t = 11
        h.step()  # idle
        assert len(trims) == 1
        h.step()
        assert len(trims) == 1


def test_trim_returns_freed_heap_pages_to_the_os():
    """In a fresh process with the engine's allocator settings: 400 MiB of freed tensors stay
    resident (mmap off, 1 GiB trim threshold) until trim_heap gives them back."""
    code = textwrap.dedent("""
        import torch
        from framework.model.cpu import trim_heap, tune_allocator

        def rss_mib():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * 4096 / 2**20

        assert tune_allocator()
        blocks = [torch.ones(1 << 18) for _ in range(400)]  # 1 MiB each, written
        keep = torch.ones(16)  # allocated last: above the freed blocks
        del blocks
        before = rss_mib()
        trim_heap()
        print(before - rss_mib())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    released = float(out.stdout.strip().splitlines()[-1])
    assert released > 300, f"only {released:.0f} MiB returned"
