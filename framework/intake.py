"""The scheduler's intake: messages in; requests validated, clamped, queued (reference A, M, AA).

`IntakeMixin` is part of `Scheduler`; it is kept apart so the loop's file reads top to bottom.
"""

from __future__ import annotations

import logging
from typing import Any

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
from framework.multimodal import IMAGE_TOO_LONG_MESSAGE, ImageInputs, expand_image_tokens, image_count_problem
from framework.plugins import PluginHookError
from framework.request import FinishAbort, Req, input_too_long_message, request_kind_error
from framework.sessions import SessionError

logger = logging.getLogger("framework.scheduler")


class IntakeMixin:
    def send(self, message: Any) -> None:
        """Queue a message for the next iteration (in-process transport)."""
        self.inbox.append(message)

    def process_input_requests(self) -> None:
        # In arrival order, so a session opened (or closed) before a request is seen by it.
        while self.inbox:
            msg = self.inbox.popleft()
            if isinstance(msg, GenerateReqInput):
                self.receive_request(msg)
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
        if self.structured.queue:
            self.structured.move_ready()

    def validate_input(self, input_ids: list[int]) -> str | None:
        """Why a prompt cannot be served, or None."""
        if len(input_ids) == 0:
            return "The prompt is empty: give at least one token."
        if len(input_ids) > self.max_req_input_len:
            return input_too_long_message(len(input_ids), self.worker.context_len, self.max_total_num_tokens,
                                          self.max_req_input_len)
        return None

    def validate_lora(self, lora_path: str | None) -> str | None:
        """Why a request's adapter cannot be served, or None."""
        if lora_path is None or lora_path in self.lora_names:
            return None
        loaded = ", ".join(self.lora_names) if self.lora_names else "none (see model.lora_paths)"
        return f"lora_path: unknown LoRA adapter {lora_path!r}; loaded adapters: {loaded}"

    def validate_session_logprob_start(self, req: Req) -> str | None:
        """Why a session request's `logprob_start_len` is past its input, or None (the server
        checks it against the prompt, but a session's history is known only here)."""
        if req.session_id is None or req.logprob_start_len < len(req.origin_input_ids):
            return None
        return (f"logprob_start_len: must be < the prompt length ({len(req.origin_input_ids)}), "
                f"got {req.logprob_start_len}")

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

    def receive_request(self, msg: GenerateReqInput) -> None:
        """`handle_generate_request` as a last line of defence: an error there is this request's
        alone, so it is logged with its rid and the request fails (aborted, holding nothing);
        the loop serves on. (The reference lets any scheduler error end the server.)"""
        try:
            self.handle_generate_request(msg)
        except Exception as exc:
            logger.exception("Request %s failed at intake; it is aborted and the scheduler serves on", msg.rid)
            self.waiting_queue = [r for r in self.waiting_queue if r.rid != msg.rid]
            self.structured.remove(msg.rid)
            reason = FinishAbort(f"internal error at intake: {type(exc).__name__}: {exc}")
            meta = {"id": msg.rid, "prompt_tokens": len(msg.input_ids), "completion_tokens": 0,
                    "cached_tokens": 0, "finish_reason": reason.to_json()}
            self.output_sink(BatchTokenOut([ReqOutput(msg.rid, 0, [], reason, meta)]))

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
            client_id=msg.client_id, slo_ttft_ms=msg.slo_ttft_ms,
        )
        req.tokenizer = self.tokenizer
        req.arrival_time = self.clock.now()
        info = getattr(self.worker, "image_info", None)
        image_error = (self.attach_images(req, msg.image_inputs) if msg.image_inputs is not None
                       else None if info is None else image_count_problem(req.origin_input_ids, 0, info))
        if req.logprob_start_len == -1:
            # Over the whole input, session history included (the reference counts only the new
            # segment, which limits a continued request's prefix hit when it asks for logprobs).
            req.logprob_start_len = len(req.origin_input_ids) - 1
        error = (
            error or image_error or self.validate_input(req.origin_input_ids)
            or self.validate_session_logprob_start(req) or self.validate_lora(req.lora_path)
        )
        if error is not None:
            # Rejected before it takes any memory (the reference prefills first, QUIRK 5).
            self.reject(req, error)
            return
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
        if not self.structured.submit(req):  # a request with a grammar waits for its compilation
            self.enqueue(req)
        if msg.session_id is not None and not req.finished():
            # Only once taken in: a plugin's refusal in enqueue leaves the history as it was.
            self.sessions.record(msg.session_id, msg.session_rid, req)

    def enqueue(self, req: Req) -> None:
        self.waiting_queue.append(req)
        try:
            self.hooks.on_request_received(req, self.view)
        except PluginHookError as exc:
            logger.error("Request %s fails: %s", req.rid, exc)
            self.waiting_queue = [r for r in self.waiting_queue if r is not req]
            # the plugins that took it in on_request_received see it end (PluginFailureMixin)
            req.finished_reason = FinishAbort(str(exc))
            self.notify_finished(req)
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
