"""model.quantization = "w8a8": int8 GEMMs in the layers (framework/model/int8.py, kernels/int8_ops.c)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from framework.batch import ForwardMode
from framework.model import int8 as int8_mod
from framework.model.int8 import Int8Ops, QuantizedRows, quantize_weight, rescore_head_top
from framework.model.runner import ModelRunner
from tests.conftest import count_int_mm_rows, needs_exact_int_mm
from tests.test_model import _batch, _new_reqs, _runner, _tiny_config, _tiny_hf

TORCH_OPS = Int8Ops(None)


@pytest.fixture(scope="module")
def c_ops() -> Int8Ops:
    ops = Int8Ops.load()
    if ops.lib is None:
        pytest.skip("the int8 kernels do not build here (no C compiler)")
    return ops


def _rows(rows: int, width: int, seed: int = 0) -> torch.Tensor:
    """bf16 rows of different magnitudes, the first all zeros."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=gen) * torch.logspace(-2, 2, rows)[:, None]
    x[0] = 0
    return x.bfloat16()


# (176: two of max_abs_f32's four-chain steps, then three vectors on their own)
SHAPES = [(1, 64), (5, 100), (3, 176), (37, 576), (200, 1536)]


def _mul(width: int, seed: int = 11) -> torch.Tensor:
    """A smoothing multiplier (a weight's `inv`): positive, a few orders of magnitude apart."""
    return torch.logspace(-1, 1, width)[torch.randperm(width, generator=torch.Generator().manual_seed(seed))]


@pytest.mark.parametrize("rows,width", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantized_rows_are_within_half_a_step_and_match_pytorch(c_ops, rows, width, dtype):
    x = _rows(rows, width).to(dtype)
    kept = x.clone()
    got, want = c_ops.quantize(x), TORCH_OPS.quantize(x)
    assert torch.equal(got.q, want.q) and torch.equal(got.scale, want.scale)
    mul = _mul(width)
    smoothed, want_smoothed = c_ops.quantize(x, mul), TORCH_OPS.quantize(x, mul)
    assert torch.equal(smoothed.q, want_smoothed.q) and torch.equal(smoothed.scale, want_smoothed.scale)
    assert not torch.equal(smoothed.q, got.q) or rows == 1
    err = (smoothed.q.float() * smoothed.scale[:, None] - x.float() * mul).abs()
    assert (err <= smoothed.scale[:, None] * 0.5001 + 1e-30).all()
    assert got.scale[0] == 0 and not got.q[0].any()  # a row of zeros
    if rows > 1:
        assert (got.q[1:].abs().amax(dim=1) == 127).all()  # each row's largest value is +-127
    err = (got.q.float() * got.scale[:, None] - x.float()).abs()
    assert (err <= got.scale[:, None] * 0.5001 + 1e-30).all()
    assert torch.equal(x, kept)  # (the rows are read, not changed)


@pytest.mark.parametrize("rows,width", SHAPES)
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_quantize_quantizes_the_norm(c_ops, rows, width, residual):
    x, res = _rows(rows, width, 1), _rows(rows, width, 2) if residual else None
    weight = (torch.rand(width) + 0.5).bfloat16()
    mul = _mul(width)
    (q, scale), h = c_ops.rms_norm_quantize(x, weight, 1e-5, res, mul=mul)
    (q_ref, scale_ref), h_ref = TORCH_OPS.rms_norm_quantize(x, weight, 1e-5, res, mul=mul)
    assert torch.equal(h, h_ref)
    if residual:
        assert torch.equal(h, (x.float() + res.float()).bfloat16())
    assert torch.allclose(scale, scale_ref, rtol=1e-5, atol=0)
    assert (q.int() - q_ref.int()).abs().max() <= 1  # (a sum's order can move a value across a .5)
    normed = F.rms_norm(h.float(), (width,), weight.float(), 1e-5) * mul
    assert ((q.float() * scale[:, None] - normed).abs() <= scale[:, None] * 0.51 + 1e-6).all()


def test_rms_norm_quantize_refuses_fp32_rows():
    """In fp32 the layers run the model's RMSNorm, then quantize: the bf16 op says so rather than
    rounding the residual to bf16."""
    x = torch.randn(3, 64)
    for ops in (TORCH_OPS, Int8Ops(None, torch.float32)):
        with pytest.raises(ValueError, match="bf16 rows.*RMSNorm, then quantize"):
            ops.rms_norm_quantize(x, torch.ones(64), 1e-5)


@needs_exact_int_mm
@pytest.mark.parametrize("rows,width,n", [(2, 64, 48), (37, 576, 960), (200, 1536, 576)])
@pytest.mark.parametrize("add", [False, True])
def test_int8_linear_dequantizes_as_pytorch_and_is_close_to_the_product(c_ops, rows, width, n, add):
    x = _rows(rows, width, 3)
    w = (torch.randn(n, width, generator=torch.Generator().manual_seed(4)) * 0.05).bfloat16()
    w8 = quantize_weight(w)
    other = _rows(rows, n, 5) if add else None
    got = c_ops.linear(c_ops.quantize(x), w8, add=other)
    want = TORCH_OPS.linear(TORCH_OPS.quantize(x), w8, add=other)
    assert got.dtype == torch.bfloat16
    if add:  # (the kernel may fuse the scaling and the add into one rounding: one bf16 step apart at most)
        assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-7 + 1e-30).all()
    else:
        assert torch.equal(got, want)
    # into rows of a larger tensor
    big = torch.zeros(rows, n + 16, dtype=torch.bfloat16)
    c_ops.linear(c_ops.quantize(x), w8, add=other, out=big[:, 8 : 8 + n])
    assert torch.equal(big[:, 8 : 8 + n], got) and not big[:, :8].any() and not big[:, 8 + n :].any()
    exact = x.float() @ w.float().T + (other.float() if add else 0)
    assert ((got.float() - exact).norm() / exact.norm()) < 0.02


