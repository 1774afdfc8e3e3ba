"""The fairness and deadline policies (issue 16): vtc, priority, edf, on the testing kit."""

from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

import pytest

from framework import hookimpl
from framework.clients import CLIENT_LEDGER_KEY
from framework.clock import VirtualClock
from framework.plugins import discover_plugins
from framework.testing import SchedulerHarness
from plugins.policies import edf, priority, vtc

_ids = itertools.count(1)


def prompt(n: int) -> list[int]:
    """`n` token ids no other prompt of the test shares (no prefix-cache hits)."""
    return [1 + next(_ids) % 500 for _ in range(n)]


def weighted_service(harness, client: str, wi: float = 1.0, wo: float = 2.0) -> float:
    tokens = harness.scheduler.view.stash[CLIENT_LEDGER_KEY].tokens.get(client)
    return 0.0 if tokens is None else wi * tokens.prompt_tokens + wo * tokens.output_tokens


def waiting_clients(harness) -> set:
    return {r.client_id for r in harness.scheduler.waiting_queue}


# -- plugin listing and selection --------------------------------------------------------------


@pytest.mark.parametrize("name", ["vtc", "priority", "edf"])
def test_policy_is_installed_and_selectable(name):
    info = discover_plugins()[name]
    assert info.kind == "policy" and info.error is None
    with SchedulerHarness(policy=name) as h:
        h.add(prompt(8), client_id="a", priority=1, slo_ttft_ms=100)
        h.run()
        assert h.prefill_batches() == [["r0"]]
        h.check_no_leak()


# -- vtc ---------------------------------------------------------------------------------------

HEAVY_IN, HEAVY_OUT, LIGHT_IN, LIGHT_OUT = 32, 8, 8, 16
POOL = 512


def run_two_backlogged_clients(policy: str) -> list[float]:
    """Client a (long prompts) sends 100 requests, then client b (short prompts, longer outputs)
    100; both stay backlogged for most of the run. Returns |W_a - W_b| after every round in which
    both were backlogged (W: weighted service, input weight 1, output weight 2)."""
    gaps = []
    with SchedulerHarness(policy=policy, cache={"max_total_tokens": POOL},
                          scheduler={"max_running_requests": 8}) as h:
        for _ in range(100):
            h.add(prompt(HEAVY_IN), max_new_tokens=HEAVY_OUT, client_id="a")
        for _ in range(100):
            h.add(prompt(LIGHT_IN), max_new_tokens=LIGHT_OUT, client_id="b")
        h.step()
        while waiting_clients(h) == {"a", "b"}:
            gaps.append(abs(weighted_service(h, "a") - weighted_service(h, "b")))
            h.step()
        h.run()
        h.check_no_leak()
    return gaps


# The bound of plugins/policies/vtc.py: 2·(w_in·L_in + w_out·M), M the KV pool's size.
VTC_BOUND = 2 * (1.0 * HEAVY_IN + 2.0 * POOL)


def test_vtc_keeps_two_backlogged_clients_within_the_bound():
    gaps = run_two_backlogged_clients("vtc")
    assert len(gaps) > 20  # both stayed backlogged for many rounds
    assert max(gaps) <= VTC_BOUND
    # Far inside it in practice: about one request's cost apart.
    assert max(gaps) <= 4 * (HEAVY_IN + 2 * HEAVY_OUT)


def test_the_bound_check_fails_for_fcfs():
    gaps = run_two_backlogged_clients("fcfs")
    assert max(gaps) > VTC_BOUND


