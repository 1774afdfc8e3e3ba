"""The C kernels (framework/model/kernels/): decode attention against a float64 reference
computed here, the fused bf16 ops against their PyTorch path, the build cache, and the fallback
when they cannot be built.

End-to-end coverage (our llama vs transformers with the kernels on and off, decode and mixed
batches) is in tests/test_model.py, whose runner fixture runs both.
"""

from __future__ import annotations

import pytest
import torch

import torch.nn.functional as F

from framework.memory import kv_scales, quantize_kv_rows, widen_kv
from framework.model import cpu_kernels
from framework.model.attention import TorchNativeAttention, _KernelDecode
from framework.model.cpu_kernels import load_decode_kernel
from framework.model.llama import RMSNorm
from tests.conftest import bool_bitmask

KERNEL = load_decode_kernel()
KERNELS = cpu_kernels.pick("auto", "cpu")
needs_kernel = pytest.mark.skipif(KERNELS is None, reason="no C compiler on this machine")


def _as_pool(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a KV pool of `dtype` holds it (float8_e5m2 as its bytes; int8 as its values, carrying
    their scales as an int8 pool's buffers do: see TokenToKVPool)."""
    if dtype == torch.int8:
        values, scales = quantize_kv_rows(x.bfloat16())
        values.kv_scales = scales
        return values
    return x.to(dtype).view(torch.uint8) if dtype == torch.float8_e5m2 else x.to(dtype)


def _values(buf: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A pool buffer's values widened to `dtype` (widen_kv, an int8 pool's with their scales), in fp32."""
    return widen_kv(buf, dtype, kv_scales(buf)).float()


def _scattered_pool(lens, kv_heads, head_dim, dtype, seed=0):
    """A KV pool and request-to-token table where each request's slots are scattered at random."""
    gen = torch.Generator().manual_seed(seed)
    slots = sum(lens) + 1
    k = _as_pool(torch.randn(slots, kv_heads, head_dim, generator=gen), dtype)
    v = _as_pool(torch.randn(slots, kv_heads, head_dim, generator=gen), dtype)
    perm = torch.randperm(slots - 1, generator=gen) + 1  # slot 0 is the dummy slot
    req_to_token = torch.zeros(len(lens) + 3, max(lens) + 5, dtype=torch.int64)
    pool_idx = torch.randperm(req_to_token.shape[0], generator=gen)[: len(lens)]
    start = 0
    for row, n in zip(pool_idx.tolist(), lens):
        req_to_token[row, :n] = perm[start : start + n]
        start += n
    return k, v, req_to_token, pool_idx


def _reference(q, k, v, req_to_token, pool_idx, lens, group, scale):
    """[n, heads, D] float64: each query attends to its request's slots, one KV head per group."""
    out = torch.empty(q.shape, dtype=torch.float64)
    k, v = _values(k), _values(v)
    for i, n in enumerate(lens):
        slots = req_to_token[pool_idx[i], :n]
        kk = k[slots].double().repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, n, D]
        vv = v[slots].double().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = torch.einsum("hd,hnd->hn", q[i].double(), kk) * scale
        out[i] = torch.einsum("hn,hnd->hd", torch.softmax(scores, dim=-1), vv)
    return out


@needs_kernel
@pytest.mark.parametrize(
    "q_dtype,kv_dtype,atol",
    [(torch.float32, torch.float32, 1e-5), (torch.bfloat16, torch.bfloat16, 2e-2), (torch.float32, torch.bfloat16, 1e-4),
     (torch.bfloat16, torch.float8_e5m2, 2e-2), (torch.float32, torch.float8_e5m2, 1e-4),
     (torch.bfloat16, torch.int8, 2e-2), (torch.float32, torch.int8, 1e-4)],
)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("tiles", [True, False])
def test_kernel_matches_reference(q_dtype, kv_dtype, atol, threads, tiles, monkeypatch):
    """Both paths of bf16 requests: AMX tiles where the CPU has them (tiles) and the vector code;
    an fp8 pool (float8_e5m2 bytes) against attention over its values."""
    heads, kv_heads, head_dim = 9, 3, 64  # SmolLM2's grouping: 3 query heads per KV head
    lens = [1, 2, 37, 300, 5, 129, 64, 1000]
    k, v, req_to_token, pool_idx = _scattered_pool(lens, kv_heads, head_dim, kv_dtype)
    q = torch.randn(len(lens), heads, head_dim, generator=torch.Generator().manual_seed(1)).to(q_dtype)
    attn = TorchNativeAttention(heads, kv_heads, head_dim)
    attn.use_decode_kernel(KERNEL)
    attn.decode_tiles = tiles
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    plan = _KernelDecode(None, req_to_token, pool_idx, torch.tensor(lens, dtype=torch.int64))
    out = attn._kernel_decode(q, k, v, plan)
    assert out.dtype == q_dtype and out.shape == (len(lens), heads * head_dim)
    ref = _reference(q, k, v, req_to_token, pool_idx, lens, heads // kv_heads, head_dim**-0.5)
    torch.testing.assert_close(out.double().view(ref.shape), ref, atol=atol, rtol=0)


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 3), (8, 2), (8, 1), (12, 1)])
@pytest.mark.parametrize("kv_dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-4), (torch.int8, 1e-4)])
def test_fp32_queries_in_groups_of_every_size_match_reference(heads, kv_heads, kv_dtype, atol):
    """fp32 queries, 1-12 query heads a KV head (the vector paths' copies for groups 1-4, the shared
    one for larger groups, and the portable loops past 8), every length around a 16-token block."""
    head_dim, lens = 64, [1, 15, 16, 17, 63, 64, 65, 200]
    k, v, req_to_token, pool_idx = _scattered_pool(lens, kv_heads, head_dim, kv_dtype, seed=2)
    q = torch.randn(len(lens), heads, head_dim, generator=torch.Generator().manual_seed(3))
    attn = TorchNativeAttention(heads, kv_heads, head_dim)
    attn.use_decode_kernel(KERNEL)
    out = attn._kernel_decode(q, k, v, _KernelDecode(None, req_to_token, pool_idx, torch.tensor(lens, dtype=torch.int64)))
    ref = _reference(q, k, v, req_to_token, pool_idx, lens, heads // kv_heads, head_dim**-0.5)
    torch.testing.assert_close(out.double().view(ref.shape), ref, atol=atol, rtol=0)


@needs_kernel
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_an_int8_pool_is_read_as_integers_to_within_the_outputs_rounding(q_dtype):
    """Where the decode kernel reads an int8 pool as integers (decode_int_query_bits: the query
    rounded per head to int8 on AVX512-VNNI, bf16 queries only; to int16 on AVX2, any queries; the
    probabilities as int16 a chunk for P V), its only error against float64 attention with that
    same query and the pool's exact values (value x scale) is about the output's own rounding: with
    bf16 outputs as far off on average as that reference rounded to bf16 (P rounded to bf16 instead,
    as on a bf16 pool, was 1.38x as far); with fp32 outputs within 2^-14 of the outputs' mean size
    (P's int16 rounding, 2^-16 of a chunk's largest). Long rows take several chunks."""
    bits = cpu_kernels.decode_int_query_bits()
    if bits == 0 or (bits == 8 and q_dtype == torch.float32):
        pytest.skip(f"the decode kernel widens an int8 pool's rows for {q_dtype} queries here")
    heads, kv_heads, head_dim = 9, 3, 64
    lens = [1, 2, 37, 300, 5, 129, 64, 1000, 700, 250]
    k, v, req_to_token, pool_idx = _scattered_pool(lens, kv_heads, head_dim, torch.int8)
    q = torch.randn(len(lens), heads, head_dim, generator=torch.Generator().manual_seed(1)).to(q_dtype)
    attn = TorchNativeAttention(heads, kv_heads, head_dim)
    attn.use_decode_kernel(KERNEL)
    attn.decode_tiles = False
    plan = _KernelDecode(None, req_to_token, pool_idx, torch.tensor(lens, dtype=torch.int64))
    out = attn._kernel_decode(q, k, v, plan).double().view(q.shape)
    top = 2 ** (bits - 1) - 1
    scale = q.float().abs().amax(-1, keepdim=True) / top  # in fp32, as the kernel rounds it
    q_int = torch.round(q.float() / scale).double() * scale.double()
    ref = _reference(q_int, k, v, req_to_token, pool_idx, lens, heads // kv_heads, head_dim**-0.5)
    if q_dtype == torch.bfloat16:
        rounding = (ref.to(torch.bfloat16).double() - ref).abs().mean()
        assert (out - ref).abs().mean() < 1.1 * rounding
    else:
        assert (out - ref).abs().mean() < 2**-14 * ref.abs().mean()  # (measured: 2^-16.1)


@needs_kernel
def test_an_int8_pool_without_its_scales_is_refused_by_name():
    """An int8 buffer that carries no kv_scales: the kernel refuses it, and the error says why
    (not an out-of-memory)."""
    lens = [3, 20]
    k, v, req_to_token, pool_idx = _scattered_pool(lens, 3, 64, torch.bfloat16)
    k, v = quantize_kv_rows(k)[0], quantize_kv_rows(v)[0]  # values only
    attn = TorchNativeAttention(9, 3, 64)
    attn.use_decode_kernel(KERNEL)
    q = torch.randn(len(lens), 9, 64).to(torch.bfloat16)
    plan = _KernelDecode(None, req_to_token, pool_idx, torch.tensor(lens, dtype=torch.int64))
    with pytest.raises(ValueError, match="int8 KV pool"):
        attn._kernel_decode(q, k, v, plan)


@needs_kernel
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tiles,d", [(True, 64), (False, 64), (False, 32)])
def test_every_finite_e5m2_value_is_read_as_itself(q_dtype, tiles, d):
    """One-token requests return their V row: every finite float8_e5m2 byte (both signs, zero,
    the subnormals, the largest) comes back as its value, on each path (the tiles and the
    AVX512-BF16 scores widen bytes to bf16 in integer steps, the fp32 vector code through fp16,
    head_dim 32 the scalar code). The bf16 widening flushes e5m2's subnormals (|x| < 6.2e-5) to zero."""
    finite = torch.tensor([b for b in range(256) if b & 0x7C != 0x7C], dtype=torch.uint8)
    kv_heads, heads = 3, 9
    n = -(-finite.numel() // (kv_heads * d))  # one-token requests, in slots 1..n
    v = torch.zeros(n + 1, kv_heads, d, dtype=torch.uint8)
    v.view(-1)[kv_heads * d : kv_heads * d + finite.numel()] = finite
    k = torch.zeros_like(v)
    req_to_token = torch.arange(1, n + 1).view(n, 1)
    attn = TorchNativeAttention(heads, kv_heads, d)
    attn.use_decode_kernel(KERNEL)
    attn.decode_tiles = tiles
    q = torch.ones(n, heads, d, dtype=q_dtype)
    out = attn._kernel_decode(q, k, v, _KernelDecode(None, req_to_token, torch.arange(n), torch.ones(n, dtype=torch.int64)))
    want = widen_kv(v[1:], torch.float32).repeat_interleave(heads // kv_heads, dim=1).reshape(n, -1)
    if tiles and q_dtype == torch.bfloat16 and _decode_uses_tiles(heads, kv_heads, d):
        torch.testing.assert_close(out.float(), want, atol=6.2e-5, rtol=0)  # subnormals flushed
        normal = want.abs() >= 2.0**-14
        assert torch.equal(out.float()[normal], want[normal])
    else:
        assert torch.equal(out.float(), want)
    assert want.abs().max() == 57344.0 and 0 < want.abs()[want != 0].min() < 2.0**-14


@needs_kernel
def test_kernel_and_torch_paths_agree_on_a_bf16_decode_step():
    """The whole `prepare` + `forward` path of one decode batch, kernel vs PyTorch dense decode."""
    from framework.batch import ForwardMode, ModelWorkerBatch
    from framework.memory import ReqToTokenPool

    heads, kv_heads, head_dim = 6, 2, 32
    lens = [4, 90, 1, 33]
    k, v, req_to_token, pool_idx = _scattered_pool(lens, kv_heads, head_dim, torch.bfloat16, seed=2)
    pool = ReqToTokenPool.__new__(ReqToTokenPool)
    pool.req_to_token = req_to_token
    last = torch.tensor([req_to_token[p, n - 1] for p, n in zip(pool_idx.tolist(), lens)])
    batch = ModelWorkerBatch(
        bid=0, forward_mode=ForwardMode.DECODE, input_ids=torch.zeros(len(lens), dtype=torch.int64),
        positions=torch.tensor(lens) - 1, out_cache_loc=last, req_pool_indices=pool_idx,
        seq_lens=torch.tensor(lens), prefix_lens=[n - 1 for n in lens], extend_lens=[1] * len(lens),
        sampling_info=None, return_logprob=False, top_logprobs_nums=[0] * len(lens), extend_logprob_start_lens=[],
    )
    kv = type("Pool", (), {"k_buffer": [k], "v_buffer": [v]})()
    q = torch.randn(len(lens), heads * head_dim, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    outs = []
    for kernel in (KERNEL, None):
        attn = TorchNativeAttention(heads, kv_heads, head_dim)
        attn.use_decode_kernel(kernel)
        meta = attn.prepare(batch, pool)
        assert (meta.kernel is not None) == (kernel is not None)
        outs.append(attn.forward(q, 0, meta, kv).float())
    torch.testing.assert_close(outs[0], outs[1], atol=2e-2, rtol=0)


@pytest.fixture()
def no_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("BATCHYARD_KERNEL_CACHE", str(tmp_path / "kernels"))
    load = cpu_kernels.load  # the test may replace it
    load.cache_clear()
    yield
    load.cache_clear()


def test_without_a_compiler_auto_falls_back_and_on_fails(no_compiler):
    assert load_decode_kernel() is None
    assert cpu_kernels.pick("auto", "cpu") is None
    with pytest.raises(RuntimeError, match="cpu_kernels = 'on'"):
        cpu_kernels.pick("on", "cpu")


def test_off_never_builds_the_kernels(no_compiler, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "load", lambda name: pytest.fail("'off' must not build kernels"))
    assert cpu_kernels.pick("off", "cpu") is None


@pytest.mark.parametrize("march", ["native", "cooperlake", "skylake-avx512", "x86-64-v3"])
def test_every_kernel_builds_without_warnings_where_there_is_a_compiler(tmp_path, march):
    """A kernel that stops compiling would only show as the PyTorch path (a warning in the log)
    and as these tests skipping: build each one here, warnings (shadowed names too) as errors,
    for this CPU and for the paths of the other kinds (cooperlake: AVX512-BF16 without AMX, as
    the AMD EPYC kind; skylake-avx512: AVX-512 without BF16; x86-64-v3: AVX2 only)."""
    import os
    import shutil
    import subprocess

    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler on this machine")
    openmp = cpu_kernels.OPENMP_FLAGS if cpu_kernels.torch_openmp() is not None else []
    sources = sorted(cpu_kernels.KERNEL_DIR.glob("*.c"))
    assert {p.stem for p in sources} >= {"decode_attention", "fused_ops", "packed_gemm", "extend_attention"}
    for source in sources:
        flags = [f if f != "-march=native" else f"-march={march}" for f in cpu_kernels.COMPILE_FLAGS]
        cmd = [compiler, *flags, *openmp, "-Wall", "-Wextra", "-Wshadow", "-Werror", str(source),
               "-o", str(tmp_path / f"{source.stem}.so"), "-lm"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{source.name} does not build for -march={march}:\n{done.stderr}"
        if march == "native":
            assert cpu_kernels.load(source.stem) is not None


@needs_kernel
def test_kernel_build_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHYARD_KERNEL_CACHE", str(tmp_path))
    cpu_kernels.load.cache_clear()
    try:
        assert load_decode_kernel() is not None
        built = list(tmp_path.glob("decode_attention-*.so"))
        assert len(built) == 1
        stamp = built[0].stat().st_mtime_ns
        cpu_kernels.load.cache_clear()
        assert load_decode_kernel() is not None
        assert built[0].stat().st_mtime_ns == stamp  # reused, not rebuilt
    finally:
        cpu_kernels.load.cache_clear()


def _kernel_builds(tmp_path_factory, flags: list[str], what: str, names=("decode_attention", "fused_ops")) -> dict:
    """The kernels `names` (kernels/<name>.c) built with `flags` after `-march=native` (see the two
    fixtures below), in a cache of their own. Skips where that cannot be built (another
    architecture, no compiler)."""
    import ctypes
    import os
    import platform
    import shutil

    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if KERNELS is None or compiler is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"no x86 C compiler for a build {what}")
    old = os.environ.get("BATCHYARD_KERNEL_CACHE")
    os.environ["BATCHYARD_KERNEL_CACHE"] = str(tmp_path_factory.mktemp("kernels"))
    try:
        return {name: ctypes.CDLL(str(cpu_kernels._build(cpu_kernels.KERNEL_DIR / f"{name}.c", compiler, flags)))
                for name in names}
    finally:
        if old is None:
            del os.environ["BATCHYARD_KERNEL_CACHE"]
        else:
            os.environ["BATCHYARD_KERNEL_CACHE"] = old


@pytest.fixture(scope="module")
def portable_libs(tmp_path_factory):
    """The kernels built without AVX-512 (`-mno-avx512f`): the portable loops an AVX2-only CPU
    runs, which an AVX-512 build never compiles."""
    return _kernel_builds(tmp_path_factory, ["-mno-avx512f"], "without AVX-512")


@pytest.fixture(scope="module")
def no_avx2_libs(tmp_path_factory):
    """fused_ops built for x86-64 without AVX2 (`-mno-avx2 -mno-avx512f`): the scalar loops that
    neither vector build compiles."""
    return _kernel_builds(tmp_path_factory, ["-mno-avx2", "-mno-avx512f"], "without AVX2", ("fused_ops",))


@pytest.fixture(scope="module")
def no_bf16_libs(tmp_path_factory):
    """The kernels built for AVX-512 without AVX512_BF16 (`-mno-avx512bf16`, which also leaves out
    the AMX code): the fp32 vector paths that AVX-512 CPUs before Cooper Lake (Skylake-SP, Cascade
    Lake) take for every dtype, bf16 pools included. Runs only where the CPU has AVX-512F."""
    if "avx512f" not in cpu_kernels._cpu_id().split():
        pytest.skip("the CPU has no AVX-512F to run an AVX-512 build on")
    return _kernel_builds(tmp_path_factory, ["-mno-avx512bf16"], "for AVX-512 without BF16",
                          ("decode_attention", "fused_ops"))


def _decode_matches_reference(lib, q_dtype, kv_dtype, atol, lens):
    heads, kv_heads, head_dim = 9, 3, 64
    k, v, req_to_token, pool_idx = _scattered_pool(lens, kv_heads, head_dim, kv_dtype)
    q = torch.randn(len(lens), heads, head_dim, generator=torch.Generator().manual_seed(1)).to(q_dtype)
    attn = TorchNativeAttention(heads, kv_heads, head_dim)
    attn.use_decode_kernel(cpu_kernels.decode_kernel_of(lib))
    plan = _KernelDecode(None, req_to_token, pool_idx, torch.tensor(lens, dtype=torch.int64))
    out = attn._kernel_decode(q, k, v, plan)
    ref = _reference(q, k, v, req_to_token, pool_idx, lens, heads // kv_heads, head_dim**-0.5)
    torch.testing.assert_close(out.double().view(ref.shape), ref, atol=atol, rtol=0)


@pytest.mark.parametrize(
    "q_dtype,kv_dtype,atol",
    [(torch.float32, torch.float32, 1e-5), (torch.bfloat16, torch.bfloat16, 2e-2),
     (torch.float32, torch.float8_e5m2, 1e-4)],
)
def test_portable_decode_kernel_matches_reference(portable_libs, q_dtype, kv_dtype, atol, monkeypatch):
    """Without AVX-512 (lane sums, exp_neg_lanes): the same float64 reference as the vector paths,
    with lengths past and short of the 16-lane loops."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    _decode_matches_reference(portable_libs["decode_attention"], q_dtype, kv_dtype, atol, [1, 2, 15, 16, 17, 300, 1000])


@pytest.mark.parametrize(
    "q_dtype,kv_dtype,atol",
    [(torch.float32, torch.float32, 1e-5), (torch.bfloat16, torch.bfloat16, 2e-2),
     (torch.bfloat16, torch.float8_e5m2, 2e-2), (torch.float32, torch.bfloat16, 1e-4)],
)
def test_decode_kernel_without_avx512_bf16_matches_reference(no_bf16_libs, q_dtype, kv_dtype, atol, monkeypatch):
    """AVX-512 without BF16: the fp32 vector paths (one copy per group size) for every dtype, bf16
    q and pools widened as they are read, on the float64 reference."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    _decode_matches_reference(no_bf16_libs["decode_attention"], q_dtype, kv_dtype, atol, [1, 2, 31, 32, 33, 300, 1000])


@needs_kernel
@pytest.mark.parametrize("rows,d", [(7, 576), (33, 100)])
def test_portable_rms_norm_gives_the_vector_codes_bits(portable_libs, rows, d):
    """The portable RMSNorm sums its squares in the AVX-512 code's lanes and order: the same bits,
    with and without the residual add."""
    from framework.model.cpu_kernels import FusedOps

    portable = FusedOps(portable_libs["fused_ops"])
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, d, generator=gen) * 3).bfloat16()
    residual = torch.randn(rows, d, generator=gen).bfloat16()
    weight = (torch.randn(d, generator=gen) * 0.3 + 1).bfloat16()
    assert torch.equal(portable.rms_norm(x, weight, 1e-5), KERNELS.fused.rms_norm(x, weight, 1e-5))
    ours = portable.add_rms_norm(x, residual, weight, 1e-5)
    assert all(torch.equal(a, b) for a, b in zip(ours, KERNELS.fused.add_rms_norm(x, residual, weight, 1e-5)))


@pytest.mark.parametrize("build", ["pytorch", "native", "portable", "no_avx2", "no_bf16"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rescore_head_top_recomputes_the_columns_near_each_rows_top(build, request, dtype):
    """int8.rescore_head_top (model.int8_lm_head): in each row exactly the columns within the margin
    of the row's largest value get hidden . weight (the exact products' fp32 sum, rounded to bf16; in
    fp32 for a float32 model) and the others keep their values; a row with a NaN is left as it is.
    The kernel's builds (with and without AVX-512, without AVX2, without AVX512_BF16) and PyTorch
    agree."""
    from framework.model.cpu_kernels import FusedOps
    from framework.model.int8 import rescore_head_top

    fused = None
    if build == "native":
        if KERNELS is None:
            pytest.skip("the C kernels do not build here")
        fused = KERNELS.fused
    elif build != "pytorch":
        fused = FusedOps(request.getfixturevalue(f"{build}_libs")["fused_ops"])
    gen = torch.Generator().manual_seed(5)
    rows, vocab, width = 9, 1000, 100  # (a vocabulary and a width off the kernel's 16 and 32 lanes)
    weight = torch.randn(vocab, width, generator=gen).to(dtype)
    hidden = torch.randn(rows, width, generator=gen).to(dtype)
    exact = hidden.double() @ weight.double().t()
    noisy = torch.cat([exact + torch.randn(rows, vocab, generator=gen, dtype=torch.float64),
                       torch.zeros(rows, 24, dtype=torch.float64)], dim=1).to(dtype)
    noisy[3, 17] = float("nan")
    logits = noisy[:, :vocab]  # rows with a stride past their length
    before = logits.clone()
    counts = rescore_head_top(logits, hidden, weight, fused, margin=1.5)
    top = before.float().max(dim=1, keepdim=True).values
    near = before.float() >= top - 1.5
    assert torch.equal(counts, near.sum(dim=1)) and counts[3] == 0 and (counts[torch.arange(rows) != 3] > 0).all()
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(logits.view(bits)[~near], before.view(bits)[~near])  # (bits: NaN included)
    within = dict(rtol=2 ** -8, atol=1e-6) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    assert torch.allclose(logits[near].double(), exact[near], **within)
    assert not torch.allclose(before[near].double(), exact[near], **within)


@needs_kernel
@pytest.mark.parametrize("rows,d", [(1, 64), (200, 576), (513, 100)])  # 100: a tail past the 16-lane loop
def test_fused_rms_norm_matches_torch(rows, d):
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(d, 1e-5)
    norm.weight.data = torch.randn(d, generator=gen) * 0.3 + 1
    norm = norm.to(torch.bfloat16)
    x = (torch.randn(rows, 2 * d, generator=gen) * 3).to(torch.bfloat16)[:, :d]  # strided rows
    ref = norm(x)
    out = KERNELS.fused.rms_norm(x, norm.weight, norm.eps)
    # Same roundings; only the sum of squares is added up in another order (one bf16 ulp at most).
    torch.testing.assert_close(out.float(), ref.float(), atol=0, rtol=2**-7)
    assert (out == ref).float().mean() > 0.99


@needs_kernel
@pytest.mark.parametrize("rows,d", [(1, 16), (200, 1536), (600, 40)])
def test_fused_silu_mul_matches_torch(rows, d):
    gen = torch.Generator().manual_seed(d)
    gate_up = (torch.randn(rows, 2 * d, generator=gen) * 4).to(torch.bfloat16)
    ref = F.silu(gate_up[:, :d]).mul_(gate_up[:, d:])
    out = KERNELS.fused.silu_mul(gate_up)
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-6, rtol=2**-7)
    assert (out == ref).float().mean() > 0.99


@needs_kernel
@pytest.mark.parametrize("rows,d", [(1, 64), (200, 576), (513, 100)])
@pytest.mark.parametrize("residual", [False, True])
def test_fused_fp32_rms_norm_matches_torch(rows, d, residual, monkeypatch):
    """fp32 rows on their kernel (with the residual add before it: h = x + residual returned too),
    PyTorch's fp32 values to fp32 rounding."""
    gen = torch.Generator().manual_seed(rows + d)
    norm = RMSNorm(d, 1e-5)
    norm.weight.data = torch.randn(d, generator=gen) * 0.3 + 1
    x = (torch.randn(rows, 2 * d, generator=gen) * 3)[:, :d]  # strided rows
    res = torch.randn(rows, d, generator=gen) if residual else None
    h_ref = x + res if residual else x
    ref = RMSNorm.forward(norm, h_ref)  # (no kernels: the PyTorch path)
    norm.fused = KERNELS.fused
    calls = []
    real = type(KERNELS.fused).rms_norm_f32
    monkeypatch.setattr(type(KERNELS.fused), "rms_norm_f32", lambda self, *a: calls.append(1) or real(self, *a))
    out, h = norm.add_and_norm(x.clone(), res) if residual else (norm(x), x)
    assert calls == [1]
    torch.testing.assert_close(h, h_ref, atol=0, rtol=0)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-6)


@needs_kernel
@pytest.mark.parametrize("rows,d", [(1, 16), (200, 1536), (600, 40)])
def test_fused_fp32_silu_mul_matches_torch(rows, d):
    gen = torch.Generator().manual_seed(d)
    gate_up = torch.randn(rows, 2 * d + 3, generator=gen)[:, :2 * d] * 6  # strided rows
    gate_up[0, :4] = torch.tensor([0.0, -100.0, 100.0, -0.0])[: min(4, d)]
    ref = F.silu(gate_up[:, :d]) * gate_up[:, d:]
    out = KERNELS.fused.silu_mul_f32(gate_up)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)


@needs_kernel
def test_fused_ops_take_bf16_and_fp32_apart():
    assert not KERNELS.fused.supports(torch.randn(3, 64)) and KERNELS.fused.supports(torch.randn(3, 64).bfloat16())
    assert KERNELS.fused.supports_f32(torch.randn(3, 64), torch.ones(64))
    assert not KERNELS.fused.supports_f32(torch.randn(3, 64).bfloat16())
    assert not KERNELS.fused.supports_f32(torch.randn(3, 64), torch.ones(64).bfloat16())
    assert not KERNELS.fused.supports_f32(torch.randn(64, 3).t())
    wide = torch.ones(1, KERNELS.fused.MAX_NORM_WIDTH + 16, dtype=torch.bfloat16)
    assert not KERNELS.fused.supports_norm(wide, wide[0])  # too wide for the kernel: PyTorch path
    wide_norm = RMSNorm(wide.shape[1], 1e-6).to(torch.bfloat16)
    wide_norm.fused = KERNELS.fused
    torch.testing.assert_close(wide_norm(wide).float(), torch.ones_like(wide).float(), atol=1e-2, rtol=0)


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 40)])  # 40: half not a multiple of 16
@pytest.mark.parametrize("dtype,kv_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float8_e5m2),
                                             (torch.bfloat16, torch.int8), (torch.float32, torch.float32),
                                             (torch.float32, torch.bfloat16), (torch.float32, torch.float8_e5m2),
                                             (torch.float32, torch.int8)])