@needs_exact_int_mm
@pytest.mark.parametrize("rows", [2, 37, 200])
def test_gate_up_quantizes_silu_gate_times_up(c_ops, rows):
    x, d = _rows(rows, 576, 6), 256
    w = (torch.randn(2 * d, 576, generator=torch.Generator().manual_seed(7)) * 0.05).bfloat16()
    w8 = quantize_weight(w)
    mul = _mul(d)
    got = c_ops.gate_up(c_ops.quantize(x), w8, mul=mul)
    want = TORCH_OPS.gate_up(TORCH_OPS.quantize(x), w8, mul=mul)
    assert got.q.shape == (rows, d) and torch.allclose(got.scale, want.scale, rtol=1e-5, atol=0)
    assert (got.q.int() - want.q.int()).abs().max() <= 1
    gate, up = (x.float() @ w.float().T).split(d, dim=1)
    exact = F.silu(gate) * up * mul
    assert ((got.q.float() * got.scale[:, None] - exact).norm() / exact[1:].norm()) < 0.03


@needs_exact_int_mm
def test_smoothing_moves_an_outlier_channels_range_into_the_weight():
    """quantize_weight with smoothing factors s: the weight times s is what is quantized, and the
    inputs times 1 / s (`inv`) give the same product; an input channel 100x the others gets the
    smaller factor, and the int8 product of such inputs is closer to the exact one."""
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(64, 96, generator=gen)
    x[:, 7] *= 100  # an outlier channel
    w = (torch.randn(80, 96, generator=gen) * 0.05).bfloat16()
    s = int8_mod.smoothing(x.abs().amax(dim=0), w)
    assert s.shape == (96,) and (s > 0).all() and s[7] == s.max()
    w8 = quantize_weight(w, s)
    assert torch.allclose(w8.inv, 1 / s)
    back = w8.q.float().T * w8.scale[:, None] / s[None, :]
    assert ((back - w.float()).abs() <= (w8.scale[:, None] / s[None, :]) * 0.5001).all()
    exact = x @ w.float().T
    errors = {}
    for name, weight in (("plain", quantize_weight(w)), ("smoothed", w8)):
        y = TORCH_OPS.linear(TORCH_OPS.quantize(x.bfloat16(), weight.inv), weight).float()
        errors[name] = ((y - exact).norm() / exact.norm()).item()
    assert errors["smoothed"] < 0.5 * errors["plain"], errors


def test_calibration_measures_each_gemms_input_range(hf_model):
    """input_maxima: per layer and GEMM the channels' largest |input|, as transformers' layers
    give them for the same random ids (qkv's input is the input norm's output, and so on), and
    the LM head's (the final norm's output)."""
    runner = _runner(hf_model, dtype=torch.float32)
    maxima, head = int8_mod.input_maxima(runner.model, sequences=2, tokens=24, seed=3)
    cfg = hf_model.config
    want = [[None] * 4 for _ in range(cfg.num_hidden_layers)]
    want_head = []
    hooks = []
    for i, layer in enumerate(hf_model.model.layers):
        for part, module in enumerate((layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.gate_proj,
                                       layer.mlp.down_proj)):
            def seen(mod, args, out, i=i, part=part):
                m = args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(dim=0)
                want[i][part] = m if want[i][part] is None else torch.maximum(want[i][part], m)
            hooks.append(module.register_forward_hook(seen))
    hooks.append(hf_model.lm_head.register_forward_hook(
        lambda mod, args, out: want_head.append(args[0].detach().abs().reshape(-1, args[0].shape[-1]).amax(dim=0))))
    gen = torch.Generator().manual_seed(3)
    try:
        with torch.no_grad():
            for _ in range(2):
                hf_model(torch.randint(0, runner.model.model.embed_tokens.weight.shape[0], (24,), generator=gen)[None])
    finally:
        for hook in hooks:
            hook.remove()
    assert len(maxima) == cfg.num_hidden_layers
    for got_layer, want_layer in zip(maxima, want):
        for got, expected in zip(got_layer, want_layer):
            assert torch.allclose(got, expected, rtol=1e-4, atol=1e-5)
    assert len(want_head) == 2 and torch.allclose(head, torch.maximum(*want_head), rtol=1e-4, atol=1e-5)


def test_weights_are_quantized_per_output_column():
    w = torch.randn(48, 64) * torch.logspace(-3, 1, 48)[:, None]
    w[5] = 0
    w8 = quantize_weight(w.bfloat16())
    assert w8.q.shape == (64, 48) and w8.q.dtype == torch.int8 and w8.q.is_contiguous()
    assert w8.scale[5] == 0 and not w8.q[:, 5].any()
    back = w8.q.float().T * w8.scale[:, None]
    assert ((back - w.bfloat16().float()).abs() <= w8.scale[:, None] * 0.5001 + 1e-30).all()
    assert torch.equal(w8.scale, w.bfloat16().float().abs().amax(dim=1) / 127)


@pytest.fixture(scope="module")
def hf_model():
    return _tiny_hf()


def _prefill_logits(runner, lens):
    reqs = _new_reqs(runner, lens, seed=5)
    return runner.forward(_batch(runner, reqs, lens, ForwardMode.EXTEND)).next_token_logits.clone()


