"""The scheduler event loop. It holds no policy: every decision is a hook (framework/hookspecs.py).

One loop serves the plain and the pipelined (overlap) worker: each launched batch is queued with
its result handle; a plain worker's result is processed at once, a pipelined worker's one
iteration later, after the next batch was launched.
"""

from __future__ import annotations

import collections
import logging
import time
import warnings
from typing import Any, Callable

from framework.batch import ScheduleBatch
from framework.budget import NewTokenRatio, PrefillAdder
from framework.config import Settings
from framework.model.lora import parse_lora_paths
from framework.messages import (
    AbortReq,
    BatchTokenOut,
    CloseSessionReq,
    FlushCacheReq,
    FlushCacheReqOutput,
    GenerateReqInput,
    GetStatsReq,
    OpenSessionReq,
    ReqOutput,
)
from framework.plugins import PluginManager
from framework.request import FinishAbort, Req, Stash
from framework.control import ControlMixin
from framework.sessions import SessionController, SessionError
from framework.worker import BatchResult, ResultHandle

logger = logging.getLogger(__name__)


class MemoryLeakError(RuntimeError):
    """The idle check found KV or request slots that nobody holds."""


class Scheduler(ControlMixin):
    def __init__(
        self,
        settings: Settings,
        output_sink: Callable[[BatchTokenOut], None] | None = None,
        tp_rank: int = 0,
        extra_plugins: tuple[Any, ...] = (),
        reply_sink: Callable[[Any], None] | None = None,
    ):
        self.settings = settings
        self.reply_sink = reply_sink
        self.sessions = SessionController()
        self.tp_rank = tp_rank
        self.output_sink = output_sink or (lambda out: None)
        self.plugins = PluginManager(settings, extra_plugins)
        self.hooks = self.plugins.hooks

        self.worker = self.hooks.create_worker(settings, tp_rank)
        self.req_to_token_pool = self.worker.req_to_token_pool
        self.token_to_kv_pool = self.worker.token_to_kv_pool
        self.tree_cache = self.hooks.create_cache(settings, self.req_to_token_pool, self.token_to_kv_pool)
        self.tokenizer = self.worker.tokenizer

        sched = settings.scheduler
        self.max_total_num_tokens = self.worker.max_total_num_tokens
        self.max_running_requests = min(
            sched.max_running_requests or self.max_total_num_tokens // 2,
            self.req_to_token_pool.size,
        )
        self.max_prefill_tokens = sched.max_prefill_tokens
        self.chunked_prefill_size = sched.chunked_prefill_size
        self.is_mixed_chunk = self.chunked_prefill_size is not None and sched.enable_mixed_chunk
        self.max_req_len = min(self.worker.context_len - 1, self.max_total_num_tokens - 1)
        self.max_req_input_len = self.max_req_len - 5
        assert self.max_req_input_len > 0, "context or KV pool too small"
        self.force_retract = sched.force_retract
        self.lora_names = list(parse_lora_paths(settings.model.lora_paths))
        self.max_loras_per_batch = settings.model.max_loras_per_batch
        if self.lora_names and settings.parallel.tp_size > 1:
            raise ValueError("model.lora_paths: LoRA adapters are not supported with parallel.tp_size > 1")
        if self.lora_names and not self.tree_cache.disable:
            # Prefixes computed under different adapters have different KV (reference AB1).
            raise ValueError(
                f"model.lora_paths: the {type(self.tree_cache).__name__} shares prefixes between "
                "requests, which requests with different LoRA adapters must not (the bundled radix and "
                "chunk caches share nothing while adapters are loaded)"
            )
        self.retract_decode_steps = sched.retract_decode_steps

        # Running state (reference B4).
        self.waiting_queue: list[Req] = []
        self.running_batch: ScheduleBatch | None = None
        self.cur_batch: ScheduleBatch | None = None
        self.last_batch: ScheduleBatch | None = None
        self.being_chunked_req: Req | None = None
        self.batch_is_full = False
        self.result_queue: collections.deque[tuple[ScheduleBatch, ResultHandle]] = collections.deque()
        self.forward_ct = 0
        self.forward_ct_decode = 0
        self.num_generated_tokens = 0
        self.last_decode_stats_tic = time.time()
        self.cache_hit_tokens = 0
        self.cache_total_tokens = 0
        self.num_retractions = 0
        self.new_token_ratio = NewTokenRatio(
            sched.init_new_token_ratio, sched.schedule_conservativeness,
            sched.min_new_token_ratio_factor, sched.new_token_ratio_decay_steps,
        )
        self.inbox: collections.deque[Any] = collections.deque()
        self.stash = Stash()  # per-plugin scheduler-wide state

    # -- the loop -------------------------------------------------------------------------------

    def run_once(self) -> bool:
        """One iteration of the event loop; returns False when there was nothing to do."""
        self.process_input_requests()
        batch = self.get_next_batch_to_run()
        batch = self.hooks.prepare_batch(batch, self)
        self.cur_batch = batch
        if batch is not None:
            handle = self.run_batch(batch)
            kept = batch.copy_for_result() if self.worker.is_pipelined else batch
            self.result_queue.append((kept, handle))
        if self.result_queue and (batch is None or not self.worker.is_pipelined or len(self.result_queue) > 1):
            self.process_batch_result(*self.result_queue.popleft())
        elif batch is None:
            self.on_idle()
        self.last_batch = batch
        return batch is not None or bool(self.result_queue)

    def has_work(self) -> bool:
        return bool(
            self.inbox or self.waiting_queue or self.result_queue or self.being_chunked_req
            or (self.running_batch is not None and not self.running_batch.is_empty())
            or (self.last_batch is not None and not self.last_batch.is_empty())
        )

    # -- intake ---------------------------------------------------------------------------------

    def send(self, message: Any) -> None:
        """Queue a message for the next iteration (in-process transport)."""
        self.inbox.append(message)

    def process_input_requests(self) -> None:
        # In arrival order, so a session opened (or closed) before a request is seen by it.
        while self.inbox:
            msg = self.inbox.popleft()
            if isinstance(msg, GenerateReqInput):
                self.handle_generate_request(msg)
            elif isinstance(msg, AbortReq):
                self.abort_request(msg.rid)
            elif isinstance(msg, FlushCacheReq):
                success = self.flush_cache()
                message = "" if success else "Cache not flushed: there are running or waiting requests."
                self.send_reply(FlushCacheReqOutput(msg.request_id, success, message))
            elif isinstance(msg, OpenSessionReq):
                self.send_reply(self.open_session(msg))
            elif isinstance(msg, CloseSessionReq):
                self.send_reply(self.close_session(msg))
            elif isinstance(msg, GetStatsReq):
                self.send_reply(self.get_stats(msg.request_id))
            else:
                # The reference raises here and kills the server; an unknown message is logged.
                logger.error("scheduler received an unknown message: %r", type(msg).__name__)

    def validate_input(self, input_ids: list[int]) -> str | None:
        """Why a prompt cannot be served, or None."""
        if len(input_ids) == 0:
            return "The prompt is empty: give at least one token."
        if len(input_ids) > self.max_req_input_len:
            return (
                f"The input ({len(input_ids)} tokens) is longer than the model's context length "
                f"allows ({self.max_req_input_len} tokens)."
            )
        return None

    def validate_lora(self, lora_path: str | None) -> str | None:
        """Why a request's adapter cannot be served, or None."""
        if lora_path is None or lora_path in self.lora_names:
            return None
        loaded = ", ".join(self.lora_names) if self.lora_names else "none (see model.lora_paths)"
        return f"lora_path: unknown LoRA adapter {lora_path!r}; loaded adapters: {loaded}"

    def handle_generate_request(self, msg: GenerateReqInput) -> None:
        input_ids = msg.input_ids
        session_error = None
        if msg.session_id is not None:
            try:
                input_ids = self.sessions.input_ids_for(msg.session_id, msg.session_rid, input_ids)
            except SessionError as exc:
                session_error = str(exc)
        req = Req(
            msg.rid, input_ids, msg.sampling_params, origin_input_text=msg.input_text,
            return_logprob=msg.return_logprob, logprob_start_len=msg.logprob_start_len,
            top_logprobs_num=msg.top_logprobs_num, stream=msg.stream,
            eos_token_ids=self.worker.eos_token_ids, session_id=msg.session_id,
            priority=msg.priority, lora_path=msg.lora_path,
        )
        req.tokenizer = self.tokenizer
        if req.logprob_start_len == -1:
            # Over the whole input, session history included (the reference counts only the new
            # segment, which limits a continued request's prefix hit when it asks for logprobs).
            req.logprob_start_len = len(req.origin_input_ids) - 1
        error = (
            session_error or self.validate_input(req.origin_input_ids) or self.validate_lora(req.lora_path)
        )
        if error is not None:
            # Rejected before it takes any memory (the reference prefills first, QUIRK 5).
            req.finished_reason = FinishAbort(error)
            self.stream_output([req])
            return
        if msg.session_id is not None:
            self.sessions.record(msg.session_id, req)
        params = req.sampling_params
        params.max_new_tokens = min(
            params.max_new_tokens if params.max_new_tokens is not None else 1 << 30,
            self.max_req_len - len(req.origin_input_ids) - 1,
        )
        self.waiting_queue.append(req)
        self.hooks.on_request_received(req, self)

    # -- batch selection (reference D) ------------------------------------------------------------

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        last = self.last_batch
        if last is not None and last.forward_mode.is_extend():
            if self.being_chunked_req is not None:
                req = self.being_chunked_req
                last.filter_batch(being_chunked_req=req)
                if req.finished():  # aborted between two chunks
                    self.being_chunked_req = None
                    self.finish_req(req)
                    self.stream_output([req])
                else:
                    self.tree_cache.cache_unfinished_req(req)
                    # The request keeps its rid and gets a new slot with its next chunk.
                    self.tree_cache.free_req_slot(req)
                self.batch_is_full = False
            if not last.is_empty():
                if self.running_batch is None:
                    self.running_batch = last
                else:
                    self.running_batch.merge_batch(last)
            self.last_batch = None

        new_batch = self.get_new_batch_prefill()
        if new_batch is not None:
            return new_batch
        if self.running_batch is not None:
            self.running_batch = self.update_running_batch(self.running_batch)
        return self.running_batch

    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        if (self.batch_is_full or not self.waiting_queue) and self.being_chunked_req is None:
            return None
        running_bs = self.running_batch.batch_size() if self.running_batch is not None else 0
        if running_bs >= self.max_running_requests:
            self.batch_is_full = True
            return None

        adder = PrefillAdder(
            self.tree_cache, self.running_batch, self.new_token_ratio.value,
            self.token_to_kv_pool.available_size() + self.tree_cache.evictable_size(),
            self.max_prefill_tokens, self.chunked_prefill_size,
            running_bs if self.is_mixed_chunk else 0,
            self.settings.scheduler.clip_max_new_tokens,
        )
        if self.being_chunked_req is not None:
            self.being_chunked_req.init_next_round_input()
            self.being_chunked_req = adder.add_inflight_req(self.being_chunked_req)
        if self.waiting_queue:
            self.hooks.select_prefill(self, adder)
        can_run_list = adder.can_run_list
        if not can_run_list:
            return None

        admitted = {id(r) for r in can_run_list}
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in admitted]
        if adder.new_inflight_req is not None:
            assert self.being_chunked_req is None, "only one request may be chunked at a time"
            self.being_chunked_req = adder.new_inflight_req
        if self.being_chunked_req is not None:
            self.being_chunked_req.is_being_chunked += 1
        self.log_prefill_stats(adder, can_run_list, running_bs)

        new_batch = ScheduleBatch(can_run_list, self.req_to_token_pool, self.token_to_kv_pool, self.tree_cache)
        new_batch.prepare_for_extend()
        if (
            self.is_mixed_chunk
            and self.running_batch is not None
            and not (new_batch.return_logprob or self.running_batch.return_logprob)
        ):
            self.running_batch.filter_batch()
            if not self.running_batch.is_empty():
                self.running_batch.prepare_for_decode()
                new_batch.mix_with_running(self.running_batch)
                new_batch.decoding_reqs = self.running_batch.reqs
            self.running_batch = None
        return new_batch

    def update_running_batch(self, batch: ScheduleBatch) -> ScheduleBatch | None:
        initial_bs = batch.batch_size()
        batch.filter_batch()
        if batch.is_empty():
            self.batch_is_full = False
            return None
        if not batch.check_decode_mem() or (self.force_retract and batch.batch_size() > 10):
            decision = self.hooks.on_decode_oom(batch, self)
            if decision is not None:
                retracted, new_ratio = decision
                self.new_token_ratio.value = new_ratio
                self.num_retractions += len(retracted)
                logger.info(
                    "Decode out of memory happened. #retracted_reqs: %d, new_token_ratio: %.4f",
                    len(retracted), new_ratio,
                )
                self.waiting_queue.extend(retracted)
        else:
            self.new_token_ratio.step()
        if batch.batch_size() < initial_bs:
            self.batch_is_full = False
        batch.prepare_for_decode()
        return batch

    def retract_req(self, req: Req, kv_len: int) -> None:
        """Release a running request's memory and send it back to waiting (used by on_decode_oom)."""
        self.tree_cache.retract_req(req, kv_len)
        req.reset_for_retract()

    # -- running and results --------------------------------------------------------------------

    def run_batch(self, batch: ScheduleBatch) -> ResultHandle:
        self.forward_ct += 1
        return self.worker.launch(batch.get_model_worker_batch())

    def process_batch_result(self, batch: ScheduleBatch, handle: ResultHandle) -> None:
        result = handle.result()
        if batch.forward_mode.is_idle():
            self.hooks.on_batch_result(batch, result, self)
            return
        if batch.forward_mode.is_decode():
            self.process_batch_result_decode(batch, result)
        else:
            self.process_batch_result_prefill(batch, result)
        self.hooks.on_batch_result(batch, result, self)

    def process_batch_result_prefill(self, batch: ScheduleBatch, result: BatchResult) -> None:
        decoding = {id(r) for r in batch.decoding_reqs} if batch.decoding_reqs else set()
        for i, req in enumerate(batch.reqs):
            if req.is_retracted or req.finished():
                continue
            if req.is_being_chunked > 0:
                # A middle chunk: its sampled token is discarded.
                req.is_being_chunked -= 1
                continue
            req.output_ids.append(result.next_token_ids[i])
            self.add_logprobs(req, i, result, is_prefill=id(req) not in decoding)
            req.check_finished()
            if req.finished():
                self.finish_req(req)
            elif id(req) not in decoding:
                self.tree_cache.cache_unfinished_req(req)
        if decoding:
            self.note_decode_step(len(decoding))
        self.stream_output(batch.reqs)

    def process_batch_result_decode(self, batch: ScheduleBatch, result: BatchResult) -> None:
        self.token_to_kv_pool.free_group_begin()
        for i, req in enumerate(batch.reqs):
            if req.is_retracted or req.finished():
                continue
            req.output_ids.append(result.next_token_ids[i])
            self.add_logprobs(req, i, result, is_prefill=False)
            req.check_finished()
            if req.finished():
                self.finish_req(req)
        self.token_to_kv_pool.free_group_end()
        self.note_decode_step(batch.batch_size())
        self.stream_output(batch.reqs)
        if self.running_batch is not None and self.running_batch.is_empty():
            self.running_batch = None

    def note_decode_step(self, num_tokens: int) -> None:
        self.forward_ct_decode = (self.forward_ct_decode + 1) % (1 << 30)
        self.num_generated_tokens += num_tokens
        if self.forward_ct_decode % self.settings.scheduler.decode_log_interval == 0:
            self.log_decode_stats()

    def finish_req(self, req: Req) -> None:
        self.tree_cache.cache_finished_req(req)
        self.hooks.on_request_finished(req, self)

    def add_logprobs(self, req: Req, i: int, result: BatchResult, is_prefill: bool) -> None:
        if not req.return_logprob or result.next_token_logprobs is None:
            return
        req.output_token_logprobs.append((result.next_token_logprobs[i], req.output_ids[-1]))
        if req.top_logprobs_num > 0 and result.next_token_top_logprobs is not None:
            req.output_top_logprobs.append(result.next_token_top_logprobs[i])
        if is_prefill and req.input_token_logprobs is None and result.input_token_logprobs is not None:
            start = req.extend_logprob_start_len
            # Position p's logprob is of token p+1 of the prompt.
            targets = req.fill_ids[len(req.prefix_indices) + start + 1 :]
            req.input_token_logprobs = list(zip(result.input_token_logprobs[i], targets))
            if req.logprob_start_len == 0:
                req.input_token_logprobs = [(None, req.fill_ids[0])] + req.input_token_logprobs
            if result.normalized_prompt_logprobs is not None:
                req.normalized_prompt_logprob = result.normalized_prompt_logprobs[i]
            if req.top_logprobs_num > 0 and result.input_top_logprobs is not None:
                tops = list(result.input_top_logprobs[i])
                req.input_top_logprobs = ([None] if req.logprob_start_len == 0 else []) + tops

    # -- output ---------------------------------------------------------------------------------

    def stream_output(self, reqs: list[Req]) -> None:
        is_stream_iter = self.forward_ct_decode % self.settings.scheduler.stream_interval == 0
        out = BatchTokenOut()
        for req in reqs:
            if req.is_retracted:
                continue
            if req.finished() or (req.stream and (is_stream_iter or len(req.output_ids) == 1)):
                out.outputs.append(self.make_output(req))
        if out.outputs:
            self.output_sink(out)

    def make_output(self, req: Req) -> ReqOutput:
        meta = {
            "id": req.rid,
            "prompt_tokens": len(req.origin_input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
            "finish_reason": req.finished_reason.to_json() if req.finished_reason else None,
        }
        if req.return_logprob:
            meta.update(
                input_token_logprobs=req.input_token_logprobs,
                output_token_logprobs=list(req.output_token_logprobs),
                input_top_logprobs=req.input_top_logprobs,
                output_top_logprobs=list(req.output_top_logprobs),
                normalized_prompt_logprob=req.normalized_prompt_logprob,
            )
        params = req.sampling_params
        return ReqOutput(
            rid=req.rid, vid=req.vid, output_ids=list(req.output_ids),
            finished_reason=req.finished_reason, meta_info=meta, no_stop_trim=params.no_stop_trim,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
        )

    # -- idle -----------------------------------------------------------------------------------

    def on_idle(self) -> None:
        self.check_memory()
        self.new_token_ratio.reset()
        self.hooks.on_idle(self)

    def check_memory(self) -> None:
        """Every KV and request slot must be free or held by the cache when nothing runs (Q1)."""
        problems = []
        kv_held = self.token_to_kv_pool.available_size() + self.tree_cache.evictable_size()
        if kv_held != self.max_total_num_tokens:
            problems.append(
                f"KV cache pool leak detected: available={self.token_to_kv_pool.available_size()}, "
                f"evictable={self.tree_cache.evictable_size()}, total={self.max_total_num_tokens}"
            )
        if self.req_to_token_pool.available_size() != self.req_to_token_pool.size:
            problems.append(
                f"Request pool leak detected: free={self.req_to_token_pool.available_size()}, "
                f"size={self.req_to_token_pool.size}"
            )
        if problems:
            msg = "; ".join(problems)
            if self.settings.scheduler.check_leaks:
                raise MemoryLeakError(msg)
            warnings.warn(msg)

    # -- logs -----------------------------------------------------------------------------------

    def num_used_tokens(self) -> int:
        return self.max_total_num_tokens - (
            self.token_to_kv_pool.available_size() + self.tree_cache.evictable_size()
        )

    def cache_hit_rate(self) -> float:
        return self.cache_hit_tokens / self.cache_total_tokens if self.cache_total_tokens else 0.0

    def log_prefill_stats(self, adder: PrefillAdder, can_run_list: list[Req], running_bs: int) -> None:
        self.cache_hit_tokens += adder.log_hit_tokens
        self.cache_total_tokens += adder.log_hit_tokens + adder.log_input_tokens
        if self.tp_rank != 0:
            return
        logger.info(
            "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, cache hit rate: %.2f%%, "
            "token usage: %.2f, #running-req: %d, #queue-req: %d",
            len(can_run_list), adder.log_input_tokens, adder.log_hit_tokens,
            100.0 * self.cache_hit_rate(), self.num_used_tokens() / self.max_total_num_tokens,
            running_bs, len(self.waiting_queue) + (self.being_chunked_req is not None),
        )

    def log_decode_stats(self) -> None:
        now = time.time()
        throughput = self.num_generated_tokens / max(now - self.last_decode_stats_tic, 1e-9)
        self.num_generated_tokens = 0
        self.last_decode_stats_tic = now
        if self.tp_rank != 0:
            return
        running = self.running_batch.batch_size() if self.running_batch is not None else 0
        logger.info(
            "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, gen throughput (token/s): "
            "%.2f, #queue-req: %d",
            running, self.num_used_tokens(), self.num_used_tokens() / self.max_total_num_tokens,
            throughput, len(self.waiting_queue),
        )

    def shutdown(self) -> None:
        self.worker.shutdown()

