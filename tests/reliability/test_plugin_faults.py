"""Item 5, in process: a plugin raising inside any request-time hook fails that request (or batch)
with an error naming the plugin; the scheduler keeps serving and nothing leaks (the engines'
idle leak check runs after every test). A grammar whose compilation crashes fails its request
alone. The same through a server is in test_faults.py."""

from __future__ import annotations

import pytest

from framework import hookimpl

MARK = "RAISE-IN-PLUGIN"
PARAMS = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


class Faulty:
    """Raises in `hook` when it concerns a request whose prompt carries MARK (on_idle: always).
    No PLUGIN_KIND: an extra plugin object of no kind may implement every hook."""

    def __init__(self, hook: str):
        self.hook = hook
        self.num_raised = 0

    def _maybe_raise(self, hook: str, reqs) -> None:
        if hook == self.hook and any(MARK in (r.origin_input_text or "") for r in reqs):
            self.num_raised += 1
            raise ValueError(f"injected fault in {hook}")

    @hookimpl
    def on_request_received(self, req, view):
        self._maybe_raise("on_request_received", [req])

    @hookimpl(tryfirst=True)  # before the policy, whose answer would end the call
    def select_prefill(self, view, adder):
        self._maybe_raise("select_prefill", view.waiting_queue)
        return None  # the policy chooses

    @hookimpl
    def prepare_batch(self, batch, view):
        if batch is not None:
            self._maybe_raise("prepare_batch", batch.reqs)
        return None  # only inspects: the core's default returns the batch

    @hookimpl(tryfirst=True)  # before the policy, whose answer would end the call
    def on_decode_oom(self, batch, view):
        self._maybe_raise("on_decode_oom", batch.reqs)
        return None  # the policy chooses the victims

    @hookimpl
    def on_batch_result(self, batch, result, view):
        self._maybe_raise("on_batch_result", batch.reqs)

    @hookimpl
    def on_request_finished(self, req, view):
        self._maybe_raise("on_request_finished", [req])

    @hookimpl
    def on_idle(self, view):
        if self.hook == "on_idle":
            self.num_raised += 1
            raise ValueError("injected fault in on_idle")


REQUEST_HOOKS = ["on_request_received", "select_prefill", "prepare_batch", "on_decode_oom",
                 "on_batch_result", "on_request_finished"]


@pytest.mark.parametrize("worker", ["tp", "overlap"])
@pytest.mark.parametrize("hook", REQUEST_HOOKS)
def test_plugin_raising_in_a_hook_fails_its_requests_and_serving_goes_on(make_engine, hook, worker):
    faulty = Faulty(hook)
    # force_retract sends a decode batch of more than 10 requests through on_decode_oom.
    engine = make_engine(extra_plugins=(faulty,), plugins={"worker": worker},
                         scheduler={"force_retract": hook == "on_decode_oom"})
    num = 12 if hook == "on_decode_oom" else 1
    outs = engine.generate([f"{MARK} {i}" for i in range(num)], [PARAMS] * num)
    assert faulty.num_raised >= 1
    for out in outs:
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort", reason
        assert f"plugin 'Faulty' failed in hook {hook}" in reason["message"]
        assert "injected fault" in reason["message"]
    # The scheduler serves on, unmarked requests are untouched.
    fine = engine.generate(["all is well", "still well"], [PARAMS] * 2)
    assert [o["meta_info"]["finish_reason"]["type"] for o in fine] == ["length", "length"]
    assert all(len(o["output_ids"]) == 4 for o in fine)


def test_plugin_raising_in_on_idle_is_logged_and_serving_goes_on(make_engine, caplog):
    faulty = Faulty("on_idle")
    engine = make_engine(extra_plugins=(faulty,))
    for _ in range(2):
        out = engine.generate("fine", PARAMS)
        assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert faulty.num_raised >= 2
    assert "plugin 'Faulty' failed in hook on_idle" in caplog.text


class Recorder:
    """Sees every broadcast hook after the other plugins (trylast)."""

    def __init__(self):
        self.received, self.finished, self.marked_results, self.idle = [], [], 0, 0

    @hookimpl(trylast=True)
    def on_request_received(self, req):
        self.received.append(req.rid)

    @hookimpl(trylast=True)
    def on_batch_result(self, batch):
        self.marked_results += any(MARK in (r.origin_input_text or "") for r in batch.reqs)

    @hookimpl(trylast=True)
    def on_request_finished(self, req):
        self.finished.append(req.rid)

    @hookimpl(trylast=True)
    def on_idle(self):
        self.idle += 1


@pytest.mark.parametrize("hook", ["on_request_received", "on_batch_result", "on_request_finished", "on_idle"])
def test_a_plugin_raising_in_a_broadcast_hook_keeps_the_event_from_no_other(make_engine, hook):
    """pluggy stops a hook at the first exception; the facade calls every other implementation of a
    broadcast hook all the same, and a request refused in on_request_received still ends with
    on_request_finished for the plugins that took it in."""
    faulty, recorder = Faulty(hook), Recorder()
    engine = make_engine(extra_plugins=(faulty, recorder))
    out = engine.generate(f"{MARK} x", PARAMS)
    if hook != "on_idle":
        assert f"plugin 'Faulty' failed in hook {hook}" in out["meta_info"]["finish_reason"]["message"]
    assert faulty.num_raised >= 1
    assert recorder.received == recorder.finished and len(recorder.received) == 1
    if hook == "on_request_received":
        assert recorder.marked_results == 0  # refused before it ran
    else:
        assert recorder.marked_results >= (faulty.num_raised if hook == "on_batch_result" else 1)
    if hook == "on_idle":
        assert recorder.idle >= faulty.num_raised


def test_a_crashed_grammar_compile_fails_its_request_others_proceed(make_engine):
    engine = make_engine()
    backend = engine.scheduler.structured.backend
    compile_grammar = backend.compile_fn

    def crashing(key):
        if key == ("regex", "crash"):
            raise MemoryError("the grammar compiler crashed")
        return compile_grammar(key)

    backend.compile_fn = crashing
    outs = engine.generate(
        ["a", "b", "c"],
        [{**PARAMS, "regex": "crash"}, {**PARAMS, "regex": "[ab]{4}"}, PARAMS],
    )
    crashed, constrained, plain = outs
    assert crashed["meta_info"]["finish_reason"]["type"] == "abort"
    assert "the grammar compiler crashed" in crashed["meta_info"]["finish_reason"]["message"]
    assert crashed["output_ids"] == []
    assert len(constrained["text"]) == 4 and set(constrained["text"]) <= {"a", "b"}
    assert plain["meta_info"]["finish_reason"]["type"] == "length"


class Wrapping:
    """A ``wrapper=True`` prepare_batch, as DP attention has: the fault passes through it."""

    @hookimpl(wrapper=True)
    def prepare_batch(self, batch, view):
        return (yield)


def test_a_fault_passing_through_a_wrapper_names_the_plugin_that_raised(make_engine):
    faulty = Faulty("prepare_batch")
    engine = make_engine(extra_plugins=(faulty, Wrapping()))
    out = engine.generate(f"{MARK} wrapped", PARAMS)
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "plugin 'Faulty' failed in hook prepare_batch" in reason["message"], reason
    assert engine.generate("fine", PARAMS)["meta_info"]["finish_reason"]["type"] == "length"
