"""The simulated worker: the real scheduler, policy, cache and budget, with the forward pass
replaced by a cost model (framework/sim/costmodel.py) and a virtual clock.

It loads no weights: the model's config (for the KV pool's size and the roofline) and its tokenizer
when the folder has one. Its KV and request pools are sized exactly as the plain worker sizes them,
so admission, chunking and retraction take the same decisions; the KV pool has no K/V tensors.

Each `launch` predicts the batch's duration from its shape, advances the worker's `VirtualClock`
(``worker.clock``, which the scheduler and the timed driver read) and answers at once with synthetic
tokens: a non-EOS, non-special id drawn from a hash of the request's last token and its position,
so identical prompts continue identically (as under greedy decoding) and a request only stops at
its length limit. Stop strings, retraction, chunked prefill, prefix sharing and the leak check run
unchanged in the core.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from framework import hookimpl
from framework.clock import VirtualClock
from framework.memory import ReqToTokenPool, TokenToKVPool
from framework.model.config import ModelConfig
from framework.model.loader import load_hf_config, load_tokenizer, resolve_model
from framework.model.runner import DEFAULT_KV_CACHE_MEMORY_BYTES, MAX_REQ_TO_TOKEN_BYTES
from framework.sim.costmodel import BatchShape, CostModelError, build_cost_model, load_profile
from framework.sim.hardware import FROM_PROFILE
from framework.worker import BatchResult, ResolvedHandle
from plugins.workers.tp import resolve_dtype, resolve_kv_dtype

PLUGIN_KIND = "worker"
SECTION = "sim"

logger = logging.getLogger(__name__)


class SimSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    cost_model: Literal["roofline", "profile"] = Field(
        "roofline",
        description="How a batch's duration is predicted: roofline (model config + a hardware entry; an "
        "estimate) or profile (fitted on this machine by `batchyard sim calibrate`).",
    )
    hardware: str = Field(
        "h100", description="Roofline hardware: a100, h100, h200, or profile (the CPU entry measured by calibrate)."
    )
    profile: str | None = Field(
        None, description="Profile JSON written by `batchyard sim calibrate` (cost_model = profile, or hardware = profile)."
    )
    flops_efficiency: float = Field(0.5, gt=0, le=1, description="Roofline: share of the peak FLOP/s kernels reach.")
    bandwidth_efficiency: float = Field(
        0.8, gt=0, le=1, description="Roofline: share of the peak memory bandwidth kernels reach."
    )
    step_overhead_s: float = Field(0.0, ge=0, description="Roofline: fixed seconds added to every step (scheduler, launch).")

    @field_validator("profile")
    @classmethod
    def _profile_readable(cls, value, info: ValidationInfo):
        # Read when the settings are checked (start-up, an experiment's grid check), not when the
        # first cell builds its worker.
        if value and FROM_PROFILE in (info.data.get("cost_model"), info.data.get("hardware")):
            try:
                load_profile(value)
            except CostModelError as exc:
                raise PydanticCustomError("sim_profile", str(exc).removeprefix("plugin.sim.profile: ")) from None
        return value


@hookimpl
def register_settings(register):
    register(SECTION, SimSettings)


def pool_sizes(cfg: ModelConfig, dtype: torch.dtype, context_len: int, tp_size: int, settings) -> tuple[int, int, int]:
    """(KV slots, request slots, KV heads per rank) as `ModelRunner` sizes them for these settings."""
    num_local_kv_heads = cfg.num_kv_heads // tp_size
    kv_dtype = resolve_kv_dtype(settings.model.kv_cache_dtype, dtype)
    cell_size = TokenToKVPool.cell_size(num_local_kv_heads, cfg.head_dim, cfg.num_layers, kv_dtype)
    max_total_tokens = settings.cache.max_total_tokens
    budget_bytes = None if max_total_tokens else settings.cache.kv_cache_memory_mb << 20
    if max_total_tokens is None or budget_bytes is not None:
        by_memory = (budget_bytes or DEFAULT_KV_CACHE_MEMORY_BYTES) // cell_size
        max_total_tokens = by_memory if max_total_tokens is None else min(max_total_tokens, by_memory)
    max_num_reqs = settings.scheduler.max_running_requests
    if max_num_reqs is None:
        max_num_reqs = min(max(int(max_total_tokens / context_len * 512), 2048), 4096)
        max_num_reqs = max(min(max_num_reqs, MAX_REQ_TO_TOKEN_BYTES // ((context_len + 4) * 8) - 1), 1)
    return int(max_total_tokens), max_num_reqs, num_local_kv_heads


class SimWorker:
    """Answers every batch at once, after moving its clock by the batch's predicted duration."""

    is_pipelined = False
    supports_output_penalties = True
    image_info = None

    def __init__(self, settings):
        folder = resolve_model(settings.model.path)
        cfg = ModelConfig.from_hf_config(load_hf_config(folder))
        self.model_config = cfg
        self.tokenizer = load_tokenizer(settings.model.tokenizer_path or folder)
        self.dtype = resolve_dtype(settings.model.dtype, settings.worker.device)
        self.context_len = settings.model.context_length or cfg.context_len
        tp_size = settings.parallel.tp_size
        self.max_total_num_tokens, self.max_running_requests, kv_heads = pool_sizes(
            cfg, self.dtype, self.context_len, tp_size, settings
        )
        self.req_to_token_pool = ReqToTokenPool(self.max_running_requests + 1, self.context_len + 4)
        # Free-list bookkeeping only: no layers, so no K/V tensors.
        self.token_to_kv_pool = TokenToKVPool(self.max_total_num_tokens, self.dtype, kv_heads, cfg.head_dim, 0)
        self.vocab_size = cfg.vocab_size
        self.hidden_size = cfg.hidden_size
        self.is_generation = not (cfg.is_embedding or settings.model.is_embedding)
        self.eos_token_ids = set(cfg.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.plain_ids = self._plain_ids()
        kv_bytes = torch.empty((), dtype=resolve_kv_dtype(settings.model.kv_cache_dtype, self.dtype)).element_size()
        self.cost_model = build_cost_model(
            settings.plugin_section(SECTION), cfg, torch.empty((), dtype=self.dtype).element_size(), tp_size, kv_bytes
        )
        self.clock = VirtualClock()
        self.num_batches = 0
        self.busy_s = 0.0  # virtual seconds spent in forward passes
        logger.info("sim worker: %s, %d KV slots, %d request slots, cost model %s",
                    cfg.architecture, self.max_total_num_tokens, self.max_running_requests,
                    type(self.cost_model).__name__)

    def _plain_ids(self) -> torch.Tensor:
        special = set(getattr(self.tokenizer, "all_special_ids", None) or []) | self.eos_token_ids
        return torch.tensor([i for i in range(self.vocab_size) if i not in special], dtype=torch.int64)

    def next_tokens(self, last_ids: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """Per request, a plain id hashed from its last token and its length."""
        mixed = torch.bitwise_xor(last_ids * 1_000_003, seq_lens * 7919)
        return self.plain_ids[mixed % len(self.plain_ids)]

    def launch(self, batch) -> ResolvedHandle:
        if batch.forward_mode.is_idle():
            return ResolvedHandle(BatchResult(next_token_ids=[]))
        shape = BatchShape.of(batch)
        seconds = self.cost_model.predict(shape)
        self.clock.advance(seconds)
        self.busy_s += seconds
        self.num_batches += 1
        if batch.is_embedding:
            unit = [1.0] + [0.0] * (self.hidden_size - 1)
            return ResolvedHandle(BatchResult(next_token_ids=[], embeddings=[unit] * batch.batch_size))
        if batch.forward_mode.is_decode():
            last_ids = batch.input_ids
        else:
            ends = torch.tensor(shape.extend_lens, dtype=torch.int64).cumsum(0) - 1
            last_ids = batch.input_ids[ends]
        ids = self.next_tokens(last_ids, batch.seq_lens).tolist()
        # Jump-forward drafts (if any) are all kept: the scheduler's default for a worker that
        # leaves `kept_draft_tokens` empty.
        return ResolvedHandle(BatchResult(next_token_ids=ids))

    def run_in_forward_thread(self, fn: Callable[[], Any]) -> Any:
        return fn()

    def update_weights(self, model_path: str) -> tuple[bool, str]:
        return True, "the sim worker has no weights"

    def shutdown(self) -> None:
        pass


@hookimpl
def create_worker(settings, tp_rank):
    return SimWorker(settings)
