"""Scheduler batches and the typed worker boundary (reference sections D, H, P5-P7).

`ScheduleBatch` is the scheduler's view: requests plus the tensors the next forward needs.
`ModelWorkerBatch` is the only thing a worker sees: plain tensors and lists, no requests, no pools.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from framework.multimodal import ImageInputs
from framework.penalties import BatchPenalties
from framework.request import Req, Stash, StashKey

if TYPE_CHECKING:
    from framework.cache import BasePrefixCache
    from framework.memory import ReqToTokenPool, TokenToKVPool


class ForwardMode(enum.IntEnum):
    EXTEND = 1  # prefill, possibly on top of a cached prefix
    DECODE = 2  # one token per request
    MIXED = 3  # a prefill chunk and the running decode requests in one pass
    IDLE = 4  # nothing to compute; keeps collectives aligned under DP attention

    def is_extend(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED)

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE


class OutOfMemoryError(RuntimeError):
    """The KV pool or the request pool cannot hold what the scheduler asked for."""


@dataclass
class SamplingBatchInfo:
    """Per-batch sampling tensors, kept aligned with the batch's requests."""

    temperatures: torch.Tensor  # [bs, 1] float32
    top_ps: torch.Tensor  # [bs] float32
    top_ks: torch.Tensor  # [bs] int64
    min_ps: torch.Tensor  # [bs] float32
    # Per row: None, or the 64-bit key of this step's draw for a seeded request (`step_seed`).
    seeds: list[int | None]
    is_all_greedy: bool
    need_min_p_sampling: bool
    # Frequency / presence / repetition / min_new_tokens state of the batch, when some row uses it.
    penalties: BatchPenalties | None = None
    # Structured output: xgrammar bitmask [bs, ceil(vocab / 32)] int32, or None (framework/grammar.py).
    vocab_mask: torch.Tensor | None = None

    @classmethod
    def from_reqs(cls, reqs: list[Req], penalties: BatchPenalties | None = None) -> "SamplingBatchInfo":
        params = [r.sampling_params for r in reqs]
        seeds = [None if p.seed is None else step_seed(p.seed, r.num_sampled_tokens()) for r, p in zip(reqs, params)]
        if penalties is not None:
            assert penalties.batch_size == len(reqs), "penalty rows out of step with the batch"
        return cls(
            temperatures=torch.tensor([[p.temperature] for p in params], dtype=torch.float32),
            top_ps=torch.tensor([p.top_p for p in params], dtype=torch.float32),
            top_ks=torch.tensor([p.top_k for p in params], dtype=torch.int64),
            min_ps=torch.tensor([p.min_p for p in params], dtype=torch.float32),
            seeds=seeds,
            is_all_greedy=all(p.top_k <= 1 for p in params),
            # Recomputed on every batch, so the reference's stale flag after merge/filter (QUIRK 13)
            # cannot happen here.
            need_min_p_sampling=any(p.min_p > 0 for p in params),
            penalties=penalties if penalties is not None and penalties.is_active else None,
        )

    def to(self, device: torch.device | str) -> "SamplingBatchInfo":
        """These rows with their tensors on `device` (the sampler's); itself when already there.
        A copy, so the scheduler's rows stay on the CPU."""
        if self.temperatures.device == torch.device(device):
            return self
        return dataclasses.replace(
            self,
            temperatures=self.temperatures.to(device),
            top_ps=self.top_ps.to(device),
            top_ks=self.top_ks.to(device),
            min_ps=self.min_ps.to(device),
            penalties=None if self.penalties is None else self.penalties.to(device),
            vocab_mask=None if self.vocab_mask is None else self.vocab_mask.to(device),
        )


