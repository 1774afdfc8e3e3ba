"""The fp32 GEMM kernel (kernels/f32_gemm.c, cpu_kernels.F32Gemm): against float64 products, and
in the model, where it takes every fp32 linear layer and the LM head on CPUs without AVX-512.

It runs on AVX2 + FMA, which every CPU with AVX-512 has too, so these tests run it wherever it
builds (the engine itself takes it only where there is no AVX-512: `load_f32_gemm`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from framework.batch import ForwardMode
from framework.model import cpu_kernels
from framework.model.cpu_kernels import F32Gemm
from tests.test_model import _batch, _new_reqs, _runner, _tiny_config, _tiny_hf


def _built() -> F32Gemm | None:
    lib = cpu_kernels.load("f32_gemm")
    if lib is None:
        return None
    lib.f32_gemm_supported.restype = cpu_kernels._INT
    return F32Gemm(lib) if lib.f32_gemm_supported() == 1 else None


GEMM = _built()
needs_gemm = pytest.mark.skipif(GEMM is None, reason="the fp32 GEMM kernel needs a C compiler and AVX2 + FMA")


@needs_gemm
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows,k,n", [(1, 64, 16), (5, 300, 40), (6, 576, 576), (13, 257, 100), (200, 1536, 72),
                                      (611, 576, 960)])
@pytest.mark.parametrize("bias", [False, True])
def test_f32_gemm_matches_float64_products(rows, k, n, bias, threads, monkeypatch):
    """Every output to fp32 rounding of the exact product (k past one block of 256 steps, n past
    a whole unit of 16 columns, rows past a micro-tile of 6, x rows strided as a view's)."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    gen = torch.Generator().manual_seed(rows * 7 + k)
    wide = torch.randn(rows, k + 9, generator=gen)
    x = wide[:, 3:3 + k]  # (row stride k + 9)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    out = GEMM.linear(x, GEMM.pack(w), n, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert out.shape == (rows, n) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-4)


@needs_gemm
def test_f32_gemm_refuses_what_it_cannot_take():
    w = torch.randn(32, 64)
    packed = GEMM.pack(w)
    assert GEMM.supports(torch.randn(4, 64), packed, 64)
    assert not GEMM.supports(torch.randn(4, 64).bfloat16(), packed, 64)
    assert not GEMM.supports(torch.randn(64, 4).t(), packed, 64)  # (columns not unit-stride)
    assert not GEMM.supports(torch.randn(4, 32), packed, 64)
    with pytest.raises(ValueError, match="cannot pack"):
        GEMM.pack(w.bfloat16())


def test_the_engine_takes_it_only_without_avx512(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_cpu_id", lambda: "flags : fpu avx2 fma avx512f avx512bw")
    assert cpu_kernels.load_f32_gemm() is None
    monkeypatch.setattr(cpu_kernels, "_cpu_id", lambda: "flags : fpu avx2 fma")
    assert (cpu_kernels.load_f32_gemm() is not None) == (GEMM is not None)


@needs_gemm
def test_an_fp32_model_runs_its_gemms_on_it(monkeypatch):
    """With the kernel (as on an AMD EPYC Zen 3), every linear layer and the LM head have a packed
    copy and their fp32 passes run on it, prefill and decode, and every prompt's prefill attention
    runs on its attention kernel, with the logits of MKL's GEMMs and SDPA to fp32 rounding; bf16
    models keep their own GEMMs."""
    hf_model = _tiny_hf(config=_tiny_config(hidden_size=128, intermediate_size=256, num_attention_heads=2,
                                            num_key_value_heads=1))  # (head_dim 64: the attention kernel's)
    monkeypatch.setattr(cpu_kernels, "load_f32_gemm", _built)
    runner = _runner(hf_model, dtype=torch.float32)
    monkeypatch.setattr(cpu_kernels, "load_f32_gemm", lambda: None)
    plain = _runner(hf_model, dtype=torch.float32)
    model = runner.model
    assert model.kernels.f32_gemm is not None and plain.model.kernels.f32_gemm is None
    layer = model.model.layers[0]
    assert all(p.f32 is not None for p in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                           layer.mlp.gate_up_proj, layer.mlp.down_proj))
    assert model.lm_head_f32 is not None
    assert model.attn_backend.f32_extend_kernel is not None and plain.model.attn_backend.f32_extend_kernel is None
    calls, attended = [], []
    real, real_attention = F32Gemm.linear, model.attn_backend.f32_extend_kernel
    monkeypatch.setattr(F32Gemm, "linear", lambda self, x, *a, **kw: calls.append(x.shape[0]) or real(self, x, *a, **kw))
    model.attn_backend.f32_extend_kernel = lambda *a: attended.append(a[8]) or real_attention(*a)  # (a[8]: seq_len)
    lens = [21, 33, 17]  # (past _KERNEL_MAX_EXTEND: the prefill attention kernel, not decode rows)
    got, want = [], []
    for r, out in ((runner, got), (plain, want)):
        reqs = _new_reqs(r, [n + 2 for n in lens], seed=4)
        out.append(r.forward(_batch(r, reqs, lens, ForwardMode.EXTEND)).next_token_logits.clone())
        out.append(r.forward(_batch(r, reqs, [1, 1, 1], ForwardMode.DECODE)).next_token_logits.clone())
    layers = len(model.model.layers)
    assert sorted(attended) == sorted(lens * layers)  # (each prompt's prefill attention, every layer)
    assert calls.count(sum(lens)) == 4 * layers and calls.count(len(lens)) == 4 * layers + 2  # (the decode step, 2 LM heads)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)

    monkeypatch.setattr(cpu_kernels, "load_f32_gemm", _built)
    bf16 = _runner(hf_model, dtype=torch.bfloat16)
    assert bf16.model.model.layers[0].self_attn.qkv_proj.f32 is None and bf16.model.lm_head_f32 is None


def _extend_reference(q, k, v, slots, prefix_len, group, scale):
    """[L, heads, 64] float64: query i attends to keys 0..prefix_len + i of `slots` (k, v: the pool's values)."""
    kk = k[slots].double().repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, S, D]
    vv = v[slots].double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.einsum("lhd,hsd->hls", q.double(), kk) * scale
    seen = torch.arange(len(slots))[None, :] <= prefix_len + torch.arange(q.shape[0])[:, None]
    probs = torch.softmax(scores.masked_fill(~seen, float("-inf")), dim=-1)
    return torch.einsum("hls,hsd->lhd", probs, vv)


