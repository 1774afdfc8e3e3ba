"""`batchyard bench serving`: an asyncio HTTP client against a running server (bench_serving).

Backends:
  batchyard  POST /generate {"input_ids", "sampling_params", "stream": true}; every SSE line
             ``data: {...}`` carries the cumulative ``text`` and ``meta_info.completion_tokens``;
             the stream ends with ``data: [DONE]``.
  openai     POST /v1/completions with ``stream: true``; each chunk carries a text delta, and the
             usage chunk (``stream_options.include_usage``) the completion token count.
  vllm       the same against `vllm serve` (vLLM's CPU build), but with the prompt as token ids, so
             both engines see exactly the same input.
  llamacpp   POST llama-server's native /completion (``prompt`` = token ids, ``n_predict``,
             ``ignore_eos``, ``cache_prompt: false``, ``stream: true``); one chunk per token until the
             last, ``stop: true``, which carries ``tokens_predicted``.

Requests arrive as a Poisson process at --request-rate (inf: all at t=0), at most
--max-concurrency in flight. The clock starts after the warm-up requests and stops when the last
request has finished. Metrics: framework/bench/metrics.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from typing import AsyncIterator

import numpy as np

from framework.bench.datasets import BenchRequest
from framework.bench.metrics import RequestResult
from framework.bench.peers import llamacpp_body

logger = logging.getLogger(__name__)

BACKENDS = ("batchyard", "openai", "vllm", "llamacpp")
# One benchmark can legitimately run for hours on a CPU.
REQUEST_TIMEOUT_S = 6 * 3600
# Cumulative-text SSE lines grow with the output; aiohttp's default 64 KiB line limit is too small.
READ_BUFSIZE = 1 << 22


def _aiohttp():
    try:
        import aiohttp
    except ImportError:
        raise ImportError("bench serving needs aiohttp: pip install 'batchyard[bench]'") from None
    return aiohttp


async def _sse_payloads(response) -> AsyncIterator[str]:
    """The data payloads of a server-sent-event stream, one per ``data:`` line."""
    async for raw in response.content:
        line = raw.strip()
        if not line or line.startswith(b":"):
            continue  # keep-alive or comment
        text = line.decode("utf-8")
        if text.startswith("data:"):
            text = text[5:].lstrip()
        yield text


class _TokenClock:
    """TTFT and ITL from the arrival times of token-carrying chunks of one request."""

    def __init__(self, result: RequestResult, start: float):
        self.result = result
        self.start = start
        self.last: float | None = None

    def tick(self) -> None:
        now = time.perf_counter()
        if self.last is None:
            self.result.ttft = now - self.start
        else:
            self.result.itl.append(now - self.last)
        self.last = now


def _chunk(payload: str, backend: str) -> dict | None:
    """The JSON object of one stream line, or None where it is not one of `backend`'s chunks (a
    server other than the one meant: its text is no JSON object, and llama.cpp's every chunk has a
    "content", which counts one token each)."""
    try:
        data = json.loads(payload)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or (backend == "llamacpp" and "content" not in data and "error" not in data):
        return None
    return data


def first_model(listing) -> str:
    """The first model id of a /v1/models answer; "default" where there is no such list."""
    data = listing.get("data") if isinstance(listing, dict) else None
    first = data[0] if isinstance(data, list) and data else None
    return str(first.get("id", "default")) if isinstance(first, dict) else "default"


def native_body(req: BenchRequest, ignore_eos: bool, extra: dict) -> dict:
    params = {"max_new_tokens": req.output_len, "temperature": 0.0, "ignore_eos": ignore_eos}
    params.update(extra.get("sampling_params", {}))
    body = {"input_ids": req.prompt_ids, "sampling_params": params, "stream": True}
    body.update({k: v for k, v in extra.items() if k != "sampling_params"})
    return body


def openai_body(req: BenchRequest, model: str, ignore_eos: bool, extra: dict) -> dict:
    body = {
        "model": model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0.0,
        "stream": True, "ignore_eos": ignore_eos, "stream_options": {"include_usage": True},
    }
    body.update(extra)
    return body


async def send_request(session, backend: str, base_url: str, req: BenchRequest, *,
                       model: str = "default", ignore_eos: bool = True,
                       extra_body: dict | None = None) -> RequestResult:
    """Send one streaming request and time its chunks; never raises (errors land in the result)."""
    extra = extra_body or {}
    if backend == "batchyard":
        url, body = base_url + "/generate", native_body(req, ignore_eos, extra)
    elif backend in ("openai", "vllm"):
        url, body = base_url + "/v1/completions", openai_body(req, model, ignore_eos, extra)
        if backend == "vllm":
            body["prompt"] = req.prompt_ids
    elif backend == "llamacpp":
        url, body = base_url + "/completion", {**llamacpp_body(req, ignore_eos, stream=True), **extra}
    else:
        raise ValueError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")

    result = RequestResult(prompt_len=req.prompt_len)
    start = time.perf_counter()
    clock = _TokenClock(result, start)
    text, tokens = "", None
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                # On one line: a server other than the one meant answers with an HTML page.
                result.error = f"HTTP {response.status}: {' '.join((await response.text()).split())}"[:500]
                return result
            async for payload in _sse_payloads(response):
                result.latency = time.perf_counter() - start
                if payload == "[DONE]":
                    continue
                data = _chunk(payload, backend)
                if data is None:
                    result.error = f"not what the {backend} backend reads: the server sent {payload[:100]!r}"
                    return result
                if "error" in data:
                    result.error = str(data["error"])[:500]
                    return result
                if backend == "batchyard":
                    new_text = data.get("text", "")
                    count = (data.get("meta_info") or {}).get("completion_tokens")
                    grew = count > (tokens or 0) if count is not None else len(new_text) > len(text)
                    text = new_text
                elif backend == "llamacpp":
                    # One chunk per token (its text may be empty: half a UTF-8 character); the last
                    # chunk (stop) carries no new token, only the totals.
                    text += data.get("content", "")
                    if data.get("stop"):
                        count, grew = data.get("tokens_predicted"), False
                    else:
                        count, grew = (tokens or 0) + 1, True
                else:
                    choices = data.get("choices") or []
                    delta = choices[0].get("text", "") if choices else ""
                    count = (data.get("usage") or {}).get("completion_tokens")
                    # The usage chunk has no choices; it must not count as a token.
                    grew = bool(delta) or (bool(choices) and count is not None and count > (tokens or 0))
                    text += delta
                if count is not None:
                    tokens = count
                if grew:
                    clock.tick()
        result.generated_text = text
        result.output_len = tokens if tokens is not None else req.output_len
        result.success = clock.last is not None
        if not result.success:
            result.error = "the stream carried no tokens"
    except Exception as exc:  # a client benchmark reports failures, it does not stop on them
        result.error = f"{type(exc).__name__}: {exc}"[:500]
    return result


def client_session():
    """The benchmark's HTTP session: each request on a connection of its own, and no cap on them, as
    the reference, which opens a session per request. A server closes a kept-alive connection on
    its own terms (uvicorn and vLLM after 5 s idle, llama.cpp's server after some requests), and a
    request sent on one it is closing fails: with reuse, ~40 % of requests sent after 5 s idle to
    the old uvicorn default were reset, and 4-7 of 16 back-to-back requests to llama.cpp's server."""
    aiohttp = _aiohttp()
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, force_close=True),
        timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S), read_bufsize=READ_BUFSIZE,
    )