def test_fused_rope_kv_matches_torch(heads, kv_heads, head_dim, dtype, kv_dtype):
    """q, and k and v as a pool stores them (TokenToKVPool.set_kv: an fp8 pool's bytes rounded to
    nearest even, e5m2 subnormals, values past 57344 clamped, NaN kept; an int8 pool's values and
    scales, rows of zeros among them), bit for bit, from bf16 rows and from fp32 rows (whose
    products RopeTables.apply rounds before adding them: no fused multiply-add)."""
    from types import SimpleNamespace

    from framework.memory import TokenToKVPool
    from framework.model.rotary import RotaryEmbedding

    tokens, slots = 100, 160  # 100 rows: split over two threads
    gen = torch.Generator().manual_seed(head_dim)
    config = SimpleNamespace(head_dim=head_dim, rope_theta=10000.0, rope_type="default", context_len=512)
    rope = RotaryEmbedding(config).tables(torch.randint(0, 500, (tokens,), generator=gen), dtype)
    width = (heads + 2 * kv_heads) * head_dim
    scales = torch.tensor([1.0, 1e-5, 3e-5, 1e5, 5e4, 1.0])[torch.randint(0, 6, (width + 8,), generator=gen)]
    qkv = (torch.randn(tokens, width + 8, generator=gen) * scales).to(dtype)[:, :width]  # strided rows
    qkv[3, -1] = float("nan")
    qkv[5, -head_dim:] = 0.0  # a V row of zeros: scale 0
    loc = torch.randperm(slots, generator=gen)[:tokens]
    ours = TokenToKVPool(slots - 1, kv_dtype, kv_heads, head_dim, 1)
    ref = TokenToKVPool(slots - 1, kv_dtype, kv_heads, head_dim, 1)
    assert KERNELS.fused.supports_rope_kv(ours.k_buffer[0], dtype)
    q = KERNELS.fused.rope_kv(qkv, rope.cos, rope.sin, loc, ours.k_buffer[0], ours.v_buffer[0], heads, kv_heads)
    assert q.dtype == dtype

    qk = rope.apply(qkv[:, : (heads + kv_heads) * head_dim].reshape(tokens, heads + kv_heads, head_dim))
    ref.set_kv(0, loc, qk[:, heads:], qkv[:, (heads + kv_heads) * head_dim :].reshape(tokens, kv_heads, head_dim))
    assert torch.equal(q, qk[:, :heads].reshape(tokens, heads * head_dim))  # the same roundings
    if kv_dtype == torch.int8:  # (NaN's row aside: what a row with a NaN holds is not defined)
        rows = torch.ones(slots, dtype=torch.bool)
        rows[loc[3]] = False
        for mine, theirs in ((ours.k_buffer[0], ref.k_buffer[0]), (ours.v_buffer[0], ref.v_buffer[0])):
            assert torch.equal(mine[rows], theirs[rows]) and torch.equal(mine.kv_scales[rows], theirs.kv_scales[rows])
        assert ours.v_scale[0][loc[5], -1] == 0 and not ours.v_buffer[0][loc[5], -1].any()
        return
    for mine, theirs in ((ours.k_buffer[0], ref.k_buffer[0]), (ours.v_buffer[0], ref.v_buffer[0])):
        mine, theirs = widen_kv(mine, torch.float32), widen_kv(theirs, torch.float32)  # NaN's sign may differ
        torch.testing.assert_close(mine, theirs, rtol=0, atol=0, equal_nan=True)
    assert widen_kv(ours.v_buffer[0], torch.float32)[loc[3], -1, -1].isnan()


