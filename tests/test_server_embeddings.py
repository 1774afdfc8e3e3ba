"""The embedding endpoints on a real server subprocess serving the tiny random `LlamaModel`:
/encode and /v1/embeddings against transformers, bad input, generation refused, nothing leaked."""

from __future__ import annotations

import base64
import json
import struct

import httpx
import openai
import pytest
import torch

from tests.conftest import assert_same_direction, hf_embedding
from tests.conftest_server import running_server, tiny_server_args

MODEL = "tiny-embedder"
PROMPTS = [list(range(10, 15)), list(range(200, 237)), [42]]


@pytest.fixture(scope="module")
def server(tiny_embedding_folder, tmp_path_factory):
    args = tiny_server_args(tiny_embedding_folder) + ["--model.served-model-name", MODEL]
    with running_server(args, tmp_path_factory.mktemp("server-embeddings") / "server.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60.0) as client:
        yield client


def post_ok(http, path: str, body) -> dict | list:
    resp = http.post(path, json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_info_endpoints_report_an_embedding_model(http):
    assert http.get("/get_model_info").json()["is_generation"] is False
    assert http.get("/health_generate").status_code == 200


def test_encode_matches_transformers(http, hf_embedder, default_tokenizer):
    single = post_ok(http, "/encode", {"text": "The quick brown fox", "rid": "enc-1"})
    ids = default_tokenizer.encode("The quick brown fox")
    assert_same_direction(single["embedding"], hf_embedding(hf_embedder, ids))
    assert single["meta_info"]["id"] == "enc-1" and single["meta_info"]["prompt_tokens"] == len(ids)

    batch = post_ok(http, "/encode", {"input_ids": PROMPTS})
    assert isinstance(batch, list) and len(batch) == len(PROMPTS)
    for prompt, result in zip(PROMPTS, batch):
        assert_same_direction(result["embedding"], hf_embedding(hf_embedder, prompt))


def test_openai_embeddings_float_and_base64(server, http, hf_embedder, default_tokenizer):
    resp = post_ok(http, "/v1/embeddings", {"model": MODEL, "input": PROMPTS})
    assert resp["object"] == "list" and resp["model"] == MODEL
    assert [d["index"] for d in resp["data"]] == list(range(len(PROMPTS)))
    for prompt, item in zip(PROMPTS, resp["data"]):
        assert item["object"] == "embedding"
        assert_same_direction(item["embedding"], hf_embedding(hf_embedder, prompt))
    assert resp["usage"] == {"prompt_tokens": sum(map(len, PROMPTS)), "total_tokens": sum(map(len, PROMPTS))}

    raw = post_ok(http, "/v1/embeddings", {"model": MODEL, "input": PROMPTS[1], "encoding_format": "base64"})
    data = base64.b64decode(raw["data"][0]["embedding"])
    decoded = list(struct.unpack(f"<{len(data) // 4}f", data))
    assert decoded == pytest.approx(resp["data"][1]["embedding"], abs=1e-6)

    # The official client (it asks for base64 and decodes it), strings and a list of strings.
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    texts = ["Hello there", "General Kenobi"]
    out = client.embeddings.create(model=MODEL, input=texts)
    for text, item in zip(texts, out.data):
        assert_same_direction(item.embedding, hf_embedding(hf_embedder, default_tokenizer.encode(text)))
    assert out.usage.prompt_tokens == sum(len(default_tokenizer.encode(t)) for t in texts)


def _emb(**body):
    return ("/v1/embeddings", {"model": MODEL, "input": "hi", **body})


BAD_REQUESTS = {
    "encode no prompt": ("/encode", {}),
    "encode text and ids": ("/encode", {"text": "hi", "input_ids": [1]}),
    "encode empty ids": ("/encode", {"input_ids": []}),
    "encode id out of vocab": ("/encode", {"input_ids": [10**9]}),
    "encode over context": ("/encode", {"input_ids": [5] * 3000}),
    "encode unknown field": ("/encode", {"text": "hi", "stream": True}),
    "encode input_embeds": ("/encode", {"input_embeds": [[0.0] * 64]}),
    "encode duplicate rids": ("/encode", {"input_ids": [[1], [2]], "rid": ["a", "a"]}),
    "embeddings no model": ("/v1/embeddings", {"input": "hi"}),
    "embeddings empty input": _emb(input=[]),
    "embeddings input wrong type": _emb(input=3.5),
    "embeddings bad encoding": _emb(encoding_format="int8"),
    "embeddings wrong dimensions": _emb(dimensions=8),
    "generate on an embedding model": ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2}}),
    "stream on an embedding model": ("/generate", {"text": "hi", "stream": True}),
    "completions on an embedding model": ("/v1/completions", {"model": MODEL, "prompt": "hi"}),
    "chat on an embedding model": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS), ids=list(BAD_REQUESTS))
def test_bad_input_is_400_and_the_server_still_serves(http, case):
    path, body = BAD_REQUESTS[case]
    resp = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["message"]
    assert len(post_ok(http, "/encode", {"input_ids": [1, 2, 3]})["embedding"]) == 64


def test_nothing_leaked(http):
    post_ok(http, "/encode", {"input_ids": [list(range(n, n + 20)) for n in range(0, 200, 20)]})
    stats = http.get("/get_server_info").json()["scheduler_stats"]
    assert stats["num_running_reqs"] == 0 and stats["num_queue_reqs"] == 0
    assert stats["kv_available"] + stats["kv_evictable"] == stats["max_total_num_tokens"]
    assert stats["kv_evictable"] > 0  # the prompts are in the prefix cache
    assert stats["req_slots_free"] == stats["req_slots_total"]


def test_generate_refusal_names_the_endpoints(http):
    resp = http.post("/generate", json={"input_ids": [1, 2]})
    assert "/v1/embeddings" in resp.json()["error"]["message"]
    assert torch.tensor(post_ok(http, "/encode", {"input_ids": [1, 2]})["embedding"]).norm() == pytest.approx(1.0)
