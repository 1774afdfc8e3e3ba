"""The scheduler on the tiny random llama: equality with transformers, chunked prefill, stop
conditions, bad input. Every engine is leak-checked by the `make_engine` fixture."""

from __future__ import annotations

import math

import pytest

from framework.messages import GenerateReqInput
from framework.plugins import PluginError
from framework.request import SamplingParams
from tests.conftest import assert_same_greedy, hf_greedy

PROMPTS = [
    list(range(10, 15)),
    list(range(200, 237)),
    list(range(1000, 1100)),
    list(range(3000, 3300)),
    [7] * 3 + list(range(500, 560)),
]
NEW = 12
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def reference(hf_tiny):
    return [hf_greedy(hf_tiny, p, NEW) for p in PROMPTS]


@pytest.mark.parametrize(
    "sections",
    [
        {},
        {"scheduler": {"chunked_prefill_size": 32}},
        {"scheduler": {"chunked_prefill_size": 32, "max_prefill_tokens": 40}},
        {"scheduler": {"chunked_prefill_size": None}, "plugins": {"cache": "chunk", "policy": "fcfs"}},
    ],
    ids=["default", "chunked", "chunked-small-budget", "no-chunking-chunk-cache"],
)
def test_greedy_matches_transformers_all_at_once(make_engine, hf_tiny, reference, sections):
    engine = make_engine(**sections)
    results = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    outputs = [r["output_ids"] for r in results]
    ties = assert_same_greedy({"ours": outputs}, PROMPTS, reference, hf_tiny)
    print(f"near-ties: {ties}")
    assert all(r["meta_info"]["completion_tokens"] == NEW for r in results)
    assert [r["meta_info"]["prompt_tokens"] for r in results] == [len(p) for p in PROMPTS]


def test_chunked_request_is_chunked(make_engine):
    sizes = []
    from framework import hookimpl

    class Extends:
        @hookimpl
        def on_batch_result(self, batch, result):
            if batch.forward_mode.is_extend():
                sizes.append(sum(batch.extend_lens))

    engine = make_engine(extra_plugins=(Extends(),), scheduler={"chunked_prefill_size": 32})
    engine.generate(input_ids=list(range(100, 200)), sampling_params={"max_new_tokens": 1})
    assert sizes == [32, 32, 32, 4]


def test_cached_tokens_reported_on_repeat(make_engine):
    engine = make_engine()
    prompt = list(range(300, 400))
    first = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    second = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert first["meta_info"]["cached_tokens"] == 0
    assert second["meta_info"]["cached_tokens"] == len(prompt) - 1
    assert first["output_ids"] == second["output_ids"]


# -- stop conditions ---------------------------------------------------------------------------


def test_max_new_tokens_and_length_reason(make_engine):
    out = make_engine().generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 5, "ignore_eos": True})
    assert len(out["output_ids"]) == 5
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}


def test_max_new_tokens_zero_still_prefills(make_engine):
    out = make_engine().generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 0})
    assert out["meta_info"]["completion_tokens"] == 1
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_stop_token_ids(make_engine, reference):
    engine = make_engine()
    stop_at = reference[1][3]
    out = engine.generate(input_ids=PROMPTS[1], sampling_params={**GREEDY, "ignore_eos": False, "stop_token_ids": [stop_at]})
    assert out["output_ids"] == reference[1][: reference[1].index(stop_at) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}


def test_ignore_eos_suppresses_stop_token_ids(make_engine, reference):
    out = make_engine().generate(input_ids=PROMPTS[1], sampling_params={**GREEDY, "stop_token_ids": [reference[1][0]]})
    assert out["output_ids"] == reference[1]


def test_min_new_tokens_masks_stop_tokens(make_engine, reference):
    stop_at = reference[1][0]
    out = make_engine().generate(
        input_ids=PROMPTS[1],
        sampling_params={"max_new_tokens": 8, "temperature": 0, "stop_token_ids": [stop_at], "min_new_tokens": 4},
    )
    assert len(out["output_ids"]) >= 4
    assert stop_at not in out["output_ids"][:4]


