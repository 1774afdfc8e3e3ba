"""Paged KV memory: request slots and token slots (reference section P).

`ReqToTokenPool` maps (request slot, position) to a KV slot index. `TokenToKVPool` owns the per-layer
K and V tensors and the free list of KV slots. Slot 0 of the KV pool is never handed out: it is the
dummy write target for padded tokens, so buffers have `size + 1` rows.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import mmap
import re
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20  # bytes of a transparent huge page on x86-64 and arm64 (4 KiB base pages)
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.cache
def thp_mode() -> str | None:
    """The kernel's transparent huge page mode (`always`, `madvise` or `never`; None where there is
    no such setting). Read once; `never` is logged, since the KV pools then stay on base pages."""
    try:
        found = re.search(r"\[(\w+)\]", THP_SETTING.read_text())
    except OSError:
        return None
    mode = found.group(1) if found else None
    if mode == "never":
        logger.info("cache.kv_huge_pages: transparent huge pages are off (%s: never), so the KV pool stays "
                    "on 4 KiB pages (`madvise` or `always` there gives them)", THP_SETTING)
    return mode


# `auto` (cache.kv_huge_pages): faults into huge pages slower than this give way to base pages.
# Measured: huge pages 0.08-0.4 s a GB where the host still backs the memory (another process has
# just freed it), 1.2-1.7 s a GB on a 2-core AMD EPYC VM and ~5 s on a 2-core Xeon VM where it must
# back them again (virtio-balloon free page reporting); 4 KiB pages 0.2-0.3 s a GB on both. Decode
# attention gains 3-10 % on huge pages, W200 1-4 %, within what those boxes drift between runs: not
# worth seconds of every start-up, so `auto` takes them only where they come about as cheaply as
# base pages (`true` takes them at any price).
SLOW_HUGE_FAULTS_S_PER_GB = 1.0
FAULT_CHUNK = 8 * HUGE_PAGE  # `auto` times the faults of this many bytes at a time

# `auto`: the rate (s a GB) of the first slow faults seen in this process, after which every later
# pool buffer goes on base pages; None while huge pages come fast.
_slow_huge_faults: float | None = None


def huge_pages_came_slowly() -> float | None:
    """The fault rate (s a GB) that made `auto` give up huge pages in this process, or None."""
    return _slow_huge_faults


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, give_up_when_slow: bool = False) -> torch.Tensor:
    """A zeroed CPU tensor in memory the kernel is asked to back with transparent huge pages.

    A decode step reads every running request's KV, scattered over the pools (each request's
    decoded tokens a batch's worth of slots apart), so on 4 KiB pages its reads keep missing the
    TLB. With `cache.kv_huge_pages` the pools are mapped on their own (anonymous and private, so
    zero-filled) and advised MADV_HUGEPAGE, which Linux honours where THP_SETTING is `always` or
    `madvise` (the usual default). Measured (docs/performance.md, issue 17): decode attention over
    200 requests' pools 2.29-2.31 -> 2.16-2.18 ms a layer on a 2-core Xeon; W200's decode attention
    8.0-8.8 -> 7.4-8.4 s on a 2-core AMD EPYC. The pages are faulted in here, as torch.zeros
    would: left to the first passes that write there, the faults (on a VM, each one also the
    host's) made a W200 run 60 % slower. Where the VM hands free memory back to its host
    (virtio-balloon free page reporting, as on that Xeon), fresh huge pages come from memory the
    host must back again, ~5 s a GB at start-up (4 KiB pages there took 0.2 s a GB): with
    `give_up_when_slow` (`auto`) the faults are timed FAULT_CHUNK at a time, and once a chunk's run
    slower than SLOW_HUGE_FAULTS_S_PER_GB the rest of the buffer is advised MADV_NOHUGEPAGE (base
    pages) and the process remembers it (huge_pages_came_slowly), so that start-up pays for one
    slow chunk at most. Elsewhere (no MADV_HUGEPAGE, THP `never`, a failed mmap, under a
    megabyte) this is torch.zeros."""
    nbytes = math.prod(shape) * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None or nbytes < HUGE_PAGE // 2 or thp_mode() == "never":
        return torch.zeros(shape, dtype=dtype)
    try:
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(advice)
    except (OSError, ValueError) as e:
        logger.debug("KV pool on base pages: %s", e)
        return torch.zeros(shape, dtype=dtype)
    anchor = ctypes.c_char.from_buffer(region)  # only to learn the address
    offset = -ctypes.addressof(anchor) % HUGE_PAGE  # start on a huge page's boundary
    del anchor
    flat = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=offset)
    # fault the pages in now, not in the first passes that write there
    done = 0
    while done < nbytes:
        end = min(done + FAULT_CHUNK, nbytes)
        start = time.perf_counter()
        flat[done:end].zero_()
        rate = (time.perf_counter() - start) / ((end - done) / 1e9)
        # (a chunk under a huge page is too short to time; a buffer's last slow chunk still counts,
        # so that a pool of many small buffers gives up too)
        if give_up_when_slow and end - done >= HUGE_PAGE and rate > SLOW_HUGE_FAULTS_S_PER_GB:
            _give_up_huge_pages(region, offset + end, rate)
            flat[end:].zero_()
            break
        done = end
    return flat.view(dtype).view(shape)


def _give_up_huge_pages(region: mmap.mmap, at: int, rate: float) -> None:
    """Advise `region` from `at` (a multiple of the base page) onto base pages, and remember why."""
    global _slow_huge_faults
    no_advice = getattr(mmap, "MADV_NOHUGEPAGE", None)
    if no_advice is not None:
        try:
            region.madvise(no_advice, at, len(region) - at)
        except (OSError, ValueError) as e:
            logger.debug("MADV_NOHUGEPAGE refused: %s", e)
    if _slow_huge_faults is None:
        logger.info("cache.kv_huge_pages = 'auto': huge pages came at %.1f s a GB (the host backs them again), "
                    "so the rest of the KV pool goes on 4 KiB pages (~0.2 s a GB); `true` keeps huge pages",
                    rate)
        _slow_huge_faults = rate


class ReqToTokenPool:
    """Request slots. `req_to_token[slot, pos]` is the KV index of token `pos` of that request."""

    def __init__(self, size: int, max_context_len: int, device: str = "cpu"):
        self.size = size
        self.max_context_len = max_context_len
        self.device = device
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=device)
        self.free_slots: list[int] = list(range(size))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, need_size: int) -> list[int] | None:
        if need_size > len(self.free_slots):
            return None
        select, self.free_slots = self.free_slots[:need_size], self.free_slots[need_size:]
        return select

    def free(self, free_index: int | list[int]) -> None:
        if isinstance(free_index, int):
            self.free_slots.append(free_index)
        else:
            self.free_slots.extend(free_index)

    def write(self, indices, values) -> None:
        self.req_to_token[indices] = values

    def clear(self) -> None:
        self.free_slots = list(range(self.size))


# The largest finite float8_e5m2: K/V beyond it are stored as it, not as inf (torch's cast gives inf,
# which would turn a whole softmax into NaN).
E5M2_MAX = 57344.0


class TokenToKVPool:
    """KV slots for a multi-head-attention model: per layer `[size + 1, kv_heads, head_dim]` K and V.

    `dtype` is what the cache holds: float32, bfloat16, float8_e5m2 or int8. float8_e5m2 is stored as
    uint8 (`store_dtype`, as the reference does); readers view those rows as float8_e5m2 and widen
    them (`widen_kv`), the C kernels decode the bytes themselves.

    int8 (model.kv_cache_dtype = "int8") keeps each slot's head row of K and of V as int8 values
    and one fp32 scale (max |x| / 127 of the row; `quantize_kv_rows`): the scales are per layer
    `[size + 1, kv_heads]` tensors, `k_scale` and `v_scale`, and each int8 buffer carries its own
    as the attribute `kv_scales` (`kv_scales(buf)`), so that whatever holds a buffer can read it.
    """

    def __init__(
        self,
        size: int,
        dtype: torch.dtype,
        num_kv_heads: int,
        head_dim: int,
        num_layers: int,
        device: str = "cpu",
        huge_pages: bool | str = False,
    ):
        if huge_pages not in (True, False, "auto"):
            raise ValueError(f"huge_pages must be true, false or 'auto', got {huge_pages!r}")
        self.size = size
        self.huge_pages = huge_pages
        self.dtype = dtype
        self.store_dtype = torch.uint8 if dtype == torch.float8_e5m2 else dtype
        self.device = device
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_layers = num_layers
        shape = (size + 1, num_kv_heads, head_dim)
        self.k_buffer = [self._zeros(shape) for _ in range(num_layers)]
        self.v_buffer = [self._zeros(shape) for _ in range(num_layers)]
        self.k_scale: list[torch.Tensor] = []  # int8 pools: per layer [size + 1, kv_heads] fp32
        self.v_scale: list[torch.Tensor] = []
        if dtype == torch.int8:
            for bufs, scales in ((self.k_buffer, self.k_scale), (self.v_buffer, self.v_scale)):
                for buf in bufs:
                    scales.append(self._zeros(shape[:2], torch.float32))
                    buf.kv_scales = scales[-1]
        self._free_group: list[torch.Tensor] | None = None
        self.clear()

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        """A zeroed buffer (of the stored dtype unless `dtype`): on huge pages where `huge_pages`
        asks (true; `auto` while they come fast in this process, see zeros_on_huge_pages), else
        torch.zeros."""
        dtype = dtype or self.store_dtype
        auto = self.huge_pages == "auto"
        if (self.huge_pages and torch.device(self.device).type == "cpu"
                and not (auto and huge_pages_came_slowly() is not None)):
            return zeros_on_huge_pages(shape, dtype, give_up_when_slow=auto)
        return torch.zeros(shape, dtype=dtype, device=self.device)

    @staticmethod
    def cell_size(num_kv_heads: int, head_dim: int, num_layers: int, dtype: torch.dtype) -> int:
        """Bytes one token of KV takes over all layers (reference P3); an int8 pool's scales too."""
        row = head_dim * dtype.itemsize + (4 if dtype == torch.int8 else 0)
        return num_kv_heads * row * num_layers * 2

    def available_size(self) -> int:
        return int(self.free_slots.numel())

    def alloc(self, need_size: int) -> torch.Tensor | None:
        if need_size > self.free_slots.numel():
            return None
        select = self.free_slots[:need_size]
        self.free_slots = self.free_slots[need_size:]
        return select

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        free_index = free_index.to(torch.int64).cpu()
        if self._free_group is not None:
            # The caller may pass a view of req_to_token that is rewritten before the group ends.
            self._free_group.append(free_index.clone())
        else:
            self.free_slots = torch.cat((self.free_slots, free_index))

    def free_group_begin(self) -> None:
        """Buffer frees until `free_group_end` and concatenate them once (decode result processing)."""
        self._free_group = []

    def free_group_end(self) -> None:
        group, self._free_group = self._free_group, None
        if group:
            self.free(torch.cat(group))

    def clear(self) -> None:
        self.free_slots = torch.arange(1, self.size + 1, dtype=torch.int64)
        self._free_group = None

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [len(loc), kv_heads, head_dim] rows for the slots `loc`."""
        for buf, x in ((self.k_buffer[layer_id], k), (self.v_buffer[layer_id], v)):
            if self.dtype == torch.int8:
                buf[loc], buf.kv_scales[loc] = quantize_kv_rows(x)
            else:
                buf[loc] = self._stored(x)

    def _stored(self, x: torch.Tensor) -> torch.Tensor:
        if self.store_dtype != torch.uint8:
            return x.to(self.dtype)
        return x.clamp(-E5M2_MAX, E5M2_MAX).to(torch.float8_e5m2).view(torch.uint8)


def quantize_kv_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K or V rows [..., head_dim] as an int8 pool keeps them: int8 values round(x / s) (to nearest
    even) and the scales s = max |x| / 127 of each row, in fp32 (a row of zeros: scale 0, values 0;
    x is first as the model's dtype gives it, e.g. bf16). The C kernels (rope_kv) make the same bits."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / 127
    q = torch.where(scale[..., None] > 0, x / scale[..., None], 0.0)
    return torch.round(q).clamp_(-127, 127).to(torch.int8), scale


def kv_scales(buf: torch.Tensor) -> torch.Tensor | None:
    """The [slots, kv_heads] fp32 scales of an int8 pool's K or V buffer; None for other pools."""
    return getattr(buf, "kv_scales", None)


def widen_kv(rows: torch.Tensor, dtype: torch.dtype, scales: torch.Tensor | None = None) -> torch.Tensor:
    """Rows read from a pool's K/V buffers, in a dtype attention computes in: the float8_e5m2
    bytes of an fp8 pool widened to `dtype`, an int8 pool's values times their `scales` (one per
    row: the rows' shape without head_dim), other pools' rows as they are."""
    if rows.dtype == torch.uint8:
        return rows.view(torch.float8_e5m2).to(dtype)
    if rows.dtype == torch.int8:
        if scales is None:
            raise ValueError("int8 KV rows need their scales (kv_scales of the pool's buffer) to be widened")
        return (rows.float() * scales.unsqueeze(-1)).to(dtype)
    return rows
