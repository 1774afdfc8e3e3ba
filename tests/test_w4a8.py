"""model.quantization = "w4a8": 4-bit weight blocks by int8 activation blocks (framework/model/w4a8.py,
kernels/w4_gemm.c)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from framework.batch import ForwardMode
from framework.model import int8 as int8_mod
from framework.model.decode_path import W4DecodePath
from framework.model.w4a8 import (BLOCK, QuantizedBlocks, W4Ops, W4Weight, dequantize_blocks, dequantize_weight,
                                  quantize_blocks, quantize_weight)
from tests.test_int8 import _prefill_logits, assert_fewest_rows_run_quantized, prefill_and_step_logits
from tests.test_int8 import _rows as int8_rows
from tests.test_model import (Wrapped, _batch, _new_reqs, _runner, _tiny_config, _tiny_hf, assert_same_step_kv,
                              step_kv)

TORCH_OPS = W4Ops(None, torch.float32)


@pytest.fixture(scope="module")
def c_ops() -> W4Ops:
    ops = W4Ops.load(torch.float32)
    if ops.lib is None:
        pytest.skip("kernels/w4_gemm.c does not build here (no C compiler, or no AVX2 and FMA)")
    return ops


def _rows(rows: int, width: int, seed: int = 0) -> torch.Tensor:
    """test_int8's rows (magnitudes 0.01-100, the first all zeros) in fp32, one block of the last
    row an outlier."""
    x = int8_rows(rows, width, seed).float()
    x[-1, :BLOCK] *= 300
    return x


def _q4_1_weight(n: int, k: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, d, m) of a Q4_1 weight as a GGUF holds it: fp16 d and m, every block using 0 and 15."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    q[:, ::BLOCK], q[:, 1::BLOCK] = 0, 15
    d = (torch.rand(n, k // BLOCK, generator=gen) * 0.01 + 1e-4).half().float()
    m = (-torch.rand(n, k // BLOCK, generator=gen) * 0.08).half().float()
    return q, d, m


def test_a_q4_1_weight_comes_back_as_its_own_blocks():
    """The embedded model's weights are Q4_1 blocks: quantizing their fp32 values gives the file's q
    back exactly and d, m within an fp32 rounding, so the weights are the file's (w8a8 rounds them
    again); a constant block has d 0, q 0 and its value as m."""
    q, d, m = _q4_1_weight(96, 576)
    w = dequantize_weight(q, d, m)
    w[5, 64:96] = 0.25
    got_q, got_d, got_m = quantize_weight(w)
    assert torch.equal(got_q[:5], q[:5]) and torch.equal(got_q[6:], q[6:])
    assert torch.equal(got_m[:5], m[:5]) and torch.allclose(got_d, torch.where(got_d == 0, got_d, d), rtol=2e-7)
    assert got_d[5, 2] == 0 and (got_q[5, 64:96] == 0).all() and got_m[5, 2] == 0.25
    assert (dequantize_weight(got_q, got_d, got_m) - w).abs().max() <= 1e-8
    with pytest.raises(ValueError, match="blocks of 32"):
        quantize_weight(torch.randn(8, 40))


def test_quantized_blocks_are_within_half_a_step_of_each_block():
    x = _rows(9, 96)
    b = quantize_blocks(x)
    assert b.q.dtype == torch.int8 and b.scale.shape == b.sum.shape == (9, 3)
    assert torch.equal(b.scale, x.reshape(9, 3, BLOCK).abs().amax(dim=2) / 127)
    step = b.scale.repeat_interleave(BLOCK, dim=1)
    assert ((dequantize_blocks(b) - x).abs() <= step * 0.5001).all()
    assert (b.q[0] == 0).all() and (b.scale[0] == 0).all()
    # the outlier block takes its own range: the last row's other blocks keep theirs
    assert b.scale[-1, 0] > 100 * b.scale[-1, 1:].max()
    assert torch.equal(b.sum, b.q.reshape(9, 3, BLOCK).sum(dim=2).float() * b.scale)


@pytest.mark.parametrize("rows,width", [(1, 32), (5, 96), (37, 576), (200, 1536)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_quantizes_as_pytorch(c_ops, rows, width, dtype):
    x = _rows(rows, width).to(dtype)
    got, want = c_ops.quantize(x), quantize_blocks(x.float())
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    strided = torch.cat([x, x], dim=1)[:, :width]  # (a row stride larger than the width)
    assert torch.equal(c_ops.quantize(strided).q, want.q)


def _exact(x: QuantizedBlocks, q, d, m, add=None) -> torch.Tensor:
    y = dequantize_blocks(x).double() @ dequantize_weight(q, d, m).double().t()
    return y if add is None else y + add.double()


@pytest.mark.parametrize("rows", [1, 3, 5, 37, 200, 700])
@pytest.mark.parametrize("width,n", [(576, 960), (1536, 576), (64, 48)])
@pytest.mark.parametrize("add", [False, True])
def test_the_kernels_product_is_the_exact_product_of_the_blocks(c_ops, rows, width, n, add):
    """Every tile size (4 rows, then 3, 2, 1) and, at 700 rows of 576, two panels of x: the exact
    product of the quantized operands to within fp32 sums; in bf16 rounded once, the add included."""
    x = c_ops.quantize(_rows(rows, width, seed=rows))
    weight = torch.randn(n, width, generator=torch.Generator().manual_seed(n)) * 0.05
    w = c_ops.make(weight)
    assert w.packed is not None and w.q is None
    q, d, m = quantize_weight(weight)
    extra = torch.randn(rows, n) if add else None
    want = _exact(x, q, d, m, extra)
    got = c_ops.linear(x, w, add=extra)
    assert got.dtype == torch.float32
    tol = 1e-5 * want.abs().amax(dim=1, keepdim=True) + 1e-30  # (each row against its own size: 0.01-3e4)
    assert ((got.double() - want).abs() <= tol).all()
    bf16 = W4Ops.load(torch.bfloat16)
    got16 = bf16.linear(x, bf16.make(weight), add=None if extra is None else extra.bfloat16())
    want16 = _exact(x, q, d, m, None if extra is None else extra.bfloat16().float())
    assert got16.dtype == torch.bfloat16
    assert ((got16.double() - want16).abs() <= want16.abs() * 2 ** -8 + tol).all()
    torch_path = TORCH_OPS.linear(quantize_blocks(_rows(rows, width, seed=rows)), TORCH_OPS.make(weight), add=extra)
    assert ((torch_path.double() - want).abs() <= tol).all()


@pytest.mark.parametrize("rows", [1, 7, 37, 200, 300])
@pytest.mark.parametrize("d", [256, 64])
def test_gate_up_quantizes_silu_gate_times_up(c_ops, rows, d):
    """The gate-up kernel's int8 blocks of SiLU(gate) * up (past its 256-row blocks at 300) against
    PyTorch's: the same blocks up to a rounding flipped by the last bit of an fp32 sum."""
    x = c_ops.quantize(_rows(rows, 576, seed=3))
    weight = torch.randn(2 * d, 576, generator=torch.Generator().manual_seed(d)) * 0.05
    got = c_ops.gate_up(x, c_ops.make(weight, gate_up=True))
    q, dd, m = quantize_weight(weight)
    y = _exact(x, q, dd, m).float()
    gate, up = y[:, :d], y[:, d:]
    want = quantize_blocks(gate / (1 + torch.exp(-gate)) * up)
    assert got.q.shape == (rows, d) and got.scale.shape == (rows, d // BLOCK)
    assert torch.allclose(got.scale, want.scale, rtol=1e-5, atol=1e-12)
    assert (got.q.int() - want.q.int()).abs().max() <= 1
    assert (got.q != want.q).float().mean() < 0.01
    torch_path = TORCH_OPS.gate_up(quantize_blocks(_rows(rows, 576, seed=3)), TORCH_OPS.make(weight, gate_up=True))
    assert (torch_path.q.int() - want.q.int()).abs().max() <= 1


def test_a_gate_up_weight_multiplies_on_its_own_in_its_columns_order(c_ops):
    """A pass whose MLP does not run on the W4A8 GEMMs calls the gate-up weight as a plain linear:
    its interleaved units come back in the weight's column order."""
    x = c_ops.quantize(_rows(6, 64))
    weight = torch.randn(128, 64) * 0.05
    got = c_ops.linear(x, c_ops.make(weight, gate_up=True))
    q, d, m = quantize_weight(weight)
    want = _exact(x, q, d, m)
    assert (got.double() - want).abs().max() <= 2e-6 * (want.abs().max() + 1)


def test_weights_the_blocks_do_not_fit_stay_in_the_models_dtype(c_ops):
    assert c_ops.make(torch.randn(16, 40)) is None  # (k not in 32s)
    w = c_ops.make(torch.randn(96, 64), gate_up=True)  # (d = 48: the next GEMM's k not in 32s)
    assert w is not None and w.packed is None and w.dense is not None
    with pytest.raises(ValueError, match="no mul"):
        c_ops.quantize(torch.randn(2, 64), torch.ones(64))


@pytest.fixture(scope="module")
def tied_model():
    """The tiny model with tied embeddings (as SmolLM2) and a vocabulary in 16s (the int8 head),
    its layers' weights on a Q4_1 grid as the embedded model's are (random weights rounded to 4
    bits would move the logits far more than the int8 activations do)."""
    model = _tiny_hf(config=_tiny_config(vocab_size=1024, tie_word_embeddings=True))
    with torch.no_grad():
        for module in model.model.layers.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(dequantize_weight(*quantize_weight(module.weight)))
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w4a8_runs_the_layers_on_4_bit_blocks_close_to_the_models_dtype(c_ops, tied_model, monkeypatch, dtype):
    """Every layer's four GEMMs on the W4A8 kernel from int8.min_rows rows (qkv, o and down
    through `linear`, gate-up giving int8 blocks; float32 from one row), the LM head on w8a8's int8
    copy; prefill and decode logits close to the unquantized model's; a smaller pass keeps the
    model's GEMMs, bit for bit."""
    plain = _runner(tied_model, dtype=dtype, max_running_requests=48)
    w4 = _runner(tied_model, dtype=dtype, quantization="w4a8", int8_lm_head=True, max_running_requests=48)
    qkv = w4.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.int8, W4Weight) and qkv.int8.packed is not None and qkv.int8_ops.packs
    assert w4.model.lm_head_int8 is not None and not isinstance(w4.model.lm_head_int8, W4Weight)
    calls = []
    real = W4Ops.linear
    monkeypatch.setattr(W4Ops, "linear", lambda self, x, w, **kw: calls.append(x.shape[0]) or real(self, x, w, **kw))
    n = 20
    lens = [3 + i % 6 for i in range(n)]
    logits = prefill_and_step_logits((w4, plain), lens)
    layers = len(w4.model.model.layers)
    # (a float32 model's decode step: the same GEMMs as straight kernel calls, W4DecodePath)
    straight = isinstance(w4.model.decode_path(), W4DecodePath)
    assert straight == (dtype == torch.float32 and w4.model.attn_backend.decode_kernel is not None)
    assert calls == [sum(lens)] * (3 * layers) + ([] if straight else [n] * (3 * layers))
    for got, want in zip(logits[0], logits[1]):
        assert got.dtype == dtype and not torch.equal(got, want)
        assert F.cosine_similarity(got.float(), want.float(), dim=1).min() > 0.99
    layers_only = _runner(tied_model, dtype=dtype, quantization="w4a8")
    assert_fewest_rows_run_quantized(layers_only, plain, calls, int8_mod.min_rows(True, dtype))


