"""Where the KV pools live: zeroed memory advised onto transparent huge pages (framework/memory.py)."""

from __future__ import annotations

import gc
import mmap
from pathlib import Path

import pytest
import torch

from framework import memory
from framework.memory import HUGE_PAGE, TokenToKVPool, widen_kv, zeros_on_huge_pages

_HAS_ADVICE = hasattr(mmap, "MADV_HUGEPAGE")


def _thp_honours_madvise() -> bool:
    return memory.thp_mode() in ("always", "madvise")


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def _pool(size: int = 40_000, dtype: torch.dtype = torch.bfloat16) -> TokenToKVPool:
    return TokenToKVPool(size, dtype, num_kv_heads=3, head_dim=64, num_layers=2, huge_pages=True)


def test_pools_stay_on_torch_zeros_unless_asked(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("zeros_on_huge_pages called without cache.kv_huge_pages")

    monkeypatch.setattr(memory, "zeros_on_huge_pages", refuse)
    pool = TokenToKVPool(40_000, torch.bfloat16, num_kv_heads=3, head_dim=64, num_layers=2)
    assert not pool.huge_pages and pool.k_buffer[0].shape == (40_001, 3, 64) and not pool.k_buffer[0].any()


@pytest.mark.skipif(not _HAS_ADVICE, reason="no MADV_HUGEPAGE on this platform")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e5m2, torch.float32])
def test_pool_buffers_are_zeroed_and_start_on_a_huge_page(dtype):
    pool = _pool(dtype=dtype)
    for buf in pool.k_buffer + pool.v_buffer:
        assert buf.shape == (40_001, 3, 64) and buf.dtype == pool.store_dtype and buf.is_contiguous()
        assert buf.data_ptr() % HUGE_PAGE == 0
        assert not buf.view(torch.uint8).any()
    # the buffers are distinct memory, written and read through the pool as before
    loc = torch.tensor([1, 7, 40_000])
    k = torch.full((3, 3, 64), 1.5)
    pool.set_kv(1, loc, k, -k)
    assert torch.equal(widen_kv(pool.k_buffer[1][loc], torch.float32), k)
    assert torch.equal(widen_kv(pool.v_buffer[1][loc], torch.float32), -k)
    assert not pool.k_buffer[0].view(torch.uint8).any() and not pool.v_buffer[0].view(torch.uint8).any()


@pytest.mark.skipif(not (_HAS_ADVICE and _thp_honours_madvise() and Path("/proc/self/smaps").exists()),
                    reason="transparent huge pages off (or not Linux)")
def test_pool_buffers_get_huge_pages_where_the_kernel_gives_them():
    pool = _pool()
    got = [_anon_huge_kib(buf.data_ptr()) for buf in pool.k_buffer + pool.v_buffer]
    # each 15.4 MB buffer spans seven whole huge pages; a busy machine may be short of some
    assert max(got) >= HUGE_PAGE // 1024, got


def test_a_view_outlives_its_pool():
    pool = _pool()
    pool.k_buffer[0][5] = 2.0
    row = pool.k_buffer[0][5]
    del pool
    gc.collect()
    assert torch.equal(row, torch.full((3, 64), 2.0, dtype=torch.bfloat16))


@pytest.mark.skipif(not _HAS_ADVICE, reason="no MADV_HUGEPAGE on this platform")
def test_with_huge_pages_off_the_pool_is_plain_zeros_and_the_log_says_so(monkeypatch, tmp_path, caplog):
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(memory, "THP_SETTING", setting)
    memory.thp_mode.cache_clear()
    try:
        with caplog.at_level("INFO", logger="framework.memory"):
            pool = _pool()
        assert memory.thp_mode() == "never"
        assert "transparent huge pages are off" in caplog.text and str(setting) in caplog.text
        assert caplog.text.count("transparent huge pages are off") == 1  # once, not per buffer
        buf = pool.k_buffer[0]
        assert buf.shape == (40_001, 3, 64) and not buf.any()
        assert buf.data_ptr() % HUGE_PAGE != 0 or _anon_huge_kib(buf.data_ptr()) == 0
    finally:
        memory.thp_mode.cache_clear()


def test_small_or_unmappable_buffers_are_plain_zeros(monkeypatch):
    small = zeros_on_huge_pages((4, 3, 64), torch.bfloat16)
    assert small.shape == (4, 3, 64) and not small.any()

    def refuse(*args, **kwargs):
        raise OSError("mmap refused")

    monkeypatch.setattr(memory.mmap, "mmap", refuse)
    big = zeros_on_huge_pages((40_001, 3, 64), torch.bfloat16)
    assert big.shape == (40_001, 3, 64) and big.dtype == torch.bfloat16 and not big.any()
    big[0] = 1.0  # an ordinary writable tensor
    assert big[0].sum() == 192


