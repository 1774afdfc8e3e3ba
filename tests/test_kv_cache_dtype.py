"""model.kv_cache_dtype: what the KV pool holds (the model's dtype, float32, bfloat16,
float8_e5m2 stored as bytes, or int8 with a scale per row), how many tokens fit, and that every
reader widens fp8 and int8 rows to their values. The kernels' reading of e5m2 bytes and int8
rows is in tests/test_cpu_kernels.py, our llama over an fp8 or int8 pool against transformers in
tests/test_model.py, the real model in tests/test_e2e_reference.py.
"""

from __future__ import annotations

import pytest
import torch

from framework.memory import E5M2_MAX, TokenToKVPool, kv_scales, quantize_kv_rows, widen_kv

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], list(range(10, 60)), [42] * 3]


def _pool(dtype: torch.dtype) -> TokenToKVPool:
    return TokenToKVPool(16, dtype, num_kv_heads=2, head_dim=4, num_layers=1)


def test_an_fp8_pool_stores_bytes_and_reads_back_their_values():
    pool = _pool(torch.float8_e5m2)
    assert pool.k_buffer[0].dtype == torch.uint8 and pool.store_dtype == torch.uint8
    assert TokenToKVPool.cell_size(2, 4, 1, torch.float8_e5m2) * 2 == TokenToKVPool.cell_size(2, 4, 1, torch.bfloat16)
    k = torch.tensor([0.0, -0.0, 1.0, -1.5, 3e-5, 0.1, 100.0, -2.0]).view(1, 2, 4)
    v = -k
    loc = torch.tensor([5])
    pool.set_kv(0, loc, k, v)
    want = k.to(torch.float8_e5m2).float()  # e5m2 keeps 1, -1.5, 100, -2 exactly
    assert torch.equal(widen_kv(pool.k_buffer[0][loc], torch.float32), want)
    assert torch.equal(widen_kv(pool.v_buffer[0][loc], torch.float32), -want)
    assert widen_kv(pool.k_buffer[0][loc], torch.bfloat16).dtype == torch.bfloat16


def test_fp8_values_beyond_the_largest_finite_one_are_stored_as_it_not_as_inf():
    """torch's cast to float8_e5m2 gives inf past 57344, which would make a softmax NaN."""
    pool = _pool(torch.float8_e5m2)
    k = torch.tensor([1e6, -1e6, float("inf"), float("-inf"), 57344.0, 60000.0, 1.0, 0.0]).view(1, 2, 4)
    pool.set_kv(0, torch.tensor([3]), k, k)
    back = widen_kv(pool.k_buffer[0][3], torch.float32).flatten()
    assert back.isfinite().all()
    assert back.tolist() == [E5M2_MAX, -E5M2_MAX, E5M2_MAX, -E5M2_MAX, E5M2_MAX, E5M2_MAX, 1.0, 0.0]