async def poisson_arrivals(requests: list[BenchRequest], rate: float,
                           rng: np.random.RandomState) -> AsyncIterator[BenchRequest]:
    """Yield requests with exponential gaps of mean 1/rate (none for rate = inf).

    Unlike the reference, no gap follows the last request: it would only stretch the duration.
    """
    for i, req in enumerate(requests):
        yield req
        if math.isinf(rate) or i == len(requests) - 1:
            continue
        await asyncio.sleep(rng.exponential(1.0 / rate))


async def _post_quietly(session, url: str) -> None:
    try:
        async with session.post(url) as response:
            if response.status != 200:
                logger.warning("POST %s answered %d", url, response.status)
    except Exception as exc:  # the endpoint is optional
        logger.warning("POST %s failed: %s", url, exc)


async def get_json(base_url: str, path: str, timeout: float = 5.0) -> dict | None:
    """GET a JSON document from the server, or None (used for optional server info)."""
    aiohttp = _aiohttp()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            async with session.get(base_url + path) as response:
                if response.status == 200:
                    return await response.json(content_type=None)
    except Exception:
        return None
    return None


async def run_serving(
    requests: list[BenchRequest],
    backend: str,
    base_url: str,
    *,
    model: str = "default",
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    warmup_requests: int = 1,
    ignore_eos: bool = True,
    seed: int = 1,
    flush_cache: bool = False,
    extra_body: dict | None = None,
    progress: bool = True,
) -> tuple[list[RequestResult], float]:
    """Warm up, then send every request and collect its result; returns (results, duration)."""
    from tqdm import tqdm

    base_url = base_url.rstrip("/")
    kwargs = dict(model=model, ignore_eos=ignore_eos, extra_body=extra_body)
    async with client_session() as session:
        if warmup_requests > 0:
            warm = [BenchRequest(r.prompt, r.prompt_ids, min(r.output_len, 32))
                    for r in requests[:warmup_requests]]
            logger.info("Warming up with %d request(s)", len(warm))
            outs = await asyncio.gather(*(send_request(session, backend, base_url, r, **kwargs) for r in warm))
            bad = [o for o in outs if not o.success]
            if bad:
                raise ValueError(f"the warm-up request to {base_url} failed (is the server running?): {bad[0].error}")
        if flush_cache:
            await _post_quietly(session, base_url + "/flush_cache")

        semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        pbar = tqdm(total=len(requests), disable=not progress, desc="serving", unit="req")

        async def one(req: BenchRequest) -> RequestResult:
            if semaphore is None:
                out = await send_request(session, backend, base_url, req, **kwargs)
            else:
                async with semaphore:
                    out = await send_request(session, backend, base_url, req, **kwargs)
            pbar.update(1)
            return out

        rng = np.random.RandomState(seed)
        start = time.perf_counter()
        tasks = []
        async for req in poisson_arrivals(requests, request_rate, rng):
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        pbar.close()
    return list(results), duration


