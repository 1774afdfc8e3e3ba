"""Serving metrics, computed as SGLang's bench_serving `calculate_metrics` does.

Over successful requests only:

* request / input / output / total throughput = count or token sum / benchmark duration;
* TTFT: send to the first streamed chunk that carries a token;
* ITL: the gap between successive token-carrying chunks, pooled over all requests;
* TPOT per request: (E2E - TTFT) / (output_len - 1), only for requests with more than one token;
* E2E latency: send to the last chunk of the stream;
* concurrency: sum of E2E latencies / duration (how many requests were in flight on average).

Latencies are reported in milliseconds, with mean, median, std, p90 and p99 (numpy's linear
interpolation, as the reference).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

PERCENTILES = (90, 99)


@dataclass
class RequestResult:
    """What the client observed for one request (times in seconds)."""

    success: bool = False
    prompt_len: int = 0
    output_len: int = 0  # tokens generated: the server's completion_tokens, else the requested length
    ttft: float = 0.0
    latency: float = 0.0  # E2E
    itl: list[float] = field(default_factory=list)
    generated_text: str = ""
    error: str = ""


def summarize(values: Iterable[float], scale: float = 1000.0) -> dict[str, float]:
    """mean/median/std/p90/p99 of `values` times `scale` (s -> ms); zeros for no values."""
    arr = np.asarray(list(values), dtype=np.float64) * scale
    if arr.size == 0:
        return {"mean": 0.0, "median": 0.0, "std": 0.0, **{f"p{p}": 0.0 for p in PERCENTILES}}
    stats = {"mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std())}
    for p in PERCENTILES:
        stats[f"p{p}"] = float(np.percentile(arr, p))
    return stats


def compute_metrics(results: list[RequestResult], duration: float, tokenizer=None) -> dict[str, float]:
    """The flat metrics dict of one serving run (see the module docstring).

    With a tokenizer, also the retokenized output count (re-encoding each generated text), which
    exposes a server that reports more tokens than it produced.
    """
    ok = [r for r in results if r.success]
    ttfts = [r.ttft for r in ok]
    e2es = [r.latency for r in ok]
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    itls = [gap for r in ok for gap in r.itl]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    duration = max(duration, 1e-9)

    m: dict[str, float] = {
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "input_throughput": total_in / duration,
        "output_throughput": total_out / duration,
        "total_throughput": (total_in + total_out) / duration,
        "concurrency": sum(e2es) / duration,
    }
    if tokenizer is not None:
        retok = sum(len(tokenizer.encode(r.generated_text, add_special_tokens=False)) for r in ok)
        m["total_output_tokens_retokenized"] = retok
        m["output_throughput_retokenized"] = retok / duration
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2e_latency", e2es)):
        for stat, value in summarize(values).items():
            m[f"{stat}_{name}_ms"] = value
    return m


def offline_metrics(num: int, in_tokens: int, out_tokens: int, elapsed: float) -> dict[str, float]:
    """Offline throughput (bench_offline_throughput's): counts and token sums over wall time."""
    elapsed = max(elapsed, 1e-9)
    return {
        "duration_s": elapsed,
        "completed": num,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": num / elapsed,
        "input_throughput": in_tokens / elapsed,
        "output_throughput": out_tokens / elapsed,
        "total_throughput": (in_tokens + out_tokens) / elapsed,
    }
