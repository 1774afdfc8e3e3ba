"""Attention over the paged KV cache: PyTorch, plus an optional C kernel for one-token requests.

The backend only reads the KV pool: each layer writes its new K/V first (`kv_pool.set_kv`), then
calls `forward`. Which KV slots a request sees is fixed for the whole pass, so the gather indices
and masks are built once per forward (`prepare`) and reused by every layer.

Paths:
* with the C decode kernel (framework/model/kernels/decode_attention.c, `use_decode_kernel`),
  every one-token request (decode batches and the decode part of MIXED batches) is attended
  straight from the paged pool: no gathers, no padding, no dense copies;
* otherwise a pure DECODE batch reads dense head-major copies of its requests' KV kept across steps
  (`_DenseGroup`: one new position appended per step, rebuilt from the pool after any prefill or
  when a group runs out of room), so the context is not re-gathered from the pool in every layer;
* other one-token requests (the decode part of a MIXED batch, one-token prefills) are gathered
  from the pool, grouped by length so the padding stays small;
* both use a grouped-query matmul-softmax-matmul: q is viewed as [n, kv_heads, group, head_dim]
  so the KV heads are never expanded, which on CPU is much faster than SDPA's single-query path;
* multi-token requests (prefill, possibly on top of a cached prefix) go through
  `scaled_dot_product_attention` one request at a time, causal with the prefix fully visible;
  in bf16 with head_dim 64 on a CPU with AVX512-BF16, the C kernel framework/model/kernels/
  extend_attention.c does them instead, straight from the pool (`use_extend_kernel`; on AMX tiles
  1.5-2.5x faster than SDPA at 64-1,024 tokens on a 2-core Xeon, on the vectors 2.8-3.8x at
  64-2,048 tokens on a 2-core AMD EPYC Zen 4).
A float8_e5m2 or int8 pool (model.kv_cache_dtype; see TokenToKVPool) is widened to q's dtype right
after each gather (`widen_kv`, an int8 pool's rows times their scales); the C kernels widen its
values themselves (`kv_format`, `kv_scales`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from framework.batch import ModelWorkerBatch
from framework.memory import ReqToTokenPool, TokenToKVPool, kv_scales, widen_kv
from framework.model.cpu import to_float32
from framework.model.cpu_kernels import kv_format, scale_ptrs


def _gather_kv(buf: torch.Tensor, scales: torch.Tensor | None, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `index` of a K/V buffer (and of an int8 pool's scales, indexed alike), widened to `dtype`."""
    return widen_kv(buf.index_select(0, index), dtype, None if scales is None else scales.index_select(0, index))


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
class _KernelDecode:
    """One-token queries of a pass for the C kernel (each request of a decode step; each token of
    a short extend): it reads their KV slots from the request-to-token table itself."""

    rows: torch.Tensor | None  # token rows of the pass; None when they are exactly 0..n-1
    req_to_token: torch.Tensor  # [pool rows, max_context_len] int64
    pool_idx: torch.Tensor  # [n] int64, contiguous: the request of each row
    seq_lens: torch.Tensor  # [n] int64, contiguous: the KV length each row attends to


@dataclass
class AttentionMetadata:
    """Per-forward gather plan shared by all layers."""

    num_tokens: int
    decode_groups: list[_DecodeGroup]
    extend_reqs: list[_ExtendReq]
    # Pure decode batches use the dense decode cache instead of decode_groups.
    dense: list["_DensePlan"] | None = None
    # With the C kernel, all one-token requests go there instead.
    kernel: _KernelDecode | None = None

    def to(self, device: torch.device) -> "AttentionMetadata":
        """The plan with its tensors on `device` (the C kernel's plan is for the CPU only)."""
        assert self.kernel is None, "the C decode kernel runs on the CPU"
        return dataclasses.replace(
            self,
            decode_groups=[_tensors_to(g, device) for g in self.decode_groups],
            extend_reqs=[_tensors_to(r, device) for r in self.extend_reqs],
            dense=None if self.dense is None else [_tensors_to(p, device) for p in self.dense],
        )


