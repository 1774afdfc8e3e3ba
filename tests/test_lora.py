"""LoRA adapters (reference AB): several adapters and the base model in one batch, equal to
transformers + peft with each adapter merged; the max_loras_per_batch admission limit; bad input."""

from __future__ import annotations

import httpx
import pytest
import torch

from framework import hookimpl
from framework.config import SettingsError
from tests.conftest import (check_greedy_equal, count_int_mm_rows, hf_greedy, hf_next_logprobs, needs_exact_int_mm,
                            tiny_settings)
from tests.conftest_server import running_server, tiny_server_args

NUM_TOKENS = 12
# Adapter a targets every supported module; b only some of them, with another rank and scaling
# (alpha / r: 2 and 3), so a scaling taken from the wrong adapter shows.
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "a": dict(r=4, lora_alpha=8, target_modules=ALL_TARGETS),
    "b": dict(r=2, lora_alpha=6, target_modules=["q_proj", "v_proj", "down_proj"]),
}


def _load_hf(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def adapter_folders(tiny_model_folder, tmp_path_factory) -> dict[str, str]:
    """Two random PEFT adapters on the tiny llama, with non-zero B so they change the outputs."""
    from peft import LoraConfig, get_peft_model

    folders = {}
    for i, (name, options) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + i)
        model = get_peft_model(_load_hf(tiny_model_folder), LoraConfig(lora_dropout=0.0, **options))
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_" in pname:
                    p.normal_(0, 0.3)
        folder = tmp_path_factory.mktemp(f"lora-{name}")
        model.save_pretrained(folder)
        folders[name] = str(folder)
    return folders


@pytest.fixture(scope="module")
def merged_models(tiny_model_folder, adapter_folders) -> dict:
    """The reference for each adapter: transformers + peft, merged into the weights."""
    from peft import PeftModel

    models = {None: _load_hf(tiny_model_folder)}
    for name, folder in adapter_folders.items():
        models[name] = PeftModel.from_pretrained(_load_hf(tiny_model_folder), folder).merge_and_unload().eval()
    return models


def lora_sections(adapter_folders, **model):
    return {"model": {"lora_paths": [f"{n}={p}" for n, p in adapter_folders.items()], **model}}


class BatchRecorder:
    """Records the adapters of every batch that runs."""

    def __init__(self):
        self.batches: list[tuple[str, list]] = []

    @hookimpl
    def prepare_batch(self, batch):
        if batch is not None:
            self.batches.append((batch.forward_mode.name, [r.lora_path for r in batch.reqs]))
        return batch


GREEDY = {"temperature": 0, "max_new_tokens": NUM_TOKENS, "ignore_eos": True}


def test_adapters_and_base_in_one_batch_match_merged_peft(make_engine, adapter_folders, merged_models,
                                                         default_tokenizer, monkeypatch):
    from framework.model import llama

    # Tiny tiles, so the wrapped layers also see the prefill in row blocks.
    monkeypatch.setattr(llama, "PREFILL_TILE", 8)
    recorder = BatchRecorder()
    # Small chunks: the last, long prompt is prefilled in three chunks under its adapter.
    engine = make_engine(extra_plugins=(recorder,), scheduler={"chunked_prefill_size": 32},
                         **lora_sections(adapter_folders))
    prompt = default_tokenizer.encode("The quick brown fox jumps over")
    other = default_tokenizer.encode("A list of colours: red, green,")
    long = default_tokenizer.encode("Once upon a time, in a small village by the sea, " * 4)
    assert len(prompt) * 3 + len(other) < 32 < len(long)
    prompts = [prompt, prompt, prompt, other, long]
    loras = ["a", "b", None, "b", "a"]
    outs = engine.generate(input_ids=prompts, sampling_params=GREEDY, lora_path=loras)

    # All five were prefilled together: one pass with both adapters and the base model.
    assert recorder.batches[0] == ("EXTEND", loras)
    # ... and decoded together: a decode step with both adapters and the base model.
    assert any(mode == "DECODE" and set(adapters) == {"a", "b", None} for mode, adapters in recorder.batches)
    ties = 0
    for ids, lora, out in zip(prompts, loras, outs):
        ref_model = merged_models[lora]
        ref = hf_greedy(ref_model, ids, NUM_TOKENS)
        ties += check_greedy_equal(out["output_ids"], ref, lambda prefix: hf_next_logprobs(ref_model, ids + prefix))
    # The adapters matter: the same prompt gives three different continuations.
    assert len({tuple(o["output_ids"]) for o in outs[:3]}) == 3, [o["output_ids"] for o in outs[:3]]
    print(f"near-ties met: {ties}")


@pytest.mark.parametrize("max_loras", [1, 2])
def test_max_loras_per_batch_is_respected_by_admission(make_engine, adapter_folders, default_tokenizer, max_loras):
    """No batch runs more distinct adapters (the base model counts as one) than the limit, and with a
    limit of 2 some batch does run two: the limit is neither ignored nor off by one."""
    recorder = BatchRecorder()
    engine = make_engine(extra_plugins=(recorder,), **lora_sections(adapter_folders, max_loras_per_batch=max_loras))
    prompts = [default_tokenizer.encode(f"Request number {i} says") for i in range(6)]
    loras = ["a", "b", "a", None, "b", None]
    outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 4}, lora_path=loras)

    assert all(len(o["output_ids"]) == 4 for o in outs)
    num_adapters = [len(set(adapters)) for _, adapters in recorder.batches]
    assert max(num_adapters) == max_loras, recorder.batches
    prefilled = [a for mode, adapters in recorder.batches if mode == "EXTEND" for a in adapters]
    assert sorted(prefilled, key=str) == sorted(loras, key=str)


