"""Batched logit penalties (reference W4): frequency, presence, repetition and min_new_tokens.

A `BatchPenalties` belongs to one ScheduleBatch and holds one row per request, in the batch's
order, as the reference's penalizer orchestrator does. Each penalizer keeps [bs, ...] tensors and
is built only when some request of the batch needs it. The batch keeps the rows aligned with its
requests: `filter` when requests leave, `merge` when a prefill joins the running batch (or mixes
with it), and `cumulate_output_tokens(ids)` once per decode step with the tokens sampled by the
previous step. A retracted request re-enters through a new prefill batch, whose rows are rebuilt
from the request's prompt and the outputs it already has, so its counts start where they were.

Formulas, applied to the raw logits in this order (reference `apply_logits_bias`):

* frequency / presence (OpenAI): ``logit[t] - frequency * count[t] - presence * (count[t] > 0)``,
  counting the request's output tokens only;
* repetition (transformers' `RepetitionPenaltyLogitsProcessor`): for every token of the prompt or
  the output, ``logit * penalty`` if the logit is negative, else ``logit / penalty``;
* min_new_tokens (transformers' `MinNewTokensLengthLogitsProcessor`): the request's stop tokens
  (``stop_token_ids`` and the EOS ids) are set to -inf while it has fewer than `min_new_tokens`
  outputs.

Every operation is a tensor operation over the batch; nothing loops over the vocabulary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from framework.request import Req


def _token_mask(token_lists: list[list[int]], vocab_size: int) -> torch.Tensor:
    """[len(token_lists), vocab] bool: row i is True at the ids of list i (ids outside the vocab
    are dropped: they can never be sampled)."""
    mask = torch.zeros((len(token_lists), vocab_size), dtype=torch.bool)
    rows, cols = _row_col(token_lists, vocab_size)
    mask[rows, cols] = True
    return mask


def _token_counts(token_lists: list[list[int]], vocab_size: int) -> torch.Tensor:
    """[len(token_lists), vocab] float32: row i counts the occurrences of each id in list i."""
    counts = torch.zeros((len(token_lists), vocab_size), dtype=torch.float32)
    rows, cols = _row_col(token_lists, vocab_size)
    counts.index_put_((rows, cols), torch.ones(rows.shape[0], dtype=torch.float32), accumulate=True)
    return counts


def _row_col(token_lists: list[list[int]], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    lens = torch.tensor([len(ids) for ids in token_lists], dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(token_lists)), lens)
    cols = torch.tensor([t for ids in token_lists for t in ids], dtype=torch.int64)
    inside = (cols >= 0) & (cols < vocab_size)
    return rows[inside], cols[inside]


def _column(values: list[float], dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).view(-1, 1)


@dataclass
class _Penalizer:
    """Tensors with one row per request; filter and merge act on every field alike."""

    def filter(self, index: torch.Tensor) -> "_Penalizer":
        return dataclasses.replace(self, **{f.name: getattr(self, f.name)[index] for f in dataclasses.fields(self)})

    def to(self, device: torch.device | str) -> "_Penalizer":
        return dataclasses.replace(self, **{f.name: getattr(self, f.name).to(device) for f in dataclasses.fields(self)})

    def concat(self, other: "_Penalizer") -> "_Penalizer":
        return dataclasses.replace(self, **{
            f.name: torch.cat([getattr(self, f.name), getattr(other, f.name)]) for f in dataclasses.fields(self)
        })

    # Each penalizer provides these.
    @staticmethod
    def is_needed_by(req: "Req") -> bool:
        raise NotImplementedError

    @classmethod
    def from_reqs(cls, reqs: list["Req"], vocab_size: int) -> "_Penalizer":
        """The rows of `reqs`."""
        raise NotImplementedError

    @classmethod
    def neutral(cls, batch_size: int, vocab_size: int) -> "_Penalizer":
        """Rows that leave the logits unchanged (requests that do not use this penalizer)."""
        raise NotImplementedError

    def is_used(self) -> bool:
        """Whether some row changes the logits (a filtered batch drops penalizers nobody uses)."""
        raise NotImplementedError

    def cumulate(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        raise NotImplementedError

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


@dataclass
class FrequencyPresencePenalizer(_Penalizer):
    frequency: torch.Tensor  # [bs, 1] float32
    presence: torch.Tensor  # [bs, 1] float32
    counts: torch.Tensor  # [bs, vocab] float32, occurrences of each token in the output

    @staticmethod
    def is_needed_by(req):
        return req.sampling_params.frequency_penalty != 0 or req.sampling_params.presence_penalty != 0

    @classmethod
    def from_reqs(cls, reqs, vocab_size):
        params = [r.sampling_params for r in reqs]
        return cls(
            frequency=_column([p.frequency_penalty for p in params]),
            presence=_column([p.presence_penalty for p in params]),
            counts=_token_counts([r.output_ids for r in reqs], vocab_size),
        )

    @classmethod
    def neutral(cls, batch_size, vocab_size):
        zeros = torch.zeros((batch_size, 1), dtype=torch.float32)
        return cls(zeros, zeros.clone(), torch.zeros((batch_size, vocab_size), dtype=torch.float32))

    def is_used(self):
        return bool((self.frequency != 0).any() or (self.presence != 0).any())

    def cumulate(self, rows, token_ids):
        self.counts[rows, token_ids] += 1.0

    def apply(self, logits):
        return logits - self.frequency * self.counts - self.presence * (self.counts > 0)


@dataclass
class RepetitionPenalizer(_Penalizer):
    penalty: torch.Tensor  # [bs, 1] float32
    seen: torch.Tensor  # [bs, vocab] bool, tokens of the prompt or the output

    @staticmethod
    def is_needed_by(req):
        return req.sampling_params.repetition_penalty != 1.0

    @classmethod
    def from_reqs(cls, reqs, vocab_size):
        return cls(
            penalty=_column([r.sampling_params.repetition_penalty for r in reqs]),
            seen=_token_mask([r.origin_input_ids + r.output_ids for r in reqs], vocab_size),
        )

    @classmethod
    def neutral(cls, batch_size, vocab_size):
        return cls(
            torch.ones((batch_size, 1), dtype=torch.float32),
            torch.zeros((batch_size, vocab_size), dtype=torch.bool),
        )

    def is_used(self):
        return bool((self.penalty != 1.0).any())

    def cumulate(self, rows, token_ids):
        self.seen[rows, token_ids] = True

    def apply(self, logits):
        scaled = torch.where(logits < 0, logits * self.penalty, logits / self.penalty)
        return torch.where(self.seen, scaled, logits)


@dataclass
class MinNewTokensPenalizer(_Penalizer):
    min_new_tokens: torch.Tensor  # [bs] int64
    num_output_tokens: torch.Tensor  # [bs] int64
    stop_tokens: torch.Tensor  # [bs, vocab] bool, stop_token_ids and EOS ids

    @staticmethod
    def is_needed_by(req):
        return req.num_sampled_tokens() < req.sampling_params.min_new_tokens

    @classmethod
    def from_reqs(cls, reqs, vocab_size):
        return cls(
            min_new_tokens=torch.tensor([r.sampling_params.min_new_tokens for r in reqs], dtype=torch.int64),
            num_output_tokens=torch.tensor([r.num_sampled_tokens() for r in reqs], dtype=torch.int64),
            stop_tokens=_token_mask(
                [sorted(set(r.sampling_params.stop_token_ids or ()) | r.eos_token_ids) for r in reqs], vocab_size
            ),
        )

    @classmethod
    def neutral(cls, batch_size, vocab_size):
        zeros = torch.zeros((batch_size,), dtype=torch.int64)
        return cls(zeros, zeros.clone(), torch.zeros((batch_size, vocab_size), dtype=torch.bool))

    def is_used(self):
        return bool((self.num_output_tokens < self.min_new_tokens).any())

    def cumulate(self, rows, token_ids):
        self.num_output_tokens += 1

    def apply(self, logits):
        too_short = (self.num_output_tokens < self.min_new_tokens).view(-1, 1)
        return logits.masked_fill(self.stop_tokens & too_short, float("-inf"))


@dataclass
class BatchPenalties:
    """The active penalizers of one batch; rows follow the batch's requests."""

    batch_size: int
    vocab_size: int | None
    penalizers: dict[type, _Penalizer] = dataclasses.field(default_factory=dict)

    # The order in which they change the logits: linear terms, then scaling, then masks.
    KINDS: ClassVar[tuple[type[_Penalizer], ...]] = (
        FrequencyPresencePenalizer, RepetitionPenalizer, MinNewTokensPenalizer,
    )

    @classmethod
    def from_reqs(cls, reqs: list["Req"], vocab_size: int | None) -> "BatchPenalties":
        penalizers = {}
        for kind in cls.KINDS:
            if any(kind.is_needed_by(r) for r in reqs):
                if vocab_size is None:
                    raise ValueError("penalties need the vocabulary size: ScheduleBatch(..., vocab_size=...)")
                penalizers[kind] = kind.from_reqs(reqs, vocab_size)
        return cls(len(reqs), vocab_size, penalizers)

    @property
    def is_active(self) -> bool:
        return bool(self.penalizers)

    def filter(self, keep_indices: list[int]) -> "BatchPenalties":
        """Keep the rows of the requests that stay; penalizers no remaining row uses are dropped."""
        index = torch.tensor(keep_indices, dtype=torch.int64)
        kept = {}
        for kind, penalizer in self.penalizers.items():
            penalizer = penalizer.filter(index)
            if penalizer.is_used():
                kept[kind] = penalizer
        return BatchPenalties(len(keep_indices), self.vocab_size, kept)

    def merge(self, other: "BatchPenalties") -> "BatchPenalties":
        """This batch's rows followed by `other`'s; a side without a penalizer gets neutral rows."""
        vocab_size = self.vocab_size if self.vocab_size is not None else other.vocab_size
        merged = {}
        for kind in self.KINDS:
            if kind not in self.penalizers and kind not in other.penalizers:
                continue
            mine = self.penalizers.get(kind) or kind.neutral(self.batch_size, vocab_size)
            theirs = other.penalizers.get(kind) or kind.neutral(other.batch_size, vocab_size)
            merged[kind] = mine.concat(theirs)
        return BatchPenalties(self.batch_size + other.batch_size, vocab_size, merged)

    def cumulate_output_tokens(self, token_ids: torch.Tensor) -> None:
        """Count one new output token per request ([bs] int64, the previous step's samples).

        Called once per decode step (ScheduleBatch.prepare_for_decode). A pipelined worker that
        samples before the scheduler knows the previous tokens must call it with the resolved ids
        before the next sampling instead."""
        if not self.penalizers:
            return
        assert token_ids.shape == (self.batch_size,), (token_ids.shape, self.batch_size)
        rows = torch.arange(self.batch_size)
        for penalizer in self.penalizers.values():
            penalizer.cumulate(rows, token_ids)

    def to(self, device: torch.device | str) -> "BatchPenalties":
        """A copy with every penalizer's tensors on `device` (the sampler's, when not the CPU)."""
        penalizers = {kind: penalizer.to(device) for kind, penalizer in self.penalizers.items()}
        return BatchPenalties(self.batch_size, self.vocab_size, penalizers)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Penalized copy of `logits` [bs, vocab]; the input is left intact (logprobs use it)."""
        for kind in self.KINDS:
            penalizer = self.penalizers.get(kind)
            if penalizer is not None:
                logits = penalizer.apply(logits)
        return logits
