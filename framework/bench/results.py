"""Result records: one JSON line per run, with the settings, the workload, the metrics and the
hardware, so that a results file alone says what was measured where."""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import platform
import sys
import tempfile
import time
from typing import Any, Iterator

from framework.preload import running_allocator

logger = logging.getLogger(__name__)


def _first_cpu() -> dict[str, str]:
    """The first CPU's fields in /proc/cpuinfo ("model name", "flags", ...; empty where there is none)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first CPU is enough
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (platform.processor() where there is none)."""
    return _first_cpu().get("model name") or platform.processor()


# The instruction sets that decide which kernels run (framework/model/cpu_kernels.py), as /proc/cpuinfo names them.
_KERNEL_ISA = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_kind() -> dict[str, Any]:
    """What the model name leaves out: under a hypervisor different CPUs report the same name
    ("Intel(R) Xeon(R) Processor"), so records also carry the vendor, family and model, which of
    the kernels' instruction sets the CPU has (`isa`), and an ONEDNN_MAX_CPU_ISA in the
    environment (a run with oneDNN held below the CPU, as the no-AMX proxy in docs/performance.md),
    and the memory allocator the engine ran on (tcmalloc or glibc: framework.preload)."""
    fields = _first_cpu()
    flags = set(fields.get("flags", "").split())
    return {
        "vendor": fields.get("vendor_id"),
        "family": fields.get("cpu family"),
        "model": fields.get("model"),
        "isa": [name for name in _KERNEL_ISA if name in flags],
        "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA"),
        "allocator": running_allocator(),  # this process's (framework.preload)
    }


def _busy_cpu_seconds() -> float | None:
    """CPU seconds all processes of the machine spent busy since boot (from /proc/stat)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of one process (all its threads), from /proc/PID/stat; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class ContentionMeter:
    """How busy the machine was with *other* processes during a measurement.

    On a 2-core box a second runnable process slows a 2-thread forward several times
    (perf-anchors §5.6), so every record says how much CPU the rest of the machine used:
    (machine busy CPU - this process's CPU) / (wall time * cores), 0 = idle, 1 = all cores,
    clamped to that range. `pids` are processes measured together with this one (a peer engine's
    server) whose CPU is not "other" either. For `serving` the server itself counts as "other".
    """

    def __init__(self, pids: tuple[int, ...] = ()):
        self.pids = tuple(pids)
        self.start_busy = _busy_cpu_seconds()
        self.start_own = self._own()
        self.start_wall = time.perf_counter()

    def _own(self) -> float:
        t = os.times()
        return t.user + t.system + sum(process_cpu_seconds(pid) for pid in self.pids)

    def other_busy_fraction(self) -> float | None:
        busy = _busy_cpu_seconds()
        if busy is None or self.start_busy is None:
            return None
        own = self._own() - self.start_own
        wall = max(time.perf_counter() - self.start_wall, 1e-9)
        return min(1.0, max(0.0, (busy - self.start_busy - own) / (wall * (os.cpu_count() or 1))))


def hardware_info(dtype: str | None = None, meter: ContentionMeter | None = None) -> dict[str, Any]:
    """CPU (its name and `cpu_kind`), cores, threads, library versions and the dtype measured.

    With a `meter`, also the share of CPU other processes used meanwhile (`ContentionMeter`).
    """
    import torch

    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:  # pragma: no cover - transformers is a dependency
        tf_version = None
    info = {
        "cpu": cpu_model(),
        "cpu_kind": cpu_kind(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": tf_version,
        "python": platform.python_version(),
        "dtype": dtype,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    if meter is not None:
        info["other_cpu_busy"] = meter.other_busy_fraction()
    return info


def _jsonable(value: Any) -> Any:
    """Strict-JSON form: inf/nan floats become strings (json.dumps would write Infinity)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def bench_args(args) -> dict[str, Any]:
    """The tool's own options from an argparse namespace (engine settings are stored apart)."""
    return {
        k: v for k, v in vars(args).items()
        if not k.startswith("set:") and k not in ("func", "command", "bench_command")
    }


def make_record(tool: str, backend: str, args: dict, workload: dict, metrics: dict,
                hardware: dict, **extra: Any) -> dict[str, Any]:
    """One result line. `extra` holds tool-specific fields (engine settings, HF mode, ratios)."""
    record = {
        "tool": tool,
        "backend": backend,
        "dataset": args.get("dataset"),
        "timestamp": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "args": args,
        "workload": workload,
        "metrics": metrics,
        "hardware": hardware,
    }
    record.update(extra)
    return _jsonable(record)


def append_jsonl(path: str | None, record: dict) -> None:
    """Append one line to `path` (no-op for None), creating folders as needed."""
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def check_output_file(path: str | None) -> None:
    """ValueError, before a run, when `--output-file` could not be appended to (its results were
    lost after the whole run). Tried, not judged by permission bits (which root passes everywhere,
    /proc included): the file opened for appending, or a file made and removed in its folder."""
    if not path:
        return
    if os.path.isdir(path):
        raise ValueError(f"--output-file {path}: is a folder")
    if os.path.exists(path):
        try:
            with open(path, "a", encoding="utf-8"):
                pass
        except OSError as exc:
            raise ValueError(f"--output-file {path}: not writable ({exc.strerror or exc})") from None
        return
    folder = os.path.dirname(os.path.abspath(path))
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    try:
        if not os.path.isdir(existing):
            raise NotADirectoryError(f"{existing} is not a folder")
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise ValueError(f"--output-file {path}: cannot be created ({existing} is not a writable folder: "
                         f"{exc.strerror or exc})") from None


def json_object_lines(lines, path: Any, appended: bool = False) -> Iterator[tuple[int, dict]]:
    """(line number, object) of each non-blank line of a JSONL file; ValueError naming the file
    and the line of one that is not JSON or not a JSON object. `appended` (`lines` as read, with
    their newlines, from a file written a record at a time): a last line cut short, not JSON and
    without its newline, is what a run stopped while writing it leaves: skipped with a warning."""
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if appended and not line.endswith("\n"):
                logger.warning("%s line %d: cut short (a run stopped while writing it?); skipped", path, number)
                return
            raise ValueError(f"{path} line {number}: not JSON ({exc.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path} line {number}: expected a JSON object, got {type(record).__name__}")
        yield number, record


def read_jsonl(path: str) -> list[dict]:
    """Every record of a results file; blank lines are skipped. ValueError naming the file and
    the line for what is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return [record for _, record in json_object_lines(lines, path, appended=True)]


def format_report(title: str, metrics: dict[str, Any]) -> str:
    """A two-column table of the metrics, in the reference's style."""
    width = 50
    lines = [f"{' ' + title + ' ':=^{width}}"]
    for key, value in metrics.items():
        if value is None:
            shown = "n/a"
        elif isinstance(value, float):
            # Latencies in seconds need more digits than throughputs.
            shown = f"{value:.4f}" if abs(value) < 10 else f"{value:.2f}"
        else:
            shown = str(value)
        lines.append(f"{key:<{width - 14}}{shown:>14}")
    lines.append("=" * width)
    return "\n".join(lines)
