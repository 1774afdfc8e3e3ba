"""`batchyard sim validate`: one timed workload on the real engine and on the sim worker with a
calibrated profile, side by side, with the relative error of each metric.

The metrics are `batchyard bench serving`'s (framework/bench/metrics.py), computed from each run's
`RequestRecord`s: TTFT = first token - arrival, E2E = finish - arrival, ITL = gaps between a
request's token times. Error = (sim - real) / real. The real run's `other_cpu_busy` (the share of
the machine other processes used meanwhile) is stored with it: on a shared 2-core machine a busy
neighbour slows the real engine, not the simulated one.
"""

from __future__ import annotations

import copy
from typing import Any

import numpy as np

from framework.bench.metrics import RequestResult, compute_metrics
from framework.workload import RunResult, TimedRequest

#: The metrics compared, in table order.
COMPARED = (
    "output_throughput", "request_throughput",
    "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
    "mean_itl_ms", "median_itl_ms", "p99_itl_ms",
    "mean_e2e_latency_ms", "median_e2e_latency_ms", "p99_e2e_latency_ms",
)


def run_metrics(result: RunResult) -> dict[str, float]:
    """bench serving's metrics of a run, plus its length on its own clock and its retractions."""
    results = []
    for rec in result.records:
        done = rec.finish_s is not None and rec.first_token_s is not None
        results.append(RequestResult(
            success=done, prompt_len=rec.input_len, output_len=rec.output_len,
            ttft=rec.first_token_s - rec.arrival_s if done else 0.0,
            latency=rec.finish_s - rec.arrival_s if done else 0.0,
            itl=np.diff(rec.token_times).tolist() if done else [],
        ))
    m = compute_metrics(results, result.duration_s)
    m["num_retractions"] = result.num_retractions
    m["cache_hit_rate"] = result.cache_hit_rate
    m["wall_s"] = result.wall_s
    return m


def sim_overrides(real_overrides: dict[str, Any], profile: str) -> dict[str, Any]:
    """The real run's settings with the sim worker on the calibrated profile."""
    out = copy.deepcopy(real_overrides)
    out.setdefault("plugins", {})["worker"] = "sim"
    out.setdefault("plugin", {})["sim"] = {"cost_model": "profile", "profile": profile}
    return out


def relative_errors(real: dict[str, float], sim: dict[str, float]) -> dict[str, float | None]:
    return {k: (sim[k] - real[k]) / real[k] if real.get(k) else None for k in COMPARED}


def validate_rate(real_overrides: dict[str, Any], profile: str, requests: list[TimedRequest],
                  progress: bool = False) -> dict[str, Any]:
    """Run `requests` on both backends; {"real", "sim", "error", "other_cpu_busy", "sim_wall_s"}."""
    from framework.bench.results import ContentionMeter
    from framework.sim.driver import run_workload

    meter = ContentionMeter()
    real = run_metrics(run_workload(real_overrides, requests, "real", progress))
    busy = meter.other_busy_fraction()
    sim = run_metrics(run_workload(sim_overrides(real_overrides, profile), requests, "sim", progress))
    return {"real": real, "sim": sim, "error": relative_errors(real, sim), "other_cpu_busy": busy}


def sim_against_stored(real_row: dict[str, Any], real_overrides: dict[str, Any], profile: str,
                       requests: list[TimedRequest]) -> dict[str, Any]:
    """Like `validate_rate`, with the real side taken from an earlier run's stored row (to judge a
    new profile or fit against the same real measurements)."""
    from framework.sim.driver import run_workload

    real = real_row["real"]
    sim = run_metrics(run_workload(sim_overrides(real_overrides, profile), requests, "sim"))
    return {"real": real, "sim": sim, "error": relative_errors(real, sim),
            "other_cpu_busy": real_row.get("other_cpu_busy")}


def format_comparison(rate: float, row: dict[str, Any]) -> str:
    """A markdown table: metric, real, sim, relative error."""
    busy = row.get("other_cpu_busy")
    lines = [
        f"rate {rate:g} req/s (real run: other_cpu_busy {busy:.2f})" if busy is not None else f"rate {rate:g} req/s",
        "",
        "| metric | real | sim | error |",
        "|---|---:|---:|---:|",
    ]
    for key in COMPARED:
        err = row["error"][key]
        shown = "n/a" if err is None else f"{100 * err:+.1f} %"
        lines.append(f"| {key} | {row['real'][key]:.2f} | {row['sim'][key]:.2f} | {shown} |")
    return "\n".join(lines)