def test_vtc_heavy_client_cannot_starve_a_light_one():
    with SchedulerHarness(policy="vtc", scheduler={"max_running_requests": 4}) as h:
        for _ in range(40):
            h.add(prompt(16), max_new_tokens=4, client_id="heavy")
        light = [h.add(prompt(16), max_new_tokens=4, client_id="light") for _ in range(5)]
        admitted_by: dict[str, int] = {}
        for step in range(40):
            for _ in range(2):  # the heavy client keeps flooding
                h.add(prompt(16), max_new_tokens=4, client_id="heavy")
            h.step()
            for rid in light:
                if rid in h.outputs:
                    admitted_by.setdefault(rid, step)
        assert set(admitted_by) == set(light)
        assert max(admitted_by.values()) <= 15
        h.run()
        h.check_no_leak()
    with SchedulerHarness(policy="fcfs", scheduler={"max_running_requests": 4}) as h:
        for _ in range(40):
            h.add(prompt(16), max_new_tokens=4, client_id="heavy")
        light = [h.add(prompt(16), max_new_tokens=4, client_id="light") for _ in range(5)]
        for _ in range(15):
            h.step()
        assert not any(rid in h.outputs for rid in light)  # fcfs makes them wait behind the flood
        h.run()


def test_vtc_lifts_a_newly_backlogged_client_to_the_least_served_backlogged_one():
    with SchedulerHarness(policy="vtc", scheduler={"max_running_requests": 2}) as h:
        for _ in range(8):
            h.add(prompt(16), max_new_tokens=2, client_id="a")
        for _ in range(4):
            h.step()
        counters = vtc.counters(h.scheduler.view)
        assert counters["a"] > 0 and "b" not in counters and "a" in waiting_clients(h)
        a_before = counters["a"]
        h.add(prompt(16), max_new_tokens=2, client_id="b")
        h.step()
        # b starts where the backlogged a stands, not at 0: it cannot claim the service it did not ask for.
        assert counters["b"] >= a_before
        h.run()
        h.check_no_leak()


def test_vtc_lifts_a_client_arriving_at_an_empty_queue_to_the_last_served():
    with SchedulerHarness(policy="vtc") as h:
        h.add(prompt(64), max_new_tokens=2, client_id="a")
        h.run()
        assert vtc.counters(h.scheduler.view)["a"] == 64 + 2 * 2
        assert vtc.state_of(h.scheduler.view).last_served == 64  # a's prefill; its outputs came after
        h.add(prompt(8), max_new_tokens=2, client_id="b")
        h.step()
        assert vtc.counters(h.scheduler.view)["b"] >= 64  # lifted to 64, then its own 8 prompt tokens
        h.run()


def test_vtc_interleaves_clients_within_one_round():
    with SchedulerHarness(policy="vtc") as h:
        a = [h.add(prompt(10), client_id="a") for _ in range(3)]
        b = [h.add(prompt(10), client_id="b") for _ in range(3)]
        h.step()
        assert h.prefill_batches()[0] == [a[0], b[0], a[1], b[1], a[2], b[2]]
        h.run()


def test_vtc_decode_oom_retracts_the_most_served_client_first():
    with SchedulerHarness(policy="vtc") as h:
        view = h.scheduler.view
        vtc.state_of(view).counters.update({"a": 10.0, "b": 500.0})
        reqs = [fake_req("a1", "a", out=1), fake_req("b1", "b", out=5), fake_req("b2", "b", out=2),
                fake_req("a2", "a", out=0)]
        order = vtc.on_decode_oom(batch=SimpleNamespace(reqs=tuple(reqs)), view=view)
        assert [r.rid for r in order] == ["b2", "b1", "a2", "a1"]


def fake_req(rid, client=None, out=0, prio=None, slo=None, arrival=0.0, prompt_len=4):
    return SimpleNamespace(rid=rid, client_id=client, output_ids=[1] * out, origin_input_ids=[1] * prompt_len,
                           priority=prio, slo_ttft_ms=slo, arrival_time=arrival)


# -- priority with aging -----------------------------------------------------------------------


def aging_run(aging_rate: float, rounds: int = 16) -> tuple[str, dict[str, float]]:
    """A priority-0 request waits from t=0 while a new priority-10 request arrives every second of
    virtual time (one request runs at a time: each round admits one). Returns the low request's
    rid and each rid's admission time."""
    clock = VirtualClock()
    admitted: dict[str, float] = {}
    with SchedulerHarness(policy="priority", clock=clock, scheduler={"max_running_requests": 1},
                          plugin={"priority": {"aging_rate": aging_rate}}) as h:
        low = h.add(prompt(8), max_new_tokens=2, priority=0)
        for _ in range(rounds):
            h.add(prompt(8), max_new_tokens=2, priority=10)
            for _ in range(3):  # prefill, decode (finishes), idle: the next round may admit
                batch = h.step()
                if batch and batch[0] == "EXTEND":
                    admitted.update((rid, clock.now()) for rid in batch[1])
            clock.advance(1.0)
        h.run()
        h.check_no_leak()
    return low, admitted


