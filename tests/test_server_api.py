"""The HTTP API on a real server subprocess (tiny random llama): native, OpenAI, errors, metrics."""

from __future__ import annotations

import functools
import json
import re
from unittest.mock import ANY

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import check_greedy_equal, hf_next_logprobs
from tests.conftest_server import running_server, sse_events, tiny_server_args

MAX_REQUEST_BYTES = 65536
MODEL = "tiny-model"


@pytest.fixture(scope="module")
def server(tiny_model_folder, tmp_path_factory):
    # Penalties are checked over HTTP here (skip_special_tokens via a repetition penalty, the
    # OpenAI mapping): the default overlap worker would ignore them, so it falls back to plain.
    args = tiny_server_args(tiny_model_folder) + [
        "--server.max-request-bytes", str(MAX_REQUEST_BYTES), "--model.served-model-name", MODEL,
        "--worker.overlap-penalties", "fallback",
    ]
    with running_server(args, tmp_path_factory.mktemp("server-api") / "server.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60.0) as client:
        yield client


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def generate(http, **body) -> dict:
    resp = http.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


GREEDY = {"temperature": 0, "max_new_tokens": 24}


# -- info endpoints --------------------------------------------------------------------------------


def test_info_endpoints(http):
    assert http.get("/health").status_code == 200
    assert http.head("/health").status_code == 200  # (what some load balancers probe with)
    assert http.get("/health_generate").status_code == 200
    info = http.get("/get_model_info").json()
    assert info["is_generation"] is True and info["model_path"]
    server_info = http.get("/get_server_info").json()
    assert server_info["max_total_num_tokens"] == 20000
    assert server_info["scheduler"]["check_leaks"] is True
    stats = server_info["scheduler_stats"]
    assert stats["req_slots_free"] == stats["req_slots_total"]
    assert set(server_info["process_ids"]) == {"main", "scheduler", "detokenizer"}
    models = http.get("/v1/models").json()
    assert models["data"][0]["id"] == MODEL
    assert http.get(f"/v1/models/{MODEL}").json() == {**models["data"][0], "created": ANY}
    unknown = http.get("/v1/models/gpt-4")
    assert unknown.status_code == 404 and "unknown model 'gpt-4'" in unknown.json()["error"]["message"]
    assert http.post("/flush_cache").status_code == 200


# -- native /generate ----------------------------------------------------------------------------


def test_generate_single_batch_and_ids(http, default_tokenizer):
    single = generate(http, text="The quick brown fox", sampling_params=GREEDY)
    meta = single["meta_info"]
    assert meta["completion_tokens"] == len(single["output_ids"]) > 0
    assert meta["finish_reason"]["type"] in ("length", "stop")
    ids = default_tokenizer.encode("The quick brown fox")
    assert meta["prompt_tokens"] == len(ids)

    batch = generate(http, input_ids=[ids, ids[:2]], sampling_params=GREEDY)
    assert isinstance(batch, list) and len(batch) == 2
    # Same prompt, greedy: the same tokens whether given as text or ids, alone or in a batch.
    assert batch[0]["output_ids"] == single["output_ids"]
    assert batch[0]["text"] == single["text"]

    parallel = generate(http, text="The quick brown fox", sampling_params={**GREEDY, "n": 2})
    assert [p["output_ids"] for p in parallel] == [single["output_ids"]] * 2
    # The n samples reuse the prompt's KV (the warm-up request put it in the cache).
    assert all(p["meta_info"]["cached_tokens"] > 0 for p in parallel)


def test_generate_stream_matches_non_stream(http):
    ref = generate(http, text="Streaming works like", sampling_params=GREEDY)
    with http.stream("POST", "/generate", json={"text": "Streaming works like", "stream": True,
                                                "sampling_params": GREEDY}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) > 1
    for chunk in chunks:  # cumulative and never more than the final text
        assert ref["text"].startswith(chunk["text"])
    assert chunks[-1]["text"] == ref["text"]
    assert chunks[-1]["output_ids"] == ref["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == ref["meta_info"]["finish_reason"]


def test_generate_logprobs(http, default_tokenizer):
    prompt_ids = default_tokenizer.encode("Logprobs of every prompt token")
    out = generate(http, input_ids=prompt_ids, sampling_params={**GREEDY, "max_new_tokens": 6},
                   return_logprob=True, logprob_start_len=0, top_logprobs_num=3,
                   return_text_in_logprobs=True)
    meta = out["meta_info"]
    inputs = meta["input_token_logprobs"]
    assert [entry[1] for entry in inputs] == prompt_ids
    assert inputs[0][0] is None and all(isinstance(e[0], float) for e in inputs[1:])
    outputs = meta["output_token_logprobs"]
    assert [e[1] for e in outputs] == out["output_ids"]
    assert all(e[0] <= 0 and isinstance(e[2], str) for e in outputs)
    tops = meta["output_top_logprobs"]
    assert len(tops) == len(outputs) and all(len(t) == 3 for t in tops)
    # Greedy: the chosen token is the most likely one.
    assert all(t[0][1] == e[1] for t, e in zip(tops, outputs))
    # Default logprob_start_len: no prompt logprobs, only the outputs'.
    out = generate(http, input_ids=prompt_ids, sampling_params={**GREEDY, "max_new_tokens": 3},
                   return_logprob=True)
    assert out["meta_info"]["input_token_logprobs"] == []
    assert out["meta_info"]["output_token_logprobs"][0][2] is None


def _stop_candidate(text: str) -> str:
    """A stop string from the middle of a greedy text: 3 characters starting at its 4th word."""
    start = max(len(text) // 3, 1)
    return text[start : start + 3]


def test_stop_string_trimmed_and_held_back(http):
    params = {**GREEDY, "max_new_tokens": 32, "ignore_eos": True}
    ref = generate(http, text="Stop strings are", sampling_params=params)["text"]
    stop = _stop_candidate(ref)
    expected = ref[: ref.find(stop)]
    out = generate(http, text="Stop strings are", sampling_params={**params, "stop": [stop]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == expected
    kept = generate(http, text="Stop strings are", sampling_params={**params, "stop": stop, "no_stop_trim": True})
    assert kept["text"].startswith(expected + stop)
    # Streaming never shows the stop string, not even its first characters.
    with http.stream("POST", "/generate", json={"text": "Stop strings are", "stream": True,
                                                "sampling_params": {**params, "stop": [stop]}}) as resp:
        chunks = sse_events(resp.iter_lines())[:-1]
    assert all(expected.startswith(c["text"]) for c in chunks)
    assert chunks[-1]["text"] == expected


# -- sampling parameters ----------------------------------------------------------------------------

SEEDED = {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True, "seed": 11}


def test_parallel_samples_with_a_seed(http):
    samples = [p["output_ids"] for p in generate(http, text="Seeds", sampling_params={**SEEDED, "n": 3})]
    assert len(samples) == 3 and len({tuple(s) for s in samples}) > 1  # sample j draws with seed + j
    again = [p["output_ids"] for p in generate(http, text="Seeds", sampling_params={**SEEDED, "n": 3})]
    assert again == samples
    # Sample 0 is what n = 1 gives with the same seed.
    assert generate(http, text="Seeds", sampling_params=SEEDED)["output_ids"] == samples[0]


def test_stop_token_ids_stop_and_are_trimmed(http, default_tokenizer):
    params = {**GREEDY, "max_new_tokens": 12, "ignore_eos": True}
    ref = generate(http, text="Stop tokens", sampling_params=params)["output_ids"]
    stop = ref[3]
    out = generate(http, text="Stop tokens", sampling_params={**params, "ignore_eos": False, "stop_token_ids": [stop]})
    assert out["output_ids"] == ref[: ref.index(stop) + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == default_tokenizer.decode(ref[: ref.index(stop)])


def test_skip_special_tokens_false_shows_them(http, default_tokenizer):
    """A repetition penalty below 1 boosts the prompt's tokens, so a prompt of one special token
    makes the model emit it."""
    boost = {**GREEDY, "max_new_tokens": 3, "ignore_eos": True, "repetition_penalty": 0.05}
    shown = []
    for special in default_tokenizer.all_special_ids:
        out = generate(http, input_ids=[special] * 4, sampling_params={**boost, "skip_special_tokens": False})
        if special in out["output_ids"]:
            shown.append((special, out))
    assert shown, "no special token was generated"
    for special, out in shown:
        assert default_tokenizer.decode([special]) in out["text"]
        hidden = generate(http, input_ids=[special] * 4, sampling_params=boost)
        assert hidden["output_ids"] == out["output_ids"]
        assert default_tokenizer.decode([special]) not in hidden["text"]


def test_openai_penalties_and_seed_map_to_native(oai, http):
    native = generate(http, text="Penalties", sampling_params={
        "temperature": 0, "max_new_tokens": 10, "ignore_eos": True, "frequency_penalty": 1.5,
        "presence_penalty": 0.5, "repetition_penalty": 1.4})
    resp = oai.completions.create(model=MODEL, prompt="Penalties", max_tokens=10, temperature=0,
                                  frequency_penalty=1.5, presence_penalty=0.5,
                                  extra_body={"ignore_eos": True, "repetition_penalty": 1.4})
    assert resp.choices[0].text == native["text"]
    seeded = generate(http, text="Penalties", sampling_params={**SEEDED, "seed": 5, "n": 2})
    resp = oai.completions.create(model=MODEL, prompt="Penalties", max_tokens=8, temperature=1.0, seed=5, n=2,
                                  extra_body={"ignore_eos": True})
    assert [c.text for c in resp.choices] == [s["text"] for s in seeded]


# -- OpenAI API -------------------------------------------------------------------------------------


def test_openai_completions(oai, http):
    ref = generate(http, text="Once upon a time", sampling_params={"temperature": 0, "max_new_tokens": 16,
                                                                   "ignore_eos": True})
    stop = _stop_candidate(ref["text"])
    resp = oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0, n=2,
                                  stop=[stop], logprobs=2, extra_body={"ignore_eos": True})
    assert len(resp.choices) == 2 and [c.index for c in resp.choices] == [0, 1]
    expected = ref["text"][: ref["text"].find(stop)]
    for choice in resp.choices:
        assert choice.text == expected
        assert choice.finish_reason == "stop"
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
        assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert resp.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in resp.choices)
    assert resp.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"]

    # Streaming: the deltas add up to the non-streamed text, per choice.
    texts = {0: "", 1: ""}
    usage = None
    for chunk in oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, temperature=0,
                                        n=2, stream=True, stream_options={"include_usage": True},
                                        extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            texts[c.index] += c.text
        usage = chunk.usage or usage
    assert texts == {0: ref["text"], 1: ref["text"]}
    assert usage.completion_tokens == 32

    # Echo with logprobs returns the prompt and its logprobs too.
    echo = oai.completions.create(model=MODEL, prompt="Echo me", max_tokens=2, temperature=0, echo=True, logprobs=1)
    assert echo.choices[0].text.startswith("Echo me")
    assert echo.choices[0].logprobs.token_logprobs[0] is None
    offsets = echo.choices[0].logprobs.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] < len(echo.choices[0].text)
    # Streamed, the offsets are the same (the prompt was counted twice before: each one 7 too high).
    streamed = []
    for chunk in oai.completions.create(model=MODEL, prompt="Echo me", max_tokens=2, temperature=0, echo=True,
                                        logprobs=1, stream=True):
        for c in chunk.choices:
            streamed += c.logprobs.text_offset if c.logprobs else []
    assert streamed == offsets


def test_openai_completions_max_tokens_zero_scores_the_prompt(oai):
    """`echo`, `logprobs` and `max_tokens: 0`: the prompt and its logprobs, no generated token (as
    lm-eval-harness scores a text); streamed the same."""
    prompt = "The sky is blue"
    resp = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice = resp.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 0 and len(choice.logprobs.tokens) == resp.usage.prompt_tokens
    assert choice.logprobs.token_logprobs[0] is None and all(lp <= 0 for lp in choice.logprobs.token_logprobs[1:])
    text, tokens, reasons = "", [], []
    for chunk in oai.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                        temperature=0, stream=True):
        for c in chunk.choices:
            text += c.text
            tokens += c.logprobs.tokens if c.logprobs else []
            reasons.append(c.finish_reason)
    assert text == prompt and tokens == choice.logprobs.tokens and reasons[-1] == "length"
    # Without echo: nothing at all.
    bare = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=0)
    assert bare.choices[0].text == "" and bare.usage.completion_tokens == 0


def test_openai_chat_completions(oai):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}]
    resp = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0, n=2,
                                       logprobs=True, top_logprobs=2)
    assert len(resp.choices) == 2
    first, second = resp.choices
    assert first.message.role == "assistant" and first.message.content == second.message.content
    assert len(first.logprobs.content) == resp.usage.completion_tokens // 2
    assert all(len(t.top_logprobs) == 2 for t in first.logprobs.content)
    assert resp.usage.prompt_tokens > 10  # the chat template was applied

    content, roles, finish = "", [], None
    for chunk in oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                             stream=True, logprobs=True):
        for c in chunk.choices:
            content += c.delta.content or ""
            roles.append(c.delta.role)
            finish = c.finish_reason or finish
    assert content == first.message.content
    assert roles[0] == "assistant" and finish == first.finish_reason
    # The logprobs' bytes are the tokens' own: joined, they are the content (special tokens aside).
    special = {"<|im_end|>", "<|im_start|>", "<|endoftext|>"}
    joined = b"".join(bytes(t.bytes) for t in first.logprobs.content if t.token not in special)
    assert joined.decode("utf-8", errors="replace") == first.message.content

    stop_resp = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0,
                                            stop=first.message.content[3:6] or None)
    assert stop_resp.choices[0].message.content == first.message.content[:first.message.content.find(
        first.message.content[3:6])]


