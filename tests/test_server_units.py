"""Server pieces without a server: detokenizer, stop-string hold-back, watchdog, sessions, intake."""

from __future__ import annotations

import re
import threading
import time

import pytest

from framework import hookimpl
from framework.messages import (
    CloseSessionReq,
    FlushCacheReq,
    GenerateReqInput,
    GetStatsReq,
    OpenSessionReq,
    ReqOutput,
)
from framework.request import FinishLength, FinishMatchedStr, FinishMatchedToken, SamplingParams
from framework.server.detokenizer import IncrementalDetokenizer, find_printable_text
from framework.server.ipc import freeze_startup_objects
from framework.server.scheduler_process import Watchdog
from framework.server.tokenizer_manager import hold_back_stop_prefix
from framework.sessions import SessionController, SessionError
from tests.conftest import tiny_settings


def _out(ids, reason=None, no_stop_trim=False, rid="r"):
    return ReqOutput(rid=rid, vid=0, output_ids=list(ids), finished_reason=reason, meta_info={},
                     no_stop_trim=no_stop_trim)


# -- detokenizer ----------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["héllo 你好世界 🙂🙂 ok\nnext line", "emoji 👩‍👩‍👧 and ünïcödé — dashes"])
def test_incremental_decode_never_emits_broken_utf8(default_tokenizer, text):
    ids = default_tokenizer.encode(text)
    detok = IncrementalDetokenizer(default_tokenizer)
    final = default_tokenizer.decode(ids)
    shown = []
    for i in range(1, len(ids) + 1):
        reason = FinishLength(len(ids)) if i == len(ids) else None
        shown.append(detok.step(_out(ids[:i], reason)).text)
    for s in shown:
        assert "\ufffd" not in s
        assert final.startswith(s)
    assert shown[-1] == final
    assert not detok.statuses  # finished requests are forgotten


@pytest.mark.parametrize("text, interval", [("日本語ok🎉 and more", 4), ("line\n🎉x🎉y", 3)])
def test_streamed_text_never_shrinks_with_several_tokens_per_output(default_tokenizer, text, interval):
    """With `stream_interval` > 1 an output adds several tokens; one ending in a partial character
    cut the shown text back to its last space, below what the last chunk showed ('日本' -> '')."""
    ids = default_tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(default_tokenizer)
    ends = [*range(1, len(ids), interval), len(ids)]
    shown = [detok.step(_out(ids[:k], FinishLength(k) if k == len(ids) else None)).text for k in ends]
    for before, after in zip(shown, shown[1:]):
        assert after.startswith(before), (before, after)
    assert shown[-1] == text


def _token_reader(tokenizer):
    """A TokenizerManager with only its tokenizer: what token_bytes and decode_token read."""
    from framework.server.tokenizer_manager import TokenizerManager

    tm = TokenizerManager.__new__(TokenizerManager)
    tm.tokenizer = tokenizer
    return tm


UNICODE_TEXTS = ["Emoji: 🎉🎉🎉 and 😀", "中文和日本語のテキスト", "plain ascii, then ünïcödé — and 👩‍👩‍👧"]


@pytest.mark.parametrize("text", UNICODE_TEXTS)
def test_token_bytes_join_into_the_text(default_tokenizer, text):
    """OpenAI's logprob `bytes`: a token holding part of a character decodes to U+FFFD, but its
    bytes are the character's own, so the tokens' bytes join into the text."""
    tm = _token_reader(default_tokenizer)
    ids = default_tokenizer.encode(text, add_special_tokens=False)
    assert any(tm.decode_token(t) == "\ufffd" for t in ids), "no token here holds part of a character"
    assert b"".join(tm.token_bytes(t) for t in ids) == text.encode("utf-8")
    eos = default_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tm.token_bytes(eos) == b"<|im_end|>"


@pytest.mark.parametrize("text", UNICODE_TEXTS)
def test_text_offsets_follow_the_text(default_tokenizer, text):
    """Each token's offset is where its first completed character is in the text; partial tokens
    add nothing, so the offsets end exactly at the text's length (they ran past it, one per
    U+FFFD, before)."""
    from framework.server.openai_api import TextOffsets

    tm = _token_reader(default_tokenizer)
    ids = default_tokenizer.encode(text, add_special_tokens=False)
    at = TextOffsets()
    offsets = [at.advance(tm.token_bytes(t)) for t in ids]
    assert offsets == sorted(offsets) and offsets[0] == 0
    assert at.offset == len(text)
    # A token that completes characters starts where they do.
    for t, start in zip(ids, offsets):
        piece = tm.decode_token(t)
        if "\ufffd" not in piece:
            assert text[start:start + len(piece)] == piece


