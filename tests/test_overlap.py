"""The overlap worker (plugins/workers/overlap.py): the same greedy outputs as the plain worker,
with and without grammars, the one-step-late free of a finished request's extra KV slot, errors and
shutdown of the forward thread, the fallback to the plain worker, weight updates with a batch in
flight. Every engine is leak-checked by `make_engine`."""

from __future__ import annotations

import json
import logging
import re
import threading

import pytest
import torch

from framework import hookimpl
from framework.engine import Engine
from framework.messages import AbortReq, GenerateReqInput
from framework.request import SamplingParams
from plugins.workers.overlap import FutureTokenMap, OverlapWorker
from plugins.workers.tp import TpWorker
from tests.conftest import assert_same_greedy, tiny_settings

PROMPT_CUT = 96
NUM_PROMPTS = 24  # enough for > 10 running requests (forced retraction) and mixed batches
NEW = 12
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
SMALL_CHUNKS = {"chunked_prefill_size": 64, "max_prefill_tokens": 256}


@pytest.fixture(scope="module")
def prompts(sharegpt_prompts):
    return [p[:PROMPT_CUT] for p in sharegpt_prompts[:NUM_PROMPTS]]


class ModeCounter:
    """Counts batches by forward mode, so a test can tell mixing really happened."""

    def __init__(self):
        self.modes: dict[str, int] = {}

    @hookimpl
    def on_batch_result(self, batch, result):
        name = batch.forward_mode.name
        self.modes[name] = self.modes.get(name, 0) + 1


@pytest.mark.parametrize(
    "scheduler",
    [SMALL_CHUNKS, {**SMALL_CHUNKS, "enable_mixed_chunk": True}, {**SMALL_CHUNKS, "force_retract": True}],
    ids=["chunked", "mixed", "retract"],
)
def test_overlap_equals_plain_worker(make_engine, hf_tiny, prompts, scheduler):
    outputs, engines, counters = {}, {}, {}
    for worker in ("tp", "overlap"):
        counters[worker] = ModeCounter()
        engines[worker] = make_engine(
            extra_plugins=(counters[worker],), plugins={"worker": worker}, scheduler=scheduler
        )
        results = engines[worker].generate(input_ids=prompts, sampling_params=GREEDY)
        outputs[worker] = [r["output_ids"] for r in results]
    assert isinstance(engines["overlap"].scheduler.worker, OverlapWorker)
    assert isinstance(engines["tp"].scheduler.worker, TpWorker)
    ties = assert_same_greedy({"overlap": outputs["overlap"]}, prompts, outputs["tp"], hf_tiny)
    assert ties <= 2
    overlap = engines["overlap"].scheduler
    assert overlap.num_late_finish_frees > 0
    if scheduler.get("force_retract"):
        assert overlap.num_retractions > 0
    if scheduler.get("enable_mixed_chunk"):
        assert counters["overlap"].modes.get("MIXED", 0) > 0


REGEXES = [r"(yes|no), [0-9]{2,4}", r"[a-z]{3,8}@example\.(com|org)", r"The answer is (red|green|blue)\."]
SCHEMA = json.dumps({
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]}},
    "required": ["ok", "color"],
    "additionalProperties": False,
})


def grammar_params(num: int) -> list[dict]:
    """Regex, JSON-schema and unconstrained requests, interleaved so batches mix them."""
    kinds = [{"regex": r} for r in REGEXES] + [{"json_schema": SCHEMA}, {"ignore_eos": True}]
    return [{"temperature": 0, "max_new_tokens": 40, **kinds[i % len(kinds)]} for i in range(num)]


def assert_in_grammar(params: dict, out: dict) -> None:
    if "regex" in params:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]
        assert re.fullmatch(params["regex"], out["text"]), (params["regex"], out["text"])
    elif "json_schema" in params:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]
        obj = json.loads(out["text"])
        assert set(obj) == {"ok", "color"} and isinstance(obj["ok"], bool) and obj["color"] in ("red", "green", "blue")


