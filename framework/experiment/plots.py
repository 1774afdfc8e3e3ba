"""Plots of an experiment's results (PNG, matplotlib), one row of panels per workload.

* latency_vs_rate.png: TTFT p50 and p99, ITL p99, E2E p99 against request rate, a line per grid point;
* throughput.png: output tokens/s and goodput against rate;
* cache_hit_rate.png: prefix cache hit rate against rate;
* ttft_cdf.png, itl_cdf.png: the distributions, one panel per rate;
* queue.png: waiting requests over run time (virtual time on sim), one panel per rate.

Metrics against rate are averaged over seeds; distributions and queues show the first seed.
Rates sit on a categorical axis so that inf (all at once) can be drawn, at the right end.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import numpy as np

MAX_RATE_PANELS = 4


def _workload(rec) -> str:
    return rec["workload"]["name"] or rec["workload"]["dataset"]


def _by_workload(records):
    groups = defaultdict(list)
    for rec in records:
        groups[_workload(rec)].append(rec)
    return dict(groups)


def _rates(records) -> list[float]:
    return sorted({float(r["rate"]) for r in records})


def _rate_text(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _labels(records) -> list[str]:
    return list(dict.fromkeys(r["label"] for r in sorted(records, key=lambda r: r["cell"])))


def _figure(rows: int, cols: int):
    import matplotlib

    matplotlib.use("Agg")  # no display on a server
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.6 * rows), squeeze=False)
    return plt, fig, axes


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _vs_rate(records, panels: list[tuple[str, str, str]], path: Path) -> Path:
    """Rows: workloads; columns: `panels` (metric key, title, y label)."""
    groups = _by_workload(records)
    plt, fig, axes = _figure(len(groups), len(panels))
    for row, (workload, recs) in enumerate(groups.items()):
        rates = _rates(recs)
        for col, (key, title, ylabel) in enumerate(panels):
            ax = axes[row][col]
            for label in _labels(recs):
                xs, ys = [], []
                for i, rate in enumerate(rates):
                    values = [r["metrics"].get(key) for r in recs
                              if r["label"] == label and float(r["rate"]) == rate]
                    values = [v for v in values if isinstance(v, (int, float))]
                    if values:
                        xs.append(i)
                        ys.append(float(np.mean(values)))
                ax.plot(xs, ys, "-o", label=label, markersize=4)
            ax.set_xticks(range(len(rates)), [_rate_text(r) for r in rates])
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel(ylabel)
            ax.set_title(f"{title} — {workload}", fontsize=10)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    return _save(plt, fig, path)


def _first_seed(recs):
    seed = min(r["seed"] for r in recs)
    return [r for r in recs if r["seed"] == seed]


def _per_rate(records, draw, title: str, path: Path) -> Path:
    """Rows: workloads; columns: rates (the highest MAX_RATE_PANELS); `draw(ax, record)` per grid point."""
    groups = {w: _first_seed(recs) for w, recs in _by_workload(records).items()}
    cols = max(min(len(_rates(recs)), MAX_RATE_PANELS) for recs in groups.values())
    plt, fig, axes = _figure(len(groups), cols)
    for row, (workload, recs) in enumerate(groups.items()):
        rates = _rates(recs)[-MAX_RATE_PANELS:]
        for col in range(cols):
            ax = axes[row][col]
            if col >= len(rates):
                ax.axis("off")
                continue
            for rec in sorted((r for r in recs if float(r["rate"]) == rates[col]), key=lambda r: r["cell"]):
                draw(ax, rec)
            ax.set_title(f"{title} — {workload} @ {_rate_text(rates[col])} req/s", fontsize=10)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    return _save(plt, fig, path)


def _cdf(key: str, xlabel: str):
    def draw(ax, rec):
        q = rec.get(key) or []
        if q:
            ax.plot(q, np.linspace(0, 1, len(q)), label=rec["label"])
        ax.set_xlabel(xlabel)
        ax.set_ylabel("fraction of requests" if "ttft" in key else "fraction of token gaps")

    return draw


def _queue(ax, rec):
    samples = rec.get("queue") or []
    if samples:
        t = [s[0] for s in samples]
        ax.step(t, [s[1] for s in samples], where="post", label=f"{rec['label']} waiting")
    ax.set_xlabel("run time (s)" + (", virtual" if rec.get("backend") == "sim" else ""))
    ax.set_ylabel("requests waiting")


def plot_experiment(records: list[dict], out_dir: Path) -> list[Path]:
    """Write every plot of the module docstring into `out_dir`; returns their paths."""
    out_dir = Path(out_dir)
    if not records:
        return []
    return [
        _vs_rate(records, [("median_ttft_ms", "TTFT p50", "ms"), ("p99_ttft_ms", "TTFT p99", "ms"),
                           ("p99_itl_ms", "ITL p99", "ms"), ("p99_e2e_latency_ms", "E2E p99", "ms")],
                 out_dir / "latency_vs_rate.png"),
        _vs_rate(records, [("output_throughput", "Output throughput", "tokens/s"),
                           ("goodput", "Goodput (SLO met)", "requests/s")], out_dir / "throughput.png"),
        _vs_rate(records, [("cache_hit_rate", "Prefix cache hit rate", "cached / prompt tokens")],
                 out_dir / "cache_hit_rate.png"),
        _per_rate(records, _cdf("ttft_ms_quantiles", "TTFT (ms)"), "TTFT CDF", out_dir / "ttft_cdf.png"),
        _per_rate(records, _cdf("itl_ms_quantiles", "ITL (ms)"), "ITL CDF", out_dir / "itl_cdf.png"),
        _per_rate(records, _queue, "Queue", out_dir / "queue.png"),
    ]
