"""Structured output (framework/grammar.py): the grammar queue and cache, masked decoding on the tiny
random llama, jump-forward, bad schemas and regexes."""

from __future__ import annotations

import re
import threading
import time

import pytest

from framework.grammar import GrammarError
from framework.messages import AbortReq, GenerateReqInput
from framework.request import SamplingParams

REGEXES = [
    r"(yes|no), [0-9]{2,4}",
    r"[a-z]{3,8}@example\.(com|org)",
    r"The answer is (red|green|blue)\.",
    r"\(\d{3}\) \d{3}-\d{4}",
]


def _params(**kw) -> SamplingParams:
    params = SamplingParams(**kw)
    params.verify()
    params.normalize(None)
    return params


def test_regex_greedy_output_matches(make_engine):
    """Random weights produce text in the language under the mask (greedy and sampled)."""
    engine = make_engine()
    greedy = [{"temperature": 0, "max_new_tokens": 48, "regex": r} for r in REGEXES]
    sampled = [{"temperature": 1.0, "seed": 3, "max_new_tokens": 48, "regex": r} for r in REGEXES]
    outs = engine.generate(["Reply:"] * len(REGEXES) * 2, sampling_params=greedy + sampled)
    for regex, out in zip(REGEXES * 2, outs):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        assert re.fullmatch(regex, out["text"]), (regex, out["text"])


def test_unconstrained_requests_in_the_same_batch_are_unchanged(make_engine):
    engine = make_engine()
    plain = {"temperature": 0, "max_new_tokens": 12}
    alone = engine.generate(["Hello there"], sampling_params=plain)[0]
    mixed = engine.generate(
        ["Hello there", "Reply:"],
        sampling_params=[plain, {"temperature": 0, "max_new_tokens": 24, "regex": REGEXES[0]}],
    )
    assert mixed[0]["output_ids"] == alone["output_ids"]
    assert re.fullmatch(REGEXES[0], mixed[1]["text"])


def _count_compiles(backend):
    calls = []
    inner = backend.compile_fn

    def counting(key):
        calls.append(key)
        return inner(key)

    backend.compile_fn = counting
    return calls


def test_same_grammar_compiled_once(make_engine):
    engine = make_engine()
    calls = _count_compiles(engine.scheduler.grammar_backend)
    params = {"temperature": 0, "max_new_tokens": 16}
    engine.generate(["a", "b", "c"], sampling_params={**params, "regex": REGEXES[0]})
    engine.generate(["d"], sampling_params={**params, "regex": REGEXES[0]})
    engine.generate(["e"], sampling_params={**params, "regex": REGEXES[1]})
    assert calls == [("regex", REGEXES[0]), ("regex", REGEXES[1])]


