"""Decode steps of a few requests on the GGUF file's own Q4_1 weights (worker.gguf_decode,
framework/model/gguf_decode.py, kernels/packed_gemm.c's q4_gemm_bf16)."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from framework.model import gguf_decode
from framework.model.cpu_kernels import load_packed_gemm
from tests.test_model import Req, _batch, _new_reqs, _runner, _tiny_hf
from framework.batch import ForwardMode


@pytest.fixture(scope="module")
def gemm():
    gemm = load_packed_gemm()
    if gemm is None:
        pytest.skip("no packed GEMM kernel here (no C compiler or no AVX512-BF16)")
    return gemm


def _q4_weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random [n, k] weight quantized to Q4_1 by gguf-py: (its file blocks uint8 [n, k / 32, 20],
    the weight they stand for, fp32, as gguf-py dequantizes them)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(seed)
    weight = (rng.standard_normal((n, k)) * 0.3 + rng.standard_normal((n, 1)) * 0.1).astype(np.float32)
    blocks = quantize(weight, GGMLQuantizationType.Q4_1)
    exact = dequantize(blocks, GGMLQuantizationType.Q4_1)
    return torch.from_numpy(blocks.reshape(n, k // 32, 20).copy()), torch.from_numpy(exact.astype(np.float32))


@pytest.mark.parametrize("epilogue", ["none", "add", "gate_up"])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 11])
def test_q4_gemm_gives_the_files_exact_weights_products(gemm, epilogue, rows):
    """x @ w^T on the packed Q4_1 blocks is the fp32 product with the dequantized weights, rounded
    to bf16 once (plus the residual, or SiLU(gate) * up as the bf16 kernel rounds it), at row
    counts below, at and past a row group, for an odd number of column blocks (the last unit's
    second block past the end: not stored)."""
    n, k = 48, 96  # 3 column blocks, 3 k blocks
    torch.manual_seed(rows)
    x = torch.randn(rows, k).to(torch.bfloat16)
    blocks, w = _q4_weight(2 * n if epilogue == "gate_up" else n, k, seed=rows)
    packed = gemm.q4_pack(blocks)
    assert packed.dtype == torch.uint8 and packed.shape == (blocks.shape[0] // 16, k // 32, gemm.Q4_BLOCK)
    ref = x.float() @ w.T
    if epilogue == "gate_up":
        y = gemm.gate_up(x, packed, n)
        ref = F.silu(ref[:, :n]).bfloat16().float() * ref[:, n:]
        torch.testing.assert_close(y.float(), ref, rtol=2**-7, atol=1e-4)  # two bf16 roundings
        return
    out = torch.full((rows, n + 16), 7.0, dtype=torch.bfloat16)
    add = torch.randn(rows, n).to(torch.bfloat16) if epilogue == "add" else None
    y = gemm.linear(x, packed, n, add=add, out=out[:, :n])
    if add is not None:
        ref = ref + add.float()
    torch.testing.assert_close(y.float(), ref, rtol=2**-8, atol=1e-5)  # one bf16 rounding
    assert torch.equal(out[:, n:], torch.full((rows, 16), 7.0, dtype=torch.bfloat16))


def test_q4_gemm_refuses_what_it_cannot_take(gemm):
    blocks, _ = _q4_weight(32, 64, seed=0)
    with pytest.raises(ValueError, match="multiple of 16"):
        gemm.q4_pack(blocks[:24])
    with pytest.raises(ValueError, match="cannot pack"):
        gemm.q4_pack(blocks.view(torch.int8))
    packed = gemm.q4_pack(blocks)
    x = torch.randn(2, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match="does not fit"):
        gemm.linear(torch.randn(2, 96).to(torch.bfloat16), packed, 32)
    with pytest.raises(ValueError, match="does not fit"):
        gemm.linear(x, packed, 32, stream=True)  # the Q4_1 path has no streamed stores
    assert gemm.linear(x, packed, 32).shape == (2, 32)


def test_the_gguf_source_is_recorded_and_forgotten_when_the_file_changes(tmp_path):
    gguf_file, folder = tmp_path / "m.gguf", tmp_path / "converted"
    gguf_file.write_bytes(b"GGUF" + bytes(60))
    folder.mkdir()
    assert gguf_decode.gguf_source(str(folder)) is None and gguf_decode.gguf_source(None) is None
    gguf_decode.write_source(str(folder), str(gguf_file))
    assert gguf_decode.gguf_source(str(folder)) == str(gguf_file)
    os.utime(gguf_file, ns=(1, 1))  # replaced: another file under the same name
    assert gguf_decode.gguf_source(str(folder)) is None
    gguf_decode.write_source(str(folder), str(gguf_file))
    assert gguf_decode.gguf_source(str(folder)) == str(gguf_file)
    gguf_file.unlink()
    assert gguf_decode.gguf_source(str(folder)) is None
    (folder / gguf_decode.SOURCE_FILE).write_text("{not json")
    assert gguf_decode.gguf_source(str(folder)) is None


def test_a_model_without_a_gguf_source_keeps_the_bf16_weights_and_says_why(caplog):
    hf = _tiny_hf()
    runner = _runner(hf, dtype=torch.float32)
    with caplog.at_level(logging.WARNING, logger="framework.model.gguf_decode"):
        assert not gguf_decode.use_gguf_decode(runner.model, None)
    assert "model.dtype = 'bfloat16'" in caplog.text and runner.model.q4_layers is None
    runner = _runner(hf, dtype=torch.bfloat16, packed_weights=True)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="framework.model.gguf_decode"):
        assert not gguf_decode.use_gguf_decode(runner.model, None)
    if runner.model.kernels is None or runner.model.kernels.gemm is None:
        assert "AVX512-BF16" in caplog.text
    else:
        assert "not converted from a GGUF file" in caplog.text
    assert runner.model.q4_layers is None


# -- the embedded model ---------------------------------------------------------------------------


@pytest.mark.e2e
def test_the_files_q4_rows_are_the_converted_weights(default_model_folder):
    """Each layer's Q4_1 blocks, dequantized, are the converted checkpoint's fused weights exactly:
    q and k rows in the HF order (transformers' GGUF loader reorders them), q|k|v and gate|up
    stacked as our fused layers stack them."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from safetensors import safe_open

    from framework.model.loader import load_hf_config

    source = gguf_decode.gguf_source(default_model_folder)
    assert source is not None and source.endswith(".gguf")
    cfg = load_hf_config(default_model_folder)
    layers = gguf_decode.read_q4_layers(source, cfg.num_hidden_layers, cfg.num_attention_heads,
                                        cfg.num_key_value_heads)
    assert len(layers) == cfg.num_hidden_layers
    parts = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
    with safe_open(os.path.join(default_model_folder, "model.safetensors"), framework="pt") as f:
        for i in (0, cfg.num_hidden_layers - 1):
            for blocks, names in zip(layers[i], parts):
                module = "self_attn" if names[0].endswith(("q_proj", "o_proj")) else "mlp"
                fused = torch.cat([f.get_tensor(f"model.layers.{i}.{module}.{name}.weight") for name in names])
                n, kbs, _ = blocks.shape
                exact = dequantize(blocks.numpy().reshape(n, kbs * 20), GGMLQuantizationType.Q4_1)
                assert torch.equal(torch.from_numpy(exact.astype(np.float32)), fused.float()), (i, names)


@pytest.mark.e2e
def test_small_decode_steps_take_the_q4_weights_from_the_settings(default_model_folder):
    """With worker.gguf_decode, a bf16 decode step of at most MAX_ROWS requests runs its layer
    GEMMs on the file's Q4_1 weights (four a layer) and gives logits as close to transformers'
    fp32 ones (the same exact weights) as the bf16 weights do; a larger step keeps the bf16
    weights, and so do reloaded weights only when they come with no GGUF."""
    from transformers import AutoModelForCausalLM

    from framework.config import Settings
    from plugins.workers.tp import TpWorker

    settings = Settings.load(None, model={"dtype": "bfloat16"}, worker={"gguf_decode": True},
                             cache={"max_total_tokens": 4096}, scheduler={"max_running_requests": 8})
    runner = TpWorker.from_settings(settings).runner
    plain = _runner_like(runner, default_model_folder)
    gemm = runner.model.kernels.gemm if runner.model.kernels is not None else None
    if gemm is None or runner.model.decode_path() is None:
        pytest.skip("no decode path here (no C kernels, or no AVX512-BF16 for the packed GEMMs)")
    assert runner.model.q4_layers is not None and plain.model.q4_layers is None
    calls = []
    real = gemm._q4_gemm
    gemm._q4_gemm = lambda *args: calls.append(args[7]) or real(*args)  # the rows
    hf = AutoModelForCausalLM.from_pretrained(default_model_folder, dtype=torch.float32).eval()
    layers = runner.model_config.num_layers
    prompt_lens = [7, 30, 12, 20, 9]
    errors = {"q4": [], "bf16": []}
    for name, r in (("q4", runner), ("bf16", plain)):
        reqs = _new_reqs(r, [n + 3 for n in prompt_lens], seed=3)
        r.forward(_batch(r, reqs, prompt_lens, ForwardMode.EXTEND))
        for step in range(3):
            active = reqs[: gguf_decode.MAX_ROWS] if step < 2 else reqs  # 4 rows twice, then 5
            logits = r.forward(_batch(r, active, [1] * len(active), ForwardMode.DECODE)).next_token_logits
            if step < 2:
                errors[name] += [_max_error(hf, q, logits[i]) for i, q in enumerate(active)]
    assert calls == [gguf_decode.MAX_ROWS] * (2 * 4 * layers)  # the 5-row step: bf16 tiles
    q4_err, bf16_err = max(errors["q4"]), max(errors["bf16"])
    assert q4_err < 1.0 and q4_err < 1.5 * bf16_err, (q4_err, bf16_err)
    ok, message = runner.update_weights(default_model_folder)
    assert ok, message
    assert runner.model.q4_layers is not None


def _runner_like(runner, folder):
    from framework.model.runner import ModelRunner

    return ModelRunner(folder, dtype=torch.bfloat16, max_total_tokens=4096, max_running_requests=8)


def _max_error(hf, req: Req, logits: torch.Tensor) -> float:
    with torch.no_grad():
        ref = hf(torch.tensor([req.tokens[: req.done]])).logits[0, -1].float()
    return (logits.float() - ref).abs().max().item()
