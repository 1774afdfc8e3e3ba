"""Request identity (client_id, priority, slo_ttft_ms) through every API, and per-client accounting.

Engine level: the fields reach `Req`, per prompt or shared; bad values are a ValueError naming the
field. Server level, one server with `metrics.max_client_labels = 2`: the official `openai` client
with `user=` for two clients, their served tokens in /metrics and /get_server_info equal to what the
responses' usage reported; a table of bad identity fields answered 400, with nothing reaching the
scheduler and nothing leaked; the label bound with four clients.
"""

from __future__ import annotations

import math
import re
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from framework import hookimpl
from framework.clients import ANONYMOUS, OTHER, ClientLedger, bound_clients, merge_clients
from framework.messages import ClientStats, GenerateReqInput
from framework.request import MAX_PARAM_INT, SamplingParams
from tests.conftest import leak_checked_engines
from tests.conftest_server import running_server, tiny_server_args

MODEL = "tiny-model"
MAX_CLIENT_LABELS = 2
MAX_CLIENT_ID_CHARS = 32


class Received:
    """Records the identity of every request the scheduler takes in."""

    def __init__(self):
        self.seen: list[tuple[str | None, int | None, float | None]] = []

    @hookimpl
    def on_request_received(self, req, view):
        self.seen.append((req.client_id, req.priority, req.slo_ttft_ms))


def served(meta: dict) -> int:
    """What a finished request was served: the prompt tokens it computed plus its output."""
    return meta["prompt_tokens"] - meta["cached_tokens"] + meta["completion_tokens"]


# -- Engine ------------------------------------------------------------------------------------------


def test_engine_identity_reaches_req_per_prompt_or_shared(make_engine):
    received = Received()
    engine = make_engine(extra_plugins=(received,))
    params = {"max_new_tokens": 2, "temperature": 0}
    engine.generate(["one", "two"], params, client_id=["alice", None], priority=[3, -MAX_PARAM_INT],
                    slo_ttft_ms=[250, None])
    engine.generate(["three", "four"], params, client_id="bob", priority=7, slo_ttft_ms=0.5)
    engine.generate("five", params)
    assert received.seen == [
        ("alice", 3, 250.0), (None, -MAX_PARAM_INT, None),
        ("bob", 7, 0.5), ("bob", 7, 0.5),
        (None, None, None),
    ]
    assert all(isinstance(slo, float) for _, _, slo in received.seen if slo is not None)


BAD_ENGINE_IDENTITY = [
    ("client-id-int", {"client_id": 5}, "client_id: must be a string"),
    ("client-id-too-long", {"client_id": "x" * 257}, "server.max_client_id_chars"),
    ("client-id-newline", {"client_id": "al\nice"}, "client_id: must not contain control"),
    ("client-ids-count", {"client_id": ["a", "b", "c"]}, "client_id: got 3 values for 2 prompts"),
    ("priority-str", {"priority": "high"}, "priority: must be an integer"),
    ("priority-float", {"priority": 1.5}, "priority: must be an integer"),
    ("priority-bool", {"priority": True}, "priority: must be an integer"),
    ("priority-2^31", {"priority": MAX_PARAM_INT + 1}, "priority: must be between"),
    ("slo-negative", {"slo_ttft_ms": -1}, "slo_ttft_ms: must be a finite number >= 0"),
    ("slo-nan", {"slo_ttft_ms": math.nan}, "slo_ttft_ms: must be a finite number >= 0"),
    ("slo-inf", {"slo_ttft_ms": math.inf}, "slo_ttft_ms: must be a finite number >= 0"),
    ("slo-str", {"slo_ttft_ms": "soon"}, "slo_ttft_ms: must be a number"),
    ("slo-bool", {"slo_ttft_ms": False}, "slo_ttft_ms: must be a number"),
]


@pytest.fixture(scope="module")
def engine(tiny_model_folder):
    factory = leak_checked_engines(tiny_model_folder)
    yield next(factory)()
    next(factory, None)  # leak check and shut down


@pytest.mark.parametrize("kwargs, message", [c[1:] for c in BAD_ENGINE_IDENTITY],
                         ids=[c[0] for c in BAD_ENGINE_IDENTITY])