class _DraftRow:
    """Request `req` as it stood before its output token `num_outputs` was chosen: what a
    SamplingBatchInfo or BatchPenalties row reads of a request (its parameters, its outputs so far)."""

    def __init__(self, req: Req, num_outputs: int):
        self.req = req
        self.num_outputs = num_outputs
        self.sampling_params = req.sampling_params
        self.origin_input_ids = req.origin_input_ids
        self.eos_token_ids = req.eos_token_ids

    @property
    def output_ids(self) -> list[int]:
        return self.req.output_ids[: self.num_outputs]

    def num_sampled_tokens(self) -> int:
        return self.num_outputs


@dataclass
class DraftCheck:
    """Draft tokens checked in an extend pass (jump-forward's forced text, framework/grammar.py).

    Request i of the batch ends its extend with `lens[i]` draft tokens. Row r of `sampling_info`
    is that request as it stood before draft `tokens[r]` (its penalties, seed step and grammar
    mask then), so sampling row r from the logits of the position before the draft gives the
    token plain decoding would have chosen there. A draft is kept while the two agree; at the first
    disagreement the model's token replaces it and the later drafts are dropped.
    """

    lens: list[int]  # [bs]
    tokens: list[int]  # [sum(lens)], request by request
    sampling_info: SamplingBatchInfo  # [sum(lens)] rows

    @classmethod
    def from_reqs(cls, reqs: list[Req], vocab_size: int | None) -> "DraftCheck | None":
        """The drafts of the requests of an extend pass, or None when none has any."""
        if not any(r.num_draft_tokens for r in reqs):
            return None
        rows: list[_DraftRow] = []
        tokens: list[int] = []
        masks: list[torch.Tensor] = []
        for req in reqs:
            n = req.num_draft_tokens
            if n == 0:
                continue
            start = len(req.output_ids) - n
            rows.extend(_DraftRow(req, start + j) for j in range(n))
            tokens.extend(req.output_ids[start:])
            masks.append(req.draft_vocab_masks)
        penalties = BatchPenalties.from_reqs(rows, vocab_size)
        info = SamplingBatchInfo.from_reqs(rows, penalties)
        info.vocab_mask = torch.cat(masks)
        return cls([r.num_draft_tokens for r in reqs], tokens, info)

    def settle(self, draft_ids: list[int], next_ids: list[int]) -> tuple[list[int], list[int]]:
        """`draft_ids`: the token sampled at each draft row; `next_ids`: each request's token
        sampled after its last draft. -> (each request's next token, drafts kept per request)."""
        next_ids = list(next_ids)
        kept: list[int] = []
        row = 0
        for i, n in enumerate(self.lens):
            k = 0
            while k < n and draft_ids[row + k] == self.tokens[row + k]:
                k += 1
            if k < n:
                next_ids[i] = draft_ids[row + k]
            kept.append(k)
            row += n
        return next_ids, kept


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def step_seed(seed: int, step: int) -> int:
    """The 64-bit key of a seeded request's draw for its `step`-th output token.

    A counter-based scheme: the key depends on (seed, step) only, so a seeded request draws the
    same random numbers whatever else is in the batch, on any device, and after a retraction
    (the step is its output length). splitmix64 keeps nearby seeds and steps uncorrelated."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ step)


@dataclass
class ModelWorkerBatch:
    """The worker boundary: everything one forward pass needs, nothing the scheduler owns.

    Token-major fields have one entry per computed token (`num_tokens = sum(extend_lens)`);
    request-major fields one per request. A decode batch has `extend_lens == [1] * bs`.
    """

    bid: int
    forward_mode: ForwardMode
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    out_cache_loc: torch.Tensor  # [num_tokens] int64, KV slot written by each token
    req_pool_indices: torch.Tensor  # [bs] int64
    seq_lens: torch.Tensor  # [bs] int64, length after this pass (prefix + extend)
    prefix_lens: list[int]  # [bs] tokens already in the KV cache before this pass
    extend_lens: list[int]  # [bs] tokens computed in this pass
    sampling_info: SamplingBatchInfo | None
    return_logprob: bool = False
    top_logprobs_nums: list[int] = field(default_factory=list)
    extend_logprob_start_lens: list[int] = field(default_factory=list)
    # input_embeds requests: the supplied vectors [num_supplied, hidden] float32, one per True of
    # `input_embeds_mask` [num_tokens] in token order; the other tokens embed their input id.
    input_embeds: torch.Tensor | None = None
    # Extend passes of multimodal requests: per request, its ImageInputs or None.
    image_inputs: list[ImageInputs | None] | None = None
    # Set by the scheduler when it builds this batch's grammar vocab mask while the batch is in
    # flight (overlap worker, reference C2/W5): sampling waits for it. None: nothing to wait for.
    vocab_mask_ready: threading.Event | None = None
    input_embeds_mask: torch.Tensor | None = None
    # An embedding model's batch: pool each request's last hidden state, do not sample.
    is_embedding: bool = False
    # Per request, its LoRA adapter name or None (base model); None when no request has one.
    lora_paths: list[str | None] | None = None
    # DP attention: every rank's token count this pass, in rank order (reference L2).
    global_num_tokens: list[int] | None = None
    # Extend passes: draft tokens at the end of some requests' extends, to check (DraftCheck).
    draft_check: DraftCheck | None = None

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens)


_bid_counter = 0


def _next_bid() -> int:
    global _bid_counter
    _bid_counter += 1
    return _bid_counter


class ScheduleBatch:
    """A set of requests scheduled together, with the KV bookkeeping for the next pass."""

    def __init__(
        self,
        reqs: list[Req],
        req_to_token_pool: "ReqToTokenPool",
        token_to_kv_pool: "TokenToKVPool",
        tree_cache: "BasePrefixCache",
        forward_mode: ForwardMode = ForwardMode.EXTEND,
        vocab_size: int | None = None,
    ):
        self.reqs = reqs
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool
        self.tree_cache = tree_cache
        self.forward_mode = forward_mode

        self.input_ids: torch.Tensor | None = None
        self.positions: torch.Tensor | None = None
        self.req_pool_indices = torch.empty((0,), dtype=torch.int64)
        self.seq_lens = torch.empty((0,), dtype=torch.int64)
        self.out_cache_loc: torch.Tensor | None = None
        self.output_ids: torch.Tensor | None = None
        self.prefix_lens: list[int] = []
        self.extend_lens: list[int] = []
        self.extend_num_tokens = 0
        self.extend_logprob_start_lens: list[int] = []
        self.decoding_reqs: list[Req] | None = None
        self.sampling_info: SamplingBatchInfo | None = None
        # Needed to build penalty rows; None only for batches that never carry penalties.
        self.vocab_size = vocab_size
        self.penalties = BatchPenalties(len(reqs), vocab_size)
        self.input_embeds: torch.Tensor | None = None
        self.image_inputs: list[ImageInputs | None] | None = None
        self.input_embeds_mask: torch.Tensor | None = None
        self.global_num_tokens: list[int] | None = None
        self.bid = 0
        self.stash = Stash()

    def __repr__(self) -> str:
        return f"ScheduleBatch(forward_mode={self.forward_mode.name}, #req={len(self.reqs)})"

    # -- queries --------------------------------------------------------------------------------

    def batch_size(self) -> int:
        return len(self.reqs)

    def is_empty(self) -> bool:
        return len(self.reqs) == 0

    def token_end(self, i: int) -> int:
        """End of request `i`'s tokens in this pass's token-major tensors (`out_cache_loc`)."""
        return sum(self.extend_lens[: i + 1])

    @property
    def return_logprob(self) -> bool:
        return any(r.return_logprob for r in self.reqs)

    @property
    def is_embedding(self) -> bool:
        # An embedding model serves embedding requests only, so a batch is all or nothing.
        return bool(self.reqs) and self.reqs[0].is_embedding

    # -- allocation -----------------------------------------------------------------------------

    def alloc_req_slots(self, num_reqs: int) -> list[int]:
        slots = self.req_to_token_pool.alloc(num_reqs)
        if slots is None:
            raise OutOfMemoryError(
                "Out of request slots. Please set a smaller scheduler.max_running_requests."
            )
        return slots

    def alloc_token_slots(self, num_tokens: int) -> torch.Tensor:
        out = self.token_to_kv_pool.alloc(num_tokens)
        if out is None:
            self.tree_cache.evict(num_tokens, self.token_to_kv_pool.free)
            out = self.token_to_kv_pool.alloc(num_tokens)
        if out is None:
            # The reference exits the process here; an exception lets the loop report it.
            raise OutOfMemoryError(
                f"KV cache out of memory: need {num_tokens} slots, "
                f"{self.token_to_kv_pool.available_size()} free, "
                f"{self.tree_cache.evictable_size()} evictable."
            )
        return out

    # -- extend ---------------------------------------------------------------------------------

    def prepare_for_extend(self) -> None:
        """Allocate request and KV slots for every request's uncached tokens (reference P5)."""
        self.forward_mode = ForwardMode.EXTEND
        reqs = self.reqs
        bs = len(reqs)
        pool_indices = self.alloc_req_slots(bs)
        self.prefix_lens = [len(r.prefix_indices) for r in reqs]
        self.extend_lens = [r.extend_input_len for r in reqs]
        self.extend_num_tokens = sum(self.extend_lens)
        out_cache_loc = self.alloc_token_slots(self.extend_num_tokens)

        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        seq_lens: list[int] = []
        self.extend_logprob_start_lens = []
        pt = 0
        req_to_token = self.req_to_token_pool.req_to_token
        for i, (req, slot) in enumerate(zip(reqs, pool_indices)):
            req.req_pool_idx = slot
            pre_len, ext_len = self.prefix_lens[i], self.extend_lens[i]
            seq_len = pre_len + ext_len
            assert seq_len == len(req.fill_ids), (seq_len, len(req.fill_ids))
            if pre_len > 0:
                req_to_token[slot, :pre_len] = req.prefix_indices
            req_to_token[slot, pre_len:seq_len] = out_cache_loc[pt : pt + ext_len]
            pt += ext_len
            input_ids.extend(req.fill_ids[pre_len:])
            positions.append(torch.arange(pre_len, seq_len, dtype=torch.int64))
            seq_lens.append(seq_len)
            # Cached tokens count only the part of the prefix that this request did not compute
            # itself in an earlier chunk (the reference's formula double-counts, QUIRK in P5).
            req.cached_tokens += max(0, pre_len - req.stash.get(_COMPUTED_KEY, 0))
            req.stash[_COMPUTED_KEY] = seq_len
            if req.return_logprob:
                if req.logprob_start_len >= pre_len:
                    start = min(req.logprob_start_len - pre_len, ext_len - 1)
                else:
                    start = ext_len - 1
            else:
                start = ext_len - 1
            self.extend_logprob_start_lens.append(start)
            req.extend_logprob_start_len = start
            req.is_retracted = False

        self.input_ids = torch.tensor(input_ids, dtype=torch.int64)
        self.positions = torch.cat(positions) if positions else torch.empty((0,), dtype=torch.int64)
        self.req_pool_indices = torch.tensor(pool_indices, dtype=torch.int64)
        self.seq_lens = torch.tensor(seq_lens, dtype=torch.int64)
        self.out_cache_loc = out_cache_loc
        # Built from each request's prompt and existing outputs, so a retracted request's counts
        # are complete again when it re-enters.
        self.penalties = BatchPenalties.from_reqs(reqs, self.vocab_size)
        self.sampling_info = SamplingBatchInfo.from_reqs(reqs, self.penalties)
        images = [r.image_inputs for r in reqs]
        self.image_inputs = images if any(images) else None
        self.input_embeds, self.input_embeds_mask = gather_input_embeds(reqs, self.prefix_lens, positions)

    def mix_with_running(self, running_batch: "ScheduleBatch") -> None:
        """Append the running decode requests to this prefill batch as 1-token extends (H3)."""
        self.forward_mode = ForwardMode.MIXED
        for req in running_batch.reqs:
            req.fill_ids = req.origin_input_ids + req.output_ids
            req.extend_input_len = 1
        running_bs = running_batch.batch_size()
        self.input_ids = torch.cat([self.input_ids, running_batch.input_ids])
        self.positions = torch.cat([self.positions, running_batch.seq_lens - 1])
        self.out_cache_loc = torch.cat([self.out_cache_loc, running_batch.out_cache_loc])
        self.prefix_lens.extend((running_batch.seq_lens - 1).tolist())
        self.extend_lens.extend([1] * running_bs)
        self.extend_num_tokens += running_bs
        self.extend_logprob_start_lens.extend([0] * running_bs)
        self.reqs = self.reqs + running_batch.reqs
        self.req_pool_indices = torch.cat([self.req_pool_indices, running_batch.req_pool_indices])
        self.seq_lens = torch.cat([self.seq_lens, running_batch.seq_lens])
        self.penalties = self.penalties.merge(running_batch.penalties)
        self.sampling_info = SamplingBatchInfo.from_reqs(self.reqs, self.penalties)
        if self.image_inputs is not None:
            self.image_inputs = self.image_inputs + [None] * running_bs
        if self.input_embeds_mask is not None:
            self.input_embeds_mask = torch.cat(
                [self.input_embeds_mask, torch.zeros(running_bs, dtype=torch.bool)]
            )

    # -- idle -----------------------------------------------------------------------------------

    def prepare_for_idle(self) -> None:
        """A pass with no requests, so this rank joins the others' collectives (reference L2)."""
        self.forward_mode = ForwardMode.IDLE
        empty = torch.empty((0,), dtype=torch.int64)
        self.input_ids = self.positions = self.out_cache_loc = empty
        self.extend_num_tokens = 0

    # -- decode ---------------------------------------------------------------------------------

    def check_decode_mem(self) -> bool:
        """True when every request can get one more KV slot, evicting cache if needed (I1)."""
        bs = self.batch_size()
        if self.token_to_kv_pool.available_size() >= bs:
            return True
        self.tree_cache.evict(bs, self.token_to_kv_pool.free)
        return self.token_to_kv_pool.available_size() >= bs

    def prepare_for_decode(self) -> None:
        """One new token per request: its input is the last sampled id, a placeholder while that id
        is still in flight on a pipelined worker (reference P6, K5)."""
        self.image_inputs = None
        self.input_embeds = self.input_embeds_mask = None  # decode inputs are sampled ids
        if any(r.num_draft_tokens for r in self.reqs):
            self._prepare_for_decode_with_drafts()
            return
        self.forward_mode = ForwardMode.DECODE
        bs = self.batch_size()
        self.input_ids = torch.tensor([r.last_token_id() for r in self.reqs], dtype=torch.int64)
        self.out_cache_loc = self.alloc_token_slots(bs)
        # seq_lens before this step is the position of the new token.
        self.positions = self.seq_lens.clone()
        self.req_to_token_pool.req_to_token[self.req_pool_indices, self.seq_lens] = self.out_cache_loc
        self.seq_lens = self.seq_lens + 1
        self.prefix_lens = (self.seq_lens - 1).tolist()
        self.extend_lens = [1] * bs
        self.extend_num_tokens = bs
        self.extend_logprob_start_lens = [0] * bs
        # The one penalty update per step: the tokens sampled by the previous step.
        self.penalties.cumulate_output_tokens(self.input_ids)
        self.sampling_info = SamplingBatchInfo.from_reqs(self.reqs, self.penalties)

    def _prepare_for_decode_with_drafts(self) -> None:
        """A decode step in which some requests also compute their draft tokens (jump-forward):
        an extend pass over the running requests, each computing its last sampled token and its
        drafts (`DraftCheck` checks them). Non-pipelined workers only: every last token is known."""
        self.forward_mode = ForwardMode.MIXED
        self.decoding_reqs = list(self.reqs)
        self.extend_lens = [1 + r.num_draft_tokens for r in self.reqs]
        self.extend_num_tokens = sum(self.extend_lens)
        prefix_lens = self.seq_lens.tolist()
        self.out_cache_loc = self.alloc_token_slots(self.extend_num_tokens)
        req_to_token = self.req_to_token_pool.req_to_token
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        pt = 0
        for req, pre_len, ext_len in zip(self.reqs, prefix_lens, self.extend_lens):
            assert req.future_token_id is None, "drafts need the last sampled token"
            req.fill_ids = req.origin_input_ids + req.output_ids
            input_ids.extend(req.output_ids[len(req.output_ids) - ext_len :])
            positions.append(torch.arange(pre_len, pre_len + ext_len, dtype=torch.int64))
            req_to_token[req.req_pool_idx, pre_len : pre_len + ext_len] = self.out_cache_loc[pt : pt + ext_len]
            pt += ext_len
        self.input_ids = torch.tensor(input_ids, dtype=torch.int64)
        self.positions = torch.cat(positions)
        self.prefix_lens = prefix_lens
        self.seq_lens = self.seq_lens + torch.tensor(self.extend_lens, dtype=torch.int64)
        self.extend_logprob_start_lens = [n - 1 for n in self.extend_lens]
        # Rows over every output so far, drafts included: the incremental update would count the
        # previous step's token and then each draft.
        self.rebuild_penalties()
        self.sampling_info = SamplingBatchInfo.from_reqs(self.reqs, self.penalties)

    def drop_last_tokens(self, i: int, num_tokens: int) -> None:
        """Free the KV of request `i`'s last `num_tokens` tokens, computed by this pass (draft
        tokens the model disagreed with, `DraftCheck`); the request already dropped them."""
        req = self.reqs[i]
        seq_len = int(self.seq_lens[i])
        slots = self.req_to_token_pool.req_to_token[req.req_pool_idx, seq_len - num_tokens : seq_len]
        self.token_to_kv_pool.free(slots.clone())
        self.seq_lens = self.seq_lens.clone()  # the worker batch of the pass shares the tensor
        self.seq_lens[i] = seq_len - num_tokens
        assert len(req.fill_ids) == seq_len - num_tokens, (len(req.fill_ids), seq_len, num_tokens)

    def rebuild_penalties(self) -> None:
        """Penalty rows from the requests' outputs again (when drafts were added or dropped); they
        equal the incremental rows of requests whose outputs the rows have all counted."""
        self.penalties = BatchPenalties.from_reqs(self.reqs, self.vocab_size)

    # -- membership -----------------------------------------------------------------------------

    def filter_batch(
        self, being_chunked_req: Req | None = None, keep_indices: list[int] | None = None
    ) -> None:
        """Keep unfinished requests other than the chunked one, or exactly `keep_indices` (P7)."""
        if keep_indices is None:
            keep_indices = [
                i
                for i, r in enumerate(self.reqs)
                if not r.finished() and r is not being_chunked_req
            ]
        if len(keep_indices) == 0:
            self.reqs = []
            self.penalties = BatchPenalties(0, self.vocab_size)
            self.req_pool_indices = torch.empty((0,), dtype=torch.int64)
            self.seq_lens = torch.empty((0,), dtype=torch.int64)
            self.output_ids = None
            return
        if len(keep_indices) == len(self.reqs):
            return
        index = torch.tensor(keep_indices, dtype=torch.int64)
        self.reqs = [self.reqs[i] for i in keep_indices]
        self.penalties = self.penalties.filter(keep_indices)
        self.req_pool_indices = self.req_pool_indices[index]
        self.seq_lens = self.seq_lens[index]
        self.out_cache_loc = None
        if self.output_ids is not None:
            self.output_ids = self.output_ids[index]

    def merge_batch(self, other: "ScheduleBatch") -> None:
        self.reqs = self.reqs + other.reqs
        self.penalties = self.penalties.merge(other.penalties)
        if self.vocab_size is None:
            self.vocab_size = other.vocab_size
        self.req_pool_indices = torch.cat([self.req_pool_indices, other.req_pool_indices])
        self.seq_lens = torch.cat([self.seq_lens, other.seq_lens])
        self.out_cache_loc = None
        if self.output_ids is not None and other.output_ids is not None:
            self.output_ids = torch.cat([self.output_ids, other.output_ids])
        else:
            self.output_ids = None

    def copy_for_result(self) -> "ScheduleBatch":
        """A shallow copy that keeps what result processing needs while the next batch is built."""
        new = ScheduleBatch(
            list(self.reqs), self.req_to_token_pool, self.token_to_kv_pool, self.tree_cache,
            self.forward_mode, self.vocab_size,
        )
        new.out_cache_loc = self.out_cache_loc
        new.decoding_reqs = self.decoding_reqs
        new.extend_lens = list(self.extend_lens)
        new.extend_logprob_start_lens = list(self.extend_logprob_start_lens)
        new.bid = self.bid
        return new

    # -- worker boundary ------------------------------------------------------------------------

    def get_model_worker_batch(self) -> ModelWorkerBatch:
        self.bid = _next_bid()
        return ModelWorkerBatch(
            bid=self.bid,
            forward_mode=self.forward_mode,
            input_ids=self.input_ids,
            positions=self.positions,
            out_cache_loc=self.out_cache_loc,
            req_pool_indices=self.req_pool_indices,
            seq_lens=self.seq_lens,
            prefix_lens=list(self.prefix_lens),
            extend_lens=list(self.extend_lens),
            sampling_info=self.sampling_info,
            return_logprob=self.return_logprob,
            top_logprobs_nums=[r.top_logprobs_num for r in self.reqs],
            extend_logprob_start_lens=list(self.extend_logprob_start_lens),
            input_embeds=self.input_embeds,
            image_inputs=self.image_inputs,
            input_embeds_mask=self.input_embeds_mask,
            is_embedding=self.is_embedding,
            lora_paths=self.lora_paths(),
            global_num_tokens=self.global_num_tokens,
            draft_check=DraftCheck.from_reqs(self.reqs, self.vocab_size) if self.forward_mode.is_extend() else None,
        )

    def lora_paths(self) -> list[str | None] | None:
        paths = [r.lora_path for r in self.reqs]
        return paths if any(p is not None for p in paths) else None


