"""Control operations of the scheduler: abort, flush, sessions, stats (reference R, M, S3).

`ControlMixin` is part of `Scheduler`; it is kept apart so the loop's file reads top to bottom.
"""

from __future__ import annotations

import logging
import warnings

from framework.clients import client_stats
from framework.messages import (
    CloseSessionReq,
    CloseSessionReqOutput,
    OpenSessionReq,
    OpenSessionReqOutput,
    SchedulerStats,
)
from framework.request import FinishAbort

logger = logging.getLogger("framework.scheduler")


class MemoryLeakError(RuntimeError):
    """The idle check found KV or request slots that nobody holds."""


class ControlMixin:
    # -- control --------------------------------------------------------------------------------

    def abort_request(self, rid: str) -> None:
        """Abort wherever the request is; it is reported as aborted (the reference is silent for
        waiting requests and misses the chunked one and the grammar queue, QUIRK 4)."""
        waiting = next((i for i, r in enumerate(self.waiting_queue) if r.rid == rid), None)
        req = self.waiting_queue.pop(waiting) if waiting is not None else self.structured.remove(rid)
        if req is not None:
            # A retracted request waits too; it must still be reported.
            req.is_retracted = False
            req.finished_reason = FinishAbort("Aborted by the client.")
            self.notify_finished(req)
            self.stream_output([req])
            return
        if self.being_chunked_req is not None and self.being_chunked_req.rid == rid:
            # Released when the next round takes it out of the last batch (D1).
            self.being_chunked_req.finished_reason = FinishAbort("Aborted by the client.")
            return
        for batch in (self.running_batch, self.last_batch):
            if batch is None:
                continue
            for req in batch.reqs:
                if req.rid == rid and not req.finished():
                    req.finished_reason = FinishAbort("Aborted by the client.")
                    self.finish_req(req)
                    self.stream_output([req])
                    return

    def has_requests(self) -> bool:
        """Requests are waiting or running. Finished ones may still sit in the running or last
        batch (or a batch whose result is pending) until the next round filters them; their KV is
        already released, so they do not count."""
        batches = (self.running_batch, self.last_batch, *(b for b, _ in self.result_queue))
        running = any(not r.finished() for b in batches if b is not None for r in b.reqs)
        return bool(self.waiting_queue or self.being_chunked_req or running)

    def flush_cache(self) -> bool:
        if self.has_requests():
            logger.warning("Cache not flushed: there are running or waiting requests.")
            return False
        # A pipelined worker may still run a batch of finished requests: let it free their slots.
        while self.result_queue:
            self.process_batch_result(*self.result_queue.popleft())
        self.running_batch = self.last_batch = None
        self.tree_cache.reset()
        self.structured.reset()
        self.req_to_token_pool.clear()
        self.token_to_kv_pool.clear()
        self.cache_hit_tokens = self.cache_total_tokens = 0
        logger.info("Cache flushed.")
        return True

    def update_weights(self, model_path: str) -> tuple[bool, str]:
        """New weights for the running worker, then an empty cache: the cached KV was computed
        by the old weights (R4). Refused while requests run, which would mix the two."""
        if self.has_requests():
            return False, "Cannot update weights while requests are running or waiting; try again when idle."
        success, message = self.worker.update_weights(model_path)
        if success:
            flushed = self.flush_cache()
            assert flushed, "idle scheduler must flush"
            logger.info("Weights updated from %s", model_path)
        else:
            logger.warning("Weight update failed: %s", message)
        return success, message

    def profile(self, action: str) -> tuple[bool, str]:
        # The profiler records the operators of the thread that starts it: the forward thread of a
        # pipelined worker (Python calls are traced in every thread).
        if action == "start":
            return self.worker.run_in_forward_thread(self.profiler.start)
        if action == "stop":
            return self.worker.run_in_forward_thread(self.profiler.stop)
        return False, f"unknown profile action {action!r}"

    def open_session(self, msg: OpenSessionReq) -> OpenSessionReqOutput:
        if not self.sessions.open(msg.session_id, msg.capacity_of_str_len):
            logger.warning("session id %s already exists; it is kept as it was", msg.session_id)
            return OpenSessionReqOutput(msg.request_id, msg.session_id, False, "session id already exists")
        return OpenSessionReqOutput(msg.request_id, msg.session_id, True)

    def close_session(self, msg: CloseSessionReq) -> CloseSessionReqOutput:
        # The session's in-flight requests run on; their KV is released as usual (M2).
        if not self.sessions.close(msg.session_id):
            return CloseSessionReqOutput(
                msg.request_id, msg.session_id, False, f"session id {msg.session_id} does not exist"
            )
        return CloseSessionReqOutput(msg.request_id, msg.session_id, True)

    def get_stats(self, request_id: str | None = None) -> SchedulerStats:
        """The SchedulerStats gauges now, plus the pools' free counts."""
        running = self.running_batch.batch_size() if self.running_batch is not None else 0
        elapsed = self.clock.now() - self.last_decode_stats_tic
        return SchedulerStats(
            request_id=request_id,
            num_running_reqs=running,
            num_queue_reqs=len(self.waiting_queue) + (self.being_chunked_req is not None),
            num_used_tokens=self.num_used_tokens(),
            token_usage=self.num_used_tokens() / self.max_total_num_tokens,
            # Tokens generated since the last decode log, over the time since then.
            gen_throughput=self.num_generated_tokens / elapsed if elapsed > 0 else 0.0,
            cache_hit_rate=self.cache_hit_rate(),
            max_total_num_tokens=self.max_total_num_tokens,
            kv_available=self.token_to_kv_pool.available_size(),
            kv_evictable=self.tree_cache.evictable_size(),
            req_slots_free=self.req_to_token_pool.available_size(),
            req_slots_total=self.req_to_token_pool.size,
            num_sessions=len(self.sessions),
            forward_ct=self.forward_ct,
            num_received_reqs=self.num_received_reqs,
            num_grammar_queue_reqs=len(self.structured.queue),
            clients=client_stats(self, self.settings.metrics.max_client_labels),
            dp_rank=self.dp_rank,
        )

    def send_reply(self, reply) -> None:
        """Send a control reply to the tokenizer side; dropped when nobody listens (the offline
        Engine calls the control methods directly and reads their return values)."""
        if self.reply_sink is not None:
            self.reply_sink(reply)

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
