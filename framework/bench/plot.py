"""`batchyard bench plot results.jsonl -o out.png`: charts comparing the runs of a results file.

Panels (each only when the file has such runs):
  1. output throughput of every offline and serving run (bars);
  2. one-batch prefill and median decode throughput per (bs, in, out) (bars);
  3. serving TTFT median / p99 against request rate, one line per (backend, dataset);
  4. serving ITL median / p99 against request rate, likewise.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict

from framework.bench.results import read_jsonl


def _rate(record) -> float:
    value = record.get("request_rate", record.get("args", {}).get("request_rate", "inf"))
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.inf


def run_label(record) -> str:
    """Short name of a run for an axis label."""
    tool, backend, dataset = record.get("tool"), record.get("backend"), record.get("dataset")
    label = f"{tool}:{backend}\n{dataset}"
    if tool == "serving":
        label += f" @{_rate(record):g}/s"
    notes = [record.get("hf_mode"), (record.get("hardware") or {}).get("dtype")]
    return label + "\n" + " ".join(n for n in notes if n)


def _bars(ax, labels, series: dict[str, list[float]], ylabel: str, title: str) -> None:
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        xs = [x + (i - (len(series) - 1) / 2) * width for x in range(len(labels))]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if len(series) > 1:
        ax.legend(fontsize=8)


def _latency_vs_rate(ax, serving, metric: str, title: str) -> None:
    groups = defaultdict(list)
    for r in serving:
        groups[(r.get("backend"), r.get("dataset"))].append(r)
    rates = sorted({_rate(r) for r in serving})
    # inf (all at once) sits at the right end of a categorical axis.
    pos = {rate: i for i, rate in enumerate(rates)}
    for (backend, dataset), runs in groups.items():
        runs.sort(key=_rate)
        xs = [pos[_rate(r)] for r in runs]
        for stat, style in (("median", "-o"), ("p99", "--s")):
            ys = [r["metrics"].get(f"{stat}_{metric}_ms", 0.0) for r in runs]
            ax.plot(xs, ys, style, label=f"{backend}/{dataset} {stat}")
    ax.set_xticks(range(len(rates)), [f"{r:g}" for r in rates])
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("ms")
    ax.set_title(title)
    ax.legend(fontsize=7)


def plot_results(records: list[dict], out_path: str) -> str:
    """Draw the panels for `records` into `out_path` (PNG); returns the path."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a server
    import matplotlib.pyplot as plt

    throughput = [r for r in records if r.get("tool") in ("offline", "serving")]
    one_batch = [r for r in records if r.get("tool") == "one-batch"]
    serving = [r for r in records if r.get("tool") == "serving"]
    panels = []
    if throughput:
        panels.append(lambda ax: _bars(
            ax, [run_label(r) for r in throughput],
            {"output tok/s": [r["metrics"].get("output_throughput", 0.0) for r in throughput]},
            "output tokens/s", "Output throughput"))
    if one_batch:
        labels = [f"bs={r['metrics']['batch_size']} in={r['metrics']['input_len']}\nout={r['metrics']['output_len']}"
                  for r in one_batch]
        panels.append(lambda ax: _bars(
            ax, labels,
            {"prefill tok/s": [r["metrics"]["prefill_throughput"] for r in one_batch],
             # (None: a point without decode steps; no bar)
             "decode tok/s (median step)": [r["metrics"]["median_decode_throughput"] or 0.0 for r in one_batch]},
            "tokens/s", "One batch"))
    if serving:
        panels.append(lambda ax: _latency_vs_rate(ax, serving, "ttft", "TTFT"))
        panels.append(lambda ax: _latency_vs_rate(ax, serving, "itl", "ITL"))
    if not panels:
        raise ValueError("no offline, serving or one-batch records to plot")

    fig, axes = plt.subplots(len(panels), 1, figsize=(max(8, 2.2 * len(throughput)), 4 * len(panels)),
                             squeeze=False)
    for draw, ax in zip(panels, axes[:, 0]):
        draw(ax)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path


# What the one-batch panel reads of a record's metrics (the decode one None without a decode step).
ONE_BATCH_FIELDS = ("batch_size", "input_len", "output_len", "prefill_throughput", "median_decode_throughput")


def unplottable(record: dict) -> str | None:
    """Why the panels cannot draw a record with metrics (a field they read missing or not an
    object), or None."""
    for key in ("args", "hardware"):
        if key in record and not isinstance(record[key], dict):
            return f"its {key} is not a JSON object"
    if record.get("tool") == "one-batch":
        missing = [key for key in ONE_BATCH_FIELDS if key not in record["metrics"]]
        if missing:
            return f"a one-batch record without {', '.join(missing)} in its metrics"
    return None


def main(args) -> int:
    records = []
    for path in args.results:
        for number, record in enumerate(read_jsonl(path), 1):
            if not isinstance(record.get("metrics"), dict):
                continue
            problem = unplottable(record)
            if problem:  # (it failed in the middle of drawing, with a KeyError naming no file)
                raise ValueError(f"{path}: record {number} cannot be plotted: {problem}")
            records.append(record)
    folder = os.path.dirname(os.path.abspath(args.output))
    os.makedirs(folder, exist_ok=True)  # (as --output-file's folders are)
    print(plot_results(records, args.output))
    return 0
