"""Weight updates from disk (reference R4) and the torch profiler (R5) on the offline Engine."""

from __future__ import annotations

import gzip
import json
import os

import pytest
import torch

from framework.model.cpu_kernels import load_f32_gemm
from tests.conftest import TINY_CONFIG, save_random_model

PROMPTS = ["The capital of France is", "Once upon a time"]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def save_tiny_llama(folder, tokenizer, seed: int, **config_overrides) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, **{**TINY_CONFIG, **config_overrides})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    return save_random_model(model, folder, tokenizer)


@pytest.fixture(scope="module")
def other_weights_folder(tmp_path_factory, default_tokenizer) -> str:
    """Same architecture as the tiny llama, other random weights."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-b"), default_tokenizer, seed=1)


@pytest.fixture(scope="module")
def other_shape_folder(tmp_path_factory, default_tokenizer) -> str:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama-wide"), default_tokenizer, seed=2,
                           intermediate_size=96)


def outputs(engine) -> list[list[int]]:
    return [o["output_ids"] for o in engine.generate(PROMPTS, GREEDY)]


def test_update_weights_from_disk_serves_the_new_weights(make_engine, other_weights_folder):
    engine = make_engine()
    before = outputs(engine)
    fresh = outputs(make_engine(model={"path": other_weights_folder}))
    assert fresh != before  # otherwise the test could not tell the weights apart

    success, message = engine.update_weights_from_disk(other_weights_folder)
    assert success, message
    assert outputs(engine) == fresh


def test_bad_weight_update_keeps_the_old_weights(make_engine, other_shape_folder, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    engine = make_engine()
    before = outputs(engine)
    for path, error in [
        (str(tmp_path / "missing"), "Failed to load weights"),
        (other_shape_folder, "parameter shapes differ"),
        (str(empty), "Failed to load weights"),
    ]:
        success, message = engine.update_weights_from_disk(path)
        assert not success and error in message, message
        assert outputs(engine) == before, path


def test_update_refused_while_requests_run(make_engine, other_weights_folder):
    from framework.messages import GenerateReqInput
    from framework.request import SamplingParams

    engine = make_engine()
    params = SamplingParams(max_new_tokens=4, temperature=0)
    params.normalize(engine.tokenizer)
    engine.scheduler.send(GenerateReqInput(rid="busy", input_ids=[1, 2, 3], sampling_params=params))
    engine.scheduler.run_once()
    success, message = engine.update_weights_from_disk(other_weights_folder)
    assert not success and "running or waiting" in message
    while engine.scheduler.has_work():
        engine.scheduler.run_once()
    engine.scheduler.run_once()


@pytest.mark.parametrize("worker", ["overlap", "tp"])
def test_profile_writes_a_trace_to_the_configured_dir(make_engine, tmp_path, worker):
    """The trace holds the forward passes' operators, also when they run on the overlap worker's
    forward thread (the profiler records operators of the thread that starts it)."""
    engine = make_engine(plugins={"worker": worker}, server={"profile_dir": str(tmp_path / "traces")})
    engine.start_profile()
    engine.generate(PROMPTS[0], {"max_new_tokens": 2})
    path = engine.stop_profile()
    assert os.path.dirname(path) == str(tmp_path / "traces")
    with gzip.open(path, "rt") as f:
        names = {event.get("name") for event in json.load(f)["traceEvents"]}
    # (the embedding lookup runs in every forward pass; the GEMMs leave aten only where MKL or
    # oneDNN takes them, not on the C kernels' own GEMMs, as fp32 ones on CPUs without AVX-512)
    assert "aten::embedding" in names, sorted(n for n in names if n)[:20]
    if load_f32_gemm() is None:  # (with AVX-512: MKL or oneDNN GEMMs among them)
        assert names & {"aten::linear", "aten::mm", "aten::addmm"}, sorted(n for n in names if n)[:20]


def test_profile_without_a_dir_uses_the_default(make_engine, monkeypatch, tmp_path):
    from framework import profiling

    monkeypatch.setattr(profiling.tempfile, "gettempdir", lambda: str(tmp_path))
    engine = make_engine()
    with pytest.raises(ValueError, match="not running"):
        engine.stop_profile()
    engine.start_profile()
    with pytest.raises(ValueError, match="already running"):
        engine.start_profile()
    path = engine.stop_profile()
    assert path.startswith(str(tmp_path / "batchyard-profiles")) and os.path.exists(path)


@pytest.mark.skipif(not os.path.isdir("/sys"), reason="needs /sys, a directory that takes no files")
def test_a_profile_dir_that_takes_no_files_is_refused_at_start(make_engine):
    """Found when profiling starts, not when the trace of the whole session is written (the
    directory exists, so creating it succeeds; /sys takes no files, even from root)."""
    engine = make_engine(server={"profile_dir": "/sys"})
    with pytest.raises(ValueError, match=r"Cannot write to the profile directory /sys \(server.profile_dir\)"):
        engine.start_profile()
    with pytest.raises(ValueError, match="not running"):
        engine.stop_profile()
