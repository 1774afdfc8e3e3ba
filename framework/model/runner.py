"""ModelRunner: owns the model and the KV memory, runs forward passes and sampling.

The runner is the whole model side of the worker boundary: it takes a `ModelWorkerBatch` and gives
back logits (and logprobs) or sampled ids. The scheduler allocates slots in the pools it exposes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Iterable

import torch

from framework.batch import ModelWorkerBatch
from framework.distributed import get_parallel_context
from framework.memory import ReqToTokenPool, TokenToKVPool
from framework.model.cpu import BF16_FLAGS, has_bf16_arithmetic, packed_linear_supported, tune_allocator
from framework.model.cpu_kernels import pick as pick_cpu_kernels
from framework.model.config import ModelConfig, context_len_to_serve
from framework.model.gguf_decode import use_gguf_decode
from framework.model.int8 import HEAD_RESCORE_MARGIN, rescore_head_top
from framework.model.int8 import min_rows as int8_min_rows
from framework.model.int8 import (INT8_DOT_FLAGS, QUANTIZATIONS, Int8Ops, has_int8_dot, int_mm_is_exact,
                                  use_int8_weights)
from framework.model.w4a8 import W4Ops
from framework.model.llama import use_cpu_kernels, use_f32_gemm, use_packed_weights
from framework.model.llava import build_model
from framework.model.loader import (ModelFolderError, iter_safetensors, load_hf_config, load_tokenizer,
                                    resolve_model)
from framework.model.logits import LogitsOutput, compute_logits_output, fill_next_token_logprobs
from framework.model.pooler import pool_last_token
from framework.model.lora import LoraManager
from framework.model.sampler import Sampler
from framework.preload import running_allocator

logger = logging.getLogger(__name__)

# What the KV pool can hold (model.kv_cache_dtype).
KV_DTYPES = (torch.float32, torch.bfloat16, torch.float8_e5m2, torch.int8)
# KV budget when neither max_total_tokens nor kv_cache_memory_bytes is given.
DEFAULT_KV_CACHE_MEMORY_BYTES = 1 << 30
# req_to_token is int64 [max_num_reqs + 1, context_len + 4]. The reference's 2048-4096 request
# slots at an 8k context would take 268 MB of host RAM for an index table; on CPU we cap it here.
MAX_REQ_TO_TOKEN_BYTES = 64 << 20


class ModelRunner:
    """Model + KV pools for one worker.

    Args:
        model_path: a local HF folder (config.json + safetensors), see `loader.resolve_model`.
        dtype: torch.float32 or torch.bfloat16, for weights, activations and (by default) the KV cache.
        kv_dtype: the KV cache's dtype when not `dtype`: float32, bfloat16, float8_e5m2 (half
            the bytes of bf16, so twice the tokens in the same memory, at 2 mantissa bits) or int8
            (one byte a value and a scale per token and KV head: TokenToKVPool).
        max_total_tokens: KV slots; when None, `kv_cache_memory_bytes // cell_size`.
        kv_cache_memory_bytes: KV budget in bytes (default 1 GiB when both are None).
        max_running_requests: request slots; default as in the reference (P3), capped on CPU.
        context_length: overrides the model's max_position_embeddings.
        lora_paths: LoRA adapters to serve, {name: PEFT folder} (framework/model/lora.py).
        cpu_kernels: worker.cpu_kernels: "auto", "on", "off" or "no_amx".
        packed_weights: worker.packed_weights: prepack bf16 linear weights for oneDNN on CPU.
        gguf_decode: worker.gguf_decode ("auto", "exact" or "off"): decode steps on the Q4_1 weights
            of the GGUF `model_path` was converted from (framework/model/gguf_decode.py).
        kv_huge_pages: cache.kv_huge_pages: a CPU KV pool on transparent huge pages (True), on
            them while they come fast ("auto"), or on base pages (False); see
            memory.zeros_on_huge_pages.
        quantization: model.quantization: "none", "w8a8" for int8 GEMMs in the layers
            (framework/model/int8.py), or "w4a8" for 4-bit weight blocks by int8 activation blocks
            (framework/model/w4a8.py); on the CPU only.
        int8_lm_head: model.int8_lm_head: with "w8a8" or "w4a8", the LM head in int8; "auto": so
            except where a bf16 model's LM head runs on AMX tiles (`_bf16_head_on_tiles`).
        tokenizer_path: model.tokenizer_path: the tokenizer's folder when not `model_path`.
    """

    def __init__(
        self,
        model_path: str,
        dtype: torch.dtype = torch.float32,
        max_total_tokens: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        max_running_requests: int | None = None,
        context_length: int | None = None,
        device: str = "cpu",
        seed: int = 0,
        lora_paths: dict[str, str] | None = None,
        cpu_kernels: str = "auto",
        packed_weights: bool = True,
        kv_dtype: torch.dtype | None = None,
        gguf_decode: str = "auto",
        kv_huge_pages: bool | str = "auto",
        quantization: str = "none",
        int8_lm_head: bool | str = False,
        tokenizer_path: str | None = None,
    ):
        if gguf_decode not in ("auto", "exact", "off"):
            raise ValueError(f"gguf_decode must be 'auto', 'exact' or 'off', got {gguf_decode!r}")
        hf_config = load_hf_config(model_path)
        self._setup(
            hf_config, iter_safetensors(model_path), load_tokenizer(tokenizer_path or model_path), dtype,
            max_total_tokens, kv_cache_memory_bytes, max_running_requests, context_length,
            device, seed, lora_paths, cpu_kernels, packed_weights, kv_dtype, kv_huge_pages, quantization,
            int8_lm_head,
        )
        self.model_path = model_path
        self.gguf_decode = gguf_decode
        if gguf_decode != "off":
            use_gguf_decode(self.model, model_path, gguf_decode, lora=self.lora is not None)

    @classmethod
    def from_hf_model(cls, hf_model: Any, **kwargs: Any) -> "ModelRunner":
        """Build a runner with the weights of an in-memory HF model (no disk round trip);
        `kwargs` are those of `from_state_dict`."""
        return cls.from_state_dict(hf_model.config, hf_model.state_dict(), **kwargs)

    @classmethod
    def from_state_dict(
        cls,
        hf_config: Any,
        state_dict: dict[str, torch.Tensor],
        dtype: torch.dtype = torch.float32,
        max_total_tokens: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        max_running_requests: int | None = None,
        context_length: int | None = None,
        device: str = "cpu",
        seed: int = 0,
        tokenizer: Any = None,
        lora_paths: dict[str, str] | None = None,
        cpu_kernels: str = "auto",
        packed_weights: bool = True,
        kv_dtype: torch.dtype | None = None,
        kv_huge_pages: bool | str = "auto",
        quantization: str = "none",
        int8_lm_head: bool | str = False,
    ) -> "ModelRunner":
        runner = cls.__new__(cls)
        runner._setup(
            hf_config, state_dict.items(), tokenizer, dtype, max_total_tokens,
            kv_cache_memory_bytes, max_running_requests, context_length, device, seed, lora_paths,
            cpu_kernels, packed_weights, kv_dtype, kv_huge_pages, quantization, int8_lm_head,
        )
        runner.model_path = None
        runner.gguf_decode = "off"
        return runner

    def _setup(
        self,
        hf_config: Any,
        weights: Iterable[tuple[str, torch.Tensor]],
        tokenizer: Any,
        dtype: torch.dtype,
        max_total_tokens: int | None,
        kv_cache_memory_bytes: int | None,
        max_running_requests: int | None,
        context_length: int | None,
        device: str,
        seed: int,
        lora_paths: dict[str, str] | None = None,
        cpu_kernels: str = "auto",
        packed_weights: bool = True,
        kv_dtype: torch.dtype | None = None,
        kv_huge_pages: bool | str = "auto",
        quantization: str = "none",
        int8_lm_head: bool | str = False,
    ) -> None:
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"dtype must be float32 or bfloat16, got {dtype}")
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
        if quantization != "none" and device != "cpu":
            raise ValueError(f"model.quantization = {quantization!r} runs on the CPU, but the model is on {device!r}: "
                             "set worker.device = 'cpu'")
        # (w4a8 runs torch._int_mm only for an int8 LM head, where the own int8 GEMM does not)
        if (quantization == "w8a8" or (quantization == "w4a8" and int8_lm_head)) and not int_mm_is_exact():
            capped = os.environ.get("ONEDNN_MAX_CPU_ISA")
            cause = f"ONEDNN_MAX_CPU_ISA={capped} in the environment, or " if capped else ""
            raise ValueError(f"model.quantization = {quantization!r} needs exact int8 GEMMs, and torch._int_mm is not "
                             "exact here: "
                             f"without an int8 dot product ({cause}a CPU without {', '.join(INT8_DOT_FLAGS)}) "
                             "oneDNN's int8 kernels saturate 16-bit sums; use model.quantization = 'none'")
        if int8_lm_head not in (True, False, "auto"):
            raise ValueError(f"model.int8_lm_head must be true, false or 'auto', got {int8_lm_head!r}")
        if int8_lm_head is True and quantization == "none":
            raise ValueError("model.int8_lm_head runs the LM head on the int8 GEMMs of model.quantization = 'w8a8' "
                             f"(or 'w4a8'), but model.quantization is {quantization!r}")
        self.quantization = quantization
        self.int8_lm_head = int8_lm_head
        kv_dtype = kv_dtype or dtype
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be float32, bfloat16, float8_e5m2 or int8, got {kv_dtype}")
        self.kv_dtype = kv_dtype
        self.kv_huge_pages = kv_huge_pages
        torch.manual_seed(seed)
        if device == "cpu":
            tuned = tune_allocator()
            allocator = running_allocator()
            glibc_tuned = tuned and allocator == "glibc"
            logger.info("Memory allocator: %s", "glibc malloc, mmap off" if glibc_tuned else allocator)
        self.device = device
        self.dtype = dtype
        self.tokenizer = tokenizer
        self.cpu_kernels = pick_cpu_kernels(cpu_kernels, device)
        self.packed_weights = packed_weights and device == "cpu" and packed_linear_supported()
        if self.int8_lm_head == "auto":
            self.int8_lm_head = quantization != "none" and not self._bf16_head_on_tiles()
        # Sharded at load time when this process is one rank of a tensor-parallel group.
        self.par = get_parallel_context()
        self.model_config, self.model = self._load_model(hf_config, weights)
        cfg = self.model_config
        self.context_len = context_len_to_serve(cfg, context_length)
        if cfg.sliding_window is not None and cfg.context_len < cfg.max_position_embeddings:
            logger.info("Context capped at the model's sliding attention window, %d tokens (max_position_embeddings "
                        "%d): within it full attention gives the model's outputs", cfg.context_len,
                        cfg.max_position_embeddings)
        # Set for multimodal models: the scheduler expands image tokens with it.
        self.image_info = getattr(self.model, "image_info", None)
        if lora_paths and cfg.is_embedding:  # (/encode takes no adapter: they would load and never apply)
            raise ValueError("model.lora_paths: LoRA adapters are served on generation models; this is an "
                             "embedding model")
        # Wraps the targeted linear layers, so after the weights are in place and cast.
        self.lora = LoraManager(self.model, lora_paths) if lora_paths else None
        self.sampler = Sampler(self.cpu_kernels.fused if self.cpu_kernels else None)
        self._init_memory_pools(max_total_tokens, kv_cache_memory_bytes, max_running_requests)

    def _bf16_head_on_tiles(self) -> bool:
        """Whether a bf16 model's LM head runs on the packed GEMM's AMX tiles, where it beat the int8
        head (model.int8_lm_head = "auto" keeps it bf16 there): W200 with w8a8 and the int8 pool on a
        2-core Xeon with AMX, LM head 0.68 against 1.03 s (docs/performance.md, issue 17's
        thirty-seventh session)."""
        gemm = self.cpu_kernels.gemm if self.cpu_kernels is not None else None
        return self.dtype == torch.bfloat16 and self.packed_weights and gemm is not None and gemm.tiles

    def _load_model(self, hf_config: Any, weights: Iterable[tuple[str, torch.Tensor]]):
        model_config, model = build_model(hf_config, self.par)
        try:
            model.load_weights(weights)
        except ModelFolderError:
            raise
        except (KeyError, ValueError, RuntimeError) as exc:  # a weight unknown, missing or of another shape
            message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
            raise ModelFolderError(f"The weights do not fit the model's config.json "
                                   f"({model_config.architecture}): {message}") from None
        use_cpu_kernels(model, self.cpu_kernels)
        model = model.to(device=self.device, dtype=self.dtype).eval()
        if self.device == "cpu" and self.dtype == torch.bfloat16 and not has_bf16_arithmetic():
            logger.warning("model.dtype = 'bfloat16' on a CPU without bf16 arithmetic (%s): PyTorch's bf16 GEMMs "
                           "run ~10x slower than float32 here (a 2-core AMD EPYC Zen 3: 10-18 against 100-135 "
                           "GFLOP/s); model.dtype = 'auto' picks float32 on this CPU", ", ".join(BF16_FLAGS))
        text = getattr(model, "language_model", model)  # llava: the packed and int8 copies are its language model's
        if self.dtype == torch.float32 and self.cpu_kernels is not None and self.cpu_kernels.f32_gemm is not None:
            logger.debug("Packed %d float32 weights for the fp32 GEMM kernel", use_f32_gemm(text, True))
        if self.packed_weights and self.dtype == torch.bfloat16:
            logger.debug("Prepacked %d bf16 linear weights for oneDNN", use_packed_weights(text, True))
            warm = getattr(text, "warm_packed_gemms", None)
            if warm is not None:
                start = time.perf_counter()
                buckets = warm()
                if buckets:
                    logger.info("Built the oneDNN GEMM kernels for %d row counts in %.1f s", buckets,
                                time.perf_counter() - start)
                else:  # the packed GEMM kernel takes every GEMM of a prefill tile
                    logger.debug("No oneDNN GEMM kernels to build ahead")
        if self.quantization in ("w8a8", "w4a8"):
            # (worker.cpu_kernels = off: in PyTorch)
            ops = (Int8Ops.load(self.dtype, tiles=self.cpu_kernels.decode_tiles) if self.cpu_kernels is not None
                   else Int8Ops(None, self.dtype))
            w4 = None
            if self.quantization == "w4a8":
                w4 = W4Ops.load(self.dtype) if self.cpu_kernels is not None else W4Ops(None, self.dtype)
            start = time.perf_counter()
            # a decoder without LM head (an embedding model) would keep an int8 copy it never runs
            head = self.int8_lm_head and not model_config.is_embedding
            count = use_int8_weights(text, ops, lm_head=head, w4_ops=w4)
            if w4 is not None:
                where = ("kernels/w4_gemm.c on AVX2, ends inside it" if w4.packs
                         else "PyTorch, on the dequantized operands")
                logger.info("model.quantization = 'w4a8': %d linear weights in 4-bit blocks%s (%.1f s), passes of %d+ "
                            "rows on W4A8 GEMMs (%s)", count, ", the LM head in int8" if head else "",
                            time.perf_counter() - start, int8_min_rows(w4.packs, self.dtype), where)
                if not w4.packs:
                    logger.warning("model.quantization = 'w4a8' without kernels/w4_gemm.c (it needs a C compiler and "
                                   "a CPU with AVX2 and FMA; worker.cpu_kernels = 'off' turns it off): its GEMMs run "
                                   "in PyTorch on the dequantized weights, slower than model.quantization = 'none'")
                return model_config, model
            isa = "AMX-INT8 tiles and AVX512-VNNI" if ops.tiles else "AVX512-VNNI" if has_int8_dot() else "AVX2"
            where = (f"kernels/int8_ops.c's own GEMM on {isa}, ends inside it" if ops.packs
                     else "torch._int_mm, ends in C" if ops.lib is not None else "torch._int_mm, ends in PyTorch")
            logger.info("model.quantization = 'w8a8': %d linear weights in int8%s (smoothed by a calibration pass, "
                        "%.1f s), passes of %d+ rows on int8 GEMMs (%s)", count,
                        ", the LM head's among them" if head else "", time.perf_counter() - start,
                        int8_min_rows(ops.packs, self.dtype), where)
            if not has_int8_dot() and not ops.packs:
                logger.warning("model.quantization = 'w8a8' on a CPU without an int8 dot product (%s): its int8 "
                               "GEMMs run on PyTorch's own loops, far slower than float32 (a 2-core AMD EPYC Zen 3: "
                               "2-3 GOP/s against 100-135 GFLOP/s); model.quantization = 'none' with model.dtype = "
                               "'auto' is the fast choice here", ", ".join(INT8_DOT_FLAGS))
        return model_config, model

    def update_weights(self, model_path: str) -> tuple[bool, str]:
        """Load a checkpoint of the same architecture in place of the current weights (R4).

        The new model is built and loaded aside and swapped in only when everything fits, so on
        any error the old weights keep serving. Returns (success, message).
        """
        if self.lora is not None:
            # The adapters wrap the loaded model's layers; a new model would come without them.
            return False, ("Cannot update weights while LoRA adapters are loaded (model.lora_paths); "
                           "restart with the new weights instead")
        try:
            folder = resolve_model(model_path)
            hf_config = load_hf_config(folder)
            model_config, model = self._load_model(hf_config, iter_safetensors(folder))
        except Exception as exc:  # noqa: BLE001 - any load failure is reported, the old weights stay
            return False, f"Failed to load weights from {model_path}: {type(exc).__name__}: {exc}"
        mismatch = self._shape_mismatch(model_config, model)
        if mismatch:
            return False, f"Cannot update weights from {model_path}: {mismatch}; the old weights are kept"
        if self.gguf_decode != "off":  # the new weights' own Q4_1 blocks, or none (the old ones are not theirs)
            use_gguf_decode(model, folder, self.gguf_decode, lora=self.lora is not None)
        self.model, self.model_config = model, model_config
        self.model_path = model_path
        return True, f"Updated weights from {model_path}"

    def _shape_mismatch(self, new_config: ModelConfig, new_model: torch.nn.Module) -> str | None:
        """Why `new_model` cannot replace the current one (the KV pool and the scheduler's limits
        were sized for it), or None."""
        for name in ("architecture", "vocab_size", "num_layers", "num_kv_heads", "head_dim"):
            old, new = getattr(self.model_config, name), getattr(new_config, name)
            if old != new:
                return f"{name} differs ({old} != {new})"
        if type(new_model) is not type(self.model):
            return f"model class differs ({type(self.model).__name__} != {type(new_model).__name__})"
        old_shapes = {n: p.shape for n, p in self.model.named_parameters()}
        new_shapes = {n: p.shape for n, p in new_model.named_parameters()}
        if old_shapes != new_shapes:
            differ = sorted(n for n in old_shapes.keys() | new_shapes.keys() if old_shapes.get(n) != new_shapes.get(n))
            return f"parameter shapes differ ({', '.join(differ[:3])})"
        return None

    def _init_memory_pools(
        self,
        max_total_tokens: int | None,
        kv_cache_memory_bytes: int | None,
        max_running_requests: int | None,
    ) -> None:
        cfg = self.model_config
        # Each rank stores only its own KV heads.
        self.num_local_kv_heads = cfg.num_kv_heads // self.par.attn_tp_size
        cell_size = TokenToKVPool.cell_size(self.num_local_kv_heads, cfg.head_dim, cfg.num_layers, self.kv_dtype)
        if max_total_tokens is None or kv_cache_memory_bytes is not None:
            budget = kv_cache_memory_bytes or DEFAULT_KV_CACHE_MEMORY_BYTES
            by_memory = budget // cell_size
            if max_total_tokens is not None and max_total_tokens > by_memory:
                logger.warning("max_total_tokens=%d exceeds the KV budget; using %d", max_total_tokens, by_memory)
            max_total_tokens = by_memory if max_total_tokens is None else min(max_total_tokens, by_memory)
        if max_total_tokens <= 0:
            raise RuntimeError("Not enough memory for the KV cache; raise kv_cache_memory_bytes.")
        self.max_total_num_tokens = int(max_total_tokens)

        if max_running_requests is not None:
            max_num_reqs = max_running_requests
        else:
            max_num_reqs = min(max(int(self.max_total_num_tokens / self.context_len * 512), 2048), 4096)
            row_bytes = (self.context_len + 4) * 8
            cap = MAX_REQ_TO_TOKEN_BYTES // row_bytes - 1
            if max_num_reqs > cap:
                logger.info("Capping request slots at %d (req_to_token memory)", cap)
                max_num_reqs = max(cap, 1)
        self.max_num_reqs = max_num_reqs
        # On the CPU whatever the device: the scheduler and the prefix cache read and write it with
        # CPU tensors, and attention moves the few indices a pass needs (`TorchNativeAttention.prepare`).
        self.req_to_token_pool = ReqToTokenPool(
            size=max_num_reqs + 1, max_context_len=self.context_len + 4, device="cpu"
        )
        self.token_to_kv_pool = TokenToKVPool(
            self.max_total_num_tokens, self.kv_dtype, self.num_local_kv_heads, cfg.head_dim, cfg.num_layers,
            device=self.device, huge_pages=self.kv_huge_pages,
        )

    # -- passes ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: ModelWorkerBatch) -> LogitsOutput:
        """Run one pass; K/V of the batch's tokens land at `batch.out_cache_loc`."""
        vocab_size = self.model_config.vocab_size
        batch = self._on_device(batch)
        if batch.forward_mode.is_idle() or batch.batch_size == 0:
            if self.par.gathers_mlp_tokens:
                # DP attention: a pass with no tokens, so this rank joins the MLP collectives (L2).
                self.model(batch.input_ids, batch.positions, batch, self.token_to_kv_pool, self.req_to_token_pool)
            return LogitsOutput(next_token_logits=torch.empty((0, vocab_size), dtype=torch.float32))
        if self.lora is not None:
            self.lora.prepare(batch)
        hidden = self._hidden_states(batch)
        return compute_logits_output(hidden, batch, self.model.compute_logits, vocab_size)

    @torch.inference_mode()
    def embed(self, batch: ModelWorkerBatch) -> torch.Tensor:
        """Run one pass of an embedding batch: [bs, hidden] float32, one unit vector per request."""
        if batch.batch_size == 0:
            return torch.empty((0, self.model_config.hidden_size), dtype=torch.float32)
        return pool_last_token(self._hidden_states(self._on_device(batch)), batch.extend_lens)

    def _on_device(self, batch: ModelWorkerBatch) -> ModelWorkerBatch:
        """`batch` with the token-major tensors the model reads on the runner's device (the
        scheduler builds them on the CPU); the batch itself on the CPU."""
        if self.device == "cpu":
            return batch
        moved = {
            name: tensor.to(self.device)
            for name in ("input_ids", "positions", "out_cache_loc", "input_embeds", "input_embeds_mask")
            if (tensor := getattr(batch, name)) is not None
        }
        return dataclasses.replace(batch, **moved)

    def _hidden_states(self, batch: ModelWorkerBatch) -> torch.Tensor:
        return self.model(
            batch.input_ids, batch.positions, batch, self.token_to_kv_pool, self.req_to_token_pool,
            input_embeds=self._input_embeds(batch),
        )

    def _input_embeds(self, batch: ModelWorkerBatch) -> torch.Tensor | None:
        """Every token's embedding when some are supplied by their requests (input_embeds): the
        table's rows, with the supplied vectors at `batch.input_embeds_mask`. None otherwise."""
        if batch.input_embeds is None:
            return None
        embeds = self.model.model.embed_tokens(batch.input_ids)
        supplied = batch.input_embeds.to(device=embeds.device, dtype=embeds.dtype)
        embeds[batch.input_embeds_mask.to(embeds.device)] = supplied
        return embeds

    @torch.inference_mode()
    def sample(self, logits_output: LogitsOutput, batch: ModelWorkerBatch) -> torch.Tensor:
        """Sample next ids [bs] int64; with logprobs, also fill `logits_output.next_token_logprobs`."""
        if batch.batch_size == 0 or batch.sampling_info is None:
            return torch.empty((0,), dtype=torch.int64)
        logits = logits_output.next_token_logits
        info = batch.sampling_info.to(logits.device)
        hidden = logits_output.next_token_hidden
        sampled = self._rescore_processed_top(logits, hidden, info) if self._int8_head_ran(
            hidden, logits_output.head_rows) else logits
        next_token_ids = self.sampler(sampled, info)
        if batch.return_logprob:
            fill_next_token_logprobs(logits_output, next_token_ids)
        return next_token_ids

    def _int8_head_ran(self, hidden: torch.Tensor | None, rows: int) -> bool:
        """Whether the LM head's pass of `rows` rows (`hidden` among them) ran on its int8 copy
        (model.int8_lm_head; the condition of LlamaForCausalLM.compute_logits)."""
        model = getattr(self.model, "language_model", self.model)
        fewest = model.int8_head_fewest() if hasattr(model, "int8_head_fewest") else None
        return fewest is not None and hidden is not None and hidden.dtype == torch.bfloat16 and rows >= fewest

    def _rescore_processed_top(self, logits: torch.Tensor, hidden: torch.Tensor, info) -> torch.Tensor:
        """An int8 LM head's logits [n, vocab] have the bf16 head's values within HEAD_RESCORE_MARGIN
        of each row's largest (int8.rescore_head_top), but a grammar mask or penalties may take
        those columns out (a grammar that allows digits only): the logits to sample from, where the
        columns within the margin of the largest value they leave have the bf16 head's values too
        (a copy; logprobs keep the head's), so greedy rows take the bf16 head's token under them as
        well. `hidden` [n, k]: the rows' final hidden states."""
        if info.vocab_mask is None and info.penalties is None:
            return logits
        processed = self.sampler.processed(logits, info)
        top = processed.max(dim=1, keepdim=True).values
        near = (processed >= top - HEAD_RESCORE_MARGIN) & torch.isfinite(top)
        rows = near.any(dim=1).nonzero().squeeze(1)
        if rows.numel() == 0:
            return logits
        # Every column to recompute at 0 and the rest at -inf, so rescore_head_top recomputes
        # exactly those, in the model's dtype, with the arithmetic of the head's own rescoring.
        near = near[rows]
        probe = torch.full(near.shape, float("-inf"), dtype=hidden.dtype, device=logits.device)
        probe.masked_fill_(near, 0.0)
        model = getattr(self.model, "language_model", self.model)
        kernels = getattr(model, "kernels", None)
        rescore_head_top(probe, hidden[rows].contiguous(), model.lm_head_weight,
                         kernels.fused if kernels is not None else None)
        logits = logits.clone()
        logits[rows] = torch.where(near, probe.to(logits.dtype), logits[rows])
        return logits

    @torch.inference_mode()
    def sample_drafts(self, logits_output: LogitsOutput, batch: ModelWorkerBatch) -> torch.Tensor:
        """The token sampled at each draft row of `batch.draft_check` [sum(lens)] int64."""
        check = batch.draft_check
        logits = logits_output.draft_logits
        info = check.sampling_info.to(logits.device)
        hidden = logits_output.draft_hidden
        if self._int8_head_ran(hidden, 0 if hidden is None else hidden.shape[0]):
            logits = self._rescore_processed_top(logits, hidden, info)
        if info.is_all_greedy and info.penalties is None:
            return self.sampler.check_greedy(logits, info, torch.tensor(check.tokens, device=logits.device))
        return self.sampler(logits, info)