@needs_kernel
def test_fused_rope_kv_says_which_pools_it_writes():
    """fp32 rows go into fp32, bf16, fp8 and int8 pools; bf16 rows not into an fp32 pool (the
    layers keep PyTorch's path there); an int8 buffer without its scales, tables of another dtype
    than the rows, or a q buffer of another dtype are refused by name rather than written wrong."""
    from framework.memory import TokenToKVPool

    pools = {dtype: TokenToKVPool(15, dtype, 3, 64, 1) for dtype in (torch.float32, torch.bfloat16, torch.int8)}
    fused = KERNELS.fused
    assert all(fused.supports_rope_kv(p.k_buffer[0], torch.float32) for p in pools.values())
    assert not fused.supports_rope_kv(pools[torch.float32].k_buffer[0], torch.bfloat16)
    assert fused.supports_rope_kv(pools[torch.int8].k_buffer[0], torch.bfloat16)
    assert not fused.supports_rope_kv(torch.zeros(16, 3, 64, dtype=torch.int8), torch.float32)  # no scales
    assert not fused.supports_rope_kv(pools[torch.float32].k_buffer[0], torch.float16)
    qkv, loc = torch.randn(4, 15 * 64), torch.arange(4)
    cos, sin = torch.ones(4, 1, 32), torch.zeros(4, 1, 32)
    k_buf, v_buf = pools[torch.float32].k_buffer[0], pools[torch.float32].v_buffer[0]
    with pytest.raises(ValueError, match="tables are torch.bfloat16"):
        fused.rope_kv(qkv, cos.bfloat16(), sin.bfloat16(), loc, k_buf, v_buf, 9, 3)
    with pytest.raises(ValueError, match="contiguous torch.float32"):
        fused.rope_kv(qkv, cos, sin, loc, k_buf, v_buf, 9, 3, out=torch.empty(4, 576, dtype=torch.bfloat16))
    q = fused.rope_kv(qkv, cos, sin, loc, k_buf, v_buf, 9, 3)  # cos 1, sin 0: nothing rotates
    assert torch.equal(q, qkv[:, :576]) and torch.equal(k_buf[:4], qkv[:, 576:768].view(4, 3, 64))
    assert torch.equal(v_buf[:4], qkv[:, 768:].view(4, 3, 64))


