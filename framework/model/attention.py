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
class AttentionMetadata:
    """Per-forward gather plan shared by all layers."""

    num_tokens: int
    # Batched one-token path. decode_rows is None when the rows are exactly 0..n-1 (pure decode).
    decode_rows: torch.Tensor | None
    decode_kv_indices: torch.Tensor | None  # [n, max_seq_len] int64, padding points at slot 0
    decode_bias: torch.Tensor | None  # [n, 1, 1, max_seq_len] float32, 0 or -inf
    extend_reqs: list[_ExtendReq]


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
            return AttentionMetadata(num_tokens, None, None, None, [])
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

        meta = AttentionMetadata(num_tokens, None, None, None, extend_reqs)
        if decode_reqs:
            idx = torch.tensor(decode_reqs, dtype=torch.int64)
            d_seq_lens = batch.seq_lens[idx]
            max_len = int(d_seq_lens.max())
            kv_idx = req_to_token[pool_indices[idx], :max_len]
            valid = torch.arange(max_len).unsqueeze(0) < d_seq_lens.unsqueeze(1)
            # Padded columns read the dummy slot 0; the -inf bias removes them from the softmax.
            meta.decode_kv_indices = torch.where(valid, kv_idx, torch.zeros_like(kv_idx))
            bias = torch.zeros(valid.shape, dtype=torch.float32).masked_fill_(~valid, float("-inf"))
            meta.decode_bias = bias.view(len(decode_reqs), 1, 1, max_len)
            if decode_rows != list(range(len(decode_rows))) or len(decode_rows) != num_tokens:
                meta.decode_rows = torch.tensor(decode_rows, dtype=torch.int64)
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

        pure_decode = meta.decode_kv_indices is not None and meta.decode_rows is None
        if pure_decode:
            return self._decode(q, k_buf, v_buf, meta)

        out = torch.empty_like(q)
        if meta.decode_kv_indices is not None:
            out[meta.decode_rows] = self._decode(q[meta.decode_rows], k_buf, v_buf, meta).view(
                -1, self.num_heads, self.head_dim
            )
        for req in meta.extend_reqs:
            rows = slice(req.token_start, req.token_start + req.extend_len)
            out[rows] = self._extend_one(q[rows], k_buf, v_buf, req)
        return out.view(num_tokens, self.num_heads * self.head_dim)

    def _decode(self, q, k_buf, v_buf, meta: AttentionMetadata) -> torch.Tensor:
        """One query per request, grouped by KV head, softmax in fp32.

        KV rows are gathered with one `index_select` (a row memcpy; advanced indexing with a 2-D
        index copies element by element and was ~3x slower) into [n, S, kv_heads, D]. Each KV head
        is then a strided [n, S, D] view that bmm consumes without a copy, whereas one 4-D matmul
        over [n, kv_heads, S, D] would first make the whole gathered KV contiguous again.
        """
        n = q.shape[0]
        kv_idx = meta.decode_kv_indices
        max_len = kv_idx.shape[1]
        flat = kv_idx.reshape(-1)
        k = k_buf.index_select(0, flat).view(n, max_len, self.num_kv_heads, self.head_dim)
        v = v_buf.index_select(0, flat).view(n, max_len, self.num_kv_heads, self.head_dim)
        qg = q.reshape(n, self.num_kv_heads, self.group_size, self.head_dim).to(k.dtype)
        scores = k.new_empty((n, self.num_kv_heads, self.group_size, max_len))
        for h in range(self.num_kv_heads):
            torch.bmm(qg[:, h], k[:, :, h].transpose(1, 2), out=scores[:, h])
        scores = scores.float().mul_(self.scaling).add_(meta.decode_bias)
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        out = v.new_empty((n, self.num_kv_heads, self.group_size, self.head_dim))
        for h in range(self.num_kv_heads):
            torch.bmm(probs[:, h], v[:, :, h], out=out[:, h])
        return out.view(n, self.num_heads * self.head_dim).to(q.dtype)

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
