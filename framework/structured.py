"""Structured output for the scheduler: one manager for everything grammar-related (reference X, J).

`StructuredOutput` owns the grammar queue (requests whose grammar is still compiling), the
compilation backend, the vocabulary mask of each batch (with the handshake a pipelined worker
needs) and jump-forward drafting. The scheduler calls it at a few seams and holds no grammar code.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Callable

from framework.grammar import (
    GRAMMAR_FUTURE_KEY, GRAMMAR_KEY, MAX_DRAFT_TOKENS, GrammarBackend, accept_last_token, batch_vocab_mask,
    grammar_key, grammar_of, jump_forward_drafts,
)
from framework.request import FinishMatchedToken, Req, StashKey

if TYPE_CHECKING:
    from framework.batch import ModelWorkerBatch, ScheduleBatch
    from framework.config import Settings

logger = logging.getLogger("framework.scheduler")

# The most drafts the request's next jump proposes (adapted to how many the model kept).
DRAFT_LIMIT_KEY: StashKey[int] = StashKey("draft_limit")
# Output tokens appended by jump-forward (and kept) rather than sampled one pass each.
JUMPED_TOKENS_KEY: StashKey[int] = StashKey("jumped_tokens")


class StructuredOutput:
    """Grammar queue, compilation, vocab masks and jump-forward drafts for one scheduler.

    :param enqueue: puts a request whose grammar is ready into the waiting queue.
    :param reject: finishes a request with an error message (its grammar failed to compile).
    """

    def __init__(self, settings: "Settings", worker, enqueue: Callable[[Req], None],
                 reject: Callable[[Req, str], None]):
        sched = settings.scheduler
        self.worker = worker
        self.vocab_size = worker.vocab_size
        self.enqueue = enqueue
        self.reject = reject
        self.backend = GrammarBackend(worker.tokenizer, worker.vocab_size, sched.grammar_compile_threads)
        # The mask of batch N+1 needs batch N's tokens, which a pipelined worker has not returned
        # yet when N+1 is launched; jump-forward is off there, as in the reference.
        self.enable_jump_forward = sched.enable_jump_forward and not worker.is_pipelined
        if sched.enable_jump_forward and worker.is_pipelined and "enable_jump_forward" in sched.model_fields_set:
            logger.info("Jump-forward is off: the %s worker is pipelined.", settings.plugins.worker)
        # TP ranks must admit the same requests: they wait for each compilation instead of the
        # reference's all-reduce of the ready count (X2).
        self.wait_for_grammars = settings.parallel.tp_size > 1
        # Requests whose grammar is still compiling, in arrival order (reference X1, X2).
        self.queue: list[Req] = []
        # A pipelined worker's launched batch whose grammar mask is still to be filled.
        self.pending_vocab_mask: tuple[list[Req], "ModelWorkerBatch"] | None = None
        # Jump-forward draft tokens the model agreed with, and those it replaced.
        self.num_draft_tokens_kept = 0
        self.num_draft_tokens_dropped = 0

    # -- intake ---------------------------------------------------------------------------------

    def submit(self, req: Req) -> bool:
        """Start compiling `req`'s grammar and queue it; False when it has none."""
        key = grammar_key(req.sampling_params)
        if key is None:
            return False
        req.stash[GRAMMAR_FUTURE_KEY] = self.backend.submit(key)
        self.queue.append(req)
        self.move_ready()
        return True

    def move_ready(self) -> None:
        """Move requests whose grammar is compiled to the waiting queue, in order; stop at the
        first still compiling (the reference's head-of-line order, without its 50 ms wait).
        A grammar that failed to compile finishes its request with the error."""
        num_ready = 0
        for req in self.queue:
            future = req.stash[GRAMMAR_FUTURE_KEY]
            if not future.done() and not self.wait_for_grammars:
                break
            num_ready += 1
            del req.stash[GRAMMAR_FUTURE_KEY]
            try:
                req.stash[GRAMMAR_KEY] = self.backend.make_grammar(future)
            except Exception as exc:  # a compile error belongs to this request alone
                self.reject(req, f"Grammar compilation failed: {exc}")
                continue
            self.enqueue(req)
        del self.queue[:num_ready]

    def remove(self, rid: str) -> Req | None:
        """Take a request out of the grammar queue (abort); None when it is not there."""
        for i, req in enumerate(self.queue):
            if req.rid == rid:
                return self.queue.pop(i)
        return None

    # -- masks ----------------------------------------------------------------------------------

    def attach_vocab_mask(self, batch: "ScheduleBatch", worker_batch: "ModelWorkerBatch") -> None:
        """Give a batch with constrained requests its mask before it is launched."""
        if batch.sampling_info is None or all(grammar_of(r) is None for r in batch.reqs):
            return
        if self.worker.is_pipelined:
            # The matchers have not seen the previous batch's tokens yet: the mask is filled
            # once that result is processed, and sampling waits for it (reference C2, 4.1).
            worker_batch.vocab_mask_ready = threading.Event()
            self.pending_vocab_mask = (list(batch.reqs), worker_batch)
        else:
            batch.sampling_info.vocab_mask = batch_vocab_mask(batch.reqs, self.vocab_size)

    def fill_pending_vocab_mask(self) -> None:
        """Fill the in-flight batch's grammar mask and let its sampling go on. Called when every
        earlier result is processed: after the previous batch's, or at once when the pipeline
        starts (the reference's DUMMY_FIRST step)."""
        if self.pending_vocab_mask is None:
            return
        reqs, worker_batch = self.pending_vocab_mask
        self.pending_vocab_mask = None
        try:
            worker_batch.sampling_info.vocab_mask = batch_vocab_mask(reqs, self.vocab_size)
        finally:
            worker_batch.vocab_mask_ready.set()  # even on an error: the forward thread must not hang

    @staticmethod
    def accept_token(req: Req) -> None:
        """The grammar accepts the request's new token (after the logprobs, as in the
        reference); a completed grammar finishes the request."""
        if accept_last_token(req) and not req.finished():
            req.finished_reason = FinishMatchedToken(matched=req.output_ids[-1])

    # -- jump-forward ---------------------------------------------------------------------------

    def jump_forward(self, batch: "ScheduleBatch", num_free_kv: int) -> None:
        """Requests whose grammar forces the next characters get the forced text's tokens
        appended as drafts (reference J). They stay in the batch: its next pass computes each
        request's last token and its drafts together, and keeps the drafts the model agrees with
        (`settle_drafts`). The reference sends them back to waiting to be re-prefilled instead.
        A request proposes at most `DRAFT_LIMIT_KEY` drafts, and all together fit the free KV."""
        if not self.enable_jump_forward:
            return
        # KV slots beyond the one per request that the decode step takes anyway.
        budget = num_free_kv - batch.batch_size()
        for req in batch.reqs:
            if budget <= 0:
                break
            # Logprobs of jumped tokens would need the reference's re-derivation (J2 step 5); a
            # stop string completed, or a stop token kept, inside the drafts would be found only
            # after them.
            params = req.sampling_params
            if (grammar_of(req) is None or req.return_logprob or params.stop_strs
                    or (params.stop_token_ids and not params.ignore_eos)):
                continue
            limit = min(budget, req.stash.get(DRAFT_LIMIT_KEY, MAX_DRAFT_TOKENS))
            drafts = jump_forward_drafts(req, self.worker.tokenizer, self.vocab_size, limit=limit)
            if drafts is None:
                continue
            tokens, masks = drafts
            req.output_ids.extend(tokens)
            req.num_draft_tokens = len(tokens)
            req.draft_vocab_masks = masks
            budget -= len(tokens)

    def settle_drafts(self, batch: "ScheduleBatch", kept: list[int]) -> None:
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

    @staticmethod
    def num_jumped_tokens(req: Req) -> int:
        return req.stash.get(JUMPED_TOKENS_KEY, 0)

    # -- lifetime -------------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget compiled grammars (flush_cache)."""
        self.backend.reset()

    def shutdown(self) -> None:
        if self.pending_vocab_mask is not None:
            # The loop stopped on an error before filling it: let the forward thread go on and exit.
            self.pending_vocab_mask[1].vocab_mask_ready.set()
        self.backend.shutdown()
