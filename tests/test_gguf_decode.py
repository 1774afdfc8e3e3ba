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
from framework.batch import ForwardMode
from tests.test_model import _batch, _new_reqs, _runner, _tiny_hf


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
    """Asked for by name ("exact"), a model that cannot take the Q4_1 weights gets a warning saying
    why; "auto" (the default) says it at INFO, since most models are not GGUF conversions."""
    hf = _tiny_hf()
    runner = _runner(hf, dtype=torch.float32)
    with caplog.at_level(logging.INFO, logger="framework.model.gguf_decode"):
        assert not gguf_decode.use_gguf_decode(runner.model, None, "exact")
    assert "model.dtype = 'bfloat16'" in caplog.text and caplog.records[-1].levelno == logging.WARNING
    assert runner.model.q4_layers is None
    runner = _runner(hf, dtype=torch.bfloat16, packed_weights=True)
    for mode, level in (("exact", logging.WARNING), ("auto", logging.INFO)):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="framework.model.gguf_decode"):
            assert not gguf_decode.use_gguf_decode(runner.model, None, mode)
        gemm = runner.model.kernels.gemm if runner.model.kernels is not None else None
        if gemm is None:
            assert "AVX512-BF16" in caplog.text
        else:
            assert "not converted from a GGUF file" in caplog.text
        assert caplog.records[-1].levelno == level and runner.model.q4_layers is None
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="framework.model.gguf_decode"):
        assert not gguf_decode.use_gguf_decode(runner.model, None, "exact", lora=True)
        assert not gguf_decode.use_gguf_decode(torch.nn.Linear(2, 2), None, "exact")  # not a llama model
    assert caplog.text.count("without LoRA adapters") == 2 and caplog.records[-1].levelno == logging.WARNING
    if runner.model.kernels is not None and runner.model.kernels.gemm is not None:
        caplog.clear()
        unpacked = _runner(hf, dtype=torch.bfloat16, packed_weights=False)
        with caplog.at_level(logging.INFO, logger="framework.model.gguf_decode"):
            assert not gguf_decode.use_gguf_decode(unpacked.model, None, "exact")
        assert "worker.packed_weights" in caplog.text


@pytest.mark.parametrize("tiles", [True, False], ids=["tiles", "vectors"])
@pytest.mark.parametrize("epilogue", ["none", "add", "gate_up"])
def test_widened_q4_blocks_give_the_bits_of_the_bf16_weights(epilogue, tiles):
    """The Q4_1 blocks widened on the fly (`widen`) give the bits of the packed GEMM on the bf16
    rounding of the dequantized weight, on the AMX tiles and on the vectors: one row, a partial row
    group (and micro-tile), more than one pass of row groups, a number of column blocks that leaves
    a partial unit on both (5: units of 2 and of 4)."""
    gemm = load_packed_gemm(tiles)
    if gemm is None:
        pytest.skip(f"no packed GEMM kernel on the {'tiles' if tiles else 'vectors'} here")
    n, k = 80, 96
    blocks, w = _q4_weight(2 * n if epilogue == "gate_up" else n, k, seed=5)
    q4, bf16 = gemm.q4_pack(blocks), gemm.pack(w.to(torch.bfloat16).contiguous())
    for rows in (1, 7, 17, 40):
        x = torch.randn(rows, k).to(torch.bfloat16)
        if epilogue == "gate_up":
            got, want = gemm.gate_up(x, q4, n, widen=True), gemm.gate_up(x, bf16, n)
        else:
            add = torch.randn(rows, n).to(torch.bfloat16) if epilogue == "add" else None
            got, want = gemm.linear(x, q4, n, add=add, widen=True), gemm.linear(x, bf16, n, add=add)
        assert torch.equal(got, want), rows


