"""framework.testing: a plugin's own tests run scheduling rounds on a fake worker, no model."""

from __future__ import annotations

import types

import pytest

from framework import hookimpl
from framework.testing import FakeWorker, SchedulerHarness


def shortest_first_module():
    """A policy module as an author writes it (not installed: passed to the harness)."""
    module = types.ModuleType("shortest")
    module.PLUGIN_KIND = "policy"

    @hookimpl
    def select_prefill(view):
        return sorted(view.waiting_queue, key=lambda r: len(r.origin_input_ids))

    module.select_prefill = select_prefill
    return module


def test_a_policy_module_takes_the_named_policys_place():
    with SchedulerHarness(shortest_first_module(), policy="lpm", scheduler={"max_running_requests": 1}) as h:
        assert "lpm" not in h.scheduler.plugins.active
        rids = [h.add([7] * n) for n in (6, 2, 4)]
        h.run()
        assert h.prefill_batches() == [[rids[1]], [rids[2]], [rids[0]]]
        assert all(len(out) == 4 for out in h.outputs.values())
        h.check_no_leak()


def test_lpm_groups_a_shared_prefix_on_the_fake_worker():
    with SchedulerHarness(policy="lpm", scheduler={"max_running_requests": 2}) as h:
        system = list(range(100, 140))
        first = h.add(system + [1])
        h.run()
        other, sharer = h.add([5, 6, 7]), h.add(system + [2])
        h.run()
        assert h.prefill_batches() == [[first], [sharer, other]]
        h.check_no_leak()


def test_retraction_runs_on_the_fake_worker_and_every_request_still_finishes():
    with SchedulerHarness(policy="fcfs", scheduler={"force_retract": True}) as h:
        rids = [h.add([i + 1] * 10, max_new_tokens=24, ignore_eos=True) for i in range(12)]
        h.run()
        assert h.scheduler.num_retractions > 0
        assert sorted(h.finished) == sorted(rids)
        assert all(len(h.outputs[r]) == 24 for r in rids)
        h.check_no_leak()


def test_the_fake_worker_is_deterministic_and_never_eos():
    worker = FakeWorker()
    tokens = {worker.next_token(a, n) for a in range(600) for n in range(1, 50)}
    assert not tokens & worker.eos_token_ids
    assert worker.next_token(3, 9) == FakeWorker().next_token(3, 9)


def test_chunked_prefill_runs_in_chunks():
    with SchedulerHarness(scheduler={"chunked_prefill_size": 16}) as h:
        rid = h.add(list(range(1, 41)), max_new_tokens=2)
        h.run()
        assert h.prefill_batches() == [[rid], [rid], [rid]]
        h.check_no_leak()


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "dfs-weight", "lof", "random"])
def test_every_bundled_policy_runs_on_the_harness(policy):
    with SchedulerHarness(policy=policy) as h:
        for i in range(5):
            h.add([1, 2, 3, i + 10], max_new_tokens=3)
        h.run()
        assert len(h.finished) == 5
        h.check_no_leak()
