"""Structured output (framework/grammar.py): the grammar queue and cache, masked decoding on the tiny
random llama, jump-forward, bad schemas and regexes."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
import torch

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
    calls = _count_compiles(engine.scheduler.structured.backend)
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
    inner = sched.structured.backend.compile_fn

    def slow(key):
        assert release.wait(60), "test never released the compilation"
        return inner(key)

    sched.structured.backend.compile_fn = slow
    ids = engine.tokenizer.encode("Reply:")
    sched.send(GenerateReqInput("slow", ids, _params(temperature=0, max_new_tokens=24, regex=REGEXES[2])))
    sched.send(GenerateReqInput("plain", ids, _params(temperature=0, max_new_tokens=8)))
    outputs = engine._outputs

    def finished(rid):
        return rid in outputs and outputs[rid].finished_reason is not None

    try:
        _drive_until(engine, lambda: finished("plain"))
        # The plain request ran to the end while the grammar was still compiling.
        assert [r.rid for r in sched.structured.queue] == ["slow"]
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

    engine.scheduler.structured.backend.compile_fn = broken
    out = engine.generate("Reply:", sampling_params={"max_new_tokens": 8, "regex": "a+"})
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "broken on purpose" in reason["message"]
    assert out["output_ids"] == []


def test_abort_in_the_grammar_queue(make_engine):
    engine = make_engine()
    sched = engine.scheduler
    release = threading.Event()
    inner = sched.structured.backend.compile_fn
    sched.structured.backend.compile_fn = lambda key: (release.wait(60), inner(key))[1]
    ids = engine.tokenizer.encode("Reply:")
    sched.send(GenerateReqInput("g", ids, _params(max_new_tokens=8, regex="b+")))
    sched.run_once()
    assert [r.rid for r in sched.structured.queue] == ["g"]
    sched.send(AbortReq("g"))
    sched.run_once()
    release.set()
    assert sched.structured.queue == []
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


def _nested_arrays(depth: int) -> str:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return json.dumps(schema)


@pytest.mark.parametrize(
    "params, message",
    [
        # parsing takes ~depth^3 (600 levels: 16 s on the tokenizer's one thread)
        ({"json_schema": _nested_arrays(600)}, "nested more than 64 levels deep"),
        ({"json_schema": "[" * 100000 + "]" * 100000}, "nested more than 64 levels deep"),
        # a forced text of ten million characters, searched at every step by jump-forward
        ({"regex": "g{10000000}"}, "a repetition count of 10000000 is above 1000"),
        ({"regex": "x{2,2000}y"}, "a repetition count of 2000 is above 1000"),
        ({"json_schema": '{"type": "string", "pattern": "g{5000}"}'}, "`pattern` 'g{5000}': a repetition count"),
        # what xgrammar ignores (a warning on stderr only), so the output would not follow it
        ({"json_schema": '{"not": {}}'}, "the keyword `not` is not supported"),
        ({"json_schema": '{"$ref": "http://example.com/s.json"}'}, "`$ref` to another document"),
        ({"json_schema": '{"type": "string", "pattern": "(?=a)b"}'}, "Lookahead is not supported"),
        # each count within the bound, but jump-forward's search of the forced text took minutes
        ({"regex": "((a{1000}){1000}){1000}"}, "nested repetition counts multiply to 1000000, above 100000"),
        ({"json_schema": '{"type": "string", "pattern": "(b{400}){400}"}'}, "nested repetition counts multiply"),
        # jump-forward's search is quadratic in the forced items (10,000: 9 s in the scheduler loop)
        ({"json_schema": '{"type": "array", "items": {"const": "a"}, "minItems": 100000}'},
         "`minItems` 100000 is above 1000"),
        # schemas that allow no value: xgrammar takes them and the output ("", "{}") does not conform
        ({"json_schema": '{"anyOf": []}'}, "`anyOf` is empty: the schema allows no value"),
        ({"json_schema": '{"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"],'
                         ' "additionalProperties": false}'}, "required property 'b' is not in `properties`"),
        # what xgrammar ignores with a warning on stderr only
        ({"json_schema": '{"allOf": [{"type": "string"}, {"type": "integer"}]}'}, "`allOf` with more than one"),
        ({"json_schema": '{"type": "number", "multipleOf": 0.5}'}, "`multipleOf` is only supported"),
        ({"json_schema": '{"type": "string", "pattern": "a+", "minLength": 3}'}, "`minLength`/`maxLength` with"),
    ],
    ids=["deep-schema", "deep-json", "huge-repeat", "repeat-range", "pattern-repeat", "not", "remote-ref",
         "pattern-lookahead", "nested-repeat", "pattern-nested-repeat", "min-items", "empty-anyof",
         "required-not-allowed", "allof", "multipleof-number", "pattern-and-length"],
)
def test_grammar_input_beyond_the_bounds_is_refused(params, message):
    started = time.perf_counter()
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams.from_dict(params).verify()
    assert time.perf_counter() - started < 5  # refused before xgrammar parses it


@pytest.mark.parametrize(
    "params",
    [
        {"json_schema": _nested_arrays(60)},
        {"regex": r"\d{4}-\d{2}-\d{2}, [a-z]{1,1000}\{5000\}[{5000}]"},
        {"json_schema": '{"type": "object", "properties": {"not": {"type": "string", "pattern": "[0-9]{1,3}"}},'
                        ' "$defs": {"a": {"type": "integer"}}, "$ref": "#/$defs/a"}'},
        {"regex": r"((\d{1,3}\.){3}\d{1,3}|(a{1000}){100})"},
        {"json_schema": '{"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 3},'
                        ' "s": {"allOf": [{"type": "string", "maxLength": 4}]}, "l": {"type": "array", "items": {"type": "integer"}, "minItems": 1000}},'
                        ' "required": ["n"], "additionalProperties": false}'},
    ],
    ids=["60-deep", "escaped-and-class-braces", "property-named-not", "nested-repeat-within", "supported-keywords"],
)
def test_grammar_input_within_the_bounds_is_taken(params):
    SamplingParams.from_dict(params).verify()


def test_a_bad_schemas_message_is_short():
    """xgrammar echoes the whole input and its C++ check; the 400's message keeps the reason."""
    with pytest.raises(ValueError) as caught:
        SamplingParams.from_dict({"json_schema": '{"type": "objectx", "description": "' + "x" * 100000 + '"}'}).verify()
    message = str(caught.value)
    assert len(message) < 400 and "Check failed" not in message and ".cc:" not in message, message


