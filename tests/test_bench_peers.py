"""`bench offline|serving --backend vllm|llamacpp` (framework/bench/peers.py, vllm_runner.py).

The peers themselves are not installed in the test environment (vLLM's CPU build is a 3.5 GB venv,
llama.cpp a 15-minute build), so each runs here as a stand-in that speaks its protocol: a fake
`llama-server` program (its command line, /health, /completion streamed or not) and a stub
`vllm` package under which the real vllm_runner.py runs. What is tested is ours: the workload each
peer gets, how its tokens are counted and timed, the records and ratios, the server's clean-up,
and a clear error when a peer is missing.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import textwrap

import pytest

from framework.bench.datasets import BenchRequest
from framework.cli import main as cli_main
from tests.test_bench import TINY_ENGINE, TINY_WORKLOAD, bench_model, read_lines  # noqa: F401

FAKE_LLAMA_SERVER = textwrap.dedent('''
    """Speaks llama-server's protocol: the flags the bench passes, /health, /completion."""
    import argparse, json, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    if "--version" in sys.argv:
        print("version: 1 (fake)", file=sys.stderr)
        sys.exit(0)
    ap = argparse.ArgumentParser()
    for flag in ("-m", "--host", "--port", "--parallel", "-c", "-t", "-tb", "--cache-ram"):
        ap.add_argument(flag, required=True)
    for flag in ("--no-kv-unified", "--cont-batching", "--no-webui", "--no-repack"):
        ap.add_argument(flag, action="store_true")
    a = ap.parse_args()
    open(a.m + ".argv", "w").write(json.dumps(sys.argv[1:]))
    assert int(a.c) == int(a.parallel) * 2048, (a.c, a.parallel)
    log = open(a.m + ".requests", "a")

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
            self.wfile.write(b'{"status": "ok"}')

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            log.write(json.dumps(body) + "\\n"); log.flush()
            n = body["n_predict"]
            if not body.get("stream"):
                out = {"content": "x" * n, "tokens_predicted": n, "tokens_evaluated": len(body["prompt"])}
                data = json.dumps(out).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for i in range(n):
                time.sleep(0.005)
                # the second token is half a UTF-8 character: no text, still a token
                chunk = {"content": "" if i == 1 else "ab", "stop": False}
                self.wfile.write(f"data: {json.dumps(chunk)}\\n\\n".encode())
                self.wfile.flush()
            end = {"content": "", "stop": True, "tokens_predicted": n}
            self.wfile.write(f"data: {json.dumps(end)}\\n\\n".encode())

    ThreadingHTTPServer((a.host, int(a.port)), Handler).serve_forever()
''')

STUB_VLLM = textwrap.dedent('''
    """Stands in for vLLM's offline API: checks what the runner asks and answers each request
    with exactly max_tokens tokens."""
    import json, os

    __version__ = "0.0-stub"


    class SamplingParams:
        def __init__(self, **kw):
            assert kw["temperature"] == 0.0 and kw["ignore_eos"] is True, kw
            assert kw["min_tokens"] == kw["max_tokens"], kw
            self.max_tokens = kw["max_tokens"]


    class _Out:
        def __init__(self, ids):
            self.token_ids = ids


    class _Result:
        def __init__(self, ids):
            self.outputs = [_Out(ids)]


    class LLM:
        def __init__(self, **kw):
            assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] and kw["skip_tokenizer_init"], kw
            self.kw = kw

        def generate(self, prompts, params, use_tqdm=True):
            if not isinstance(params, list):
                params = [params] * len(prompts)
            with open(os.environ["STUB_VLLM_LOG"], "a") as f:
                f.write(json.dumps({"settings": self.kw, "prompts": [p["prompt_token_ids"] for p in prompts]}) + "\\n")
            return [_Result(list(range(p.max_tokens))) for p in params]

        def reset_prefix_cache(self):
            pass