def test_bad_lora_input(make_engine, adapter_folders, default_tokenizer, tiny_model_folder, tmp_path):
    engine = make_engine(**lora_sections(adapter_folders))
    ids = default_tokenizer.encode("Hello")
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'"):
        engine.generate(input_ids=ids, sampling_params=GREEDY, lora_path="nope")
    with pytest.raises(ValueError, match="lora_path: got 1 values for 2 prompts"):
        engine.generate(input_ids=[ids, ids], sampling_params=GREEDY, lora_path=["a"])
    with pytest.raises(SettingsError, match="given twice"):
        tiny_settings(tiny_model_folder, model={"lora_paths": ["x=/a", "x=/b"]})
    # The adapters wrap the loaded layers: new weights are refused plainly (it was "parameter
    # shapes differ", and passing that check would have served the base model for adapter requests).
    ok, message = engine.update_weights_from_disk(tiny_model_folder)
    assert not ok and "while LoRA adapters are loaded (model.lora_paths)" in message
    assert engine.generate(input_ids=ids, sampling_params=GREEDY, lora_path="a")["output_ids"]

    from framework.engine import Engine

    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        Engine(tiny_settings(tiny_model_folder, model={"lora_paths": [f"x={tmp_path}"]}))


def test_http_lora_path(tiny_model_folder, adapter_folders, tmp_path):
    args = tiny_server_args(tiny_model_folder) + ["--model.lora-paths", f"a={adapter_folders['a']}"]
    with running_server(args, tmp_path / "server.log") as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        body = {"input_ids": [[5, 6, 7], [5, 6, 7]], "sampling_params": GREEDY, "lora_path": ["a", None]}
        resp = http.post("/generate", json=body)
        assert resp.status_code == 200, resp.text
        with_lora, base = (r["output_ids"] for r in resp.json())
        assert with_lora != base

        for bad, message in [("nope", "unknown LoRA adapter 'nope'"), (3, "lora_path: must be a string")]:
            resp = http.post("/generate", json={"input_ids": [5, 6, 7], "lora_path": bad})
            assert resp.status_code == 400, resp.text
            assert message in resp.json()["error"]["message"]


@pytest.mark.parametrize("chunked, expected", [(8192, "ChunkCache"), (0, "RadixCache")])
def test_radix_plugin_shares_nothing_while_adapters_are_loaded(chunked, expected):
    from framework.config import Settings
    from framework.memory import ReqToTokenPool, TokenToKVPool
    from plugins.caches import radix

    settings = Settings.load(None, model={"lora_paths": ["a=/adapters/a"]},
                             scheduler={"chunked_prefill_size": chunked})
    cache = radix.create_cache(
        settings=settings, req_to_token_pool=ReqToTokenPool(4, 16),
        token_to_kv_pool=TokenToKVPool(16, torch.float32, 1, 2, 1),
    )
    assert type(cache).__name__ == expected and cache.disable


def test_adapters_take_the_model_off_the_decode_path(tiny_model_folder, adapter_folders):
    """The decode path (framework/model/decode_path.py) calls the layers' kernels itself, so a
    model LoRA wraps must drop a path built before and keep its layers (and their adapters)."""
    from framework.model.lora import LoraManager
    from framework.model.runner import ModelRunner

    runner = ModelRunner(tiny_model_folder, dtype=torch.bfloat16, max_total_tokens=512, packed_weights=True)
    model = runner.model
    if model.decode_path() is None:
        pytest.skip("no decode path for this model here (no C kernels, or no AVX512-BF16 for the packed GEMMs)")
    LoraManager(model, dict(adapter_folders))
    assert model.decode_path() is None


@needs_exact_int_mm
def test_adapters_on_int8_base_weights(make_engine, adapter_folders, monkeypatch):
    """model.quantization = "w8a8" with adapters: the wrapped projections run their base product in
    int8 and add the adapter's delta in bf16; a batch large enough for the int8 GEMMs serves
    adapter and base requests, leak-checked, and an adapter changes its requests' outputs."""
    calls = count_int_mm_rows(monkeypatch)
    names = sorted(adapter_folders)
    engine = make_engine(model={"dtype": "bfloat16", "quantization": "w8a8",
                                "lora_paths": [f"{n}={p}" for n, p in adapter_folders.items()]})
    prompts = [[5 + i, 7, 9, 11, 13, 17, 19, 23] for i in range(8)]
    loras = [names[0] if i % 2 else None for i in range(len(prompts))]
    outs = engine.generate(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 4}, lora_path=loras)
    assert calls and max(calls) >= 32  # the prefill's 64 rows went through the int8 GEMMs
    base = engine.generate(input_ids=prompts[1], sampling_params={**GREEDY, "max_new_tokens": 4},
                           return_logprob=True)
    adapted = engine.generate(input_ids=prompts[1], sampling_params={**GREEDY, "max_new_tokens": 4},
                              lora_path=names[0], return_logprob=True)
    assert all(len(o["output_ids"]) == 4 for o in outs)
    first = [o["meta_info"]["output_token_logprobs"][0][0] for o in (base, adapted)]
    assert first[0] != first[1]  # the adapter's delta reaches the logits