JUMP_REGEXES = [
    r"The answer is (red|green|blue)\. Confidence: [0-9]{1,2} percent\.",
    r"\{\"name\": \"[a-z]{2,6}\", \"age\": [0-9]{1,2}\}",
]


JUMP_PROMPTS = ["Reply:", "Describe a person:"]
# Greedy, greedy with penalties (their rows must see only the drafts before them), seeded sampling
# (a draft row draws with the seed step of its output position).
JUMP_PARAMS = [
    {"temperature": 0},
    {"temperature": 0, "frequency_penalty": 0.7, "repetition_penalty": 1.3},
    {"temperature": 1.0, "top_p": 0.9, "seed": 11},
]


@pytest.mark.parametrize(
    "sections",
    [
        {},
        {"scheduler": {"enable_mixed_chunk": True}},
        {"plugins": {"cache": "chunk", "policy": "fcfs"}},
        # 12 requests: retracted while more than 10 run, and re-prefilled with their outputs.
        {"scheduler": {"force_retract": True}},
    ],
    ids=["radix", "mixed-chunk", "chunk-cache", "retract"],
)
def test_jump_forward_gives_the_outputs_of_plain_decoding(make_engine, sections):
    """Random weights spell forced text unlike the tokenizer, so the drafts are both kept and
    replaced here; the outputs must still be those of plain constrained decoding, token for token."""
    prompts = [p for p in JUMP_PROMPTS for _ in JUMP_PARAMS] * len(JUMP_REGEXES)
    params = [
        {**extra, "max_new_tokens": 64, "regex": regex}
        for regex in JUMP_REGEXES for _ in JUMP_PROMPTS for extra in JUMP_PARAMS
    ]
    scheduler = {**sections.get("scheduler", {})}
    plugins = {"worker": "tp", **sections.get("plugins", {})}
    plain_engine = make_engine(plugins=plugins, scheduler={**scheduler, "enable_jump_forward": False})
    plain = plain_engine.generate(prompts, sampling_params=params)
    # Jump-forward is off with a pipelined worker (as in the reference): it runs on the plain one.
    engine = make_engine(plugins=plugins, scheduler=scheduler)  # jump-forward is on by default
    jumped = engine.generate(prompts, sampling_params=params)
    for p, j, param in zip(plain, jumped, params):
        assert re.fullmatch(param["regex"], j["text"]), j["text"]
        assert (j["output_ids"], j["text"]) == (p["output_ids"], p["text"]), param
        assert p["meta_info"]["completion_tokens_wo_jump_forward"] == p["meta_info"]["completion_tokens"]
    sched = engine.scheduler
    assert sched.structured.num_draft_tokens_kept > 0 and sched.structured.num_draft_tokens_dropped > 0
    kept = sum(j["meta_info"]["completion_tokens"] - j["meta_info"]["completion_tokens_wo_jump_forward"]
               for j in jumped)
    assert kept == sched.structured.num_draft_tokens_kept
    # Drafts are computed in the decode step itself (no re-prefill pass), so passes are saved
    # (29 -> 18 here).
    assert sched.forward_ct < plain_engine.scheduler.forward_ct


