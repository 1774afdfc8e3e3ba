"""Every hook is called at its seam, in order, with what its contract promises."""

from __future__ import annotations

from pathlib import Path

import pytest

from framework import hookimpl
from framework.batch import ForwardMode
from framework.hookspecs import ALL_HOOKS
from framework.messages import GenerateReqInput
from framework.request import SamplingParams, StashKey

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
    def on_request_received(self, req, view):
        self.calls.append("on_request_received")

    @hookimpl
    def select_prefill(self, view, adder):
        self.calls.append("select_prefill")

    @hookimpl
    def on_decode_oom(self, batch, view):
        self.calls.append("on_decode_oom")

    @hookimpl
    def prepare_batch(self, batch, view):
        self.calls.append(f"prepare_batch:{batch.forward_mode.name if batch else None}")

    @hookimpl
    def on_batch_result(self, batch, result, view):
        self.calls.append(f"on_batch_result:{batch.forward_mode.name}")

    @hookimpl
    def on_request_finished(self, req, view):
        self.calls.append("on_request_finished")

    @hookimpl
    def on_idle(self, view):
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
        def select_prefill(self, view):
            return view.waiting_queue[:1]

    sizes = []

    class Sizes:
        @hookimpl
        def on_batch_result(self, batch):
            if batch.forward_mode == ForwardMode.EXTEND:
                sizes.append(batch.batch_size())

    engine = make_engine(extra_plugins=(OneAtATime(), Sizes()))
    engine.generate(input_ids=[[1, 2], [3, 4], [5, 6]], sampling_params={"max_new_tokens": 2})
    assert sizes == [1, 1, 1]


def admit_through(adder, sched) -> None:
    """What a policy written against the old contract did: admit straight into the adder. The
    adder a policy gets is read-only now, so this raises, and the test swallows that."""
    try:
        for req in sched.waiting_queue:
            req.init_next_round_input(sched.tree_cache)
            adder.add_one_req(req)
    except AttributeError:
        pass


def send(sched, rid, input_ids, max_new_tokens=2):
    sampling = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    sampling.normalize(None)
    sched.send(GenerateReqInput(rid=rid, input_ids=input_ids, sampling_params=sampling))


def test_select_prefill_returning_none_admits_nothing_even_when_the_adder_was_touched(make_engine):
    engine = make_engine()
    sched = engine.scheduler

    class TouchAndDecline:
        @hookimpl
        def select_prefill(self, adder):
            admit_through(adder, sched)
            return None

    sched.plugins.pm.unregister(name="lpm")  # the only select_prefill left is TouchAndDecline's
    sched.plugins.pm.register(TouchAndDecline())
    send(sched, "s0", [1, 2, 3])
    send(sched, "s1", [4, 5, 6])
    for _ in range(3):
        sched.run_once()
    assert sched.forward_ct == 0
    assert [r.rid for r in sched.waiting_queue] == ["s0", "s1"]
    assert sched.token_to_kv_pool.available_size() == sched.max_total_num_tokens
    for rid in ("s0", "s1"):
        sched.abort_request(rid)
    sched.run_once()


def test_a_policy_that_touched_the_adder_and_declined_does_not_admit_twice(make_engine):
    """A tryfirst implementation touches the adder and returns None; the active policy then
    chooses, and each request is admitted once (main admitted ['s0', 's1', 's0', 's1'])."""
    engine = make_engine()
    sched = engine.scheduler
    prefills = []

    class TouchAndDecline:
        @hookimpl(tryfirst=True)
        def select_prefill(self, adder):
            admit_through(adder, sched)

    class Prefills:
        @hookimpl
        def on_batch_result(self, batch):
            if batch.forward_mode.is_extend():
                prefills.append([r.rid for r in batch.reqs])

    sched.plugins.pm.register(TouchAndDecline())
    sched.plugins.pm.register(Prefills())
    send(sched, "s0", [1, 2, 3])
    send(sched, "s1", [4, 5, 6])
    while sched.has_work():
        sched.run_once()
    sched.run_once()
    assert prefills == [["s0", "s1"]]


