"""The FastAPI app: native endpoints (reference 3.1), the OpenAI ones, auth and error format.

Every error is JSON, ``{"error": {"message", "type", "code"}}``, with a 4xx status for bad input and
503 once a child process has died. Bodies are read by hand (not by FastAPI's model binding) so the
size limit, malformed JSON and field errors all get the same treatment.
"""

from __future__ import annotations

import hmac
import logging
from pathlib import Path
from dataclasses import asdict, dataclass, field
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from framework.config import Settings
from framework.request import SamplingParams
from framework.server.openai_api import register_openai_routes
from framework.server.protocol import (
    ApiError,
    ReqSpec,
    check_int,
    embedding_specs,
    native_output,
    new_rid,
    parse_encode,
    parse_generate,
)
from framework.server.streaming import SSE_DONE, merge_streams, open_streams, read_json, sse, stream_response
from framework.server.tokenizer_manager import ClientDisconnected, TokenizerManager

logger = logging.getLogger(__name__)

# /update_weights_from_disk: weights load from safetensors folders (or a GGUF, converted once).
LOAD_FORMATS = {None, "auto", "safetensors", "gguf"}


def load_format_problem(model_path: str, load_format: str | None) -> str | None:
    """Why `model_path` does not hold the weights `load_format` names, or None (null and auto
    take either; a path that is not there is the load's own error)."""
    path = Path(model_path)
    if load_format not in ("safetensors", "gguf") or not path.exists():
        return None
    if load_format == "gguf":
        found = path.suffix == ".gguf" if path.is_file() else any(path.glob("*.gguf"))
    else:
        found = path.is_dir() and any(path.glob("*.safetensors"))
    return None if found else f"load_format: {load_format}, but {model_path} holds no {load_format} weights"


@dataclass
class ServerInfo:
    """What the server reports about itself besides the settings."""

    model_path: str
    tokenizer_path: str
    model_name: str
    model_folder: str = ""  # the resolved local folder the scheduler loaded
    process_ids: dict[str, int] = field(default_factory=dict)


class GuardMiddleware:
    """Plain ASGI middleware: 503 once a child died, then the API key on every path but /health
    (the reference also exempts /health_generate, which runs the model: here it needs the key)."""

    def __init__(self, app, tm: TokenizerManager, api_key: str | None):
        self.app = app
        self.tm = tm
        self.api_key = api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.tm.dead_reason is not None:
            err = ApiError(self.tm.dead_reason, status=503, err_type="server_error")
            return await JSONResponse(err.to_json(), status_code=503)(scope, receive, send)
        path = scope.get("path", "")
        if self.api_key and path != "/health" and scope.get("method") != "OPTIONS":
            headers = dict(scope.get("headers") or [])
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, f"Bearer {self.api_key}".encode("latin-1")):
                err = ApiError("Unauthorized", status=401, err_type="authentication_error")
                return await JSONResponse(err.to_json(), status_code=401)(scope, receive, send)
        return await self.app(scope, receive, send)


