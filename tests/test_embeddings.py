"""Embedding models (reference Y) and input_embeds requests (reference Z) on the tiny random llama.

Embeddings are compared with transformers' last hidden state of the last token, L2-normalized, on
the same weights; input_embeds requests with the same prompts given as token ids. Every engine is
leak-checked by its fixture.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from framework import hookimpl
from framework.engine import Engine
from framework.messages import AbortReq, GenerateReqInput
from framework.request import SamplingParams
from tests.conftest import (
    TINY_CONFIG,
    assert_no_leak,
    assert_same_direction,
    check_greedy_equal,
    hf_embedding,
    hf_next_logprobs,
    leak_checked_engines,
    tiny_settings,
)

PROMPTS = [list(range(10, 15)), list(range(200, 237)), [7] * 3 + list(range(500, 560)), [42]]
NEW = 10
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def make_embedder(tiny_embedding_folder):
    yield from leak_checked_engines(tiny_embedding_folder)


@pytest.fixture(scope="module")
def embedder(tiny_embedding_folder):
    """One embedding engine shared by the cheap tests; each of them leaves it leak-free."""
    engine = Engine(tiny_settings(tiny_embedding_folder))
    yield engine
    assert_no_leak(engine)
    engine.shutdown()


@pytest.fixture(scope="module")
def generator(tiny_model_folder):
    engine = Engine(tiny_settings(tiny_model_folder))
    yield engine
    assert_no_leak(engine)
    engine.shutdown()


# -- embedding models -----------------------------------------------------------------------------


def test_encode_matches_transformers_single_and_batch(embedder, hf_embedder, default_tokenizer):
    engine = embedder
    single = engine.encode("The quick brown fox")
    ids = default_tokenizer.encode("The quick brown fox")
    assert_same_direction(single["embedding"], hf_embedding(hf_embedder, ids))
    assert single["meta_info"]["prompt_tokens"] == len(ids)
    assert single["meta_info"]["finish_reason"] == {"type": "length", "length": 0}

    results = engine.encode(input_ids=PROMPTS)  # one batch of different lengths
    assert len(results) == len(PROMPTS)
    for prompt, result in zip(PROMPTS, results):
        assert_same_direction(result["embedding"], hf_embedding(hf_embedder, prompt))
    # Different prompts give different vectors (the check above is not vacuous).
    assert float(torch.dot(torch.tensor(results[0]["embedding"]), torch.tensor(results[1]["embedding"]))) < 0.99


def test_prefix_cache_and_chunked_prefill_keep_the_vector(make_embedder, hf_embedder):
    prompt = list(range(300, 350))
    engine = make_embedder(scheduler={"chunked_prefill_size": 16})
    first = engine.encode(input_ids=prompt)
    # A prefix of the first prompt and a longer prompt sharing it, batched together.
    shorter, longer = engine.encode(input_ids=[prompt[:30], prompt + [5, 6, 7]])
    again = engine.encode(input_ids=prompt)
    assert again["meta_info"]["cached_tokens"] == len(prompt) - 1  # the last token is recomputed
    assert shorter["meta_info"]["cached_tokens"] > 0 and longer["meta_info"]["cached_tokens"] > 0
    for ids, result in [(prompt, first), (prompt[:30], shorter), (prompt + [5, 6, 7], longer), (prompt, again)]:
        assert_same_direction(result["embedding"], hf_embedding(hf_embedder, ids))


def test_a_causal_checkpoint_served_as_an_embedding_model(tiny_model_folder, hf_tiny):
    engine = Engine(tiny_settings(tiny_model_folder, model={"is_embedding": True}))
    try:
        assert not engine.scheduler.is_generation
        result = engine.encode(input_ids=PROMPTS[1])
        assert_same_direction(result["embedding"], hf_embedding(hf_tiny.model, PROMPTS[1]))
        with pytest.raises(ValueError, match="is an embedding model"):
            engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)
        assert_no_leak(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("is_embedding", [False, True], ids=["generation", "embedding"])
def test_abort_between_chunks_caches_only_the_computed_chunks(make_engine, hf_tiny, is_embedding):
    engine = make_engine(model={"is_embedding": is_embedding}, scheduler={"chunked_prefill_size": 16})
    prompt = list(range(100, 160))
    params = SamplingParams(max_new_tokens=0 if is_embedding else 4)
    params.normalize(None)
    engine.scheduler.send(GenerateReqInput(rid="x", input_ids=prompt, sampling_params=params,
                                           is_embedding=is_embedding))
    engine.scheduler.run_once()
    engine.scheduler.run_once()  # two chunks of 16 computed
    assert engine.scheduler.being_chunked_req is not None
    engine.scheduler.send(AbortReq("x"))
    while engine.scheduler.has_work():
        engine.scheduler.run_once()
    engine.scheduler.run_once()  # idle: the leak check
    assert engine._outputs.pop("x").finished_reason.to_json()["type"] == "abort"
    assert engine.scheduler.tree_cache.total_size() == 32
    if is_embedding:
        again = engine.encode(input_ids=prompt)
        assert_same_direction(again["embedding"], hf_embedding(hf_tiny.model, prompt))
    else:
        again = engine.generate(input_ids=prompt, sampling_params=GREEDY)
    assert again["meta_info"]["cached_tokens"] == 32


def test_encode_on_a_generation_model_is_refused(generator):
    engine = generator
    with pytest.raises(ValueError, match="does not appear to be an embedding model"):
        engine.encode(input_ids=PROMPTS[0])
    assert engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY)["meta_info"]["completion_tokens"] == NEW


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "exactly one of"),
        ({"input_ids": []}, "empty"),
        ({"input_ids": [10**9]}, "token ids must be in"),
        ({"input_ids": list(range(3000))}, "longer than"),
    ],
)
def test_encode_bad_input(embedder, kwargs, message):
    with pytest.raises(ValueError, match=message):
        embedder.encode(**kwargs)
    assert_no_leak(embedder)
    assert len(embedder.encode(input_ids=[1, 2, 3])["embedding"]) == TINY_CONFIG["hidden_size"]


# -- input_embeds ---------------------------------------------------------------------------------


def embeds_of(hf_model, ids: list[int]) -> list[list[float]]:
    return hf_model.model.embed_tokens.weight[ids].detach().tolist()


def assert_matches_ids_run(hf_tiny, prompts, by_embeds: list[list[int]], by_ids: list[list[int]]) -> None:
    for prompt, ours, ref in zip(prompts, by_embeds, by_ids):
        check_greedy_equal(ours, ref, lambda prefix, prompt=prompt: hf_next_logprobs(hf_tiny, prompt + prefix))


def test_input_embeds_equals_the_same_prompt_as_ids(make_engine, hf_tiny):
    engine = make_engine()
    single = engine.generate(input_embeds=embeds_of(hf_tiny, PROMPTS[1]), sampling_params=GREEDY)
    assert single["meta_info"]["prompt_tokens"] == len(PROMPTS[1])
    assert single["meta_info"]["cached_tokens"] == 0
    batch = engine.generate(input_embeds=[embeds_of(hf_tiny, p) for p in PROMPTS], sampling_params=GREEDY)
    by_ids = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert_matches_ids_run(hf_tiny, PROMPTS, [single["output_ids"]], [by_ids[1]["output_ids"]])
    assert_matches_ids_run(hf_tiny, PROMPTS, [r["output_ids"] for r in batch], [r["output_ids"] for r in by_ids])
    # The embeds runs cached nothing (their ids are placeholders); the ids run cached its prompts.
    assert engine.scheduler.tree_cache.total_size() == sum(len(p) + NEW - 1 for p in PROMPTS)


class RePrefills:
    """Counts prefills of input_embeds requests that already have output (after a retraction)."""

    def __init__(self):
        self.count = 0

    @hookimpl
    def on_batch_result(self, batch, result):
        if batch.forward_mode.is_extend():
            self.count += sum(1 for r in batch.reqs if r.input_embeds is not None and len(r.output_ids) > 1)


def test_input_embeds_and_ids_in_one_batch_with_retraction(make_engine, hf_tiny):
    """Embeds and id prompts share prefill and mixed batches; forced retraction re-prefills the
    embeds requests from their vectors followed by their output ids."""
    prompts = [list(range(100 + 7 * i, 130 + 9 * i)) for i in range(12)]
    sections = {"scheduler": {"force_retract": True, "enable_mixed_chunk": True, "chunked_prefill_size": 64}}
    params = SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True)
    params.normalize(None)
    # Odd ones (the longer prompt of each pair, retracted first) as vectors.
    messages = [
        GenerateReqInput(
            rid=f"r{i}", input_ids=[0] * len(p) if i % 2 else p, sampling_params=dataclasses.replace(params),
            input_embeds=torch.tensor(embeds_of(hf_tiny, p)) if i % 2 else None,
        )
        for i, p in enumerate(prompts)
    ]
    re_prefills = RePrefills()
    results = make_engine(extra_plugins=(re_prefills,), **sections)._run(messages, single=False)
    assert re_prefills.count > 0
    by_ids = make_engine(**sections).generate(input_ids=prompts, sampling_params=GREEDY)
    assert_matches_ids_run(hf_tiny, prompts, [r["output_ids"] for r in results], [r["output_ids"] for r in by_ids])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"input_embeds": [[0.0] * 63]}, "must have 64 numbers"),
        ({"input_embeds": []}, "non-empty"),
        ({"input_embeds": [[0.0] * 64, [0.0] * 3]}, "equal length"),
        ({"input_embeds": [[float("nan")] * 64]}, "finite"),
        ({"input_embeds": [["a"] * 64]}, "list of vectors"),
        ({"input_embeds": [[0.0] * 64], "input_ids": [1]}, "exactly one of"),
        ({"input_embeds": [[0.0] * 64] * 3000}, "longer than"),
        ({"input_embeds": [[0.0] * 64] * 3, "return_logprob": True, "logprob_start_len": 0}, "no tokens to score"),
    ],
)
def test_input_embeds_bad_input(generator, kwargs, message):
    with pytest.raises(ValueError, match=message):
        generator.generate(sampling_params=GREEDY, **kwargs)
    assert_no_leak(generator)
    out = generator.generate(input_embeds=[[0.1] * 64] * 3, sampling_params=GREEDY, return_logprob=True)
    assert len(out["meta_info"]["output_token_logprobs"]) == NEW


def test_input_embeds_with_a_session_is_refused(generator):
    engine = generator
    params = SamplingParams(max_new_tokens=2)
    params.normalize(None)
    msg = GenerateReqInput(rid="s", input_ids=[0], sampling_params=params, session_id="any",
                           input_embeds=torch.zeros(1, 64))
    with pytest.raises(ValueError, match="a session request takes text or input_ids"):
        engine._run([msg], single=True)


def test_input_embeds_on_an_embedding_model_is_refused(embedder):
    with pytest.raises(ValueError, match="is an embedding model"):
        embedder.generate(input_embeds=[[0.0] * 64], sampling_params=GREEDY)