def test_select_prefill_must_return_waiting_requests_once(make_engine):
    """Anything else fails the waiting requests with a message naming the plugin (more cases in
    tests/reliability/test_plugin_returns.py)."""

    class Twice:
        @hookimpl(tryfirst=True)
        def select_prefill(self, view):
            return list(view.waiting_queue) * 2

    twice = Twice()
    engine = make_engine(extra_plugins=(twice,))
    outs = engine.generate(input_ids=[[1, 2], [3, 4]], sampling_params={"max_new_tokens": 2})
    for out in outs:
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "is listed twice" in reason["message"], reason
    engine.scheduler.plugins.pm.unregister(twice)
    out = engine.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 2, "ignore_eos": True})
    assert out["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize("attempt", ["append", "sort", "assign", "clear"])
def test_a_policy_cannot_mutate_the_waiting_queue_through_its_view(make_engine, attempt):
    errors = []

    class Meddler:
        @hookimpl(tryfirst=True)
        def select_prefill(self, view):
            try:
                if attempt == "append":
                    view.waiting_queue.append(view.waiting_queue[0])
                elif attempt == "sort":
                    view.waiting_queue.sort(key=lambda r: r.rid)
                elif attempt == "assign":
                    view.waiting_queue = []
                else:
                    del view.waiting_queue[:]
            except (AttributeError, TypeError) as exc:
                errors.append(type(exc).__name__)

    engine = make_engine(extra_plugins=(Meddler(),))
    out = engine.generate(input_ids=[[1, 2], [3, 4]], sampling_params={"max_new_tokens": 2})
    assert [o["meta_info"]["completion_tokens"] for o in out] == [2, 2]
    assert errors, "the mutation went through"


def test_prepare_batch_implementation_with_only_batch(make_engine):
    """pluggy passes only the arguments an implementation declares; returning None inspects."""
    seen = []

    class Inspect:
        @hookimpl
        def prepare_batch(self, batch):
            seen.append(None if batch is None else batch.forward_mode.name)

    engine = make_engine(extra_plugins=(Inspect(),), plugins={"worker": "tp"})
    out = engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 3, "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == 3
    assert seen[:3] == ["EXTEND", "DECODE", "DECODE"]
    assert all(s is None for s in seen[3:])


def test_prepare_batch_wrapper_gets_the_batch_and_may_add_an_idle_one(make_engine):
    """A wrapper=True implementation receives the others' result from its yield; on an idle
    iteration it may return an IDLE batch (as DP attention does)."""
    key: StashKey[int] = StashKey("wrapped")
    seen = []

    class Wrap:
        @hookimpl(wrapper=True)
        def prepare_batch(self, view):
            batch = yield
            if batch is None and not seen.count("IDLE"):
                batch = view.idle_batch()
            if batch is not None:
                batch.stash[key] = batch.stash.get(key, 0) + 1
                seen.append(batch.forward_mode.name)
            return batch

    engine = make_engine(extra_plugins=(Wrap(),), plugins={"worker": "tp"})
    out = engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 3, "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == 3
    assert seen == ["EXTEND", "DECODE", "DECODE", "IDLE"]
    # The prefill batch becomes the running batch, so its stash counts every pass the wrapper saw.
    assert engine.scheduler.running_batch is None or engine.scheduler.running_batch.stash[key] == 3


def test_prepare_batch_may_not_replace_a_built_batch(make_engine):
    """The built batch holds KV slots: a plugin replacing it is refused as one that raised. The
    batch runs as built and its requests fail with the message; serving goes on, nothing leaks."""

    class Replace:
        def __init__(self):
            self.on = True

        @hookimpl(tryfirst=True)
        def prepare_batch(self, batch, view):
            return view.idle_batch() if batch is not None and self.on else None

    replace = Replace()
    engine = make_engine(extra_plugins=(replace,), plugins={"worker": "tp"})
    out = engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort", reason
    assert "returned an invalid value from prepare_batch" in reason["message"], reason
    assert "'Replace'" in reason["message"] and "in place of the batch the scheduler built" in reason["message"]
    replace.on = False
    out = engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2, "ignore_eos": True})
    assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_prepare_batch_may_only_add_an_idle_batch_where_there_was_none(make_engine, caplog):
    class NotABatch:
        @hookimpl(wrapper=True)
        def prepare_batch(self, batch):
            built = yield
            return "a batch" if built is None else built

    engine = make_engine(extra_plugins=(NotABatch(),), plugins={"worker": "tp"})
    out = engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2, "ignore_eos": True})
    assert out["meta_info"]["finish_reason"]["type"] == "length"  # the request's batches were fine
    for _ in range(3):  # idle rounds: the wrapper's answer is refused, nothing runs
        engine.scheduler.run_once()
    assert not engine.scheduler.has_work()
    assert "returned an invalid value from prepare_batch: got str 'a batch' where there was no batch" in caplog.text
    # logged once as an error however many idle rounds refuse it
    refused = [r.levelname for r in caplog.records if "where there was no batch" in r.getMessage()]
    assert [level for level in refused if level != "DEBUG"] == ["ERROR"], refused


