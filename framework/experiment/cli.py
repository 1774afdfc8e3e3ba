"""`batchyard experiment ...`:

    batchyard experiment run exp.toml [--jobs N] [--ray ADDRESS] [--out DIR] [--dry-run]
    batchyard experiment report DIR [--no-plots]   # redraw table.md and the plots from DIR/results.jsonl

A bad experiment file stops `run` before any cell runs, with one line
``batchyard experiment: <problem>`` and exit status 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path


def add_experiment_parser(sub) -> None:
    """Register `experiment` and its commands under the main parser's subcommands."""
    exp = sub.add_parser("experiment", help="compare plugins over a grid of settings and workloads")
    cmds = exp.add_subparsers(dest="experiment_command", required=True)

    p = cmds.add_parser("run", help="run every cell of an experiment file")
    p.add_argument("file", help="experiment TOML (see docs/research.md)")
    p.add_argument("--jobs", type=int, help="cells run in parallel processes (default: cores; "
                   "1 for the real backend, whose timings parallel cells would distort)")
    p.add_argument("--ray", metavar="ADDRESS", help="run cells as Ray tasks: 'local' starts a Ray "
                   "instance here, 'auto' joins the running cluster, or a cluster address "
                   "(needs the 'cluster' extra)")
    p.add_argument("--out", help="output folder (default: the file's [experiment] out_dir)")
    p.add_argument("--dry-run", action="store_true", help="check the file and list the cells; run nothing")
    p.add_argument("--no-plots", action="store_true", help="write results.jsonl and table.md only")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.add_argument("--verbose", action="store_true", help="keep the scheduler's INFO logs")
    p.set_defaults(func=cmd_run)

    p = cmds.add_parser("report", help="redraw table.md and the plots from a results folder")
    p.add_argument("dir", help="folder holding results.jsonl")
    p.add_argument("--no-plots", action="store_true", help="redraw table.md only")
    p.set_defaults(func=cmd_report)


def _fail(message: str) -> int:
    print(f"batchyard experiment: {message}", file=sys.stderr)
    return 2


def cmd_run(args) -> int:
    from framework.experiment import report
    from framework.experiment.runner import default_jobs, import_ray, run_cells
    from framework.experiment.spec import ExperimentError, load_experiment

    if args.jobs is not None and args.jobs < 1:
        return _fail("--jobs must be at least 1")
    if not args.verbose:
        for name in ("framework", "plugins"):
            logging.getLogger(name).setLevel(logging.WARNING)
    try:
        if args.ray is not None:
            import_ray()
        exp = load_experiment(args.file)  # (--dry-run too: every workload is built, so a bad trace shows)
    except (ExperimentError, ValueError) as exc:
        return _fail(str(exc))
    out_dir = exp.out_dir(args.out)
    print(f"{exp.name}: {len(exp.cells)} cells on {exp.options.backend} -> {out_dir}", file=sys.stderr)
    if args.dry_run:
        for cell in exp.cells:
            w = cell.workload
            print(f"{cell.index:4d}  {w.label} @ {w.rate:g} req/s seed {w.seed}  {cell.label}")
        return 0

    problem = _unwritable(out_dir)  # before any cell runs, not after the sweep
    if problem:
        return _fail(f"output folder {out_dir}: cannot be made ({problem})")
    shared = report.experiment_fields(exp)
    partial = out_dir / report.RESULTS_FILE
    num_kept = 0

    def keep(record: dict) -> None:  # a crash late in a sweep keeps the finished cells
        nonlocal num_kept
        record.update(shared)
        if num_kept == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
            partial.write_text("")
        report.append_result(partial, record)
        num_kept += 1

    start = time.perf_counter()
    try:
        records = run_cells(exp.cells, exp.workloads, exp.slo,
                            jobs=args.jobs or default_jobs(exp.options.backend), ray_address=args.ray,
                            progress=not args.disable_tqdm, on_record=keep)
    except ValueError as exc:  # a cell's run refused its input, or --ray could not connect
        kept = f" ({num_kept} finished cells kept in {partial})" if num_kept else ""
        return _fail(f"{exc}{kept}")
    except OSError as exc:  # the output folder could not be written after all
        return _fail(f"output folder {out_dir}: cannot be written ({exc.strerror or exc})")
    wall = time.perf_counter() - start
    report.write_results(records, out_dir)
    table = report.write_table(records, out_dir)
    written = [report.RESULTS_FILE, table.name]
    if not args.no_plots:
        from framework.experiment.plots import plot_experiment

        written += [p.name for p in plot_experiment(records, out_dir)]
    print(table.read_text())
    print(f"{len(records)} cells in {wall:.1f} s; wrote {', '.join(written)} to {out_dir}", file=sys.stderr)
    return 0


def _unwritable(out_dir: Path) -> str | None:
    """Why `out_dir` cannot be made or written into, or None (nothing is created here)."""
    if out_dir.exists():
        if not out_dir.is_dir():
            return "a file of that name exists"
        return None if os.access(out_dir, os.W_OK) else "not writable"
    parent = out_dir.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is a file"
    return None if os.access(parent, os.W_OK) else f"{parent} is not writable"


def cmd_report(args) -> int:
    from framework.experiment import report
    from framework.experiment.plots import plot_experiment

    out_dir = Path(args.dir)
    try:
        records = report.read_results(out_dir)
    except OSError as exc:
        return _fail(f"{out_dir}: cannot read {report.RESULTS_FILE} ({exc.strerror or exc})")
    except ValueError as exc:
        return _fail(str(exc))
    report.write_table(records, out_dir)
    paths = [] if args.no_plots else plot_experiment(records, out_dir)
    print(report.render_table(records))
    print(f"wrote {', '.join([report.TABLE_FILE] + [p.name for p in paths])} to {out_dir}", file=sys.stderr)
    return 0

