"""Admission budget for one prefill round (reference section F) and the new-token ratio (B5, I3)."""

from __future__ import annotations

import enum
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterable

from framework.views import ReadOnlyView

if TYPE_CHECKING:
    from framework.batch import ScheduleBatch
    from framework.cache import BasePrefixCache
    from framework.request import Req


class AddReqResult(enum.Enum):
    CONTINUE = 1  # more requests may be added
    NO_TOKEN = 2  # out of KV budget: the batch is full
    OTHER = 3  # out of prefill/chunk budget for this round only


class PrefillAdder:
    """Admits requests into one prefill batch while four token budgets last.

    - ``rem_total_tokens``: free + evictable KV, minus what running requests are expected to decode
      (their remaining max_new_tokens, clipped, times the new-token ratio).
    - ``cur_rem_tokens``: free + evictable KV with no future-decode reservation.
    - ``rem_input_tokens``: ``max_prefill_tokens`` for this batch.
    - ``rem_chunk_tokens``: ``chunked_prefill_size`` for this batch (None when chunking is off).
    Mixed chunked prefill takes one token per running request off each budget.
    """

    def __init__(
        self,
        tree_cache: "BasePrefixCache",
        running_batch: "ScheduleBatch | None",
        new_token_ratio: float,
        rem_total_tokens: int,
        rem_input_tokens: int,
        rem_chunk_tokens: int | None,
        mixed_with_decode_tokens: int = 0,
        clip_max_new_tokens: int = 4096,
    ):
        self.tree_cache = tree_cache
        self.running_batch = running_batch
        self.new_token_ratio = new_token_ratio
        self.clip_max_new_tokens = clip_max_new_tokens
        mixed = mixed_with_decode_tokens
        self.rem_total_tokens = rem_total_tokens - mixed
        self.cur_rem_tokens = rem_total_tokens - mixed
        self.rem_input_tokens = rem_input_tokens - mixed
        self.rem_chunk_tokens = None if rem_chunk_tokens is None else rem_chunk_tokens - mixed
        if running_batch is not None:
            # Finished-but-unfiltered requests are reserved too, as in the reference.
            self.rem_total_tokens -= sum(
                min(r.sampling_params.max_new_tokens - len(r.output_ids), clip_max_new_tokens)
                * new_token_ratio
                for r in running_batch.reqs
            )
        self.can_run_list: list["Req"] = []
        self.new_inflight_req: "Req | None" = None
        self.log_hit_tokens = 0
        self.log_input_tokens = 0
        self.req_states: list[tuple[float, int]] | None = None

    # -- bookkeeping ----------------------------------------------------------------------------

    def budget_state(self) -> AddReqResult:
        if self.rem_total_tokens <= 0 or self.cur_rem_tokens <= 0:
            return AddReqResult.NO_TOKEN
        if self.rem_input_tokens <= 0 or (self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0):
            return AddReqResult.OTHER
        return AddReqResult.CONTINUE

    def _prefill_one_req(self, prefix_len: int, extend_input_len: int, max_new_tokens: int) -> None:
        self.rem_total_tokens -= extend_input_len + max_new_tokens
        self.cur_rem_tokens -= extend_input_len
        self.rem_input_tokens -= extend_input_len
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= extend_input_len
        self.log_hit_tokens += prefix_len
        self.log_input_tokens += extend_input_len

    def _clipped_max_new(self, req: "Req") -> int:
        # Tokens still to decode: a retracted request re-prefills its outputs, so they are in its
        # extend length already. The reference reserves all of max_new_tokens again, and a request
        # retracted late never fits an empty pool (prompt + outputs + max_new_tokens > the pool).
        return min(req.sampling_params.max_new_tokens - len(req.output_ids), self.clip_max_new_tokens)

    def _truncate(self, req: "Req", extend_len: int) -> None:
        req.extend_input_len = extend_len
        req.fill_ids = req.fill_ids[: len(req.prefix_indices) + extend_len]

    @contextmanager
    def _lock_node(self, last_node):
        # The matched prefix stops being evictable while the request runs, so it leaves the budget.
        try:
            self.rem_total_tokens += self.tree_cache.inc_lock_ref(last_node)
            yield
        finally:
            self.rem_total_tokens += self.tree_cache.dec_lock_ref(last_node)

    # -- admission ------------------------------------------------------------------------------

    def add_inflight_req(self, req: "Req") -> "Req | None":
        """Add the next chunk of the request being chunked; return it if more chunks remain (F4)."""
        truncated = req.extend_input_len > self.rem_chunk_tokens
        self._truncate(req, min(req.extend_input_len, self.rem_chunk_tokens))
        self.can_run_list.append(req)
        # Future decode tokens are reserved only with the last chunk.
        self._prefill_one_req(
            len(req.prefix_indices), req.extend_input_len, 0 if truncated else self._clipped_max_new(req)
        )
        # The request already holds its lock from cache_unfinished_req.
        return req if truncated else None

    def add_one_req(self, req: "Req") -> AddReqResult:
        """Try to admit one waiting request whose prefix was matched (F5)."""
        if req.sampling_params.ignore_eos and self.tree_cache.disable:
            return self.add_one_req_ignore_eos(req)

        total_tokens = req.extend_input_len + self._clipped_max_new(req)
        input_tokens = req.extend_input_len
        prefix_len = len(req.prefix_indices)

        if total_tokens >= self.rem_total_tokens:
            return AddReqResult.NO_TOKEN
        if input_tokens > self.rem_input_tokens and len(self.can_run_list) != 0:
            return AddReqResult.OTHER

        with self._lock_node(req.last_node):
            if total_tokens > self.rem_total_tokens:
                return AddReqResult.NO_TOKEN
            if (
                self.rem_chunk_tokens is None
                or input_tokens <= self.rem_chunk_tokens
                or _needs_whole_prompt(req)
            ):
                self.can_run_list.append(req)
                self.tree_cache.inc_lock_ref(req.last_node)
                self._prefill_one_req(prefix_len, input_tokens, self._clipped_max_new(req))
            else:
                trunc_len = self.rem_chunk_tokens
                if trunc_len == 0:
                    return AddReqResult.OTHER
                self._truncate(req, trunc_len)
                self.can_run_list.append(req)
                self.new_inflight_req = req
                self.tree_cache.inc_lock_ref(req.last_node)
                self._prefill_one_req(prefix_len, trunc_len, 0)
        return self.budget_state()

    def add_one_req_ignore_eos(self, req: "Req") -> AddReqResult:
        """Admission for ignore_eos requests when the cache shares nothing (F6).

        Simulates the running requests finishing in order of tokens left and checks that the KV
        never runs out. The reference compares each step with the *next* request's tokens left
        (QUIRK 1); here the check is exact: just before request i finishes, every request has
        decoded min(its tokens left, request i's), and every request before i has freed its KV.
        """

        def state_of(r: "Req") -> tuple[float, int]:
            ratio = 1.0 if r.sampling_params.ignore_eos else self.new_token_ratio
            tokens_left = r.sampling_params.max_new_tokens * ratio - len(r.output_ids)
            tokens_occupied = len(r.origin_input_ids) + len(r.output_ids)
            return tokens_left, tokens_occupied

        if self.req_states is None:
            self.req_states = []
            others = list(self.running_batch.reqs) if self.running_batch is not None else []
            for r in [req] + others + self.can_run_list:
                state = state_of(r)
                if state[0] > 0:
                    self.req_states.append(state)
            self.req_states.sort()
        else:
            state = state_of(req)
            if state[0] > 0:
                self.req_states.append(state)
                self.req_states.sort()

        # A retracted request re-prefills its outputs too (the reference charges the prompt only).
        cur_rem = self.cur_rem_tokens - len(req.origin_input_ids) - len(req.output_ids)
        freed = 0
        for i, (tokens_left, tokens_occupied) in enumerate(self.req_states):
            decoded = sum(min(t, tokens_left) for t, _ in self.req_states)
            if cur_rem + freed - decoded <= 0:
                return AddReqResult.NO_TOKEN
            freed += tokens_occupied + tokens_left

        if (
            self.rem_chunk_tokens is None
            or req.extend_input_len <= self.rem_chunk_tokens
            or _needs_whole_prompt(req)
        ):
            self.can_run_list.append(req)
            self._prefill_one_req(0, req.extend_input_len, self._clipped_max_new(req))
        else:
            trunc_len = self.rem_chunk_tokens
            # The reference has no zero check here, so a continuing chunked request that used the
            # whole chunk budget let a second request be chunked at once (an assertion failure).
            if trunc_len <= 0:
                return AddReqResult.OTHER
            self._truncate(req, trunc_len)
            self.can_run_list.append(req)
            self.new_inflight_req = req
            self._prefill_one_req(0, trunc_len, 0)
        return self.budget_state()

    def admit(
        self,
        ordered: Iterable["Req"],
        running_reqs: list["Req"],
        max_running_requests: int,
        max_loras: int | None = None,
        matches: "dict[int, tuple] | None" = None,
    ) -> bool:
        """The reference's admission loop (D4 step 8) over `ordered`, a policy's choice; returns
        True when the batch is full (``batch_is_full``). Called by the core only.

        `matches` maps ``id(req)`` to the ``(prefix_indices, last_node)`` a policy already matched
        this round (through its view); other requests are matched here. With `max_loras` set, a
        request whose adapter would make the batch use more adapters stops the loop.
        """
        running_bs = len(running_reqs)
        running_loras = {r.lora_path for r in running_reqs} if max_loras is not None else None
        matches = matches or {}
        for req in ordered:
            if running_loras is not None:
                # The base model (None) counts as one adapter, as in the reference.
                loras = running_loras | {r.lora_path for r in self.can_run_list} | {req.lora_path}
                if len(loras) > max_loras:
                    return True
            if running_bs + len(self.can_run_list) >= max_running_requests:
                return True
            match = matches.get(id(req))
            if match is not None:
                req.prefix_indices, req.last_node = match
            req.init_next_round_input(None if match is not None else self.tree_cache)
            res = self.add_one_req(req)
            if res != AddReqResult.CONTINUE:
                return res == AddReqResult.NO_TOKEN
        return False


