"""What the scheduler does when a plugin raises in a request-time hook (issue 18).

The `Hooks` facade turns such an exception into `PluginHookError`, which names the plugin; the
scheduler fails the request or batch concerned with that message and keeps serving.
`PluginFailureMixin` is part of `Scheduler`; it is kept apart so the loop's file reads top to bottom.
"""

from __future__ import annotations

import logging

from framework.batch import ScheduleBatch
from framework.plugins import PluginHookError
from framework.request import FinishAbort, Req, StashKey

logger = logging.getLogger("framework.scheduler")

# The error of a failed prepare_batch: the request fails once its batch's result is in.
PLUGIN_ERROR_KEY: StashKey[str] = StashKey("plugin_error")


class PluginFailureMixin:
    def notify_finished(self, req: Req) -> None:
        """on_request_finished; a plugin failing there turns the request's finish into that error
        (its memory is already released)."""
        try:
            self.hooks.on_request_finished(req, self.view)
        except PluginHookError as exc:
            logger.error("Request %s fails: %s", req.rid, exc)
            req.finished_reason = FinishAbort(str(exc))

    # The last failure of prepare_batch with no batch to run: an idle loop asks every round, so the
    # same failure is logged once (then at DEBUG) until another message, a batch, or a round
    # prepare_batch answers (Scheduler.prepare_batch resets it).
    _idle_plugin_error: str | None = None

    def mark_batch_failed(self, batch: ScheduleBatch | None, message: str) -> None:
        """prepare_batch failed: the batch's requests fail with `message` once its result is in."""
        if batch is None:
            repeated = message == self._idle_plugin_error
            self._idle_plugin_error = message
            logger.log(logging.DEBUG if repeated else logging.ERROR,
                       "%s (with no batch to run; while it repeats it is logged at DEBUG only)", message)
            return
        self._idle_plugin_error = None
        logger.error("%s; the batch's requests fail", message)
        for req in batch.reqs:
            req.stash[PLUGIN_ERROR_KEY] = message

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