def test_echo_offsets_count_special_tokens_written_in_a_text_prompt(default_tokenizer):
    """`echo` of a text prompt sends the prompt as given, so a special token written in it as text
    (`<|im_start|>`) takes its characters there; the offsets after it ran that many characters
    short. A special token the text does not hold (here the generated `<|im_end|>`, left out
    of the text by `skip_special_tokens`) still takes none."""
    from framework.server.openai_api import OpenAIFormatter, TextOffsets

    tm = _token_reader(default_tokenizer)
    prompt = "a<|im_start|>b c<|im_end|>"
    end = default_tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = default_tokenizer.encode(prompt, add_special_tokens=False) + [end]
    text = prompt  # (the generated <|im_end|> is skipped)
    lp = OpenAIFormatter(tm).completion_logprobs([(-1.0, t) for t in ids], None, TextOffsets(prompt), True)
    assert [text[o:o + len(t)] for t, o in zip(lp["tokens"][:-1], lp["text_offset"])] == lp["tokens"][:-1]
    assert lp["text_offset"][-1] == len(text)


def test_stop_trimming(default_tokenizer):
    ids = default_tokenizer.encode("alpha beta gamma delta")
    detok = IncrementalDetokenizer(default_tokenizer)
    assert detok.step(_out(ids, FinishMatchedStr("gamma"))).text == "alpha beta "
    assert detok.step(_out(ids, FinishMatchedStr("gamma"), no_stop_trim=True)).text == "alpha beta gamma delta"
    eos = default_tokenizer.eos_token_id
    out = _out(ids + [eos], FinishMatchedToken(eos))
    out.skip_special_tokens = False
    assert detok.step(out).text == "alpha beta gamma delta"


def test_find_printable_text():
    assert find_printable_text("hello wor") == "hello "
    assert find_printable_text("line\n") == "line\n"
    assert find_printable_text("你好") == "你好"
    assert find_printable_text("ab \ufffd") == "ab "
    assert find_printable_text("你\ufffd") == "你"


def test_hold_back_stop_prefix():
    assert hold_back_stop_prefix("hello wo", ["world"]) == "hello "
    assert hold_back_stop_prefix("hello world!", ["world"]) == "hello "
    assert hold_back_stop_prefix("hello", ["xyz"]) == "hello"
    assert hold_back_stop_prefix("a\n", ["\n\n", "zz"]) == "a"


# -- OpenAI request models ----------------------------------------------------------------------------


def test_openai_null_for_an_optional_field_is_its_default():
    """The OpenAI API takes null for every optional field, and the openai client sends
    `temperature=None` as null: it means the default (it was refused with 400 before)."""
    from pydantic import ValidationError

    from framework.server.openai_protocol import ChatCompletionRequest, CompletionRequest

    nulls = {"temperature": None, "top_p": None, "n": None, "presence_penalty": None, "frequency_penalty": None,
             "stream": None, "stream_options": None, "seed": None, "stop": None, "logit_bias": None}
    cmpl = CompletionRequest.model_validate({"model": "m", "prompt": "hi", "max_tokens": None, "echo": None,
                                             **nulls})
    assert (cmpl.temperature, cmpl.top_p, cmpl.n, cmpl.max_tokens, cmpl.echo) == (1.0, 1.0, 1, 16, False)
    chat = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": None}],
                                                 "logprobs": None, "max_completion_tokens": None, **nulls})
    assert (chat.temperature, chat.logprobs, chat.stream, chat.messages[0].content) == (0.7, False, False, None)
    # A required field's null is still refused.
    for body in ({"model": None, "prompt": "hi"}, {"model": "m", "prompt": None}):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate(body)


# -- watchdog ---------------------------------------------------------------------------------------


class FakeScheduler:
    def __init__(self, busy: bool):
        self.cur_batch = object() if busy else None
        self.forward_ct = 0


