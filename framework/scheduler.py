"""The scheduler event loop. It holds no policy: every decision is a hook (framework/hookspecs.py).

One loop serves the plain and the pipelined (overlap) worker: each launched batch is queued with
its result handle; a plain worker's result is processed at once, a pipelined worker's one
iteration later, after the next batch was launched.
"""

from __future__ import annotations

import collections
import logging
from typing import Any, Callable

from framework.batch import ScheduleBatch
from framework.clock import clock_of
from framework.budget import AdderView, NewTokenRatio, PrefillAdder
from framework.config import Settings, SettingsError
from framework.model.cpu import HeapTrimmer
from framework.model.lora import parse_lora_paths
from framework.messages import BatchTokenOut
from framework.plugins import PluginHookError, PluginManager
from framework.profiling import TorchProfiler
from framework.request import FinishLength, Req, Stash
from framework.control import ControlMixin, MemoryLeakError
from framework.failures import PluginFailureMixin
from framework.intake import IntakeMixin
from framework.output import OutputMixin
from framework.sessions import SessionController
from framework.structured import StructuredOutput
from framework.views import BatchView, PrefixMatch, SchedulerView
from framework.worker import BatchResult, ResultHandle

logger = logging.getLogger(__name__)

__all__ = ["MemoryLeakError", "Scheduler"]