def test_an_int8_pool_keeps_each_rows_values_and_scale():
    """Per slot and KV head: int8 values round(x / s) (to nearest even) and s = max |x| / 127 in
    fp32, in scale tensors each buffer carries (`kv_scales`); read back within half a step."""
    pool = _pool(torch.int8)
    assert pool.k_buffer[0].dtype == torch.int8 and pool.store_dtype == torch.int8
    assert kv_scales(pool.k_buffer[0]) is pool.k_scale[0] and kv_scales(pool.v_buffer[0]) is pool.v_scale[0]
    assert pool.k_scale[0].shape == (17, 2) and pool.k_scale[0].dtype == torch.float32
    assert kv_scales(_pool(torch.bfloat16).k_buffer[0]) is None
    # 4 values a row + a 4-byte scale, against 8 bytes of bf16 (SmolLM2's 64 + 4 against 128)
    assert TokenToKVPool.cell_size(2, 4, 1, torch.int8) == 2 * 2 * (4 + 4)
    assert TokenToKVPool.cell_size(3, 64, 30, torch.int8) * 128 == TokenToKVPool.cell_size(3, 64, 30, torch.bfloat16) * 68
    k = torch.tensor([[1.0, -0.5, 0.25, 127.0], [0.0, 0.0, 0.0, 0.0]]).view(1, 2, 4)
    v = torch.tensor([[3.0, 2.5, -1.5, 0.5], [1e-3, -2e-3, 3e-3, 0.0]]).view(1, 2, 4)
    loc = torch.tensor([5])
    pool.set_kv(0, loc, k, v)
    assert pool.k_buffer[0][5].tolist() == [[1, 0, 0, 127], [0, 0, 0, 0]]  # -0.5 and 0.25 round to even 0
    assert pool.k_scale[0][5].tolist() == [1.0, 0.0]  # a row of zeros: scale 0
    assert pool.v_buffer[0][5, 0].tolist() == [127, 106, -64, 21]  # 2.5 * 127 / 3 = 105.83
    assert torch.equal(pool.v_scale[0][5], torch.tensor([3.0, 3e-3]) / 127)
    back = widen_kv(pool.v_buffer[0][loc], torch.float32, pool.v_scale[0][loc])
    assert ((back - v).abs() <= pool.v_scale[0][loc].unsqueeze(-1) / 2 + 1e-9).all()
    assert widen_kv(pool.k_buffer[0][loc], torch.bfloat16, pool.k_scale[0][loc]).dtype == torch.bfloat16
    values, scales = quantize_kv_rows(torch.full((3, 64), -2.0))
    assert (values == -127).all() and torch.equal(scales, torch.full((3,), 2.0 / 127))
    with pytest.raises(ValueError, match="scales"):  # int8 rows without them: no values to give
        widen_kv(pool.k_buffer[0][loc], torch.float32)


def test_other_pools_are_read_as_they_are():
    for dtype in (torch.float32, torch.bfloat16):
        pool = _pool(dtype)
        assert pool.k_buffer[0].dtype == dtype
        rows = pool.k_buffer[0][:2]
        assert widen_kv(rows, torch.float32) is rows


@pytest.mark.parametrize("kv_cache_dtype,pool_dtype,bytes_per_value", [
    ("auto", torch.float32, 4), ("float32", torch.float32, 4), ("bfloat16", torch.bfloat16, 2),
    ("fp8_e5m2", torch.float8_e5m2, 1), ("int8", torch.int8, 1),
])
def test_the_setting_types_and_sizes_the_pool(make_engine, kv_cache_dtype, pool_dtype, bytes_per_value):
    """The tiny fp32 model: the pool holds the setting's dtype (auto: the model's), as many tokens
    as kv_cache_memory_mb takes at that size (an int8 pool's scales counted: 4 bytes a row), and
    the engine generates over it (leak-checked)."""
    engine = make_engine(model={"kv_cache_dtype": kv_cache_dtype}, cache={"max_total_tokens": None, "kv_cache_memory_mb": 4})
    worker = engine.scheduler.worker
    pool = worker.token_to_kv_pool
    assert pool.dtype == pool_dtype
    cfg = worker.runner.model_config
    row = cfg.head_dim * bytes_per_value + (4 if pool_dtype == torch.int8 else 0)
    assert worker.max_total_num_tokens == (4 << 20) // (2 * cfg.num_layers * cfg.num_kv_heads * row)
    outs = engine.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert [len(o["output_ids"]) for o in outs] == [6] * len(PROMPTS)


def test_the_sim_worker_sizes_an_fp8_pool_as_the_engine_does(tiny_model_folder):
    from framework.model.config import ModelConfig
    from framework.model.loader import load_hf_config
    from plugins.workers.sim import pool_sizes
    from tests.conftest import tiny_settings

    cfg = ModelConfig.from_hf_config(load_hf_config(tiny_model_folder))

    def tokens(kv_cache_dtype):
        settings = tiny_settings(tiny_model_folder, model={"kv_cache_dtype": kv_cache_dtype},
                                 cache={"max_total_tokens": None, "kv_cache_memory_mb": 4})
        return pool_sizes(cfg, torch.bfloat16, 2048, 1, settings)[0]

    assert tokens("fp8_e5m2") == 2 * tokens("auto") == 2 * tokens("bfloat16")
    assert tokens("int8") == (4 << 20) // (2 * cfg.num_layers * cfg.num_kv_heads * (cfg.head_dim + 4))