def _drive_until(engine, done, limit_s=120.0):
    """Run the loop until `done()`; the time limit only guards against a hang."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if done():
            return
        engine.scheduler.run_once()
    raise AssertionError("condition not reached")


def test_slow_grammar_does_not_block_other_requests(make_engine):
    engine = make_engine()
    sched = engine.scheduler
    release = threading.Event()
    inner = sched.grammar_backend.compile_fn

    def slow(key):
        assert release.wait(60), "test never released the compilation"
        return inner(key)

    sched.grammar_backend.compile_fn = slow
    ids = engine.tokenizer.encode("Reply:")
    sched.send(GenerateReqInput("slow", ids, _params(temperature=0, max_new_tokens=24, regex=REGEXES[2])))
    sched.send(GenerateReqInput("plain", ids, _params(temperature=0, max_new_tokens=8)))
    outputs = engine._outputs

    def finished(rid):
        return rid in outputs and outputs[rid].finished_reason is not None

    try:
        _drive_until(engine, lambda: finished("plain"))
        # The plain request ran to the end while the grammar was still compiling.
        assert [r.rid for r in sched.grammar_queue] == ["slow"]
        assert not finished("slow")
    finally:
        release.set()
    _drive_until(engine, lambda: finished("slow") and not sched.has_work())
    engine.scheduler.run_once()
    text = engine._to_dict(outputs.pop("slow"))["text"]
    assert re.fullmatch(REGEXES[2], text), text
    outputs.pop("plain")


def test_failed_compilation_finishes_the_request_with_its_error(make_engine):
    engine = make_engine()

    def broken(key):
        raise GrammarError("regex: invalid: broken on purpose")

    engine.scheduler.grammar_backend.compile_fn = broken
    out = engine.generate("Reply:", sampling_params={"max_new_tokens": 8, "regex": "a+"})
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "broken on purpose" in reason["message"]
    assert out["output_ids"] == []


def test_abort_in_the_grammar_queue(make_engine):
    engine = make_engine()
    sched = engine.scheduler
    release = threading.Event()
    inner = sched.grammar_backend.compile_fn
    sched.grammar_backend.compile_fn = lambda key: (release.wait(60), inner(key))[1]
    ids = engine.tokenizer.encode("Reply:")
    sched.send(GenerateReqInput("g", ids, _params(max_new_tokens=8, regex="b+")))
    sched.run_once()
    assert [r.rid for r in sched.grammar_queue] == ["g"]
    sched.send(AbortReq("g"))
    sched.run_once()
    release.set()
    assert sched.grammar_queue == []
    assert engine._outputs.pop("g").finished_reason.to_json()["type"] == "abort"
    _drive_until(engine, lambda: not sched.has_work())
    sched.run_once()


@pytest.mark.parametrize(
    "params, field",
    [
        ({"regex": "(abc"}, "regex"),
        ({"json_schema": '{"type": "objectx"}'}, "json_schema"),
        ({"json_schema": "not json"}, "json_schema"),
        ({"json_schema": {"type": "object"}}, "json_schema"),
        ({"regex": "a", "json_schema": '{"type": "object"}'}, "regex and json_schema"),
    ],
)
def test_bad_grammar_is_a_value_error(params, field):
    """Checked when the parameters are verified, before anything is queued (Engine and HTTP)."""
    with pytest.raises(ValueError, match=re.escape(field)):
        SamplingParams.from_dict(params).verify()


JUMP_REGEXES = [
    r"The answer is (red|green|blue)\. Confidence: [0-9]{1,2} percent\.",
    r"\{\"name\": \"[a-z]{2,6}\", \"age\": [0-9]{1,2}\}",
]


def test_jump_forward_appends_forced_text(make_engine):
    """Random weights: the forced text is appended and the output stays in the language. The free
    choices after a jump may differ from plain decoding where random weights spell the forced text
    unlike the tokenizer (equality is checked on the real model, tests/test_grammar_e2e.py)."""
    prompts = ["Reply:", "Describe a person:"]
    params = [{"temperature": 0, "max_new_tokens": 64, "regex": r} for r in JUMP_REGEXES]
    plain = make_engine().generate(prompts, sampling_params=params)
    # Jump-forward is off with a pipelined worker (as in the reference): it runs on the plain one.
    jumped = make_engine(plugins={"worker": "tp"}, scheduler={"enable_jump_forward": True}).generate(
        prompts, sampling_params=params
    )
    for regex, p, j in zip(JUMP_REGEXES, plain, jumped):
        assert re.fullmatch(regex, j["text"]), j["text"]
        assert re.fullmatch(regex, p["text"]), p["text"]
        meta = j["meta_info"]
        # Forced text was appended, not sampled.
        assert meta["completion_tokens_wo_jump_forward"] < meta["completion_tokens"]
        assert p["meta_info"]["completion_tokens_wo_jump_forward"] == p["meta_info"]["completion_tokens"]


def test_jump_keeps_the_sampled_tokens_and_leaves_the_last_forced_one(default_tokenizer):
    """Plain decoding on SmolLM2 samples "{" then '"' where the tokenizer would write '{"'; a jump
    must not re-encode the sampled "{" with the forced text, and the forced text's last token
    (' "', which could merge with the free value after it) is left to the model."""
    from framework.grammar import GRAMMAR_KEY, GrammarBackend, jump_forward_ids
    from framework.request import Req

    schema = '{"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}'
    backend = GrammarBackend(default_tokenizer, len(default_tokenizer))
    try:
        grammar = backend.make_grammar(backend.submit(("json", schema)))
    finally:
        backend.shutdown()
    req = Req("r", [1], _params(max_new_tokens=64))
    req.stash[GRAMMAR_KEY] = grammar
    req.output_ids = default_tokenizer.encode("{", add_special_tokens=False)
    assert grammar.accept_tokens(req.output_ids)
    new_ids = jump_forward_ids(req, default_tokenizer)
    assert new_ids is not None and new_ids[:1] == req.output_ids
    assert [default_tokenizer.decode([i]) for i in new_ids] == ["{", '"', "name", '":']
    # The matcher moved with the jump: only ' "' is forced now, and one token is not jumped.
    assert grammar.jump_forward_string() == ' "'
    req.output_ids = new_ids
    assert jump_forward_ids(req, default_tokenizer) is None