def test_watchdog_trips_on_a_stuck_forward_only():
    fired = []
    stuck = FakeScheduler(busy=True)
    Watchdog(stuck, 0.2, on_timeout=fired.append).start()
    idle = FakeScheduler(busy=False)
    Watchdog(idle, 0.2, on_timeout=lambda s: fired.append("idle")).start()
    moving = FakeScheduler(busy=True)
    Watchdog(moving, 0.2, on_timeout=lambda s: fired.append("moving")).start()
    stop = threading.Event()

    def advance():
        while not stop.is_set():
            moving.forward_ct += 1
            time.sleep(0.02)

    threading.Thread(target=advance, daemon=True).start()
    time.sleep(0.8)
    stop.set()
    assert len(fired) == 1 and isinstance(fired[0], float) and fired[0] > 0.2


# -- sessions ---------------------------------------------------------------------------------------


class _Req:
    def __init__(self, rid, inputs, outputs, max_new=None):
        self.rid, self.origin_input_ids, self.output_ids = rid, inputs, outputs
        self.sampling_params = SamplingParams(max_new_tokens=max_new)


def test_session_controller_history_and_branching():
    ctl = SessionController()
    assert ctl.open("s") and not ctl.open("s")
    assert ctl.input_ids_for("s", None, [1, 2]) == [1, 2]
    ctl.record("s", None, _Req("a", [1, 2], [3, 4]))
    assert ctl.input_ids_for("s", "a", [5]) == [1, 2, 3, 4, 5]
    ctl.record("s", "a", _Req("b", [1, 2, 3, 4, 5], [6], max_new=1))
    assert ctl.input_ids_for("s", "a", [7]) == [1, 2, 3, 4, 7]  # a branch from "a"...
    assert ctl.input_ids_for("s", "b", [8]) == [1, 2, 3, 4, 5, 6, 8]  # ...refused (never recorded): "b" stays
    assert ctl.input_ids_for("s", None, [9]) == [9]  # a fresh history, refused: the old one stays
    ctl.record("s", "a", _Req("c", [1, 2, 3, 4, 7], [8]))  # the branch admitted: "b" is dropped
    with pytest.raises(SessionError, match="rid b does not exist"):
        ctl.input_ids_for("s", "b", [8])
    assert ctl.input_ids_for("s", "c", [9]) == [1, 2, 3, 4, 7, 8, 9]
    ctl.record("s", None, _Req("d", [9], [10]))  # a fresh history admitted
    with pytest.raises(SessionError, match="rid c does not exist"):
        ctl.input_ids_for("s", "c", [1])
    with pytest.raises(SessionError, match="session id t does not exist"):
        ctl.input_ids_for("t", None, [1])
    assert ctl.close("s") and not ctl.close("s")


def _greedy(sched, max_new_tokens: int) -> SamplingParams:
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    params.normalize(sched.tokenizer)
    return params


def _run_messages(sched, *msgs) -> None:
    """Send `msgs` to the scheduler and run it until it has nothing left, then one idle round."""
    for m in msgs:
        sched.send(m)
    sched.run_once()
    while sched.has_work():
        sched.run_once()
    sched.run_once()


def test_scheduler_control_messages_and_session_intake(tiny_model_folder):
    from framework.scheduler import Scheduler

    outputs, replies = [], []
    sched = Scheduler(tiny_settings(tiny_model_folder), output_sink=outputs.append, reply_sink=replies.append)

    def gen(rid, ids, **kw):
        return GenerateReqInput(rid=rid, input_ids=ids, sampling_params=_greedy(sched, 4), session_id="s1", **kw)

    _run_messages(sched, OpenSessionReq("s1", 10, request_id="o"), gen("t0", [5, 6, 7, 8]))
    _run_messages(sched, gen("t1", [9], session_rid="t0"), gen("bad", [9], session_rid="nope"),
                  CloseSessionReq("s1", request_id="c"), CloseSessionReq("s1", request_id="c2"),
                  FlushCacheReq(request_id="busy"))
    _run_messages(sched, GetStatsReq(request_id="st"), FlushCacheReq(request_id="f"))
    last = {o.rid: o for batch in outputs for o in batch.outputs}
    t0, t1 = last["t0"], last["t1"]
    assert t1.meta_info["prompt_tokens"] == 4 + 4 + 1
    assert t1.meta_info["cached_tokens"] > 0
    assert last["bad"].finished_reason.is_error and not last["bad"].output_ids
    assert "does not exist" in last["bad"].finished_reason.message
    by_id = {r.request_id: r for r in replies}
    assert by_id["o"].success and by_id["c"].success and not by_id["c2"].success
    stats = by_id["st"]
    assert stats.req_slots_free == stats.req_slots_total and stats.num_sessions == 0
    assert stats.kv_available + stats.kv_evictable == stats.max_total_num_tokens
    # A flush only happens with nothing running or waiting (reference R2).
    assert not by_id["busy"].success and by_id["f"].success
    assert t0.output_ids and len(t1.output_ids) == 4
    sched.shutdown()