@pytest.mark.parametrize("build", ["native", "portable", "no_avx2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_fused_argmax_matches_torch(threads, dtype, build, request, monkeypatch):
    """The argmax kernel (bf16 and fp32 rows; the native build's vectors and the portable loops)
    gives torch.argmax's index: the first on ties, the first NaN where a row has one."""
    from framework.model.cpu_kernels import FusedOps

    if build == "native":
        if KERNELS is None:
            pytest.skip("the C kernels do not build here")
        fused = KERNELS.fused
    else:
        fused = FusedOps(request.getfixturevalue(f"{build}_libs")["fused_ops"])
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)  # rows split over the threads
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(10, 1003, generator=gen).to(dtype)  # 1003: a tail past the lanes
    logits[1, 10] = logits[1, 500] = 40.0  # a tie: the first index wins
    logits[2] = float("-inf")
    logits[2, 1002] = 0.0  # the maximum in the tail
    logits[3, 7] = float("nan")  # NaN counts as the largest
    logits[4, 900] = float("nan")
    logits[4, 901] = float("inf")
    logits[5, :] = float("-inf")  # all -inf: index 0
    logits[6, 37] = logits[6, 35] = 40.0  # a tie within one vector of 16
    logits[7, 33] = 40.0
    logits[7, 36] = float("nan")  # a NaN after the maximum, in the same vector
    logits[8, 70] = logits[8, 995] = 50.0  # a tie between a vector and the tail
    logits[9, 999] = 60.0  # the maximum in the last lanes before the tail
    strided = torch.randn(3, 2000, generator=gen).to(dtype)[:, 100:1100]
    assert fused.supports_argmax(logits) and not fused.supports_argmax(logits.double())
    for x in (logits, strided):
        assert torch.equal(fused.argmax(x), x.argmax(dim=-1))


@needs_kernel
def test_fused_add_and_norm_matches_torch():
    gen = torch.Generator().manual_seed(9)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576, generator=gen) * 0.3 + 1
    norm = norm.to(torch.bfloat16)
    x = torch.randn(300, 576, generator=gen).to(torch.bfloat16)
    residual = torch.randn(300, 576, generator=gen).to(torch.bfloat16)
    ref_h = x + residual
    ref = norm(ref_h)
    fused_norm = RMSNorm(576, 1e-5).to(torch.bfloat16)
    fused_norm.weight.data = norm.weight.data
    fused_norm.fused = KERNELS.fused
    out, h = fused_norm.add_and_norm(x.clone(), residual)
    assert torch.equal(h, ref_h)
    torch.testing.assert_close(out.float(), ref.float(), atol=0, rtol=2**-7)
    assert (out == ref).float().mean() > 0.99


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_masked_argmax_matches_masking_then_argmax(dtype):
    from framework.grammar import apply_vocab_mask

    gen = torch.Generator().manual_seed(6)
    vocab = 1003  # a tail word past the full ones
    logits = torch.randn(9, vocab, generator=gen).to(dtype)
    allowed = torch.rand(9, vocab, generator=gen) < 0.2
    allowed[0] = True  # unconstrained
    allowed[1] = False
    allowed[1, [3, 1001]] = True  # two tokens, one in the tail word
    logits[2, 10] = logits[2, 500] = 40.0
    allowed[2, [10, 500]] = True  # a tie among allowed: the first wins
    logits[3, 7] = float("nan")
    allowed[3, 7] = False  # a masked-out NaN is ignored
    logits[4, 900] = float("nan")
    allowed[4, 900] = True  # an allowed NaN wins
    allowed[5] = False  # nothing allowed: index 0, as argmax of all -inf
    logits[6, allowed[6]] = float("-inf")  # everything allowed is -inf: index 0
    logits[7, 1002] = 99.0
    allowed[7, 1002] = True  # the maximum is the last token
    logits[8, 40] = logits[8, 42] = logits[8, 45] = 50.0
    allowed[8, 40], allowed[8, 42], allowed[8, 45] = False, True, True  # within one word: the first allowed
    mask = bool_bitmask(allowed)
    expected = apply_vocab_mask(logits, mask).argmax(dim=-1)
    assert torch.equal(KERNELS.fused.argmax_masked(logits, mask), expected)
    strided = torch.randn(9, 2 * vocab, generator=gen).to(dtype)[:, 5 : 5 + vocab]
    assert torch.equal(KERNELS.fused.argmax_masked(strided, mask), apply_vocab_mask(strided, mask).argmax(dim=-1))


