"""Data-parallel replicas on a real server subprocess (tiny random llama): routing, equality with
one replica, no leaks, core placement, DP_RANK, and the life cycle of the extra processes."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from framework.server.placement import plan_cores
from framework.server.scheduler_process import dp_rank_from_env
from tests.conftest import assert_same_greedy, hf_greedy
from tests.conftest_server import ROOT, pid_alive, running_server, tiny_server_args

NUM_TOKENS = 8
GREEDY = {"temperature": 0, "max_new_tokens": NUM_TOKENS, "ignore_eos": True}
REPLICAS = ("scheduler-dp0", "scheduler-dp1")


@pytest.fixture(scope="module")
def server(tiny_model_folder, tmp_path_factory):
    args = tiny_server_args(tiny_model_folder) + [
        "--parallel.dp-size", "2", "--parallel.load-balance-method", "shortest_queue",
    ]
    with running_server(args, tmp_path_factory.mktemp("server-dp") / "server.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60.0) as client:
        yield client


def replica_stats(http) -> list[dict]:
    stats = http.get("/get_server_info").json()["scheduler_stats"]
    assert [r["dp_rank"] for r in stats["replicas"]] == [0, 1]
    return stats["replicas"]


def wait_idle(http, timeout: float = 30.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        replicas = replica_stats(http)
        if all(r["num_running_reqs"] == 0 and r["num_queue_reqs"] == 0 for r in replicas):
            return replicas
        assert time.monotonic() < deadline, f"replicas still busy after {timeout} s: {replicas}"
        time.sleep(0.2)


def assert_no_leak(replicas: list[dict]) -> None:
    for r in replicas:
        assert r["kv_available"] + r["kv_evictable"] == r["max_total_num_tokens"], r
        assert r["req_slots_free"] == r["req_slots_total"], r


def received(replicas: list[dict]) -> list[int]:
    return [r["num_received_reqs"] for r in replicas]


def test_burst_is_shared_and_equals_one_replica(server, http, default_tokenizer, make_engine, hf_tiny):
    prompts = [default_tokenizer.encode(f"Request {k}: tell me about the number {k * 7}.") for k in range(32)]
    before = received(replica_stats(http))

    async def main():
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.url, timeout=120.0, limits=limits) as client:
            resps = await asyncio.gather(*(
                client.post("/generate", json={"input_ids": p, "sampling_params": GREEDY}) for p in prompts
            ))
        assert all(r.status_code == 200 for r in resps), [r.text for r in resps if r.status_code != 200]
        return [r.json()["output_ids"] for r in resps]

    served = asyncio.run(main())
    replicas = wait_idle(http)
    counts = [after - b for after, b in zip(received(replicas), before)]
    assert sum(counts) == 32 and min(counts) > 0, counts
    assert_no_leak(replicas)

    one_replica = [out["output_ids"] for out in make_engine().generate(input_ids=prompts, sampling_params=GREEDY)]
    ties = assert_same_greedy({"dp_size=2": served}, prompts, one_replica, hf_tiny)
    # And both equal the reference model, which the one-replica engine is checked against elsewhere.
    assert_same_greedy({"dp_size=1": one_replica}, prompts[:4], [hf_greedy(hf_tiny, p, NUM_TOKENS) for p in prompts[:4]],
                       hf_tiny)
    print(f"near-ties met: {ties}")


def test_shortest_queue_skips_the_busy_replica_and_abort_reaches_it(server, http):
    wait_idle(http)
    max_new = 2000
    long_body = {"input_ids": [1, 2, 3], "stream": True,
                 "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True, "temperature": 0}}
    with httpx.Client(base_url=server.url, timeout=60.0) as streaming:
        with streaming.stream("POST", "/generate", json=long_body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()  # kept: a dropped line iterator closes the stream
            next(line for line in lines if line.startswith("data: "))
            busy = [r["num_running_reqs"] + r["num_queue_reqs"] for r in replica_stats(http)]
            assert sorted(busy) == [0, 1], busy
            idle, loaded = busy.index(0), busy.index(1)
            before = received(replica_stats(http))
            for k in range(4):
                out = http.post("/generate", json={"text": f"short {k}", "sampling_params": GREEDY})
                assert out.status_code == 200, out.text
                # The reply can reach us before the controller has read the replica's finish report
                # (it travels replica -> controller, the output replica -> detokenizer -> us). A stats
                # round trip comes back on the replica's same socket after that report, so once it is
                # here the router has counted the short request finished (else the next one could
                # see a tie with the loaded replica: a race this test hit ~1 run in 5).
                replica_stats(http)
            snapshot = replica_stats(http)
            counts = [a - b for a, b in zip(received(snapshot), before)]
            # Each short request finished before the next was sent, so the idle replica stayed the
            # shortest queue every time (round robin would have alternated).
            assert counts[idle] == 4 and counts[loaded] == 0, counts
        # Leaving the block disconnected the stream; the abort must reach the loaded replica.
    # The long request is the loaded replica's only one: its used KV is its length so far.
    remaining = max_new - (snapshot[loaded]["num_used_tokens"] - 3)
    assert remaining > 400, "the long request was nearly done before the disconnect; nothing to check"
    replicas = wait_idle(http)
    grown = replicas[loaded]["forward_ct"] - snapshot[loaded]["forward_ct"]
    assert grown < remaining / 2, f"{grown} more steps of {remaining} left: the abort did not reach the replica"
    assert_no_leak(replicas)


def test_sessions_stick_to_their_replica(http, default_tokenizer):
    sessions = [http.post("/open_session", json={"capacity_of_str_len": 100}).json() for _ in range(2)]
    assert sorted(r["num_sessions"] for r in replica_stats(http)) == [1, 1]  # one on each replica
    for session_id in sessions:
        prev = None
        for turn in range(3):
            rid = f"{session_id}-{turn}"
            resp = http.post("/generate", json={"input_ids": default_tokenizer.encode(f" turn {turn}"), "rid": rid,
                                                "session": [session_id, prev], "sampling_params": GREEDY})
            assert resp.status_code == 200, resp.text
            if turn > 0:  # the history lives on the replica that opened the session
                assert resp.json()["meta_info"]["cached_tokens"] > 0
            prev = rid
    for session_id in sessions:
        assert http.post("/close_session", json={"session_id": session_id}).status_code == 200
        assert http.post("/close_session", json={"session_id": session_id}).status_code == 400
    assert [r["num_sessions"] for r in replica_stats(http)] == [0, 0]


def test_flush_reaches_every_replica(http):
    wait_idle(http)
    assert http.post("/flush_cache").status_code == 200
    assert all(r["kv_evictable"] == 0 for r in replica_stats(http))


def test_replicas_are_pinned_to_their_cores(http):
    pids = http.get("/get_server_info").json()["process_ids"]
    assert set(pids) >= {"main", "dp_controller", "detokenizer", *REPLICAS}
    plan = plan_cores(sorted(os.sched_getaffinity(0)), 2)
    for dp_rank, name in enumerate(REPLICAS):
        assert sorted(os.sched_getaffinity(pids[name])) == plan[dp_rank], name


def test_killed_replica_stops_the_server_nonzero(server, http):
    """Last in this module: it ends the module's server."""
    pids = http.get("/get_server_info").json()["process_ids"]
    os.kill(pids["scheduler-dp1"], signal.SIGKILL)
    server.proc.wait(15)
    assert server.proc.returncode != 0
    assert "scheduler-dp1 process exited unexpectedly" in server.log()
    time.sleep(0.2)
    for name in ("dp_controller", "detokenizer", "scheduler-dp0"):
        assert not pid_alive(pids[name]), f"{name} left behind"


