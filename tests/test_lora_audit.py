"""LoRA audit: adapter folders that cannot be served fail start-up with a message naming the
adapter, and the OpenAI endpoints do not silently serve the base model for a `lora_path`."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest

from tests.conftest import tiny_settings
from tests.conftest_server import running_server, tiny_server_args
from tests.test_lora import adapter_folders  # noqa: F401  (the fixture)
from tests.test_multimodal import llava_folder, llava_tokenizer  # noqa: F401  (the fixtures)


def _broken_copy(src: str, dst, config_change=None, config_text=None, weights=None) -> str:
    shutil.copytree(src, dst)
    config_file = dst / "adapter_config.json"
    if config_change is not None:
        config = json.loads(config_file.read_text())
        config_change(config)
        config_file.write_text(json.dumps(config))
    if config_text is not None:
        config_file.write_text(config_text)
    if weights is not None:
        (dst / "adapter_model.safetensors").write_bytes(weights)
    return str(dst)


@pytest.mark.parametrize("broken, message", [
    (dict(config_change=lambda c: c.pop("r")), "adapter_config.json: r must be a positive integer"),
    (dict(config_change=lambda c: c.update(r=0)), "adapter_config.json: r must be a positive integer"),
    (dict(config_change=lambda c: c.update(lora_alpha="x")), "adapter_config.json: lora_alpha must be a number"),
    (dict(config_change=lambda c: c.update(peft_type="IA3")), "a IA3 adapter, not LoRA"),
    (dict(config_text="{not json"), "adapter_config.json is not valid JSON"),
    (dict(weights=b"garbage"), "cannot read adapter_model.safetensors"),
])
def test_unservable_adapter_folders_name_the_adapter(tiny_model_folder, adapter_folders, tmp_path, broken, message):
    """These were a KeyError 'r', a ZeroDivisionError, a JSONDecodeError or the safetensors
    library's own message ("Scheduler start-up failed: KeyError: 'r'"), none naming the adapter."""
    from framework.engine import Engine

    folder = _broken_copy(adapter_folders["a"], tmp_path / "adapter", **broken)
    with pytest.raises(ValueError, match=f"LoRA adapter {folder}: .*{message}"):
        Engine(tiny_settings(tiny_model_folder, model={"lora_paths": [f"x={folder}"]}))


def test_openai_endpoints_refuse_lora_path(tiny_model_folder, adapter_folders, tmp_path):
    """The OpenAI endpoints serve the base model only: a `lora_path` there is refused rather than
    ignored (it was a 200 with the base model's output)."""
    args = tiny_server_args(tiny_model_folder) + ["--model.lora-paths", f"a={adapter_folders['a']}"]
    with running_server(args, tmp_path / "server.log") as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        for path, body in [("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", chat)]:
            resp = http.post(path, json={"model": "default", "max_tokens": 2, "lora_path": "a", **body})
            assert resp.status_code == 400, resp.text
            assert "lora_path: the OpenAI endpoints serve the base model" in resp.json()["error"]["message"]
            # null is the default, as for every optional OpenAI field.
            resp = http.post(path, json={"model": "default", "max_tokens": 2, "lora_path": None, **body})
            assert resp.status_code == 200, resp.text



def test_adapters_on_a_llava_model_are_refused_plainly(llava_folder, adapter_folders):
    """It was "AttributeError: 'LlavaForCausalLM' object has no attribute 'model'" at start-up."""
    from framework.engine import Engine

    with pytest.raises(ValueError, match="LoRA adapters are served on llama-family text models only"):
        Engine(tiny_settings(llava_folder, model={"lora_paths": [f"a={adapter_folders['a']}"]}))


def test_adapters_on_an_embedding_model_are_refused(tiny_embedding_folder, adapter_folders):
    """They loaded and were never applied (/encode takes no adapter): the base embeddings came back."""
    from framework.engine import Engine

    with pytest.raises(ValueError, match="LoRA adapters are served on generation models"):
        Engine(tiny_settings(tiny_embedding_folder, model={"lora_paths": [f"a={adapter_folders['a']}"]}))