def test_a_refused_session_request_leaves_the_history(tiny_model_folder):
    """A session request refused at intake (an unknown adapter, a fresh history of a too-long
    input) cuts nothing: the request it would have branched away from can still be continued."""
    from framework.scheduler import Scheduler

    outputs = []
    sched = Scheduler(tiny_settings(tiny_model_folder), output_sink=outputs.append, reply_sink=lambda r: None)

    def gen(rid, ids, **kw):
        return GenerateReqInput(rid=rid, input_ids=ids, sampling_params=_greedy(sched, 2), session_id="s", **kw)

    too_long = [5] * (sched.max_req_len + 1)
    _run_messages(sched, OpenSessionReq("s", 10, request_id="o"), gen("a", [5, 6]))
    _run_messages(sched, gen("b", [7], session_rid="a"))
    _run_messages(sched, gen("x", [8], session_rid="a", lora_path="no-such-adapter"), gen("y", too_long),
                  gen("c", [9], session_rid="b"))
    last = {o.rid: o for batch in outputs for o in batch.outputs}
    assert last["x"].finished_reason.is_error and last["y"].finished_reason.is_error
    assert not last["c"].finished_reason.is_error, last["c"].finished_reason
    assert last["c"].meta_info["prompt_tokens"] == 2 + 2 + 1 + 2 + 1
    sched.shutdown()


class _RefuseRid:
    """Raises in on_request_received for one rid: the plugin's refusal of that request."""

    def __init__(self, rid: str):
        self.rid = rid

    @hookimpl
    def on_request_received(self, req, view):
        if req.rid == self.rid:
            raise ValueError("refused")


def test_a_session_request_refused_by_a_plugin_leaves_the_history(tiny_model_folder):
    """A plugin's refusal at intake is answered 400 like any other refusal, so it cuts nothing:
    the history it would have branched away from can still be continued."""
    from framework.scheduler import Scheduler

    outputs = []
    sched = Scheduler(tiny_settings(tiny_model_folder), output_sink=outputs.append, reply_sink=lambda r: None,
                      extra_plugins=(_RefuseRid("x"),))

    def gen(rid, ids, **kw):
        return GenerateReqInput(rid=rid, input_ids=ids, sampling_params=_greedy(sched, 2), session_id="s", **kw)

    _run_messages(sched, OpenSessionReq("s", 10, request_id="o"), gen("a", [5, 6]))
    _run_messages(sched, gen("b", [7], session_rid="a"))
    _run_messages(sched, gen("x", [8], session_rid="a"), gen("c", [9], session_rid="b"))
    last = {o.rid: o for batch in outputs for o in batch.outputs}
    assert last["x"].finished_reason.is_error and not last["x"].output_ids
    assert not last["c"].finished_reason.is_error, last["c"].finished_reason
    assert last["c"].meta_info["prompt_tokens"] == 2 + 2 + 1 + 2 + 1
    sched.shutdown()


def test_a_session_request_over_the_kv_pool_names_the_pool(tiny_model_folder):
    """The scheduler checks a session request's length (its history is known only there) and named
    the model's context even where the smaller KV pool binds, unlike the server's own check."""
    from framework.scheduler import Scheduler

    outputs = []
    sched = Scheduler(tiny_settings(tiny_model_folder, cache={"max_total_tokens": 100}),
                      output_sink=outputs.append, reply_sink=lambda r: None)
    assert sched.max_total_num_tokens < sched.worker.context_len

    def gen(rid, ids, **kw):
        return GenerateReqInput(rid=rid, input_ids=ids, sampling_params=_greedy(sched, 2), session_id="s", **kw)

    _run_messages(sched, OpenSessionReq("s", 10, request_id="o"), gen("a", [5] * 60))
    _run_messages(sched, gen("b", [6] * 40, session_rid="a"))
    reason = {o.rid: o for batch in outputs for o in batch.outputs}["b"].finished_reason
    assert reason.is_error
    assert "The input (102 tokens) is longer than the KV pool allows (max_total_num_tokens 100" in reason.message
    sched.shutdown()