# -- packed GEMMs (kernels/packed_gemm.c), on AMX tiles and on AVX512-BF16 vectors ----------------

# Every path this CPU has: the tiles where there are AMX tiles, the vectors wherever there is AVX512-BF16.
GEMMS = [] if KERNELS is None else [
    g for g in (cpu_kernels.load_packed_gemm(tiles=True), cpu_kernels.load_packed_gemm(tiles=False)) if g is not None
]
HAS_TILES = any(g.tiles for g in GEMMS)
needs_tiles = pytest.mark.skipif(not HAS_TILES, reason="no C compiler or no AMX tiles on this CPU")
each_gemm = pytest.mark.parametrize(
    "gemm", GEMMS or [pytest.param(None, marks=pytest.mark.skip(reason="no C compiler or no AVX512-BF16"))],
    ids=lambda g: "none" if g is None else "tiles" if g.tiles else "vectors",
)


def _bf16(gen, *shape, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16)


def test_the_default_packed_gemm_takes_the_tiles_where_there_are():
    if not GEMMS:
        pytest.skip("no C compiler or no AVX512-BF16 on this CPU")
    assert KERNELS.gemm is not None and KERNELS.gemm.tiles == HAS_TILES
    assert KERNELS.gemm.rows == (cpu_kernels.PackedGemm.TILE_ROWS if HAS_TILES else cpu_kernels.PackedGemm.VECTOR_ROWS)


@needs_kernel
def test_no_amx_picks_the_kernels_of_a_cpu_without_amx():
    kernels = cpu_kernels.pick("no_amx", "cpu")
    assert kernels is not None and not kernels.decode_tiles
    assert kernels.gemm is None if not GEMMS else not kernels.gemm.tiles
    assert kernels.extend_attention is None if not GEMMS else not kernels.extend_attention.tiles
    assert KERNELS.decode_tiles
    assert "AMX tiles not used" in cpu_kernels.kernels_note(kernels) or not GEMMS


