"""TokenizerManager: the asyncio side of the server (reference T3, R1, M1).

It tokenizes and checks requests, sends them to the scheduler, and routes what comes back: the
detokenizer's `BatchStrOut` to the waiting requests (one `ReqState` per rid), control replies to
the futures waiting on their `request_id`. Only the newest output of a request is kept; a slow
client sees coalesced progress rather than a backlog.

A request leaves `states` through `release(rid)`, which also aborts it in the scheduler if it has
not finished; `release` is synchronous so it can run from a cancelled stream's `finally` block.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import math
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable

import zmq
import zmq.asyncio

from framework.clients import bound_clients
from framework.config import ServerSettings
from framework.messages import (
    AbortReq,
    BatchStrOut,
    CloseSessionReq,
    FlushCacheReq,
    GetStatsReq,
    OpenSessionReq,
    ProfileReq,
    SchedulerReady,
    SchedulerStats,
    StrOutput,
    UpdateWeightsReq,
)
from framework.images import ImageError, ImageProcessor
from framework.metrics import ServerMetrics
from framework.request import FinishAbort, input_too_long_message, request_kind_error
from framework.server.ipc import IpcNames, make_socket
from framework.server.limits import RequestLimits, max_token_bytes
from framework.server.protocol import ApiError, GenerateBatch, ReqSpec

logger = logging.getLogger(__name__)


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet, character -> the byte it stands for: the printable bytes
    (33-126, 161-172, 174-255) stand for themselves; the other 68, in order, are the characters
    from U+0100 on (so that no token holds a control character or a space)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


BYTE_OF_CHAR = _byte_level_alphabet()

# How often a waiting non-streamed request checks whether its client is still there.
DISCONNECT_CHECK_S = 1.0
CONTROL_TIMEOUT_S = 60.0
# How long a /metrics scrape waits for the scheduler's gauges: it answers between passes, and one
# prefill pass can outlast a scraper's timeout (Prometheus: 10 s); past this the last ones serve.
METRICS_STATS_WAIT_S = 1.0
# How often a weight update checks whether the requests in flight have finished.
UPDATE_POLL_S = 0.01


class ClientDisconnected(Exception):
    """The client went away; its requests were aborted."""


@dataclass
class ReqState:
    spec: ReqSpec
    event: asyncio.Event = field(default_factory=asyncio.Event)
    out: StrOutput | None = None
    finished: bool = False
    is_warmup: bool = False
    created: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_time: float = 0.0
    last_completion_tokens: int = 0
    # The client's Starlette request while a wait should check for a disconnect.
    watch: Any = None


def hold_back_stop_prefix(text: str, stops: list[str]) -> str:
    """Text safe to show before a request finishes: without a stop string, or the start of one,
    at its end. The final text has the stop string cut off, so showing its start early would
    make a stream take back text it already sent."""
    cut = len(text)
    for stop in stops:
        pos = text.find(stop)
        if pos != -1:
            cut = min(cut, pos)
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                cut = min(cut, len(text) - k)
                break
    return text[:cut]


async def gather_or_cancel(aws: Iterable[Awaitable[Any]]) -> list[Any]:
    """Like asyncio.gather, but the others are cancelled (and so released) when one fails."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        raise


def is_rejected(out: StrOutput) -> bool:
    """The scheduler refused the request at intake (bad session, too long): nothing was generated."""
    return isinstance(out.finished_reason, FinishAbort) and not out.output_ids