def server_dtype(info) -> str | None:
    """The dtype setting a batchyard server reports in /get_server_info (its settings dump)."""
    if not isinstance(info, dict):
        return None
    model = info.get("model")
    return model.get("dtype") if isinstance(model, dict) else info.get("dtype")


def main(args) -> int:
    """CLI entry: build the workload, run it against the server, print and record the metrics."""
    from framework.bench.common import build_requests, load_bench_tokenizer
    from framework.bench.datasets import describe
    from framework.bench.metrics import compute_metrics
    from framework.bench.results import (ContentionMeter, append_jsonl, bench_args, format_report, hardware_info,
                                         make_record)

    base_url = args.base_url or f"http://{args.host}:{args.port}"
    tokenizer = load_bench_tokenizer(args.tokenizer)
    requests = build_requests(args, tokenizer)
    model = args.model
    if args.backend in ("openai", "vllm") and model is None:
        model = first_model(asyncio.run(get_json(base_url, "/v1/models")))
    extra = args.extra_request_body
    server_info = asyncio.run(get_json(base_url, "/get_server_info"))

    meter = ContentionMeter()
    results, duration = asyncio.run(run_serving(
        requests, args.backend, base_url, model=model or "default",
        request_rate=args.request_rate, max_concurrency=args.max_concurrency,
        warmup_requests=args.warmup_requests, ignore_eos=args.ignore_eos, seed=args.seed,
        flush_cache=args.flush_cache, extra_body=extra, progress=not args.disable_tqdm,
    ))
    metrics = compute_metrics(results, duration, tokenizer)
    failed = [r for r in results if not r.success]
    if failed:
        logger.warning("%d request(s) failed; first error: %s", len(failed), failed[0].error)
    print(format_report(f"Serving Benchmark ({args.backend}, rate {args.request_rate})", metrics))
    record = make_record(
        "serving", args.backend, bench_args(args), describe(requests), metrics,
        hardware_info(server_dtype(server_info), meter), request_rate=args.request_rate, base_url=base_url,
        server_info=server_info,
    )
    append_jsonl(args.output_file, record)
    return 0 if not failed else 1