def test_openai_nulls_are_defaults_and_errors_name_the_fields_sent(oai, http):
    """`temperature=None` (sent as null by the client) is the default, as in the OpenAI API; an
    error about the output length names the field the request gave (`max_completion_tokens`)."""
    messages = [{"role": "user", "content": "Say hello."}]
    resp = oai.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=2, temperature=None,
                                       top_p=None, n=None, stream=None, logprobs=None)
    assert len(resp.choices) == 1 and resp.usage.completion_tokens <= 2
    resp = http.post("/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                   "max_completion_tokens": 2, "min_tokens": 5})
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == "min_tokens: must be <= max_completion_tokens (5 > 2)"


# -- errors ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def closed_session(http):
    session_id = http.post("/open_session", json={"capacity_of_str_len": 100}).json()
    assert http.post("/close_session", json={"session_id": session_id}).status_code == 200
    return session_id


def _gen(**body):
    return ("/generate", json.dumps({"text": "hi", **body}).encode())


def _cmpl(**body):
    return ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", **body}).encode())


def _chat(**body):
    return ("/v1/chat/completions",
            json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body}).encode())


BAD_REQUESTS = {
    "malformed json": (("/generate", b'{"text": "hi",'), 400),
    "body not an object": (("/generate", b"[1, 2]"), 400),
    "no prompt": (("/generate", b"{}"), 400),
    "text and input_ids": (_gen(input_ids=[1, 2]), 400),
    "text wrong type": (("/generate", b'{"text": 5}'), 400),
    "input_ids wrong type": (("/generate", b'{"input_ids": ["a", "b"]}'), 400),
    "token id out of vocab": (("/generate", b'{"input_ids": [1000000]}'), 400),
    "unknown field": (_gen(foo=1), 400),
    "unknown sampling field": (_gen(sampling_params={"bogus": 1}), 400),
    "temperature < 0": (_gen(sampling_params={"temperature": -0.1}), 400),
    "temperature wrong type": (_gen(sampling_params={"temperature": "hot"}), 400),
    "top_p = 0": (_gen(sampling_params={"top_p": 0.0}), 400),
    "top_p > 1": (_gen(sampling_params={"top_p": 1.5}), 400),
    "max_new_tokens < 0": (_gen(sampling_params={"max_new_tokens": -1}), 400),
    "n = 0": (_gen(sampling_params={"n": 0}), 400),
    "n wrong type": (_gen(sampling_params={"n": 1.5}), 400),
    "frequency_penalty > 2": (_gen(sampling_params={"frequency_penalty": 2.5}), 400),
    "presence_penalty < -2": (_gen(sampling_params={"presence_penalty": -3}), 400),
    "presence_penalty wrong type": (_gen(sampling_params={"presence_penalty": "a lot"}), 400),
    "repetition_penalty = 0": (_gen(sampling_params={"repetition_penalty": 0}), 400),
    "repetition_penalty > 2": (_gen(sampling_params={"repetition_penalty": 2.5}), 400),
    "min_new_tokens < 0": (_gen(sampling_params={"min_new_tokens": -1}), 400),
    "min_new_tokens > max_new_tokens": (_gen(sampling_params={"min_new_tokens": 9, "max_new_tokens": 3}), 400),
    "stop_token_ids not a list": (_gen(sampling_params={"stop_token_ids": 5}), 400),
    "stop_token_ids negative": (_gen(sampling_params={"stop_token_ids": [-1]}), 400),
    "seed wrong type": (_gen(sampling_params={"seed": "lucky"}), 400),
    "skip_special_tokens not bool": (_gen(sampling_params={"skip_special_tokens": "no"}), 400),
    "spaces_between_special_tokens not bool": (_gen(sampling_params={"spaces_between_special_tokens": 0}), 400),
    "stream not bool": (_gen(stream="yes"), 400),
    "prompt over context": (("/generate", json.dumps({"input_ids": [5] * 3000}).encode()), 400),
    "unknown session": (_gen(session=["no-such-session", None]), 400),
    "closed session": ("CLOSED", 400),
    "oversized body": (("/generate", b'{"text": "' + b"a" * (MAX_REQUEST_BYTES + 10) + b'"}'), 413),
    "openai max_tokens < 0": (_cmpl(max_tokens=-1), 400),
    "openai temperature < 0": (_cmpl(temperature=-1.0), 400),
    "openai top_p = 0": (_cmpl(top_p=0.0), 400),
    "openai max_tokens wrong type": (_cmpl(max_tokens="ten"), 400),
    "openai frequency_penalty > 2": (_cmpl(frequency_penalty=5.0), 400),
    "openai presence_penalty wrong type": (_cmpl(presence_penalty="high"), 400),
    "openai repetition_penalty = 0": (_cmpl(repetition_penalty=0.0), 400),
    "openai seed wrong type": (_cmpl(seed="x"), 400),
    "openai n = 0": (_cmpl(n=0), 400),
    "openai min_tokens > max_tokens": (_cmpl(min_tokens=20, max_tokens=4), 400),
    "chat stop_token_ids wrong type": (_chat(stop_token_ids=["a"]), 400),
    "openai no model": (("/v1/completions", b'{"prompt": "hi"}'), 400),
    "openai prompt over context": (("/v1/completions", json.dumps({"model": MODEL, "prompt": [7] * 3000}).encode()), 400),
    "chat bad role": (("/v1/chat/completions", json.dumps(
        {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}).encode()), 400),
    "chat no messages": (("/v1/chat/completions", json.dumps({"model": MODEL, "messages": []}).encode()), 400),
    "chat max_tokens 0": (_chat(max_tokens=0), 400),
    "chat max_completion_tokens 0": (_chat(max_completion_tokens=0), 400),
    "chat top_p > 1": (_chat(top_p=2.0), 400),
    "chat malformed json": (("/v1/chat/completions", b"{not json"), 400),
    "bad regex": (_gen(sampling_params={"regex": "(abc"}), 400),
    "bad json_schema": (_gen(sampling_params={"json_schema": '{"type": "objectx"}'}), 400),
    "openai bad regex": (_cmpl(regex="[z-a]"), 400),
    "chat bad response_format schema": (_chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}), 400),
    "chat response_format without schema": (_chat(response_format={"type": "json_schema"}), 400),
    "chat response_format and regex": (_chat(response_format={"type": "json_object"}, regex="a"), 400),
    "close unknown session": (("/close_session", b'{"session_id": "nope"}'), 400),
    "close_session without a body": (("/close_session", b""), 400),
    "chat response_format schema not an object": (_chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": "notadict"}}), 400),
    "json_schema nested too deep": (_gen(sampling_params={"json_schema": json.dumps(
        functools.reduce(lambda inner, _: {"type": "array", "items": inner}, range(600), {"type": "integer"}))}), 400),
    "regex repetition too large": (_gen(sampling_params={"regex": "g{10000000}"}), 400),
    "open_session wrong type": (("/open_session", b'{"capacity_of_str_len": "big"}'), 400),
}
# input_embeds (the tiny model's hidden size is 64), and the embedding endpoints on a generation model.
BAD_REQUESTS.update({
    "input_embeds wrong hidden size": (("/generate", json.dumps({"input_embeds": [[0.5] * 63]}).encode()), 400),
    "input_embeds ragged": (("/generate", json.dumps({"input_embeds": [[0.5] * 64, [0.5]]}).encode()), 400),
    "input_embeds not numbers": (("/generate", json.dumps({"input_embeds": [["x"] * 64]}).encode()), 400),
    "input_embeds empty": (("/generate", b'{"input_embeds": []}'), 400),
    "input_embeds and text": (_gen(input_embeds=[[0.5] * 64]), 400),
    "input_embeds prompt logprobs": (("/generate", json.dumps(
        {"input_embeds": [[0.5] * 64] * 2, "return_logprob": True, "logprob_start_len": 0}).encode()), 400),
    "encode on a generation model": (("/encode", b'{"text": "hi"}'), 400),
    "embeddings on a generation model": (("/v1/embeddings", json.dumps({"model": MODEL, "input": "hi"}).encode()), 400),
})


