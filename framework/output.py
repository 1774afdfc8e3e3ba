"""What the scheduler reports: request outputs and logprobs, prefill and decode logs.

`OutputMixin` is part of `Scheduler`; it is kept apart so the loop's file reads top to bottom.
"""

from __future__ import annotations

import logging

from framework.budget import PrefillAdder
from framework.messages import BatchTokenOut, ReqOutput
from framework.request import Req
from framework.structured import StructuredOutput
from framework.worker import BatchResult

logger = logging.getLogger("framework.scheduler")


class OutputMixin:
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
            "completion_tokens_wo_jump_forward": len(req.output_ids) - StructuredOutput.num_jumped_tokens(req),
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
        now = self.clock.now()
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
