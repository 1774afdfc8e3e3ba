"""`batchyard bench offline`: in-process Engine throughput (bench_offline_throughput).

All requests go to one `Engine.generate` call at once (greedy, ignore_eos by default), after a
warm-up of random 256-in / 16-out requests and a cache flush, so neither first-call costs nor
prefix reuse between warm-up and run count. Reported: request / input / output / total throughput
over the wall time of that call, with output tokens from each request's completion_tokens.

``--backend hf`` runs the same requests through transformers instead, ``--backend both`` runs
both in this process and stores their ratio with the engine's record.
"""

from __future__ import annotations

import gc
import logging
import time

from framework.bench.datasets import BenchRequest, sample_random
from framework.bench.metrics import offline_metrics

logger = logging.getLogger(__name__)

BACKENDS = ("batchyard", "hf", "both")
WARMUP_INPUT_LEN, WARMUP_OUTPUT_LEN = 256, 16


def sampling_params(req: BenchRequest, ignore_eos: bool, extra: dict | None = None) -> dict:
    return {"max_new_tokens": req.output_len, "temperature": 0.0, "ignore_eos": ignore_eos, **(extra or {})}


def _progress_sink(engine, pbar):
    """Tick `pbar` for every request the scheduler reports finished.

    Engine.generate blocks until all requests are done; the scheduler's output sink is the one
    place that sees each request finish, so it is wrapped for the duration of the run.
    """
    inner = engine.scheduler.output_sink

    def sink(batch_out):
        inner(batch_out)
        pbar.update(sum(1 for out in batch_out.outputs if out.finished_reason is not None))

    return inner, sink


def warmup_engine(engine, tokenizer, num: int, seed: int, extra: dict | None = None) -> None:
    """Run `num` random requests and flush the cache (the reference's warm-up); with `extra`
    sampling params (a grammar), so that its compilation is not timed."""
    if num <= 0:
        return
    warm = sample_random(tokenizer, num, WARMUP_INPUT_LEN, WARMUP_OUTPUT_LEN, 1.0, seed=seed + 1, source="ids")
    engine.generate(input_ids=[r.prompt_ids for r in warm],
                    sampling_params=[sampling_params(r, True, extra) for r in warm])
    engine.flush_cache()


def run_engine(engine, requests: list[BenchRequest], ignore_eos: bool = True, progress: bool = True,
               extra: dict | None = None) -> dict:
    """Time one generate call over all requests; returns the offline metrics, the cache hit rate,
    the forward passes and the jump-forward drafts kept and dropped."""
    from tqdm import tqdm

    pbar = tqdm(total=len(requests), disable=not progress, desc="offline", unit="req")
    inner, sink = _progress_sink(engine, pbar)
    engine.scheduler.output_sink = sink
    sched = engine.scheduler
    passes, kept, dropped = sched.forward_ct, sched.structured.num_draft_tokens_kept, sched.structured.num_draft_tokens_dropped
    try:
        start = time.perf_counter()
        outs = engine.generate(input_ids=[r.prompt_ids for r in requests],
                               sampling_params=[sampling_params(r, ignore_eos, extra) for r in requests])
        elapsed = time.perf_counter() - start
    finally:
        engine.scheduler.output_sink = inner
        pbar.close()
    in_tokens = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    out_tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    metrics = offline_metrics(len(outs), in_tokens, out_tokens, elapsed)
    metrics["cache_hit_rate"] = sched.cache_hit_rate()
    metrics["forward_passes"] = sched.forward_ct - passes
    # Jump-forward drafts the model kept, and those it replaced (computed for nothing).
    metrics["jump_forward_tokens"] = sched.structured.num_draft_tokens_kept - kept
    metrics["jump_forward_dropped"] = sched.structured.num_draft_tokens_dropped - dropped
    return metrics


def engine_dtype(engine) -> str | None:
    """The dtype the worker actually runs (None if the worker does not say)."""
    runner = getattr(engine.scheduler.worker, "runner", None)
    dtype = getattr(runner, "dtype", None)
    return str(dtype).replace("torch.", "") if dtype is not None else None


def main(args) -> int:
    """CLI entry: run the chosen backend(s) on one workload and record each run."""
    from framework.bench.common import build_requests
    from framework.bench.datasets import describe
    from framework.bench.results import (ContentionMeter, append_jsonl, bench_args, format_report, hardware_info,
                                         make_record)
    from framework.bench.settings import bench_settings, settings_record
    from framework.model.loader import load_tokenizer, resolve_model
    from plugins.workers.tp import resolve_dtype

    if args.extra_sampling_params and args.backend != "batchyard":
        # transformers' generate has no grammars or batchyard's sampling fields: not comparable.
        logger.error("--extra-sampling-params needs --backend batchyard")
        return 2
    if args.extra_sampling_params:
        from framework.request import SamplingParams

        try:  # before the model loads: an unknown field or a bad grammar is a usage error
            SamplingParams.from_dict(args.extra_sampling_params).verify()
        except ValueError as exc:
            logger.error("--extra-sampling-params: %s", exc)
            return 2
    settings = bench_settings(args)
    folder = resolve_model(settings.model.path)
    tokenizer = load_tokenizer(settings.model.tokenizer_path or folder)
    requests = build_requests(args, tokenizer)
    workload = describe(requests)
    options = bench_args(args)
    records = []

    if args.backend in ("batchyard", "both"):
        from framework.engine import Engine

        engine = Engine(settings)
        try:
            warmup_engine(engine, tokenizer, args.warmup_requests, args.seed, args.extra_sampling_params)
            meter = ContentionMeter()
            metrics = run_engine(engine, requests, args.ignore_eos, not args.disable_tqdm, args.extra_sampling_params)
            dtype = engine_dtype(engine)
        finally:
            engine.shutdown()
        del engine
        gc.collect()  # free the KV pool before transformers allocates its own
        print(format_report("Offline Throughput (batchyard)", metrics))
        records.append(make_record("offline", "batchyard", options, workload, metrics, hardware_info(dtype, meter),
                                   engine_settings=settings_record(settings)))

    if args.backend in ("hf", "both"):
        from framework.bench.hf_backend import run_hf

        dtype = resolve_dtype(settings.model.dtype, settings.worker.device)
        meter = ContentionMeter()  # covers loading and warm-up too: transformers gives no hook between
        metrics = run_hf(folder, tokenizer, requests, dtype, args.ignore_eos, args.hf_mode,
                         args.hf_batch_size, warmup=args.warmup_requests > 0, progress=not args.disable_tqdm,
                         kv_budget_mb=settings.cache.kv_cache_memory_mb,
                         max_batch_tokens=args.hf_max_batch_tokens)
        mode = metrics.pop("hf_mode")
        print(format_report(f"Offline Throughput (transformers, {mode} batching)", metrics))
        dtype_name = str(dtype).replace("torch.", "")
        records.append(make_record("offline", "hf", options, workload, metrics, hardware_info(dtype_name, meter),
                                   hf_mode=mode, hf_batch_size=args.hf_batch_size if mode == "static" else None))

    if len(records) == 2:
        ours, hf = records[0]["metrics"], records[1]["metrics"]
        ratio = {k: ours[k] / hf[k] for k in ("output_throughput", "total_throughput") if hf[k]}
        records[0]["vs_hf"] = {"hf_mode": records[1]["hf_mode"], "ratio": ratio, "hf_metrics": hf}
        print(f"batchyard / transformers ({records[1]['hf_mode']}): "
              f"output throughput x{ratio.get('output_throughput', float('nan')):.2f}")
    for record in records:
        append_jsonl(args.output_file, record)
    return 0
