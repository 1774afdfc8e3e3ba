"""The Hugging Face transformers baseline for `bench offline --backend hf|both`.

Same weights (the same local folder), same dtype, same requests, same process, so the ratio of the
two throughputs is measured under the same conditions. Two modes:

* continuous: transformers' continuous batching manager (``model.continuous_batching_context_manager``,
  present in transformers >= 5), each request with its own max_new_tokens; the closest existing
  tool to our engine.
* static: batched ``generate`` with left padding, `batch_size` requests at a time in workload order;
  a batch runs until its longest request is done, and only each request's own tokens count as
  output (the rest is the waste static batching pays), like vLLM's HF baseline.

With ignore_eos the continuous manager gets eos_token_id=-1 (no stop token) and static generate
gets min_new_tokens, so both produce exactly the requested number of tokens.
"""

from __future__ import annotations

import logging
import time

import torch

from framework.bench.datasets import BenchRequest, sample_random
from framework.bench.metrics import offline_metrics

logger = logging.getLogger(__name__)

MODES = ("auto", "continuous", "static")
# Warm-up requests: short, as the engine's (framework/bench/offline.py).
WARMUP_INPUT_LEN, WARMUP_OUTPUT_LEN = 64, 4


def load_hf_model(folder: str, dtype: torch.dtype):
    """The transformers model of a local folder, in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
    return model.eval()


def has_continuous_batching(model) -> bool:
    return hasattr(model, "continuous_batching_context_manager")


def cb_config_for(model, requests: list[BenchRequest], kv_budget_mb: int, max_batch_tokens: int):
    """Cache sizing for the continuous batching manager on this workload.

    Left to itself the manager sizes its KV cache from *total host RAM* on CPU (90% of it) and
    builds dense attention masks as wide as that cache, which takes tens of seconds and most of
    the memory of a shared box. Here the cache holds the whole workload at once (no preemption),
    but no more than `kv_budget_mb`, the engine's own KV budget.
    """
    from transformers import ContinuousBatchingConfig

    cfg = model.config
    page = ContinuousBatchingConfig().page_size
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    bytes_per_block = 2 * cfg.num_hidden_layers * kv_heads * head_dim * model.dtype.itemsize * page
    needed = sum(-(-(r.prompt_len + r.output_len) // page) for r in requests) + 1
    by_budget = max((kv_budget_mb << 20) // bytes_per_block, 1)
    return ContinuousBatchingConfig(num_blocks=int(min(needed, by_budget)), max_batch_tokens=max_batch_tokens)


def _cb_generate(manager, requests: list[BenchRequest], eos: int, pbar=None) -> tuple[float, int]:
    """Submit `requests` to a running manager and wait for all; returns (seconds, output tokens)."""
    start = time.perf_counter()
    ids = [manager.add_request(r.prompt_ids, max_new_tokens=r.output_len, eos_token_id=eos) for r in requests]
    done: dict[str, int] = {}
    while len(done) < len(ids):
        out = manager.get_result(timeout=1)
        if out is None:
            if not manager.is_running():
                raise RuntimeError("the transformers generation thread stopped")
            continue
        if out.is_finished():
            if out.error is not None:
                raise RuntimeError(f"transformers request {out.request_id} failed: {out.error}")
            done[out.request_id] = len(out.generated_tokens)
            if pbar is not None:
                pbar.update(1)
    return time.perf_counter() - start, sum(done.values())


def run_continuous(model, requests: list[BenchRequest], ignore_eos: bool, warmup: list[BenchRequest],
                   kv_budget_mb: int = 2048, max_batch_tokens: int = 2048, pbar=None) -> tuple[float, int]:
    """Generate with the continuous batching manager; returns (seconds, output tokens).

    The warm-up requests run first in the same manager, so its lazy cache allocation and first
    kernel calls stay out of the timed run.
    """
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    eos = -1 if ignore_eos else model.config.eos_token_id
    config = GenerationConfig(
        max_new_tokens=max(r.output_len for r in requests), do_sample=False,
        eos_token_id=eos, pad_token_id=model.config.pad_token_id or 0,
    )
    hints = WorkloadHints(
        max_prompt_length=max(r.prompt_len for r in requests),
        max_generated_length=max(r.output_len for r in requests), num_requests=len(requests),
    )
    # The manager's own warm-up only captures CUDA graphs; on CPU it would just spend time.
    graphs = torch.cuda.is_available() and str(model.device).startswith("cuda")
    with model.continuous_batching_context_manager(
        generation_config=config, block=True, timeout=60, warmup=graphs, workload_hints=hints,
        continuous_batching_config=cb_config_for(model, requests + warmup, kv_budget_mb, max_batch_tokens),
    ) as manager:
        if warmup:
            _cb_generate(manager, warmup, eos)
        return _cb_generate(manager, requests, eos, pbar)


@torch.inference_mode()
def run_static(model, tokenizer, requests: list[BenchRequest], ignore_eos: bool, batch_size: int,
               pbar=None) -> tuple[float, int]:
    """Batched `generate` with left padding; returns (seconds, useful output tokens)."""
    pad_id = tokenizer.pad_token_id
    if pad_id is None:
        pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    start = time.perf_counter()
    total = 0
    for i in range(0, len(requests), batch_size):
        chunk = requests[i : i + batch_size]
        width = max(r.prompt_len for r in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, r in enumerate(chunk):
            # Left padding keeps every prompt's last token in the last column.
            ids[row, width - r.prompt_len :] = torch.tensor(r.prompt_ids)
            mask[row, width - r.prompt_len :] = 1
        max_new = max(r.output_len for r in chunk)
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new, do_sample=False,
            min_new_tokens=max_new if ignore_eos else None, pad_token_id=pad_id,
        )
        generated = out.shape[1] - width
        total += sum(min(r.output_len, generated) for r in chunk)
        if pbar is not None:
            pbar.update(len(chunk))
    return time.perf_counter() - start, total


def run_hf(folder: str, tokenizer, requests: list[BenchRequest], dtype: torch.dtype, ignore_eos: bool = True,
           mode: str = "auto", batch_size: int = 32, warmup: bool = True, progress: bool = True,
           kv_budget_mb: int = 2048, max_batch_tokens: int = 2048) -> dict:
    """Time `requests` through transformers; returns the offline metrics plus the mode used."""
    from tqdm import tqdm

    if mode not in MODES:
        raise ValueError(f"unknown HF mode {mode!r}; choose from {', '.join(MODES)}")
    model = load_hf_model(folder, dtype)
    if mode == "auto":
        mode = "continuous" if has_continuous_batching(model) else "static"
    elif mode == "continuous" and not has_continuous_batching(model):
        raise ValueError("this transformers version has no continuous batching; use --hf-mode static")

    # Random ids, not the workload's prompts: a prefix cache must not start warm.
    warm = sample_random(tokenizer, 2, WARMUP_INPUT_LEN, WARMUP_OUTPUT_LEN, 1.0, seed=2, source="ids") if warmup else []
    pbar = tqdm(total=len(requests), disable=not progress, desc=f"hf-{mode}", unit="req")
    if mode == "continuous":
        elapsed, out_tokens = run_continuous(model, requests, ignore_eos, warm, kv_budget_mb, max_batch_tokens, pbar)
    else:
        if warm:
            run_static(model, tokenizer, warm, ignore_eos, batch_size)
        elapsed, out_tokens = run_static(model, tokenizer, requests, ignore_eos, batch_size, pbar)
    pbar.close()
    in_tokens = sum(r.prompt_len for r in requests)
    del model
    return {
        "hf_mode": mode,
        **offline_metrics(len(requests), in_tokens, out_tokens, elapsed),
    }