def test_dp_rank_env_makes_the_server_that_replica(tiny_model_folder, tmp_path):
    args = tiny_server_args(tiny_model_folder) + ["--parallel.dp-size", "2"]
    with running_server(args, tmp_path / "server.log", env={"DP_RANK": "1"}) as srv:
        info = httpx.get(srv.url + "/get_server_info", timeout=30).json()
        pids = info["process_ids"]
        assert "dp_controller" not in pids  # one replica; an outside router runs the other
        assert info["scheduler_stats"]["dp_rank"] == 1
        assert sorted(os.sched_getaffinity(pids["scheduler"])) == plan_cores(sorted(os.sched_getaffinity(0)), 2)[1]
        out = httpx.post(srv.url + "/generate", json={"text": "hi", "sampling_params": GREEDY}, timeout=30)
        assert out.status_code == 200 and len(out.json()["output_ids"]) == NUM_TOKENS
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(15)
        assert srv.proc.returncode == 0
        assert "scheduler DP1" in srv.log()  # the reference's log prefix
        time.sleep(0.2)
        assert not pid_alive(pids["scheduler"]) and not pid_alive(pids["detokenizer"])


def test_dp_rank_outside_the_replicas_fails_with_a_clear_message():
    proc = subprocess.run(
        [sys.executable, "-m", "framework.cli", "serve", "--parallel.dp-size", "2", "--server.port", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=dict(os.environ, DP_RANK="2"),
    )
    assert proc.returncode != 0
    assert "DP_RANK=2 names no replica" in proc.stderr


@pytest.mark.parametrize("value, message", [("x", "must be an integer"), ("-1", "must be >= 0")])
def test_bad_dp_rank_values(monkeypatch, value, message):
    monkeypatch.setenv("DP_RANK", value)
    with pytest.raises(ValueError, match=message):
        dp_rank_from_env()


def test_dp_rank_is_read_only_when_set(monkeypatch):
    monkeypatch.delenv("DP_RANK", raising=False)
    assert dp_rank_from_env() is None
    monkeypatch.setenv("DP_RANK", "3")
    assert dp_rank_from_env() == 3
