"""From final hidden states to next-token logits and, on request, prompt logprobs (reference U3).

Without logprobs only the last token of each request goes through the LM head. With logprobs,
request i also gets the rows `extend_logprob_start_lens[i] .. extend_lens[i]-1`: row p scores the
request's input token p+1, except the last row, whose "next token" is the one about to be sampled
and is reported after sampling as `next_token_logprobs` instead.

A request ending its extend with n draft tokens (`batch.draft_check`) also gets the n rows before
its last one, each scoring one draft, in `draft_logits`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from framework.batch import ModelWorkerBatch
from framework.model.cpu import to_float32

TopLogprobs = list[tuple[float, int]]


@dataclass
class LogitsOutput:
    """What one forward pass hands to the sampler and to result processing."""

    # [bs, vocab]: float32 with logprobs, else the model's dtype. The sampler widens bf16 logits to
    # fp32 where it computes with them; greedy rows take the argmax of the bf16 values directly,
    # which is the argmax of their (exact) fp32 widening.
    next_token_logits: torch.Tensor
    # Filled only when batch.return_logprob; one entry per request.
    input_token_logprobs: list[list[float]] | None = None
    input_top_logprobs: list[list[TopLogprobs]] | None = None
    # Mean of input_token_logprobs[i] (0.0 when the range is empty).
    normalized_prompt_logprobs: list[float] | None = None
    next_token_top_logprobs: list[TopLogprobs] | None = None
    # [bs] float32, filled by ModelRunner.sample: logprob of the sampled token under the
    # unprocessed log_softmax of next_token_logits.
    next_token_logprobs: torch.Tensor | None = None
    # [sum(draft_check.lens), vocab] in the model's dtype: row r scores draft token r (its
    # request's position before it). None without drafts.
    draft_logits: torch.Tensor | None = None
    # The final hidden states of the rows of next_token_logits [bs, hidden] and of draft_logits, and
    # how many rows the LM head ran on for next_token_logits (more with prompt logprobs): with an
    # int8 LM head (model.int8_lm_head) ModelRunner.sample recomputes in bf16 the columns that a
    # grammar mask or penalties leave on top.
    next_token_hidden: torch.Tensor | None = None
    head_rows: int = 0
    draft_hidden: torch.Tensor | None = None


def compute_logits_output(
    hidden: torch.Tensor,
    batch: ModelWorkerBatch,
    lm_head: Callable[[torch.Tensor], torch.Tensor],
    vocab_size: int,
) -> LogitsOutput:
    """hidden: [num_tokens, hidden] of the pass -> LogitsOutput (see module docstring)."""
    bs = batch.batch_size
    if bs == 0:
        return LogitsOutput(next_token_logits=torch.empty((0, vocab_size), dtype=torch.float32))
    ends = torch.tensor(batch.extend_lens, dtype=torch.int64).cumsum(0)
    output = _next_token_logits(hidden, batch, ends, lm_head)
    if batch.draft_check is not None:
        lens = batch.draft_check.lens
        rows = torch.cat([torch.arange(int(e) - 1 - n, int(e) - 1) for e, n in zip(ends.tolist(), lens) if n])
        output.draft_hidden = hidden[rows]
        output.draft_logits = lm_head(output.draft_hidden)
    return output


def _next_token_logits(
    hidden: torch.Tensor, batch: ModelWorkerBatch, ends: torch.Tensor, lm_head: Callable[[torch.Tensor], torch.Tensor]
) -> LogitsOutput:
    bs = batch.batch_size
    if not batch.return_logprob:
        last = hidden[ends - 1]
        return LogitsOutput(next_token_logits=lm_head(last), next_token_hidden=last, head_rows=bs)

    starts = [int(e) - n for e, n in zip(ends.tolist(), batch.extend_lens)]
    # Without explicit start lens only the last row (the one to sample from) is computed.
    start_lens = batch.extend_logprob_start_lens or [n - 1 for n in batch.extend_lens]
    row_ranges = [
        (starts[i] + start_lens[i], starts[i] + batch.extend_lens[i]) for i in range(bs)
    ]
    rows = torch.cat([torch.arange(a, b) for a, b in row_ranges])
    head_input = hidden[rows]
    logits = to_float32(lm_head(head_input))  # [num_rows, vocab]
    logprobs = torch.log_softmax(logits, dim=-1)
    num_rows_per_req = [b - a for a, b in row_ranges]
    last_rows = torch.tensor(num_rows_per_req).cumsum(0) - 1

    # Row p's target is the input token at p + 1 (within the pass); the last row has none.
    targets = torch.zeros(rows.shape[0], dtype=torch.int64, device=logprobs.device)
    is_input_row = torch.ones(rows.shape[0], dtype=torch.bool)
    is_input_row[last_rows] = False
    targets[is_input_row] = batch.input_ids[rows[is_input_row] + 1]
    token_logprobs = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1).tolist()

    top_nums = batch.top_logprobs_nums or [0] * bs
    # The server refuses more than the vocabulary; offline callers get at most all of it.
    max_top = min(max(top_nums), logprobs.shape[-1]) if top_nums else 0
    top_vals = top_ids = None
    if max_top > 0:
        top_vals, top_ids = logprobs.topk(max_top, dim=-1)
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()

    input_lps: list[list[float]] = []
    input_tops: list[list[TopLogprobs]] = []
    next_tops: list[TopLogprobs] = []
    normalized: list[float] = []
    offset = 0
    for i, num_rows in enumerate(num_rows_per_req):
        lps = token_logprobs[offset : offset + num_rows - 1]
        input_lps.append(lps)
        normalized.append(sum(lps) / len(lps) if lps else 0.0)
        k = top_nums[i]
        if k > 0:
            tops = [
                list(zip(top_vals[r][:k], top_ids[r][:k])) for r in range(offset, offset + num_rows)
            ]
            input_tops.append(tops[:-1])
            next_tops.append(tops[-1])
        else:
            input_tops.append([])
            next_tops.append([])
        offset += num_rows

    return LogitsOutput(
        next_token_logits=logits[last_rows],
        input_token_logprobs=input_lps,
        input_top_logprobs=input_tops,
        normalized_prompt_logprobs=normalized,
        next_token_top_logprobs=next_tops,
        next_token_hidden=head_input[last_rows],
        head_rows=rows.shape[0],
    )


def fill_next_token_logprobs(output: LogitsOutput, next_token_ids: torch.Tensor) -> None:
    """Logprob of each sampled token under the raw (unpenalized, untempered) distribution."""
    logprobs = torch.log_softmax(output.next_token_logits, dim=-1)
    output.next_token_logprobs = logprobs.gather(1, next_token_ids.view(-1, 1)).squeeze(1)
