"""Running cells: in this process (one job), a process pool, or a Ray cluster.

Each cell calls `framework.sim.driver.run_workload` with its settings and its workload's requests
and returns its result record (`run_cell`); the records come back in completion order under a tqdm
bar over cells and are sorted by cell index at the end.

Cells on the real backend time the model on the wall clock, so two of them sharing cores would slow
each other: `default_jobs` runs them one at a time unless --jobs says otherwise; run in this
process, each also shows a bar over its requests.
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from typing import Any, Callable, Iterable

from framework.experiment.metrics import cell_metrics
from framework.experiment.spec import Cell, Slo
from framework.workload import TimedRequest, describe

POOL_PRELOAD = (
    "framework.experiment.runner",
    "framework.sim.driver",
    "framework.engine",
    "plugins.workers.sim",
    "transformers.models.auto.configuration_auto",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.llama.configuration_llama",
)
RAY_MISSING = "--ray needs the ray package: pip install 'batchyard[cluster]'"


def default_jobs(backend: str) -> int:
    return 1 if backend == "real" else (os.cpu_count() or 1)


def run_cell(cell: Cell, requests: list[TimedRequest], slo: Slo, progress: bool = False) -> dict[str, Any]:
    """Run one cell and return its record (without the experiment-level fields); `progress`: a bar
    over its requests."""
    from framework.sim.driver import run_workload

    result = run_workload(cell.settings, requests, backend=cell.backend, progress=progress)
    metrics, dists = cell_metrics(result, slo)
    return {
        "cell": cell.index,
        "label": cell.label,
        "grid": cell.grid,
        "backend": cell.backend,
        "workload": {**cell.workload.model_dump(), **describe(requests)},
        "rate": cell.workload.rate,
        "seed": cell.workload.seed,
        "settings": cell.settings,
        "metrics": metrics,
        **dists,
    }


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, unit="cell", desc="experiment", disable=not enabled)


def run_cells(cells: list[Cell], workloads: dict[tuple, list[TimedRequest]], slo: Slo, *,
              jobs: int = 1, ray_address: str | None = None, progress: bool = True,
              on_record: Callable[[dict], None] | None = None) -> list[dict[str, Any]]:
    """Run every cell; records sorted by cell index. `on_record` sees each as it completes."""
    if ray_address is not None:
        done = _run_ray(cells, workloads, slo, ray_address, progress, on_record)
    elif jobs <= 1 or len(cells) == 1:
        done = []
        with _progress(len(cells), progress) as bar:
            for cell in cells:
                # A real cell runs for minutes: its own bar over requests, or the one over cells
                # would sit at 0 meanwhile (a sim cell takes seconds; many bars would be clutter).
                requests = workloads[cell.workload_key]
                done.append(run_cell(cell, requests, slo, progress=progress and cell.backend == "real"))
                _report(done[-1], bar, on_record)
    else:
        done = _run_pool(cells, workloads, slo, jobs, progress, on_record)
    return sorted(done, key=lambda r: r["cell"])


def _report(record: dict, bar, on_record) -> None:
    bar.update(1)
    if on_record is not None:
        on_record(record)


def _run_pool(cells, workloads, slo, jobs, progress, on_record) -> list[dict]:
    # Not fork: the parent has torch and a tokenizer loaded, whose thread pools a fork copies in an
    # unusable state. A fork server imports the engine once (before any thread pool starts) and
    # forks the workers from it, so they do not each pay the seconds of importing torch and the
    # transformers modules a worker's start-up reads the model config and tokenizer with.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(POOL_PRELOAD))
    done = []
    with ProcessPoolExecutor(max_workers=min(jobs, len(cells)), mp_context=ctx) as pool, \
            _progress(len(cells), progress) as bar:
        pending = {pool.submit(run_cell, c, workloads[c.workload_key], slo) for c in cells}
        try:
            while pending:
                finished, pending = wait(pending, return_when=FIRST_COMPLETED)
                for fut in finished:
                    done.append(fut.result())
                    _report(done[-1], bar, on_record)
        except BaseException:
            for fut in pending:
                fut.cancel()
            raise
    return done


def import_ray():
    """The ray module, or a ValueError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ValueError(RAY_MISSING) from None
    return ray


def _run_ray(cells: Iterable[Cell], workloads, slo, address: str, progress, on_record) -> list[dict]:
    """Cells as Ray tasks of one CPU each. `local` starts a Ray instance in this process (and
    stops it at the end); anything else is passed to ray.init (``auto``: the running cluster)."""
    ray = import_ray()
    cells = list(cells)
    started_here = not ray.is_initialized()
    if started_here:
        try:
            if address == "local":
                ray.init(include_dashboard=False, log_to_driver=False)
            else:
                ray.init(address=address, log_to_driver=False)
        except ConnectionError as exc:
            raise ValueError(f"--ray {address}: {exc}") from None
    try:
        task = ray.remote(num_cpus=1)(run_cell)
        slo_ref = ray.put(slo)
        request_refs = {key: ray.put(reqs) for key, reqs in workloads.items()}
        pending = [task.remote(c, request_refs[c.workload_key], slo_ref) for c in cells]
        done = []
        with _progress(len(cells), progress) as bar:
            while pending:
                finished, pending = ray.wait(pending, num_returns=1)
                done.append(ray.get(finished[0]))
                _report(done[-1], bar, on_record)
        return done
    finally:
        if started_here:
            ray.shutdown()
