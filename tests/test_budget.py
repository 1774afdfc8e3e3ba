"""PrefillAdder arithmetic (reference F) and the new-token ratio life cycle (B5, I3)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from framework.budget import AddReqResult, NewTokenRatio, PrefillAdder
from framework.memory import ReqToTokenPool, TokenToKVPool
from framework.request import Req, SamplingParams
from plugins.caches.chunk import ChunkCache
from plugins.caches.radix import RadixCache


def test_ratio_init_decay_floor_reset():
    ratio = NewTokenRatio(0.7, 1.0, 0.14, 600)
    assert ratio.value == pytest.approx(0.7)
    assert ratio.min == pytest.approx(0.098)
    ratio.step()
    assert ratio.value == pytest.approx(0.7 - (0.7 - 0.098) / 600)
    for _ in range(1000):
        ratio.step()
    assert ratio.value == pytest.approx(0.098)
    ratio.reset()
    assert ratio.value == pytest.approx(0.7)


def test_conservativeness_scales_and_caps_the_ratio():
    assert NewTokenRatio(0.7, 0.5, 0.14, 600).init == pytest.approx(0.35)
    assert NewTokenRatio(0.7, 3.0, 0.14, 600).init == 1.0


@pytest.mark.parametrize("worker", ["tp", "overlap"])
def test_scheduler_resets_the_ratio_when_idle_and_decays_while_decoding(make_engine, worker):
    from framework import hookimpl

    values = []

    class Watch:
        @hookimpl
        def on_batch_result(self, view):
            values.append(view.new_token_ratio)

    engine = make_engine(extra_plugins=(Watch(),), plugins={"worker": worker},
                         scheduler={"schedule_conservativeness": 0.5})
    ratio = engine.scheduler.new_token_ratio
    assert ratio.init == pytest.approx(0.35)
    engine.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 5, "ignore_eos": True})
    if worker == "tp":
        assert values[0] == pytest.approx(ratio.init)
        decaying = values[1:]
    else:
        # The first decode batch (one decay) is built before the prefill's result is processed,
        # and the last result in an iteration that builds no batch (no decay).
        assert values[0] < ratio.init
        decaying = values[:-1]
    assert all(b < a for a, b in zip(decaying, decaying[1:]))
    assert ratio.value == ratio.init  # reset by the idle iteration


def make_req(ids, max_new=10, ignore_eos=False):
    req = Req("r", ids, SamplingParams(max_new_tokens=max_new, ignore_eos=ignore_eos))
    req.init_next_round_input()
    return req


def adder_for(cache, total=1000, inputs=500, chunk=None, running=None, ratio=0.5, mixed=0):
    return PrefillAdder(cache, running, ratio, total, inputs, chunk, mixed)


@pytest.fixture
def radix():
    return RadixCache(ReqToTokenPool(4, 64), TokenToKVPool(1000, torch.float32, 1, 1, 1))


def test_budgets_after_one_request(radix):
    adder = adder_for(radix, chunk=300)
    assert adder.add_one_req(make_req(list(range(100)), max_new=10)) == AddReqResult.CONTINUE
    assert (adder.rem_total_tokens, adder.cur_rem_tokens, adder.rem_input_tokens, adder.rem_chunk_tokens) == (
        890, 900, 400, 200,
    )


def test_running_requests_reserve_ratio_times_remaining(radix):
    running = SimpleNamespace(reqs=[Req("a", [1], SamplingParams(max_new_tokens=100))])
    running.reqs[0].output_ids = [5] * 20
    adder = adder_for(radix, running=running, ratio=0.5)
    assert adder.rem_total_tokens == 1000 - 80 * 0.5


def test_no_token_when_total_exceeds(radix):
    adder = adder_for(radix, total=100)
    assert adder.add_one_req(make_req(list(range(95)), max_new=10)) == AddReqResult.NO_TOKEN
    assert adder.can_run_list == []


def test_first_request_may_exceed_max_prefill_tokens(radix):
    adder = adder_for(radix, inputs=50)
    assert adder.add_one_req(make_req(list(range(80)))) == AddReqResult.OTHER
    assert len(adder.can_run_list) == 1
    assert adder.add_one_req(make_req(list(range(80)))) == AddReqResult.OTHER
    assert len(adder.can_run_list) == 1


def test_chunking_truncates_and_reserves_no_decode(radix):
    adder = adder_for(radix, chunk=32)
    req = make_req(list(range(100)), max_new=10)
    assert adder.add_one_req(req) == AddReqResult.OTHER
    assert adder.new_inflight_req is req
    assert req.extend_input_len == 32 and len(req.fill_ids) == 32
    assert adder.rem_total_tokens == 1000 - 32


def test_mixed_takes_one_token_per_running_request(radix):
    adder = adder_for(radix, total=1000, inputs=500, chunk=100, mixed=7)
    assert (adder.cur_rem_tokens, adder.rem_input_tokens, adder.rem_chunk_tokens) == (993, 493, 93)


def test_ignore_eos_admission_is_exact_on_a_cache_that_shares_nothing():
    cache = ChunkCache(ReqToTokenPool(4, 64), TokenToKVPool(1000, torch.float32, 1, 1, 1))
    # 100 prompt + 60 new tokens each: three fit in 500 (480), a fourth does not.
    adder = adder_for(cache, total=500, inputs=10000)
    results = [adder.add_one_req(make_req(list(range(100)), max_new=60, ignore_eos=True)) for _ in range(4)]
    assert len(adder.can_run_list) == 3
    assert results[3] == AddReqResult.NO_TOKEN


def retracted_req(ids, outputs, max_new, ignore_eos=False):
    """A request retracted after `outputs` tokens: it re-prefills its prompt and those outputs."""
    req = Req("r", ids, SamplingParams(max_new_tokens=max_new, ignore_eos=ignore_eos))
    req.output_ids = [5] * outputs
    req.init_next_round_input()
    return req


def test_a_retracted_request_reserves_only_the_tokens_it_has_left(radix):
    # 100 prompt + 200 outputs re-prefilled + 180 left = 480 of 500: it fits (the reference
    # reserves all 380 again, 680, and the request waits forever even in an empty pool).
    adder = adder_for(radix, total=500)
    assert adder.add_one_req(retracted_req(list(range(100)), 200, 380)) == AddReqResult.CONTINUE
    assert adder.rem_total_tokens == 500 - 300 - 180


def test_ignore_eos_admission_counts_a_retracted_requests_outputs():
    cache = ChunkCache(ReqToTokenPool(4, 512), TokenToKVPool(1000, torch.float32, 1, 1, 1))
    # 100 prompt + 100 outputs re-prefilled + 150 left = 350 tokens: not in 300.
    adder = adder_for(cache, total=300, inputs=10000)
    assert adder.add_one_req(retracted_req(list(range(100)), 100, 250, ignore_eos=True)) == AddReqResult.NO_TOKEN
    assert adder.can_run_list == []