@pytest.mark.parametrize("kv_dtype", [None, torch.int8, torch.float8_e5m2])
def test_w4a8_float32_decode_path_gives_the_layers_bits(c_ops, tied_model, monkeypatch, kv_dtype):
    """A float32 w4a8 decode step on W4DecodePath (framework/model/decode_path.py: the layers'
    kernel calls made straight) writes the same KV and gives the same logits, bit for bit, as the
    same step through the layers, whose W4Ops calls it makes none of; a model whose layers it would
    not call alike (a wrapped linear layer, as LoRA makes) keeps the layers."""
    runner = _runner(tied_model, dtype=torch.float32, quantization="w4a8", kv_dtype=kv_dtype)
    model = runner.model
    path = model.decode_path()
    if path is None:
        pytest.skip("no decode attention kernel here")
    assert isinstance(path, W4DecodePath)
    runs, calls = [], []
    real_run, real_linear = W4DecodePath.run, W4Ops.linear
    monkeypatch.setattr(W4DecodePath, "run", lambda self, *a: runs.append(1) or real_run(self, *a))
    monkeypatch.setattr(W4Ops, "linear", lambda self, x, w, **kw: calls.append(x.shape[0]) or real_linear(self, x, w, **kw))
    prompt_lens = [5, 40, 17, 1]
    reqs = _new_reqs(runner, [n + 4 for n in prompt_lens])
    runner.forward(_batch(runner, reqs, prompt_lens, ForwardMode.EXTEND))
    pool = runner.token_to_kv_pool
    layers = len(pool.k_buffer)
    for _ in range(3):
        batch = _batch(runner, reqs, [1] * len(reqs), ForwardMode.DECODE)
        locs = batch.out_cache_loc
        calls.clear()
        fast = runner.forward(batch).next_token_logits.clone()
        assert calls == []
        kv = step_kv(pool, locs)
        model._decode_path = False  # the layers, on the same step (same slots, same inputs)
        slow = runner.forward(batch).next_token_logits
        model.reset_decode_path()
        assert calls == [len(reqs)] * (3 * layers)
        assert torch.equal(fast, slow)
        assert_same_step_kv(pool, kv, locs, kv_dtype)
    assert len(runs) == 3

    layer = model.model.layers[1].mlp
    layer.down_proj = Wrapped(layer.down_proj)
    model.reset_decode_path()
    assert model.decode_path() is None