class Scheduler(IntakeMixin, OutputMixin, ControlMixin, PluginFailureMixin):
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
        self.view = SchedulerView(self)

        self.worker = self.hooks.create_worker(settings, tp_rank)
        # The wall clock, or the worker's own (the sim worker's virtual clock).
        self.clock = clock_of(self.worker)
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
        if self.max_req_input_len <= 0:
            raise SettingsError(
                f"invalid settings:\ncache.max_total_tokens / model.context_length: too small to hold a request "
                f"(KV pool {self.max_total_num_tokens} tokens, context {self.worker.context_len}: a request needs "
                "at least 7 tokens of both)"
            )
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
        self.structured = StructuredOutput(settings, self.worker, self.enqueue, self.reject)

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
        self.last_decode_stats_tic = self.clock.now()
        self.cache_hit_tokens = 0
        self.cache_total_tokens = 0
        self.num_retractions = 0
        self.num_received_reqs = 0
        self.num_late_finish_frees = 0  # KV slots of requests that finished one step late (K6)
        self.new_token_ratio = NewTokenRatio(
            sched.init_new_token_ratio, sched.schedule_conservativeness,
            sched.min_new_token_ratio_factor, sched.new_token_ratio_decay_steps,
        )
        self.inbox: collections.deque[Any] = collections.deque()
        self.stash = Stash()  # per-plugin scheduler-wide state
        # Prefixes matched by the policy this round (id(req) -> (prefix_indices, last_node)).
        self.prefix_matches: dict[int, tuple[Any, Any]] = {}
        self.profiler = TorchProfiler(settings.server.profile_dir)
        self.heap_trimmer = HeapTrimmer(settings.worker.heap_trim_idle_s, settings.worker.heap_trim_busy_s)

    # -- the loop -------------------------------------------------------------------------------

    def run_once(self) -> bool:
        """One iteration: receive, choose, run, process (a pipelined worker's previous result);
        returns False when there was nothing to do."""
        self.process_input_requests()
        batch = self.prepare_batch(self.get_next_batch_to_run())
        self.cur_batch = batch
        if batch is not None:
            handle = self.run_batch(batch)
            kept = batch.copy_for_result() if self.worker.is_pipelined else batch
            self.result_queue.append((kept, handle))
        if self.result_queue and (batch is None or not self.worker.is_pipelined or len(self.result_queue) > 1):
            self.process_batch_result(*self.result_queue.popleft())
        elif batch is None:
            self.on_idle()
        self.structured.fill_pending_vocab_mask()
        self.last_batch = batch
        busy = batch is not None or bool(self.result_queue)
        self.heap_trimmer.tick(idle=not busy)
        return busy

    def has_work(self) -> bool:
        return bool(
            self.inbox or self.waiting_queue or self.structured.queue or self.result_queue
            or self.being_chunked_req
            or (self.running_batch is not None and not self.running_batch.is_empty())
            or (self.last_batch is not None and not self.last_batch.is_empty())
        )

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
                num_reqs = last.batch_size()
                last.filter_batch()
                if last.batch_size() < num_reqs:
                    # Their running slots are free again. (The reference keeps batch_is_full set
                    # here, and a queue that filled max_running_requests this way never moves.)
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
            self.admit_selected(adder, running_bs)
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

    def admit_selected(self, adder: PrefillAdder, running_bs: int) -> None:
        """Ask the policy for its order and admit through `adder`. The chosen requests go to the
        front of the waiting queue in that order (the reference sorts the queue in place)."""
        self.prefix_matches = {}
        try:
            try:
                chosen = self.hooks.select_prefill(self.view, AdderView(adder))
            except PluginHookError as exc:
                self.fail_waiting(adder.can_run_list, str(exc))
                return
            if chosen is None:
                return
            picked = {id(r) for r in chosen}  # (the facade checked: distinct waiting requests)
            self.waiting_queue = chosen + [r for r in self.waiting_queue if id(r) not in picked]
            running = self.running_batch.reqs if running_bs else []
            max_loras = self.max_loras_per_batch if self.lora_names else None
            if adder.admit(chosen, running, self.max_running_requests, max_loras, self.prefix_matches):
                self.batch_is_full = True
        finally:
            self.prefix_matches = {}

    def live_requests(self) -> tuple[list[Req], list[Req]]:
        """(waiting, running) requests now. Waiting: the waiting and grammar queues and the request
        being chunked (as SchedulerStats counts it); running: the unfinished requests of the running
        batch and of the last batch (a prefill batch joins the running one at the next iteration)."""
        chunked = self.being_chunked_req
        waiting = [*self.waiting_queue, *self.structured.queue, *([chunked] if chunked is not None else [])]
        running, seen = [], set()
        for batch in (self.running_batch, self.last_batch):
            for req in batch.reqs if batch is not None else ():
                if req is not chunked and not req.finished() and id(req) not in seen:
                    seen.add(id(req))
                    running.append(req)
        return waiting, running

    def match_waiting_prefix(self, req: Req) -> PrefixMatch:
        """`SchedulerView.match_prefix`: match without changing `req`, and keep the match for
        this round's admission."""
        fill_ids = req.origin_input_ids + req.output_ids
        indices, node = self.tree_cache.match_prefix(rid=req.rid, key=fill_ids[: req.max_prefix_len()])
        self.prefix_matches[id(req)] = (indices, node)
        return PrefixMatch(len(indices), node)

    def update_running_batch(self, batch: ScheduleBatch) -> ScheduleBatch | None:
        initial_bs = batch.batch_size()
        batch.filter_batch()
        if batch.is_empty():
            self.batch_is_full = False
            return None
        if not batch.check_decode_mem() or (self.force_retract and batch.batch_size() > 10):
            try:
                self.retract_decode(batch, self.hooks.on_decode_oom(BatchView(batch), self.view))
                if not batch.check_decode_mem():
                    # Too few victims (an empty list on a real OOM): the decode step's allocation
                    # would raise out of the loop.
                    raise self.hooks.refused("on_decode_oom", (
                        f"after its victims, the next decode step of {batch.batch_size()} requests does not "
                        f"fit the {self.token_to_kv_pool.available_size()} free KV slots; list more victims"))
            except PluginHookError as exc:
                self.fail_batch_reqs(batch, str(exc))
                batch.filter_batch()
                self.batch_is_full = False
                return None
        else:
            self.new_token_ratio.step()
        self.structured.jump_forward(batch, self.view.num_free_kv_tokens)
        if batch.batch_size() < initial_bs:
            self.batch_is_full = False
        batch.prepare_for_decode()
        return batch

    def retract_decode(self, batch: ScheduleBatch, decision: tuple[list[Req], float | None]) -> None:
        """Apply `on_decode_oom`'s answer, as the facade checked it: (victims in order, the new
        ratio or None). Retract from the front while the free KV does not cover
        `retract_decode_steps` more steps of the rest, at least one and never the last request
        (reference I2)."""
        victims, new_ratio = decision
        steps = self.retract_decode_steps
        index = {id(r): i for i, r in enumerate(batch.reqs)}
        seq_lens = batch.seq_lens.tolist()
        remaining = batch.batch_size()
        retracted: list[Req] = []
        for req in victims:
            if remaining == 1 or (retracted and self.token_to_kv_pool.available_size() >= remaining * steps):
                # With one request left the reference asserts and dies; we let the decode step
                # try, and the allocator raises a clear out-of-memory error if it truly cannot run.
                break
            self.tree_cache.retract_req(req, seq_lens[index[id(req)]])
            req.reset_for_retract()
            retracted.append(req)
            remaining -= 1
            self.tree_cache.evict(max(0, remaining * steps - self.token_to_kv_pool.available_size()),
                                  self.token_to_kv_pool.free)
        gone = {id(r) for r in retracted}
        batch.filter_batch(keep_indices=[i for i, r in enumerate(batch.reqs) if id(r) not in gone])
        if new_ratio is None:
            # Reference I3: what the remaining requests are expected to decode.
            total_max_new = sum(r.sampling_params.max_new_tokens for r in batch.reqs)
            num_decoded = sum(len(r.output_ids) for r in batch.reqs)
            new_ratio = min(1.0, (num_decoded + steps * len(batch.reqs)) / max(total_max_new, 1))
        self.new_token_ratio.value = new_ratio
        self.num_retractions += len(retracted)
        logger.info(
            "Decode out of memory happened. #retracted_reqs: %d, new_token_ratio: %.4f", len(retracted), new_ratio
        )
        self.waiting_queue.extend(retracted)

    def prepare_batch(self, batch: ScheduleBatch | None) -> ScheduleBatch | None:
        """The `prepare_batch` hook; a batch the scheduler built holds KV slots and must stay.
        If a plugin fails there, the batch still runs as built (its KV must be computed before it
        can be released like a client abort's) and its requests fail once the result is in."""
        try:
            prepared = self.hooks.prepare_batch(batch, self.view)
        except PluginHookError as exc:  # (a returned value the facade refused included)
            self.mark_batch_failed(batch, str(exc))
            return batch
        self._idle_plugin_error = None  # (a failure after this one is logged again)
        return prepared

    def new_idle_batch(self) -> ScheduleBatch:
        batch = ScheduleBatch([], self.req_to_token_pool, self.token_to_kv_pool, self.tree_cache)
        batch.prepare_for_idle()
        return batch

    # -- running and results --------------------------------------------------------------------

    def run_batch(self, batch: ScheduleBatch) -> ResultHandle:
        self.forward_ct += 1
        worker_batch = batch.get_model_worker_batch()
        self.structured.attach_vocab_mask(batch, worker_batch)
        handle = self.worker.launch(worker_batch)
        # The next decode step may be built before this result is processed (pipelined worker).
        for req, token_id in zip(batch.reqs, handle.next_token_ids):
            req.future_token_id = token_id
        return handle

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
            self.hooks.on_batch_result(BatchView(batch), result, self.view)
        except PluginHookError as exc:
            self.fail_batch_reqs(batch, str(exc))
        self.fail_batch_reqs(batch)  # those a failed prepare_batch marked

    def process_batch_result_prefill(self, batch: ScheduleBatch, result: BatchResult, launched: list[int]) -> None:
        decoding = {id(r) for r in batch.decoding_reqs} if batch.decoding_reqs else set()
        if any(r.num_draft_tokens for r in batch.reqs):
            # A worker that does not check drafts (no `kept_draft_tokens`) keeps them all, unchecked.
            kept = result.kept_draft_tokens or [r.num_draft_tokens for r in batch.reqs]
            self.structured.settle_drafts(batch, kept)
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
        """The grammar accepts the new token first; a completed grammar finishes the request."""
        self.structured.accept_token(req)
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

    # -- idle -----------------------------------------------------------------------------------

    def on_idle(self) -> None:
        self.check_memory()
        self.new_token_ratio.reset()
        try:
            self.hooks.on_idle(self.view)
        except PluginHookError as exc:
            logger.error("%s", exc)

    def shutdown(self) -> None:
        self.structured.shutdown()
        self.worker.shutdown()