def test_a_session_request_logprob_start_past_its_input_is_refused(tiny_model_folder):
    """The server checks `logprob_start_len` against the prompt, but a session request's prompt
    (its history included) is known only to the scheduler: it was taken silently, with no prompt
    logprobs, where the same request without a session is refused."""
    from framework.scheduler import Scheduler

    outputs = []
    sched = Scheduler(tiny_settings(tiny_model_folder), output_sink=outputs.append, reply_sink=lambda r: None)

    def gen(rid, ids, **kw):
        return GenerateReqInput(rid=rid, input_ids=ids, sampling_params=_greedy(sched, 2), session_id="s", **kw)

    _run_messages(sched, OpenSessionReq("s", 10, request_id="o"), gen("a", [5, 6]))
    _run_messages(sched, gen("past", [7], session_rid="a", return_logprob=True, logprob_start_len=5),
                  gen("last", [7], session_rid="a", return_logprob=True, logprob_start_len=4))
    last = {o.rid: o for batch in outputs for o in batch.outputs}
    assert last["past"].finished_reason.is_error
    assert "logprob_start_len: must be < the prompt length (5), got 5" in last["past"].finished_reason.message
    assert not last["last"].finished_reason.is_error, last["last"].finished_reason
    sched.shutdown()


# -- docs and example config ------------------------------------------------------------------------


def test_every_endpoint_is_documented(tmp_path):
    from pathlib import Path

    from framework.messages import SchedulerReady
    from framework.metrics import ServerMetrics
    from framework.server.http_server import ServerInfo, build_app
    from framework.server.ipc import IpcNames
    from framework.server.tokenizer_manager import TokenizerManager

    ipc = IpcNames(*(f"ipc://{tmp_path}/{n}" for n in ("t", "s", "d")))
    ready = SchedulerReady(max_total_num_tokens=10, max_req_input_len=5, context_len=10, vocab_size=10, pid=0)
    tm = TokenizerManager(ipc, ready, tokenizer=None, metrics=ServerMetrics("m"))
    try:
        app = build_app(tm, tiny_settings("unused"), ServerInfo("m", "m", "m")).app
        paths = {route.path for route in app.routes}
    finally:
        tm.close()
    doc = (Path(__file__).parent.parent / "docs" / "api.md").read_text()
    headings = [line for line in doc.splitlines() if line.startswith("### ")]
    assert {"/generate", "/v1/chat/completions", "/metrics", "/open_session"} <= paths
    for path in paths:
        path = path.replace(":path}", "}")  # (a converter: model names may hold slashes)
        assert any(f" {path}`" in h or f" {path}," in h for h in headings), f"{path} has no heading in docs/api.md"


def test_example_serve_toml_loads():
    from pathlib import Path

    from framework.config import Settings

    settings = Settings.load(Path(__file__).parent.parent / "docs" / "examples" / "serve.toml")
    assert settings.server.host == "127.0.0.1" and settings.server.port == 30000


# -- start-up objects out of the garbage collector's walks ----------------------------------------


def test_freeze_startup_objects_collects_startup_garbage_then_freezes_the_rest():
    import gc
    import weakref

    class Node:
        pass

    alive, garbage = Node(), Node()
    alive.me, garbage.me = alive, garbage  # both in a reference cycle
    gone = weakref.ref(garbage)
    del garbage
    try:
        frozen = freeze_startup_objects()
        assert gone() is None, "start-up's cyclic garbage must be collected, not frozen"
        # (not equal: another thread of the test process may free a frozen object meanwhile, which
        # leaves the permanent generation; a CI run saw 664,255 then 664,253)
        assert 0 < gc.get_freeze_count() <= frozen
        assert not any(obj is alive for obj in gc.get_objects()), "a live object is still walked"
        later = Node()
        later.me = later
        assert any(obj is later for obj in gc.get_objects()), "objects made afterwards are walked as usual"
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("context_len, pool, binding", [
    (100, 4096, "the model's context length allows (context_len 100)"),
    (8192, 100, "the KV pool allows (max_total_num_tokens 100: cache.max_total_tokens"),
])
def test_a_too_long_input_names_the_limit_that_binds(tmp_path, context_len, pool, binding):
    """A KV pool smaller than the context (cache.max_total_tokens) was reported as the context."""
    from framework.messages import SchedulerReady
    from framework.metrics import ServerMetrics
    from framework.server.ipc import IpcNames
    from framework.server.protocol import ApiError
    from framework.server.tokenizer_manager import TokenizerManager

    ipc = IpcNames(*(f"ipc://{tmp_path}/{n}" for n in ("t", "s", "d")))
    ready = SchedulerReady(max_total_num_tokens=pool, max_req_input_len=94, context_len=context_len, vocab_size=10,
                           pid=0)
    tm = TokenizerManager(ipc, ready, tokenizer=None, metrics=ServerMetrics("m"))
    try:
        tm.check_input_ids([1] * 94, is_session=False)
        with pytest.raises(ApiError, match=re.escape(f"The input (95 tokens) is longer than {binding}")):
            tm.check_input_ids([1] * 95, is_session=False)
    finally:
        tm.close()