@pytest.mark.parametrize("scheduler", [{}, SMALL_CHUNKS], ids=["one-prefill", "chunked"])
def test_grammar_outputs_equal_plain_worker_and_satisfy_their_grammar(make_engine, hf_tiny, prompts, scheduler):
    """The mask of each pipelined batch is filled after the previous result (DUMMY_FIRST at the
    start): a mask built from matchers one token behind gives other tokens or breaks the grammar."""
    params = grammar_params(len(prompts))
    outputs = {}
    for worker in ("tp", "overlap"):
        engine = make_engine(plugins={"worker": worker}, scheduler=scheduler)
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        for p, out in zip(params, outs):
            assert_in_grammar(p, out)
        outputs[worker] = [o["output_ids"] for o in outs]
    assert isinstance(engine.scheduler.worker, OverlapWorker)
    ties = assert_same_greedy({"overlap": outputs["overlap"]}, prompts, outputs["tp"], hf_tiny)
    assert ties <= 2


def test_update_weights_with_a_batch_in_flight(make_engine, tiny_model_folder):
    """A finished request's last batch may still be queued for the forward thread when the weights
    are updated: the update runs behind it and its result is processed (its extra slot freed)."""
    engine = make_engine(plugins={"worker": "overlap"})
    sched = engine.scheduler
    assert isinstance(sched.worker, OverlapWorker)
    before = engine.generate(input_ids=list(range(10, 30)), sampling_params=GREEDY)["output_ids"]
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    params.normalize()
    sched.send(GenerateReqInput(rid="w", input_ids=list(range(40, 60)), sampling_params=params))
    sched.run_once()
    while sched.has_requests():
        sched.run_once()
    assert sched.result_queue  # the batch launched before the request was seen finished
    frees = sched.num_late_finish_frees
    ok, message = sched.update_weights(tiny_model_folder)
    assert ok, message
    assert not sched.result_queue and sched.num_late_finish_frees == frees + 1
    assert engine.generate(input_ids=list(range(10, 30)), sampling_params=GREEDY)["output_ids"] == before


@pytest.mark.parametrize("worker, late_frees", [("overlap", 1), ("tp", 0)])
def test_late_finish_frees_its_extra_slot_once(make_engine, worker, late_frees):
    """A request finishing after its third token was already in the next decode batch; the leak
    check of `make_engine` fails on a missed free and on a double free (more free than total)."""
    engine = make_engine(plugins={"worker": worker})
    out = engine.generate(input_ids=list(range(10, 30)), sampling_params={**GREEDY, "max_new_tokens": 3})
    assert len(out["output_ids"]) == 3
    sched = engine.scheduler
    assert sched.num_late_finish_frees == late_frees
    assert sched.token_to_kv_pool.available_size() + sched.tree_cache.evictable_size() == sched.max_total_num_tokens


def test_abort_while_prefill_in_flight_frees_its_slot(make_engine):
    engine = make_engine(plugins={"worker": "overlap"})
    sched = engine.scheduler
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    params.normalize()
    sched.send(GenerateReqInput(rid="x", input_ids=list(range(40, 60)), sampling_params=params))
    sched.run_once()  # the prefill is launched; its result is not processed yet
    assert len(sched.result_queue) == 1
    sched.send(AbortReq("x"))
    while sched.has_work():
        sched.run_once()
    sched.run_once()
    assert sched.num_late_finish_frees == 1


@pytest.mark.parametrize("worker", ["tp", "overlap"])
def test_abort_of_a_retracted_waiting_request_is_reported(make_engine, worker):
    """A retracted request waits again; aborting it there must still report it (it was dropped
    silently while it kept its retracted flag)."""
    engine = make_engine(plugins={"worker": worker}, scheduler={"force_retract": True})
    sched = engine.scheduler
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    params.normalize()
    for n in range(12):
        sched.send(GenerateReqInput(rid=f"r{n}", input_ids=list(range(40 + n, 50 + n)), sampling_params=params))
    for _ in range(200):
        sched.run_once()
        retracted = [r for r in sched.waiting_queue if r.is_retracted]
        if retracted:
            break
    assert retracted, "no request was retracted"
    rid = retracted[0].rid
    sched.send(AbortReq(rid))
    while sched.has_work():
        sched.run_once()
    sched.run_once()
    assert engine._outputs[rid].finished_reason.to_json()["type"] == "abort"
    assert sum(o.finished_reason is not None for o in engine._outputs.values()) == 12