@each_gemm
def test_pack_lays_out_16_columns_by_32_k_per_tile(gemm):
    w = torch.arange(40 * 64, dtype=torch.float32).view(40, 64).to(torch.bfloat16)
    packed = gemm.pack(w)
    assert packed.shape == (48, 64)  # 40 columns rounded up to 3 blocks of 16
    tiles = packed.view(3, 32, 16, 2)  # [block][k pair][column][k in the pair]
    expected = torch.cat([w, torch.zeros(8, 64, dtype=w.dtype)]).view(3, 16, 32, 2).transpose(1, 2)
    assert torch.equal(tiles, expected)


@each_gemm
@pytest.mark.parametrize("rows,n_out,k", [(1, 960, 576), (16, 576, 1536), (17, 40, 64), (33, 48, 96), (200, 96, 64),
                                          (5, 16, 32), (300, 48, 1536), (7, 80, 64), (13, 37, 96)])
def test_packed_linear_matches_fp32(gemm, rows, n_out, k):
    """Plain and residual-add epilogues against fp32 GEMMs of the same bf16 inputs, one bf16
    rounding of the fp32 sum. Tiles: one row group and several (17, 33, 200: the last one
    partial), odd block counts (48: three blocks, a pair and a single). Vectors: micro-tiles of 6
    rows and the rest (7, 13, 17), units of 4 blocks and a partial one (40, 48, 80), a partial
    block (37). Both: rows in two panels (300 rows of k = 1,536)."""
    gen = torch.Generator().manual_seed(rows * 1000 + n_out)
    x = _bf16(gen, rows, 2 * k)[:, :k]  # strided rows
    w, add = _bf16(gen, n_out, k, scale=0.05), _bf16(gen, rows, n_out)
    ref = x.float() @ w.float().T
    packed = gemm.pack(w)
    torch.testing.assert_close(gemm.linear(x, packed, n_out).float(), ref, atol=1e-3, rtol=2**-7)
    torch.testing.assert_close(gemm.linear(x, packed, n_out, add=add).float(), ref + add.float(), atol=1e-3, rtol=2**-7)


@each_gemm
@pytest.mark.parametrize("rows,d,k", [(1, 1536, 576), (40, 32, 64), (300, 32, 1536), (7, 48, 64)])
def test_packed_gate_up_matches_the_two_gemm_roundings(gemm, rows, d, k):
    """bf16(silu(gate)) * up, as oneDNN's swish GEMM then its binary-mul GEMM (48: three gate
    blocks, on the vectors a unit of two and one of one)."""
    gen = torch.Generator().manual_seed(d)
    x, w = _bf16(gen, rows, k), _bf16(gen, 2 * d, k, scale=0.1)
    gate, up = x.float() @ w[:d].float().T, x.float() @ w[d:].float().T
    ref = F.silu(gate).to(torch.bfloat16).float() * up
    torch.testing.assert_close(gemm.gate_up(x, gemm.pack(w), d).float(), ref, atol=1e-3, rtol=2**-7)


@each_gemm
@pytest.mark.parametrize("rows,n_out", [(1, 49152), (200, 4096), (35, 1000), (9, 37)])
def test_streamed_outputs_are_the_cached_ones(gemm, rows, n_out):
    """`stream` (the LM head's non-temporal stores) gives the same bits as the cached stores,
    also where a row's groups of 16 are not 32-byte aligned (y one element off, an odd row
    stride: those go through the cached stores) and for a partial last block (1000, 37)."""
    gen = torch.Generator().manual_seed(rows + n_out)
    k = 64
    x, w = _bf16(gen, rows, k), _bf16(gen, n_out, k, scale=0.1)
    packed = gemm.pack(w)
    cached = gemm.linear(x, packed, n_out)
    torch.testing.assert_close(cached.float(), x.float() @ w.float().T, atol=1e-3, rtol=2**-7)
    assert torch.equal(gemm.linear(x, packed, n_out, stream=True), cached)
    for offset, stride in ((1, n_out + 1), (0, n_out + 3), (16, n_out + 16)):
        buf = torch.full((rows * stride + offset + n_out,), float("nan"), dtype=torch.bfloat16)
        y = buf[offset:offset + rows * stride].view(rows, stride)[:, :n_out]
        gemm._run(x, packed, None, y, n_out, "none", stream=True)
        assert torch.equal(y, cached)
        gaps = buf[offset:offset + rows * stride].view(rows, stride)[:, n_out:]
        assert gaps.isnan().all()  # nothing stored past a row's outputs


@needs_tiles
@pytest.mark.parametrize("epilogue", ["none", "add", "gate_up", "stream"])
def test_prefill_tiles_go_row_pair_by_row_pair_with_the_same_bits(epilogue):
    """From 1,024 rows the tiles take the rows in pairs of row groups outermost, the units inner
    (run_units_by_rows, in column panels of 1 MiB of weights); below that, unit by unit. Every sum
    runs over k in the same order either way, so 1,041 rows at once (a partial last row group, an
    odd number of groups) give the bits of the same rows as 1,000 + 41, and match fp32. 3,088
    columns (193 blocks: the last unit one block) or a gate_up of 2 x 1,536 at k = 576 are more
    than one panel of each thread's units."""
    gemm = next(g for g in GEMMS if g.tiles)
    gen = torch.Generator().manual_seed(7)
    rows, k = 1041, 576
    n_out = 1536 if epilogue == "gate_up" else 3088
    x = _bf16(gen, rows, k)
    w = _bf16(gen, 2 * n_out if epilogue == "gate_up" else n_out, k, scale=0.05)
    add = _bf16(gen, rows, n_out) if epilogue == "add" else None
    packed = gemm.pack(w)

    def run(part: slice) -> torch.Tensor:
        if epilogue == "gate_up":
            return gemm.gate_up(x[part], packed, n_out)
        return gemm.linear(x[part], packed, n_out, add=None if add is None else add[part],
                           stream=epilogue == "stream")

    whole = run(slice(None))
    assert torch.equal(whole, torch.cat([run(slice(0, 1000)), run(slice(1000, None))]))
    if epilogue == "gate_up":  # (bf16(silu) may round the other way: one of its ulps, 2^-8)
        ref = F.silu(x.float() @ w[:n_out].float().T).to(torch.bfloat16).float() * (x.float() @ w[n_out:].float().T)
        torch.testing.assert_close(whole.float(), ref, atol=1e-3, rtol=2**-6)
    else:
        ref = x.float() @ w.float().T + (0 if add is None else add.float())
        torch.testing.assert_close(whole.float(), ref, atol=1e-3, rtol=2**-7)


@each_gemm
def test_packed_gate_up_of_very_negative_gates_is_zero_not_nan(gemm):
    """SiLU of a gate below ~-88.7: exp(-gate) overflows fp32, and the epilogue's reciprocal of
    it gave NaN (found when the vectors came; the tiles had it too)."""
    d, k = 32, 64
    x = torch.ones(3, k, dtype=torch.bfloat16)
    w = torch.full((2 * d, k), 0.5, dtype=torch.bfloat16)
    w[:d] *= -torch.tensor([1.0, 3.0, 6.0, 12.0]).repeat(d // 4).to(torch.bfloat16)[:, None]  # gates -32 .. -384
    gate, up = x.float() @ w[:d].float().T, x.float() @ w[d:].float().T
    ref = F.silu(gate).to(torch.bfloat16).float() * up
    out = gemm.gate_up(x, gemm.pack(w), d).float()
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=2**-7)