class AdderView(ReadOnlyView):
    """What a policy may read of this round's `PrefillAdder`: the budgets left (read only; a
    policy returns the requests to admit and the core admits them)."""

    __slots__ = ()

    @property
    def rem_total_tokens(self) -> float:
        """Free + evictable KV minus the running requests' expected decode tokens."""
        return self._target.rem_total_tokens

    @property
    def cur_rem_tokens(self) -> int:
        """Free + evictable KV, no decode reservation."""
        return self._target.cur_rem_tokens

    @property
    def rem_input_tokens(self) -> int:
        """What is left of ``max_prefill_tokens`` for this batch."""
        return self._target.rem_input_tokens

    @property
    def rem_chunk_tokens(self) -> int | None:
        """What is left of ``chunked_prefill_size`` for this batch (None: chunking off)."""
        return self._target.rem_chunk_tokens

    @property
    def new_token_ratio(self) -> float:
        return self._target.new_token_ratio

    @property
    def num_admitted(self) -> int:
        """Requests already in the batch (a continuing chunked request)."""
        return len(self._target.can_run_list)


def _needs_whole_prompt(req: "Req") -> bool:
    # Prompt logprobs need the whole prompt in one pass, so such a request is never chunked; nor
    # is an input_embeds one, whose KV cannot go through the prefix cache between chunks.
    if req.input_embeds is not None:
        return True
    return (
        req.return_logprob
        and req.normalized_prompt_logprob is None
        and req.logprob_start_len != len(req.origin_input_ids) - 1
    )


class NewTokenRatio:
    """The estimate of how much of max_new_tokens running requests will still use (B5, I3)."""

    def __init__(self, init_base: float, conservativeness: float, min_factor: float, decay_steps: float):
        self.init = min(init_base * conservativeness, 1.0)
        self.min = min(self.init * min_factor, 1.0)
        self.decay = (self.init - self.min) / decay_steps
        self.value = self.init

    def step(self) -> None:
        """One successful decode scheduling step."""
        self.value = max(self.value - self.decay, self.min)

    def reset(self) -> None:
        """An idle iteration."""
        self.value = self.init