@pytest.mark.parametrize("case", list(BAD_REQUESTS), ids=list(BAD_REQUESTS))
def test_bad_input_is_4xx_json(http, closed_session, case):
    request, status = BAD_REQUESTS[case]
    if request == "CLOSED":
        request = _gen(session=[closed_session, None])
    path, body = request
    resp = http.post(path, content=body, headers={"content-type": "application/json"})
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    # The server keeps serving.
    assert generate(http, text="still alive", sampling_params={"max_new_tokens": 2})["meta_info"]


def test_embeddings_on_a_generation_model_name_the_model_kind(http):
    """With `dimensions` too: the answer is that this is no embedding model, not a size to retry with."""
    for extra in ({}, {"dimensions": 5}):
        resp = http.post("/v1/embeddings", json={"model": MODEL, "input": "hi", **extra})
        assert resp.status_code == 400 and "not appear to be an embedding model" in resp.text, resp.text


def test_bad_streamed_request_is_4xx_before_the_stream(http):
    resp = http.post("/generate", json={"text": "hi", "stream": True, "session": ["no-such-session", None]})
    assert resp.status_code == 400 and "session" in resp.json()["error"]["message"]


# -- metrics --------------------------------------------------------------------------------------


def _samples(http) -> dict[str, float]:
    text = http.get("/metrics").text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + (f"{{{sample.labels.get('finish_reason')}}}" if "finish_reason" in sample.labels else "")
            values[key] = values.get(key, 0.0) + sample.value
    return values


