"""`batchyard bench one-batch`: prefill and decode latency of one static batch (bench_one_batch).

`batch_size` prompts of `input_len` random ids (``randint(0, 10000)``, as the reference) are sent
to the Engine's scheduler at once and run to `output_len` tokens with ignore_eos: one prefill
batch, then output_len - 1 decode steps. Two clocks:

* forward: the worker's launch until its result is ready (model + sampling), the reference's
  numbers: prefill throughput = bs * input_len / prefill latency; decode throughput = bs / median
  decode step latency; total throughput = bs * (in + out) / (prefill + all decode steps);
* iteration: the whole scheduler iteration around it (batch building, result processing); the
  difference is our scheduler's per-step overhead.

Chunked prefill is turned off and the prefill budget raised so the prompts form a single batch.
``--breakdown`` times the parts of each point's timed batch (framework/bench/breakdown.py) and
stores them in its record as ``breakdown``.
Like the reference, a (bs, in, out) that does not fit the KV pool is skipped. A pipelined worker
(the default overlap) is timed resolved (launch then result), so overlap does not hide the forward
time, and the loop runs it as a plain one: each result is processed before the next batch is built,
so there is no extra decode step for requests that already finished (the reference's
bench_one_batch runs the model without the overlap loop).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import statistics
import time

import numpy as np

from framework.bench.breakdown import Breakdown, format_breakdown
from framework.messages import GenerateReqInput
from framework.request import SamplingParams
from framework.worker import ResolvedHandle

logger = logging.getLogger(__name__)

WARMUP_DECODE_STEPS = 8


class LaunchTimer:
    """Wraps `worker.launch` to time each forward pass and note its mode; the worker reads as not
    pipelined meanwhile, since each launch is resolved before it returns."""

    def __init__(self, worker):
        self.worker = worker
        self.inner = worker.launch
        self.records: list[tuple[str, float]] = []

    def __call__(self, batch):
        start = time.perf_counter()
        result = self.inner(batch).result()
        self.records.append((batch.forward_mode.name.lower(), time.perf_counter() - start))
        return ResolvedHandle(result)

    def __enter__(self) -> "LaunchTimer":
        # Instance attributes shadow the method and the class attribute.
        self.worker.launch = self
        self.worker.is_pipelined = False
        return self

    def __exit__(self, *exc) -> None:
        del self.worker.launch
        del self.worker.is_pipelined


def random_prompts(batch_size: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = np.random.RandomState(seed)
    high = min(10000, vocab_size)
    return rng.randint(0, high, size=(batch_size, input_len)).tolist()


def run_static_batch(engine, prompts: list[list[int]], output_len: int) -> dict:
    """Run one static batch through the scheduler; returns per-step timings by mode."""
    sched = engine.scheduler
    counter = itertools.count()
    for ids in prompts:
        params = SamplingParams.from_dict({"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True})
        params.verify()
        params.normalize(engine.tokenizer)
        sched.send(GenerateReqInput(rid=f"one-batch-{next(counter)}", input_ids=ids, sampling_params=params))

    finished: list[int] = []
    inner_sink = sched.output_sink
    # Only completion counts matter here; the engine's own sink would keep every output.
    sched.output_sink = lambda out: finished.extend(
        len(o.output_ids) for o in out.outputs if o.finished_reason is not None
    )
    steps: list[tuple[str, float, float]] = []  # (mode, forward s, iteration s)
    try:
        with LaunchTimer(sched.worker) as timer:
            while sched.has_work():
                before = len(timer.records)
                start = time.perf_counter()
                sched.run_once()
                iteration = time.perf_counter() - start
                for mode, forward in timer.records[before:]:
                    steps.append((mode, forward, iteration))
    finally:
        sched.output_sink = inner_sink
    return {"steps": steps, "output_tokens": sum(finished), "finished": len(finished)}


def summarize_steps(run: dict, batch_size: int, input_len: int, output_len: int) -> dict:
    """The reference's latency metrics from `run_static_batch` timings."""
    steps = run["steps"]
    prefill = [s for s in steps if s[0] in ("extend", "mixed")]
    decode = [s for s in steps if s[0] == "decode"]
    prefill_s = sum(s[1] for s in prefill)
    prefill_iter_s = sum(s[2] for s in prefill)
    decode_fwd = [s[1] for s in decode]
    decode_iter = [s[2] for s in decode]
    total_s = prefill_s + sum(decode_fwd)
    # No decode step (output_len 1): its metrics are None ("n/a"), not a rate over no time.
    median_decode = statistics.median(decode_fwd) if decode else None
    median_decode_iter = statistics.median(decode_iter) if decode else None
    return {
        "batch_size": batch_size,
        "input_len": input_len,
        "output_len": output_len,
        "prefill_batches": len(prefill),
        "decode_steps": len(decode),
        "prefill_latency_s": prefill_s,
        "prefill_throughput": batch_size * input_len / max(prefill_s, 1e-9),
        "median_decode_latency_s": median_decode,
        "p90_decode_latency_s": float(np.percentile(decode_fwd, 90)) if decode else None,
        "median_decode_throughput": batch_size / max(median_decode, 1e-9) if decode else None,
        "total_latency_s": total_s,
        "total_throughput": batch_size * (input_len + output_len) / max(total_s, 1e-9),
        "prefill_iteration_latency_s": prefill_iter_s,
        "median_decode_iteration_latency_s": median_decode_iter,
        "median_decode_iteration_throughput": batch_size / max(median_decode_iter, 1e-9) if decode else None,
        "output_tokens": run["output_tokens"],
    }


