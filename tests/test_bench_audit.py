"""`batchyard bench` used the wrong way: a server that is not the one meant, bad URLs and ports,
results files the plot cannot draw, a soak whose server refuses its flags. Each is one clear
error (exit status 2 for a usage error), not a traceback and not a run that counts as a success."""

from __future__ import annotations

import asyncio
import json

import pytest

from framework.bench.datasets import BenchRequest
from framework.cli import main as cli_main
from tests.conftest import aiohttp_app_in_thread


@pytest.fixture
def other_server():
    """An aiohttp server on 127.0.0.1 that answers every POST and GET with `answers[path]`
    (status, content type, body): a server that is not batchyard. Yields (answers, base_url)."""
    from aiohttp import web

    answers: dict[str, tuple[int, str, str]] = {}

    async def handle(request):
        status, content_type, body = answers.get(request.path, (404, "text/plain", "not found"))
        return web.Response(status=status, content_type=content_type, text=body)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    with aiohttp_app_in_thread(app) as url:
        yield answers, url


def send_one(backend: str, url: str):
    from framework.bench.serving import client_session, send_request

    async def go():
        async with client_session() as session:
            return await send_request(session, backend, url, BenchRequest("a b c", [1, 2, 3], 4))

    return asyncio.run(go())


HTML_PAGE = "<!DOCTYPE HTML>\n<html>\n  <body>\n    <h1>Error response</h1>\n  </body>\n</html>\n"


@pytest.mark.parametrize("backend, path", [("batchyard", "/generate"), ("openai", "/v1/completions"),
                                           ("llamacpp", "/completion")])
def test_a_server_that_is_not_the_one_meant_fails_each_request_in_one_line(other_server, backend, path):
    """An HTML page was a JSONDecodeError ("Expecting value: line 1 column 1"), a JSON array an
    AttributeError; an HTTP error's page came out over a dozen lines."""
    answers, url = other_server
    answers[path] = (200, "text/html", "<html><body>hello</body></html>")
    result = send_one(backend, url)
    assert not result.success
    assert result.error == f"not what the {backend} backend reads: the server sent '<html><body>hello</body></html>'"
    answers[path] = (200, "application/json", "[1, 2, 3]")
    assert send_one(backend, url).error == f"not what the {backend} backend reads: the server sent '[1, 2, 3]'"
    answers[path] = (501, "text/html", HTML_PAGE)
    result = send_one(backend, url)
    assert result.error == "HTTP 501: <!DOCTYPE HTML> <html> <body> <h1>Error response</h1> </body> </html>"


def test_llama_cpp_chunks_are_only_those_with_content(other_server):
    """Every JSON object of the stream counted as one llama.cpp token: any JSON server passed the
    benchmark, with one token a request and exit status 0."""
    answers, url = other_server
    answers["/completion"] = (200, "application/json", '{"text": "x", "meta_info": {"completion_tokens": 1}}')
    result = send_one("llamacpp", url)
    assert not result.success and result.error.startswith("not what the llamacpp backend reads")


def test_the_openai_model_name_comes_from_a_model_list_or_is_default(other_server):
    """A /v1/models answer that is JSON but not a model list was an AttributeError traceback."""
    from framework.bench.serving import first_model

    assert first_model({"object": "list", "data": [{"id": "smol"}, {"id": "other"}]}) == "smol"
    for listing in (None, [1, 2], {"data": []}, {"data": "x"}, {"data": ["smol"]}, {"data": [{}]}):
        assert first_model(listing) == "default"

    answers, url = other_server
    answers["/v1/models"] = (200, "application/json", "[1, 2, 3]")
    argv = ["bench", "serving", "--backend", "openai", "--base-url", url, "--dataset", "random",
            "--random-source", "ids", "--num-prompts", "1", "--random-input-len", "4", "--random-output-len", "2",
            "--disable-tqdm"]
    assert cli_main(argv) == 2  # the warm-up failed (the server has no /v1/completions), in one line