def test_aging_admits_a_low_priority_request_after_the_configured_wait():
    # Rate 1 point/s and a gap of 10 points: from 10 s of waiting on, it ties or beats a newcomer.
    low, admitted = aging_run(aging_rate=1.0)
    assert admitted[low] == 10.0
    before = [rid for rid, t in admitted.items() if t < 10.0]
    assert len(before) == 10 and low not in before  # every newcomer went first until then


def test_without_aging_priority_is_strict():
    low, admitted = aging_run(aging_rate=0.0)
    assert low not in admitted


def test_faster_aging_admits_sooner():
    low, admitted = aging_run(aging_rate=2.0)
    assert admitted[low] == 5.0


def test_lower_is_higher_flips_the_convention():
    with SchedulerHarness(policy="priority", scheduler={"max_running_requests": 1},
                          plugin={"priority": {"lower_is_higher": True, "aging_rate": 0}}) as h:
        r5, r0, r2 = (h.add(prompt(8), max_new_tokens=2, priority=p) for p in (5, 0, 2))
        h.run()
        assert h.prefill_batches() == [[r0], [r2], [r5]]


def test_priority_ties_prefer_the_longer_cached_prefix():
    shared = prompt(32)
    with SchedulerHarness(policy="priority", scheduler={"max_running_requests": 1},
                          plugin={"priority": {"aging_rate": 0}}) as h:
        first = h.add(shared + prompt(4), max_new_tokens=2)
        h.run()
        cold, warm = h.add(prompt(36), max_new_tokens=2), h.add(shared + prompt(4), max_new_tokens=2)
        h.run()
        assert h.prefill_batches() == [[first], [warm], [cold]]
        h.check_no_leak()


def test_priority_decode_oom_retracts_the_lowest_priority_first():
    with SchedulerHarness(policy="priority") as h:
        reqs = [fake_req("p5", prio=5), fake_req("p1", prio=1, out=3), fake_req("none", out=1),
                fake_req("p1b", prio=1, out=1)]
        order = priority.on_decode_oom(batch=SimpleNamespace(reqs=tuple(reqs)), view=h.scheduler.view)
        assert [r.rid for r in order] == ["none", "p1b", "p1", "p5"]


# -- edf ---------------------------------------------------------------------------------------


def test_edf_admits_by_deadline():
    with SchedulerHarness(policy="edf", clock=VirtualClock(), scheduler={"max_running_requests": 1}) as h:
        r500 = h.add(prompt(8), max_new_tokens=2, slo_ttft_ms=500)
        none = h.add(prompt(8), max_new_tokens=2)
        r100 = h.add(prompt(8), max_new_tokens=2, slo_ttft_ms=100)
        r300 = h.add(prompt(8), max_new_tokens=2, slo_ttft_ms=300)
        h.run()
        assert h.prefill_batches() == [[r100], [r300], [r500], [none]]
        h.check_no_leak()


def test_edf_default_deadline_applies_to_requests_without_one():
    with SchedulerHarness(policy="edf", clock=VirtualClock(), scheduler={"max_running_requests": 1},
                          plugin={"edf": {"default_slo_ttft_ms": 200}}) as h:
        r500 = h.add(prompt(8), max_new_tokens=2, slo_ttft_ms=500)
        none = h.add(prompt(8), max_new_tokens=2)
        h.run()
        assert h.prefill_batches() == [[none], [r500]]


