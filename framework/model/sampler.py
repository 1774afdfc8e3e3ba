"""Next-token sampling from logits (reference W5, pytorch backend semantics).

Order: grammar vocab mask -> penalties (framework/penalties.py) -> (all greedy: argmax) -> temperature -> softmax (fp32) -> top-k,
top-p, min-p on the sorted candidates -> one inverse-CDF draw per row. top-p uses the cumulative mass of the full
distribution (computed before the top-k cut), and min-p is relative to the most likely token, as in
the reference. Rows with top_k <= 1 are always argmax, whatever the rest of the batch does; rows
that filter draw from their sorted candidates, the others from the distribution in vocabulary order,
also whatever the rest of the batch does, so a seeded row's draw depends on its own row only.
"""

from __future__ import annotations

import torch

from framework.batch import SamplingBatchInfo
from framework.grammar import apply_vocab_mask
from framework.model.cpu import to_float32

# Candidates taken by the partial sort before falling back to sorting the whole vocabulary.
_NUM_CANDIDATES = 512


class Sampler:
    """Stateless; a seeded row's draw comes from its own per-step key, not from the batch.

    `fused`: the C kernels' ops (framework/model/cpu_kernels.py), whose argmax over bf16 or fp32
    rows is several times faster than torch's; None: torch only.
    """

    def __init__(self, fused=None):
        self.fused = fused

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and self.fused.supports_argmax(logits):
            return self.fused.argmax(logits)
        return logits.argmax(dim=-1)

    def masked_argmax(self, logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """argmax of each row over the tokens its grammar bitmask allows (all without a mask)."""
        if mask is None:
            return self.argmax(logits)
        if self.fused is not None and self.fused.supports_masked_argmax(logits, mask):
            return self.fused.argmax_masked(logits, mask)
        return apply_vocab_mask(logits, mask).argmax(dim=-1)

    def __call__(self, logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """logits: [bs, vocab] fp32 or bf16 (not modified) -> int64 token ids [bs]."""
        bs, vocab_size = logits.shape
        if bs == 0:
            return torch.empty((0,), dtype=torch.int64)
        if info.is_all_greedy and info.penalties is None:
            return self.masked_argmax(logits, info.vocab_mask)
        logits = self.processed(logits, info)
        greedy_ids = self.argmax(logits)
        if info.is_all_greedy:
            return greedy_ids

        # The clamp only guards against a stray 0; greedy rows are overridden by argmax below.
        temperatures = info.temperatures.view(bs, 1).clamp(min=1e-6)
        probs = torch.softmax(to_float32(logits) / temperatures, dim=-1)
        top_ks = info.top_ks.clamp(min=1, max=vocab_size)
        # A row's draw depends on its own parameters only: rows that filter draw from their
        # candidates sorted by probability, the others from the whole distribution in vocabulary
        # order, whatever the other rows do (a seeded row gives the same token next to a greedy or a
        # top-p row as alone; greedy rows are argmax and filter nothing here).
        filtered = (top_ks > 1) & ((top_ks < vocab_size) | (info.top_ps < 1.0) | (info.min_ps > 0.0))
        if not bool(filtered.any()):
            ids = _multinomial(probs, info.seeds)
        elif bool(filtered.all()):
            ids = _sample_filtered(probs, top_ks, info.top_ps, info.min_ps, info.seeds)
        else:  # each group drawn over its own rows only
            ids = torch.empty(bs, dtype=torch.int64, device=probs.device)
            plain, rows = (~filtered).nonzero().squeeze(1), filtered.nonzero().squeeze(1)
            ids[plain] = _multinomial(probs[plain], _seeds_of(info.seeds, plain))
            ids[rows] = _sample_filtered(probs[rows], top_ks[rows], info.top_ps[rows], info.min_ps[rows],
                                         _seeds_of(info.seeds, rows))
        return torch.where(info.top_ks <= 1, greedy_ids, ids)

    @staticmethod
    def processed(logits: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor:
        """The logits the tokens are chosen from: the grammar's vocab mask, then the penalties.
        A copy where either applies (the caller keeps the raw logits for logprobs); `logits` itself
        where neither does."""
        logits = apply_vocab_mask(logits, info.vocab_mask)  # an fp32 copy when there is a mask
        if info.penalties is not None:
            masked, logits = logits, info.penalties.apply(to_float32(logits))
            if info.vocab_mask is not None:
                # The grammar wins: a row whose grammar allows only tokens the penalties mask (its
                # end, under min_new_tokens) keeps the grammar's choice, not a token of no logit.
                dead = ~torch.isfinite(logits).any(dim=-1)
                if bool(dead.any()):
                    logits[dead] = to_float32(masked[dead])
        return logits

    def check_greedy(self, logits: torch.Tensor, info: SamplingBatchInfo, expected: torch.Tensor) -> torch.Tensor:
        """What `self(logits, info)` returns when every row is greedy without penalties and
        `expected[r]` is allowed by row r's mask (a draft): a row whose unmasked argmax is its
        expected token has that as its masked argmax too (the first maximum is allowed), so only
        the other rows pay for the mask."""
        assert info.is_all_greedy and info.penalties is None
        ids = self.argmax(logits)
        miss = (ids != expected).nonzero().squeeze(1)
        if miss.numel() and info.vocab_mask is not None:
            ids[miss] = self.masked_argmax(logits[miss], info.vocab_mask[miss])
        return ids


def _seeds_of(seeds: list[int | None] | None, rows: torch.Tensor) -> list[int | None] | None:
    """The seed keys of some rows (None: no row has one)."""
    return [seeds[r] for r in rows.tolist()] if seeds else None


def _sample_filtered(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor,
                     seeds: list[int | None] | None) -> torch.Tensor:
    need_top_p = bool((top_ps < 1.0).any())
    need_min_p = bool((min_ps > 0.0).any())
    probs_sort, probs_idx = _sorted_candidates(probs, top_ks, top_ps if need_top_p else None,
                                               min_ps if need_min_p else None)
    # Mass strictly before each token, over the untruncated distribution.
    mass_before = probs_sort.cumsum(dim=-1) - probs_sort
    ranks = torch.arange(probs_sort.shape[1], device=probs_sort.device).unsqueeze(0)
    drop = ranks >= top_ks.unsqueeze(1)
    if need_top_p:
        drop |= mass_before > top_ps.unsqueeze(1)
    if need_min_p:
        drop |= probs_sort < probs_sort[:, :1] * min_ps.unsqueeze(1)
    # The most likely token is never dropped, so each row keeps some mass.
    drop[:, 0] = False
    probs_sort = probs_sort.masked_fill(drop, 0.0)
    choice = _multinomial(probs_sort, seeds)
    return probs_idx.gather(1, choice.unsqueeze(1)).squeeze(1)


def _sorted_candidates(probs: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor | None,
                       min_ps: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens that can survive filtering, sorted by probability (descending); `top_ps` and
    `min_ps` are None where no row filters by them.

    A full sort of the vocabulary costs ~100 ms for 32 x 49k on one core; `topk` of a few hundred
    costs a few ms. The truncation is exact whenever every row provably keeps fewer tokens than
    were taken: its top_k is within them, or top-p or min-p already drops the first left-out token
    (and therefore every later one, since the mass before them only grows and their probabilities
    only shrink). Otherwise fall back to the full sort.
    """
    vocab_size = probs.shape[1]
    max_k = int(top_ks.max())
    if max_k < vocab_size:
        return probs.topk(max_k, dim=-1, sorted=True)
    num_candidates = min(vocab_size, _NUM_CANDIDATES)
    if num_candidates < vocab_size and (top_ps is not None or min_ps is not None):
        vals, idx = probs.topk(num_candidates, dim=-1, sorted=True)
        # mass_before of the first left-out token = kept mass; its probability <= the last kept.
        kept_mass = vals.sum(dim=-1)
        safe = top_ks <= num_candidates
        if top_ps is not None:
            safe |= kept_mass > top_ps
        if min_ps is not None:
            safe |= vals[:, -1] < vals[:, 0] * min_ps
        if bool(safe.all()):
            return vals, idx
    return probs.sort(dim=-1, descending=True)


def _multinomial(probs: torch.Tensor, seeds: list[int | None]) -> torch.Tensor:
    """One draw per row from unnormalized `probs`; a row with a seed key takes its uniform from
    the key's top 53 bits (see `framework.batch.step_seed`), so its draw does not depend on the
    rest of the batch.

    Inverse CDF with one uniform per row: torch.multinomial (and the exponential race) draw one
    random number per vocabulary entry, which dominated the sampling time (~35 ms vs ~5 ms for
    32 x 49k on one core). The CDF is fp64 so that rounding cannot land on a zero-probability token:
    `searchsorted(right=True)` returns the first index whose CDF exceeds u, and a zero-probability
    entry never raises the CDF.
    """
    bs = probs.shape[0]
    cdf = probs.double().cumsum(dim=-1)
    seeds = seeds or [None] * bs
    u = torch.rand(bs, 1, dtype=torch.float64)
    seeded = [i for i, key in enumerate(seeds) if key is not None]
    if seeded:
        u[seeded, 0] = torch.tensor([(seeds[i] >> 11) * 2.0**-53 for i in seeded], dtype=torch.float64)
    # Drawn on the CPU whatever the device: the same draws on any device. The factor keeps u
    # strictly below the total mass despite rounding of u * total.
    u = u.to(cdf.device) * cdf[:, -1:] * (1.0 - 1e-12)
    ids = torch.searchsorted(cdf, u, right=True).squeeze(1)
    return ids.clamp_(max=probs.shape[1] - 1)