''')


@pytest.fixture
def fake_llama_server(tmp_path):
    path = tmp_path / "llama-server"
    path.write_text(f"#!{sys.executable}\n" + FAKE_LLAMA_SERVER)
    path.chmod(0o755)
    model = tmp_path / "model.bf16.gguf"
    model.write_bytes(b"GGUF")
    return str(path), str(model)


def test_offline_against_llama_cpp_records_the_ratio(bench_model, fake_llama_server, tmp_path):  # noqa: F811
    server, model = fake_llama_server
    out = tmp_path / "cmp.jsonl"
    argv = ["bench", "offline", "--model.path", bench_model, *TINY_ENGINE, *TINY_WORKLOAD,
            "--warmup-requests", "1", "--backend", "batchyard", "llamacpp", "--llamacpp-server", server,
            "--llamacpp-model", model, "--llamacpp-parallel", "3", "--llamacpp-args=--no-repack",
            "--output-file", str(out)]
    assert cli_main(argv) == 0
    ours, theirs = read_lines(out)
    assert theirs["backend"] == "llamacpp" and theirs["metrics"]["total_output_tokens"] == 30
    assert theirs["metrics"]["total_input_tokens"] == ours["metrics"]["total_input_tokens"] == 120
    assert theirs["peer"]["parallel"] == 3 and "fake" in theirs["peer"]["version"]
    # --llamacpp-args reached the server, after the bench's own flags, and the record
    assert json.load(open(model + ".argv"))[-1] == "--no-repack" and theirs["peer"]["extra_args"] == ["--no-repack"]
    assert theirs["hardware"]["dtype"] == "bfloat16" and 0 <= theirs["hardware"]["other_cpu_busy"] <= 1
    assert ours["vs_llamacpp"]["ratio"]["output_throughput"] == pytest.approx(
        ours["metrics"]["output_throughput"] / theirs["metrics"]["output_throughput"])
    # The server got the workload as token ids, greedy, EOS ignored, no prompt cache (plus a warm-up).
    sent = [json.loads(line) for line in open(model + ".requests")]
    assert len(sent) == 6
    assert sorted(len(b["prompt"]) for b in sent[1:]) == [24] * 5
    assert all(b["n_predict"] == 6 and b["ignore_eos"] and b["temperature"] == 0 and b["cache_prompt"] is False
               for b in sent[1:])
    # ... and was stopped: nothing of ours is left listening.
    assert not _alive_children(server)


def _alive_children(name: str) -> list[int]:
    pids = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if name.encode() in f.read():
                    with open(f"/proc/{pid}/stat") as s:
                        if s.read().rsplit(")", 1)[1].split()[0] != "Z":
                            pids.append(int(pid))
        except (OSError, ValueError):
            continue
    return pids


def test_serving_client_counts_llama_cpp_stream_tokens(fake_llama_server):
    from framework.bench.peers import LlamaServer
    from framework.bench.serving import run_serving

    server_bin, model = fake_llama_server

    async def go(server):
        import aiohttp

        async with aiohttp.ClientSession() as session:
            await server.wait_healthy(session, timeout=30)
        reqs = [BenchRequest("a b c", [5, 6, 7], 4) for _ in range(3)]
        return await run_serving(reqs, "llamacpp", server.base_url, request_rate=100.0, warmup_requests=0,
                                 progress=False)

    with LlamaServer(server_bin, model, parallel=2) as server:
        results, _ = asyncio.run(go(server))
    for r in results:
        assert r.success, r.error
        assert r.output_len == 4 and r.generated_text == "ab" * 3
        assert len(r.itl) == 3  # the empty-text chunk is a token; the closing chunk is not
    sent = [json.loads(line) for line in open(model + ".requests")]
    assert sent[0]["prompt"] == [5, 6, 7] and sent[0]["stream"] is True and sent[0]["n_predict"] == 4
    assert server.proc.poll() is not None


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e5m2"])
def test_offline_against_vllm_runs_the_runner_under_the_peers_python(bench_model, tmp_path, monkeypatch,  # noqa: F811
                                                                      kv_cache_dtype):
    """The runner under the peer's python, on the engine's folder, dtype and KV cache dtype."""
    stub = tmp_path / "stub"
    (stub / "vllm").mkdir(parents=True)
    (stub / "vllm" / "__init__.py").write_text(STUB_VLLM)
    (stub / "vllm" / "inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n"
                                             "    return {'prompt_token_ids': prompt_token_ids}\n")
    log = tmp_path / "vllm.log"
    monkeypatch.setenv("PYTHONPATH", str(stub))
    monkeypatch.setenv("STUB_VLLM_LOG", str(log))
    out = tmp_path / "cmp.jsonl"
    argv = ["bench", "offline", "--model.path", bench_model, "--model.kv-cache-dtype", kv_cache_dtype, *TINY_ENGINE,
            *TINY_WORKLOAD, "--backend", "vllm", "--vllm-python", sys.executable, "--vllm-args=--no-preload",
            "--output-file", str(out)]
    assert cli_main(argv) == 0
    (record,) = read_lines(out)
    assert record["backend"] == "vllm" and record["peer"]["version"] == "0.0-stub"
    assert record["metrics"]["total_output_tokens"] == 30 and record["metrics"]["total_input_tokens"] == 120
    assert record["peer"]["settings"]["model"] == bench_model and record["peer"]["settings"]["dtype"] == "float32"
    assert record["peer"]["settings"]["kv_cache_dtype"] == kv_cache_dtype
    warm, run = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(warm["prompts"]) == 1 and [len(p) for p in run["prompts"]] == [24] * 5


def test_vllm_gets_the_engines_w8a8_weights_as_a_compressed_tensors_checkpoint(bench_model, tmp_path,  # noqa: F811
                                                                                 monkeypatch):
    """With model.quantization = "w8a8" the runner loads a W8A8 copy of the folder: the engine's
    int8 weights and column scales, inputs per token, written once under the peers' home."""
    import torch
    from safetensors.torch import load_file

    from framework.bench.peers import w8a8_checkpoint
    from framework.model.int8 import quantize_weight

    stub = tmp_path / "stub"
    (stub / "vllm").mkdir(parents=True)
    (stub / "vllm" / "__init__.py").write_text(STUB_VLLM)
    (stub / "vllm" / "inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n"
                                             "    return {'prompt_token_ids': prompt_token_ids}\n")
    monkeypatch.setenv("PYTHONPATH", str(stub))
    monkeypatch.setenv("STUB_VLLM_LOG", str(tmp_path / "vllm.log"))
    monkeypatch.setenv("BATCHYARD_PEERS_HOME", str(tmp_path / "peers"))
    out = tmp_path / "cmp.jsonl"
    argv = ["bench", "offline", "--model.path", bench_model, *TINY_ENGINE, "--dtype", "bfloat16",
            "--model.quantization", "w8a8", *TINY_WORKLOAD, "--backend", "vllm", "--vllm-python", sys.executable,
            "--vllm-args=--no-preload", "--output-file", str(out)]
    assert cli_main(argv) == 0
    (record,) = read_lines(out)
    folder = record["peer"]["settings"]["model"]
    assert folder == str(tmp_path / "peers" / "w8a8" / os.path.basename(bench_model))
    assert record["peer"]["quantization"] == "w8a8" and record["peer"]["settings"]["dtype"] == "bfloat16"
    config = json.load(open(os.path.join(folder, "config.json")))
    scheme = config["quantization_config"]["config_groups"]["group_0"]
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert (scheme["weights"]["strategy"], scheme["input_activations"]["strategy"]) == ("channel", "token")
    assert scheme["input_activations"]["dynamic"] and not scheme["weights"]["dynamic"]
    assert os.path.exists(os.path.join(folder, "tokenizer.json"))
    ours = load_file(os.path.join(bench_model, "model.safetensors"))
    theirs = load_file(os.path.join(folder, "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    want = quantize_weight(ours[name])
    assert theirs[name].dtype == torch.int8 and torch.equal(theirs[name], want.q.t())
    assert torch.equal(theirs[name[: -len("weight")] + "weight_scale"][:, 0], want.scale)
    assert torch.equal(theirs["model.embed_tokens.weight"], ours["model.embed_tokens.weight"])
    stamp = os.path.getmtime(os.path.join(folder, "model.safetensors"))
    assert w8a8_checkpoint(bench_model) == folder  # reused, not written again
    assert os.path.getmtime(os.path.join(folder, "model.safetensors")) == stamp


def test_a_w8a8_checkpoint_that_cannot_be_written_leaves_nothing_behind(tmp_path):
    """A folder without config.json: the error comes out, and no checkpoint or temporary folder is
    left under the peers' home (the next call would otherwise take a half-written copy)."""
    from framework.bench.peers import w8a8_checkpoint

    broken = tmp_path / "broken-model"
    broken.mkdir()
    with pytest.raises(FileNotFoundError):
        w8a8_checkpoint(str(broken), home=str(tmp_path / "peers"))
    assert os.listdir(tmp_path / "peers" / "w8a8") == []


def test_a_missing_peer_is_a_usage_error_before_anything_runs(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("BATCHYARD_PEERS_HOME", str(tmp_path / "none"))
    argv = ["bench", "offline", "--backend", "batchyard", "llamacpp", "--num-prompts", "2"]
    assert cli_main(argv) == 2
    assert "bench peers setup llamacpp" in caplog.text
    assert cli_main(["bench", "peers", "setup", "nosuch"]) == 2


def test_bf16_gguf_keeps_every_tensor_and_the_metadata(tmp_path):
    import gguf
    import numpy as np

    from framework.bench.peers import shipped_gguf, write_bf16_gguf

    src = shipped_gguf()
    dst = str(tmp_path / "m.bf16.gguf")
    write_bf16_gguf(src, dst)
    a, b = gguf.GGUFReader(src), gguf.GGUFReader(dst)
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    kinds = {t.tensor_type for t in b.tensors if len(t.shape) > 1}
    assert kinds == {gguf.GGMLQuantizationType.BF16}
    assert b.fields[gguf.Keys.General.FILE_TYPE].contents() == 32
    assert a.fields["tokenizer.ggml.tokens"].contents()[:50] == b.fields["tokenizer.ggml.tokens"].contents()[:50]
    # The values are the dequantized ones, rounded to bf16.
    from gguf.quants import dequantize

    ta, tb = a.tensors[1], b.tensors[1]
    x = dequantize(ta.data, ta.tensor_type).astype(np.float32)
    y = dequantize(tb.data, tb.tensor_type).astype(np.float32)
    assert np.allclose(x, y, rtol=1e-2, atol=1e-3)


def test_a_served_vllm_gets_the_kv_cache_dtype_and_llama_cpp_refuses_fp8(tmp_path, monkeypatch, caplog):
    """`bench peers serve vllm --kv-cache-dtype fp8_e5m2` serves like the engine's fp8 pool;
    llama.cpp has no such cache, which is a usage error before anything starts."""
    from framework.bench import peers

    vllm = tmp_path / "vllm" / "bin" / "python"
    vllm.parent.mkdir(parents=True)
    vllm.write_text("")
    monkeypatch.setenv("BATCHYARD_PEERS_HOME", str(tmp_path))
    cmd, _ = peers.serve_command("vllm", 30005, folder="/some/model", kv_cache_dtype="fp8_e5m2")
    assert cmd[cmd.index("--kv-cache-dtype") + 1] == "fp8_e5m2" and cmd[cmd.index("--model") + 1] == "/some/model"
    cmd, _ = peers.serve_command("vllm", 30005, folder="/some/model")
    assert cmd[cmd.index("--kv-cache-dtype") + 1] == "auto"
    server, gguf = tmp_path / "llamacpp" / "bin" / "llama-server", tmp_path / "model.gguf"
    server.parent.mkdir(parents=True)
    server.write_text("")
    gguf.write_bytes(b"GGUF")
    cmd, _ = peers.serve_command("llamacpp", 30006, model=str(gguf), llamacpp_args=["--no-repack"])
    assert cmd[cmd.index("-m") + 1] == str(gguf) and cmd[-1] == "--no-repack"
    assert cli_main(["bench", "peers", "serve", "llamacpp", "--kv-cache-dtype", "fp8_e5m2"]) == 2
    assert "no fp8_e5m2 KV cache" in caplog.text


def test_peer_flags_that_do_not_split_are_a_usage_error_naming_the_option(capsys, caplog):
    """`--llamacpp-args` / `--vllm-args` are split as a shell would; an unclosed quote is an
    error naming the option (exit 2), before any peer or engine starts."""
    from framework.bench import peers

    assert peers.peer_flags("--no-repack -ub '512'", "--llamacpp-args") == ["--no-repack", "-ub", "512"]
    assert peers.peer_flags(None, "--vllm-args") == []
    with pytest.raises(ValueError, match="--vllm-args: No closing quotation"):
        peers.peer_flags("--max-num-seqs '8", "--vllm-args")
    assert cli_main(["bench", "peers", "serve", "llamacpp", "--llamacpp-args=--foo 'x"]) == 2
    assert "--llamacpp-args: No closing quotation" in caplog.text