def test_metrics_parse_and_move(http):
    before = _samples(http)
    assert "batchyard:num_running_reqs" in before and "batchyard:token_usage" in before
    generate(http, text="count me", sampling_params={"max_new_tokens": 5, "ignore_eos": True})
    with http.stream("POST", "/generate", json={"text": "stream me", "stream": True,
                                                "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}) as r:
        list(r.iter_lines())
    after = _samples(http)

    def moved(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert moved("batchyard:generation_tokens_total") == 10
    assert moved("batchyard:prompt_tokens_total") > 0
    assert moved("batchyard:num_requests_total{length}") == 2
    assert moved("batchyard:e2e_request_latency_seconds_count") == 2
    assert moved("batchyard:time_to_first_token_seconds_count") == 1
    assert moved("batchyard:inter_token_latency_seconds_count") == 4
    assert after["batchyard:kv_available_tokens"] + after["batchyard:kv_evictable_tokens"] == 20000


def test_structured_output_over_http(http, oai):
    """regex on /generate and /v1/completions, response_format on chat (tiny random weights)."""
    regex = r"(yes|no), [0-9]{2,4}"
    out = generate(http, text="Reply:", sampling_params={"temperature": 0, "max_new_tokens": 32, "regex": regex})
    assert re.fullmatch(regex, out["text"]), out["text"]
    cmpl = oai.completions.create(model=MODEL, prompt="Reply:", max_tokens=32, temperature=0,
                                  extra_body={"regex": regex})
    assert re.fullmatch(regex, cmpl.choices[0].text), cmpl.choices[0].text
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    chat = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Answer in JSON."}], max_tokens=48, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}},
    )
    choice = chat.choices[0]
    if choice.finish_reason == "stop":  # random weights may spend the budget on whitespace
        assert isinstance(json.loads(choice.message.content)["ok"], bool)
    else:
        assert choice.message.content.lstrip().startswith("{")


# -- input_embeds ---------------------------------------------------------------------------------


def test_input_embeds_equals_the_same_prompt_as_ids(http, hf_tiny):
    prompts = [list(range(300, 306)), list(range(40, 52))]
    table = hf_tiny.model.embed_tokens.weight.detach()
    params = {**GREEDY, "max_new_tokens": 8}
    by_ids = generate(http, input_ids=prompts, sampling_params=params)
    by_embeds = generate(http, input_embeds=[table[p].tolist() for p in prompts], sampling_params=params)
    for prompt, ours, ref in zip(prompts, by_embeds, by_ids):
        check_greedy_equal(ours["output_ids"], ref["output_ids"],
                           lambda prefix, prompt=prompt: hf_next_logprobs(hf_tiny, prompt + prefix))
        assert ours["text"] and ours["meta_info"]["prompt_tokens"] == len(prompt)
        assert ours["meta_info"]["cached_tokens"] == 0
    # A single prompt, streamed.
    streamed = http.post("/generate", json={"input_embeds": table[prompts[1]].tolist(), "stream": True,
                                            "sampling_params": params})
    events = sse_events(streamed.text.splitlines())
    assert events[-1] == "[DONE]" and events[-2]["output_ids"] == by_embeds[1]["output_ids"]
