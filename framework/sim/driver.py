"""Run a timed workload on the `sim` worker (virtual clock) or the real Engine (wall clock).

    from framework.sim.driver import run_workload
    result = run_workload({"plugins": {"policy": "lpm"}}, requests, backend="sim")

One loop for both backends, the in-process Engine's scheduler driven directly (no HTTP): every
request is sent to the scheduler at the first iteration that starts at or after its `arrival_s`
(as a server's scheduler receives requests between iterations); when nothing runs, the run waits for
the next arrival: the virtual clock jumps to it, the wall clock sleeps until it. Times come from
the scheduler's clock (`framework.clock`): the sim worker's virtual clock, or the wall clock.

Requests ignore EOS and generate exactly their `output_len` tokens, greedily. A token's time is the
moment its batch's result was processed (when a server would stream it). The run ends with an idle
iteration and the leak check as an error (`scheduler.check_leaks` on unless the overrides say
otherwise). The real backend first warms up on a few random requests and flushes the cache.
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Any

from framework import hookimpl
from framework.config import Settings
from framework.messages import GenerateReqInput
from framework.request import SamplingParams
from framework.workload import RequestRecord, RunResult, TimedRequest

logger = logging.getLogger(__name__)

BACKENDS = ("sim", "real")
SIM_WORKER = "sim"
# Iterations in a row with work queued but no batch to run before the run is declared stuck.
MAX_IDLE_SPINS = 1000


class StuckRunError(ValueError):
    """The scheduler stopped making progress with requests queued (a policy that admits none of
    them, say); a ValueError so that the commands report it in one line, as bad input."""


class RunRecorder:
    """Observer plugin: per tracked request, the clock time of each output token and of its finish."""

    def __init__(self):
        # Nothing is tracked before `start` (the real backend's warm-up runs before it).
        self.tracked: set[str] = set()
        self.token_times: dict[str, list[float]] = {}
        self.finished: dict[str, tuple[float, int, str | None]] = {}

    def start(self, clock, tracked: set[str], pbar=None) -> None:
        """Track `tracked` from now on `clock` (the scheduler's, known once the engine is built)."""
        self.clock = clock
        self.t0 = clock.now()
        self.tracked = tracked
        self.token_times: dict[str, list[float]] = {rid: [] for rid in tracked}
        self.finished: dict[str, tuple[float, int, str | None]] = {}
        self.pbar = pbar

    def now(self) -> float:
        return self.clock.now() - self.t0

    @hookimpl
    def on_batch_result(self, batch):
        token_times = self.token_times
        if not token_times:
            return
        now = self.now()
        for req in batch.reqs:
            times = token_times.get(req.rid)
            if times is not None:
                new = len(req.output_ids) - len(times)
                if new > 0:
                    times.extend([now] * new)

    @hookimpl
    def on_request_finished(self, req):
        if req.rid not in self.tracked:
            return
        reason = req.finished_reason.to_json().get("type") if req.finished_reason else None
        self.finished[req.rid] = (self.now(), req.cached_tokens, reason)
        if self.pbar is not None:
            self.pbar.update(1)


def driver_settings(settings_overrides: dict[str, Any], backend: str) -> Settings:
    """The run's settings: the overrides (nested by section) with the backend's worker and the
    leak check on by default."""
    if backend not in BACKENDS:
        raise ValueError(f"backend: unknown backend {backend!r}; use one of {', '.join(BACKENDS)}")
    overrides = copy.deepcopy(settings_overrides)
    plugins = overrides.setdefault("plugins", {})
    worker = plugins.get("worker")
    if backend == "sim":
        if worker not in (None, SIM_WORKER):
            raise ValueError(f"plugins.worker: backend sim runs the sim worker, not {worker!r}")
        plugins["worker"] = SIM_WORKER
    elif worker == SIM_WORKER:
        raise ValueError("plugins.worker: backend real needs a model worker (tp, overlap), not sim")
    overrides.setdefault("scheduler", {}).setdefault("check_leaks", True)
    return Settings.load(None, **overrides)


def make_message(req: TimedRequest) -> GenerateReqInput:
    params = SamplingParams.from_dict({"max_new_tokens": req.output_len, "ignore_eos": True, "temperature": 0.0})
    params.verify()
    return GenerateReqInput(rid=req.rid, input_ids=list(req.input_ids), sampling_params=params,
                            priority=req.priority, client_id=req.client_id, slo_ttft_ms=req.slo_ttft_ms)


def warm_up(engine, num: int = 4) -> None:
    """A few random requests (first-call costs) and a cache flush, as `batchyard bench` does."""
    from framework.bench.datasets import sample_random

    warm = sample_random(engine.tokenizer, num, 128, 8, 1.0, seed=12345, source="ids")
    engine.generate(input_ids=[r.prompt_ids for r in warm],
                    sampling_params=[{"max_new_tokens": r.output_len, "ignore_eos": True} for r in warm])
    engine.flush_cache()


def run_workload(
    settings_overrides: dict[str, Any],
    requests: list[TimedRequest],
    backend: str = "sim",
    progress: bool = False,
) -> RunResult:
    """Inject each request when the run's clock reaches its `arrival_s`, run the scheduler until
    every request finished, and return one `RequestRecord` per request (in `requests` order).

    `settings_overrides` are nested by section (``{"plugins": {"policy": "fcfs"}, "plugin":
    {"sim": {...}}}``); backend "sim" sets ``plugins.worker = "sim"``, backend "real" keeps the
    named model worker (default tp). Raises ValueError naming the problem for bad settings,
    a duplicate rid or a request the model cannot take (its prompt and output_len do not fit in
    a request's room), before anything runs; `StuckRunError` (a ValueError) when the scheduler
    stops admitting the queued requests.
    """
    from framework.engine import Engine

    settings = driver_settings(settings_overrides, backend)
    rids = [r.rid for r in requests]
    if len(set(rids)) != len(rids):
        raise ValueError("requests: rids must be unique")
    recorder = RunRecorder()
    engine = Engine(settings, extra_plugins=(recorder,))
    try:
        messages = [make_message(r) for r in requests]
        room = engine.scheduler.max_req_len - 1  # the most tokens a request may hold, prompt and output
        for req, msg in zip(requests, messages):
            engine._check(msg)
            if len(msg.input_ids) + req.output_len > room:
                # The scheduler would clip its output silently: the run would not be the one asked for.
                raise ValueError(
                    f"request {req.rid}: its prompt ({len(msg.input_ids)} tokens) and output_len "
                    f"({req.output_len}) exceed the {room} tokens a request may hold here "
                    "(model.context_length and cache.max_total_tokens): its output would be cut short"
                )
        if backend == "real":
            warm_up(engine)
        return _drive(engine, recorder, requests, messages, progress)
    finally:
        engine.shutdown()


def _drive(engine, recorder: RunRecorder, requests: list[TimedRequest], messages, progress: bool) -> RunResult:
    from tqdm import tqdm

    sched = engine.scheduler
    clock = sched.clock
    pbar = tqdm(total=len(requests), disable=not progress, desc=f"run ({sched.settings.plugins.worker})", unit="req")
    recorder.start(clock, {r.rid for r in requests}, pbar)
    retractions0 = sched.num_retractions
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival_s)
    queue_samples: list[tuple[float, int, int]] = []
    wall0 = time.perf_counter()
    nxt, spins = 0, 0
    try:
        while True:
            now = recorder.now()
            while nxt < len(order) and requests[order[nxt]].arrival_s <= now:
                sched.send(messages[order[nxt]])
                nxt += 1
            if sched.has_work():
                progressed = sched.run_once()
                running = sched.running_batch.batch_size() if sched.running_batch is not None else 0
                queue_samples.append((recorder.now(), len(sched.waiting_queue), running))
                spins = 0 if progressed else spins + 1
                if spins < MAX_IDLE_SPINS:
                    continue
                if nxt == len(order):
                    raise StuckRunError(
                        f"the scheduler made no progress in {MAX_IDLE_SPINS} iterations with "
                        f"{len(sched.waiting_queue)} requests waiting (does policy "
                        f"{sched.settings.plugins.policy!r} admit any of them?)"
                    )
            elif nxt == len(order):
                break
            _wait_until(clock, recorder.t0 + requests[order[nxt]].arrival_s)
            spins = 0
        sched.run_once()  # an idle iteration: the leak check
    finally:
        pbar.close()
    wall_s = time.perf_counter() - wall0
    records = []
    for req, msg in zip(requests, messages):
        times = recorder.token_times[req.rid]
        finish_s, cached, reason = recorder.finished.get(req.rid, (None, 0, None))
        records.append(RequestRecord(
            rid=req.rid, client_id=req.client_id, priority=req.priority, arrival_s=req.arrival_s,
            first_token_s=times[0] if times else None, finish_s=finish_s, token_times=times,
            input_len=len(msg.input_ids), output_len=len(times), cached_tokens=cached, finish_reason=reason,
        ))
    # The requests' own counts: the prefill log's counters (hit / (hit + new) per prefill batch)
    # also count a chunked prompt's earlier chunks and a retracted request's re-prefill as hits.
    prompt_tokens = sum(r.input_len for r in records)
    return RunResult(
        records=records,
        duration_s=max((r.finish_s for r in records if r.finish_s is not None), default=0.0),
        wall_s=wall_s,
        num_retractions=sched.num_retractions - retractions0,
        cache_hit_rate=sum(r.cached_tokens for r in records) / prompt_tokens if prompt_tokens else 0.0,
        queue_samples=queue_samples,
    )


def _wait_until(clock, t: float) -> None:
    if clock.is_virtual:
        clock.jump_to(t)
    else:
        delay = t - clock.now()
        if delay > 0:
            time.sleep(delay)
