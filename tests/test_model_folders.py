"""Serving a model other than the embedded one: what a model folder's config and files decide
(EOS ids, the tokenizer, the context), and the one-line errors for folders that cannot be served."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, Qwen2Config

from framework.config import SettingsError
from framework.model import ModelRunner
from framework.model.config import ModelConfig, context_len_to_serve
from framework.model.loader import ModelFolderError, iter_safetensors, resolve_model
from plugins.workers.tp import eos_ids_of
from tests.conftest import TINY_CONFIG, leak_checked_engines
from tests.conftest_server import ROOT

SMALL = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)


def _runner(config, **kw) -> ModelRunner:
    torch.manual_seed(0)
    return ModelRunner.from_hf_model(LlamaForCausalLM(config), max_total_tokens=512, max_running_requests=4, **kw)


def test_eos_ids_are_the_configs_and_the_tokenizers():
    """A config may name several EOS ids (Llama 3's instruct models end a turn with <|eot_id|>,
    not the tokenizer's <|end_of_text|>): every one stops a request."""
    runner = _runner(LlamaConfig(**SMALL, eos_token_id=[3, 7]))
    assert eos_ids_of(runner) == {3, 7}
    assert eos_ids_of(_runner(LlamaConfig(**SMALL, eos_token_id=5))) == {5}


def test_a_context_length_longer_than_the_models_is_refused():
    config = LlamaConfig(**SMALL)
    assert _runner(config, context_length=100).context_len == 100
    with pytest.raises(SettingsError, match=r"model.context_length: 512 is longer than the model's context of 256 "
                                            r"tokens \(its max_position_embeddings\)"):
        _runner(config, context_length=512)


def test_a_sliding_window_caps_the_context():
    """Our attention is full: the same as a sliding window's only up to the window's length."""
    assert ModelConfig.from_hf_config(MistralConfig(**SMALL, sliding_window=None)).context_len == 256
    mistral = ModelConfig.from_hf_config(MistralConfig(**SMALL, sliding_window=64))
    assert (mistral.context_len, mistral.sliding_window, mistral.max_position_embeddings) == (64, 64, 256)
    # Qwen2 configs carry a window that only use_sliding_window turns on (for layers from max_window_layers).
    off = Qwen2Config(**SMALL, sliding_window=64, use_sliding_window=False)
    assert ModelConfig.from_hf_config(off).context_len == 256
    on = Qwen2Config(**SMALL, sliding_window=64, use_sliding_window=True, max_window_layers=0)
    assert ModelConfig.from_hf_config(on).context_len == 64
    assert context_len_to_serve(mistral, 32) == 32
    with pytest.raises(SettingsError, match="model.context_length: 100 .* sliding attention window"):
        context_len_to_serve(mistral, 100)


def test_an_activation_other_than_silu_is_refused():
    with pytest.raises(ValueError, match="Unsupported hidden_act 'gelu'"):
        ModelConfig.from_hf_config(LlamaConfig(**SMALL, hidden_act="gelu"))


@pytest.fixture(scope="module")
def no_tokenizer_folder(tmp_path_factory, default_tokenizer) -> str:
    """A tiny llama saved without tokenizer files."""
    folder = tmp_path_factory.mktemp("tiny-llama-no-tokenizer")
    config = LlamaConfig(vocab_size=len(default_tokenizer), bos_token_id=default_tokenizer.bos_token_id,
                         eos_token_id=None, **TINY_CONFIG)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


@pytest.fixture
def make_engine(no_tokenizer_folder):
    yield from leak_checked_engines(no_tokenizer_folder)


def test_model_tokenizer_path_is_the_schedulers_tokenizer(make_engine, tiny_model_folder, default_tokenizer):
    """The worker (stop strings, grammars, the tokenizer's EOS) reads model.tokenizer_path too,
    not only the HTTP side: a folder without tokenizer files is served with it."""
    engine = make_engine(model={"tokenizer_path": tiny_model_folder})
    assert engine.tokenizer is not None
    assert engine.scheduler.worker.eos_token_ids == {default_tokenizer.eos_token_id}
    out = engine.generate("Hello", {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == 4


def test_folders_that_cannot_be_served_name_their_problem(tmp_path, tiny_model_folder):
    with pytest.raises(ModelFolderError, match="does not exist"):
        resolve_model(str(tmp_path / "missing.gguf"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelFolderError, match="has no config.json"):
        resolve_model(str(empty))
    shutil.copy(os.path.join(tiny_model_folder, "config.json"), empty)
    with pytest.raises(ModelFolderError, match=r"^No .safetensors weights in \S+$"):
        next(iter_safetensors(str(empty)))


def _bin_folder(tiny_model_folder, folder) -> str:
    """The tiny model as a PyTorch pickle (pytorch_model.bin) instead of safetensors."""
    shutil.copytree(tiny_model_folder, folder)
    state = dict(iter_safetensors(str(folder)))
    for name in os.listdir(folder):
        if name.endswith(".safetensors") or name == "model.safetensors.index.json":
            os.remove(os.path.join(folder, name))
    torch.save(state, os.path.join(folder, "pytorch_model.bin"))
    return str(folder)


def test_a_bin_checkpoint_is_one_line_at_start_up(tiny_model_folder, tmp_path):
    folder = _bin_folder(tiny_model_folder, tmp_path / "bin")
    with pytest.raises(ModelFolderError, match=r"pytorch_model.bin: PyTorch pickles are not loaded"):
        next(iter_safetensors(folder))
    proc = subprocess.run(
        [sys.executable, "-m", "framework.cli", "generate", "Hello", "--max-new-tokens", "1", "--model.path", folder,
         "--model.dtype", "float32"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == (f"batchyard: No .safetensors weights in {folder} (pytorch_model.bin: "
                                            "PyTorch pickles are not loaded; re-save with save_pretrained)")


def test_generate_chat_without_a_chat_template_is_one_line(tiny_model_folder, tmp_path, capsys):
    from framework.cli import main

    folder = tmp_path / "no-template"
    shutil.copytree(tiny_model_folder, folder, ignore=shutil.ignore_patterns("chat_template*"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert main(["generate", "Hello", "--chat", "--model.path", str(folder), "--model.dtype", "float32",
                 "--cache.max-total-tokens", "2000"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == ("batchyard: --chat needs a chat template, and this model's "
                                                       "tokenizer has none (model.tokenizer_path names another tokenizer)")


def test_weights_that_do_not_fit_the_config_are_one_error(tiny_model_folder, tmp_path):
    """A config.json of another architecture or shape than the weights (Qwen2's q/k/v biases under
    a Llama config, a wrong intermediate_size): one error naming it, not a traceback from the copy."""
    folder = tmp_path / "mismatch"
    shutil.copytree(tiny_model_folder, folder)
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] *= 2
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFolderError, match=r"The weights do not fit the model's config.json \(LlamaForCausalLM\)"):
        ModelRunner(str(folder), max_total_tokens=256, max_running_requests=2)