def test_engine_bad_identity_is_a_value_error_naming_the_field(engine, kwargs, message):
    params = {"max_new_tokens": 1}
    with pytest.raises(ValueError, match=re.escape(message)):
        engine.generate(["one", "two"], params, **kwargs)
    with pytest.raises(ValueError, match=message.split(":")[0]):
        engine.encode(input_ids=[[1, 2], [3]], **kwargs)
    assert not engine.scheduler.has_work()  # nothing was queued
    assert engine.generate("still serving", params)["meta_info"]["completion_tokens"] == 1


def test_scheduler_counts_each_clients_tokens_and_requests(make_engine):
    engine = make_engine(scheduler={"max_running_requests": 2}, metrics={"max_client_labels": 4})
    sched = engine.scheduler
    messages = [
        GenerateReqInput(rid=f"r{i}", input_ids=[10 + i] * (4 + i), sampling_params=_params(3 + i),
                         client_id=client)
        for i, client in enumerate(["alice", "alice", "bob", None])
    ]
    for msg in messages:
        sched.send(msg)
    sched.process_input_requests()
    clients = sched.get_stats().clients
    assert {c: s.num_waiting_reqs for c, s in clients.items()} == {"alice": 2, "bob": 1, ANONYMOUS: 1}
    assert all(s.num_running_reqs == 0 and s.served_tokens == 0 for s in clients.values())

    sched.run_once()  # one prefill of two requests (max_running_requests)
    clients = sched.get_stats().clients
    assert sum(s.num_running_reqs for s in clients.values()) == 2
    assert sum(s.num_waiting_reqs for s in clients.values()) == 2

    while sched.has_work():
        sched.run_once()
    sched.run_once()
    outputs = {rid: engine._outputs.pop(rid) for rid in [m.rid for m in messages]}
    clients = sched.get_stats().clients
    expected = {"alice": 0, "bob": 0, ANONYMOUS: 0}
    for msg in messages:
        expected[msg.client_id or ANONYMOUS] += served(outputs[msg.rid].meta_info)
    assert {c: s.served_tokens for c, s in clients.items()} == expected
    assert all(s.served_tokens == s.prompt_tokens + s.output_tokens for s in clients.values())
    assert clients["bob"].output_tokens == 5 and clients["bob"].prompt_tokens == 6
    assert all(s.num_running_reqs == s.num_waiting_reqs == 0 for s in clients.values())


def _params(max_new_tokens: int) -> SamplingParams:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True)
    params.normalize(None)
    return params


def test_accounting_observer_can_be_disabled(make_engine):
    engine = make_engine(plugins={"disable": ["clients"]})
    engine.generate("hi", {"max_new_tokens": 1}, client_id="alice")
    assert engine.scheduler.get_stats().clients == {}


def test_bound_clients_keeps_the_top_n_and_sums_the_rest():
    stats = {name: ClientStats(served_tokens=tokens, prompt_tokens=tokens, num_waiting_reqs=1)
             for name, tokens in [("a", 5), ("b", 50), ("c", 7), ("d", 7), (ANONYMOUS, 1)]}
    bounded = bound_clients(stats, 2)
    assert list(bounded) == ["b", "c", ANONYMOUS, OTHER]  # ties by name
    assert bounded[OTHER] == ClientStats(served_tokens=12, prompt_tokens=12, num_waiting_reqs=2)
    assert sum(s.served_tokens for s in bounded.values()) == 70
    assert list(bound_clients(stats, 0)) == [ANONYMOUS, OTHER]
    assert bound_clients(stats, 10) == stats
    merged = merge_clients([{"a": ClientStats(served_tokens=1)}, {"a": ClientStats(served_tokens=2), OTHER: ClientStats(served_tokens=4)}])
    assert merged == {"a": ClientStats(served_tokens=3), OTHER: ClientStats(served_tokens=4)}


def test_data_parallel_stats_sum_the_replicas_clients():
    from framework.server.dp_controller import combine_stats
    from tests.test_dp_routing import stats

    parts = [stats(0, clients={"a": ClientStats(served_tokens=3, num_running_reqs=1)}),
             stats(1, clients={"a": ClientStats(served_tokens=4), "b": ClientStats(served_tokens=1)})]
    total = combine_stats(parts)
    assert total.clients == {"a": ClientStats(served_tokens=7, num_running_reqs=1), "b": ClientStats(served_tokens=1)}
    assert [r.clients for r in total.replicas] == [p.clients for p in parts]