def measure(engine, batch_size: int, input_len: int, output_len: int, seed: int = 1,
            warmup: bool = True, breakdown: bool = False) -> dict | None:
    """Warm up, flush, then time one static batch; None when it does not fit the KV pool. With
    `breakdown`, the metrics hold the timed batch's `Breakdown` summary under "breakdown"."""
    sched = engine.scheduler
    if batch_size * (input_len + output_len) > sched.max_total_num_tokens:
        logger.warning("skip bs=%d in=%d out=%d: exceeds the KV pool of %d tokens",
                       batch_size, input_len, output_len, sched.max_total_num_tokens)
        return None
    if input_len > sched.max_req_input_len:
        logger.warning("skip bs=%d in=%d out=%d: an input of %d tokens is over the longest the model takes (%d)",
                       batch_size, input_len, output_len, input_len, sched.max_req_input_len)
        return None
    vocab = sched.worker.vocab_size
    if warmup:
        run_static_batch(engine, random_prompts(batch_size, input_len, vocab, seed + 1),
                         min(output_len, WARMUP_DECODE_STEPS + 1))
    engine.flush_cache()  # no prefix reuse from the warm-up or an earlier size of the sweep
    timing = Breakdown() if breakdown else contextlib.nullcontext()
    with timing:
        run = run_static_batch(engine, random_prompts(batch_size, input_len, vocab, seed), output_len)
    engine.flush_cache()
    if run["finished"] != batch_size or run["output_tokens"] != batch_size * output_len:
        raise RuntimeError(f"bs={batch_size} in={input_len} out={output_len}: {run['finished']} of {batch_size} "
                           f"requests finished with {run['output_tokens']} output tokens; the numbers would be "
                           "wrong (see the log)")
    metrics = summarize_steps(run, batch_size, input_len, output_len)
    if breakdown:
        metrics["breakdown"] = timing.summary()
    return metrics


def main(args) -> int:
    """CLI entry: sweep the product of batch sizes and lengths, one record per point."""
    from framework.bench.offline import engine_dtype
    from framework.bench.results import (ContentionMeter, append_jsonl, bench_args, format_report, hardware_info,
                                         make_record)
    from framework.bench.settings import bench_settings, settings_record
    from framework.engine import Engine

    grid = list(itertools.product(args.batch_size, args.input_len, args.output_len))
    biggest_prefill = max(bs * il for bs, il, _ in grid)
    settings = bench_settings(args)
    # One prefill batch for the whole static batch: no chunking, a budget that fits it.
    settings.scheduler.chunked_prefill_size = None
    settings.scheduler.max_prefill_tokens = max(settings.scheduler.max_prefill_tokens, biggest_prefill)
    with Engine(settings) as engine:
        dtype = engine_dtype(engine)
        for bs, il, ol in grid:
            meter = ContentionMeter()
            metrics = measure(engine, bs, il, ol, seed=args.seed, warmup=args.warmup, breakdown=args.breakdown)
            if metrics is None:
                continue
            extra = {"breakdown": metrics.pop("breakdown")} if args.breakdown else {}
            print(format_report(f"One Batch (bs={bs}, in={il}, out={ol})", metrics))
            if extra:
                print(format_breakdown(extra["breakdown"]))
            record = make_record("one-batch", "batchyard", bench_args(args), {}, metrics, hardware_info(dtype, meter),
                                 engine_settings=settings_record(settings), **extra)
            append_jsonl(args.output_file, record)
    return 0