def test_edf_demotes_missed_deadlines_but_still_serves_them():
    clock = VirtualClock()
    with SchedulerHarness(policy="edf", clock=clock, scheduler={"max_running_requests": 1}) as h:
        blocker = h.add(prompt(8), max_new_tokens=3)
        h.step()
        missed = h.add(prompt(8), max_new_tokens=2, slo_ttft_ms=50)
        late = h.add(prompt(8), max_new_tokens=2, slo_ttft_ms=1000)
        soon = h.add(prompt(8), max_new_tokens=2, slo_ttft_ms=400)
        h.step()  # they arrive at t=0 and wait: the blocker decodes
        clock.advance(0.2)  # the blocker decodes for 200 ms: `missed` can no longer make it
        h.run()
        assert h.prefill_batches() == [[blocker], [soon], [late], [missed]]
        assert missed in h.finished
        h.check_no_leak()


def test_edf_min_prefill_counts_a_too_close_deadline_as_missed():
    with SchedulerHarness(policy="edf", clock=VirtualClock(), scheduler={"max_running_requests": 1},
                          plugin={"edf": {"min_prefill_ms": 20}}) as h:
        tight = h.add(prompt(8), max_new_tokens=2, slo_ttft_ms=10)
        loose = h.add(prompt(8), max_new_tokens=2, slo_ttft_ms=100)
        h.run()
        assert h.prefill_batches() == [[loose], [tight]]


def test_edf_decode_oom_retracts_the_most_slack_first():
    with SchedulerHarness(policy="edf") as h:
        reqs = [fake_req("d100", slo=100), fake_req("none"), fake_req("d900", slo=900),
                fake_req("d100b", slo=100, arrival=1.0)]
        order = edf.on_decode_oom(batch=SimpleNamespace(reqs=tuple(reqs)), view=h.scheduler.view)
        assert [r.rid for r in order] == ["none", "d100b", "d900", "d100"]


class ArrivalRecorder:
    PLUGIN_KIND = "observer"

    def __init__(self):
        self.arrivals: dict[str, float] = {}

    @hookimpl
    def on_request_received(self, req, view):
        self.arrivals[req.rid] = req.arrival_time


def test_view_now_reads_the_scheduler_clock():
    clock = VirtualClock(start=5.0)
    recorder = ArrivalRecorder()
    with SchedulerHarness(recorder, clock=clock) as h:
        assert h.scheduler.view.now() == 5.0
        clock.advance(1.5)
        assert h.scheduler.view.now() == 6.5
        rid = h.add(prompt(4))
        h.step()
        assert recorder.arrivals == {rid: 6.5}
        h.run()


# -- the fairness experiment, small --------------------------------------------------------------

FAIRNESS_EXPERIMENT = """
[experiment]
name = "fairness-test"

[scheduler]
max_running_requests = 8

[cache]
max_total_tokens = 16384

[plugin.sim]
hardware = "a100"

[grid]
"plugins.policy" = ["fcfs", "lpm", "vtc"]

[[workload]]
name = "heavy-light"
dataset = "random"
random_source = "ids"
random_input_len = 128
random_output_len = 16
random_range_ratio = 0.5
num_requests = 330
rates = [inf]
clients = { heavy = 10.0, light = 1.0 }
"""


def test_fairness_experiment_vtc_is_fair_and_fcfs_is_not(tmp_path):
    """A small copy of docs/examples/experiment-fairness.toml: everything arrives at once, the
    heavy client sends ten times the light one's requests."""
    from framework.cli import main

    path = tmp_path / "fairness.toml"
    path.write_text(FAIRNESS_EXPERIMENT)
    out = tmp_path / "out"
    assert main(["experiment", "run", str(path), "--out", str(out), "--disable-tqdm", "--jobs", "1"]) == 0
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    jain = {r["grid"]["plugins.policy"]: r["metrics"]["jain_fairness_all_busy"] for r in records}
    assert jain["vtc"] >= 0.95
    assert jain["vtc"] > jain["fcfs"] + 0.2 and jain["vtc"] > jain["lpm"] + 0.2
    vtc_clients = next(r["clients"] for r in records if r["grid"]["plugins.policy"] == "vtc")
    assert vtc_clients["light"]["all_busy_tokens"] == vtc_clients["light"]["served_tokens"]  # all of it
    table = (out / "table.md").read_text()
    assert "Jain all-busy" in table and "all-busy tok/s" in table
    assert (out / "fairness.png").read_bytes().startswith(b"\x89PNG")