@needs_gemm
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("seq_len,prefix_len", [(1, 0), (7, 0), (37, 20), (300, 0), (300, 283), (611, 100)])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("threads", [1, 2])
def test_f32_prefill_attention_matches_float64(kv_dtype, seq_len, prefix_len, heads, kv_heads, threads, monkeypatch,
                                               scale=None):
    """fp32 queries (rows of a pass, strided as its q) over a request's scattered slots of an fp32,
    bf16 or int8 pool (its values: an int8 row's integers times its scale), causal past a prefix."""
    from framework.model.attention import TorchNativeAttention, _ExtendReq
    from tests.test_cpu_kernels import _as_pool, _values

    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    gen = torch.Generator().manual_seed(seq_len + prefix_len)
    slots_total = seq_len + 50
    k = _as_pool(torch.randn(slots_total, kv_heads, 64, generator=gen), kv_dtype)
    v = _as_pool(torch.randn(slots_total, kv_heads, 64, generator=gen), kv_dtype)
    slots = torch.randperm(slots_total, generator=gen)[:seq_len]
    ext = seq_len - prefix_len
    rows = torch.randn(ext + 2, heads * 64 + 5, generator=gen)[1:ext + 1, :heads * 64]  # (a pass's rows, strided)
    q = rows.view(ext, heads, 64)
    attn = TorchNativeAttention(heads, kv_heads, 64)
    attn.use_f32_extend_kernel(GEMM.extend_attention)
    if scale is not None:
        attn.scaling = scale  # (the kernel folds it into q: not a power of 2 here)
    out = torch.full((ext, heads, 64), float("nan"))
    assert attn._kernel_extend(q, k, v, _ExtendReq(0, ext, prefix_len, slots, None), out)
    ref = _extend_reference(q, _values(k), _values(v), slots, prefix_len, heads // kv_heads, scale or 64**-0.5)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)


@needs_gemm
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (8, 1)])
def test_f32_prefill_attention_other_scale(heads, kv_heads, monkeypatch):
    """A softmax scale other than head_dim ** -0.5 (a model's own query scaling), folded into q."""
    test_f32_prefill_attention_matches_float64(torch.int8, 300, 100, heads, kv_heads, 2, monkeypatch, scale=0.1)
