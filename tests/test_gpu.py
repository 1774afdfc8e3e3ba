"""The engine on a GPU (`worker.device = "cuda"`, docs/parallelism.md): fp32 greedy outputs equal
transformers' on the tiny model, with the plain and the overlap worker; bfloat16 generates; sampling
with every filter, the penalties and a seed runs, and prompt logprobs equal transformers'; regex and
JSON-schema outputs follow their constraints. Every
engine is leak-checked by `make_engine`.

Skipped where CUDA is not available; `.ci/gpu_check.sh` runs this file on a machine with a GPU.
BATCHYARD_GPU_CHECK_DEVICE=cpu runs the same checks on the CPU, to check the test itself."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

from framework import hookimpl
from framework.model.loader import load_tokenizer
from plugins.workers.overlap import OverlapWorker
from tests.conftest import assert_same_greedy, hf_greedy

DEVICE = os.environ.get("BATCHYARD_GPU_CHECK_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
)

# With chunks of 64 and 256 prefill tokens per batch, the longer prompts are prefilled in chunks
# over several batches while the shorter ones already decode.
PROMPT_LENS = [5, 31, 64, 97, 250, 600]
NEW = 16
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
SMALL_CHUNKS = {"chunked_prefill_size": 64, "max_prefill_tokens": 256}


@pytest.fixture(scope="session")
def default_tokenizer(request):
    """Overrides conftest's: BATCHYARD_GPU_CHECK_TOKENIZER names a folder with only the default
    model's tokenizer files, which gpu_check.sh carries since the 98 MB GGUF is too big to."""
    folder = os.environ.get("BATCHYARD_GPU_CHECK_TOKENIZER") or request.getfixturevalue("default_model_folder")
    return load_tokenizer(folder)