@pytest.mark.skipif(not _HAS_ADVICE, reason="no MADV_HUGEPAGE on this platform")
def test_the_setting_puts_an_engines_pool_on_huge_pages_with_the_same_outputs(make_engine):
    """cache.kv_huge_pages reaches the worker's pool (its buffers mapped on their own), and greedy
    outputs over it are the same tokens as over the default pool (leak-checked engines)."""
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9] * 5]
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    outputs = []
    for huge in (False, True, None):  # None: the default, 'auto'
        cache = {"max_total_tokens": None, "kv_cache_memory_mb": 8}
        if huge is not None:
            cache["kv_huge_pages"] = huge
        engine = make_engine(cache=cache)
        pool = engine.scheduler.worker.token_to_kv_pool
        assert pool.huge_pages == ("auto" if huge is None else huge)
        if huge:
            assert all(buf.data_ptr() % HUGE_PAGE == 0 for buf in pool.k_buffer + pool.v_buffer)
        outputs.append([o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)])
    assert outputs[0] == outputs[1] == outputs[2] and [len(o) for o in outputs[1]] == [8, 8]


def _every_fault_slow(monkeypatch) -> list:
    """`auto` made to find every chunk's faults slow, in a process that has not given up yet;
    returns the `give_up_when_slow` of each zeros_on_huge_pages call from then on."""
    monkeypatch.setattr(memory, "_slow_huge_faults", None)
    monkeypatch.setattr(memory, "SLOW_HUGE_FAULTS_S_PER_GB", 0.0)
    calls = []
    real = memory.zeros_on_huge_pages

    def counted(*args, **kwargs):
        calls.append(kwargs.get("give_up_when_slow"))
        return real(*args, **kwargs)

    monkeypatch.setattr(memory, "zeros_on_huge_pages", counted)
    return calls


def _big_pool(huge_pages) -> TokenToKVPool:
    # 100,000 tokens: 38.4 MB a buffer, more than one FAULT_CHUNK (16 MiB)
    return TokenToKVPool(100_000, torch.bfloat16, num_kv_heads=3, head_dim=64, num_layers=2, huge_pages=huge_pages)


@pytest.mark.skipif(not (_HAS_ADVICE and _thp_honours_madvise() and Path("/proc/self/smaps").exists()),
                    reason="transparent huge pages off (or not Linux)")
def test_auto_gives_up_huge_pages_after_one_slow_chunk(monkeypatch, caplog):
    """cache.kv_huge_pages = 'auto' where huge pages fault in slowly (every chunk made to count as
    slow): the first buffer's first chunk keeps them, the rest of it is advised onto base pages,
    every later buffer is plain torch.zeros, and the log says so once."""
    calls = _every_fault_slow(monkeypatch)
    with caplog.at_level("INFO", logger="framework.memory"):
        pool = _big_pool("auto")
    assert calls == [True]  # the first buffer only
    assert memory.huge_pages_came_slowly() is not None and memory.huge_pages_came_slowly() > 0
    assert caplog.text.count("so the rest of the KV pool goes on 4 KiB pages") == 1
    first = pool.k_buffer[0]
    assert first.data_ptr() % HUGE_PAGE == 0
    assert _anon_huge_kib(first.data_ptr()) <= memory.FAULT_CHUNK // 1024  # not the whole 38.4 MB
    for buf in pool.k_buffer + pool.v_buffer:
        assert buf.shape == (100_001, 3, 64) and not buf.any()


@pytest.mark.skipif(not _HAS_ADVICE, reason="no MADV_HUGEPAGE on this platform")
def test_auto_gives_up_on_a_slow_buffer_shorter_than_a_chunk(monkeypatch):
    """Buffers of one chunk or less (15.4 MB here): the first one's slow faults still send every
    later buffer to torch.zeros."""
    calls = _every_fault_slow(monkeypatch)
    pool = TokenToKVPool(40_000, torch.bfloat16, num_kv_heads=3, head_dim=64, num_layers=2, huge_pages="auto")
    assert pool.k_buffer[0].numel() * 2 <= memory.FAULT_CHUNK
    assert calls == [True] and memory.huge_pages_came_slowly() is not None
    assert all(not buf.any() for buf in pool.k_buffer + pool.v_buffer)


@pytest.mark.skipif(not _HAS_ADVICE, reason="no MADV_HUGEPAGE on this platform")
def test_auto_keeps_huge_pages_while_they_come_fast(monkeypatch):
    monkeypatch.setattr(memory, "_slow_huge_faults", None)
    monkeypatch.setattr(memory, "SLOW_HUGE_FAULTS_S_PER_GB", float("inf"))
    pool = _big_pool("auto")
    assert memory.huge_pages_came_slowly() is None
    for buf in pool.k_buffer + pool.v_buffer:
        assert buf.data_ptr() % HUGE_PAGE == 0 and not buf.any()


def test_auto_after_slow_faults_and_false_use_torch_zeros(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("zeros_on_huge_pages called")

    monkeypatch.setattr(memory, "zeros_on_huge_pages", refuse)
    monkeypatch.setattr(memory, "_slow_huge_faults", 5.0)  # an earlier pool of this process found them slow
    assert not _big_pool("auto").k_buffer[0].any()
    assert not _big_pool(False).k_buffer[0].any()


def test_the_pool_refuses_other_huge_pages_values():
    with pytest.raises(ValueError, match="huge_pages must be true, false or 'auto'"):
        TokenToKVPool(10, torch.bfloat16, num_kv_heads=1, head_dim=8, num_layers=1, huge_pages="yes")