@pytest.mark.parametrize("flags, message", [
    (["--base-url", "127.0.0.1:30000"], "argument --base-url: not an http:// or https:// URL with a host"),
    (["--base-url", "http://"], "argument --base-url: not an http:// or https:// URL with a host"),
    (["--base-url", "http://127.0.0.1:99999"], "argument --base-url: not a URL"),
    (["--port", "70000"], "argument --port: must be at most 65535"),
    (["--port", "-5"], "argument --port: must be at least 1"),
    (["--warmup-requests", "-1"], "argument --warmup-requests: must be at least 0"),
])
def test_serving_server_options_are_checked_before_the_workload(flags, message, capsys):
    """They failed in aiohttp's words (InvalidUrlClientError, NonHttpUrlClientError) after the
    tokenizer had loaded and the workload was built; a negative warm-up count meant none."""
    with pytest.raises(SystemExit) as caught:
        cli_main(["bench", "serving", "--port", "1", "--num-prompts", "1", *flags])  # (nothing listens on 1)
    assert caught.value.code == 2
    assert message in capsys.readouterr().err


def test_offline_refuses_a_negative_warm_up_count(tmp_path, capsys):
    with pytest.raises(SystemExit) as caught:  # (no model in tmp_path: it would fail fast if it ran)
        cli_main(["bench", "offline", "--num-prompts", "1", "--model.path", str(tmp_path), "--warmup-requests", "-2"])
    assert caught.value.code == 2
    assert "argument --warmup-requests: must be at least 0" in capsys.readouterr().err


def test_bench_plot_names_the_file_of_a_record_it_cannot_draw(tmp_path, capsys):
    """A one-batch record without its lengths was a KeyError, a record whose args are not an
    object an AttributeError (tracebacks naming no file); a file that is not UTF-8 was
    UnicodeDecodeError's message without the file."""
    good = {"tool": "offline", "backend": "batchyard", "dataset": "random", "metrics": {"output_throughput": 1.0}}
    cases = {
        "one_batch.jsonl": ({"tool": "one-batch", "metrics": {"batch_size": 1}},
                            "record 2 cannot be plotted: a one-batch record without input_len, output_len, "
                            "prefill_throughput, median_decode_throughput in its metrics"),
        "args.jsonl": ({**good, "tool": "serving", "args": [1]},
                       "record 2 cannot be plotted: its args is not a JSON object"),
        "hardware.jsonl": ({**good, "hardware": "x"}, "record 2 cannot be plotted: its hardware is not a JSON object"),
    }
    for name, (record, message) in cases.items():
        path = tmp_path / name
        path.write_text(json.dumps(good) + "\n" + json.dumps(record) + "\n")
        assert cli_main(["bench", "plot", str(path), "-o", str(tmp_path / "p.png")]) == 2
        assert f"{path}: {message}" in capsys.readouterr().err
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xe6\x00\xff\n")
    assert cli_main(["bench", "plot", str(binary), "-o", str(tmp_path / "p.png")]) == 2
    assert f"{binary}: not UTF-8 text" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()


def test_peers_refuses_an_unknown_peer_for_every_action(tmp_path, monkeypatch, caplog):
    """`bench peers status vlm` listed both peers, as if it had understood."""
    monkeypatch.setenv("BATCHYARD_PEERS_HOME", str(tmp_path))
    assert cli_main(["bench", "peers", "status", "vlm"]) == 2
    assert "unknown peer vlm; choose from vllm, llamacpp" in caplog.text


def test_soak_whose_server_refuses_its_flags_is_a_usage_error(tmp_path, monkeypatch, caplog):
    """A server that exited during start-up was a RuntimeError traceback (exit status 1); its log
    is still shown, and nothing is left running."""
    from framework.bench import common, datasets, soak

    monkeypatch.setattr(common, "load_bench_tokenizer", lambda path=None: None)
    monkeypatch.setattr(datasets, "sample_sharegpt", lambda *a, **kw: [BenchRequest("a b", [1, 2], 4)])
    servers = []
    real = soak.LocalServer

    def local_server(*args, **kwargs):
        servers.append(real(*args, **kwargs))
        return servers[-1]

    monkeypatch.setattr(soak, "LocalServer", local_server)
    log = tmp_path / "server.log"
    assert cli_main(["bench", "soak", "--duration", "1", "--server-log", str(log), "--", "--bogus-flag"]) == 2
    assert "server exited with 2 during start-up" in caplog.text
    assert "unrecognized arguments: --bogus-flag" in caplog.text
    [server] = servers
    assert server.proc.poll() == 2