def test_metrics_serve_the_last_gauges_while_the_scheduler_is_in_a_long_pass(tmp_path):
    """The scheduler answers between passes; a scrape waits METRICS_STATS_WAIT_S at most, then the
    last gauges serve, and scrapes meanwhile share one round trip instead of queueing more."""
    import asyncio

    from framework.messages import SchedulerReady, SchedulerStats
    from framework.metrics import ServerMetrics
    from framework.server.ipc import IpcNames
    from framework.server.tokenizer_manager import TokenizerManager

    ipc = IpcNames(*(f"ipc://{tmp_path}/{n}" for n in ("t", "s", "d")))
    ready = SchedulerReady(max_total_num_tokens=10, max_req_input_len=5, context_len=10, vocab_size=10, pid=0)
    tm = TokenizerManager(ipc, ready, tokenizer=None, metrics=ServerMetrics("m"))
    asked, answer = [], {"delay": 0.0}

    async def control(make):
        asked.append(1)
        await asyncio.sleep(answer["delay"])
        return SchedulerStats("r", len(asked), 0, 0, 0.0, 0.0, 0.0, 10, 10, 0, 4, 4, 0, 0)

    async def scenario():
        tm.control = control
        assert await tm.refresh_stats(wait_s=1.0)
        answer["delay"] = 3.0  # a long prefill pass
        started = time.monotonic()
        assert not await tm.refresh_stats(wait_s=0.2)
        assert not await tm.refresh_stats(wait_s=0.2)
        assert time.monotonic() - started < 1.5 and len(asked) == 2  # one round trip for both
        assert "batchyard:num_running_reqs" in tm.metrics.render().decode()

    try:
        asyncio.run(scenario())
    finally:
        tm.close()


def test_latencies_of_parallel_samples_count_their_prefix_warm_up(tmp_path):
    """With n > 1 the prompt is first prefilled alone (AD5) and the samples are sent after it: their
    first-token and e2e latencies were counted from then, leaving the prompt's prefill out."""
    import asyncio
    from types import SimpleNamespace

    from framework.messages import SchedulerReady, StrOutput
    from framework.metrics import ServerMetrics
    from framework.server.ipc import IpcNames
    from framework.server.protocol import GenerateBatch, ReqSpec
    from framework.server.tokenizer_manager import TokenizerManager

    ipc = IpcNames(*(f"ipc://{tmp_path}/{n}" for n in ("t", "s", "d")))
    ready = SchedulerReady(max_total_num_tokens=100, max_req_input_len=50, context_len=64, vocab_size=10, pid=0)
    tm = TokenizerManager(ipc, ready, tokenizer=None, metrics=ServerMetrics("m"))
    prefill_s = 0.3

    def finish(rid: str, num_tokens: int) -> None:
        meta = {"prompt_tokens": 3, "completion_tokens": num_tokens}
        tm._on_output(StrOutput(rid, "", [1] * num_tokens, FinishLength(num_tokens), meta), time.monotonic())

    async def scenario():
        loop = asyncio.get_running_loop()

        def send(msg):  # the scheduler: the warm-up takes the prefill, each sample then one step
            if msg.rid.endswith("-prefix"):
                loop.call_later(prefill_s, finish, msg.rid, 0)
            else:
                loop.call_soon(finish, msg.rid, 1)

        tm.send_to_scheduler = SimpleNamespace(send_pyobj=send)
        spec = ReqSpec(rid="a", input_ids=[1, 2, 3], sampling_params=SamplingParams(max_new_tokens=1), stream=True)
        specs = await tm.expand_parallel(GenerateBatch([spec], n=2, stream=True))
        await tm.run_all(specs)

    try:
        asyncio.run(scenario())
    finally:
        tm.close()
    sample = tm.metrics.registry.get_sample_value
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert sample(f"batchyard:{name}_count", {"model_name": "m"}) == 2
        assert sample(f"batchyard:{name}_sum", {"model_name": "m"}) >= 2 * prefill_s, name