class FailingForward:
    """Makes the model's forward pass raise on its second call (on the forward thread)."""

    def __init__(self, runner):
        self.runner = runner
        self.forward = runner.forward
        self.calls = 0

    def __call__(self, batch):
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("forward exploded")
        return self.forward(batch)


def test_forward_thread_error_surfaces_and_thread_stops(tiny_model_folder):
    engine = Engine(tiny_settings(tiny_model_folder, plugins={"worker": "overlap"}))
    worker = engine.scheduler.worker
    runner = worker.inner.runner
    runner.forward = FailingForward(runner)
    try:
        with pytest.raises(RuntimeError, match="forward exploded"):
            engine.generate(input_ids=[list(range(10, 20)), list(range(30, 45))], sampling_params=GREEDY)
    finally:
        engine.shutdown()
    assert not worker.forward_thread.is_alive()


def test_shutdown_after_a_loop_error_releases_a_batch_waiting_for_its_mask(tiny_model_folder):
    """Result processing fails after a grammar batch was launched, so its mask is never filled:
    shutdown must still stop the forward thread, which waits on that batch's event."""
    engine = Engine(tiny_settings(tiny_model_folder, plugins={"worker": "overlap"}))
    worker = engine.scheduler.worker

    def exploding(batch, handle):
        raise RuntimeError("result processing exploded")

    engine.scheduler.process_batch_result = exploding
    try:
        with pytest.raises(RuntimeError, match="exploded"):
            engine.generate(input_ids=list(range(10, 30)), sampling_params={**GREEDY, "regex": REGEXES[0]})
        assert engine.scheduler.structured.pending_vocab_mask is not None
    finally:
        stopper = threading.Thread(target=engine.shutdown, daemon=True)
        stopper.start()
        stopper.join(60)  # a hang guard, not a timing check
    assert not stopper.is_alive() and not worker.forward_thread.is_alive()


def test_shutdown_stops_the_forward_thread(make_engine):
    engine = make_engine(plugins={"worker": "overlap"})
    engine.generate(input_ids=list(range(10, 20)), sampling_params=GREEDY)
    worker = engine.scheduler.worker
    assert worker.forward_thread.is_alive()
    worker.shutdown()
    assert not worker.forward_thread.is_alive()


def test_penalties_fallback_starts_the_plain_worker(make_engine, caplog):
    with caplog.at_level(logging.INFO, logger="plugins.workers.overlap"):
        engine = make_engine(plugins={"worker": "overlap"}, worker={"overlap_penalties": "fallback"})
    assert isinstance(engine.scheduler.worker, TpWorker)
    assert any("Overlap worker not used" in r.getMessage() for r in caplog.records)


def test_penalties_are_ignored_with_a_warning_under_overlap(make_engine, caplog):
    engine = make_engine(plugins={"worker": "overlap"})
    params = {**GREEDY, "max_new_tokens": 2, "frequency_penalty": 0.5, "repetition_penalty": 1.2}
    with caplog.at_level(logging.WARNING, logger="framework.scheduler"):
        engine.generate(input_ids=list(range(10, 20)), sampling_params=params)
    assert any("penalties are ignored" in r.getMessage() for r in caplog.records)


def test_future_token_map_resolves_and_wraps():
    fmap = FutureTokenMap(max_batch_size=2)
    seen = []
    for step in range(5):  # wraps after 3 batches of 2
        start, placeholders = fmap.allocate(2)
        assert all(p < 0 for p in placeholders)
        fmap.store(start, [100 + step, 200 + step])
        resolved = fmap.resolve(torch.tensor([7, *placeholders]))
        seen.append(resolved.tolist())
    assert seen == [[7, 100 + s, 200 + s] for s in range(5)]
    with pytest.raises(ValueError, match="exceeds"):
        fmap.allocate(3)
