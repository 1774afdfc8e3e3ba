"""Metrics of one cell, from its `RunResult`.

Latency and throughput metrics are `framework.bench.metrics.compute_metrics`'s, fed with one
`RequestResult` per completed request (TTFT = first token - arrival, E2E = finish - arrival, ITL =
gaps between token times), so a simulated cell and `batchyard bench serving` report the same
quantities under the same names (``median_*`` is p50); throughputs are per second from the first
arrival to the last finish. Added here:

* goodput: completed requests meeting every SLO given, per second of run time; ``slo_attainment``
  is their share of all requests. The ITL objective applies to the request's mean gap (its TPOT).
* cache hit rate and retractions, as the run counted them;
* per client (when requests carry client ids): requests, tokens served (prompt + output), token
  throughput and mean TTFT; and Jain's fairness index over the clients' served tokens,
  (Σx)² / (n·Σx²): 1 when every client got the same service, 1/n when one got all of it;
* the same while every client had work left (``jain_fairness_all_busy``): tokens served up to the
  moment the first client's last request finished (a prompt counts once its first token came,
  an output token at its time). Over a whole run that completes every request, served tokens
  are each client's demand whatever the policy; only while all clients still want service does
  the scheduler's choice of whom to serve show;
* distributions for plots: 101 quantiles of TTFT and ITL, and the queue samples thinned to at
  most `MAX_QUEUE_POINTS`.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np

from framework.bench.metrics import RequestResult, compute_metrics
from framework.workload import RequestRecord, RunResult

MAX_QUEUE_POINTS = 400
QUANTILES = np.linspace(0, 100, 101)


def _request_result(rec: RequestRecord) -> RequestResult:
    done = rec.finish_s is not None and rec.first_token_s is not None
    if not done:
        return RequestResult(success=False, prompt_len=rec.input_len)
    return RequestResult(
        success=True,
        prompt_len=rec.input_len,
        output_len=rec.output_len,
        ttft=rec.first_token_s - rec.arrival_s,
        latency=rec.finish_s - rec.arrival_s,
        itl=np.diff(rec.token_times).tolist() if len(rec.token_times) > 1 else [],
    )


def _meets_slo(res: RequestResult, slo) -> bool:
    if not res.success:
        return False
    if slo.ttft_ms is not None and res.ttft * 1000 > slo.ttft_ms:
        return False
    if slo.e2e_ms is not None and res.latency * 1000 > slo.e2e_ms:
        return False
    if slo.itl_ms is not None and res.output_len > 1:
        tpot = (res.latency - res.ttft) / (res.output_len - 1)
        if tpot * 1000 > slo.itl_ms:
            return False
    return True


def jain_index(values: list[float]) -> float:
    """Jain's fairness index of `values` (1.0 for an empty or all-zero list: nothing to be unfair about)."""
    x = np.asarray(values, dtype=np.float64)
    denom = len(x) * float((x * x).sum())
    return float(x.sum() ** 2 / denom) if denom > 0 else 1.0


def served_by(rec: RequestRecord, t: float) -> int:
    """Tokens `rec` was served by time `t`: its prompt once the first token came, and its outputs."""
    if rec.first_token_s is None or rec.first_token_s > t:
        return 0
    return rec.input_len + sum(1 for s in rec.token_times if s <= t)


def all_busy_until(by_client: dict[str, list[RequestRecord]]) -> float | None:
    """When the first client's last request finished (None: some client never finished them all)."""
    ends = []
    for recs in by_client.values():
        if any(r.finish_s is None for r in recs):
            return None
        ends.append(max(r.finish_s for r in recs))
    return min(ends) if ends else None


