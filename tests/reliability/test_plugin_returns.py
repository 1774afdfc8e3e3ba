"""A plugin whose hook *returns* something outside the hook's contract is handled as one that
raised (test_plugin_faults.py): the requests concerned fail with a message naming the plugin,
the hook and what was wrong; the scheduler serves on and nothing leaks (the engines' idle leak
check runs after every test). Before, such an answer escaped the scheduler loop and stopped the
server."""

from __future__ import annotations

import numpy as np
import pytest

from framework import hookimpl
from framework.plugins import PluginError

MARK = "BAD-ANSWER"
PARAMS = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}


class Stranger:
    """An object that is not a request of the scheduler."""

    rid = "stranger"


def _raising_generator(reqs):
    yield reqs[0]
    raise RuntimeError("the generator broke")


SELECT_ANSWERS = {
    "an int": (lambda reqs: 5, "got int 5"),
    "rids": (lambda reqs: [r.rid for r in reqs], "is not a request of view.waiting_queue"),
    "a None item": (lambda reqs: [None], "NoneType None is not a request"),
    "a dict": (lambda reqs: {r.rid: r for r in reqs}, "got dict"),
    "a stranger": (lambda reqs: [Stranger()], "Stranger"),
    "twice": (lambda reqs: list(reqs) * 2, "is listed twice"),
    "a broken generator": (_raising_generator, "iterating it raised RuntimeError: the generator broke"),
}


class BadSelect:
    """Answers `answer(waiting)` while a request with MARK waits; otherwise lets the policy choose."""

    def __init__(self, answer):
        self.answer = answer

    @hookimpl(tryfirst=True)
    def select_prefill(self, view):
        if any(MARK in (r.origin_input_text or "") for r in view.waiting_queue):
            return self.answer(view.waiting_queue)
        return None


def assert_all_aborted(outs: list[dict], *fragments: str) -> None:
    """Every output ended with an abort whose message holds each fragment."""
    for out in outs:
        reason = out["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and all(f in reason["message"] for f in fragments), reason


@pytest.mark.parametrize("case", list(SELECT_ANSWERS))
def test_a_bad_select_prefill_answer_fails_the_waiting_requests_and_serving_goes_on(make_engine, case):
    answer, expected = SELECT_ANSWERS[case]
    engine = make_engine(extra_plugins=(BadSelect(answer),))
    outs = engine.generate([f"{MARK} {i}" for i in range(2)], [PARAMS] * 2)
    assert_all_aborted(outs, "'BadSelect'", "select_prefill", expected)
    fine = engine.generate(["all is well", "still well"], [PARAMS] * 2)
    assert [o["meta_info"]["finish_reason"]["type"] for o in fine] == ["length", "length"]


OOM_ANSWERS = {
    "rids": (lambda reqs: [r.rid for r in reqs], "is not a request of the running batch"),
    "a ratio that is no number": (lambda reqs: (list(reqs), "fast"), "the new token ratio str 'fast'"),
    "a ratio above one": (lambda reqs: (list(reqs), 1.5), "the new token ratio float 1.5 of (victims, new_token_ratio) is not a number in [0, 1]"),
    "a NaN ratio": (lambda reqs: (list(reqs), float("nan")), "is not a number in [0, 1]"),
    "twice": (lambda reqs: [reqs[0], reqs[0], reqs[1]], "is listed twice"),
    "a stranger": (lambda reqs: [Stranger()], "Stranger"),
    "an int": (lambda reqs: 3, "got int 3"),
}


class BadOom:
    @hookimpl(tryfirst=True)
    def on_decode_oom(self, batch):
        return self.answer(batch.reqs)

    def __init__(self, answer):
        self.answer = answer


@pytest.mark.parametrize("case", list(OOM_ANSWERS))
def test_a_bad_on_decode_oom_answer_fails_the_batch_and_serving_goes_on(make_engine, case):
    answer, expected = OOM_ANSWERS[case]
    bad = BadOom(answer)
    # force_retract sends a decode batch of more than 10 requests through on_decode_oom.
    engine = make_engine(extra_plugins=(bad,), scheduler={"force_retract": True})
    outs = engine.generate([f"{MARK} {i}" for i in range(12)], [PARAMS] * 12)
    assert_all_aborted(outs, "'BadOom'", "returned an invalid value from on_decode_oom", expected)
    assert engine.scheduler.num_retractions == 0
    engine.scheduler.plugins.pm.unregister(bad)
    fine = engine.generate(["all is well"] * 12, [PARAMS] * 12)
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in fine)


