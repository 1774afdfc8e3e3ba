"""`batchyard sim calibrate`: measure the real engine's steps on this machine and fit the profile
cost model (framework/sim/costmodel.py) by least squares.

The engine runs a handful of probes, each a set of requests sent at once with EOS ignored: single
prefills of several lengths (one output token), prefills on top of a cached prefix, and decode
batches of several sizes at several context lengths (requests sharing a long cached prefix, so the
context is long but the prefill short). Every scheduler iteration is timed as a whole (intake,
scheduling, forward pass, result processing) and attributed to the batch whose result it
processed: for the plain worker that is the batch it ran; for the pipelined overlap worker it is
the previous batch, whose forward pass the iteration waited for while the next one was queued. The
sim then advances its clock by these step times, the scheduler's overhead included.

The profile also stores a roofline entry for this CPU (``hardware``): a matmul's FLOP/s and a large
copy's bandwidth, for ``[plugin.sim] hardware = "profile"``.
"""

from __future__ import annotations

import collections
import datetime
import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from framework import hookimpl
from framework.sim.costmodel import FEATURES, PROFILE_VERSION, BatchShape, fit_profile

logger = logging.getLogger(__name__)


@dataclass
class CalibrationPlan:
    """What the probes measure (defaults: a couple of minutes for SmolLM2-135M on 2 cores)."""

    prefill_lens: tuple[int, ...] = (16, 64, 256, 512, 1024, 2048)
    # (cached prefix, new tokens) prefills.
    prefix_extends: tuple[tuple[int, int], ...] = ((512, 64), (1024, 256), (256, 512))
    decode_batch_sizes: tuple[int, ...] = (1, 8, 32, 64)
    decode_contexts: tuple[int, ...] = (64, 512, 1280)
    decode_steps: int = 8
    repeats: int = 2

    @classmethod
    def quick(cls) -> "CalibrationPlan":
        """A few seconds on a tiny model (the test suite's)."""
        return cls(prefill_lens=(8, 32, 96), prefix_extends=((64, 16),), decode_batch_sizes=(1, 4, 8),
                   decode_contexts=(16, 64), decode_steps=4, repeats=1)


class StepTimer:
    """Observer: the shape of each launched batch, and which one each iteration processed."""

    def __init__(self):
        self.launched: collections.deque[BatchShape] = collections.deque()
        self.processed: list[BatchShape] = []

    @hookimpl
    def prepare_batch(self, batch):
        if batch is not None and not batch.forward_mode.is_idle():
            self.launched.append(BatchShape(list(batch.extend_lens), batch.seq_lens.tolist()))

    @hookimpl
    def on_batch_result(self, batch):
        if not batch.forward_mode.is_idle():
            self.processed.append(self.launched.popleft())  # results come back in launch order


def run_probe(engine, timer: StepTimer, prompts: list[list[int]], max_new_tokens: int) -> list[tuple[BatchShape, float]]:
    """Send `prompts` at once and time every iteration until they are done."""
    from framework.sim.driver import make_message
    from framework.workload import TimedRequest

    sched = engine.scheduler
    for prompt in prompts:
        sched.send(make_message(TimedRequest(engine._new_rid(), 0.0, prompt, max_new_tokens)))
    samples = []
    while sched.has_work():
        before = len(timer.processed)
        start = time.perf_counter()
        sched.run_once()
        elapsed = time.perf_counter() - start
        if len(timer.processed) == before + 1:
            samples.append((timer.processed[-1], elapsed))
    sched.run_once()  # idle: the leak check
    return samples


def probe_prompts(plan: CalibrationPlan, plain_ids: np.ndarray, rng: np.random.Generator):
    """(name, prompts, max_new_tokens, flush before) for every probe of the plan."""
    def ids(n: int) -> list[int]:
        return [int(x) for x in rng.choice(plain_ids, size=n)]

    for _ in range(plan.repeats):
        for n in plan.prefill_lens:
            yield f"prefill {n}", [ids(n)], 1, True
        for prefix_len, extend_len in plan.prefix_extends:
            prefix = ids(prefix_len)
            yield f"prefix {prefix_len}", [prefix], 1, True
            yield f"prefill {extend_len} on prefix {prefix_len}", [prefix + ids(extend_len)], 1, False
        for context in plan.decode_contexts:
            shared = ids(max(context - 8, 1))
            for bs in plan.decode_batch_sizes:
                # A shared prefix keeps the prefill short while every request attends to `context` tokens.
                yield f"decode bs {bs} ctx {context}", [shared + ids(8) for _ in range(bs)], plan.decode_steps, True