def _tensors_to(plan, device: torch.device):
    """A copy of dataclass `plan` with its tensor fields on `device`."""
    return dataclasses.replace(plan, **{
        f.name: value.to(device) for f in dataclasses.fields(plan)
        if isinstance(value := getattr(plan, f.name), torch.Tensor)
    })


# With the C kernel, extends of at most this many tokens run as one kernel row per token (decode
# steps with jump-forward drafts); longer ones, prefills, go to the prefill kernel (or SDPA), which
# reuses each K/V row across the queries.
_KERNEL_MAX_EXTEND = 16

# A decode request shorter than this fraction of its group's longest starts a new group, so the
# padded KV read stays within ~1/fraction of the real one; each extra group costs ~10 small ops
# per layer, hence the cap.
_DECODE_GROUP_SPLIT = 0.6
_MAX_DECODE_GROUPS = 6


class _DenseGroup:
    """Head-major copies of the KV of some decode requests, kept across decode steps.

    k[layer], v[layer]: [n, kv_heads, cap, head_dim], zero beyond each row's length.
    """

    def __init__(self, pool_idx: list[int], lens: list[int], last_locs: list[int], cap: int):
        self.pool_idx = pool_idx
        self.lens = lens
        self.last_locs = last_locs
        self.cap = cap
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}


@dataclass
class _DensePlan:
    """What one layer does with one dense group in this pass."""

    group: _DenseGroup
    max_len: int
    bias: torch.Tensor  # [n * kv_heads, 1, cap] float32, 0 or -inf
    gather_idx: torch.Tensor | None  # rebuild: [n * kv_heads * max_len] pool rows to copy in
    append_src: torch.Tensor | None  # append: pool rows of the new tokens [live * kv_heads]
    append_dst: torch.Tensor | None  # append: rows of the flat dense buffer to write them to
    live_rows: torch.Tensor | None  # rows of the group in this batch; None: all, in order
    token_rows: torch.Tensor | None  # their rows in the pass; None: 0..n-1
    grow_from: int | None = None  # append into a group that outgrew this capacity: copy it over first


# Extra decode positions a dense group is allocated for before it has to be rebuilt.
_DENSE_HEADROOM = 32
# Rebuild once fewer than this fraction of a dense cache's rows are still decoding.
_DENSE_MIN_LIVE = 0.75


def _length_groups(lens: list[int], max_groups: int) -> list[list[int]]:
    """Indices into `lens`, grouped by length (see _DECODE_GROUP_SPLIT), longest first."""
    order = sorted(range(len(lens)), key=lambda j: -lens[j])
    groups: list[list[int]] = []
    for j in order:
        if groups and (lens[j] >= _DECODE_GROUP_SPLIT * lens[groups[-1][0]] or len(groups) >= max_groups):
            groups[-1].append(j)
        else:
            groups.append([j])
    return groups


def _grown(buf: torch.Tensor, cap: int) -> torch.Tensor:
    """[n, kv_heads, old_cap, D] -> [n, kv_heads, cap, D], zero-padded (a contiguous copy, much
    cheaper than gathering the KV from the pool again)."""
    return _with_zero_tail(buf, cap)


def _with_zero_tail(head: torch.Tensor, cap: int) -> torch.Tensor:
    """[n, kv_heads, cap, D] holding `head` ([n, kv_heads, L, D]) then zeros. Only the tail is
    filled: zeroing whole buffers cost ~10% of a decode step. (The tail must be zeros, not
    garbage: masked scores still multiply it, and NaN * 0 is NaN.)"""
    n, kvh, length, d = head.shape
    out = head.new_empty((n, kvh, cap, d))
    out[:, :, :length] = head
    out[:, :, length:].zero_()
    return out


