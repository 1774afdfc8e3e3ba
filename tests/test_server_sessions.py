"""Sessions and client disconnects on a real server subprocess (tiny random llama)."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.conftest_server import running_server, sse_events, tiny_server_args

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_model_folder, tmp_path_factory):
    with running_server(tiny_server_args(tiny_model_folder),
                        tmp_path_factory.mktemp("server-sessions") / "server.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60.0) as client:
        yield client


def generate(http, **body) -> dict:
    resp = http.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


TURNS = ["You are a tiny model.", " The user says hello.", " Then asks a question.", " And says goodbye."]


def test_session_continuation_equals_full_history(http, default_tokenizer):
    segments = [default_tokenizer.encode(t) for t in TURNS]
    session_id = http.post("/open_session", json={"capacity_of_str_len": 1000}).json()
    assert isinstance(session_id, str) and session_id

    session_outputs, prev_rid = [], None
    for k, seg in enumerate(segments):
        rid = f"turn-{k}-{session_id}"
        out = generate(http, input_ids=seg, rid=rid, session=[session_id, prev_rid], sampling_params=GREEDY)
        if k > 0:
            assert out["meta_info"]["cached_tokens"] > 0, out["meta_info"]
        session_outputs.append(out["output_ids"])
        prev_rid = rid

    # The same conversation as plain requests with the concatenated ids, computed from scratch.
    assert http.post("/flush_cache").status_code == 200
    history: list[int] = []
    for k, seg in enumerate(segments):
        prompt = history + seg
        out = generate(http, input_ids=prompt, sampling_params=GREEDY)
        assert out["output_ids"] == session_outputs[k], f"turn {k} differs"
        history = prompt + out["output_ids"]
    assert out["meta_info"]["prompt_tokens"] == len(history) - len(out["output_ids"])

    # Branching: continuing from turn 0 again drops turns 1-3 from the history.
    branch = generate(http, input_ids=segments[1], rid="branch", session=[session_id, f"turn-0-{session_id}"],
                      sampling_params=GREEDY)
    assert branch["output_ids"] == session_outputs[1]
    resp = http.post("/generate", json={"input_ids": segments[2], "session": [session_id, f"turn-2-{session_id}"]})
    assert resp.status_code == 400 and "does not exist" in resp.json()["error"]["message"]

    assert http.post("/close_session", json={"session_id": session_id}).status_code == 200
    resp = http.post("/generate", json={"input_ids": segments[0], "session": [session_id, None]})
    assert resp.status_code == 400
    assert http.post("/close_session", json={"session_id": session_id}).status_code == 400


def test_session_streaming(http, default_tokenizer):
    session_id = http.post("/open_session", json={"capacity_of_str_len": 10}).json()
    first = generate(http, text="Hello", rid="s-first", session=[session_id, None], sampling_params=GREEDY)
    with http.stream("POST", "/generate", json={"text": " again", "stream": True, "session": [session_id, "s-first"],
                                                "sampling_params": GREEDY}) as resp:
        assert resp.status_code == 200
        events = sse_events(resp.iter_lines())
    final = events[-2]
    assert final["meta_info"]["cached_tokens"] > 0
    assert final["meta_info"]["prompt_tokens"] == first["meta_info"]["prompt_tokens"] + 12 + len(
        default_tokenizer.encode(" again"))
    http.post("/close_session", json={"session_id": session_id})


async def _stream(client: httpx.AsyncClient, k: int, disconnect: bool) -> int:
    body = {"text": f"request number {k}", "stream": True,
            "sampling_params": {"max_new_tokens": 64, "ignore_eos": True, "temperature": 1.0}}
    chunks = 0
    async with client.stream("POST", "/generate", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                chunks += 1
                if disconnect and chunks >= 3:
                    break  # leaving the block closes the connection mid-stream
    return chunks


def _aborted(http) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("batchyard:num_requests_total") and 'finish_reason="abort"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _pools(http) -> dict:
    return http.get("/get_server_info").json()


def test_disconnects_free_every_slot(http, server):
    async def main():
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, timeout=120.0, limits=limits) as client:
            return await asyncio.gather(*(_stream(client, k, disconnect=k % 2 == 0) for k in range(50)))

    aborted_before = _aborted(http)
    chunks = asyncio.run(main())
    assert all(c == 3 for c in chunks[::2])
    assert all(c > 3 for c in chunks[1::2])

    deadline = time.monotonic() + 20
    while True:
        info = _pools(http)
        stats = info["scheduler_stats"]
        idle = stats["num_running_reqs"] == 0 and stats["num_queue_reqs"] == 0 and info["num_inflight_requests"] == 0
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert idle, info
    assert stats["kv_available"] + stats["kv_evictable"] == stats["max_total_num_tokens"], stats
    assert stats["req_slots_free"] == stats["req_slots_total"], stats
    # The disconnected requests were aborted, not run to the end.
    assert _aborted(http) - aborted_before == 25
    # The idle leak check (scheduler.check_leaks) runs within seconds; the server must survive it.
    time.sleep(2.5)
    assert http.get("/health").status_code == 200