@pytest.mark.parametrize("rows,d", [(1, 64), (37, 576), (300, 96)])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_quantize_in_one_pass_gives_the_two_calls_bits(c_ops, rows, d, residual):
    """W4Ops.rms_norm_quantize_f32 (kernels/w4_gemm.c's w4_rms_norm_quantize): the fp32 RMSNorm of
    the C kernels (with the residual added first, and written out) then `quantize`, bit for bit;
    `takes_norm_f32` refuses what it does not run."""
    from framework.model.cpu_kernels import load, FusedOps
    from framework.model.llama import RMSNorm

    lib = load("fused_ops")
    if lib is None:
        pytest.skip("the C kernels do not build here")
    norm = RMSNorm(d, 1e-5)
    norm.fused = FusedOps(lib)
    gen = torch.Generator().manual_seed(rows + d)
    norm.weight.data = torch.randn(d, generator=gen) * 0.3 + 1
    x = torch.randn(rows, d + 32, generator=gen)[:, 16:16 + d] * 4  # (rows with a stride past their length)
    res = torch.randn(rows, d, generator=gen) if residual else None
    assert c_ops.takes_norm_f32(x, norm, res)
    got, h = c_ops.rms_norm_quantize_f32(x, norm, res)
    if residual:
        normed, want_h = norm.add_and_norm(x.contiguous(), res)
    else:
        normed, want_h = norm(x), x
    want = c_ops.quantize(normed)
    assert torch.equal(h, want_h) and torch.equal(got.q, want.q)
    assert torch.equal(got.scale, want.scale) and torch.equal(got.sum, want.sum)
    assert not c_ops.takes_norm_f32(x.bfloat16(), norm) and not c_ops.takes_norm_f32(torch.zeros(2, 48), norm)
    assert not c_ops.takes_norm_f32(x, norm, torch.zeros(rows + 1, d))
    plain = RMSNorm(d, 1e-5)  # (no C kernels: its own PyTorch values)
    assert not c_ops.takes_norm_f32(x, plain)