def gather_input_embeds(
    reqs: list[Req], prefix_lens: list[int], positions: list[torch.Tensor]
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The supplied vectors of an extend pass and the mask of the tokens they replace, or
    (None, None) when no request brought input_embeds. `positions[i]` are request i's positions
    in this pass; those below its input_embeds length take its vectors (later positions, e.g.
    output tokens re-prefilled after a retraction, are ordinary ids)."""
    if all(r.input_embeds is None for r in reqs):
        return None, None
    rows: list[torch.Tensor] = []
    masks: list[torch.Tensor] = []
    for req, pre_len, pos in zip(reqs, prefix_lens, positions):
        if req.input_embeds is None:
            masks.append(torch.zeros(len(pos), dtype=torch.bool))
            continue
        num_embeds = len(req.input_embeds)
        masks.append(pos < num_embeds)
        rows.append(req.input_embeds[pre_len : min(pre_len + len(pos), num_embeds)])
    return torch.cat(rows), torch.cat(masks)


def idle_worker_batch() -> ModelWorkerBatch:
    empty = torch.empty((0,), dtype=torch.int64)
    return ModelWorkerBatch(
        bid=_next_bid(), forward_mode=ForwardMode.IDLE, input_ids=empty, positions=empty,
        out_cache_loc=empty, req_pool_indices=empty, seq_lens=empty, prefix_lens=[],
        extend_lens=[], sampling_info=None,
    )


_COMPUTED_KEY: StashKey[int] = StashKey("computed_len")