class TokenizerManager:
    def __init__(self, ipc: IpcNames, ready: SchedulerReady, tokenizer: Any, metrics: ServerMetrics,
                 log_requests: bool = False, image_processor: ImageProcessor | None = None,
                 limits: RequestLimits | None = None, max_client_labels: int = 16,
                 request_timeout: float | None = None):
        self.ready = ready
        self.request_timeout = request_timeout
        self.max_client_labels = max_client_labels
        if limits is None:
            limits = RequestLimits.from_settings(ServerSettings(), ready.vocab_size, ready.max_req_input_len,
                                                 max_token_bytes(tokenizer) if tokenizer is not None else 1)
        self.limits = limits
        # Tokenizing (and the parsing around it) runs here, off the event loop. One thread: a Hugging
        # Face tokenizer is not safe to call from two threads at once.
        self.tokenizer_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenizer")
        self.image_processor = image_processor
        self.log_requests = log_requests
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.states: dict[str, ReqState] = {}
        self.pending: dict[str, asyncio.Future] = {}
        self._stats_refresh: asyncio.Task | None = None  # refresh_stats' round trip in flight
        self.open_sessions: set[str] = set()
        self.dead_reason: str | None = None
        self.model_update_lock = asyncio.Lock()
        # Sends never block (unbounded HWM), so a plain socket serves the event loop.
        self._sync_context = zmq.Context()
        self.send_to_scheduler = make_socket(self._sync_context, zmq.PUSH, ipc.scheduler)
        self._async_context = zmq.asyncio.Context()
        self.recv_sock = make_socket(self._async_context, zmq.PULL, ipc.tokenizer)
        self._loop_task: asyncio.Task | None = None
        self.is_closed = False

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self.handle_loop())

    def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        # Sockets and contexts go now, not whenever the interpreter gets to them at exit.
        self.is_closed = True
        self.tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        self._async_context.destroy(linger=0)
        self._sync_context.destroy(linger=0)

    def mark_dead(self, reason: str) -> None:
        """A child process died: wake every waiter so it answers 503 instead of hanging."""
        self.dead_reason = reason
        for state in self.states.values():
            state.event.set()
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(ApiError(reason, status=503, err_type="server_error"))
        self.pending.clear()

    def begin_shutdown(self) -> None:
        """The server is stopping: every request in flight ends now (a stream with a last error
        event, a waiting request with a 503) and new ones are answered 503. Nothing more is sent
        to the scheduler, which is stopped next."""
        if self.dead_reason is None:
            self.mark_dead("The server is shutting down.")

    def check_alive(self) -> None:
        if self.dead_reason is not None:
            raise ApiError(self.dead_reason, status=503, err_type="server_error")

    async def handle_loop(self) -> None:
        while True:
            msg = await self.recv_sock.recv_pyobj()
            if isinstance(msg, BatchStrOut):
                now = time.monotonic()
                for out in msg.outputs:
                    self._on_output(out, now)
                continue
            fut = self.pending.pop(getattr(msg, "request_id", None), None)
            if fut is not None and not fut.done():
                fut.set_result(msg)

    def _on_output(self, out: StrOutput, now: float) -> None:
        state = self.states.get(out.rid)
        if state is None:  # released already (client gone); its abort echo lands here
            return
        num_tokens = out.meta_info.get("completion_tokens", 0)
        if not state.is_warmup and state.spec.stream and num_tokens > 0:
            if state.first_token_time is None:
                state.first_token_time = now
                self.metrics.observe_first_token(now - state.created)
            elif num_tokens > state.last_completion_tokens:
                new = num_tokens - state.last_completion_tokens
                self.metrics.observe_inter_token((now - state.last_time) / new, new)
            state.last_time, state.last_completion_tokens = now, num_tokens
        if out.finished_reason is not None:
            state.finished = True
            if self.log_requests:
                logger.info(
                    "Finished request %s: prompt_tokens=%s, completion_tokens=%s, cached_tokens=%s, "
                    "finish_reason=%s, %.3f s", out.rid, out.meta_info.get("prompt_tokens"), num_tokens,
                    out.meta_info.get("cached_tokens"), out.meta_info.get("finish_reason"), now - state.created,
                )
            if not state.is_warmup:
                self.metrics.observe_finished(
                    out.meta_info.get("prompt_tokens", 0), num_tokens, now - state.created,
                    out.finished_reason.to_json()["type"],
                )
        state.out = out
        state.event.set()

    # -- requests -------------------------------------------------------------------------------

    def tokenize(self, text: str, add_special_tokens: bool = True, name: str = "text") -> list[int]:
        """Token ids of a prompt (the request field `name`); its size is checked first. Call it
        through `offload`."""
        self.limits.check_prompt_bytes(text, name)
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except (TypeError, ValueError) as exc:  # what the tokenizer refuses is the request's fault
            raise ApiError(f"{name}: the tokenizer cannot encode it: {exc}") from None

    async def offload(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` on the tokenizer thread: parsing that tokenizes never blocks the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, functools.partial(fn, *args))

    @functools.lru_cache(maxsize=1 << 16)
    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    @functools.lru_cache(maxsize=1 << 16)
    def token_bytes(self, token_id: int) -> bytes:
        """The bytes the token stands for (OpenAI's logprob `bytes`). A token holding part of a
        UTF-8 character decodes to U+FFFD, so they are read from the token itself: in byte-level
        BPE (GPT-2, SmolLM2, Llama 3) each of its characters stands for one byte; a SentencePiece
        byte-fallback token `<0xNN>` is that byte. Other tokens (added and special ones included)
        are the UTF-8 of their decoded text."""
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str) and token_id not in self._added_ids:
            if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                try:
                    return bytes([int(piece[3:5], 16)])
                except ValueError:
                    pass
            if self._byte_level and all(c in BYTE_OF_CHAR for c in piece):
                return bytes(BYTE_OF_CHAR[c] for c in piece)
        return self.decode_token(token_id).encode("utf-8")

    @functools.cached_property
    def _byte_level(self) -> bool:
        """Whether the tokenizer is byte-level BPE (its decoder, or one in its sequence, is ByteLevel)."""
        decoder = getattr(getattr(self.tokenizer, "backend_tokenizer", None), "decoder", None)
        return decoder is not None and "ByteLevel" in repr(decoder)

    @functools.cached_property
    def _added_ids(self) -> frozenset[int]:
        """Added and special tokens: stored as their text, not in the byte-level alphabet."""
        added = getattr(self.tokenizer, "get_added_vocab", lambda: {})()
        return frozenset(added.values()) | self.special_ids

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """The special tokens, which the text leaves out with `skip_special_tokens`."""
        return frozenset(getattr(self.tokenizer, "all_special_ids", ()))

    def check_input_ids(self, ids: list[int], is_session: bool) -> None:
        vocab = self.ready.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise ApiError(f"input_ids: token ids must be in [0, {vocab})")
        if not ids and not is_session:
            raise ApiError("The prompt is empty: give at least one token.")
        if len(ids) > self.ready.max_req_input_len:
            ready = self.ready
            raise ApiError(input_too_long_message(len(ids), ready.context_len, ready.max_total_num_tokens,
                                                  ready.max_req_input_len))

    def submit(self, spec: ReqSpec, is_warmup: bool = False) -> None:
        """Check and send one request; its outputs are read with `outputs(rid)`."""
        self.check_alive()
        kind_error = request_kind_error(spec.is_embedding, self.ready.is_generation)
        if kind_error is not None:
            raise ApiError(kind_error)
        if spec.rid in self.states:
            raise ApiError(f"rid: {spec.rid} is already in use by a running request")
        if spec.session_id is not None and spec.session_id not in self.open_sessions:
            raise ApiError(f"Invalid request: session id {spec.session_id} does not exist")
        self.check_input_ids(spec.input_ids, spec.session_id is not None)
        state = ReqState(spec=spec, is_warmup=is_warmup)
        if spec.arrival is not None:
            state.created = spec.arrival
        self.states[spec.rid] = state
        self.send_to_scheduler.send_pyobj(spec.to_message())

    def submit_all(self, specs: list[ReqSpec], is_warmup: bool = False) -> None:
        """All or nothing: if one is refused, the ones already sent are released."""
        sent: list[str] = []
        try:
            for spec in specs:
                self.submit(spec, is_warmup)
                sent.append(spec.rid)
        except BaseException:
            for rid in sent:
                self.release(rid)
            raise

    def release(self, rid: str) -> None:
        """Forget a request; abort it in the scheduler if it is still running (its KV is freed)."""
        state = self.states.pop(rid, None)
        if state is None or state.finished:
            return
        if not state.is_warmup:
            meta = state.out.meta_info if state.out is not None else {}
            prompt_tokens = meta.get("prompt_tokens", len(state.spec.input_ids))
            completion_tokens, elapsed = meta.get("completion_tokens", 0), time.monotonic() - state.created
            self.metrics.observe_finished(prompt_tokens, completion_tokens, elapsed, "abort")
            if self.log_requests:  # (client gone, timed out, shutdown: no "Finished request" line comes)
                logger.info("Aborted request %s: prompt_tokens=%s, completion_tokens=%s, %.3f s",
                            rid, prompt_tokens, completion_tokens, elapsed)
        if self.dead_reason is None and not self.is_closed:
            self.send_to_scheduler.send_pyobj(AbortReq(rid))

    def stop_watching(self, rid: str) -> None:
        state = self.states.get(rid)
        if state is not None:
            state.watch = None

    async def outputs(self, rid: str, request: Any = None) -> AsyncIterator[StrOutput]:
        """The request's outputs as they come (coalesced), the last one finished.

        With `request` (a Starlette request) the wait checks for a disconnected client until
        `stop_watching(rid)`; a streamed response leaves that to the server, which cancels it."""
        state = self.states[rid]
        state.watch = request
        deadline = None if self.request_timeout is None else state.created + self.request_timeout
        try:
            while True:
                while not state.event.is_set():
                    wait_s = DISCONNECT_CHECK_S
                    if deadline is not None:
                        wait_s = min(wait_s, deadline - time.monotonic())
                        if wait_s <= 0:
                            logger.warning("request %s timed out; aborting it", rid)
                            raise ApiError(
                                f"the request took longer than {self.request_timeout:g} s "
                                "(server.request_timeout) and was aborted", status=504, err_type="timeout_error",
                            )
                    try:
                        await asyncio.wait_for(state.event.wait(), wait_s)
                    except asyncio.TimeoutError:
                        if state.watch is not None and await state.watch.is_disconnected():
                            logger.info("client disconnected; aborting request %s", rid)
                            raise ClientDisconnected(rid) from None
                state.event.clear()
                if self.dead_reason is not None and not state.finished:
                    self.check_alive()
                out = state.out
                yield out
                if out.finished_reason is not None:
                    return
        finally:
            self.release(rid)

    async def first_output(self, rid: str, request: Any = None) -> tuple[StrOutput, AsyncIterator[StrOutput]]:
        """The first output and an iterator over the rest; raises ApiError if it was rejected."""
        it = self.outputs(rid, request)
        first = await it.__anext__()
        if is_rejected(first):
            raise ApiError(first.finished_reason.message)
        return first, it

    async def final_output(self, rid: str, request: Any = None) -> StrOutput:
        last = None
        async for out in self.outputs(rid, request):
            last = out
        if is_rejected(last):
            raise ApiError(last.finished_reason.message)
        return last

    async def run_all(self, specs: list[ReqSpec], request: Any = None) -> list[StrOutput]:
        """Send all and wait for all final outputs (non-streamed); release all on any error. Like
        every new request, they wait while a weight update runs (/generate's in `expand_parallel`;
        /encode, /v1/embeddings and /health_generate here), and that wait counts in their latency."""
        arrival = time.monotonic()
        for spec in specs:
            if spec.arrival is None:
                spec.arrival = arrival
        await self.wait_for_weight_update()
        self.submit_all(specs)
        try:
            return await gather_or_cancel(self.final_output(s.rid, request) for s in specs)
        finally:
            for spec in specs:
                self.release(spec.rid)

    async def process_images(self, specs: list[ReqSpec]) -> None:
        """Decode and preprocess the specs' images into `image_inputs`, off the event loop (AA2)."""
        if all(spec.image_data is None for spec in specs):
            return
        if self.image_processor is None:
            raise ApiError("image_data: this model does not take images")
        for spec in specs:
            if spec.image_data is not None:
                try:
                    spec.image_inputs = await asyncio.to_thread(self.image_processor.process, spec.image_data)
                except ImageError as exc:
                    raise ApiError(str(exc)) from None

    async def expand_parallel(self, batch: GenerateBatch, request: Any = None) -> list[ReqSpec]:
        """The n samples of every prompt, prompt-major (reference AD5).

        With n > 1 each prompt is first run once with max_new_tokens = 0, so its KV is in the
        prefix cache and the n samples share it instead of each prefilling the prompt. Latencies
        and `server.request_timeout` count from now: a weight update's wait and the warm-up count."""
        arrival = time.monotonic()
        for spec in batch.specs:
            spec.arrival = arrival
        await self.wait_for_weight_update()
        if batch.n == 1:
            return batch.specs
        warmups = [
            replace(
                spec, rid=f"{spec.rid}-prefix", stream=False, return_logprob=False,
                sampling_params=replace(spec.sampling_params, max_new_tokens=0, min_new_tokens=0),
            )
            for spec in batch.specs
        ]
        self.submit_all(warmups, is_warmup=True)
        try:
            await gather_or_cancel(self.final_output(w.rid, request) for w in warmups)
        finally:
            for w in warmups:
                self.release(w.rid)
        return [spec.copy_for_sample(j) for spec in batch.specs for j in range(batch.n)]

    def visible_text(self, spec: ReqSpec, out: StrOutput) -> str:
        params = spec.sampling_params
        if out.finished_reason is not None or params.no_stop_trim or not params.stop_strs:
            return out.text
        return hold_back_stop_prefix(out.text, params.stop_strs)

    # -- control --------------------------------------------------------------------------------

    async def control(self, make: Callable[[str], Any], timeout: float | None = None) -> Any:
        """Send `make(request_id)` to the scheduler and wait for the reply carrying that id, at most
        `timeout` seconds (None: CONTROL_TIMEOUT_S); a child's death wakes the wait with a 503."""
        self.check_alive()
        request_id = uuid.uuid4().hex
        fut = asyncio.get_running_loop().create_future()
        self.pending[request_id] = fut
        self.send_to_scheduler.send_pyobj(make(request_id))
        try:
            return await asyncio.wait_for(fut, CONTROL_TIMEOUT_S if timeout is None else timeout)
        except asyncio.TimeoutError:
            raise ApiError("the scheduler did not answer in time", status=503, err_type="server_error") from None
        finally:
            self.pending.pop(request_id, None)

    async def get_stats(self) -> SchedulerStats:
        stats = await self.control(lambda rid: GetStatsReq(request_id=rid))
        # Each scheduler bounds its clients; data-parallel replicas' sum needs it again.
        stats.clients = bound_clients(stats.clients, self.max_client_labels)
        self.metrics.set_scheduler_stats(stats)
        return stats

    async def refresh_stats(self, wait_s: float = METRICS_STATS_WAIT_S) -> bool:
        """Refresh the scheduler gauges, waiting at most `wait_s`; False when the scheduler did not
        answer by then (the gauges keep their last values and the round trip goes on, shared with
        the next caller, so scrapes of a busy server do not pile requests onto its queue)."""
        if self._stats_refresh is None or self._stats_refresh.done():
            self._stats_refresh = asyncio.ensure_future(self.get_stats())
            # (its error is read here even when no caller waits for it any more)
            self._stats_refresh.add_done_callback(lambda task: task.cancelled() or task.exception())
        try:
            await asyncio.wait_for(asyncio.shield(self._stats_refresh), wait_s)
        except asyncio.TimeoutError:
            return False
        except ApiError:
            return False
        return True

    async def flush_cache(self):
        return await self.control(lambda rid: FlushCacheReq(request_id=rid))

    async def open_session(self, capacity_of_str_len: int) -> str:
        session_id = uuid.uuid4().hex
        reply = await self.control(lambda rid: OpenSessionReq(session_id, capacity_of_str_len, rid))
        if not reply.success:
            raise ApiError(reply.message)
        self.open_sessions.add(session_id)
        return session_id

    async def update_weights_from_disk(self, model_path: str) -> tuple[bool, str]:
        """New weights in the scheduler (R4). New requests wait while an update runs; the update
        waits for the requests in flight to finish, up to CONTROL_TIMEOUT_S."""
        if self.model_update_lock.locked():
            return False, "Another update is in progress. Please try again later."
        async with self.model_update_lock:
            deadline = time.monotonic() + CONTROL_TIMEOUT_S
            while self.states:
                if time.monotonic() > deadline:
                    return False, "Requests are still running; the weights were not updated."
                await asyncio.sleep(UPDATE_POLL_S)
            # Loading a large checkpoint (or converting a GGUF) may take longer than any control
            # timeout: a 503 meanwhile would let requests through while the weights change.
            reply = await self.control(lambda rid: UpdateWeightsReq(model_path, rid), timeout=math.inf)
        return reply.success, reply.message

    async def wait_for_weight_update(self) -> None:
        if self.model_update_lock.locked():
            async with self.model_update_lock:
                pass

    async def profile(self, action: str) -> str:
        reply = await self.control(lambda rid: ProfileReq(action, rid))
        if not reply.success:
            raise ApiError(reply.message)
        return reply.message

    async def close_session(self, session_id: str) -> None:
        reply = await self.control(lambda rid: CloseSessionReq(session_id, rid))
        self.open_sessions.discard(session_id)
        if not reply.success:
            raise ApiError(reply.message)