class TorchNativeAttention:
    """Paged attention for one model.

    Between prefills, the KV of the running decode requests is also kept in dense head-major
    buffers (`_DenseGroup`) that grow by one position per step, so a decode step reads the KV
    once instead of re-gathering the whole context from the paged pool in every layer. Any batch
    with a multi-token request drops these buffers (new or retracted requests change the set),
    and they are rebuilt from the pool at the next decode step.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.group_size = num_heads // num_kv_heads
        self.scaling = head_dim**-0.5
        self._dense: list[_DenseGroup] | None = None
        self.enable_dense_decode = True
        self.decode_kernel = None  # see use_decode_kernel
        self.decode_tiles = True  # the decode kernel may use AMX tiles (bf16, where the CPU has them)
        self.extend_kernel = None  # see use_extend_kernel
        self.f32_extend_kernel = None  # see use_f32_extend_kernel

    def use_decode_kernel(self, kernel) -> None:
        """Attend one-token requests with `kernel` (cpu_kernels.CpuKernels.decode_attention; None:
        PyTorch)."""
        self.decode_kernel = kernel
        self._dense = None

    def use_extend_kernel(self, kernel) -> None:
        """Attend bf16 multi-token requests with `kernel` (cpu_kernels.CpuKernels.extend_attention,
        on AMX tiles or AVX512-BF16 vectors, head_dim 64; None: PyTorch's SDPA)."""
        self.extend_kernel = kernel if self.head_dim == 64 else None

    def use_f32_extend_kernel(self, kernel) -> None:
        """Attend fp32 multi-token requests with `kernel` (cpu_kernels.F32Gemm.extend_attention, on
        CPUs without AVX-512, head_dim 64, fp32, bf16 or int8 pools; None: PyTorch's SDPA)."""
        self.f32_extend_kernel = kernel if self.head_dim == 64 else None

    def prepare(self, batch: ModelWorkerBatch, req_to_token_pool: ReqToTokenPool) -> AttentionMetadata:
        """Split the batch into one-token and multi-token requests and build their KV indices.

        The plan is built on the CPU, from the CPU table `req_to_token`, and moved once to the
        device of the pass (that of `batch.out_cache_loc`) for all layers."""
        meta = self._plan(batch, req_to_token_pool)
        device = batch.out_cache_loc.device
        return meta if device.type == "cpu" else meta.to(device)

    def _plan(self, batch: ModelWorkerBatch, req_to_token_pool: ReqToTokenPool) -> AttentionMetadata:
        num_tokens = int(sum(batch.extend_lens))
        if batch.forward_mode.is_idle() or batch.batch_size == 0:
            return AttentionMetadata(num_tokens, [], [])
        req_to_token = req_to_token_pool.req_to_token
        seq_lens = batch.seq_lens.tolist()
        pool_indices = batch.req_pool_indices

        decode_reqs: list[int] = []
        decode_rows: list[int] = []
        decode_lens: list[int] = []  # KV length each row attends to (kernel rows)
        extend_reqs: list[_ExtendReq] = []
        token_start = 0
        for i, ext_len in enumerate(batch.extend_lens):
            if ext_len == 1:
                decode_reqs.append(i)
                decode_rows.append(token_start)
                decode_lens.append(seq_lens[i])
            elif self.decode_kernel is not None and ext_len <= _KERNEL_MAX_EXTEND:
                # A short extend (a decode step with drafts): one kernel row per token, each over
                # the KV up to its own position, which this pass wrote before attention (the kernel
                # takes a request's consecutive rows in one pass over its K).
                first_len = seq_lens[i] - ext_len + 1
                decode_reqs.extend([i] * ext_len)
                decode_rows.extend(range(token_start, token_start + ext_len))
                decode_lens.extend(range(first_len, first_len + ext_len))
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
        if self.decode_kernel is not None:
            if decode_reqs:
                meta.kernel = self._kernel_plan(batch, req_to_token, decode_reqs, decode_rows, decode_lens, num_tokens)
            return meta
        if not self.enable_dense_decode:
            self._dense = None
        elif not batch.forward_mode.is_decode():
            # A request in a prefill/mixed pass is (re)starting or skips the dense append: its
            # rows, if any, are stale (its request slot may even be a new request's now).
            self._forget(pool_indices.tolist())
        elif decode_reqs:
            meta.dense = self._prepare_dense(batch, req_to_token, seq_lens)
            return meta
        if decode_reqs:
            d_lens = [seq_lens[i] for i in decode_reqs]
            groups = _length_groups(d_lens, _MAX_DECODE_GROUPS)
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

    @staticmethod
    def _kernel_plan(batch, req_to_token, decode_reqs, decode_rows, decode_lens, num_tokens) -> _KernelDecode:
        pool_idx = batch.req_pool_indices.to(torch.int64)
        rows = None if decode_rows == list(range(num_tokens)) else torch.tensor(decode_rows, dtype=torch.int64)
        if decode_reqs == list(range(batch.batch_size)):  # one row per request, in order
            return _KernelDecode(rows, req_to_token, pool_idx.contiguous(), batch.seq_lens.to(torch.int64).contiguous())
        reqs = torch.tensor(decode_reqs, dtype=torch.int64)
        return _KernelDecode(rows, req_to_token, pool_idx[reqs].contiguous(), torch.tensor(decode_lens, dtype=torch.int64))

    def _forget(self, pool_list: list[int]) -> None:
        if not self._dense:
            return
        gone = set(pool_list)
        for group in self._dense:
            group.pool_idx = [-1 if p in gone else p for p in group.pool_idx]

    def _prepare_dense(self, batch, req_to_token: torch.Tensor, seq_lens: list[int]) -> list[_DensePlan]:
        """Plan a pure decode step over the dense cache.

        Requests already in a dense group append their new position; requests new to the cache
        (just prefilled) get a new group gathered from the pool. Everything is rebuilt when too
        few rows are still live or there would be too many groups.
        """
        pool_list = batch.req_pool_indices.tolist()
        new_locs = batch.out_cache_loc.tolist()
        where: dict[int, tuple[int, int]] = {}
        total_rows = 0
        for gi, group in enumerate(self._dense or []):
            total_rows += len(group.pool_idx)
            for r, p in enumerate(group.pool_idx):
                if p >= 0:
                    where[p] = (gi, r)
        per_group: list[list[tuple[int, int]]] = [[] for _ in self._dense or []]  # (row, batch index)
        fresh: list[int] = []
        for j, p in enumerate(pool_list):
            loc = where.get(p)
            if loc is not None and self._dense[loc[0]].lens[loc[1]] + 1 == seq_lens[j]:
                per_group[loc[0]].append((loc[1], j))
            else:
                fresh.append(j)
        kept = [gi for gi, members in enumerate(per_group) if members]
        fresh_groups = _length_groups([seq_lens[j] for j in fresh], _MAX_DECODE_GROUPS)
        if (
            len(pool_list) - len(fresh) < _DENSE_MIN_LIVE * total_rows
            or len(kept) + len(fresh_groups) > _MAX_DECODE_GROUPS
            or not kept
        ):
            self._dense = []
            groups = _length_groups(seq_lens, _MAX_DECODE_GROUPS)
            if len(groups) == 1:
                groups = [list(range(len(pool_list)))]  # keep the batch order: no scatter needed
            return [self._new_group(members, pool_list, seq_lens, new_locs, req_to_token) for members in groups]
        alone = len(kept) == 1 and not fresh_groups
        plans = [self._append_plan(self._dense[gi], per_group[gi], seq_lens, new_locs, alone) for gi in kept]
        self._dense = [self._dense[gi] for gi in kept]
        for members in fresh_groups:
            plans.append(self._new_group([fresh[m] for m in members], pool_list, seq_lens, new_locs, req_to_token))
        return plans

    def _new_group(self, members, pool_list, seq_lens, new_locs, req_to_token) -> _DensePlan:
        """A dense group for batch rows `members`, gathered from the pool in this pass."""
        kvh = self.num_kv_heads
        lens = [seq_lens[j] for j in members]
        max_len = max(lens)
        group = _DenseGroup(
            [pool_list[j] for j in members], lens, [new_locs[j] for j in members], max_len + _DENSE_HEADROOM
        )
        self._dense.append(group)
        lens_t = torch.tensor(lens, dtype=torch.int64)
        valid = torch.arange(max_len).unsqueeze(0) < lens_t.unsqueeze(1)
        kv_idx = req_to_token[torch.tensor(group.pool_idx, dtype=torch.int64), :max_len]
        kv_idx = torch.where(valid, kv_idx, torch.zeros_like(kv_idx))
        heads = torch.arange(kvh, dtype=torch.int64).view(1, -1, 1)
        gather_idx = (kv_idx.unsqueeze(1) * kvh + heads).reshape(-1)
        identity = members == list(range(len(pool_list)))
        return _DensePlan(
            group, max_len, self._dense_bias(lens_t, group.cap), gather_idx, None, None,
            live_rows=None if identity else torch.tensor(members, dtype=torch.int64), token_rows=None,
        )

    def _append_plan(self, group: _DenseGroup, members: list[tuple[int, int]], seq_lens, new_locs,
                     alone: bool) -> _DensePlan:
        """Append one position to each member row of `group` (grown first when out of room);
        `alone`: the only plan of the pass."""
        kvh = self.num_kv_heads
        heads = torch.arange(kvh, dtype=torch.int64)
        rows = [r for r, _ in members]
        js = [j for _, j in members]
        for r, j in members:
            group.lens[r] = seq_lens[j]
            group.last_locs[r] = new_locs[j]
        grow_from = None
        if max(group.lens) > group.cap:
            grow_from, group.cap = group.cap, max(group.lens) + _DENSE_HEADROOM
        rows_t = torch.tensor(rows, dtype=torch.int64)
        pos_t = torch.tensor([seq_lens[j] - 1 for j in js], dtype=torch.int64)
        src = torch.tensor([new_locs[j] for j in js], dtype=torch.int64)
        append_src = (src.unsqueeze(1) * kvh + heads).reshape(-1)
        append_dst = (((rows_t.unsqueeze(1) * kvh + heads) * group.cap) + pos_t.unsqueeze(1)).reshape(-1)
        bias = self._dense_bias(torch.tensor(group.lens, dtype=torch.int64), group.cap)
        identity = alone and rows == js == list(range(len(group.pool_idx)))
        return _DensePlan(
            group, max(group.lens), bias, None, append_src, append_dst,
            None if identity else rows_t, None if identity else torch.tensor(js, dtype=torch.int64),
            grow_from=grow_from,
        )

    def _dense_bias(self, lens: torch.Tensor, cap: int) -> torch.Tensor:
        """[n * kv_heads, 1, cap] float32: 0 for each row's first lens[i] positions, else -inf."""
        invalid = torch.arange(cap).unsqueeze(0) >= lens.unsqueeze(1)
        bias = torch.zeros(invalid.shape, dtype=torch.float32).masked_fill_(invalid, float("-inf"))
        return bias.unsqueeze(1).expand(-1, self.num_kv_heads, -1).reshape(-1, 1, cap)

    def _dense_layer(self, q, k_buf, v_buf, layer_id: int, plan: _DensePlan) -> torch.Tensor:
        group, kvh, d = plan.group, self.num_kv_heads, self.head_dim
        n = len(group.pool_idx)
        if plan.gather_idx is not None:
            shape = (n, kvh, plan.max_len, d)
            k_dense = _with_zero_tail(self._rows(k_buf, plan.gather_idx, q).view(shape), group.cap)
            v_dense = _with_zero_tail(self._rows(v_buf, plan.gather_idx, q).view(shape), group.cap)
            group.k[layer_id], group.v[layer_id] = k_dense, v_dense
        else:
            k_dense, v_dense = group.k[layer_id], group.v[layer_id]
            if plan.grow_from is not None:
                k_dense, v_dense = _grown(k_dense, group.cap), _grown(v_dense, group.cap)
                group.k[layer_id], group.v[layer_id] = k_dense, v_dense
            k_dense.view(-1, d).index_copy_(0, plan.append_dst, self._rows(k_buf, plan.append_src, q))
            v_dense.view(-1, d).index_copy_(0, plan.append_dst, self._rows(v_buf, plan.append_src, q))
        # Attend over the whole capacity: contiguous [n * kv_heads, cap, D] operands are several
        # times faster in bmm than a [:max_len] slice (which matmul copies), and the zero
        # positions beyond each row's length are masked by the bias.
        k = k_dense.view(n * kvh, group.cap, d)
        v = v_dense.view(n * kvh, group.cap, d)
        if plan.live_rows is not None and plan.gather_idx is None:
            # Rows of finished requests stay in the buffers until the next rebuild; pad their
            # queries with zeros (their outputs are dropped).
            qg = q.new_zeros((n, self.num_heads, d))
            qg[plan.live_rows] = q[plan.token_rows]
        elif plan.live_rows is not None:
            qg = q[plan.live_rows]
        else:
            qg = q
        qg = qg.reshape(n * kvh, self.group_size, d).to(k.dtype)
        scores = to_float32(torch.bmm(qg, k.transpose(1, 2)), copy=True).mul_(self.scaling).add_(plan.bias)
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        out = torch.bmm(probs, v)  # [n * kv_heads, group, D]
        return out.view(n, self.num_heads * d).to(q.dtype)

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

        if meta.dense is not None:
            plans = meta.dense
            if len(plans) == 1 and plans[0].live_rows is None:
                return self._dense_layer(q, k_buf, v_buf, layer_id, plans[0])
            out = q.new_empty((num_tokens, self.num_heads * self.head_dim))
            for plan in plans:
                res = self._dense_layer(q, k_buf, v_buf, layer_id, plan)
                if plan.gather_idx is not None:
                    out[plan.live_rows] = res  # rebuild: live_rows are the batch rows
                else:
                    out[plan.token_rows] = res[plan.live_rows]
            return out
        kernel = meta.kernel
        if kernel is not None and kernel.rows is None:
            return self._kernel_decode(q, k_buf, v_buf, kernel)
        groups = meta.decode_groups
        if len(groups) == 1 and groups[0].rows is None:
            return self._decode(q, k_buf, v_buf, groups[0])

        out = torch.empty_like(q)
        if kernel is not None:
            out[kernel.rows] = self._kernel_decode(q[kernel.rows], k_buf, v_buf, kernel).view(
                -1, self.num_heads, self.head_dim
            )
        for group in groups:
            out[group.rows] = self._decode(q[group.rows], k_buf, v_buf, group).view(
                -1, self.num_heads, self.head_dim
            )
        for req in meta.extend_reqs:
            rows = slice(req.token_start, req.token_start + req.extend_len)
            if not self._kernel_extend(q[rows], k_buf, v_buf, req, out[rows]):
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
        k = self._rows(k_buf, group.kv_indices, q).view(n, kvh, max_len, d)
        v = self._rows(v_buf, group.kv_indices, q).view(n, kvh, max_len, d)
        qg = q.reshape(n, kvh, self.group_size, d).to(k.dtype)
        scores = to_float32(torch.matmul(qg, k.transpose(2, 3)), copy=True).mul_(self.scaling).add_(group.bias)
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        out = torch.matmul(probs, v)  # [n, kv_heads, group, D]
        return out.view(n, self.num_heads * d).to(q.dtype)

    def _rows(self, buf: torch.Tensor, index: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """Rows `index` of a K/V buffer viewed as [slots * kv_heads, head_dim] (an fp8 or int8
        pool's widened to q's dtype)."""
        scales = kv_scales(buf)
        return _gather_kv(buf.view(-1, self.head_dim), None if scales is None else scales.view(-1), index, q.dtype)

    def _kernel_decode(self, q, k_buf, v_buf, plan: _KernelDecode) -> torch.Tensor:
        """[n, heads, D] one-token queries -> [n, heads * D], by the C kernel (fp32 softmax)."""
        q = q.contiguous()
        n = q.shape[0]
        out = torch.empty((n, self.num_heads * self.head_dim), dtype=q.dtype)
        rc = self.decode_kernel(
            q.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), *scale_ptrs(k_buf, v_buf), plan.req_to_token.data_ptr(),
            plan.req_to_token.stride(0), plan.pool_idx.data_ptr(), plan.seq_lens.data_ptr(), out.data_ptr(),
            n, self.num_heads, self.num_kv_heads, self.head_dim, int(q.dtype == torch.bfloat16),
            kv_format(k_buf), self.scaling, torch.get_num_threads(), int(self.decode_tiles),
        )
        if rc == -2:
            raise ValueError("decode attention kernel: an int8 KV pool's buffers carry no scales (kv_scales)")
        if rc != 0:
            raise MemoryError("decode attention kernel: out of memory for its scratch buffers")
        return out

    def _kernel_extend(self, q, k_buf, v_buf, req: _ExtendReq, out: torch.Tensor) -> bool:
        """`_extend_one` by the C kernel (`use_extend_kernel`; fp32 rows `use_f32_extend_kernel`)
        into `out` ([L, heads, D] rows of the pass's output); False where the kernel does not take
        it (PyTorch's turn then)."""
        if q.dtype == torch.float32:
            # (fp32, bf16 or int8 pools: an e5m2 pool's bytes stay with SDPA)
            if (self.f32_extend_kernel is None or kv_format(k_buf) not in (0, 1, 3) or q.stride(2) != 1
                    or q.stride(1) != self.head_dim or out.stride(2) != 1 or out.stride(1) != self.head_dim):
                return False
            rc = self.f32_extend_kernel(
                q.data_ptr(), q.stride(0), k_buf.data_ptr(), v_buf.data_ptr(), *scale_ptrs(k_buf, v_buf),
                kv_format(k_buf), req.kv_indices.data_ptr(), req.prefix_len + req.extend_len, req.prefix_len,
                out.data_ptr(), out.stride(0), self.num_heads, self.num_kv_heads, self.head_dim, self.scaling,
            )
            return rc == 0
        if (self.extend_kernel is None or q.dtype != torch.bfloat16 or k_buf.dtype == torch.float32
                or q.stride(2) != 1 or q.stride(1) != self.head_dim or out.stride(2) != 1
                or out.stride(1) != self.head_dim):
            return False
        rc = self.extend_kernel(
            q.data_ptr(), q.stride(0), k_buf.data_ptr(), v_buf.data_ptr(), *scale_ptrs(k_buf, v_buf), kv_format(k_buf),
            req.kv_indices.data_ptr(),
            req.prefix_len + req.extend_len, req.prefix_len, out.data_ptr(), out.stride(0), self.num_heads,
            self.num_kv_heads, self.head_dim, self.scaling, torch.get_num_threads(),
        )
        return rc == 0

    def _extend_one(self, q, k_buf, v_buf, req: _ExtendReq) -> torch.Tensor:
        """Causal attention of one request's new tokens over its prefix and themselves."""
        k, v = (_gather_kv(buf, kv_scales(buf), req.kv_indices, q.dtype).transpose(0, 1).unsqueeze(0)
                for buf in (k_buf, v_buf))  # [1, kv_heads, S, D]
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