@each_gemm
def test_packed_gemm_refuses_what_it_cannot_do(gemm):
    w = torch.zeros(32, 64, dtype=torch.bfloat16)
    assert not gemm.packs(w[:, :48].contiguous()) and not gemm.packs(w.float()) and not gemm.packs(w.t())
    with pytest.raises(ValueError, match="cannot pack"):
        gemm.pack(w[:, :48].contiguous())  # k not a multiple of 32
    packed, x = gemm.pack(w), torch.zeros(3, 64, dtype=torch.bfloat16)
    assert gemm.supports(x, packed) and not gemm.supports(x[:, :32], packed) and not gemm.supports(x.float(), packed)
    assert not gemm.supports(torch.zeros(gemm.rows + 1, 64, dtype=torch.bfloat16), packed)
    with pytest.raises(ValueError, match="does not fit"):
        gemm.linear(x[:, :32], packed, 32)
    with pytest.raises(ValueError, match="does not fit"):
        gemm.gate_up(x, gemm.pack(torch.zeros(24, 64, dtype=torch.bfloat16)), 12)  # not whole blocks
    with pytest.raises(ValueError, match="does not fit"):
        gemm.linear(x, packed, 16)  # packed from 32 columns
    with pytest.raises(ValueError, match="added tensor"):
        gemm.linear(x, packed, 32, add=torch.zeros(3, 31, dtype=torch.bfloat16))


# -- prefill attention on AMX tiles and AVX512-BF16 vectors (kernels/extend_attention.c) ------------

# Every path this CPU has, as for the GEMMs.
EXTENDS = [] if KERNELS is None else [
    x for x in (cpu_kernels.load_extend_kernel(tiles=True), cpu_kernels.load_extend_kernel(tiles=False)) if x is not None
]
each_extend = pytest.mark.parametrize(
    "extend", EXTENDS or [pytest.param(None, marks=pytest.mark.skip(reason="no C compiler or no AVX512-BF16"))],
    ids=lambda x: "none" if x is None else "tiles" if x.tiles else "vectors",
)


def test_prefill_attention_takes_the_tiles_where_there_are_else_the_vectors():
    if not GEMMS:
        pytest.skip("no C compiler or no AVX512-BF16 on this CPU")
    assert sorted(x.tiles for x in EXTENDS) == ([False, True] if HAS_TILES else [False])
    assert KERNELS.extend_attention is not None and KERNELS.extend_attention.tiles == HAS_TILES


def _extend_reference(q, k_pool, v_pool, slots, prefix_len, round_p: bool = False):
    """fp32 causal attention of q [L, heads, 64] over the pool's slots, the prefix all visible;
    `round_p`: the probabilities' numerators rounded to bf16 before P V, as the kernel rounds them."""
    heads, kv_heads = q.shape[1], k_pool.shape[1]
    k_pool, v_pool = _values(k_pool, torch.bfloat16), _values(v_pool, torch.bfloat16)  # as the kernel widens them
    k = k_pool[slots].float().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
    v = v_pool[slots].float().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
    seq_len = slots.numel()
    visible = torch.arange(seq_len).unsqueeze(0) <= torch.arange(prefix_len, seq_len).unsqueeze(1)
    scores = (q.float().transpose(0, 1) @ k.transpose(1, 2)) / 8.0
    if not round_p:
        return (torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1) @ v).transpose(0, 1)
    num = torch.exp(scores - scores.masked_fill(~visible, float("-inf")).amax(-1, keepdim=True)) * visible
    return ((num.bfloat16().float() @ v) / num.sum(-1, keepdim=True)).transpose(0, 1)


@each_extend
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e5m2, torch.int8])
@pytest.mark.parametrize("ext_len,prefix_len,heads,kv_heads", [(37, 0, 9, 3), (2, 0, 4, 4), (16, 0, 9, 3),
                                                                 (100, 45, 9, 3), (17, 300, 8, 1), (300, 7, 6, 2),
                                                                 (13, 0, 9, 3), (9, 20, 2, 1), (7, 0, 9, 3),
                                                                 (22, 5, 9, 3), (3, 40, 4, 2)])
def test_extend_attention_matches_fp32(extend, ext_len, prefix_len, heads, kv_heads, kv_dtype):
    """Against fp32 attention of the same bf16 inputs (or the fp8 pool's values), within bf16
    rounding (P is rounded to bf16 before P V, as torch's flash attention does): query blocks cut
    at 16, key blocks at 32, a cached prefix, grouped-query heads, slots scattered over the pool;
    rows are read with the pass's stride and written into a strided output. The last blocks'
    row counts take each of the vectors' copies (1-8 rows of scores, 1-6 of P V)."""
    gen = torch.Generator().manual_seed(ext_len * 7 + prefix_len)
    pool = 1200
    k_pool, v_pool = _as_pool(_bf16(gen, pool, kv_heads, 64), kv_dtype), _as_pool(_bf16(gen, pool, kv_heads, 64), kv_dtype)
    slots = torch.randperm(pool, generator=gen)[: prefix_len + ext_len]
    q = _bf16(gen, ext_len, heads + 1, 64, scale=2.0)[:, :heads]  # strided rows
    out = torch.full((ext_len, heads + 2, 64), float("nan"), dtype=torch.bfloat16)
    rc = extend(q.data_ptr(), q.stride(0), k_pool.data_ptr(), v_pool.data_ptr(), *cpu_kernels.scale_ptrs(k_pool, v_pool),
                cpu_kernels.kv_format(k_pool), slots.data_ptr(), prefix_len + ext_len, prefix_len, out.data_ptr(),
                out.stride(0), heads, kv_heads, 64, 0.125, 2)
    assert rc == 0
    ref = _extend_reference(q, k_pool, v_pool, slots, prefix_len)
    torch.testing.assert_close(out[:, :heads].float(), ref, atol=2e-2, rtol=2e-2)
    # Its only error is the roundings': as far off on average as the same attention with P and the
    # output rounded to bf16 (the softmax's exp is a cubic to 7.5e-5; one with its cubic term
    # dropped, 0.7 % off, is 1.3x as far).
    rounded = _extend_reference(q, k_pool, v_pool, slots, prefix_len, round_p=True).bfloat16().float()
    assert (out[:, :heads].float() - ref).abs().mean() < 1.1 * (rounded - ref).abs().mean()
    assert out[:, heads:].isnan().all()  # nothing written past the heads


@each_extend
@pytest.mark.parametrize("prefix_len", [0, 70])
def test_extend_attention_keeps_later_keys_out_of_each_rows_max(extend, prefix_len):
    """A key with a huge score, seen by the later rows of a query block only: the earlier rows'
    softmax must not take it as their max (their probabilities would all underflow to 0 and the
    row turn NaN). The rows' max over the blocks every row sees is taken apart from the rest."""
    gen = torch.Generator().manual_seed(3)
    ext_len, heads = 64, 2
    seq_len = prefix_len + ext_len
    k_pool, v_pool = _bf16(gen, seq_len + 1, 1, 64), _bf16(gen, seq_len + 1, 1, 64)
    q = _bf16(gen, ext_len, heads, 64, scale=2.0)
    big = prefix_len + 40  # seen by queries 40.. of the block of queries 32..47 only
    k_pool[big + 1] = (q[32, 0].float() * 60).to(torch.bfloat16)
    slots = torch.arange(1, seq_len + 1)
    out = torch.full((ext_len, heads, 64), float("nan"), dtype=torch.bfloat16)
    rc = extend(q.data_ptr(), q.stride(0), k_pool.data_ptr(), v_pool.data_ptr(), None, None,
                cpu_kernels.kv_format(k_pool), slots.data_ptr(), seq_len, prefix_len, out.data_ptr(), out.stride(0), heads,
                1, 64, 0.125, 2)
    assert rc == 0
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), _extend_reference(q, k_pool, v_pool, slots, prefix_len),
                               atol=2e-2, rtol=2e-2)


@each_extend
def test_extend_attention_refuses_what_it_cannot_do(extend):
    q = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    pool, slots = torch.zeros(8, 1, 64, dtype=torch.bfloat16), torch.arange(4)

    def call(heads=2, kv_heads=1, head_dim=64, seq_len=4, prefix_len=0, kv_fmt=1):
        out = torch.zeros_like(q)
        return extend(q.data_ptr(), q.stride(0), pool.data_ptr(), pool.data_ptr(), None, None, kv_fmt, slots.data_ptr(),
                      seq_len, prefix_len, out.data_ptr(), out.stride(0), heads, kv_heads, head_dim, 0.125, 2)

    assert call() == 0 and call(kv_fmt=2) == 0
    assert call(kv_fmt=3) == -1  # an int8 pool without its scales
    assert call(head_dim=32) == -1 and call(heads=3, kv_heads=2) == -1 and call(prefix_len=4) == -1
    assert call(kv_fmt=0) == -1  # an fp32 pool
    if not HAS_TILES:  # the tiles, asked for where there are none
        tiles = cpu_kernels.ExtendAttention(extend._fn, True)
        assert tiles(q.data_ptr(), q.stride(0), pool.data_ptr(), pool.data_ptr(), None, None, 1, slots.data_ptr(), 4, 0,
                     q.clone().data_ptr(), q.stride(0), 2, 1, 64, 0.125, 2) == -1


