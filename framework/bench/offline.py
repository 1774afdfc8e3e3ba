"""`batchyard bench offline`: in-process Engine throughput (bench_offline_throughput).

All requests go to one `Engine.generate` call at once (greedy, ignore_eos by default), after a
warm-up of random 256-in / 16-out requests and a cache flush, so neither first-call costs nor
prefix reuse between warm-up and run count. Reported: request / input / output / total throughput
over the wall time of that call, with output tokens from each request's completion_tokens.

``--backend`` takes one or more of batchyard, hf (transformers, same process), vllm and llamacpp
(the peer engines, framework/bench/peers.py), run in turn on the same requests; with batchyard in
the list its record stores the ratio to each of the others (``vs_hf``, ``vs_vllm``, ...).
``--breakdown`` times the parts of the engine's passes in the timed run (framework/bench/
breakdown.py) and stores them in its record as ``breakdown``; ``--roofline`` sets the run against
the GEMM and memory rates measured on this machine afterwards (framework/bench/roofline.py), in
its record as ``roofline``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import time

from framework.bench.breakdown import Breakdown, format_breakdown
from framework.bench.datasets import BenchRequest, sample_random
from framework.bench.metrics import offline_metrics
from framework.bench.peers import PEER_BACKENDS, PeerMissing
from framework.bench.roofline import RequestTokens, format_roofline, roofline, run_shape

logger = logging.getLogger(__name__)

BACKENDS = ("batchyard", "hf", "vllm", "llamacpp", "both")
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
               extra: dict | None = None) -> tuple[dict, list[RequestTokens]]:
    """Time one generate call over all requests; returns the offline metrics (with the cache hit
    rate, the forward passes and the jump-forward drafts kept and dropped) and each request's token
    counts."""
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
    counts = [RequestTokens(o["meta_info"]["prompt_tokens"], o["meta_info"].get("cached_tokens", 0),
                            o["meta_info"]["completion_tokens"]) for o in outs]
    return metrics, counts


def expand_backends(names) -> list[str]:
    """The backends to run, in order, each once ("both" = batchyard and hf)."""
    if isinstance(names, str):
        names = [names]
    out: list[str] = []
    for name in names:
        for one in (("batchyard", "hf") if name == "both" else (name,)):
            if one not in out:
                out.append(one)
    return out


def peer_paths(args) -> dict[str, str]:
    """The peers' programs and model files from the options or the defaults; PeerMissing names
    the first one that is not there, so nothing runs before the whole comparison can."""
    from framework.bench import peers

    default = peers.PeerPaths.default()
    model = getattr(args, "llamacpp_model", None) or default.llamacpp_bf16_gguf
    if model == "shipped":
        model = peers.shipped_gguf()
    paths = {"vllm": getattr(args, "vllm_python", None) or default.vllm_python,
             "llamacpp": getattr(args, "llamacpp_server", None) or default.llamacpp_server,
             "llamacpp_model": model}
    flags = {"vllm": "--vllm-python", "llamacpp": "--llamacpp-server", "llamacpp_model": "--llamacpp-model"}
    for peer in expand_backends(args.backend):
        for key in (k for k in paths if k.split("_")[0] == peer):
            if not os.path.exists(paths[key]):
                raise PeerMissing(f"{peer}: {paths[key]} does not exist; run `batchyard bench peers setup {peer}` "
                                  f"or pass {flags[key]}")
    return paths


def run_peer(peer: str, args, requests: list[BenchRequest], folder: str, dtype: str,
             paths: dict[str, str], kv_cache_dtype: str = "auto", quantization: str = "none") -> tuple[dict, dict]:
    """One peer engine on the workload (framework/bench/peers.py); returns (metrics, details).
    vLLM gets the engine's fp8_e5m2 KV cache too (llama.cpp has no e5m2 cache type; an int8 cache has
    no counterpart in vLLM's CPU build, which then keeps its bf16 cache, the nearest in quality), and its
    W8A8 int8 scheme (model.quantization = "w8a8": int8 weights made the same way, as a compressed-tensors
    checkpoint, `peers.w8a8_checkpoint`; the same for "w4a8", which it has no counterpart of)."""
    from framework.bench import peers

    if peer == "vllm":
        extra = peers.peer_flags(args.vllm_args, "--vllm-args")
        if kv_cache_dtype == "fp8_e5m2" and "--kv-cache-dtype" not in extra:
            extra = ["--kv-cache-dtype", kv_cache_dtype] + extra
        if quantization in ("w8a8", "w4a8"):  # (w4a8: vLLM's CPU build has no 4-bit W4A8; its W8A8 is its fastest)
            folder = peers.w8a8_checkpoint(folder)
        metrics, details = peers.run_vllm_offline(requests, folder, dtype, python=paths["vllm"], extra_args=extra)
        details["quantization"] = quantization
        return metrics, details
    model = paths["llamacpp_model"]
    metrics, details = peers.run_llamacpp_offline(requests, server_bin=paths["llamacpp"], model=model,
                                                  parallel=args.llamacpp_parallel, ignore_eos=args.ignore_eos,
                                                  progress=not args.disable_tqdm,
                                                  extra_args=peers.peer_flags(args.llamacpp_args, "--llamacpp-args"))
    details["dtype"] = "q4_1" if model and "Q4_1" in os.path.basename(model) else "bfloat16"
    return metrics, details


def roofline_shape(engine) -> dict | None:
    """`roofline.run_shape` of the engine's model runner; None (with a warning) where the worker has
    none on the CPU to bound (the simulated worker, a GPU)."""
    runner = getattr(engine.scheduler.worker, "runner", None)
    if runner is None or getattr(runner, "device", "cpu") != "cpu":
        logger.warning("--roofline: the worker runs no model on the CPU here; no bounds to give")
        return None
    return run_shape(runner)


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

    backends = expand_backends(args.backend)
    if args.extra_sampling_params and backends != ["batchyard"]:
        # The other engines have no grammars or batchyard's sampling fields: not comparable.
        logger.error("--extra-sampling-params needs --backend batchyard alone")
        return 2
    for flag, what in (("breakdown", "times batchyard's passes"), ("roofline", "bounds batchyard's run")):
        if getattr(args, flag, False) and "batchyard" not in backends:
            logger.error("--%s %s: add batchyard to --backend", flag, what)
            return 2
    if args.extra_sampling_params:
        from framework.request import SamplingParams

        try:  # before the model loads: an unknown field or a bad grammar is a usage error
            SamplingParams.from_dict(args.extra_sampling_params).verify()
        except ValueError as exc:
            logger.error("--extra-sampling-params: %s", exc)
            return 2
    try:
        paths = peer_paths(args)
    except PeerMissing as exc:
        logger.error("%s", exc)
        return 2
    settings = bench_settings(args)
    folder = resolve_model(settings.model.path)
    tokenizer = load_tokenizer(settings.model.tokenizer_path or folder)
    requests = build_requests(args, tokenizer)
    workload = describe(requests)
    options = bench_args(args)
    records = []
    # The dtype the other backends run: the engine's setting, resolved as the engine resolves it.
    dtype = resolve_dtype(settings.model.dtype, settings.worker.device)
    dtype_name = str(dtype).replace("torch.", "")

    if "batchyard" in backends:
        from framework.engine import Engine

        engine = Engine(settings)
        try:
            warmup_engine(engine, tokenizer, args.warmup_requests, args.seed, args.extra_sampling_params)
            meter = ContentionMeter()
            timing = Breakdown() if args.breakdown else contextlib.nullcontext()
            with timing:  # the timed run only: not the warm-up
                metrics, counts = run_engine(engine, requests, args.ignore_eos, not args.disable_tqdm,
                                             args.extra_sampling_params)
            engine_dtype_name = engine_dtype(engine)
            shape = roofline_shape(engine) if getattr(args, "roofline", False) else None
        finally:
            engine.shutdown()
        del engine
        gc.collect()  # free the KV pool before transformers allocates its own
        print(format_report("Offline Throughput (batchyard)", metrics))
        extra = {}
        if args.breakdown:
            extra["breakdown"] = timing.summary()
            print(format_breakdown(extra["breakdown"]))
        if shape is not None:  # measured with the engine shut down: nothing else runs
            extra["roofline"] = roofline(shape, counts, metrics["duration_s"])
            print(format_roofline(extra["roofline"]))
        records.append(make_record("offline", "batchyard", options, workload, metrics,
                                   hardware_info(engine_dtype_name, meter),
                                   engine_settings=settings_record(settings), **extra))

    if "hf" in backends:
        from framework.bench.hf_backend import run_hf

        meter = ContentionMeter()  # covers loading and warm-up too: transformers gives no hook between
        metrics = run_hf(folder, tokenizer, requests, dtype, args.ignore_eos, args.hf_mode,
                         args.hf_batch_size, warmup=args.warmup_requests > 0, progress=not args.disable_tqdm,
                         kv_budget_mb=settings.cache.kv_cache_memory_mb,
                         max_batch_tokens=args.hf_max_batch_tokens)
        mode = metrics.pop("hf_mode")
        print(format_report(f"Offline Throughput (transformers, {mode} batching)", metrics))
        records.append(make_record("offline", "hf", options, workload, metrics, hardware_info(dtype_name, meter),
                                   hf_mode=mode, hf_batch_size=args.hf_batch_size if mode == "static" else None))

    for peer in (b for b in backends if b in PEER_BACKENDS):
        metrics, details = run_peer(peer, args, requests, folder, dtype_name, paths, settings.model.kv_cache_dtype,
                                    settings.model.quantization)
        version = details.get("version")
        print(format_report(f"Offline Throughput ({peer}{' ' + version if version else ''})", metrics))
        hardware = hardware_info(details.get("dtype", dtype_name))
        hardware["other_cpu_busy"] = details.pop("other_cpu_busy", None)
        records.append(make_record("offline", peer, options, workload, metrics, hardware, peer=details))

    ours = next((r for r in records if r["backend"] == "batchyard"), None)
    for other in records:
        if ours is None or other is ours:
            continue
        theirs = other["metrics"]
        ratio = {k: ours["metrics"][k] / theirs[k] for k in ("output_throughput", "total_throughput") if theirs[k]}
        name = other["backend"]
        entry = {"ratio": ratio, f"{name}_metrics": theirs}
        if name == "hf":
            entry["hf_mode"] = other["hf_mode"]
        else:
            entry["peer"] = other.get("peer")
        ours[f"vs_{name}"] = entry
        label = f"transformers ({other['hf_mode']})" if name == "hf" else name
        print(f"batchyard / {label}: output throughput x{ratio.get('output_throughput', float('nan')):.2f}")
    for record in records:
        append_jsonl(args.output_file, record)
    return 0