def test_w4a8_without_the_c_kernels_gives_the_kernels_logits_closely(tied_model):
    """worker.cpu_kernels = off: the same quantized operands multiplied in PyTorch."""
    torch_runner = _runner(tied_model, dtype=torch.float32, quantization="w4a8", cpu_kernels="off")
    assert torch_runner.model.model.layers[0].int8_ops.lib is None
    kernel_runner = _runner(tied_model, dtype=torch.float32, quantization="w4a8")
    if kernel_runner.model.model.layers[0].int8_ops.lib is None:
        pytest.skip("kernels/w4_gemm.c does not build here")
    a, b = _prefill_logits(torch_runner, [30, 12]), _prefill_logits(kernel_runner, [30, 12])
    assert F.cosine_similarity(a, b, dim=1).min() > 0.9999


def test_w4a8_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="'w4a8' runs on the CPU"):
        _runner(_tiny_hf(), dtype=torch.float32, quantization="w4a8", device="meta")


def test_quantize_takes_rows_of_any_layout_and_float_dtype(c_ops):
    x = _rows(6, 64)
    want = quantize_blocks(x)
    assert torch.equal(c_ops.quantize(x.t().contiguous().t()).q, want.q)  # (column-major rows)
    plain = x[:-1]  # (not the outlier row: fp16 has no room for it)
    assert torch.equal(c_ops.quantize(plain.half()).q, quantize_blocks(plain.half().float()).q)


def test_w4a8_without_its_kernel_says_it_runs_slowly(tied_model, caplog):
    with caplog.at_level("WARNING", logger="framework.model.runner"):
        runner = _runner(tied_model, dtype=torch.float32, quantization="w4a8", cpu_kernels="off")
    assert not runner.model.model.layers[0].int8_ops.packs
    assert "without kernels/w4_gemm.c" in caplog.text and "slower than model.quantization = 'none'" in caplog.text