@pytest.fixture(scope="module")
def prompts(default_tokenizer):
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, len(default_tokenizer), (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def reference(hf_tiny, prompts):
    return [hf_greedy(hf_tiny, p, NEW) for p in prompts]


class BatchCounter:
    """Counts batches by forward mode, and decode batches of several requests."""

    def __init__(self):
        self.modes: dict[str, int] = {}
        self.num_batched_decodes = 0

    @hookimpl
    def on_batch_result(self, batch, result):
        name = batch.forward_mode.name
        self.modes[name] = self.modes.get(name, 0) + 1
        if batch.forward_mode.is_decode() and len(batch.reqs) > 1:
            self.num_batched_decodes += 1


def assert_placed(engine, dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> None:
    """The weights (in `dtype`) and the KV pool (in `kv_dtype`, default `dtype`) are on DEVICE."""
    weight = next(engine.scheduler.worker.runner.model.parameters())
    pool = engine.scheduler.token_to_kv_pool
    assert (weight.device.type, weight.dtype) == (DEVICE, dtype)
    assert (pool.k_buffer[0].device.type, pool.dtype) == (DEVICE, kv_dtype or dtype)


@pytest.mark.parametrize("worker", ["tp", "overlap"])
def test_fp32_greedy_equals_transformers(make_engine, hf_tiny, prompts, reference, worker):
    counter = BatchCounter()
    engine = make_engine(
        extra_plugins=(counter,), plugins={"worker": worker}, worker={"device": DEVICE}, scheduler=SMALL_CHUNKS
    )
    assert isinstance(engine.scheduler.worker, OverlapWorker) == (worker == "overlap")
    assert_placed(engine, torch.float32)
    outputs = [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=GREEDY)]
    ties = assert_same_greedy({f"{worker} on {DEVICE}": outputs}, prompts, reference, hf_tiny)
    assert ties <= 2
    assert counter.modes.get("EXTEND", 0) > len(prompts)  # the long prompts took several chunks
    assert counter.num_batched_decodes > 0


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e5m2"])
def test_bfloat16_generates(make_engine, prompts, default_tokenizer, kv_cache_dtype):
    engine = make_engine(model={"dtype": "bfloat16", "kv_cache_dtype": kv_cache_dtype}, worker={"device": DEVICE},
                         scheduler=SMALL_CHUNKS)
    assert_placed(engine, torch.bfloat16, torch.bfloat16 if kv_cache_dtype == "auto" else torch.float8_e5m2)
    results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    for r in results:
        assert len(r["output_ids"]) == NEW
        assert all(0 <= t < len(default_tokenizer) for t in r["output_ids"])


# Every sampling stage: top-k, top-p and min-p filtering, the three penalties, min_new_tokens and a
# seeded draw (twice, so the two rows must agree).
SAMPLED = {
    "max_new_tokens": NEW, "ignore_eos": True, "temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.02,
    "frequency_penalty": 0.5, "presence_penalty": 0.3, "repetition_penalty": 1.2, "min_new_tokens": 4,
}


def test_sampling_and_logprobs(make_engine, hf_tiny, prompts, default_tokenizer):
    engine = make_engine(plugins={"worker": "tp"}, worker={"device": DEVICE}, scheduler=SMALL_CHUNKS)
    # The seeded pair first, so both are prefilled in the first chunk alike: a chunked prefill's
    # roundings can reorder the near-equal probabilities of this random model's tokens.
    params = [{**SAMPLED, "seed": 7}, {**SAMPLED, "seed": 7}, SAMPLED, {**SAMPLED, "top_k": -1, "min_p": 0.0}]
    sampled = engine.generate(input_ids=[prompts[1]] * len(params), sampling_params=params)
    for r in sampled:
        assert len(r["output_ids"]) == NEW
        assert all(0 <= t < len(default_tokenizer) for t in r["output_ids"])
    assert sampled[0]["output_ids"] == sampled[1]["output_ids"]

    # Prompt and output logprobs of a greedy request, the prompt's against transformers'.
    prompt = prompts[2]
    out = engine.generate(input_ids=prompt, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0,
                          top_logprobs_num=3)
    meta = out["meta_info"]
    inputs = meta["input_token_logprobs"]
    assert [e[1] for e in inputs] == prompt and inputs[0][0] is None
    with torch.no_grad():
        ref = torch.log_softmax(hf_tiny(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
    ref = ref.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
    assert torch.allclose(torch.tensor([e[0] for e in inputs[1:]]), ref, atol=1e-3)
    outputs = meta["output_token_logprobs"]
    assert [e[1] for e in outputs] == out["output_ids"]
    assert all(e[0] <= 0 for e in outputs)
    tops = meta["output_top_logprobs"]
    assert len(tops) == NEW and all(len(t) == 3 and t[0][1] == e[1] for t, e in zip(tops, outputs))


def test_regex_and_json_schema_are_followed(make_engine, prompts):
    """Structured output with the vocab masks on the device (xgrammar's GPU path there): a regex
    and a JSON schema, greedy and sampled, in one batch; each output matches its constraint."""
    engine = make_engine(plugins={"worker": "tp"}, worker={"device": DEVICE}, scheduler=SMALL_CHUNKS)
    regex = r"(Mon|Tue|Wed)day at [0-9]{1,2}(am|pm)"
    # Bounded values: the random model could spin out an unbounded integer or string past the budget.
    schema = {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "ok": {"type": "boolean"}},
              "required": ["kind", "ok"], "additionalProperties": False}
    params = [{"max_new_tokens": 32, "temperature": 0, "regex": regex},
              {"max_new_tokens": 48, "temperature": 0.7, "seed": 3, "regex": regex},
              {"max_new_tokens": 48, "temperature": 0, "json_schema": json.dumps(schema)}]
    outs = engine.generate(input_ids=prompts[:3], sampling_params=params)
    for out in outs[:2]:
        assert re.fullmatch(regex, out["text"]), out["text"]
    value = json.loads(outs[2]["text"])
    assert set(value) == {"kind", "ok"} and value["kind"] in ("cat", "dog") and isinstance(value["ok"], bool)
