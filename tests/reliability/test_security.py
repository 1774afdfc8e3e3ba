"""Item 6: safe defaults. The server binds 127.0.0.1 unless told otherwise; with an API key every
endpoint but /health answers 401 without it; no process of the server listens on or talks TCP
except the HTTP port (the processes talk ZMQ over ipc://, where pickle never meets the network);
error bodies carry no stack trace."""

from __future__ import annotations

import httpx
import psutil
import pytest

from framework.config import Settings
from framework.server.ipc import IpcNames
from tests.reliability.conftest import error_body_ok, process_tree

ENDPOINTS = [
    ("GET", "/health_generate"), ("GET", "/get_model_info"), ("GET", "/get_server_info"),
    ("POST", "/flush_cache"), ("GET", "/flush_cache"), ("POST", "/generate"), ("PUT", "/generate"),
    ("POST", "/encode"), ("POST", "/update_weights_from_disk"), ("POST", "/update_weights"),
    ("POST", "/start_profile"), ("GET", "/stop_profile"), ("POST", "/open_session"), ("POST", "/close_session"),
    ("GET", "/metrics"), ("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
    ("POST", "/v1/embeddings"), ("GET", "/no-such-path"),
]


def test_defaults_bind_loopback_and_need_no_key_to_be_safe():
    settings = Settings.load(None)
    assert settings.server.host == "127.0.0.1"
    assert settings.server.max_request_bytes > 0 and settings.server.request_timeout is not None
    names, folder = IpcNames.in_new_temp_dir()
    try:
        assert all(n.startswith("ipc://") for n in (names.tokenizer, names.scheduler, names.detokenizer))
        assert names.for_replica(0).scheduler.startswith("ipc://")
    finally:
        import shutil

        shutil.rmtree(folder)


@pytest.mark.parametrize("method,path", ENDPOINTS, ids=[f"{m} {p}" for m, p in ENDPOINTS])
# No header, a wrong key, the key without "Bearer", the key in another scheme.
@pytest.mark.parametrize("auth", [None, "Bearer wrong-key", "reliability-key", "Basic cmVsaWFiaWxpdHkta2V5"])
def test_every_endpoint_but_health_needs_the_key(guarded_server, method, path, auth):
    headers = {} if auth is None else {"Authorization": auth}
    resp = httpx.request(method, guarded_server.url + path, headers=headers, json={}, timeout=10)
    assert resp.status_code == 401, resp.text
    assert error_body_ok(resp) == "Unauthorized"
    assert resp.json()["error"]["type"] == "authentication_error"


def test_health_needs_no_key(guarded_server):
    assert httpx.get(guarded_server.url + "/health", timeout=10).status_code == 200


def test_only_the_http_port_is_on_tcp(guarded_server, guarded):
    info = guarded.get("/get_server_info").json()
    port = info["server"]["port"]
    procs = process_tree(guarded_server.proc.pid)
    assert {p.pid for p in procs} >= set(info["process_ids"].values())
    for proc in procs:
        for conn in proc.net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN:
                assert (conn.laddr.ip, conn.laddr.port) == ("127.0.0.1", port), (proc.name(), conn)
            else:  # accepted HTTP connections only
                assert conn.laddr.port == port, (proc.name(), conn)
    # The children reach each other over unix sockets (ZMQ ipc://), never TCP.
    assert any(proc.net_connections(kind="unix") for proc in procs)


def test_error_bodies_carry_no_stack_trace(guarded):
    for path, body in [("/generate", b"{oops"), ("/generate", b'{"text": 5}'), ("/v1/completions", b"[]"),
                       ("/update_weights_from_disk", b'{"model_path": "/no/such/folder"}')]:
        resp = guarded.post(path, content=body, headers={"content-type": "application/json"})
        assert 400 <= resp.status_code < 500, resp.text
        error_body_ok(resp)


def test_rank_broadcasts_are_authenticated():
    """Tensor-parallel ranks get rank 0's input as pickles over TCP (gloo): each carries an HMAC
    under parallel.dist_secret and one that fails the check is never unpickled."""
    from framework.distributed import UnauthenticatedMessage, seal, unseal

    sealed = seal(b"secret", b"payload")
    assert unseal(b"secret", sealed) == b"payload"
    with pytest.raises(UnauthenticatedMessage):
        unseal(b"other secret", sealed)
    with pytest.raises(UnauthenticatedMessage):
        unseal(b"secret", sealed[:-1] + b"!")


def test_several_nodes_need_a_shared_secret(tmp_path):
    import subprocess
    import sys

    from tests.conftest_server import ROOT

    proc = subprocess.run(
        [sys.executable, "-m", "framework.cli", "serve", "--parallel.tp-size", "2", "--parallel.nnodes", "2",
         "--parallel.dist-init-addr", "127.0.0.1:1", "--server.port", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 1
    assert "parallel.dist_secret" in proc.stderr
