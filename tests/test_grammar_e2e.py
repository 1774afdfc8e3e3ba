"""Structured output on the real SmolLM2 model: JSON-schema and regex requests in one batch on the
plain worker, the overlap worker giving the same outputs, and jump-forward (plain worker only)
giving the same outputs as plain constrained decoding (issue #6)."""

from __future__ import annotations

import json
import re

import pytest

from framework.engine import Engine
from tests.conftest import assert_no_leak, tiny_settings

pytestmark = pytest.mark.e2e

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
REGEX = r"(Monday|Tuesday|Friday), the [1-9]th of (May|June)"
PEOPLE = ["Alice", "Bob", "Chen", "Dana", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Juno"]


def _check_person(obj) -> None:
    """The schema above, by hand (jsonschema is not a dependency)."""
    assert isinstance(obj, dict) and set(obj) == {"name", "age", "city"}, obj
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 12
    assert isinstance(obj["age"], int) and not isinstance(obj["age"], bool)
    assert obj["city"] in ("Paris", "Rome", "Oslo")


def _chat_prompt(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


def _engine(folder, worker="tp", **scheduler):
    return Engine(tiny_settings(folder, model={"dtype": "float32"}, cache={"max_total_tokens": 8192},
                                plugins={"worker": worker}, scheduler=scheduler))


@pytest.fixture(scope="module")
def prompts(default_tokenizer):
    return [_chat_prompt(default_tokenizer, f"Describe {p}, who lives in a European city, as JSON "
                                            "with name, age and city.") for p in PEOPLE * 2]


def _run(engine, prompts, tokenizer):
    params = [{"temperature": 0, "max_new_tokens": 64, "json_schema": json.dumps(SCHEMA)}] * len(prompts)
    regex_prompt = _chat_prompt(tokenizer, "When is the meeting?")
    params.append({"temperature": 0, "max_new_tokens": 32, "regex": REGEX})
    outs = engine.generate(prompts + [regex_prompt], sampling_params=params)
    assert_no_leak(engine)
    return outs


@pytest.fixture(scope="module")
def plain(default_model_folder, default_tokenizer, prompts):
    engine = _engine(default_model_folder, enable_jump_forward=False)
    try:
        yield _run(engine, prompts, default_tokenizer)
    finally:
        engine.shutdown()


def test_json_schema_and_regex_outputs_are_valid(plain):
    for out in plain[:-1]:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        _check_person(json.loads(out["text"]))
    assert re.fullmatch(REGEX, plain[-1]["text"]), plain[-1]["text"]


def test_overlap_worker_gives_the_same_outputs(plain, default_model_folder, default_tokenizer, prompts):
    """The pipelined worker fills each batch's mask after the previous result (DUMMY_FIRST)."""
    engine = _engine(default_model_folder, worker="overlap")
    try:
        assert engine.scheduler.worker.is_pipelined
        overlapped = _run(engine, prompts, default_tokenizer)
    finally:
        engine.shutdown()
    assert [o["output_ids"] for o in overlapped] == [p["output_ids"] for p in plain]


def test_jump_forward_gives_the_same_greedy_text(plain, default_model_folder, default_tokenizer, prompts):
    engine = _engine(default_model_folder)  # jump-forward is on by default with the tp worker
    try:
        jumped = _run(engine, prompts, default_tokenizer)
        sched = engine.scheduler
        kept, dropped = sched.structured.num_draft_tokens_kept, sched.structured.num_draft_tokens_dropped
    finally:
        engine.shutdown()
    for out in jumped[:-1]:
        _check_person(json.loads(out["text"]))
    assert re.fullmatch(REGEX, jumped[-1]["text"]), jumped[-1]["text"]
    # The forced text's tokens are drafts the next decode step checks against the model, so every
    # output is plain constrained decoding's, token for token: also the regex one, where the model
    # spells "Monday, the" as "M", "ond", "ay", ",", " ", "th", "e", not as the tokenizer would.
    assert [(j["text"], j["output_ids"]) for j in jumped] == [(p["text"], p["output_ids"]) for p in plain]
    for j in jumped[:-1]:
        meta = j["meta_info"]
        assert meta["completion_tokens"] - meta["completion_tokens_wo_jump_forward"] > 0, meta
    assert kept > 0 and dropped > 0, (kept, dropped)