# -- decode attention on AMX tiles (amx_request in kernels/decode_attention.c) ----------------------

def _decode_uses_tiles(heads, kv_heads, head_dim=64, bf16=True, kv_fmt=None) -> bool:
    lib = cpu_kernels.load("decode_attention")
    return bool(lib.decode_attention_tiles(heads, kv_heads, head_dim, int(bf16), int(bf16) if kv_fmt is None else kv_fmt))


def _prompt_then_decode_pool(lens, kv_heads, decoded, seed, dtype=torch.bfloat16):
    """A pool laid out as a server leaves it: each request's prompt in consecutive slots (read by
    the tiles in place from a bf16 pool), then its last `decoded` tokens one slot per step,
    interleaved with the other requests' (copied out 16 at a time)."""
    gen = torch.Generator().manual_seed(seed)
    slots = sum(lens) + 1
    k, v = _as_pool(_bf16(gen, slots, kv_heads, 64), dtype), _as_pool(_bf16(gen, slots, kv_heads, 64), dtype)
    req_to_token = torch.zeros(len(lens), max(lens) + 3, dtype=torch.int64)
    nxt = 1
    prompts = [max(n - decoded, 0) for n in lens]
    for i, p in enumerate(prompts):
        req_to_token[i, :p] = torch.arange(nxt, nxt + p)
        nxt += p
    for step in range(decoded):
        for i, n in enumerate(lens):
            if prompts[i] + step < n:
                req_to_token[i, prompts[i] + step] = nxt
                nxt += 1
    return k, v, req_to_token, torch.arange(len(lens))


@needs_kernel
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e5m2])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (15, 5), (16, 16), (8, 1), (4, 4), (8, 2), (6, 3), (10, 2)])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("tiles", [True, False])
def test_decode_attention_on_tiles_matches_reference(heads, kv_heads, threads, kv_dtype, tiles, monkeypatch):
    """Within bf16 rounding of float64 attention (P is rounded to bf16 before P V): blocks of 16
    tokens cut anywhere (1, 15, 16, 17, 33 tokens), prompts read in place and decoded tokens
    copied out (an fp8 pool's rows always, widened), every grouping the tiles take (up to 16
    query heads); the same requests on the vector code (tiles False: its bf16 scores have a copy
    for each group size up to 4, and one for larger groups)."""
    if tiles and not HAS_TILES:
        pytest.skip("no C compiler or no AMX tiles on this CPU")
    assert _decode_uses_tiles(heads, kv_heads) or not tiles
    lens = [1, 15, 16, 17, 33, 300, 129, 1000]
    k, v, req_to_token, pool_idx = _prompt_then_decode_pool(lens, kv_heads, decoded=40, seed=heads, dtype=kv_dtype)
    q = _bf16(torch.Generator().manual_seed(5), len(lens), heads, 64, scale=2.0)
    attn = TorchNativeAttention(heads, kv_heads, 64)
    attn.use_decode_kernel(KERNEL)
    attn.decode_tiles = tiles
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    out = attn._kernel_decode(q, k, v, _KernelDecode(None, req_to_token, pool_idx, torch.tensor(lens)))
    ref = _reference(q, k, v, req_to_token, pool_idx, lens, heads // kv_heads, 0.125)
    torch.testing.assert_close(out.double().view(ref.shape), ref, atol=2e-2, rtol=2e-2)


@needs_tiles
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e5m2])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_attention_reads_evenly_spaced_slots(kv_dtype, threads, monkeypatch):
    """A steady decode batch leaves each request's decoded tokens one slot a step, as many slots
    apart as there are requests: the tiles read blocks of 16 such slots straight from a bf16 pool
    with that stride (a copy out of an fp8 one). Blocks that mix prompt and decoded slots, and the
    last partial block, are copied; all of it within bf16 rounding of float64 attention."""
    lens = [40, 57, 300, 129, 1000, 64]  # every request decodes all 40 steps: 6 slots apart
    k, v, req_to_token, pool_idx = _prompt_then_decode_pool(lens, 3, decoded=40, seed=11, dtype=kv_dtype)
    decoded = req_to_token[1, 17:57]
    assert (decoded.diff() == len(lens)).all()
    q = _bf16(torch.Generator().manual_seed(6), len(lens), 9, 64, scale=2.0)
    attn = TorchNativeAttention(9, 3, 64)
    attn.use_decode_kernel(KERNEL)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    out = attn._kernel_decode(q, k, v, _KernelDecode(None, req_to_token, pool_idx, torch.tensor(lens)))
    ref = _reference(q, k, v, req_to_token, pool_idx, lens, 3, 0.125)
    torch.testing.assert_close(out.double().view(ref.shape), ref, atol=2e-2, rtol=2e-2)


@needs_tiles
@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e5m2])
@pytest.mark.parametrize("threads", [1, 2])
def test_decode_attention_takes_a_requests_queries_in_one_pass(kv_dtype, threads, monkeypatch):
    """A decode step with drafts gives the kernel one row per token of a request, at consecutive
    positions: the tiles read the request's K once for up to five of them (amx_request). Each row
    must come out exactly as when it is attended alone, and within bf16 rounding of float64
    attention: runs of 1 to 7 rows (7 = a group of five, then two), a run starting at length 1,
    runs split between the two threads' spans, and a row of another request one slot longer
    right after a run (not one of its queries)."""
    lens = [40, 57, 300, 129, 1000, 64, 3, 65]
    k, v, req_to_token, _ = _prompt_then_decode_pool(lens, 3, decoded=30, seed=13, dtype=kv_dtype)
    # (request, rows): its last `rows` positions; request 7's one row is as long as request 5's last + 1
    runs = [(0, 3), (1, 1), (2, 5), (3, 7), (4, 2), (5, 4), (7, 1), (6, 3)]
    pool_idx = torch.tensor([i for i, r in runs for _ in range(r)])
    seq_lens = torch.tensor([lens[i] - r + 1 + j for i, r in runs for j in range(r)])
    assert seq_lens[-3] == 1  # request 6's first row sees one slot
    q = _bf16(torch.Generator().manual_seed(7), len(pool_idx), 9, 64, scale=2.0)
    attn = TorchNativeAttention(9, 3, 64)
    attn.use_decode_kernel(KERNEL)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    out = attn._kernel_decode(q, k, v, _KernelDecode(None, req_to_token, pool_idx, seq_lens))
    for row in range(len(pool_idx)):
        alone = attn._kernel_decode(q[row : row + 1], k, v,
                                    _KernelDecode(None, req_to_token, pool_idx[row : row + 1], seq_lens[row : row + 1]))
        assert torch.equal(out[row], alone[0]), row
    ref = _reference(q, k, v, req_to_token, pool_idx, seq_lens.tolist(), 3, 0.125)
    torch.testing.assert_close(out.double().view(ref.shape), ref, atol=2e-2, rtol=2e-2)


@needs_tiles
def test_decode_attention_keeps_the_vector_code_where_the_tiles_do_not_fit():
    assert _decode_uses_tiles(9, 3) and _decode_uses_tiles(9, 3, kv_fmt=2)  # bf16 and e5m2 pools
    assert not _decode_uses_tiles(9, 3, kv_fmt=0)  # an fp32 pool
    assert not _decode_uses_tiles(32, 8)  # more query heads than a tile's 16 columns
    assert not _decode_uses_tiles(9, 3, head_dim=128)
    assert not _decode_uses_tiles(9, 3, bf16=False)
    assert not _decode_uses_tiles(9, 2)  # heads not a multiple of kv_heads


def test_kernel_cache_key_names_the_cpu_features():
    """The kernels are built with -march=native, and under a hypervisor CPUs with different
    features can share one model name: the build key hashes the feature flags too."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    if "\nflags" not in text or "model name" not in text:
        pytest.skip("this cpuinfo names no model or no flags")
    cpu = cpu_kernels._cpu_id()
    assert cpu.startswith("model name") and "\nflags" in cpu
