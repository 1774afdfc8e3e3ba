"""Embedding models: one vector per request from the final hidden states (reference Y4).

Last-token pooling, L2-normalized, as the reference's `Pooler(LAST, normalize=True)` used by its
llama-family embedding models. The last token is always in the pass: a prefix-cache hit stops at
least one token short of the prompt, and a chunked request is pooled on its final chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from framework.model.cpu import to_float32


def pool_last_token(hidden: torch.Tensor, extend_lens: list[int]) -> torch.Tensor:
    """[num_tokens, hidden] of the pass -> [bs, hidden] float32, each row of unit length."""
    last_rows = torch.tensor(extend_lens, dtype=torch.int64).cumsum(0) - 1
    return F.normalize(to_float32(hidden[last_rows]), p=2.0, dim=-1)