def test_ledger_folds_idle_clients_past_its_limit():
    ledger = ClientLedger(max_tracked=4)
    for i in range(5):
        ledger.add(f"c{i}", prompt_tokens=i + 1)
    ledger.fold_idle(active={"c0"})
    # Down to half the limit; the least served idle ones went first, the active one stayed.
    assert set(ledger.tokens) == {"c0", "c4"}
    assert ledger.folded.served_tokens == 2 + 3 + 4


# -- server ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_model_folder, tmp_path_factory):
    args = tiny_server_args(tiny_model_folder) + [
        "--model.served-model-name", MODEL, "--metrics.max-client-labels", str(MAX_CLIENT_LABELS),
        "--server.max-client-id-chars", str(MAX_CLIENT_ID_CHARS),
    ]
    with running_server(args, tmp_path_factory.mktemp("client-identity") / "server.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60.0) as client:
        yield client


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def served_metrics(http) -> dict[str, float]:
    """`batchyard:client_served_tokens_total` by client label."""
    text = http.get("/metrics").text
    for family in text_string_to_metric_families(text):
        if family.name == "batchyard:client_served_tokens":
            assert family.type == "counter"
            return {s.labels["client"]: s.value for s in family.samples if s.name.endswith("_total")}
    return {}


def idle_info(http) -> dict:
    """/get_server_info once idle; asserts nothing leaked and no client has a request left."""
    deadline = time.monotonic() + 5.0
    while True:
        info = http.get("/get_server_info").json()
        stats = info["scheduler_stats"]
        if (info["num_inflight_requests"] == 0 and stats["num_running_reqs"] == stats["num_queue_reqs"] == 0) \
                or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert info["num_inflight_requests"] == 0, info
    assert stats["kv_available"] + stats["kv_evictable"] == stats["max_total_num_tokens"], stats
    assert stats["req_slots_free"] == stats["req_slots_total"], stats
    assert all(c["num_waiting_reqs"] == c["num_running_reqs"] == 0 for c in info["clients"].values()), info
    return info


def usage_served(usage) -> int:
    return usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens + usage.completion_tokens


def test_openai_user_is_the_client_and_its_tokens_are_counted(oai, http):
    messages = [{"role": "user", "content": "Say something about the sea."}]
    alice = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                        user="alice", extra_body={"priority": 2, "slo_ttft_ms": 500})
    bob = oai.completions.create(model=MODEL, prompt="Tell me about mountains", max_tokens=9,
                                 temperature=0, user="bob")
    bob_chat = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, user="bob")
    expected = {"alice": usage_served(alice.usage), "bob": usage_served(bob.usage) + usage_served(bob_chat.usage)}
    # The second chat shares the template's prefix with the first: its cached tokens are not served again.
    assert bob_chat.usage.prompt_tokens_details.cached_tokens > 0

    assert served_metrics(http) == expected
    clients = idle_info(http)["clients"]
    assert {c: s["served_tokens"] for c, s in clients.items()} == expected
    assert clients["bob"]["output_tokens"] == bob.usage.completion_tokens + bob_chat.usage.completion_tokens
    text = http.get("/metrics").text
    assert 'batchyard:client_num_waiting_reqs{client="alice",model_name="tiny-model"} 0.0' in text
    assert 'batchyard:client_num_running_reqs{client="bob",model_name="tiny-model"} 0.0' in text


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
HI = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}

