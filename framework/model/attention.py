"""Attention over the paged KV cache in plain PyTorch (no custom kernels).

The backend only reads the KV pool: each layer writes its new K/V first (`kv_pool.set_kv`), then
calls `forward`. Which KV slots a request sees is fixed for the whole pass, so the gather indices
and masks are built once per forward (`prepare`) and reused by every layer.

Two paths:
* one-token requests (every DECODE request, and the decode part of a MIXED batch) go through one
  batched grouped-query matmul-softmax-matmul over KV padded to the longest sequence. q is reshaped
  to [n, kv_heads, group, head_dim] so the KV heads are never expanded, which on CPU is much faster
  than SDPA's single-query path;
* multi-token requests (prefill, possibly on top of a cached prefix) go through
  `scaled_dot_product_attention` one request at a time, causal with the prefix fully visible.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from framework.batch import ModelWorkerBatch
from framework.memory import ReqToTokenPool, TokenToKVPool


@dataclass
class _ExtendReq:
    """One multi-token request: its token rows in the pass and its KV slots."""

    token_start: int
    extend_len: int
    prefix_len: int
    kv_indices: torch.Tensor  # [seq_len] int64
    mask: torch.Tensor | None  # [extend_len, seq_len] bool, None when there is no prefix


@dataclass
class _DecodeGroup:
    """One-token requests of similar length, attended together over KV padded to their longest.

    kv_indices index the pool viewed as [slots * kv_heads, head_dim] and are laid out
    [n, kv_heads, max_len], so one `index_select` yields K/V already head-major and contiguous:
    the grouped matmuls then read it without another copy.
    """

    rows: torch.Tensor | None  # token rows of the pass; None when they are exactly 0..n-1
    num_reqs: int
    max_len: int
    kv_indices: torch.Tensor  # [n * kv_heads * max_len] int64, padding points at slot 0
    bias: torch.Tensor  # [n, 1, 1, max_len] float32, 0 or -inf


@dataclass
class AttentionMetadata:
    """Per-forward gather plan shared by all layers."""

    num_tokens: int
    decode_groups: list[_DecodeGroup]
    extend_reqs: list[_ExtendReq]


# A decode request shorter than this fraction of its group's longest starts a new group, so the
# padded KV read stays within ~1/fraction of the real one; each extra group costs ~10 small ops
# per layer, hence the cap.
_DECODE_GROUP_SPLIT = 0.6
_MAX_DECODE_GROUPS = 6


class TorchNativeAttention:
    """Paged attention for one model; holds only shapes, no state across passes."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group_size = num_heads // num_kv_heads
        self.scaling = head_dim**-0.5

    def prepare(self, batch: ModelWorkerBatch, req_to_token_pool: ReqToTokenPool) -> AttentionMetadata:
        """Split the batch into one-token and multi-token requests and build their KV indices."""
        num_tokens = int(sum(batch.extend_lens))
        if batch.forward_mode.is_idle() or batch.batch_size == 0:
            return AttentionMetadata(num_tokens, [], [])
        req_to_token = req_to_token_pool.req_to_token
        seq_lens = batch.seq_lens.tolist()
        pool_indices = batch.req_pool_indices

        decode_reqs: list[int] = []
        decode_rows: list[int] = []
        extend_reqs: list[_ExtendReq] = []
        token_start = 0
        for i, ext_len in enumerate(batch.extend_lens):
            if ext_len == 1:
                decode_reqs.append(i)
                decode_rows.append(token_start)
            elif ext_len > 1:
                seq_len = seq_lens[i]
                prefix_len = seq_len - ext_len
                kv_indices = req_to_token[pool_indices[i], :seq_len]
                mask = None
                if prefix_len > 0:
                    # Query j sits at position prefix_len + j and sees keys 0..prefix_len + j.
                    q_pos = torch.arange(prefix_len, seq_len).unsqueeze(1)
                    mask = torch.arange(seq_len).unsqueeze(0) <= q_pos
                extend_reqs.append(_ExtendReq(token_start, ext_len, prefix_len, kv_indices, mask))
            token_start += ext_len

        meta = AttentionMetadata(num_tokens, [], extend_reqs)
        if decode_reqs:
            d_lens = [seq_lens[i] for i in decode_reqs]
            order = sorted(range(len(decode_reqs)), key=lambda j: -d_lens[j])
            groups: list[list[int]] = []
            for j in order:
                if groups and (
                    d_lens[j] >= _DECODE_GROUP_SPLIT * d_lens[groups[-1][0]]
                    or len(groups) >= _MAX_DECODE_GROUPS
                ):
                    groups[-1].append(j)
                else:
                    groups.append([j])
            identity = len(groups) == 1 and decode_rows == list(range(num_tokens))
            head_offsets = torch.arange(self.num_kv_heads, dtype=torch.int64).view(1, -1, 1)
            for members in groups:
                if identity:
                    members = list(range(len(decode_reqs)))  # keep the batch order
                reqs = torch.tensor([decode_reqs[j] for j in members], dtype=torch.int64)
                g_lens = torch.tensor([d_lens[j] for j in members], dtype=torch.int64)
                max_len = max(d_lens[j] for j in members)
                kv_idx = req_to_token[pool_indices[reqs], :max_len]
                valid = torch.arange(max_len).unsqueeze(0) < g_lens.unsqueeze(1)
                # Padded columns read the dummy slot 0; the -inf bias removes them from the softmax.
                kv_idx = torch.where(valid, kv_idx, torch.zeros_like(kv_idx))
                head_idx = (kv_idx.unsqueeze(1) * self.num_kv_heads + head_offsets).reshape(-1)
                bias = torch.zeros(valid.shape, dtype=torch.float32).masked_fill_(~valid, float("-inf"))
                rows = None
                if not identity:
                    rows = torch.tensor([decode_rows[j] for j in members], dtype=torch.int64)
                meta.decode_groups.append(
                    _DecodeGroup(rows, len(members), max_len, head_idx, bias.view(len(members), 1, 1, max_len))
                )
        return meta

    def forward(
        self, q: torch.Tensor, layer_id: int, meta: AttentionMetadata, kv_pool: TokenToKVPool
    ) -> torch.Tensor:
        """q: [num_tokens, num_heads * head_dim] -> attention output of the same shape."""
        num_tokens = q.shape[0]
        if num_tokens == 0:
            return q.new_empty((0, self.num_heads * self.head_dim))
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k_buf = kv_pool.k_buffer[layer_id]
        v_buf = kv_pool.v_buffer[layer_id]

        groups = meta.decode_groups
        if len(groups) == 1 and groups[0].rows is None:
            return self._decode(q, k_buf, v_buf, groups[0])

        out = torch.empty_like(q)
        for group in groups:
            out[group.rows] = self._decode(q[group.rows], k_buf, v_buf, group).view(
                -1, self.num_heads, self.head_dim
            )
        for req in meta.extend_reqs:
            rows = slice(req.token_start, req.token_start + req.extend_len)
            out[rows] = self._extend_one(q[rows], k_buf, v_buf, req)
        return out.view(num_tokens, self.num_heads * self.head_dim)

    def _decode(self, q, k_buf, v_buf, group: _DecodeGroup) -> torch.Tensor:
        """One query per request, grouped by KV head, softmax in fp32.

        One `index_select` of head_dim-sized rows gathers K (and V) straight into
        [n, kv_heads, S, D]; q is viewed as [n, kv_heads, group, D], so the query heads sharing a
        KV head form the M dimension of one batched matmul and the KV heads are never expanded.
        (Gathering [n, S, kv_heads, D] and bmm-ing per head over strided views, or permuting
        it contiguous, measured ~2x slower on CPU.)
        """
        n, max_len = group.num_reqs, group.max_len
        kvh, d = self.num_kv_heads, self.head_dim
        k = k_buf.view(-1, d).index_select(0, group.kv_indices).view(n, kvh, max_len, d)
        v = v_buf.view(-1, d).index_select(0, group.kv_indices).view(n, kvh, max_len, d)
        qg = q.reshape(n, kvh, self.group_size, d).to(k.dtype)
        scores = torch.matmul(qg, k.transpose(2, 3)).float().mul_(self.scaling).add_(group.bias)
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        out = torch.matmul(probs, v)  # [n, kv_heads, group, D]
        return out.view(n, self.num_heads * d).to(q.dtype)

    def _extend_one(self, q, k_buf, v_buf, req: _ExtendReq) -> torch.Tensor:
        """Causal attention of one request's new tokens over its prefix and themselves."""
        k = k_buf.index_select(0, req.kv_indices).transpose(0, 1).unsqueeze(0)  # [1, kv_heads, S, D]
        v = v_buf.index_select(0, req.kv_indices).transpose(0, 1).unsqueeze(0)
        qh = q.transpose(0, 1).unsqueeze(0).to(k.dtype)  # [1, heads, L, D]
        if req.mask is None:
            out = F.scaled_dot_product_attention(
                qh, k, v, is_causal=True, scale=self.scaling, enable_gqa=self.group_size > 1
            )
        else:
            out = F.scaled_dot_product_attention(
                qh, k, v, attn_mask=req.mask, scale=self.scaling, enable_gqa=self.group_size > 1
            )
        return out.squeeze(0).transpose(0, 1).to(q.dtype)  # [L, heads, D]
