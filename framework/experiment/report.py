"""The results of an experiment: `results.jsonl` (one line per cell) and `table.md`.

A line holds the cell's grid point and label, the full settings overrides, the workload (its spec
and size), the metrics (`framework.experiment.metrics`), the TTFT/ITL quantiles, the queue samples
and per-client service, so that the table and the plots can be redrawn from the file alone
(`batchyard experiment report DIR`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from framework.bench.results import _jsonable, cpu_model, json_object_lines

RESULTS_FILE = "results.jsonl"
TABLE_FILE = "table.md"

# (header, metric key, format): the table's metric columns; "ms": digits by magnitude.
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("req/s", "request_throughput", "{:.2f}"),
    ("out tok/s", "output_throughput", "{:.0f}"),
    ("TTFT mean", "mean_ttft_ms", "ms"),
    ("TTFT p50", "median_ttft_ms", "ms"),
    ("TTFT p90", "p90_ttft_ms", "ms"),
    ("TTFT p99", "p99_ttft_ms", "ms"),
    ("ITL p50", "median_itl_ms", "ms"),
    ("ITL p99", "p99_itl_ms", "ms"),
    ("E2E p50", "median_e2e_latency_ms", "ms"),
    ("E2E p99", "p99_e2e_latency_ms", "ms"),
    ("goodput", "goodput", "{:.2f}"),
    ("SLO %", "slo_attainment", "{:.0%}"),
    ("hit rate", "cache_hit_rate", "{:.1%}"),
    ("retract", "num_retractions", "{:d}"),
    ("Jain", "jain_fairness", "{:.3f}"),
    ("Jain all-busy", "jain_fairness_all_busy", "{:.3f}"),
)


def experiment_fields(exp) -> dict[str, Any]:
    """What every line of one experiment shares."""
    return {
        "experiment": exp.name,
        "file": str(exp.path),
        "slo": exp.slo.model_dump(),
        "host": {"cpu": cpu_model()},
    }


def write_results(records: list[dict], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / RESULTS_FILE
    with open(path, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(_jsonable(rec)) + "\n")
    return path


def append_result(path: Path, record: dict) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(_jsonable(record)) + "\n")


# What every record of results.jsonl has (run_cells writes them; the table and plots read them).
RECORD_KEYS = ("cell", "label", "grid", "seed", "rate", "backend", "workload", "metrics")


def read_results(out_dir: Path) -> list[dict]:
    """The records of `out_dir`'s results.jsonl; ValueError naming the file and line of the first
    one that is not JSON or not a record of an experiment (OSError where it cannot be read)."""
    path = Path(out_dir) / RESULTS_FILE
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, record in json_object_lines(f, path, appended=True):
            missing = [k for k in RECORD_KEYS if k not in record]
            if missing:
                raise ValueError(f"{path} line {lineno}: not an experiment record (no {', '.join(missing)})")
            records.append(record)
    return records


def _rate(record: dict) -> float:
    return float(record["rate"])  # "inf" is stored as a string and reads back as inf


def _rate_text(record: dict) -> str:
    """The rate column: a trace's requests arrive at the trace's own times, not at a rate."""
    if record["workload"].get("dataset") == "trace":
        return "trace"
    rate = _rate(record)
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _cell_text(value: Any, fmt: str) -> str:
    if value is None:
        return "–"
    if isinstance(value, str):
        return value
    if fmt == "{:d}":
        value = int(value)
    if fmt == "ms":  # sub-millisecond gaps on fast simulated hardware still show
        fmt = "{:.2f}" if abs(value) < 10 else "{:.1f}" if abs(value) < 100 else "{:.0f}"
    return fmt.format(value)


def render_table(records: list[dict]) -> str:
    """A markdown table, one row per cell, grouped by workload then rate (latencies in ms); when
    requests carry client ids, a second table of per-client service."""
    if not records:
        return "(no results)\n"
    grid_keys = list(dict.fromkeys(k for r in records for k in r["grid"]))  # merged files: every file's
    show_seed = len({r["seed"] for r in records}) > 1
    has_clients = any("jain_fairness" in r["metrics"] for r in records)
    columns = [c for c in COLUMNS if not c[1].startswith("jain_fairness") or has_clients]
    # Merged result files may mix backends and SLOs: then each row says its own.
    per_row_backend = len({r["backend"] for r in records}) > 1
    per_row_slo = len({_slo_text(r.get("slo") or {}) for r in records}) > 1
    headers = ["workload", "rate"] + (["seed"] if show_seed else []) + (["backend"] if per_row_backend else [])
    headers += (["SLO"] if per_row_slo else [])
    headers += [k.rsplit(".", 1)[-1] for k in grid_keys] + [c[0] for c in columns]
    slo = "each row's SLO" if per_row_slo else _slo_text(records[0].get("slo") or {})
    backend = "backend per row" if per_row_backend else f"backend {records[0]['backend']}"
    lines = [
        f"Latencies in ms; goodput in good requests/s ({slo}); {backend}.",
        "",
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---" if i < 2 else "---:" for i in range(len(headers))) + "|",
    ]
    ordered = sorted(records, key=lambda r: (r["workload"]["name"] or r["workload"]["dataset"], _rate(r),
                                             r["seed"], r["cell"]))
    for rec in ordered:
        row = [rec["workload"]["name"] or rec["workload"]["dataset"], _rate_text(rec)]
        if show_seed:
            row.append(str(rec["seed"]))
        if per_row_backend:
            row.append(rec["backend"])
        if per_row_slo:
            row.append(_slo_text(rec.get("slo") or {}).removeprefix("SLO "))
        row += [str(rec["grid"][k]) if k in rec["grid"] else "–" for k in grid_keys]
        row += [_cell_text(rec["metrics"].get(key), fmt) for _, key, fmt in columns]
        lines.append("| " + " | ".join(row) + " |")
    if has_clients:
        lines += ["", *_client_table(ordered, show_seed)]
    return "\n".join(lines) + "\n"


def _client_table(ordered: list[dict], show_seed: bool) -> list[str]:
    """Per-client service of every cell whose workload has client ids."""
    headers = ["workload", "rate"] + (["seed"] if show_seed else []) + [
        "cell", "client", "requests", "served tokens", "tok/s", "TTFT mean", "all-busy tokens", "all-busy tok/s"]
    lines = ["Per client (served tokens: prompt + output of completed requests; all-busy: served while "
             "every client had work left, until the first one's last request finished):", "",
             "| " + " | ".join(headers) + " |",
             "|" + "|".join("---" if i < 2 else "---:" for i in range(len(headers))) + "|"]
    for rec in ordered:
        for client, c in (rec.get("clients") or {}).items():
            row = [rec["workload"]["name"] or rec["workload"]["dataset"], _rate_text(rec)]
            if show_seed:
                row.append(str(rec["seed"]))
            row += [rec["label"], client, str(c["num_requests"]), str(c["served_tokens"]),
                    f"{c['token_throughput']:.0f}", _cell_text(c["mean_ttft_ms"], "ms"),
                    str(c.get("all_busy_tokens", "–")), _cell_text(c.get("all_busy_throughput"), "{:.0f}")]
            lines.append("| " + " | ".join(row) + " |")
    return lines


def _slo_text(slo: dict) -> str:
    given = [f"{k.removesuffix('_ms').upper()} ≤ {v:g} ms" for k, v in slo.items() if v is not None]
    return "SLO " + ", ".join(given) if given else "no SLO given: every completed request counts"


def write_table(records: list[dict], out_dir: Path) -> Path:
    path = Path(out_dir) / TABLE_FILE
    path.write_text(render_table(records), encoding="utf-8")
    return path
