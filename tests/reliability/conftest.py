"""The reliability suite: what the server promises under bad input, disconnects, load and faults.

Every test here is marked `reliability` (`pytest -m reliability` runs the suite alone). Servers are
real `batchyard serve` subprocesses on 127.0.0.1 and a free port, one per module where the tests
can share it, always torn down by pid (see tests/conftest_server.py). The idle state is read from
outside, as an operator would: `/get_server_info` and the Prometheus gauges at `/metrics`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

HERE = Path(__file__).resolve().parent
# How long a server may take to return to idle after a probe (a few scheduler steps, plus the
# scheduler's idle poll).
IDLE_TIMEOUT_S = 10.0


def pytest_collection_modifyitems(items):
    for item in items:
        if Path(str(item.fspath)).resolve().is_relative_to(HERE):
            item.add_marker(pytest.mark.reliability)


@dataclass
class IdleState:
    """What the server reports about its requests and memory, from both outside views."""

    inflight: int  # requests the HTTP side is still waiting on
    running: int
    queued: int
    grammar_queued: int
    kv_free_or_cached: int
    kv_total: int
    req_slots_free: int
    req_slots_total: int
    # The same from the Prometheus gauges.
    gauges: dict[str, float]

    def problems(self) -> list[str]:
        found = []
        if self.inflight:
            found.append(f"{self.inflight} requests in flight in the HTTP server")
        if self.running or self.queued or self.grammar_queued:
            found.append(f"running={self.running} queued={self.queued} grammar_queued={self.grammar_queued}")
        if self.kv_free_or_cached != self.kv_total:
            found.append(f"KV slots free or cached {self.kv_free_or_cached} of {self.kv_total}")
        if self.req_slots_free != self.req_slots_total:
            found.append(f"request slots free {self.req_slots_free} of {self.req_slots_total}")
        g = self.gauges
        expect = {
            "batchyard:num_running_reqs": 0, "batchyard:num_queue_reqs": 0, "batchyard:num_grammar_queue_reqs": 0,
            "batchyard:num_inflight_requests": 0, "batchyard:req_slots_free": self.req_slots_total,
        }
        for name, value in expect.items():
            if g.get(name) != value:
                found.append(f"gauge {name} = {g.get(name)}, expected {value}")
        kv = g.get("batchyard:kv_available_tokens", 0) + g.get("batchyard:kv_evictable_tokens", 0)
        if kv != g.get("batchyard:max_total_num_tokens"):
            found.append(f"gauges: KV available + evictable = {kv}, total {g.get('batchyard:max_total_num_tokens')}")
        return found


def gauges(http: httpx.Client) -> dict[str, float]:
    """The server's unlabelled-by-reason samples at /metrics, by name."""
    resp = http.get("/metrics")
    assert resp.status_code == 200, resp.text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(resp.text):
        for sample in family.samples:
            if "finish_reason" not in sample.labels:
                values[sample.name] = sample.value
    return values


def idle_state(http: httpx.Client) -> IdleState:
    info = http.get("/get_server_info")
    assert info.status_code == 200, info.text
    info = info.json()
    stats = info["scheduler_stats"]
    return IdleState(
        inflight=info["num_inflight_requests"], running=stats["num_running_reqs"],
        queued=stats["num_queue_reqs"], grammar_queued=stats["num_grammar_queue_reqs"],
        kv_free_or_cached=stats["kv_available"] + stats["kv_evictable"], kv_total=stats["max_total_num_tokens"],
        req_slots_free=stats["req_slots_free"], req_slots_total=stats["req_slots_total"], gauges=gauges(http),
    )


def wait_idle(http: httpx.Client, timeout: float = IDLE_TIMEOUT_S) -> float:
    """Wait until the server reports the idle state (no request anywhere, every KV and request
    slot free or cached); returns the seconds it took, fails with what is still held."""
    start = time.monotonic()
    while True:
        problems = idle_state(http).problems()
        if not problems:
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            pytest.fail(f"server not idle {timeout} s after the probe: {'; '.join(problems)}")
        time.sleep(0.05)


def process_tree(pid: int) -> list[psutil.Process]:
    """The server's main process and its children (scheduler, detokenizer, ...)."""
    main = psutil.Process(pid)
    return [main, *main.children(recursive=True)]


def assert_no_orphans_or_zombies(pids: dict[str, int], timeout: float = 3.0) -> None:
    """None of the server's processes is left, running or as a zombie (named by role)."""
    deadline = time.monotonic() + timeout
    left = dict(pids)
    while left and time.monotonic() < deadline:
        left = {name: pid for name, pid in left.items() if _exists(pid)}
        time.sleep(0.05)
    assert not left, f"left behind: {', '.join(f'{n} ({p}, {_status(p)})' for n, p in left.items())}"


def _exists(pid: int) -> bool:
    """Running or a zombie: a zombie is a process its parent never reaped."""
    try:
        psutil.Process(pid).status()
        return True
    except psutil.NoSuchProcess:
        return False


def _status(pid: int) -> str:
    try:
        return psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return "gone"


def rss_mib(pids) -> dict[int, float]:
    return {pid: psutil.Process(pid).memory_info().rss / 2**20 for pid in pids}


def error_body_ok(resp: httpx.Response) -> str:
    """The documented error body: {"error": {"message", "type", "code"}}, no stack trace; returns
    the message."""
    body = resp.json()
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"], body
    assert error["code"] == resp.status_code and isinstance(error["type"], str), body
    assert "Traceback" not in resp.text and 'File "' not in resp.text, resp.text
    return error["message"]


API_KEY = "reliability-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# The guarded server's per-request limit: short, so a stuck request is seen to end.
REQUEST_TIMEOUT_S = 3.0


@pytest.fixture(scope="session")
def guarded_server(tiny_model_folder, tmp_path_factory):
    """One tiny-model server for the bad-input, security and plugin-fault tests: an API key, a
    short request timeout, the fault-injecting test plugin on, the leak check on."""
    from tests.conftest_server import running_server, tiny_server_args

    folder = tmp_path_factory.mktemp("reliability-guarded")
    config = folder / "serve.toml"
    config.write_text("[plugin.faults]\nenabled = true\n")
    args = tiny_server_args(tiny_model_folder) + [
        "--config", str(config), "--server.api-key", API_KEY, "--server.request-timeout", str(REQUEST_TIMEOUT_S),
        "--model.served-model-name", "tiny-model", "--server.log-level", "warning",
    ]
    with running_server(args, folder / "server.log") as server:
        yield server


@pytest.fixture(scope="session")
def guarded(guarded_server):
    """An authenticated client of the guarded server."""
    with httpx.Client(base_url=guarded_server.url, headers=AUTH, timeout=30.0) as client:
        yield client