def measure_hardware(dtype: torch.dtype) -> dict:
    """This CPU's roofline entry: best-of-3 matmul FLOP/s in `dtype`, and copy bandwidth."""
    from framework.bench.results import cpu_model

    n = 1024
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(3))
    src = torch.empty(64 << 20, dtype=torch.float32)  # 256 MiB
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy_s = min(_timed(lambda: dst.copy_(src)) for _ in range(3))
    return {
        "name": f"cpu: {cpu_model()}",
        "peak_flops": 2 * n**3 / best,
        "mem_bandwidth": 2 * src.numel() * src.element_size() / copy_s,
        "source": f"measured by batchyard sim calibrate ({str(dtype).replace('torch.', '')} matmul {n}^3, 256 MiB copy, "
                  f"{torch.get_num_threads()} threads)",
    }


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def calibrate(settings, plan: CalibrationPlan | None = None, seed: int = 0, progress: bool = False) -> dict:
    """Run the plan on the real engine of `settings` and return the profile (a JSON-able dict)."""
    from tqdm import tqdm

    from framework.bench.datasets import _plain_token_ids
    from framework.bench.offline import engine_dtype
    from framework.bench.results import ContentionMeter, hardware_info
    from framework.engine import Engine
    from framework.sim.driver import warm_up

    plan = plan or CalibrationPlan()
    timer = StepTimer()
    engine = Engine(settings, extra_plugins=(timer,))
    try:
        warm_up(engine)
        plain = _plain_token_ids(engine.tokenizer)
        probes = list(probe_prompts(plan, plain, np.random.default_rng(seed)))
        meter = ContentionMeter()
        samples: list[tuple[BatchShape, float]] = []
        for name, prompts, max_new, flush in tqdm(probes, disable=not progress, desc="calibrate", unit="probe"):
            if flush:
                engine.flush_cache()
            got = run_probe(engine, timer, prompts, max_new)
            logger.debug("%s: %d steps, %.3f s", name, len(got), sum(t for _, t in got))
            samples.extend(got)
        hardware = hardware_info(engine_dtype(engine), meter)
        dtype = engine.scheduler.worker.runner.dtype
        worker = engine.scheduler.worker
    finally:
        engine.shutdown()
    coef, fit = fit_profile(samples)
    return {
        "kind": "batchyard-sim-profile",
        "version": PROFILE_VERSION,
        "created": datetime.datetime.now().isoformat(timespec="seconds"),
        "model": settings.model.path or "default (SmolLM2-135M-Instruct)",
        "dtype": str(dtype).replace("torch.", ""),
        # The worker that ran: overlap falls back to tp where it cannot run.
        "worker": "tp" if settings.plugins.worker == "overlap" and not worker.is_pipelined else settings.plugins.worker,
        "tp_size": settings.parallel.tp_size,
        "cpu": hardware["cpu"],
        "machine": hardware,
        "features": list(FEATURES),
        "coef": coef,
        "fit": fit,
        "plan": asdict(plan),
        "samples": [[list(s.extend_lens), list(s.seq_lens), t] for s, t in samples],
        "hardware": measure_hardware(dtype),
    }


def refit(profile: dict) -> dict:
    """The profile fitted again from its stored steps (after a change to the fit)."""
    samples = [(BatchShape(ext, seq), t) for ext, seq, t in profile["samples"]]
    coef, fit = fit_profile(samples)
    return {**profile, "coef": coef, "fit": fit}


def write_profile(profile: dict, path: str | Path) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    Path(path).write_text(json.dumps(profile, indent=1) + "\n")