def test_jump_forward_drafts_and_their_masks(default_tokenizer):
    """The forced text after SmolLM2's sampled "{" is encoded on its own (the sampled "{" is never
    re-encoded with it) and accepted by the matcher, with the bitmask of each draft's position."""
    import xgrammar as xgr

    from framework.grammar import GRAMMAR_KEY, GrammarBackend, jump_forward_drafts
    from framework.request import Req

    schema = '{"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}'
    vocab_size = len(default_tokenizer)
    backend = GrammarBackend(default_tokenizer, vocab_size)
    try:
        grammar = backend.make_grammar(backend.submit(("json", schema)))
    finally:
        backend.shutdown()
    req = Req("r", [1], _params(max_new_tokens=64))
    req.stash[GRAMMAR_KEY] = grammar
    req.output_ids = default_tokenizer.encode("{", add_special_tokens=False)
    assert grammar.accept_drafts(req.output_ids, vocab_size) is not None
    tokens, masks = jump_forward_drafts(req, default_tokenizer, vocab_size)
    assert [default_tokenizer.decode([i]) for i in tokens] == ['"', "name", '":', ' "']
    assert masks.shape == (len(tokens), (vocab_size + 31) // 32)
    # Each draft is allowed by its own row's mask; the rows differ (the grammar moved on).
    logits = torch.zeros((len(tokens), vocab_size))
    xgr.apply_token_bitmask_inplace(logits, masks)
    assert all(logits[r, t] == 0 for r, t in enumerate(tokens))
    assert logits[0, tokens[1]] == float("-inf")
    # The matcher is past the forced text: the free string value comes next.
    assert grammar.jump_forward_string() == ""
    assert jump_forward_drafts(req, default_tokenizer, vocab_size) is None
    # No room for drafts plus the token after them: nothing is jumped.
    req.sampling_params.max_new_tokens = len(req.output_ids) + 1
    grammar.rollback(len(tokens))
    assert jump_forward_drafts(req, default_tokenizer, vocab_size) is None


def test_draft_check_settles_at_the_first_disagreement():
    from framework.batch import DraftCheck, SamplingBatchInfo

    info = SamplingBatchInfo.from_reqs([])
    check = DraftCheck(lens=[0, 3, 2], tokens=[5, 6, 7, 8, 9], sampling_info=info)
    # Request 1 agrees with 5, then samples 4 for 6; request 2 agrees with both drafts.
    next_ids, kept = check.settle([5, 4, 7, 8, 9], [100, 101, 102])
    assert (next_ids, kept) == ([100, 4, 102], [0, 1, 2])
    next_ids, kept = check.settle([1, 6, 7, 8, 0], [100, 101, 102])
    assert (next_ids, kept) == ([100, 1, 0], [0, 0, 1])


def test_dropped_drafts_leave_the_penalty_rows(make_engine):
    """After a pass whose drafts the model partly refused, each request's penalty row counts
    exactly its outputs before the token this pass sampled (the refused drafts are not counted)."""
    from framework.penalties import FrequencyPresencePenalizer, RepetitionPenalizer

    checked, wrong = [], []

    def watch(batch, result, vocab_size):
        if result.kept_draft_tokens is None:
            return
        penalizers = batch.penalties.penalizers
        for i, req in enumerate(batch.reqs):
            before = req.output_ids[:-1]
            counts = torch.zeros(vocab_size)
            counts.index_add_(0, torch.tensor(before, dtype=torch.int64), torch.ones(len(before)))
            seen = torch.zeros(vocab_size, dtype=torch.bool)
            seen[req.origin_input_ids + before] = True
            ok = torch.equal(penalizers[FrequencyPresencePenalizer].counts[i], counts)
            ok &= torch.equal(penalizers[RepetitionPenalizer].seen[i], seen)
            (checked if ok else wrong).append(len(before))

    # The penalty rows are the core's, which observers only see through a read-only view: spy.
    engine = make_engine(plugins={"worker": "tp"})
    sched = engine.scheduler
    process = sched.process_batch_result

    def spy(batch, handle):
        process(batch, handle)
        watch(batch, handle.result(), sched.worker.vocab_size)

    sched.process_batch_result = spy
    params = {"temperature": 0, "max_new_tokens": 64, "frequency_penalty": 0.5, "repetition_penalty": 1.2}
    outs = engine.generate(JUMP_PROMPTS * 2, sampling_params=[{**params, "regex": r} for r in JUMP_REGEXES * 2])
    for regex, out in zip(JUMP_REGEXES * 2, outs):
        assert re.fullmatch(regex, out["text"]), out["text"]
    assert engine.scheduler.structured.num_draft_tokens_dropped > 0
    assert checked and not wrong, wrong


@pytest.mark.parametrize("explicit", [False, True])
def test_pipelined_worker_does_not_jump(make_engine, caplog, explicit):
    """On by default, but the overlap worker cannot jump (reference J1): it says so only when the
    setting was asked for explicitly."""
    caplog.set_level("INFO", logger="framework.scheduler")
    engine = make_engine(plugins={"worker": "overlap"}, scheduler={"enable_jump_forward": True} if explicit else {})
    sched = engine.scheduler
    assert sched.settings.scheduler.enable_jump_forward and sched.worker.is_pipelined
    assert not sched.structured.enable_jump_forward
    assert ("Jump-forward is off" in caplog.text) == explicit
    out = engine.generate("Reply:", sampling_params={"temperature": 0, "max_new_tokens": 64, "regex": JUMP_REGEXES[0]})
    assert re.fullmatch(JUMP_REGEXES[0], out["text"])
    meta = out["meta_info"]
    assert meta["completion_tokens_wo_jump_forward"] == meta["completion_tokens"]
    assert sched.structured.num_draft_tokens_kept == 0


def test_draft_length_follows_what_the_model_keeps(make_engine):
    """After the model refuses a draft, the request's next jump proposes at most one more than it
    kept (a refused draft is a token computed for nothing); after a full accept it may grow again."""
    engine = make_engine(plugins={"worker": "tp"})
    sched = engine.scheduler
    events: list[tuple[str, int, int]] = []
    settle = sched.structured.settle_drafts

    def spy(batch, kept):
        events.extend((r.rid, r.num_draft_tokens, k) for r, k in zip(batch.reqs, kept) if r.num_draft_tokens)
        settle(batch, kept)

    sched.structured.settle_drafts = spy
    params = [{"temperature": 0, "max_new_tokens": 64, "regex": r} for r in JUMP_REGEXES]
    engine.generate(JUMP_PROMPTS, sampling_params=params)
    after_refusal = 0
    for rid in {e[0] for e in events}:
        mine = [(n, k) for r, n, k in events if r == rid]
        for (n0, k0), (n1, _) in zip(mine, mine[1:]):
            if k0 < n0:
                assert n1 <= k0 + 1, mine
                after_refusal += 1
    assert after_refusal > 0


def test_grammar_cache_keeps_the_most_recently_used():
    """Every distinct schema would otherwise stay compiled in the scheduler for good."""
    from framework.grammar import GrammarBackend

    backend = GrammarBackend(None, 10, compile_fn=lambda key: key[1], max_cached=3)
    try:
        first = backend.submit(("regex", "a"))
        for text in ("b", "c"):
            backend.submit(("regex", text))
        assert backend.submit(("regex", "a")) is first  # a hit moves "a" to the recent end
        backend.submit(("regex", "d"))  # drops "b", the least recently used
        assert list(backend.cache) == [("regex", "c"), ("regex", "a"), ("regex", "d")]
        assert backend.submit(("regex", "a")).result() == "a"
    finally:
        backend.shutdown()


def test_min_new_tokens_yields_to_a_complete_grammar(make_engine):
    """Once the grammar allows only its end, min_new_tokens (which masks the end) yields: the
    output follows the grammar and ends there, rather than a token no mask allowed."""
    engine = make_engine()
    regex = r"(yes|no)\."
    params = [{"temperature": t, "seed": 5, "max_new_tokens": 12, "min_new_tokens": 10, "regex": regex}
              for t in (0.0, 1.0)]
    for out in engine.generate(["Is it raining?"] * 2, sampling_params=params):
        assert re.fullmatch(regex, out["text"]), out["text"]
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out["meta_info"]


def test_jump_forward_keeps_stop_token_ids(make_engine):
    """A stop token inside the forced text ends the request where plain decoding ends it: requests
    with stop_token_ids are not jumped (a kept draft would carry the stop token past its check)."""
    regex = JUMP_REGEXES[0]
    plain = make_engine(plugins={"worker": "tp"}, scheduler={"enable_jump_forward": False})
    jumped = make_engine(plugins={"worker": "tp"})
    base = {"temperature": 0, "max_new_tokens": 32, "regex": regex}
    # Each token of the output (drafts kept by jump-forward among them) as a stop token in turn.
    tokens = sorted(set(plain.generate("Reply:", sampling_params=base)["output_ids"][:-1]))
    params = [{**base, "stop_token_ids": [token]} for token in tokens]
    want = plain.generate(["Reply:"] * len(params), sampling_params=params)
    got = jumped.generate(["Reply:"] * len(params), sampling_params=params)
    assert all(o["meta_info"]["finish_reason"].get("matched") == p["stop_token_ids"][0] for o, p in zip(want, params))
    assert [o["output_ids"] for o in got] == [o["output_ids"] for o in want]


def test_a_long_forced_string_is_jumped_once(default_tokenizer):
    """A forced string over MAX_JUMP_CHARS is encoded only as far as the drafts go, and the
    request then decodes plainly: its grammar is not searched for the string at every step."""
    from framework.grammar import (GRAMMAR_KEY, LONG_JUMP_KEY, MAX_JUMP_CHARS, GrammarBackend,
                                   jump_forward_drafts)
    from framework.request import Req

    vocab_size = len(default_tokenizer)
    backend = GrammarBackend(default_tokenizer, vocab_size)
    try:
        grammar = backend.make_grammar(backend.submit(("regex", "(ab{1000}){5}c")))
    finally:
        backend.shutdown()
    assert len(grammar.jump_forward_string()) > MAX_JUMP_CHARS
    req = Req("r", [1], _params(max_new_tokens=100))
    req.stash[GRAMMAR_KEY] = grammar
    encoded = []
    real_encode = default_tokenizer.encode
    try:
        default_tokenizer.encode = lambda text, **kw: encoded.append(len(text)) or real_encode(text, **kw)
        tokens, _ = jump_forward_drafts(req, default_tokenizer, vocab_size, limit=8)
    finally:
        default_tokenizer.encode = real_encode
    assert len(tokens) == 8 and encoded == [8 * 64]
    assert req.stash.get(LONG_JUMP_KEY) and jump_forward_drafts(req, default_tokenizer, vocab_size) is None
