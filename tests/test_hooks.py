"""Every hook is called at its seam, in order, with what its contract promises."""

from __future__ import annotations

from pathlib import Path

import pytest

from framework import hookimpl
from framework.batch import ForwardMode
from framework.hookspecs import ALL_HOOKS

DOCS = Path(__file__).resolve().parent.parent / "docs"


class Recorder:
    """Implements every hook as an observer and records the calls."""

    def __init__(self):
        self.calls: list[str] = []

    @hookimpl
    def register_settings(self, register):
        self.calls.append("register_settings")

    @hookimpl
    def create_worker(self, settings, tp_rank):
        self.calls.append("create_worker")

    @hookimpl
    def create_cache(self, settings, req_to_token_pool, token_to_kv_pool):
        self.calls.append("create_cache")

    @hookimpl
    def on_request_received(self, req, scheduler):
        self.calls.append("on_request_received")

    @hookimpl
    def select_prefill(self, scheduler, adder):
        self.calls.append("select_prefill")

    @hookimpl
    def on_decode_oom(self, batch, scheduler):
        self.calls.append("on_decode_oom")

    @hookimpl
    def prepare_batch(self, batch, scheduler):
        self.calls.append(f"prepare_batch:{batch.forward_mode.name if batch else None}")
        return batch

    @hookimpl
    def on_batch_result(self, batch, result, scheduler):
        self.calls.append(f"on_batch_result:{batch.forward_mode.name}")

    @hookimpl
    def on_request_finished(self, req, scheduler):
        self.calls.append("on_request_finished")

    @hookimpl
    def on_idle(self, scheduler):
        self.calls.append("on_idle")


def test_recorder_covers_every_hook():
    assert {c for c in dir(Recorder) if not c.startswith("_")} - {"calls"} == set(ALL_HOOKS)


HOOK_ORDER = {
    # The plain worker: each batch's result is processed before the next batch is built.
    "tp": [
        "on_request_received",
        "select_prefill",
        "prepare_batch:EXTEND",
        "on_batch_result:EXTEND",
        "prepare_batch:DECODE",
        "on_batch_result:DECODE",
        "prepare_batch:DECODE",
        "on_request_finished",
        "on_batch_result:DECODE",
        "prepare_batch:None",
        "on_idle",
    ],
    # The overlap worker: batch N+1 is built and launched before batch N's result is processed,
    # so the request runs one decode step past its finish (its result is dropped, K6).
    "overlap": [
        "on_request_received",
        "select_prefill",
        "prepare_batch:EXTEND",
        "prepare_batch:DECODE",
        "on_batch_result:EXTEND",
        "prepare_batch:DECODE",
        "on_batch_result:DECODE",
        "prepare_batch:DECODE",
        "on_request_finished",
        "on_batch_result:DECODE",
        "prepare_batch:None",
        "on_batch_result:DECODE",
        "prepare_batch:None",
        "on_idle",
    ],
}


@pytest.mark.parametrize("worker", sorted(HOOK_ORDER))
def test_hook_order_through_one_prefill_and_two_decodes(make_engine, worker):
    rec = Recorder()
    engine = make_engine(extra_plugins=(rec,), plugins={"worker": worker})
    assert rec.calls == ["register_settings", "create_worker", "create_cache"]
    rec.calls.clear()
    engine.generate(input_ids=[1, 2, 3, 4], sampling_params={"max_new_tokens": 3, "temperature": 0, "ignore_eos": True})
    expected = HOOK_ORDER[worker]
    assert rec.calls[: len(expected)] == expected
    assert all(c in ("prepare_batch:None", "on_idle") for c in rec.calls[len(expected):])


def test_select_prefill_controls_admission(make_engine):
    """A policy that admits one request per round makes every request its own prefill batch."""

    class OneAtATime:
        @hookimpl(tryfirst=True)
        def select_prefill(self, scheduler, adder):
            return adder.admit_waiting(scheduler, scheduler.waiting_queue[:1], prefix_computed=False)

    sizes = []

    class Sizes:
        @hookimpl
        def on_batch_result(self, batch, result, scheduler):
            if batch.forward_mode == ForwardMode.EXTEND:
                sizes.append(batch.batch_size())

    engine = make_engine(extra_plugins=(OneAtATime(), Sizes()))
    engine.generate(input_ids=[[1, 2], [3, 4], [5, 6]], sampling_params={"max_new_tokens": 2})
    assert sizes == [1, 1, 1]


def test_prepare_batch_is_chained(make_engine):
    """Each implementation receives the previous one's return value."""
    from framework.request import StashKey

    key: StashKey[int] = StashKey("seen_by_first")
    seen = []

    class First:
        @hookimpl(tryfirst=True)
        def prepare_batch(self, batch, scheduler):
            if batch is not None:
                batch.stash[key] = batch.stash.get(key, 0) + 1
            return batch

    class Last:
        @hookimpl(trylast=True)
        def prepare_batch(self, batch, scheduler):
            seen.append(None if batch is None else (batch.forward_mode.name, batch.stash.get(key)))
            return batch

    # The plain worker: no extra one-step-late decode pass (the overlap order is tested above).
    engine = make_engine(extra_plugins=(Last(), First()), plugins={"worker": "tp"})
    out = engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 3, "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == 3
    # The prefill batch becomes the running batch, so its stash counts every pass First saw.
    assert seen[:3] == [("EXTEND", 1), ("DECODE", 2), ("DECODE", 3)]
    assert all(s is None for s in seen[3:])


def test_on_decode_oom_can_be_replaced_by_a_policy(make_engine):
    calls = []

    class KeepAll:
        @hookimpl(tryfirst=True)
        def on_decode_oom(self, batch, scheduler):
            calls.append(batch.batch_size())
            return [], 0.5

    engine = make_engine(extra_plugins=(KeepAll(),), scheduler={"force_retract": True})
    engine.generate(input_ids=[[i + 1, i + 2] for i in range(12)], sampling_params={"max_new_tokens": 3})
    assert calls and all(bs > 10 for bs in calls)
    assert engine.scheduler.num_retractions == 0


def test_on_request_finished_sees_the_reason(make_engine):
    reasons = []

    class Finished:
        @hookimpl
        def on_request_finished(self, req, scheduler):
            reasons.append(req.finished_reason.to_json()["type"])

    engine = make_engine(extra_plugins=(Finished(),))
    engine.generate(input_ids=[[1, 2, 3], [4, 5]], sampling_params={"max_new_tokens": 2, "ignore_eos": True})
    assert reasons == ["length", "length"]


def test_on_idle_runs_after_the_leak_check(make_engine):
    seen = []

    class Idle:
        @hookimpl
        def on_idle(self, scheduler):
            seen.append(scheduler.new_token_ratio.value == scheduler.new_token_ratio.init)

    engine = make_engine(extra_plugins=(Idle(),))
    engine.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 2})
    assert seen and all(seen)


def test_every_hook_has_a_heading_in_docs():
    text = (DOCS / "hooks.md").read_text()
    headings = {line[4:].strip().strip("`") for line in text.splitlines() if line.startswith("### ")}
    missing = [h for h in ALL_HOOKS if h not in headings]
    assert missing == []
