"""model.kv_cache_dtype: what the KV pool holds (the model's dtype, float32, bfloat16, or
float8_e5m2 stored as bytes), how many tokens fit, and that every reader widens fp8 rows to their
values. The kernels' reading of e5m2 bytes is in tests/test_cpu_kernels.py, our llama over an fp8
pool against transformers in tests/test_model.py, the real model in tests/test_e2e_reference.py.
"""

from __future__ import annotations

import pytest
import torch

from framework.memory import E5M2_MAX, TokenToKVPool, widen_kv

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


def test_other_pools_are_read_as_they_are():
    for dtype in (torch.float32, torch.bfloat16):
        pool = _pool(dtype)
        assert pool.k_buffer[0].dtype == dtype
        rows = pool.k_buffer[0][:2]
        assert widen_kv(rows, torch.float32) is rows


@pytest.mark.parametrize("kv_cache_dtype,pool_dtype,bytes_per_value", [
    ("auto", torch.float32, 4), ("float32", torch.float32, 4), ("bfloat16", torch.bfloat16, 2),
    ("fp8_e5m2", torch.float8_e5m2, 1),
])
def test_the_setting_types_and_sizes_the_pool(make_engine, kv_cache_dtype, pool_dtype, bytes_per_value):
    """The tiny fp32 model: the pool holds the setting's dtype (auto: the model's), as many tokens
    as kv_cache_memory_mb takes at that size, and the engine generates over it (leak-checked)."""
    engine = make_engine(model={"kv_cache_dtype": kv_cache_dtype}, cache={"max_total_tokens": None, "kv_cache_memory_mb": 4})
    worker = engine.scheduler.worker
    pool = worker.token_to_kv_pool
    assert pool.dtype == pool_dtype
    cfg = worker.runner.model_config
    assert worker.max_total_num_tokens == (4 << 20) // (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * bytes_per_value)
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