def test_stop_string_is_matched_and_trimmed(make_engine, default_tokenizer):
    engine = make_engine()
    free = engine.generate(input_ids=PROMPTS[2], sampling_params={**GREEDY, "max_new_tokens": 10})
    text = default_tokenizer.decode(free["output_ids"])
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    if not stop.strip():
        pytest.skip("the random model produced whitespace where the stop string would go")
    out = engine.generate(input_ids=PROMPTS[2], sampling_params={**GREEDY, "max_new_tokens": 10, "stop": stop})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in out["text"]
    assert text.startswith(out["text"])


@pytest.mark.parametrize("stop", ["", [""], ["", ""]])
def test_an_empty_stop_string_stops_nothing(make_engine, stop):
    """"" is in every text: as a string it used to end every request after one token, while in a
    list it was dropped. Both forms stop nothing now."""
    engine = make_engine()
    out = engine.generate(input_ids=PROMPTS[2], sampling_params={**GREEDY, "max_new_tokens": 6, "ignore_eos": True,
                                                                 "stop": stop})
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert len(out["output_ids"]) == 6


def test_seeded_sampling_is_reproducible(make_engine):
    engine = make_engine()
    params = {"max_new_tokens": 8, "temperature": 1.0, "seed": 1234, "ignore_eos": True}
    a = engine.generate(input_ids=PROMPTS[0], sampling_params=params)
    b = engine.generate(input_ids=PROMPTS[0], sampling_params=params)
    c = engine.generate(input_ids=PROMPTS[0], sampling_params={**params, "seed": 99})
    assert a["output_ids"] == b["output_ids"]
    assert a["output_ids"] != c["output_ids"]


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"input_ids": []}, "prompt is empty"),
        ({"input_ids": list(range(3000))}, "longer than the model's context"),
        ({"input_ids": [1, 2], "sampling_params": {"temperature": -1}}, "temperature: must be >= 0"),
        ({"input_ids": [1, 2], "sampling_params": {"temperature": math.nan}}, "temperature: must be finite"),
        ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "top_p: must be in (0, 1]"),
        ({"input_ids": [1, 2], "sampling_params": {"top_p": 1.5}}, "top_p: must be in (0, 1]"),
        ({"input_ids": [1, 2], "sampling_params": {"top_k": 0}}, "top_k"),
        # Larger than an int64 tensor holds: refused, not a crashed batch.
        ({"input_ids": [1, 2], "sampling_params": {"top_k": 10**30}}, "top_k: must be <= 2147483647"),
        ({"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [2**63]}}, "stop_token_ids"),
        ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": -3}}, "max_new_tokens: must be >= 0"),
        ({"input_ids": [1, 2], "sampling_params": {"min_p": math.nan}}, "min_p: must be finite"),
        ({"input_ids": [1, 2], "sampling_params": {"frequency_penalty": 3}}, "frequency_penalty"),
        ({"input_ids": [1, 2], "sampling_params": {"presence_penalty": -2.5}}, "presence_penalty: must be in [-2, 2]"),
        ({"input_ids": [1, 2], "sampling_params": {"repetition_penalty": 0}}, "repetition_penalty: must be in (0, 2]"),
        ({"input_ids": [1, 2], "sampling_params": {"stop_token_ids": [3, -1]}}, "stop_token_ids: must be a list of non-negative"),
        ({"input_ids": [1, 2], "sampling_params": {"stop_token_ids": 3}}, "stop_token_ids: must be a list"),
        ({"input_ids": [1, 2], "sampling_params": {"seed": 1.5}}, "seed: must be an integer"),
        ({"input_ids": [1, 2], "sampling_params": {"min_new_tokens": 5, "max_new_tokens": 2}}, "min_new_tokens"),
        ({"input_ids": [1, 2], "sampling_params": {"temprature": 0}}, "unknown field(s) temprature"),
        ({"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}, "temperature: must be a number"),
        ({"input_ids": [1, -2]}, "token ids must be in"),
        ({"input_ids": [1, 10**9]}, "token ids must be in"),
        ({"input_ids": [1, 2.5]}, "input_ids must be a list of integers"),
        ({"prompt": ""}, "prompt is empty"),
        ({}, "exactly one of prompt, input_ids or input_embeds"),
        ({"prompt": "hi", "input_ids": [1]}, "exactly one of prompt, input_ids or input_embeds"),
    ],
)
def test_bad_input_is_a_clear_error(make_engine, kwargs, message):
    engine = make_engine()
    with pytest.raises(ValueError) as info:
        engine.generate(**kwargs)
    assert message in str(info.value)
    assert not engine.scheduler.waiting_queue
    # The engine still serves afterwards.
    assert engine.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 1})["output_ids"]