def test_the_gguf_header_reader_finds_what_gguf_py_finds(tmp_path):
    """gguf_tensors (the header alone, metadata skipped) gives each tensor's type, shape and data
    offset as gguf-py's reader does, through every metadata type, arrays of strings and a custom
    alignment; a cut or foreign file is a ValueError."""
    from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter

    path = str(tmp_path / "t.gguf")
    writer = GGUFWriter(path, "llama")
    writer.add_custom_alignment(64)
    writer.add_string("a.string", "hé")
    writer.add_array("a.strings", ["x", "yz", ""])
    writer.add_array("a.ints", [1, 2, 3])
    writer.add_float32("a.float", 0.5)
    writer.add_bool("a.bool", True)
    writer.add_uint64("a.u64", 7)
    blocks, _ = _q4_weight(32, 64, seed=1)
    writer.add_tensor("blk.0.attn_q.weight", blocks.reshape(32, 40).numpy(), raw_shape=(32, 40),
                      raw_dtype=GGMLQuantizationType.Q4_1)
    writer.add_tensor("f", np.arange(5, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = open(path, "rb").read()
    mine = gguf_decode.gguf_tensors(data)
    theirs = {t.name: (int(t.tensor_type), tuple(int(d) for d in t.shape), int(t.data_offset))
              for t in GGUFReader(path).tensors}
    assert mine == theirs and mine["blk.0.attn_q.weight"][:2] == (3, (64, 32))
    assert data[mine["f"][2]:mine["f"][2] + 20] == np.arange(5, dtype=np.float32).tobytes()
    for bad in (data[:40], b"GGML" + data[4:], b""):
        with pytest.raises(ValueError):
            gguf_decode.gguf_tensors(bad)


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


def _decode_logits(runner, prompt_lens, steps):
    """Prefill requests of `prompt_lens` tokens, then decode steps of the first `rows` of them
    for each `rows` in `steps`; returns (the requests, each step's logits)."""
    reqs = _new_reqs(runner, [n + len(steps) for n in prompt_lens], seed=3)
    runner.forward(_batch(runner, reqs, prompt_lens, ForwardMode.EXTEND))
    out = []
    for rows in steps:
        active = reqs[:rows]
        out.append(runner.forward(_batch(runner, active, [1] * rows, ForwardMode.DECODE)).next_token_logits.clone())
    return reqs, out


@pytest.fixture(scope="module")
def real_runners(default_model_folder):
    """Runners of the embedded model in bf16 with worker.gguf_decode auto (through the settings and
    the worker, as a server builds it), exact and off."""
    from framework.config import Settings
    from framework.model.runner import ModelRunner
    from plugins.workers.tp import TpWorker

    settings = Settings.load(None, model={"dtype": "bfloat16"}, cache={"max_total_tokens": 4096},
                             scheduler={"max_running_requests": 16})
    assert settings.worker.gguf_decode == "auto"
    runners = {"auto": TpWorker.from_settings(settings).runner}
    for mode in ("exact", "off"):
        runners[mode] = ModelRunner(default_model_folder, dtype=torch.bfloat16, max_total_tokens=4096,
                                    max_running_requests=16, gguf_decode=mode)
    model = runners["off"].model
    if model.kernels is None or model.kernels.gemm is None or model.decode_path() is None:
        pytest.skip("no decode path here (no C kernels, or no AVX512-BF16 for the packed GEMMs)")
    return runners


def _count_q4_calls(gemm, calls: list):
    real = gemm._q4_gemm
    gemm._q4_gemm = lambda *args: calls.append((args[7], args[-1])) or real(*args)  # (rows, widen)
    return real


@pytest.mark.e2e
def test_auto_decode_steps_read_the_q4_weights_for_the_same_bits(real_runners, monkeypatch):
    """worker.gguf_decode = auto (the default): decode steps of up to WIDEN_ROWS requests run their
    four GEMMs a layer on the Q4_1 blocks widened to the bf16 weights, and give the logits of the
    bf16 weights bit for bit; larger steps take the bf16 copies."""
    auto, off = real_runners["auto"], real_runners["off"]
    gemm = auto.model.kernels.gemm
    assert auto.model.q4_layers is not None and not auto.model.q4_exact and off.model.q4_layers is None
    monkeypatch.setattr(gguf_decode, "WIDEN_ROWS", 4)
    auto.model.reset_decode_path()
    calls = []
    real = _count_q4_calls(gemm, calls)
    try:
        steps = [1, 3, 4, 5]
        _, got = _decode_logits(auto, [7, 30, 12, 20, 9], steps)
    finally:
        gemm._q4_gemm = real
        auto.model.reset_decode_path()  # built again, after the test, with the real WIDEN_ROWS
    _, want = _decode_logits(off, [7, 30, 12, 20, 9], steps)
    for rows, a, b in zip(steps, got, want):
        assert torch.equal(a, b), rows
    layers = auto.model_config.num_layers
    assert calls == [(rows, gemm.widen_mode) for rows in (1, 3, 4) for _ in range(4 * layers)]  # not 5 rows


@pytest.mark.e2e
def test_exact_decode_steps_multiply_by_the_files_weights(real_runners, default_model_folder):
    """worker.gguf_decode = exact: decode steps of up to EXACT_ROWS requests run their GEMMs on the
    file's exact Q4_1 weights, logits as close to transformers' fp32 ones (on the same exact
    weights) as the bf16 weights give; larger steps widen the blocks to the bf16 weights. Weights
    reloaded from the same folder get their own Q4_1 copies."""
    from transformers import AutoModelForCausalLM

    exact, off = real_runners["exact"], real_runners["off"]
    gemm = exact.model.kernels.gemm
    assert exact.model.q4_layers is not None and exact.model.q4_exact
    calls = []
    real = _count_q4_calls(gemm, calls)
    steps = [4, 4, 5]
    try:
        reqs, got = _decode_logits(exact, [7, 30, 12, 20, 9], steps)
    finally:
        gemm._q4_gemm = real
    _, want = _decode_logits(off, [7, 30, 12, 20, 9], steps)
    layers = exact.model_config.num_layers
    widened = [(5, gemm.widen_mode)] * (4 * layers)
    assert calls == [(4, 0)] * (2 * 4 * layers) + widened
    # 5 rows: the bf16 weights' bits, widened or not, for the one request whose KV the exact steps
    # before did not write
    assert torch.equal(got[2][4], want[2][4]) and not torch.equal(got[2][0], want[2][0])
    hf = AutoModelForCausalLM.from_pretrained(default_model_folder, dtype=torch.float32).eval()
    errors = {"exact": [], "bf16": []}
    for step in range(2):
        for i, req in enumerate(reqs[:4]):
            seen = len(req.tokens) - len(steps) + step + 1  # the prompt and this step's input token
            with torch.no_grad():
                ref = hf(torch.tensor([req.tokens[:seen]])).logits[0, -1].float()
            errors["exact"].append((got[step][i].float() - ref).abs().max().item())
            errors["bf16"].append((want[step][i].float() - ref).abs().max().item())
    exact_err, bf16_err = max(errors["exact"]), max(errors["bf16"])
    assert not torch.equal(got[0], want[0])  # the exact weights' own logits
    assert exact_err < 1.0 and exact_err < 1.5 * bf16_err, (exact_err, bf16_err)
    ok, message = exact.update_weights(default_model_folder)
    assert ok, message
    assert exact.model.q4_layers is not None and exact.model.q4_exact


@pytest.mark.e2e
def test_blocks_that_are_not_the_loaded_weights_are_refused(real_runners, default_model_folder, caplog):
    """The blocks are checked against the loaded bf16 weights (a row order other than llama's, a
    GGUF that is not the folder's source): one weight that differs keeps the bf16 weights, with a
    warning naming it."""
    model = real_runners["off"].model
    weight = model.model.layers[0].mlp.down_proj.weight
    saved = weight.detach().clone()
    try:
        with torch.no_grad():
            weight[3, 5] += 1.0
        with caplog.at_level(logging.WARNING, logger="framework.model.gguf_decode"):
            assert not gguf_decode.use_gguf_decode(model, default_model_folder, "exact")
        assert "not the loaded weights (layer 0's down_proj)" in caplog.text and model.q4_layers is None
    finally:
        with torch.no_grad():
            weight.copy_(saved)
        model.q4_layers, model.q4_exact = None, False
        model.reset_decode_path()
