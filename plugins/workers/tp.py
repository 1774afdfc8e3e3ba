"""The plain model worker (reference TpModelWorker): one forward pass per `launch`, in the caller's
thread. With tp_size 1 it runs the whole model; with tensor parallelism this process is one rank
(framework/distributed.py) and its model holds that rank's shard."""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from framework import hookimpl
from framework.distributed import get_parallel_context, local_device
from framework.model.cpu import has_bf16_arithmetic
from framework.model.loader import resolve_model
from framework.model.lora import parse_lora_paths
from framework.model.runner import ModelRunner
from framework.worker import BatchResult, ResolvedHandle

PLUGIN_KIND = "worker"

logger = logging.getLogger(__name__)


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "float32":
        return torch.float32
    if name == "bfloat16":
        return torch.bfloat16
    if device.startswith("cuda") or has_bf16_arithmetic():
        return torch.bfloat16
    return torch.float32


def resolve_kv_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """model.kv_cache_dtype: auto is the model's dtype."""
    return {"auto": dtype, "float32": torch.float32, "bfloat16": torch.bfloat16,
            "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}[name]


def eos_ids_of(runner: ModelRunner) -> set[int]:
    """The model config's EOS ids (one or a list: Llama 3's instruct models end turns with a
    second one) and the tokenizer's."""
    ids = set(runner.model_config.eos_token_ids)
    tokenizer = runner.tokenizer
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class TpWorker:
    """Runs one batch at a time; `launch` returns an already-resolved handle."""

    is_pipelined = False
    supports_output_penalties = True

    def __init__(self, runner: ModelRunner, is_embedding: bool = False):
        self.runner = runner
        self.req_to_token_pool = runner.req_to_token_pool
        self.token_to_kv_pool = runner.token_to_kv_pool
        self.max_total_num_tokens = runner.max_total_num_tokens
        self.max_running_requests = runner.max_num_reqs
        self.context_len = runner.context_len
        self.tokenizer = runner.tokenizer
        self.vocab_size = runner.model_config.vocab_size
        self.hidden_size = runner.model_config.hidden_size
        self.eos_token_ids = eos_ids_of(runner)
        self.image_info = runner.image_info
        # By architecture (a decoder without LM head) or forced by model.is_embedding (reference Y1).
        self.is_generation = not (runner.model_config.is_embedding or is_embedding)
        # Plain TP: every rank samples, and rank 0's ids are the ones all ranks continue from, so
        # the ranks' requests can never drift apart (with DP attention each rank has its own).
        par = runner.par
        self.shares_sampled_ids = par.tp_size > 1 and not par.dp_attention

    @classmethod
    def from_settings(cls, settings) -> "TpWorker":
        par = get_parallel_context()
        if settings.parallel.tp_size != par.tp_size:
            raise ValueError(
                f"parallel.tp_size={settings.parallel.tp_size} needs one process per rank: use "
                "`batchyard serve` (the in-process Engine runs a single rank)"
            )
        if settings.worker.num_threads is not None:
            torch.set_num_threads(settings.worker.num_threads)
        folder = resolve_model(settings.model.path)
        device = local_device(settings.worker.device, par.tp_rank, settings.parallel)
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"worker.device = {settings.worker.device!r}, but this torch ({torch.__version__}) "
                             "sees no CUDA device; use worker.device = 'cpu'")
        dtype = resolve_dtype(settings.model.dtype, device)
        runner = ModelRunner(
            folder,
            dtype=dtype,
            max_total_tokens=settings.cache.max_total_tokens,
            kv_cache_memory_bytes=None if settings.cache.max_total_tokens else settings.cache.kv_cache_memory_mb << 20,
            max_running_requests=settings.scheduler.max_running_requests,
            context_length=settings.model.context_length,
            device=device,
            seed=settings.model.random_seed,
            lora_paths=parse_lora_paths(settings.model.lora_paths),
            cpu_kernels=settings.worker.cpu_kernels,
            packed_weights=settings.worker.packed_weights,
            gguf_decode=settings.worker.gguf_decode,
            quantization=settings.model.quantization,
            # ("auto" lets the runner keep a bf16 head where it runs on AMX tiles)
            int8_lm_head="auto" if settings.model.int8_head and settings.model.int8_lm_head == "auto"
            else settings.model.int8_head,
            kv_dtype=resolve_kv_dtype(settings.model.kv_cache_dtype, dtype),
            kv_huge_pages=settings.cache.kv_huge_pages,
            tokenizer_path=settings.model.tokenizer_path,
        )
        logger.info(
            "Loaded %s (%s, KV cache %s): max_total_num_tokens=%d, context_len=%d",
            folder, dtype, runner.kv_dtype, runner.max_total_num_tokens, runner.context_len,
        )
        return cls(runner, is_embedding=settings.model.is_embedding)

    def forward_batch_generation(self, batch) -> BatchResult:
        return self.sample(self.runner.forward(batch), batch)

    def sample(self, logits_output, batch) -> BatchResult:
        """The next tokens (and logprobs) from a forward pass's logits."""
        next_token_ids = self.runner.sample(logits_output, batch)
        check = batch.draft_check
        if check is not None:
            # One tensor, so that TP ranks share the draft checks with the next ids.
            next_token_ids = torch.cat([next_token_ids, self.runner.sample_drafts(logits_output, batch)])
        if self.shares_sampled_ids:
            next_token_ids = get_parallel_context().broadcast_from_first(next_token_ids.cpu())
        ids = next_token_ids.tolist()
        kept = None
        if check is not None:
            bs = batch.batch_size
            ids, kept = check.settle(ids[bs:], ids[:bs])
        result = BatchResult(next_token_ids=ids, kept_draft_tokens=kept)
        if batch.return_logprob:
            result.next_token_logprobs = logits_output.next_token_logprobs.tolist()
            result.next_token_top_logprobs = logits_output.next_token_top_logprobs
            result.input_token_logprobs = logits_output.input_token_logprobs
            result.input_top_logprobs = logits_output.input_top_logprobs
            result.normalized_prompt_logprobs = logits_output.normalized_prompt_logprobs
        return result

    def forward_batch_embedding(self, batch) -> BatchResult:
        return BatchResult(next_token_ids=[], embeddings=self.runner.embed(batch).tolist())

    def launch(self, batch) -> ResolvedHandle:
        if batch.forward_mode.is_idle():
            self.runner.forward(batch)  # joins the DP-attention collectives; nothing to sample
            return ResolvedHandle(BatchResult(next_token_ids=[]))
        if batch.is_embedding:
            return ResolvedHandle(self.forward_batch_embedding(batch))
        return ResolvedHandle(self.forward_batch_generation(batch))

    def run_in_forward_thread(self, fn: Callable[[], Any]) -> Any:
        return fn()  # the forward passes run in the caller's thread

    def update_weights(self, model_path: str) -> tuple[bool, str]:
        return self.runner.update_weights(model_path)

    def shutdown(self) -> None:
        pass


@hookimpl
def create_worker(settings, tp_rank):
    return TpWorker.from_settings(settings)