def test_text_prompt_over_context_is_rejected(make_engine):
    engine = make_engine()
    with pytest.raises(ValueError, match="longer than the model's context"):
        engine.generate("hello " * 3000)


def test_unknown_plugin_name_is_a_clear_error(tiny_model_folder):
    from framework.engine import Engine

    with pytest.raises(PluginError, match="unknown policy plugin 'nope'; installed: .*fcfs"):
        Engine(model={"path": tiny_model_folder}, plugins={"policy": "nope"})


def test_leak_check_raises_when_a_slot_is_lost(make_engine):
    from framework.scheduler import MemoryLeakError

    engine = make_engine()
    sched = engine.scheduler
    lost = sched.token_to_kv_pool.alloc(3)
    with pytest.raises(MemoryLeakError, match="KV cache pool leak detected"):
        sched.check_memory()
    sched.token_to_kv_pool.free(lost)


def test_flush_right_after_a_finish_succeeds(make_engine):
    """A finished request still waiting to be filtered out of the batches does not block a flush."""
    engine = make_engine()
    sched = engine.scheduler
    params = SamplingParams(max_new_tokens=2, ignore_eos=True)
    params.normalize()
    sched.send(GenerateReqInput(rid="x", input_ids=[1, 2, 3], sampling_params=params))
    while not any(r.finished() for b in (sched.running_batch, sched.last_batch) if b for r in b.reqs):
        sched.run_once()
    assert sched.flush_cache()
    assert sched.tree_cache.evictable_size() == 0



def test_requests_finished_by_their_prefill_do_not_join_the_running_batch(make_engine):
    """A one-token request (or any embedding request) is done after its prefill; it must not sit
    in the running batch, counted by /get_server_info as running, while the next prefill runs
    (the embedding server's leak check saw num_running_reqs == 1 after its response)."""
    engine = make_engine(plugins={"worker": "tp"})
    sched = engine.scheduler
    one = SamplingParams(max_new_tokens=1)
    one.normalize()
    sched.send(GenerateReqInput(rid="a", input_ids=[1, 2, 3], sampling_params=one))
    sched.run_once()
    assert engine._outputs["a"].finished_reason is not None
    sched.send(GenerateReqInput(rid="b", input_ids=list(range(10, 40)), sampling_params=one))
    sched.run_once()  # merges a's batch, runs b's prefill
    assert engine._outputs["b"].finished_reason is not None
    assert sched.get_stats().num_running_reqs == 0
    while sched.has_work():
        sched.run_once()


def test_priority_reaches_the_priority_eviction_order(make_engine):
    """Under `cache.eviction = priority` a low-priority request's cached prompt is evicted first."""
    engine = make_engine(cache={"eviction": "priority", "max_total_tokens": 250})
    cache = engine.scheduler.tree_cache
    high, low = list(range(500, 600)), list(range(700, 800))
    engine.generate(input_ids=high, sampling_params={"max_new_tokens": 1}, priority=5)
    engine.generate(input_ids=low, sampling_params={"max_new_tokens": 1}, priority=0)
    # A third request needs room: the evicted prompt must be the low-priority one.
    engine.generate(input_ids=list(range(900, 980)), sampling_params={"max_new_tokens": 1})
    assert len(cache.match_prefix("q", high)[0]) == 100
    assert len(cache.match_prefix("q", low)[0]) < 100