def client_service(records: list[RequestRecord], duration: float) -> dict[str, dict[str, float]]:
    """Per client id: requests, tokens served (prompt + output), tokens/s and mean TTFT (ms); and
    tokens served and tokens/s while every client had work left (``all_busy_*``)."""
    by_client: dict[str, list[RequestRecord]] = defaultdict(list)
    for rec in records:
        if rec.client_id is not None:
            by_client[rec.client_id].append(rec)
    start = min((r.arrival_s for r in records), default=0.0)  # the window opens at the first arrival
    busy_end = all_busy_until(by_client)
    if busy_end is None:
        busy_end = start + duration
    out = {}
    for client, recs in sorted(by_client.items()):
        done = [r for r in recs if r.finish_s is not None]
        tokens = sum(r.input_len + r.output_len for r in done)
        ttfts = [r.first_token_s - r.arrival_s for r in done if r.first_token_s is not None]
        out[client] = {
            "num_requests": len(recs),
            "completed": len(done),
            "served_tokens": tokens,
            "token_throughput": tokens / max(duration, 1e-9),
            "mean_ttft_ms": 1000 * float(np.mean(ttfts)) if ttfts else 0.0,
            "all_busy_s": busy_end,
            "all_busy_tokens": sum(served_by(r, busy_end) for r in recs),
        }
        out[client]["all_busy_throughput"] = out[client]["all_busy_tokens"] / max(busy_end - start, 1e-9)
    return out


def _thin(samples: list[tuple[float, int, int]]) -> list[list[float]]:
    step = max(1, -(-len(samples) // MAX_QUEUE_POINTS))
    return [list(s) for s in samples[::step]]


def _quantiles(values: list[float]) -> list[float]:
    if not values:
        return []
    return (np.percentile(np.asarray(values) * 1000, QUANTILES)).tolist()


def time_mean_waiting(samples: list[tuple[float, int, int]]) -> float:
    """The waiting queue's length averaged over time: each (time, waiting, running) sample, taken
    after a scheduler iteration, holds until the next (a mean over iterations weighed the short
    iterations of a drained queue like the long ones of a full one)."""
    if len(samples) < 2:
        return float(samples[0][1]) if samples else 0.0
    times = np.array([t for t, _, _ in samples])
    waiting = np.array([w for _, w, _ in samples], dtype=np.float64)
    span = times[-1] - times[0]
    if span <= 0:
        return float(waiting.mean())
    return float((waiting[:-1] * np.diff(times)).sum() / span)


def cell_metrics(result: RunResult, slo) -> tuple[dict[str, Any], dict[str, Any]]:
    """(metrics, distributions) of one run: flat numbers for the table, lists for the plots."""
    results = [_request_result(r) for r in result.records]
    # Throughputs are over the first arrival to the last finish: a trace cut from a longer log
    # starts late, and its idle lead-in would divide them all.
    start = min((r.arrival_s for r in result.records), default=0.0)
    duration = max(result.duration_s - start, 1e-9)
    m = compute_metrics(results, duration)
    good = sum(_meets_slo(r, slo) for r in results)
    m["goodput"] = good / duration
    m["slo_attainment"] = good / len(results) if results else 0.0
    m["cache_hit_rate"] = result.cache_hit_rate
    m["num_retractions"] = result.num_retractions
    m["wall_s"] = result.wall_s
    waiting = [w for _, w, _ in result.queue_samples]
    m["max_waiting"] = max(waiting, default=0)
    m["mean_waiting"] = time_mean_waiting(result.queue_samples)
    clients = client_service(result.records, duration)
    if clients:
        m["jain_fairness"] = jain_index([c["served_tokens"] for c in clients.values()])
        m["jain_fairness_all_busy"] = jain_index([c["all_busy_tokens"] for c in clients.values()])
    ok = [r for r in results if r.success]
    dists = {
        "ttft_ms_quantiles": _quantiles([r.ttft for r in ok]),
        "itl_ms_quantiles": _quantiles([gap for r in ok for gap in r.itl]),
        "queue": _thin(result.queue_samples),
        "clients": clients,
    }
    return m, dists