class TupleOfVictims:
    """`batch.reqs` is a tuple: returned as it is, it is the victims, not (victims, ratio). Two
    victims make a pair, the case a check of "a tuple of two" alone would misread."""

    def __init__(self, count):
        self.count = count
        self.calls = 0

    @hookimpl(tryfirst=True)
    def on_decode_oom(self, batch):
        self.calls += 1
        return batch.reqs[: self.count] if self.count else batch.reqs


@pytest.mark.parametrize("count", [0, 2])
def test_on_decode_oom_may_return_a_tuple_of_requests(make_engine, count):
    policy = TupleOfVictims(count)
    engine = make_engine(extra_plugins=(policy,), scheduler={"force_retract": True})
    outs = engine.generate([f"prompt {i}" for i in range(12)], [PARAMS] * 12)
    assert policy.calls >= 1
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    assert all(len(o["output_ids"]) == PARAMS["max_new_tokens"] for o in outs)
    assert engine.scheduler.num_retractions >= 1


@pytest.mark.parametrize("ratio", [0.25, np.float32(0.25), None], ids=["float", "numpy", "none"])
def test_on_decode_oom_pair_of_victims_and_ratio_sets_the_ratio(make_engine, ratio):
    """(victims, ratio) sets the ratio (a numpy number too); (victims, None) leaves it to the core."""

    class WithRatio:
        @hookimpl(tryfirst=True)
        def on_decode_oom(self, batch):
            return list(batch.reqs), ratio

    engine = make_engine(extra_plugins=(WithRatio(),), scheduler={"force_retract": True})
    ratios = []
    retract = engine.scheduler.retract_decode

    def recording(batch, decision):
        retract(batch, decision)
        ratios.append(engine.scheduler.new_token_ratio.value)

    engine.scheduler.retract_decode = recording
    outs = engine.generate([f"prompt {i}" for i in range(12)], [PARAMS] * 12)
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    assert ratios and (ratios[0] == 0.25 if ratio is not None else 0.0 < ratios[0] <= 1.0 and ratios[0] != 0.25)


def test_a_policy_without_select_prefill_is_refused_at_start_up():
    from framework.testing import SchedulerHarness

    class RetractionOnly:
        PLUGIN_KIND = "policy"

        @hookimpl
        def on_decode_oom(self, batch):
            return list(batch.reqs)

    with pytest.raises(PluginError, match="policy plugin .RetractionOnly. does not implement select_prefill, so no request"):
        SchedulerHarness(RetractionOnly())


def test_a_policy_reusing_a_bundled_select_prefill_runs():
    """What the start-up error suggests: take a bundled policy's select_prefill into your own."""
    import types

    from framework.testing import SchedulerHarness
    from plugins.policies.fcfs import select_prefill

    mine = types.ModuleType("retraction_only")
    mine.PLUGIN_KIND = "policy"
    mine.select_prefill = select_prefill

    @hookimpl
    def on_decode_oom(batch):
        return list(batch.reqs)[::-1]

    mine.on_decode_oom = on_decode_oom
    harness = SchedulerHarness(mine)
    rids = [harness.add([1, 2, 3], max_new_tokens=2) for _ in range(3)]
    harness.run()
    assert all(len(harness.outputs[rid]) == 2 for rid in rids)


def test_no_victims_for_a_real_decode_oom_fail_the_batch_and_serving_goes_on():
    """On a real out-of-memory (not force_retract), victims that leave the next decode step without
    KV (here none) are refused like any bad answer. Before, the step's allocation raised
    OutOfMemoryError out of the scheduler loop, stopping the server with the batch's KV held."""
    from framework.request import FinishAbort
    from framework.testing import SchedulerHarness

    class NoVictims:
        PLUGIN_KIND = "policy"
        calls = 0

        @hookimpl
        def select_prefill(self, view):
            return list(view.waiting_queue)

        @hookimpl
        def on_decode_oom(self):
            self.calls += 1
            return []

    policy = NoVictims()
    with SchedulerHarness(policy, cache={"max_total_tokens": 160}) as harness:
        ratio = harness.scheduler.new_token_ratio
        ratio.init = ratio.value = ratio.min = 0.0  # admission reserves nothing for future tokens
        rids = []
        for i in range(8):  # arriving one by one, each is admitted beside the running ones
            rids.append(harness.add([i + 1] * 8, max_new_tokens=40))
            harness.step()
        harness.run()
        assert policy.calls >= 1 and sorted(harness.finished) == sorted(rids)
        failed = [reason for reason in harness.finished.values() if isinstance(reason, FinishAbort)]
        assert failed and all("plugin 'NoVictims' returned an invalid value from on_decode_oom: after its "
                              "victims, the next decode step" in reason.message for reason in failed)
        harness.check_no_leak()
        fine = [harness.add([9, 9], max_new_tokens=3) for _ in range(2)]
        harness.run()
        assert all(len(harness.outputs[r]) == 3 for r in fine)
