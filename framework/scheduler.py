"""The scheduler event loop. It holds no policy: every decision is a hook (framework/hookspecs.py).

One loop serves the plain and the pipelined (overlap) worker: each launched batch is queued with
its result handle; a plain worker's result is processed at once, a pipelined worker's one
iteration later, after the next batch was launched.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import warnings
from typing import Any, Callable

from framework.batch import ModelWorkerBatch, ScheduleBatch
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
    ProfileReq,
    ProfileReqOutput,
    ReqOutput,
    UpdateWeightsReq,
    UpdateWeightsReqOutput,
)
from framework.grammar import (
    GRAMMAR_FUTURE_KEY, GRAMMAR_KEY, GrammarBackend, accept_last_token, batch_vocab_mask, grammar_key,
    grammar_of, jump_forward_drafts, MAX_DRAFT_TOKENS,
)
from framework.multimodal import IMAGE_TOO_LONG_MESSAGE, ImageInputs, expand_image_tokens
from framework.plugins import PluginHookError, PluginManager
from framework.profiling import TorchProfiler
from framework.request import FinishAbort, FinishLength, FinishMatchedToken, Req, Stash, StashKey, request_kind_error
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
        dp_rank: int | None = None,
    ):
        self.settings = settings
        self.dp_rank = dp_rank
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
        self.is_generation = self.worker.is_generation

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
        self.grammar_backend = GrammarBackend(
            self.tokenizer, self.worker.vocab_size, sched.grammar_compile_threads
        )
        # The mask of batch N+1 needs batch N's tokens, which a pipelined worker has not returned
        # yet when N+1 is launched; jump-forward is off there, as in the reference.
        self.enable_jump_forward = sched.enable_jump_forward and not self.worker.is_pipelined
        if sched.enable_jump_forward and self.worker.is_pipelined and "enable_jump_forward" in sched.model_fields_set:
            logger.info("Jump-forward is off: the %s worker is pipelined.", settings.plugins.worker)
        # TP ranks must admit the same requests: they wait for each compilation instead of the
        # reference's all-reduce of the ready count (X2).
        self.wait_for_grammars = settings.parallel.tp_size > 1

        # Running state (reference B4).
        self.waiting_queue: list[Req] = []
        # Requests whose grammar is still compiling, in arrival order (reference X1, X2).
        self.grammar_queue: list[Req] = []
        self.running_batch: ScheduleBatch | None = None
        self.cur_batch: ScheduleBatch | None = None
        self.last_batch: ScheduleBatch | None = None
        self.being_chunked_req: Req | None = None
        self.batch_is_full = False
        self.result_queue: collections.deque[tuple[ScheduleBatch, ResultHandle]] = collections.deque()
        # A pipelined worker's launched batch whose grammar mask is still to be filled.
        self.pending_vocab_mask: tuple[list[Req], ModelWorkerBatch] | None = None
        self.forward_ct = 0
        self.forward_ct_decode = 0
        self.num_generated_tokens = 0
        self.last_decode_stats_tic = time.time()
        self.cache_hit_tokens = 0
        self.cache_total_tokens = 0
        self.num_retractions = 0
        # Jump-forward draft tokens the model agreed with, and those it replaced.
        self.num_draft_tokens_kept = 0
        self.num_draft_tokens_dropped = 0
        self.num_received_reqs = 0
        self.num_late_finish_frees = 0  # KV slots of requests that finished one step late (K6)
        self.new_token_ratio = NewTokenRatio(
            sched.init_new_token_ratio, sched.schedule_conservativeness,
            sched.min_new_token_ratio_factor, sched.new_token_ratio_decay_steps,
        )
        self.inbox: collections.deque[Any] = collections.deque()
        self.stash = Stash()  # per-plugin scheduler-wide state
        self.profiler = TorchProfiler(settings.server.profile_dir)

    # -- the loop -------------------------------------------------------------------------------

    def run_once(self) -> bool:
        """One iteration of the event loop; returns False when there was nothing to do."""
        self.process_input_requests()
        batch = self.get_next_batch_to_run()
        batch = self.prepare_batch(batch)
        self.cur_batch = batch
        if batch is not None:
            handle = self.run_batch(batch)
            kept = batch.copy_for_result() if self.worker.is_pipelined else batch
            self.result_queue.append((kept, handle))
        if self.result_queue and (batch is None or not self.worker.is_pipelined or len(self.result_queue) > 1):
            self.process_batch_result(*self.result_queue.popleft())
        elif batch is None:
            self.on_idle()
        self.fill_pending_vocab_mask()
        self.last_batch = batch
        return batch is not None or bool(self.result_queue)

    def has_work(self) -> bool:
        return bool(
            self.inbox or self.waiting_queue or self.grammar_queue or self.result_queue
            or self.being_chunked_req
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
            elif isinstance(msg, UpdateWeightsReq):
                self.send_reply(UpdateWeightsReqOutput(msg.request_id, *self.update_weights(msg.model_path)))
            elif isinstance(msg, ProfileReq):
                self.send_reply(ProfileReqOutput(msg.request_id, *self.profile(msg.action)))
            else:
                # The reference raises here and kills the server; an unknown message is logged.
                logger.error("scheduler received an unknown message: %r", type(msg).__name__)
        if self.grammar_queue:
            self.move_ready_grammar_requests()

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

    def validate_request(self, msg: GenerateReqInput) -> str | None:
        """Why a request cannot be served by this model, or None (before any session history)."""
        error = request_kind_error(msg.is_embedding, self.is_generation)
        if error is not None or msg.input_embeds is None:
            return error
        if msg.session_id is not None:
            return "input_embeds: a session request takes text or input_ids"
        if msg.return_logprob and msg.logprob_start_len not in (-1, len(msg.input_ids) - 1):
            return "logprob_start_len: an input_embeds prompt has no tokens to score; leave it at -1"
        shape = tuple(msg.input_embeds.shape)
        if shape != (len(msg.input_ids), self.worker.hidden_size):
            return (f"input_embeds: shape {list(shape)} does not match {len(msg.input_ids)} placeholder "
                    f"ids and the model's hidden size {self.worker.hidden_size}")
        return None

    def handle_generate_request(self, msg: GenerateReqInput) -> None:
        self.num_received_reqs += 1
        input_ids = msg.input_ids
        error = self.validate_request(msg)
        if msg.session_id is not None and error is None:
            try:
                input_ids = self.sessions.input_ids_for(msg.session_id, msg.session_rid, input_ids)
            except SessionError as exc:
                error = str(exc)
        req = Req(
            msg.rid, input_ids, msg.sampling_params, origin_input_text=msg.input_text,
            return_logprob=msg.return_logprob, logprob_start_len=msg.logprob_start_len,
            top_logprobs_num=msg.top_logprobs_num, stream=msg.stream,
            eos_token_ids=self.worker.eos_token_ids, session_id=msg.session_id,
            priority=msg.priority, is_embedding=msg.is_embedding, input_embeds=msg.input_embeds, lora_path=msg.lora_path,
        )
        req.tokenizer = self.tokenizer
        image_error = self.attach_images(req, msg.image_inputs) if msg.image_inputs is not None else None
        if req.logprob_start_len == -1:
            # Over the whole input, session history included (the reference counts only the new
            # segment, which limits a continued request's prefix hit when it asks for logprobs).
            req.logprob_start_len = len(req.origin_input_ids) - 1
        error = (
            error or image_error or self.validate_input(req.origin_input_ids)
            or self.validate_lora(req.lora_path)
        )
        if error is not None:
            # Rejected before it takes any memory (the reference prefills first, QUIRK 5).
            self.reject(req, error)
            return
        if msg.session_id is not None:
            self.sessions.record(msg.session_id, req)
        params = req.sampling_params
        if params.has_output_penalties() and not self.worker.supports_output_penalties:
            # Reference W4: under the overlap scheduler these penalties are ignored with a warning.
            logger.warning(
                "Request %s: frequency/presence/repetition penalties are ignored by the %s worker "
                "(set worker.overlap_penalties = \"fallback\" to apply them).",
                req.rid, self.settings.plugins.worker,
            )
            params.drop_output_penalties()
        params.max_new_tokens = 0 if req.is_embedding else min(
            params.max_new_tokens if params.max_new_tokens is not None else 1 << 30,
            self.max_req_len - len(req.origin_input_ids) - 1,
        )
        key = grammar_key(params)
        if key is not None:
            req.stash[GRAMMAR_FUTURE_KEY] = self.grammar_backend.submit(key)
            self.grammar_queue.append(req)
            self.move_ready_grammar_requests()
            return
        self.enqueue(req)

    def enqueue(self, req: Req) -> None:
        self.waiting_queue.append(req)
        try:
            self.hooks.on_request_received(req, self)
        except PluginHookError as exc:
            logger.error("Request %s fails: %s", req.rid, exc)
            self.waiting_queue = [r for r in self.waiting_queue if r is not req]
            self.reject(req, str(exc))

    def attach_images(self, req: Req, images: ImageInputs) -> str | None:
        """Expand the prompt's image tokens into hash-derived pad ids (AA3); why not, or None."""
        info = getattr(self.worker, "image_info", None)
        if info is None:
            return "image_data: this model does not take images"
        try:
            req.origin_input_ids = expand_image_tokens(req.origin_input_ids, images, info, self.worker.vocab_size)
        except ValueError as exc:
            return str(exc)
        req.image_inputs = images
        if len(req.origin_input_ids) > self.max_req_input_len:
            # An image cannot be truncated; refused before it takes memory (QUIRK 5 fixed).
            return IMAGE_TOO_LONG_MESSAGE
        return None

    def reject(self, req: Req, message: str) -> None:
        """Finish a request that never took memory, reporting `message`."""
        req.finished_reason = FinishAbort(message)
        self.stream_output([req])

    def move_ready_grammar_requests(self) -> None:
        """Move requests whose grammar is compiled to the waiting queue, in order; stop at the
        first still compiling (the reference's head-of-line order, without its 50 ms wait).
        A grammar that failed to compile finishes its request with the error."""
        num_ready = 0
        for req in self.grammar_queue:
            future = req.stash[GRAMMAR_FUTURE_KEY]
            if not future.done() and not self.wait_for_grammars:
                break
            num_ready += 1
            del req.stash[GRAMMAR_FUTURE_KEY]
            try:
                req.stash[GRAMMAR_KEY] = self.grammar_backend.make_grammar(future)
            except Exception as exc:  # a compile error belongs to this request alone
                self.reject(req, f"Grammar compilation failed: {exc}")
                continue
            self.enqueue(req)
        del self.grammar_queue[:num_ready]

    # -- batch selection (reference D) ------------------------------------------------------------

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        last = self.last_batch
        # A decode step with jump-forward drafts is an extend pass of the running batch itself.
        if last is not None and last.forward_mode.is_extend() and last is not self.running_batch:
            req = self.being_chunked_req
            if req is not None and any(r is req for r in last.reqs):
                last.filter_batch(being_chunked_req=req)
                if req.finished():  # aborted between two chunks
                    self.being_chunked_req = None
                    self.finish_req(req, token_ids=req.fill_ids)  # only its chunks so far have KV
                    self.stream_output([req])
                else:
                    self.tree_cache.cache_unfinished_req(req)
                    # The request keeps its rid and gets a new slot with its next chunk.
                    self.tree_cache.free_req_slot(req)
                self.batch_is_full = False
            else:
                # Requests finished by their prefill (all of an embedding batch) do not join the
                # running batch, where they would count as running until its next filter.
                last.filter_batch()
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
            try:
                self.hooks.select_prefill(self, adder)
            except PluginHookError as exc:
                self.fail_waiting(adder.can_run_list, str(exc))
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

        new_batch = ScheduleBatch(
            can_run_list, self.req_to_token_pool, self.token_to_kv_pool, self.tree_cache,
            vocab_size=self.worker.vocab_size,
        )
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
            try:
                decision = self.hooks.on_decode_oom(batch, self)
            except PluginHookError as exc:
                self.fail_batch_reqs(batch, str(exc))
                batch.filter_batch()
                self.batch_is_full = False
                return None
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
        if self.enable_jump_forward:
            self.jump_forward(batch)
        if batch.batch_size() < initial_bs:
            self.batch_is_full = False
        batch.prepare_for_decode()
        return batch

    def jump_forward(self, batch: ScheduleBatch) -> None:
        """Requests whose grammar forces the next characters get the forced text's tokens
        appended as drafts (reference J). They stay in the batch: its next pass computes each
        request's last token and its drafts together, and keeps the drafts the model agrees with
        (`settle_drafts`). The reference sends them back to waiting to be re-prefilled instead.
        A request proposes at most `DRAFT_LIMIT_KEY` drafts, and all together fit the free KV."""
        # KV slots beyond the one per request that the decode step takes anyway.
        budget = self.token_to_kv_pool.available_size() + self.tree_cache.evictable_size() - batch.batch_size()
        for req in batch.reqs:
            if budget <= 0:
                break
            # Logprobs of jumped tokens would need the reference's re-derivation (J2 step 5); a
            # stop string completed inside kept drafts would be found only after them.
            if grammar_of(req) is None or req.return_logprob or req.sampling_params.stop_strs:
                continue
            limit = min(budget, req.stash.get(DRAFT_LIMIT_KEY, MAX_DRAFT_TOKENS))
            drafts = jump_forward_drafts(req, self.tokenizer, self.worker.vocab_size, limit=limit)
            if drafts is None:
                continue
            tokens, masks = drafts
            req.output_ids.extend(tokens)
            req.num_draft_tokens = len(tokens)
            req.draft_vocab_masks = masks
            budget -= len(tokens)

    def settle_drafts(self, batch: ScheduleBatch, kept: list[int]) -> None:
        """Some requests of the pass computed draft tokens, of which the model agreed with the
        first `kept[i]`: the others leave the request's outputs, its KV and its matcher (the
        batch's next token for it is the model's own in their place)."""
        dropped_any = False
        for i, req in enumerate(batch.reqs):
            if not req.num_draft_tokens:
                continue
            proposed = req.num_draft_tokens
            dropped = req.keep_draft_tokens(kept[i])
            # Propose about as many as the model takes (a refused draft is a token computed for
            # nothing): one more than it kept after a refusal, twice as many after a full accept.
            limit = req.stash.get(DRAFT_LIMIT_KEY, MAX_DRAFT_TOKENS)
            req.stash[DRAFT_LIMIT_KEY] = max(1, kept[i] + 1) if dropped else min(MAX_DRAFT_TOKENS, max(limit, 2 * proposed))
            req.stash[JUMPED_TOKENS_KEY] = req.stash.get(JUMPED_TOKENS_KEY, 0) + kept[i]
            self.num_draft_tokens_kept += kept[i]
            self.num_draft_tokens_dropped += dropped
            if dropped:
                batch.drop_last_tokens(i, dropped)
                grammar_of(req).rollback(dropped)
                dropped_any = True
        if dropped_any:
            # Before any request appends this pass's token, so its rows are those of the pass.
            batch.rebuild_penalties()

    def retract_req(self, req: Req, kv_len: int) -> None:
        """Release a running request's memory and send it back to waiting (used by on_decode_oom)."""
        self.tree_cache.retract_req(req, kv_len)
        req.reset_for_retract()

    # -- running and results --------------------------------------------------------------------

    def run_batch(self, batch: ScheduleBatch) -> ResultHandle:
        self.forward_ct += 1
        worker_batch = batch.get_model_worker_batch()
        if batch.sampling_info is not None and any(grammar_of(r) is not None for r in batch.reqs):
            if self.worker.is_pipelined:
                # The matchers have not seen the previous batch's tokens yet: the mask is filled
                # once that result is processed, and sampling waits for it (reference C2, 4.1).
                worker_batch.vocab_mask_ready = threading.Event()
                self.pending_vocab_mask = (list(batch.reqs), worker_batch)
            else:
                batch.sampling_info.vocab_mask = batch_vocab_mask(batch.reqs, self.worker.vocab_size)
        handle = self.worker.launch(worker_batch)
        # The next decode step may be built before this result is processed (pipelined worker).
        for req, token_id in zip(batch.reqs, handle.next_token_ids):
            req.future_token_id = token_id
        return handle

    def fill_pending_vocab_mask(self) -> None:
        """Fill the in-flight batch's grammar mask and let its sampling go on. Called when every
        earlier result is processed: after the previous batch's, or at once when the pipeline
        starts (the reference's DUMMY_FIRST step)."""
        if self.pending_vocab_mask is None:
            return
        reqs, worker_batch = self.pending_vocab_mask
        self.pending_vocab_mask = None
        try:
            worker_batch.sampling_info.vocab_mask = batch_vocab_mask(reqs, self.worker.vocab_size)
        finally:
            worker_batch.vocab_mask_ready.set()  # even on an error: the forward thread must not hang

    def process_batch_result(self, batch: ScheduleBatch, handle: ResultHandle) -> None:
        result = handle.result()
        if batch.forward_mode.is_idle():
            pass  # a DP-attention rank without requests: only the hooks see the batch
        elif batch.forward_mode.is_decode():
            self.process_batch_result_decode(batch, result, handle.next_token_ids)
        elif batch.is_embedding:
            self.process_batch_result_embedding(batch, result)
        else:
            self.process_batch_result_prefill(batch, result, handle.next_token_ids)
        try:
            self.hooks.on_batch_result(batch, result, self)
        except PluginHookError as exc:
            self.fail_batch_reqs(batch, str(exc))
        self.fail_batch_reqs(batch)  # those a failed prepare_batch marked

    def process_batch_result_prefill(self, batch: ScheduleBatch, result: BatchResult, launched: list[int]) -> None:
        decoding = {id(r) for r in batch.decoding_reqs} if batch.decoding_reqs else set()
        if any(r.num_draft_tokens for r in batch.reqs):
            # A worker that does not check drafts (no `kept_draft_tokens`) keeps them all, unchecked.
            kept = result.kept_draft_tokens or [r.num_draft_tokens for r in batch.reqs]
            self.settle_drafts(batch, kept)
        for i, req in enumerate(batch.reqs):
            if req.is_retracted:
                continue
            if req.is_being_chunked > 0:
                # A middle chunk: its sampled token is discarded.
                req.is_being_chunked -= 1
                continue
            if req.finished():
                self.free_late_finished_slot(batch, i)
                continue
            self.append_token(req, result.next_token_ids[i], launched[i])
            self.add_logprobs(req, i, result, is_prefill=id(req) not in decoding)
            self.check_finished(req)
            if req.finished():
                self.finish_req(req)
            elif id(req) not in decoding and req.input_embeds is None:
                # (An input_embeds request keeps its KV to itself, see finish_req.)
                self.tree_cache.cache_unfinished_req(req)
        if decoding:
            self.note_decode_step(len(decoding))
        self.stream_output(batch.reqs)

    def process_batch_result_embedding(self, batch: ScheduleBatch, result: BatchResult) -> None:
        for i, req in enumerate(batch.reqs):
            if req.finished():  # aborted meanwhile
                continue
            if req.is_being_chunked > 0:
                req.is_being_chunked -= 1  # a middle chunk: neither finished nor cached (post1)
                continue
            req.embedding = result.embeddings[i]
            req.finished_reason = FinishLength(length=0)
            self.finish_req(req)
        self.stream_output(batch.reqs)

    def process_batch_result_decode(self, batch: ScheduleBatch, result: BatchResult, launched: list[int]) -> None:
        self.token_to_kv_pool.free_group_begin()
        for i, req in enumerate(batch.reqs):
            if req.is_retracted:
                continue
            if req.finished():
                self.free_late_finished_slot(batch, i)
                continue
            self.append_token(req, result.next_token_ids[i], launched[i])
            self.add_logprobs(req, i, result, is_prefill=False)
            self.check_finished(req)
            if req.finished():
                self.finish_req(req)
        self.token_to_kv_pool.free_group_end()
        self.note_decode_step(batch.batch_size())
        self.stream_output(batch.reqs)
        if self.running_batch is not None and self.running_batch.is_empty():
            self.running_batch = None

    def append_token(self, req: Req, token_id: int, launched_id: int) -> None:
        req.output_ids.append(token_id)
        # Unless a later batch, launched meanwhile, already holds the request's next placeholder.
        if req.future_token_id == launched_id:
            req.future_token_id = None

    def free_late_finished_slot(self, batch: ScheduleBatch, i: int) -> None:
        """Request `i` finished (or was aborted) while this batch was in flight, so the batch gave
        it a KV slot for a token it will never keep: free that slot, exactly once. Only a pipelined
        worker gets here; `cache_finished_req` covers `(origin + output)[:-1]` (reference K6)."""
        end = batch.token_end(i)
        self.token_to_kv_pool.free(batch.out_cache_loc[end - 1 : end])
        self.num_late_finish_frees += 1

    def check_finished(self, req: Req) -> None:
        """The grammar accepts the new token first (after the logprobs, as in the reference); a
        completed grammar finishes the request."""
        if accept_last_token(req) and not req.finished():
            req.finished_reason = FinishMatchedToken(matched=req.output_ids[-1])
        req.check_finished()

    def note_decode_step(self, num_tokens: int) -> None:
        self.forward_ct_decode = (self.forward_ct_decode + 1) % (1 << 30)
        self.num_generated_tokens += num_tokens
        if self.forward_ct_decode % self.settings.scheduler.decode_log_interval == 0:
            self.log_decode_stats()

    def finish_req(self, req: Req, token_ids: list[int] | None = None) -> None:
        """Release a finished request's KV to the cache; `token_ids` are those with KV when not
        the cache's default (origin + output minus the last sampled token)."""
        if req.input_embeds is not None:
            # Its KV is keyed by placeholder ids, useless to any other request: all of it goes
            # back, as for a retraction (it never matched a prefix and is never chunked).
            self.tree_cache.retract_req(req, kv_len=req.seqlen() - 1)
        else:
            if token_ids is None and req.is_embedding:
                # No output token: the whole prompt has KV (the reference appends a dummy 0 instead).
                token_ids = req.origin_input_ids
            self.tree_cache.cache_finished_req(req, token_ids)
        self.notify_finished(req)

    def notify_finished(self, req: Req) -> None:
        """on_request_finished; a plugin failing there turns the request's finish into that error
        (its memory is already released)."""
        try:
            self.hooks.on_request_finished(req, self)
        except PluginHookError as exc:
            logger.error("Request %s fails: %s", req.rid, exc)
            req.finished_reason = FinishAbort(str(exc))

    # -- plugin failures --------------------------------------------------------------------------

    def prepare_batch(self, batch: ScheduleBatch | None) -> ScheduleBatch | None:
        """The prepare_batch chain. If a plugin fails there, the batch still runs as built (its KV
        must be computed before it can be released like a client abort's) and its requests fail
        with the error once the result is in."""
        try:
            return self.hooks.prepare_batch(batch, self)
        except PluginHookError as exc:
            logger.error("%s; the batch's requests fail", exc)
            for req in batch.reqs if batch is not None else []:
                req.stash[PLUGIN_ERROR_KEY] = str(exc)
            return batch

    def fail_batch_reqs(self, batch: ScheduleBatch, message: str | None = None) -> None:
        """Fail the batch's unfinished requests with `message` (or those marked by a failed
        prepare_batch) the way a client abort does: their KV is computed, so it goes to the cache."""
        for req in batch.reqs:
            marked = req.stash.get(PLUGIN_ERROR_KEY)
            if marked is not None:
                del req.stash[PLUGIN_ERROR_KEY]
            error = message or marked
            if error is None or req.finished() or req.is_retracted:
                continue
            logger.error("Request %s fails: %s", req.rid, error)
            req.finished_reason = FinishAbort(error)
            if req is self.being_chunked_req:
                continue  # released when the next round takes it out of the last batch (D1)
            self.finish_req(req)
            self.stream_output([req])

    def fail_waiting(self, admitted: list[Req], message: str) -> None:
        """select_prefill failed: the waiting requests it did not admit fail (they hold no memory);
        the ones admitted so far run."""
        logger.error("%s; %d waiting requests fail", message, len(self.waiting_queue) - len(admitted))
        keep = {id(r) for r in admitted}
        failed = [r for r in self.waiting_queue if id(r) not in keep]
        self.waiting_queue = [r for r in self.waiting_queue if id(r) in keep]
        for req in failed:
            req.is_retracted = False
            req.finished_reason = FinishAbort(message)
            self.notify_finished(req)
            self.stream_output([req])

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
            "completion_tokens_wo_jump_forward": len(req.output_ids) - req.stash.get(JUMPED_TOKENS_KEY, 0),
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
            finished_reason=req.finished_reason, meta_info=meta, embedding=req.embedding,
            no_stop_trim=params.no_stop_trim,
            skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
        )

    # -- idle -----------------------------------------------------------------------------------

    def on_idle(self) -> None:
        self.check_memory()
        self.new_token_ratio.reset()
        try:
            self.hooks.on_idle(self)
        except PluginHookError as exc:
            logger.error("%s", exc)

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
        if self.pending_vocab_mask is not None:
            # The loop stopped on an error before filling it: let the forward thread go on and exit.
            self.pending_vocab_mask[1].vocab_mask_ready.set()
        self.grammar_backend.shutdown()
        self.worker.shutdown()


# The most drafts the request's next jump proposes (adapted to how many the model kept).
DRAFT_LIMIT_KEY: StashKey[int] = StashKey("draft_limit")
# Output tokens appended by jump-forward (and kept) rather than sampled one pass each.
JUMPED_TOKENS_KEY = StashKey("jumped_tokens")
# The error of a failed prepare_batch: the request fails once its batch's result is in.
PLUGIN_ERROR_KEY: StashKey[str] = StashKey("plugin_error")