# (id, path, body, a part of the message)
BAD_IDENTITY = [
    ("chat-user-int", "/v1/chat/completions", {**CHAT, "user": 5}, "user: Input should be a valid string"),
    ("chat-user-too-long", "/v1/chat/completions", {**CHAT, "user": "x" * (MAX_CLIENT_ID_CHARS + 1)},
     "user: must be at most 32 characters (server.max_client_id_chars)"),
    ("chat-user-control-char", "/v1/chat/completions", {**CHAT, "user": "al\x1bice"}, "user: must not contain control"),
    ("chat-priority-str", "/v1/chat/completions", {**CHAT, "priority": "high"}, "priority: Input should be a valid integer"),
    ("chat-priority-float", "/v1/chat/completions", {**CHAT, "priority": 1.5}, "priority: Input should be a valid integer"),
    ("chat-priority-bool", "/v1/chat/completions", {**CHAT, "priority": True}, "priority: Input should be a valid integer"),
    ("chat-priority-2^31", "/v1/chat/completions", {**CHAT, "priority": 2**31}, "priority: must be between"),
    ("chat-slo-negative", "/v1/chat/completions", {**CHAT, "slo_ttft_ms": -5}, "slo_ttft_ms: must be a finite number >= 0"),
    ("completion-user-list", "/v1/completions", {**COMPLETION, "user": ["a"]}, "user: Input should be a valid string"),
    ("completion-slo-str", "/v1/completions", {**COMPLETION, "slo_ttft_ms": "soon"}, "slo_ttft_ms: Input should be a valid number"),
    ("embeddings-user-int", "/v1/embeddings", {"model": MODEL, "input": "hi", "user": 1}, "user: Input should be a valid string"),
    ("generate-client-id-int", "/generate", {**HI, "client_id": 7}, "client_id: must be a string"),
    ("generate-client-id-too-long", "/generate", {**HI, "client_id": "é" * (MAX_CLIENT_ID_CHARS + 1)},
     "server.max_client_id_chars"),
    ("generate-priority-bool", "/generate", {**HI, "priority": False}, "priority: must be an integer"),
    ("generate-priority-str", "/generate", {**HI, "priority": "high"}, "priority: must be an integer"),
    ("generate-slo-negative", "/generate", {**HI, "slo_ttft_ms": -0.5}, "slo_ttft_ms: must be a finite number >= 0"),
    ("generate-batch-client-ids-count", "/generate",
     {"text": ["a", "b"], "client_id": ["x"], "sampling_params": {"max_new_tokens": 1}},
     "client_id: got 1 values for 2 prompts"),
    ("encode-priority-float", "/encode", {"text": "hi", "priority": 0.5}, "priority: must be an integer"),
]


@pytest.mark.parametrize("path, body, message", [c[1:] for c in BAD_IDENTITY], ids=[c[0] for c in BAD_IDENTITY])
def test_bad_identity_is_a_400_and_nothing_reaches_the_scheduler(http, path, body, message):
    received = idle_info(http)["scheduler_stats"]["num_received_reqs"]
    resp = http.post(path, json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()
    assert set(error) == {"error"} and error["error"]["code"] == 400, error
    assert error["error"]["type"] == "invalid_request_error", error
    assert message in error["error"]["message"], error
    assert idle_info(http)["scheduler_stats"]["num_received_reqs"] == received
    ok = http.post("/generate", json={**HI, "client_id": "after-bad", "priority": -1, "slo_ttft_ms": 0})
    assert ok.status_code == 200, ok.text
    idle_info(http)


def test_nan_slo_is_malformed_json(http):
    resp = http.post("/generate", content=b'{"text": "hi", "slo_ttft_ms": NaN}',
                     headers={"content-type": "application/json"})
    assert resp.status_code == 400 and "NaN" in resp.json()["error"]["message"]


def test_client_labels_are_bounded_and_add_up(http):
    before = sum(served_metrics(http).values())
    spent = 0
    # carol and dave are served the most tokens of all the module's clients.
    for client, max_new_tokens in [("carol", 160), ("dave", 120), ("erin", 20), ("frank", 10)]:
        out = http.post("/generate", json={"text": f"A story for {client}", "client_id": client,
                                           "sampling_params": {"max_new_tokens": max_new_tokens,
                                                               "ignore_eos": True}}).json()
        spent += served(out["meta_info"])
    anonymous = http.post("/generate", json=HI).json()
    spent += served(anonymous["meta_info"])

    metrics = served_metrics(http)
    named = [c for c in metrics if c not in (ANONYMOUS, OTHER)]
    assert sorted(named) == ["carol", "dave"], metrics
    assert OTHER in metrics and ANONYMOUS in metrics, metrics
    assert sum(metrics.values()) == before + spent
    clients = idle_info(http)["clients"]
    assert {c: s["served_tokens"] for c, s in clients.items()} == metrics