def prefill_and_step_logits(runners, lens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """On each runner, the same requests' prefill of `lens` tokens, then one decode step: the
    logits of both passes."""
    logits = []
    for runner in runners:
        reqs = _new_reqs(runner, [k + 2 for k in lens], seed=3)
        prefill = runner.forward(_batch(runner, reqs, lens, ForwardMode.EXTEND)).next_token_logits.clone()
        step = runner.forward(_batch(runner, reqs, [1] * len(lens), ForwardMode.DECODE)).next_token_logits.clone()
        logits.append((prefill, step))
    return logits


@needs_exact_int_mm
def test_w8a8_prefill_runs_on_int8_gemms_close_to_bf16(hf_model, monkeypatch):
    """A pass of >= MIN_ROWS rows: every layer's four GEMMs on torch._int_mm (held to it here; the
    own kernel gives its bits, below), logits close to bf16's; a smaller pass keeps the bf16 GEMMs."""
    monkeypatch.setenv(int8_mod.INT8_GEMM_ENV, "onednn")
    bf16 = _runner(hf_model, dtype=torch.bfloat16)
    w8 = _runner(hf_model, dtype=torch.bfloat16, quantization="w8a8")
    layers = len(w8.model.model.layers)
    calls = count_int_mm_rows(monkeypatch)
    lens = [30, 12, 7]
    got = _prefill_logits(w8, lens)
    assert calls == [sum(lens)] * (4 * layers)
    want = _prefill_logits(bf16, lens)
    assert not torch.equal(got, want)
    cos = F.cosine_similarity(got.float(), want.float(), dim=1)
    assert cos.min() > 0.99, cos
    calls.clear()
    _prefill_logits(w8, [int8_mod.MIN_ROWS - 1])
    assert calls == []


@needs_exact_int_mm
@pytest.mark.parametrize("gemm", ["onednn", "auto"])
def test_w8a8_decode_steps_on_the_decode_path_give_the_layers_bits(hf_model, monkeypatch, gemm):
    """A decode step of >= min_rows requests on the decode path (straight kernel calls) runs the
    same int8 arithmetic as the layers, bit for bit, on torch._int_mm or the own kernel; a smaller
    step keeps the bf16 weights."""
    monkeypatch.setenv(int8_mod.INT8_GEMM_ENV, gemm)
    runners = [_runner(hf_model, dtype=torch.bfloat16, quantization="w8a8", max_running_requests=48)
               for _ in range(2)]
    path = runners[0].model.decode_path()
    if path is None:
        pytest.skip("no decode path here (no C kernels, or no AVX512-BF16 for the packed GEMMs)")
    own = runners[0].model.model.layers[0].mlp.int8_ops.packs
    assert own == (gemm == "auto" and int8_mod.own_gemm_wanted())
    assert path.int8_rows == int8_mod.min_rows(own) == (8 if own else 32)
    runners[1].model.decode_path = lambda: None  # the layers, as any model without the path
    n = path.int8_rows + 3
    lens = [3 + i % 5 for i in range(n)]
    calls = count_int_mm_rows(monkeypatch)
    runs = []
    for runner in runners:
        reqs = _new_reqs(runner, [k + 2 for k in lens], seed=9)
        runner.forward(_batch(runner, reqs, lens, ForwardMode.EXTEND))
        step = runner.forward(_batch(runner, reqs, [1] * n, ForwardMode.DECODE)).next_token_logits.clone()
        calls.clear()
        small = runner.forward(_batch(runner, reqs[:3], [1] * 3, ForwardMode.DECODE)).next_token_logits.clone()
        runs.append((step, small, list(calls)))
    assert torch.equal(runs[0][0], runs[1][0])
    assert torch.equal(runs[0][1], runs[1][1]) and runs[0][2] == runs[1][2] == []


@pytest.fixture(scope="module")
def tied_model():
    """The tiny model with tied embeddings (as SmolLM2: the LM head is the embedding) and a
    vocabulary the own int8 GEMM takes (columns in 16s)."""
    return _tiny_hf(config=_tiny_config(vocab_size=1024, tie_word_embeddings=True))


@needs_exact_int_mm
@pytest.mark.parametrize("gemm", ["onednn", "auto"])
def test_int8_lm_head_takes_the_logits(tied_model, monkeypatch, gemm):
    """model.int8_lm_head: the LM head gets a smoothed int8 copy, and a pass of >= min_rows rows
    takes its logits from the int8 GEMM (the bits of Int8Ops.linear on the quantized rows), close
    to the bf16 head's; a smaller pass keeps the bf16 head on torch._int_mm, and takes the int8 one
    on the own kernel too (its bytes, half bf16's, win there). Without the setting there is no copy."""
    monkeypatch.setenv(int8_mod.INT8_GEMM_ENV, gemm)
    hf_model = tied_model
    w8 = _runner(hf_model, dtype=torch.bfloat16, quantization="w8a8", max_running_requests=48)
    head = _runner(hf_model, dtype=torch.bfloat16, quantization="w8a8", int8_lm_head=True, max_running_requests=48)
    assert w8.model.lm_head_int8 is None and w8.model.lm_head_int8_ops is None
    h8, ops = head.model.lm_head_int8, head.model.lm_head_int8_ops
    vocab, width = head.model.lm_head_weight.shape
    assert h8 is not None and h8.out_features == vocab and h8.inv is not None and h8.inv.shape == (width,)
    own = h8.packed is not None
    assert own == ops.packs
    rows = int8_mod.min_rows(own)
    hidden = torch.randn(rows, width, generator=torch.Generator().manual_seed(2)).bfloat16()
    fused, weight = head.model.kernels.fused if head.model.kernels else None, head.model.lm_head_weight

    def int8_head(x):  # the int8 GEMM's logits, the columns near each row's top then recomputed in bf16
        logits = ops.linear(ops.quantize(x, h8.inv), h8)
        rescore_head_top(logits, x, weight, fused)
        return logits

    got = head.model.compute_logits(hidden)
    assert torch.equal(got, int8_head(hidden))
    bf16 = w8.model.compute_logits(hidden)
    assert not torch.equal(got, bf16)
    assert F.cosine_similarity(got.float(), bf16.float(), dim=1).min() > 0.99
    assert torch.equal(got.argmax(dim=1), bf16.argmax(dim=1))  # greedy rows: the bf16 head's tokens
    few = head.model.compute_logits(hidden[:1])
    if own:
        assert torch.equal(few, int8_head(hidden[:1])) and not torch.equal(few, bf16[:1])
    else:
        assert torch.equal(head.model.compute_logits(hidden[: rows - 1]), bf16[: rows - 1])
    # through a forward pass: one next-token row per request, so `rows` requests take the int8 head
    lens = [4 + i % 3 for i in range(rows)]
    got, want = _prefill_logits(head, lens), _prefill_logits(w8, lens)
    assert not torch.equal(got, want)
    assert F.cosine_similarity(got.float(), want.float(), dim=1).min() > 0.99


@needs_exact_int_mm
def test_int8_lm_head_under_a_grammar_gives_the_bf16_heads_greedy_tokens(make_engine):
    """A grammar mask can take out every column the int8 head recomputed in bf16 (a regex of digits,
    far below the row's top): those near the largest allowed value get the bf16 head's values too,
    so greedy outputs under the grammar are the bf16 head's (model.int8_lm_head = false) as well."""
    params = {"max_new_tokens": 12, "temperature": 0, "regex": "[0-9]{12}"}
    prompts = [f"Hello number {i}, tell me" for i in range(24)]
    texts = {}
    for head in (True, False):  # (True: "auto" keeps a bf16 head on AMX tiles)
        engine = make_engine(model={"dtype": "bfloat16", "quantization": "w8a8", "int8_lm_head": head})
        assert (engine.scheduler.worker.runner.model.lm_head_int8 is not None) is head
        texts[head] = [o["text"] for o in engine.generate(prompts, sampling_params=params)]
    assert all(len(t) == 12 and t.isdigit() for t in texts[False])
    assert texts[True] == texts[False]


def test_int8_lm_head_under_a_grammar_and_penalties_gives_the_bf16_heads_greedy_tokens(make_engine):
    """The same with penalties on top of the grammar (a repetition penalty; min_new_tokens past the
    grammar's end, where the grammar wins): the recomputed columns are chosen from the logits the
    sampler chooses from (Sampler.processed)."""
    params = {"max_new_tokens": 8, "min_new_tokens": 6, "temperature": 0, "regex": "[0-9]{4}",
              "repetition_penalty": 1.3}
    prompts = [f"Hello number {i}, tell me" for i in range(16)]
    texts = {}
    for head in (True, False):  # (True: "auto" keeps a bf16 head on AMX tiles)
        engine = make_engine(model={"dtype": "bfloat16", "quantization": "w8a8", "int8_lm_head": head})
        assert (engine.scheduler.worker.runner.model.lm_head_int8 is not None) is head
        texts[head] = [o["text"] for o in engine.generate(prompts, sampling_params=params)]
    assert all(len(t) == 4 and t.isdigit() for t in texts[False])
    assert texts[True] == texts[False]


@needs_exact_int_mm
def test_embedding_models_get_no_int8_lm_head(tiny_embedding_folder):
    """A decoder without LM head never runs one: w8a8 (int8_lm_head auto, on) makes no int8 copy of
    its embedding table for it; the layers still go int8."""
    runner = ModelRunner(tiny_embedding_folder, dtype=torch.bfloat16, max_total_tokens=512, quantization="w8a8",
                         int8_lm_head=True)
    assert runner.model_config.is_embedding
    assert runner.model.lm_head_int8 is None and runner.model.lm_head_int8_ops is None
    assert runner.model.model.layers[0].self_attn.qkv_proj.int8 is not None


def test_int8_lm_head_needs_w8a8(hf_model):
    with pytest.raises(ValueError, match="int8_lm_head.*'none'"):
        _runner(hf_model, dtype=torch.bfloat16, int8_lm_head=True)
    with pytest.raises(ValueError, match="int8_lm_head must be true, false or 'auto', got 'yes'"):
        _runner(hf_model, dtype=torch.bfloat16, quantization="w8a8", int8_lm_head="yes")


@needs_exact_int_mm
def test_auto_int8_lm_head_keeps_a_bf16_head_on_amx_tiles(tied_model, monkeypatch):
    """model.int8_lm_head = "auto" (the runner's "auto"): the int8 head with w8a8, except for a bf16
    model whose head runs on the packed GEMM's AMX tiles; a float32 model is never on them."""
    for on_tiles in (False, True):
        monkeypatch.setattr(ModelRunner, "_bf16_head_on_tiles", lambda self, on=on_tiles: on)
        runner = _runner(tied_model, dtype=torch.bfloat16, quantization="w8a8", int8_lm_head="auto")
        assert runner.int8_lm_head is (not on_tiles)
        assert (runner.model.lm_head_int8 is not None) is (not on_tiles)
    monkeypatch.undo()
    f32 = _runner(tied_model, dtype=torch.float32, quantization="w8a8", int8_lm_head="auto")
    assert not f32._bf16_head_on_tiles() and f32.int8_lm_head is True
    assert _runner(tied_model, dtype=torch.bfloat16, int8_lm_head="auto").int8_lm_head is False  # (no quantization)


@needs_exact_int_mm
def test_the_pytorch_ends_give_what_the_kernels_give(hf_model, monkeypatch):
    """Without the C kernels (no compiler) the int8 path runs in PyTorch, to the same logits up
    to the SiLU's exp and a sum's order."""
    c = _runner(hf_model, dtype=torch.bfloat16, quantization="w8a8")
    if c.model.model.layers[0].int8_ops.lib is None:
        pytest.skip("the int8 kernels do not build here")
    monkeypatch.setattr(Int8Ops, "load", classmethod(lambda cls, dtype=torch.bfloat16, tiles=True: cls(None, dtype)))
    pt = _runner(hf_model, dtype=torch.bfloat16, quantization="w8a8")
    assert pt.model.model.layers[0].int8_ops.lib is None
    lens = [30, 12, 7]
    got, want = _prefill_logits(c, lens), _prefill_logits(pt, lens)
    assert F.cosine_similarity(got.float(), want.float(), dim=1).min() > 0.999


@pytest.fixture(scope="module")
def packing_ops() -> Int8Ops:
    """Int8Ops that pack weights for the own GEMM wherever it is built (AVX512-VNNI, or AVX2 and
    FMA), AMX CPUs included, where the engine leaves the GEMMs to oneDNN (own_gemm_wanted) but the
    kernel runs."""
    ops = Int8Ops.load()
    if ops.lib is None or ops.lib.int8_gemm_packed_bytes(4, 16, 0) <= 0:
        pytest.skip("the own int8 GEMM is not built here (no AVX512-VNNI, nor AVX2 and FMA)")
    ops.packs = True
    return ops


@pytest.fixture(scope="module")
def packing_ops_f32(packing_ops) -> Int8Ops:
    """The same for fp32 activations (models in float32)."""
    ops = Int8Ops(packing_ops.lib, torch.float32)
    ops.packs = True
    return ops


@needs_exact_int_mm
@pytest.mark.parametrize("rows", [1, 5, 7, 32, 200, 1400])
@pytest.mark.parametrize("width,n", [(576, 960), (1536, 576), (64, 48), (8, 80)])
@pytest.mark.parametrize("add", [False, True])
def test_own_int8_gemm_gives_int_mm_and_the_ends_bits(packing_ops, rows, width, n, add):
    """kernels/int8_ops.c's GEMM on the packed weight: the bits of torch._int_mm then dequantize,
    at every row count (micro-tiles of 6 and their rest, panels of x) and width (a unit's missing
    blocks: 48 and 80 columns), into rows of a larger tensor too."""
    ops = packing_ops
    x = ops.quantize(_rows(rows, width, 3))
    w8 = quantize_weight((torch.randn(n, width, generator=torch.Generator().manual_seed(4)) * 0.05).bfloat16())
    packed = ops.pack(dataclasses.replace(w8))  # the same int8 weight, with its packed copy
    assert packed.packed is not None and w8.packed is None
    other = _rows(rows, n, 5) if add else None
    want = ops.linear(x, w8, add=other)
    big = torch.zeros(rows, n + 16, dtype=torch.bfloat16)
    got = ops.linear(x, packed, add=other, out=big[:, 8 : 8 + n])
    assert torch.equal(got, want) and not big[:, :8].any() and not big[:, 8 + n :].any()


@needs_exact_int_mm
@pytest.mark.parametrize("rows", [1, 5, 37, 200])
@pytest.mark.parametrize("width,n", [(576, 960), (64, 48), (8, 80)])
def test_own_int8_gemm_in_fp32_gives_int_mm_times_the_scales(packing_ops_f32, rows, width, n):
    """For float32 models (int8_gemm_f32): the int32 sums times x_scale * w_scale in fp32, the
    values of torch._int_mm's sums scaled in PyTorch, bit for bit; with an fp32 add, that add in the
    same rounding (fused: within one rounding of PyTorch's product-then-sum); into rows of a larger
    tensor too."""
    ops = packing_ops_f32
    x = ops.quantize(_rows(rows, width, 3).float() * 7)
    w8 = quantize_weight(torch.randn(n, width, generator=torch.Generator().manual_seed(4)) * 0.05)
    packed = ops.pack(dataclasses.replace(w8))
    assert packed.packed is not None
    got, want = ops.linear(x, packed), ops.linear(x, w8)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    other = torch.randn(rows, n, generator=torch.Generator().manual_seed(5))
    big = torch.zeros(rows, n + 16)
    fused = ops.linear(x, packed, add=other, out=big[:, 8 : 8 + n])
    assert fused.data_ptr() == big[:, 8:].data_ptr() and not big[:, :8].any() and not big[:, 8 + n :].any()
    separate = ops.linear(x, w8, add=other)
    assert ((fused - separate).abs() <= (want.abs() + separate.abs()) * 2**-23).all()
    assert not torch.equal(fused, want)  # (the add is there)


@needs_exact_int_mm
@pytest.mark.parametrize("rows", [1, 7, 37, 200, 256, 601])
@pytest.mark.parametrize("d", [256, 48])
def test_own_int8_gemm_gate_up_gives_int_mm_and_the_ends_bits(packing_ops, rows, d):
    """The packed gate-up GEMM's int8 rows are torch._int_mm's then silu_mul_quantize's, at every
    row count: blocks of gate_up_block rows (256) and their rest included."""
    ops = packing_ops
    assert ops.gate_up_block == 256
    x = ops.quantize(_rows(rows, 576, 6))
    w = (torch.randn(2 * d, 576, generator=torch.Generator().manual_seed(7)) * 0.05).bfloat16()
    w8 = quantize_weight(w)
    packed = ops.pack(dataclasses.replace(w8), gate_up=True)
    assert packed.packed is not None and packed.gate_up
    mul = _mul(d)
    got, want = ops.gate_up(x, packed, mul=mul), ops.gate_up(x, w8, mul=mul)
    assert torch.equal(got.q, want.q) and torch.equal(got.scale, want.scale)


@pytest.mark.parametrize("rows", [32, 45, 200, 300])
def test_own_int8_gemm_on_the_amx_tiles_gives_the_vectors_bits(packing_ops, packing_ops_f32, rows):
    """Where the own GEMM has AMX-INT8 tiles (int8_gemm_tiles), a pass's rows go 32 at a time on
    them where k is in 64s, the rest on the vectors: every end (bf16 with an add, fp32, gate-up's
    int8 rows) gives the bits of the vectors alone, missing blocks of a unit included."""
    lib = packing_ops.lib
    if not lib.int8_gemm_tiles(-1):
        pytest.skip("the own int8 GEMM has no AMX-INT8 tiles here")
    gen = torch.Generator().manual_seed(9)
    cases = []
    for width, n in [(576, 960), (1536, 576), (64, 48), (8, 80)]:
        x = packing_ops.quantize(_rows(rows, width, 3))
        w8 = packing_ops.pack(quantize_weight((torch.randn(n, width, generator=gen) * 0.05).bfloat16()))
        cases.append((x, w8, _rows(rows, n, 5), packing_ops_f32.quantize(_rows(rows, width, 4).float())))
    up = packing_ops.pack(quantize_weight((torch.randn(512, 576, generator=gen) * 0.05).bfloat16()), gate_up=True)
    x_up = packing_ops.quantize(_rows(rows, 576, 6))

    def products():
        out = []
        for x, w8, other, xf in cases:
            out += [packing_ops.linear(x, w8, add=other), packing_ops_f32.linear(xf, w8)]
        made = packing_ops.gate_up(x_up, up, mul=_mul(256))
        return out + [made.q, made.scale]

    try:
        on = products()
        assert not lib.int8_gemm_tiles(0)
        off = products()
    finally:
        lib.int8_gemm_tiles(1)
    assert all(torch.equal(a, b) for a, b in zip(on, off))


@needs_exact_int_mm
@pytest.mark.parametrize("rows", [7, 300])
def test_own_int8_gemm_gate_up_may_write_over_its_input(packing_ops, rows):
    """The decode path writes the gate-up GEMM's int8 rows over its input rows (a larger buffer:
    rows x d over rows x 576): then all rows go at once, into a scratch of every row, and the bits
    are those of separate buffers, past a block's rows too."""
    ops, d = packing_ops, 768
    x = ops.quantize(_rows(rows, 576, 8))
    w8 = quantize_weight((torch.randn(2 * d, 576, generator=torch.Generator().manual_seed(9)) * 0.05).bfloat16())
    packed = ops.pack(dataclasses.replace(w8), gate_up=True)
    mul = _mul(d)
    want = ops.gate_up(x, packed, mul=mul)
    buf = torch.zeros(rows * d, dtype=torch.int8)  # x's rows at its start, then room for the output's
    buf[: rows * 576].copy_(x.q.flatten())
    scale = x.scale.clone()
    h = torch.empty((rows, d), dtype=torch.float32)
    rc = ops._gemm_gate_up(buf.data_ptr(), scale.data_ptr(), packed.packed.data_ptr(), packed.scale.data_ptr(), rows,
                           576, d, mul.data_ptr(), h.data_ptr(), buf.data_ptr(), scale.data_ptr(), 1)
    assert rc == 0
    assert torch.equal(buf.view(rows, d), want.q) and torch.equal(scale, want.scale)


@needs_exact_int_mm
def test_w8a8_on_the_own_gemm_gives_the_int_mm_logits(hf_model, monkeypatch, packing_ops):
    """The whole model in w8a8, prefill on the layers and a decode step on the decode path: the own
    GEMM's logits are torch._int_mm's, bit for bit, and it makes no torch._int_mm call."""
    monkeypatch.delenv(int8_mod.INT8_GEMM_ENV, raising=False)
    if not int8_mod.own_gemm_wanted():
        pytest.skip("the engine keeps torch._int_mm on this CPU (AMX, or no AVX512-VNNI)")
    runs = []
    for gemm in ("onednn", "auto"):
        monkeypatch.setenv(int8_mod.INT8_GEMM_ENV, gemm)
        runner = _runner(hf_model, dtype=torch.bfloat16, quantization="w8a8", max_running_requests=48)
        qkv = runner.model.model.layers[0].self_attn.qkv_proj.int8
        assert (qkv.packed is not None) == (gemm == "auto")
        calls = count_int_mm_rows(monkeypatch)
        n = int8_mod.MIN_ROWS + 5  # (int8 on either GEMM)
        lens = [3 + i % 7 for i in range(n)]
        reqs = _new_reqs(runner, [k + 2 for k in lens], seed=3)
        prefill = runner.forward(_batch(runner, reqs, lens, ForwardMode.EXTEND)).next_token_logits.clone()
        step = runner.forward(_batch(runner, reqs, [1] * n, ForwardMode.DECODE)).next_token_logits.clone()
        runs.append((prefill, step, len(calls)))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert runs[0][2] > 0 and runs[1][2] == 0


@needs_exact_int_mm
def test_the_own_gemm_takes_passes_from_8_rows(hf_model, monkeypatch):
    """On the own kernel, passes of MIN_ROWS_OWN_GEMM rows or more run in int8 (on torch._int_mm
    from MIN_ROWS: there smaller passes were slower than the bf16 weights), logits close to bf16's;
    a pass of fewer keeps the bf16 weights."""
    monkeypatch.delenv(int8_mod.INT8_GEMM_ENV, raising=False)
    if not int8_mod.own_gemm_wanted():
        pytest.skip("the engine keeps torch._int_mm on this CPU (AMX, or no AVX512-VNNI)")
    w8 = _runner(hf_model, dtype=torch.bfloat16, quantization="w8a8")
    bf16 = _runner(hf_model, dtype=torch.bfloat16)
    calls = []
    real = Int8Ops.linear
    monkeypatch.setattr(Int8Ops, "linear", lambda self, x, w, **kw: calls.append(x.shape[0]) or real(self, x, w, **kw))
    lens = [5, 3]  # 8 rows
    got, want = _prefill_logits(w8, lens), _prefill_logits(bf16, lens)
    assert calls and set(calls) == {8}
    assert not torch.equal(got, want) and F.cosine_similarity(got.float(), want.float(), dim=1).min() > 0.99
    calls.clear()
    assert torch.equal(_prefill_logits(w8, [4, 3]), _prefill_logits(bf16, [4, 3])) and calls == []


@needs_exact_int_mm
def test_w8a8_in_float32_runs_int8_gemms_close_to_float32(tied_model, monkeypatch):
    """A float32 model in w8a8 (the AVX2 CPUs' way, where bf16 is slow): fp32 rows quantized as they
    are made, every layer's four GEMMs and the LM head in int8 on the own kernel where it is wanted,
    their outputs fp32; prefill and decode logits close to float32's; a pass of fewer rows than
    min_rows keeps the float32 GEMMs, bit for bit."""
    monkeypatch.delenv(int8_mod.INT8_GEMM_ENV, raising=False)
    fp32 = _runner(tied_model, dtype=torch.float32, max_running_requests=48)
    w8 = _runner(tied_model, dtype=torch.float32, quantization="w8a8", int8_lm_head=True, max_running_requests=48)
    own = int8_mod.own_gemm_wanted() and w8.model.model.layers[0].int8_ops.lib is not None
    qkv = w8.model.model.layers[0].self_attn.qkv_proj
    assert qkv.int8 is not None and (qkv.int8.packed is not None) == own
    assert w8.model.lm_head_int8 is not None and w8.model.lm_head_int8_ops.dtype == torch.float32
    calls = []
    real = Int8Ops.linear
    monkeypatch.setattr(Int8Ops, "linear", lambda self, x, w, **kw: calls.append(x.shape[0]) or real(self, x, w, **kw))
    int_mm = count_int_mm_rows(monkeypatch)
    n = int8_mod.MIN_ROWS + 3
    lens = [3 + i % 6 for i in range(n)]
    logits = prefill_and_step_logits((w8, fp32), lens)
    layers = len(w8.model.model.layers)
    # per pass: qkv, o, down per layer (gate-up gives int8 rows) and the LM head
    assert calls == [sum(lens)] * (3 * layers) + [n] + [n] * (3 * layers) + [n]
    assert (int_mm == []) == own
    for got, want in zip(logits[0], logits[1]):
        assert got.dtype == torch.float32 and not torch.equal(got, want)
        assert F.cosine_similarity(got, want, dim=1).min() > 0.99
    layers_only = _runner(tied_model, dtype=torch.float32, quantization="w8a8")  # (no int8 head: it takes every pass)
    assert_fewest_rows_run_quantized(layers_only, fp32, calls, int8_mod.min_rows(own, torch.float32))


def assert_fewest_rows_run_quantized(quantized, plain, calls: list[int], fewest: int) -> None:
    """A pass of `fewest` rows runs its layers' qkv, o and down GEMMs quantized (`calls`: the row
    counts of the quantized linear calls); a pass of fewer keeps the model's GEMMs, bit for bit."""
    layers = len(quantized.model.model.layers)
    calls.clear()
    _prefill_logits(quantized, [fewest])
    assert calls == [fewest] * (3 * layers)
    if fewest > 1:
        calls.clear()
        few = fewest - 1
        assert torch.equal(_prefill_logits(quantized, [few]), _prefill_logits(plain, [few])) and calls == []


def test_float32_passes_take_the_own_gemm_from_one_row():
    """A float32 model's small passes would read its fp32 weights (4 bytes a weight): on the own
    kernel they run quantized from one row; bf16 passes from 8 (their bf16 and Q4_1 paths read
    fewer bytes), torch._int_mm's from 32."""
    assert int8_mod.min_rows(True, torch.float32) == 1 and int8_mod.min_rows(True, torch.bfloat16) == 8
    assert int8_mod.min_rows(False, torch.float32) == int8_mod.min_rows(False) == 32
    assert int8_mod.takes(torch.zeros(1, 64), own_gemm=True) and not int8_mod.takes(torch.zeros(7, 64).bfloat16(), True)


def test_own_int8_gemm_is_wanted_on_vnni_and_on_amx_tiles(monkeypatch):
    monkeypatch.delenv(int8_mod.INT8_GEMM_ENV, raising=False)
    assert int8_mod.own_gemm_wanted("fpu avx512f avx512_vnni avx512_bf16")
    # (with AMX-INT8: where the own kernel runs on the tiles, not on its vectors)
    assert int8_mod.own_gemm_wanted("fpu avx512f avx512_vnni amx_bf16 amx_int8 amx_tile", tiles=True)
    assert not int8_mod.own_gemm_wanted("fpu avx512f avx512_vnni amx_bf16 amx_int8 amx_tile", tiles=False)
    assert int8_mod.own_gemm_wanted("fpu fma avx2")  # (an AMD EPYC Zen 3's: the AVX2 build)
    assert not int8_mod.own_gemm_wanted("fpu fma avx2 avx_vnni")  # (oneDNN's 256-bit dot products)
    assert not int8_mod.own_gemm_wanted("fpu sse4_2")
    monkeypatch.setenv(int8_mod.INT8_GEMM_ENV, "onednn")
    assert not int8_mod.own_gemm_wanted("fpu avx512f avx512_vnni avx512_bf16")
    assert not int8_mod.own_gemm_wanted("fpu avx512f avx512_vnni amx_int8", tiles=True)
    monkeypatch.setenv(int8_mod.INT8_GEMM_ENV, "fast")
    with pytest.raises(ValueError, match="BATCHYARD_INT8_GEMM"):
        int8_mod.own_gemm_wanted("avx512_vnni")


@needs_exact_int_mm
def test_w8a8_without_the_c_kernels_runs_its_ends_in_pytorch(hf_model, monkeypatch):
    """worker.cpu_kernels = off means PyTorch only: the int8 ends too (the GEMMs stay torch._int_mm)."""
    runner = _runner(hf_model, dtype=torch.bfloat16, quantization="w8a8", cpu_kernels="off")
    assert runner.model.model.layers[0].int8_ops.lib is None
    calls = count_int_mm_rows(monkeypatch)
    logits = _prefill_logits(runner, [30, 12])
    assert calls and torch.isfinite(logits).all()


def test_w8a8_is_refused_where_it_cannot_run(hf_model):
    with pytest.raises(ValueError, match="runs on the CPU.*worker.device = 'cpu'"):
        _runner(hf_model, dtype=torch.float32, quantization="w8a8", device="meta")
    with pytest.raises(ValueError, match="quantization must be one of none, w8a8"):
        _runner(hf_model, dtype=torch.bfloat16, quantization="int4")
    from framework.config import Settings, SettingsError

    with pytest.raises((SettingsError, ValueError), match="quantization"):
        Settings.load(None, model={"quantization": "int4"})


@pytest.mark.parametrize("quantization", [pytest.param("w8a8", marks=needs_exact_int_mm), "w4a8"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_quantized_engine_serves_and_reloads(make_engine, tiny_model_folder, dtype, quantization):
    """Through the settings: greedy requests of a batch large enough for the int8 (or W4A8) GEMMs,
    leak-checked (the fixture); reloaded weights get their quantized copies again, made the same
    way (w8a8: calibrated the same way)."""
    engine = make_engine(model={"dtype": dtype, "quantization": quantization})
    outs = engine.generate(input_ids=[[5 + i, 7, 9 + i, 11] for i in range(40)],
                           sampling_params={"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert all(len(o["output_ids"]) == 6 for o in outs)
    runner = ModelRunner(tiny_model_folder, dtype=getattr(torch, dtype), max_total_tokens=512,
                         quantization=quantization)
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.int8 is not None and qkv.int8_ops is not None
    assert (qkv.int8.inv is not None) == (quantization == "w8a8")  # (w4a8's rows are not smoothed)
    before = qkv.int8
    ok, message = runner.update_weights(tiny_model_folder)
    assert ok, message
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.int8 is not before and type(qkv.int8) is type(before)
    if quantization == "w8a8":
        assert torch.equal(qkv.int8.q, before.q) and torch.equal(qkv.int8.inv, before.inv)
    else:
        assert torch.equal(qkv.int8.d, before.d) and torch.equal(qkv.int8.packed, before.packed)


def test_quantized_rows_carry_their_shape():
    rows = QuantizedRows(torch.zeros(3, 8, dtype=torch.int8), torch.zeros(3))
    assert rows.shape == (3, 8)


@needs_exact_int_mm
def test_cpus_without_an_int8_dot_product_are_named(hf_model, monkeypatch, caplog):
    assert int8_mod.has_int8_dot("fpu avx2 avx512f avx512_vnni")
    assert int8_mod.has_int8_dot("fpu avx2 amx_bf16 amx_int8") and int8_mod.has_int8_dot("avx2 avx_vnni")
    assert not int8_mod.has_int8_dot("fpu avx2 avx512f avx512_bf16")
    monkeypatch.setattr("framework.model.runner.has_int8_dot", lambda: False)
    monkeypatch.setenv(int8_mod.INT8_GEMM_ENV, "onednn")  # (the own AVX2 GEMM is fast: no warning with it)
    with caplog.at_level("WARNING", logger="framework.model.runner"):
        _runner(hf_model, dtype=torch.bfloat16, quantization="w8a8")
    assert "without an int8 dot product" in caplog.text
    if int8_mod.Int8Ops.load().lib is not None and int8_mod.Int8Ops.load().lib.int8_gemm_packed_bytes(4, 16, 0) > 0:
        caplog.clear()
        monkeypatch.setenv(int8_mod.INT8_GEMM_ENV, "auto")
        monkeypatch.setattr(int8_mod, "own_gemm_wanted", lambda flags=None, tiles=None: True)
        with caplog.at_level("WARNING", logger="framework.model.runner"):
            _runner(hf_model, dtype=torch.bfloat16, quantization="w8a8")
        assert "without an int8 dot product" not in caplog.text


def _saturating_int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch._int_mm as oneDNN's kernels without an int8 dot product compute it: a + 128 (u8) times
    b (s8), adjacent pairs of products added in 16 bits with saturation, then 128 * b's column sums
    taken off again."""
    ua, b = a.int() + 128, b.int()
    pairs = ua[:, 0::2, None] * b[None, 0::2] + ua[:, 1::2, None] * b[None, 1::2]
    return pairs.clamp(-32768, 32767).sum(dim=1).int() - 128 * b.sum(dim=0)


def test_the_int_mm_probe_catches_saturating_kernels(monkeypatch):
    """A kernel that adds int8 pairs in 16 bits (oneDNN's without an int8 dot product) saturates on
    the probe's operands: the probe says so. oneDNN held below the int8 dot products
    (ONEDNN_MAX_CPU_ISA=AVX2, read when it starts: a process of its own) is such a kernel where
    torch gives _int_mm to oneDNN, on CPUs with an int8 dot product; natively there _int_mm is
    exact. (Without one, as on an AMD EPYC Zen 3, torch keeps _int_mm on its own exact loops.)"""
    import os
    import subprocess
    import sys

    monkeypatch.setattr(torch, "_int_mm", _saturating_int_mm)
    assert int8_mod.int_mm_is_exact.__wrapped__() is False
    monkeypatch.undo()
    if not int8_mod.has_int8_dot():
        return
    code = "from framework.model.int8 import int_mm_is_exact; print(int_mm_is_exact())"
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    capped = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert capped.returncode == 0, capped.stderr
    assert capped.stdout.strip() == "False"
    if int8_mod.has_int8_dot() and "ONEDNN_MAX_CPU_ISA" not in os.environ:
        assert int8_mod.int_mm_is_exact()


def test_w8a8_is_refused_where_int_mm_saturates(hf_model, monkeypatch):
    """Saturated sums cost more than the quantization itself (perplexity +2 %), silently: the runner
    refuses to start, naming the cause and the way out."""
    monkeypatch.setattr("framework.model.runner.int_mm_is_exact", lambda: False)
    with pytest.raises(ValueError, match="torch._int_mm is not exact here.*model.quantization = 'none'"):
        _runner(hf_model, dtype=torch.bfloat16, quantization="w8a8")
    _runner(hf_model, dtype=torch.bfloat16, quantization="none")  # the rest still runs