def build_app(tm: TokenizerManager, settings: Settings, info: ServerInfo) -> GuardMiddleware:
    """The ASGI app to serve: the FastAPI routes behind the guard."""
    app = FastAPI(title="batchyard", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError):
        return JSONResponse(exc.to_json(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        # FastAPI's own answers (404 no such path, 405 wrong method) in the documented error body.
        err = ApiError(f"{exc.detail}: {request.method} {request.url.path}", status=exc.status_code,
                       err_type="invalid_request_error" if exc.status_code < 500 else "server_error")
        return JSONResponse(err.to_json(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        # Bodies are parsed by hand, so no route has FastAPI-validated parameters today; should one
        # get them, its errors are a 400 in the documented body, like every other invalid field.
        parts = [f"{'.'.join(str(p) for p in err.get('loc', ()))}: {err.get('msg')}" for err in exc.errors()]
        return JSONResponse(ApiError("; ".join(parts) or "invalid request").to_json(), status_code=400)

    @app.exception_handler(ClientDisconnected)
    async def client_gone(request: Request, exc: ClientDisconnected):
        # Nobody reads this; 499 is the conventional "client closed request" in access logs.
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        logger.exception("unexpected error on %s", request.url.path)
        err = ApiError(f"internal error: {type(exc).__name__}: {exc}", status=500, err_type="server_error")
        return JSONResponse(err.to_json(), status_code=500)

    @app.api_route("/health", methods=["GET", "HEAD"])  # (HEAD: what some load balancers probe with)
    async def health():
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate(request: Request):
        rid = f"health-{new_rid()}"
        if tm.ready.is_generation:
            spec = ReqSpec(rid=rid, input_ids=[0], sampling_params=_params({"max_new_tokens": 1, "temperature": 0.7}))
        else:
            [spec] = embedding_specs([rid], [[0]], [None])
        try:
            await tm.run_all([spec], request)
        except ApiError as exc:
            raise ApiError(f"generation failed: {exc.message}", status=503, err_type="server_error") from None
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def get_model_info():
        return {"model_path": info.model_path, "tokenizer_path": info.tokenizer_path,
                "is_generation": tm.ready.is_generation}

    @app.get("/get_server_info")
    async def get_server_info():
        stats = await tm.get_stats()
        dumped = settings.model_dump(mode="json")
        if dumped["server"].get("api_key"):
            dumped["server"]["api_key"] = "<redacted>"
        if dumped["parallel"].get("dist_secret"):
            dumped["parallel"]["dist_secret"] = "<redacted>"
        stats_dict = asdict(stats)
        stats_dict.pop("request_id")
        clients = stats_dict.pop("clients")
        return {
            **dumped,
            "served_model_name": info.model_name,
            "model_path_resolved": info.model_path,
            "max_total_num_tokens": tm.ready.max_total_num_tokens,
            "memory_pool_size": tm.ready.max_total_num_tokens,
            "max_req_input_len": tm.ready.max_req_input_len,
            "context_len": tm.ready.context_len,
            "process_ids": info.process_ids,
            "num_inflight_requests": len(tm.states),
            "scheduler_stats": stats_dict,
            "clients": clients,
        }

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        reply = await tm.flush_cache()
        if not reply.success:
            raise ApiError(reply.message)
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/update_weights_from_disk")
    @app.post("/update_weights")  # the reference's 0.3.6 name
    async def update_weights_from_disk(request: Request):
        body = _object_with(await read_json(request, tm.limits), {"model_path", "load_format"})
        model_path = body.get("model_path")
        if not isinstance(model_path, str) or not model_path:
            raise ApiError("model_path: must be a non-empty string")
        if body.get("load_format") not in LOAD_FORMATS:
            raise ApiError(f"load_format: must be one of {sorted(f for f in LOAD_FORMATS if f)} or null")
        problem = load_format_problem(model_path, body.get("load_format"))
        if problem:  # (it was checked for its name only, and a safetensors folder loaded as "gguf")
            raise ApiError(problem)
        success, message = await tm.update_weights_from_disk(model_path)
        if success:
            info.model_path = model_path
        if success:
            return JSONResponse({"success": True, "message": message})
        # The reference's fields, and the error body every other 4xx has.
        return JSONResponse({"success": False, "message": message, **ApiError(message).to_json()}, status_code=400)

    @app.api_route("/start_profile", methods=["GET", "POST"])
    async def start_profile():
        return PlainTextResponse(await tm.profile("start") + "\n")

    @app.api_route("/stop_profile", methods=["GET", "POST"])
    async def stop_profile():
        return PlainTextResponse(f"Profiling stopped; trace written to {await tm.profile('stop')}\n")

    @app.api_route("/open_session", methods=["GET", "POST"])
    async def open_session(request: Request):
        body = await read_json(request, tm.limits, allow_empty=True)
        body = _object_with(body, {"capacity_of_str_len"})
        capacity = check_int("capacity_of_str_len", body.get("capacity_of_str_len", 0), minimum=0)
        return JSONResponse(await tm.open_session(capacity))

    @app.api_route("/close_session", methods=["GET", "POST"])
    async def close_session(request: Request):
        body = _object_with(await read_json(request, tm.limits, allow_empty=True), {"session_id"})
        session_id = body.get("session_id")
        if session_id is None:
            raise ApiError('session_id: required (a JSON body {"session_id": "..."}, as /open_session answered it)')
        if not isinstance(session_id, str):
            raise ApiError("session_id: must be a string")
        await tm.close_session(session_id)
        return Response(status_code=200)

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        body = await read_json(request, tm.limits)
        batch = await tm.offload(parse_generate, body, tm.tokenize, tm.tokenizer, tm.ready.hidden_size, tm.limits)
        await tm.process_images(batch.specs)
        specs = await tm.expand_parallel(batch, request)
        if not batch.stream:
            outs = await tm.run_all(specs, request)
            results = [native_output(o, s, tm.decode_token, o.text) for o, s in zip(outs, specs)]
            return JSONResponse(results if batch.is_batch else results[0])
        firsts, iterators = await open_streams(tm, specs, request)

        async def events() -> AsyncIterator[str]:
            for i, out in enumerate(firsts):
                yield sse(_chunk(specs[i], out, i))
            async for i, out in merge_streams(iterators):
                yield sse(_chunk(specs[i], out, i))
            yield SSE_DONE

        def _chunk(spec: ReqSpec, out, i: int) -> dict:
            return native_output(out, spec, tm.decode_token, tm.visible_text(spec, out),
                                 index=i if batch.is_batch else None)

        return stream_response(tm, specs, events())

    @app.api_route("/encode", methods=["POST", "PUT"])
    async def encode(request: Request):
        body = await read_json(request, tm.limits)
        specs, is_batch = await tm.offload(parse_encode, body, tm.tokenize, tm.limits)
        outs = await tm.run_all(specs, request)
        results = [{"embedding": out.embedding, "meta_info": out.meta_info} for out in outs]
        return JSONResponse(results if is_batch else results[0])

    if settings.server.enable_metrics:
        @app.get("/metrics")
        async def metrics():
            await tm.refresh_stats()  # the scheduler gauges; the last ones while a long pass runs
            tm.metrics.set_inflight_requests(len(tm.states))
            return Response(tm.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    register_openai_routes(app, tm, info.model_name)
    return GuardMiddleware(app, tm, settings.server.api_key)


def _params(data: dict) -> SamplingParams:
    params = SamplingParams.from_dict(data)
    params.verify()
    params.normalize(None)
    return params


def _object_with(body: Any, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ApiError(f"unknown field(s): {', '.join(unknown)}")
    return body