def test_on_decode_oom_can_be_replaced_by_a_policy(make_engine):
    calls = []

    class KeepAll:
        @hookimpl(tryfirst=True)
        def on_decode_oom(self, batch, view):
            calls.append(batch.batch_size())
            return [], 0.5

    engine = make_engine(extra_plugins=(KeepAll(),), scheduler={"force_retract": True})
    engine.generate(input_ids=[[i + 1, i + 2] for i in range(12)], sampling_params={"max_new_tokens": 3})
    assert calls and all(bs > 10 for bs in calls)
    assert engine.scheduler.num_retractions == 0


def test_on_decode_oom_victims_are_retracted_by_the_core(make_engine):
    """The policy names victims; the core retracts from the front of its list (one is enough
    here: the pool is large), filters the batch and sends them back to waiting."""
    retracted = []

    class NewestFirst:
        @hookimpl(tryfirst=True)
        def on_decode_oom(self, batch):
            victims = sorted(batch.reqs, key=lambda r: r.rid, reverse=True)
            retracted.append(victims[0].rid)
            return victims

    engine = make_engine(extra_plugins=(NewestFirst(),), scheduler={"force_retract": True})
    outs = engine.generate(input_ids=[[i + 1, i + 2] for i in range(12)],
                           sampling_params={"max_new_tokens": 3, "ignore_eos": True})
    assert all(o["meta_info"]["completion_tokens"] == 3 for o in outs)
    assert retracted and engine.scheduler.num_retractions == len(retracted)


def test_on_request_finished_sees_the_reason(make_engine):
    reasons = []

    class Finished:
        @hookimpl
        def on_request_finished(self, req):
            reasons.append(req.finished_reason.to_json()["type"])

    engine = make_engine(extra_plugins=(Finished(),))
    engine.generate(input_ids=[[1, 2, 3], [4, 5]], sampling_params={"max_new_tokens": 2, "ignore_eos": True})
    assert reasons == ["length", "length"]


def test_on_idle_runs_after_the_leak_check(make_engine):
    seen = []

    class Idle:
        @hookimpl
        def on_idle(self, view):
            seen.append(view.new_token_ratio == engine.scheduler.new_token_ratio.init)

    engine = make_engine(extra_plugins=(Idle(),))
    engine.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 2})
    assert seen and all(seen)


def test_every_hook_has_a_heading_in_docs():
    text = (DOCS / "hooks.md").read_text()
    headings = {line[4:].strip().strip("`") for line in text.splitlines() if line.startswith("### ")}
    missing = [h for h in ALL_HOOKS if h not in headings]
    assert missing == []


def test_every_hookspec_states_its_contract():
    """When called, the return value and what the core does with it, who may implement it."""
    from framework import hookspecs

    for name in ALL_HOOKS:
        spec = getattr(hookspecs, name)
        doc = " ".join(spec.__doc__.split())
        assert ":return:" in doc and "mplement" in doc, name
        is_firstresult = spec.batchyard_spec["firstresult"]
        assert ("Stops at first non-None result" in doc) == is_firstresult, name


def test_every_hook_is_allowed_to_some_kind():
    from framework.hookspecs import KIND_HOOKS

    allowed = {hook for hooks in KIND_HOOKS.values() for hook in hooks}
    assert allowed == set(ALL_HOOKS)
