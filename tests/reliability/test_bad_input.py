"""Item 1 and 2: bad input on every endpoint gets a 4xx with the documented JSON error body
within a second, and after each probe the server is back to the idle state, seen from outside
(no request anywhere, every KV and request slot free or cached), and still serves. Huge numbers,
deep nesting, lone surrogates and FastAPI's own 404/405 bodies rely on issue 19's request limits.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.reliability.conftest import error_body_ok, wait_idle

MODEL = "tiny-model"
JSON = "application/json"
# The answer to bad input comes within this (issue 18); the 50 MB body has to be sent first.
ANSWER_WITHIN_S = 1.0
BIG_BODY_WITHIN_S = 10.0
BIG = 50 * 2**20
FAR_OVER_CONTEXT = "hello " * 5000  # the tiny model's context is 2048 tokens

JSON_ENDPOINTS = ["/generate", "/encode", "/v1/completions", "/v1/chat/completions", "/v1/embeddings",
                  "/open_session", "/close_session", "/update_weights_from_disk"]


def case(path, body, status=400, content_type=JSON, method="POST", marks=(), name=None):
    if isinstance(body, (dict, list)) or body is None:
        body = json.dumps(body).encode()
    elif isinstance(body, str):
        body = body.encode()
    return pytest.param(method, path, body, content_type, status, marks=marks,
                        id=f"{path} {name}" if name else None)


def gen(name, status=400, marks=(), **fields):
    return case("/generate", {"text": "hi", **fields}, status, marks=marks, name=name)


def sp(name, status=400, marks=(), **params):
    return case("/generate", {"text": "hi", "sampling_params": params}, status, marks=marks, name=f"sampling {name}")


def cmpl(name, status=400, marks=(), **fields):
    return case("/v1/completions", {"model": MODEL, "prompt": "hi", **fields}, status, marks=marks, name=name)


def chat(name, status=400, marks=(), **fields):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}
    return case("/v1/chat/completions", body, status, marks=marks, name=name)


def emb(name, status=400, marks=(), **fields):
    return case("/v1/embeddings", {"model": MODEL, "input": "hi", **fields}, status, marks=marks, name=name)


# The same malformed bodies on every endpoint that reads JSON.
GENERIC = []
for path in JSON_ENDPOINTS:
    GENERIC += [
        case(path, b'{"text": "hi",', name="malformed JSON"),
        case(path, b'{"text": "\xff\xfe hi"}', name="non-UTF-8 bytes"),
        case(path, b"text=hi&stream=true", content_type="application/x-www-form-urlencoded", name="form body"),
        case(path, b"[1, 2, 3]", name="array body"),
        case(path, b'"just a string"', name="string body"),
        case(path, b"null", name="null body"),
        case(path, b"x" * BIG, status=413, name="50 MB body"),
        case(path, b"[" * 100_000 + b"]" * 100_000, name="deep nesting"),
    ]
    if path != "/open_session":  # an empty body opens a session with the defaults
        GENERIC.append(case(path, b"", name="empty body"))

SPECIFIC = [
    # /generate: wrong types, missing fields, bad numbers, prompts, grammars, sessions.
    case("/generate", {}, name="no prompt"),
    case("/generate", {"sampling_params": {"max_new_tokens": 2}}, name="sampling only"),
    gen("text wrong type", text=5),
    gen("text and input_ids", input_ids=[1, 2]),
    case("/generate", {"input_ids": ["a"]}, name="input_ids strings"),
    case("/generate", {"input_ids": [-1]}, name="negative token id"),
    case("/generate", {"input_ids": [10**9]}, name="token id over vocab"),
    case("/generate", {"input_ids": []}, name="empty input_ids"),
    gen("empty text", text=""),
    gen("prompt far over the context", text=FAR_OVER_CONTEXT),
    gen("unknown field", bogus=1),
    gen("stream not bool", stream="yes"),
    gen("sampling_params not object", sampling_params=[1]),
    gen("rid wrong type", rid=5),
    gen("return_logprob wrong type", return_logprob="x"),
    gen("logprob_start_len wrong type", return_logprob=True, logprob_start_len="x"),
    gen("top_logprobs_num negative", return_logprob=True, top_logprobs_num=-1),
    gen("top_logprobs_num huge", return_logprob=True, top_logprobs_num=10**12),
    gen("unknown session", session=["no-such-session", None]),
    gen("session wrong type", session=5),
    gen("image on a text model", image_data="data:image/png;base64,AAAA"),
    gen("unknown lora", lora_path="nope"),
    gen("lone surrogate", text="\ud800"),
    sp("unknown field", bogus=1),
    sp("temperature negative", temperature=-1),
    sp("temperature string", temperature="hot"),
    sp("temperature huge", temperature=1e308 * 10),  # json.dumps writes Infinity
    sp("top_p zero", top_p=0),
    sp("top_p over one", top_p=1.5),
    sp("top_p NaN", top_p=float("nan")),
    sp("top_k zero", top_k=0),
    sp("min_p over one", min_p=2),
    sp("max_new_tokens negative", max_new_tokens=-1),
    sp("max_new_tokens float", max_new_tokens=1.5),
    sp("max_new_tokens huge", max_new_tokens=10**30),
    sp("n zero", n=0),
    sp("n negative", n=-3),
    sp("n huge", n=10**9),
    sp("frequency_penalty over two", frequency_penalty=3),
    sp("presence_penalty NaN", presence_penalty=float("nan")),
    sp("repetition_penalty zero", repetition_penalty=0),
    sp("min_new_tokens over max", min_new_tokens=5, max_new_tokens=2),
    sp("stop wrong type", stop=5),
    sp("stop_token_ids negative", stop_token_ids=[-1]),
    sp("bad regex", regex="(unclosed"),
    sp("bad json_schema", json_schema='{"type": "objectx"}'),
    sp("json_schema not JSON", json_schema="{nope"),
    sp("regex and json_schema", regex="a", json_schema='{"type": "object"}'),
    # /encode on a generation model, and its own bad bodies.
    case("/encode", {"text": "hi"}, name="generation model"),
    case("/encode", {}, name="no prompt"),
    # /v1/completions
    case("/v1/completions", {"prompt": "hi"}, name="no model"),
    cmpl("unknown model", status=404, model="gpt-17"),
    cmpl("model wrong type", model=5),
    case("/v1/completions", {"model": MODEL}, name="no prompt"),
    cmpl("empty prompt", prompt=""),
    cmpl("empty prompt list", prompt=[]),
    cmpl("prompt far over the context", prompt=FAR_OVER_CONTEXT),
    cmpl("max_tokens negative", max_tokens=-1),
    cmpl("max_tokens string", max_tokens="ten"),
    cmpl("temperature NaN", temperature=float("nan")),
    cmpl("n zero", n=0),
    cmpl("logprobs negative", logprobs=-1),
    cmpl("logprobs huge", logprobs=10**12),
    cmpl("suffix", suffix="tail"),
    cmpl("seed past 64 bits", seed=2**70),
    cmpl("stream_options without stream", stream_options={"include_usage": True}),
    chat("stream_options with stream false", stream=False, stream_options={"include_usage": True}),
    chat("seed below -2**63", seed=-(2**70)),
    cmpl("bad regex", regex="[z-a]"),
    # /v1/chat/completions
    chat("unknown model", status=404, model="gpt-17"),
    case("/v1/chat/completions", {"model": MODEL}, name="no messages"),
    chat("empty messages", messages=[]),
    chat("bad role", messages=[{"role": "wizard", "content": "hi"}]),
    chat("content wrong type", messages=[{"role": "user", "content": 5}]),
    chat("image part", messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
    chat("messages far over the context", messages=[{"role": "user", "content": FAR_OVER_CONTEXT}]),
    chat("top_p over one", top_p=2),
    chat("n zero", n=0),
    chat("top_logprobs without logprobs", top_logprobs=3, logprobs="yes"),
    chat("top_logprobs with logprobs false", top_logprobs=3, logprobs=False),
    chat("top_logprobs with logprobs left out", top_logprobs=0),
    chat("response_format without schema", response_format={"type": "json_schema"}),
    chat("bad response_format schema", response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}),
    chat("unknown response_format", response_format={"type": "yaml"}),
    # /v1/embeddings on a generation model, and its own bad bodies.
    emb("generation model"),
    emb("unknown model", status=404, model="gpt-17"),
    emb("empty input", input=""),
    emb("input wrong type", input=5),
    emb("bad encoding_format", encoding_format="hex"),
    # Sessions.
    case("/open_session", {"capacity_of_str_len": "big"}, name="capacity wrong type"),
    case("/open_session", {"capacity_of_str_len": -1}, name="capacity negative"),
    case("/open_session", {"bogus": 1}, name="unknown field"),
    case("/close_session", {"session_id": "nope"}, name="unknown session"),
    case("/close_session", {"session_id": 5}, name="session_id wrong type"),
    case("/close_session", {}, name="no session_id"),
    # Weights and profiling.
    case("/update_weights_from_disk", {"model_path": "/no/such/folder"}, name="missing folder"),
    case("/update_weights_from_disk", {"model_path": ""}, name="empty path"),
    case("/update_weights_from_disk", {"model_path": "/tmp", "load_format": "pickle"}, name="bad load_format"),
    case("/update_weights_from_disk", {}, name="no model_path"),
    case("/update_weights", {"model_path": 5}, name="model_path wrong type"),
    case("/stop_profile", b"", name="stop without start"),
    # FastAPI's own answers: an unknown path, a wrong method.
    case("/no-such-endpoint", {}, status=404, name="unknown path"),
    case("/generate", b"", status=405, method="GET", name="wrong method"),
    case("/v1/completions", b"", status=405, method="GET", name="wrong method"),
]

CASES = GENERIC + SPECIFIC


def test_the_table_is_big_enough():
    assert len(CASES) >= 100


@pytest.mark.parametrize("method,path,body,content_type,status", CASES)
def test_bad_input_is_a_4xx_json_error_and_leaves_the_server_idle(guarded, method, path, body, content_type, status):
    start = time.monotonic()
    resp = guarded.request(method, path, content=body, headers={"content-type": content_type})
    took = time.monotonic() - start
    assert resp.status_code == status, resp.text[:500]
    error_body_ok(resp)
    assert took < (BIG_BODY_WITHIN_S if len(body) >= BIG else ANSWER_WITHIN_S), f"answered in {took:.2f} s"
    wait_idle(guarded)
    assert guarded.get("/health").status_code == 200
    ok = guarded.post("/generate", json={"text": "still serving", "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200, ok.text