def test_the_request_log_has_a_line_for_an_aborted_request(tmp_path, caplog):
    """server.log_requests logs every finished request; one that is aborted before it finishes (its
    client gone, its timeout, a shutdown) had no line, a cut stream no line at all."""
    from types import SimpleNamespace

    from framework.messages import SchedulerReady
    from framework.metrics import ServerMetrics
    from framework.server.ipc import IpcNames
    from framework.server.protocol import ReqSpec
    from framework.server.tokenizer_manager import TokenizerManager

    ipc = IpcNames(*(f"ipc://{tmp_path}/{n}" for n in ("t", "s", "d")))
    ready = SchedulerReady(max_total_num_tokens=100, max_req_input_len=50, context_len=64, vocab_size=10, pid=0)
    tm = TokenizerManager(ipc, ready, tokenizer=None, metrics=ServerMetrics("m"), log_requests=True)
    sent = []
    tm.send_to_scheduler = SimpleNamespace(send_pyobj=sent.append)
    caplog.set_level("INFO", logger="framework.server.tokenizer_manager")
    try:
        tm.submit(ReqSpec(rid="gone", input_ids=[1, 2, 3], sampling_params=SamplingParams(), stream=True))
        tm.release("gone")
    finally:
        tm.close()
    assert [type(m).__name__ for m in sent] == ["GenerateReqInput", "AbortReq"]
    assert re.search(r"Aborted request gone: prompt_tokens=3, completion_tokens=0, [0-9.]+ s", caplog.text)


def test_merge_streams_reads_no_further_ahead_than_the_client():
    """A slow client of an n > 1 (or batch) stream: each request's outputs wait in its state,
    where a newer one replaces the last, until the response takes it. The merge drained them
    into an unbounded queue, each a cumulative copy of the output (quadratic memory)."""
    import asyncio

    from framework.server.streaming import merge_streams

    pulled = [0, 0]

    async def source(i: int):
        for k in range(1000):
            pulled[i] += 1
            yield k
            await asyncio.sleep(0)

    async def scenario():
        merged = merge_streams([source(0), source(1)])
        await merged.__anext__()
        await asyncio.sleep(0.05)  # the client is not reading
        assert sum(pulled) <= 3, pulled  # the item sent and at most one waiting per stream
        seen = [i async for i, _ in merged]
        assert sum(pulled) == 2000 and len(seen) == 1999

    asyncio.run(scenario())


def test_chat_messages_reach_the_template_as_transformers_gives_them(default_tokenizer):
    """The chat prompt's ids are transformers' `apply_chat_template` of the same messages: special
    tokens written in the content are special tokens there too, a trailing assistant message is
    continued, and a message's `name` reaches the template (it was dropped)."""
    import copy

    from framework.server.openai_api import _chat_input_ids
    from framework.server.openai_protocol import ChatCompletionRequest

    tm = _token_reader(default_tokenizer)
    tm.tokenize = lambda text, add_special_tokens=True, name="text": default_tokenizer.encode(
        text, add_special_tokens=add_special_tokens)

    def both(tokenizer, messages):
        tm.tokenizer = tokenizer
        ours = _chat_input_ids(tm, ChatCompletionRequest.model_validate({"model": "m", "messages": messages}))
        cont = messages[-1]["role"] == "assistant"
        ref = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False,
                                            add_generation_prompt=not cont, continue_final_message=cont)
        return ours, ref

    for messages in ([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "a<|im_start|>b"}],
                     [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure, "}]):
        ours, ref = both(default_tokenizer, messages)
        assert ours == ref
    named = copy.copy(default_tokenizer)
    named.chat_template = ("{% for m in messages %}{{ m['role'] }}{% if m['name'] is defined %}({{ m['name'] }})"
                           "{% endif %}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:"
                           "{% endif %}")
    ours, ref = both(named, [{"role": "user", "content": "Hi", "name": "bob"}])
    assert ours == ref and "(bob)" in default_tokenizer.decode(ours)
