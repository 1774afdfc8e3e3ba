"""Helpers shared by the native and the OpenAI endpoints: request bodies, SSE, fan-in of streams.

Streams are opened in two steps. `open_streams` sends the requests and waits for each one's first
output before any byte of the response goes out: a request the scheduler rejects at intake (an
unknown session rid, say) still gets a proper 4xx. The rest of the outputs are then merged as they
come by `merge_streams`, which tags each with its request's index.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator

from fastapi.responses import StreamingResponse

from framework.messages import StrOutput
from framework.server.limits import RequestLimits
from framework.server.protocol import ApiError, ReqSpec
from framework.server.tokenizer_manager import TokenizerManager, gather_or_cancel

SSE_DONE = "data: [DONE]\n\n"


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def read_body(request: Any, max_bytes: int) -> bytes:
    """The request body, refusing more than `max_bytes` (413) without reading past the limit."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise ApiError(f"request body of {length} bytes is over the limit of {max_bytes} bytes "
                       "(server.max_request_bytes)", status=413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(f"request body is over the limit of {max_bytes} bytes (server.max_request_bytes)",
                           status=413)
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(request: Any, limits: RequestLimits, allow_empty: bool = False) -> Any:
    """The body as JSON within `limits` (size, nesting, number lengths, valid strings)."""
    return limits.parse_json(await read_body(request, limits.max_request_bytes), allow_empty)


async def open_streams(
    tm: TokenizerManager, specs: list[ReqSpec], request: Any
) -> tuple[list[StrOutput], list[AsyncIterator[StrOutput]]]:
    """Send `specs` and wait for every first output; on any error all are released."""
    tm.submit_all(specs)
    try:
        pairs = await gather_or_cancel(tm.first_output(s.rid, request) for s in specs)
    except BaseException:
        for spec in specs:
            tm.release(spec.rid)
        raise
    for spec in specs:
        # From here the server notices a disconnect itself: it cancels the response stream.
        tm.stop_watching(spec.rid)
    return [p[0] for p in pairs], [p[1] for p in pairs]


async def merge_streams(iterators: list[AsyncIterator[StrOutput]]) -> AsyncIterator[tuple[int, StrOutput]]:
    """(index, output) from several output iterators, in arrival order, until all finish; each is
    read one output at a time, as the caller takes them."""
    if len(iterators) == 1:
        async for out in iterators[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()
    taken = [asyncio.Event() for _ in iterators]

    async def pump(i: int, it: AsyncIterator[StrOutput]) -> None:
        try:
            async for out in it:
                taken[i].clear()
                queue.put_nowait((i, out))
                # Until the response has sent it, newer outputs replace each other in the request's
                # state rather than pile up here behind a slow client.
                await taken[i].wait()
            queue.put_nowait((i, done))
        except BaseException as exc:  # handed to the consumer, which re-raises it
            queue.put_nowait((i, exc))

    tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
                taken[i].set()
    finally:
        for task in tasks:
            task.cancel()


def stream_response(tm: TokenizerManager, specs: list[ReqSpec], events: AsyncIterator[str]):
    """An SSE response over `events` that reports an ApiError as a last event and always
    releases the requests, on completion and when the client goes away."""
    async def guarded() -> AsyncIterator[str]:
        try:
            async for data in events:
                yield data
        except ApiError as exc:
            yield sse(exc.to_json())
        finally:
            # Runs on completion and when the client goes away (the stream is cancelled).
            for spec in specs:
                tm.release(spec.rid)

    return StreamingResponse(guarded(), media_type="text/event-stream")
