"""OpenAI-compatible endpoints: /v1/models, /v1/completions, /v1/chat/completions and
/v1/embeddings (reference 3.2).

Each request maps onto native ReqSpecs (one per prompt, then n samples each as in AD5) and the
answers are formatted as the OpenAI API does, logprobs included. Streaming sends deltas: the new
text since the last chunk and the logprobs of the new tokens.
"""

from __future__ import annotations

import base64
import codecs
import struct
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from framework.messages import StrOutput
from framework.server.openai_protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from framework.server.protocol import (
    ApiError,
    GenerateBatch,
    ReqSpec,
    embedding_specs,
    is_int,
    new_rid,
    sampling_params_from,
)
from framework.server.streaming import SSE_DONE, merge_streams, open_streams, read_json, sse, stream_response
from framework.server.tokenizer_manager import TokenizerManager


DEFAULT_MODEL_ALIAS = "default"


def validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "body"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


def finish_fields(out: StrOutput) -> tuple[str | None, Any]:
    reason = out.meta_info.get("finish_reason")
    if reason is None:
        return None, None
    return reason["type"], reason.get("matched")


class OpenAIFormatter:
    """Logprob formats of the two endpoints, over the TokenizerManager's token decoder."""

    def __init__(self, tm: TokenizerManager):
        self.tm = tm

    def completion_logprobs(self, pairs: list, tops: list | None, at: "TextOffsets", skip_special: bool) -> dict:
        """`at`: where the choice's text stands (advanced past these tokens), so that a stream's
        chunks continue each other's offsets; `skip_special`: the text leaves special tokens out."""
        tokens = [self.tm.decode_token(tid) for _, tid in pairs]
        special = self.tm.special_ids if skip_special else frozenset()
        # (a special token the echoed prompt text holds, written as text, takes its characters there)
        offsets = [at.advance(b"" if tid in special and not at.shows(tokens[k]) else self.tm.token_bytes(tid))
                   for k, (_, tid) in enumerate(pairs)]
        top = None
        if tops is not None:
            top = [None if t is None else {self.tm.decode_token(tid): lp for lp, tid in t} for t in tops]
        return {"tokens": tokens, "token_logprobs": [lp for lp, _ in pairs], "top_logprobs": top,
                "text_offset": offsets}

    def chat_logprobs(self, pairs: list, tops: list | None) -> dict:
        content = []
        for k, (lp, tid) in enumerate(pairs):
            entry = {"token": self.tm.decode_token(tid), "logprob": lp, "bytes": list(self.tm.token_bytes(tid)),
                     "top_logprobs": []}
            if tops is not None and k < len(tops) and tops[k]:
                entry["top_logprobs"] = [
                    {"token": self.tm.decode_token(t), "logprob": l, "bytes": list(self.tm.token_bytes(t))}
                    for l, t in tops[k]
                ]
            content.append(entry)
        return {"content": content}


class TextOffsets:
    """The character offset in a choice's text at which each next token starts. A token's
    characters are those its bytes complete: a token holding the first bytes of a character adds
    none, the one that completes it adds it, so the offsets follow the text as the detokenizer
    writes it and never run past its end. `echo`: the echoed prompt the choice's text starts with."""

    def __init__(self, echo: str = ""):
        self.offset = 0
        self.echo = echo
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def shows(self, piece: str) -> bool:
        """Whether the echoed prompt has `piece` where the next token starts (a special token
        written as text in a text prompt is there; an added BOS is not)."""
        return bool(piece) and self.echo.startswith(piece, self.offset)

    def advance(self, token_bytes: bytes) -> int:
        """The offset where a token of these bytes starts; moves past it."""
        start = self.offset
        self.offset += len(self._utf8.decode(token_bytes))
        return start


def usage(outs: list[StrOutput], n: int, scored_only: bool = False) -> dict:
    # The prompt is counted once per prompt, not once per sample (as in the reference).
    prompt = sum(o.meta_info.get("prompt_tokens", 0) for o in outs[::n])
    completion = 0 if scored_only else sum(o.meta_info.get("completion_tokens", 0) for o in outs)
    result = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    cached = sum(o.meta_info.get("cached_tokens", 0) for o in outs[::n])
    result["prompt_tokens_details"] = {"cached_tokens": cached}
    return result


def register_openai_routes(app: FastAPI, tm: TokenizerManager, model_name: str) -> None:
    fmt = OpenAIFormatter(tm)

    def model_card() -> dict:
        return {"id": model_name, "object": "model", "created": int(time.time()), "owned_by": "batchyard",
                "root": model_name, "max_model_len": tm.ready.context_len}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str):
        """OpenAI's `models.retrieve`: the served model by its name (or the alias "default")."""
        if model_id not in (model_name, DEFAULT_MODEL_ALIAS):
            raise ApiError(f"model: unknown model {model_id!r}; this server serves {model_name!r}", status=404)
        return model_card()

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = _validate(CompletionRequest, await read_json(request, tm.limits), model_name)
        identity = tm.limits.check_identity(req.user, req.priority, req.slo_ttft_ms, "user")
        if req.suffix:
            raise ApiError("suffix: not supported")
        prompts = await tm.offload(_prompts, tm, req.prompt, "prompt")
        # logprobs = 0 asks for the chosen tokens' logprobs only, as in the OpenAI API.
        top = tm.limits.check_top_logprobs_num(req.logprobs or 0, "logprobs")
        batch = await tm.offload(_batch, tm, req, prompts, req.sampling_dict(req.max_tokens, req.temperature),
                                 req.logprobs is not None, top, 0 if (req.echo and req.logprobs is not None) else -1,
                                 identity)
        specs = await tm.expand_parallel(batch, request)
        rid, created = f"cmpl-{batch.specs[0].rid}", int(time.time())
        # (a token-id prompt's text as the output's is made: special tokens left out unless asked for,
        # as the logprobs' text_offset counts them)
        echo_texts = [(p[1] if p[1] is not None
                       else tm.tokenizer.decode(p[0], skip_special_tokens=req.skip_special_tokens)) if req.echo else ""
                      for p in prompts for _ in range(batch.n)]
        # max_tokens 0 scores the prompt (with echo and logprobs, as lm-eval-harness asks): the
        # engine still samples one token (max_new_tokens 0, as the reference), which is left out.
        scored_only = req.max_tokens == 0

        def choice(i: int, spec: ReqSpec, out: StrOutput, text: str, new_pairs, new_tops, at: TextOffsets) -> dict:
            reason, matched = finish_fields(out)
            if scored_only and reason in ("length", "stop"):  # (the sampled token is not shown; an abort is)
                reason, matched = "length", None
            logprobs = None
            if spec.return_logprob:
                logprobs = fmt.completion_logprobs(new_pairs, new_tops if spec.top_logprobs_num else None, at,
                                                   req.skip_special_tokens)
            return {"index": i, "text": text, "logprobs": logprobs, "finish_reason": reason, "matched_stop": matched}

        def logprob_lists(spec: ReqSpec, out: StrOutput, with_input: bool):
            if not spec.return_logprob:
                return [], []
            meta = out.meta_info
            pairs = [] if scored_only else list(meta.get("output_token_logprobs") or [])
            tops = [] if scored_only else list(meta.get("output_top_logprobs") or [])
            if with_input:
                pairs = list(meta.get("input_token_logprobs") or []) + pairs
                tops = list(meta.get("input_top_logprobs") or []) + tops
            return pairs, tops

        if not req.stream:
            outs = await tm.run_all(specs, request)
            choices = []
            for i, (spec, out) in enumerate(zip(specs, outs)):
                pairs, tops = logprob_lists(spec, out, with_input=req.echo)
                text = echo_texts[i] + ("" if scored_only else out.text)
                choices.append(choice(i, spec, out, text, pairs, tops, TextOffsets(echo_texts[i])))
            return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": model_name,
                                 "choices": choices, "usage": usage(outs, batch.n, scored_only)})

        firsts, iterators = await open_streams(tm, specs, request)

        async def events() -> AsyncIterator[str]:
            sent_text = ["" for _ in specs]
            sent_lp = [0 for _ in specs]
            finals: list[StrOutput | None] = [None] * len(specs)
            echoed = [False] * len(specs)
            # With echo the logprobs start with the prompt's tokens, which advance the offsets.
            offsets = [TextOffsets(echo_texts[i]) for i in range(len(specs))]

            def chunk(i: int, out: StrOutput) -> str | None:
                spec = specs[i]
                visible = "" if scored_only else tm.visible_text(spec, out)
                if not visible.startswith(sent_text[i]):
                    visible = sent_text[i]  # never take back text already sent
                delta = visible[len(sent_text[i]):]
                pairs, tops = logprob_lists(spec, out, with_input=req.echo)
                new_pairs, new_tops = pairs[sent_lp[i]:], tops[sent_lp[i]:]
                if not delta and not new_pairs and out.finished_reason is None:
                    return None
                if req.echo and not echoed[i]:
                    delta = echo_texts[i] + delta
                    echoed[i] = True
                body = choice(i, spec, out, delta, new_pairs, new_tops, offsets[i])
                sent_text[i] = visible
                sent_lp[i] = len(pairs)
                if out.finished_reason is not None:
                    finals[i] = out
                return sse({"id": rid, "object": "text_completion", "created": created,
                            "model": model_name, "choices": [body]})

            for i, out in enumerate(firsts):
                if (data := chunk(i, out)) is not None:
                    yield data
            async for i, out in merge_streams([it for it in iterators]):
                if (data := chunk(i, out)) is not None:
                    yield data
            if req.stream_options is not None and req.stream_options.include_usage:
                yield sse({"id": rid, "object": "text_completion", "created": created, "model": model_name,
                           "choices": [], "usage": usage([f for f in finals if f is not None], batch.n, scored_only)})
            yield SSE_DONE

        return stream_response(tm, specs, events())

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = _validate(ChatCompletionRequest, await read_json(request, tm.limits), model_name)
        identity = tm.limits.check_identity(req.user, req.priority, req.slo_ttft_ms, "user")
        ids = await tm.offload(_chat_input_ids, tm, req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        if max_tokens == 0:  # (as OpenAI's: a chat answer has a token at least)
            raise ApiError(f"{field}: must be at least 1")
        if req.top_logprobs is not None and not req.logprobs:  # (as OpenAI and vLLM: else it came back empty)
            raise ApiError("top_logprobs: needs logprobs: true")
        top = tm.limits.check_top_logprobs_num(req.top_logprobs or 0, "top_logprobs")
        batch = await tm.offload(_batch, tm, req, [(ids, None)], req.sampling_dict(max_tokens, req.temperature),
                                 req.logprobs, top, -1, identity, field)
        specs = await tm.expand_parallel(batch, request)
        rid, created = f"chatcmpl-{batch.specs[0].rid}", int(time.time())

        def lp_of(spec: ReqSpec, out: StrOutput, start: int) -> dict | None:
            if not spec.return_logprob:
                return None
            pairs = list(out.meta_info.get("output_token_logprobs") or [])[start:]
            tops = list(out.meta_info.get("output_top_logprobs") or [])[start:] if spec.top_logprobs_num else None
            return fmt.chat_logprobs(pairs, tops)

        if not req.stream:
            outs = await tm.run_all(specs, request)
            choices = []
            for i, (spec, out) in enumerate(zip(specs, outs)):
                reason, matched = finish_fields(out)
                choices.append({"index": i, "message": {"role": "assistant", "content": out.text},
                                "logprobs": lp_of(spec, out, 0), "finish_reason": reason,
                                "matched_stop": matched})
            return JSONResponse({"id": rid, "object": "chat.completion", "created": created,
                                 "model": model_name, "choices": choices, "usage": usage(outs, batch.n)})

        firsts, iterators = await open_streams(tm, specs, request)

        async def events() -> AsyncIterator[str]:
            sent_text = ["" for _ in specs]
            sent_lp = [0 for _ in specs]
            finals: list[StrOutput | None] = [None] * len(specs)

            def frame(choices: list[dict], **extra) -> str:
                return sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                            "model": model_name, "choices": choices, **extra})

            def chunk(i: int, out: StrOutput) -> str | None:
                spec = specs[i]
                visible = tm.visible_text(spec, out)
                if not visible.startswith(sent_text[i]):
                    visible = sent_text[i]
                delta = visible[len(sent_text[i]):]
                n_lp = len(out.meta_info.get("output_token_logprobs") or []) if spec.return_logprob else 0
                if not delta and n_lp == sent_lp[i] and out.finished_reason is None:
                    return None
                reason, matched = finish_fields(out)
                body = {"index": i, "delta": {"content": delta} if delta else {},
                        "logprobs": lp_of(spec, out, sent_lp[i]), "finish_reason": reason,
                        "matched_stop": matched}
                sent_text[i], sent_lp[i] = visible, n_lp
                if out.finished_reason is not None:
                    finals[i] = out
                return frame([body])

            yield frame([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(len(specs))])
            for i, out in enumerate(firsts):
                if (data := chunk(i, out)) is not None:
                    yield data
            async for i, out in merge_streams(iterators):
                if (data := chunk(i, out)) is not None:
                    yield data
            if req.stream_options is not None and req.stream_options.include_usage:
                yield frame([], usage=usage([f for f in finals if f is not None], batch.n))
            yield SSE_DONE

        return stream_response(tm, specs, events())

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        req = _validate(EmbeddingRequest, await read_json(request, tm.limits), model_name)
        client_id, priority, slo_ttft_ms = tm.limits.check_identity(req.user, req.priority, req.slo_ttft_ms, "user")
        # (A generation model is refused below, as not being an embedding model, whatever the size.)
        if req.dimensions is not None and not tm.ready.is_generation and req.dimensions != tm.ready.hidden_size:
            raise ApiError(f"dimensions: this model's embeddings have {tm.ready.hidden_size} dimensions")
        if req.input == [] or req.input == "":
            raise ApiError("input: must not be empty")
        prompts = await tm.offload(_prompts, tm, req.input, "input")
        specs = embedding_specs([new_rid() for _ in prompts], [ids for ids, _ in prompts], [t for _, t in prompts])
        for spec in specs:
            spec.client_id, spec.priority, spec.slo_ttft_ms = client_id, priority, slo_ttft_ms
        outs = await tm.run_all(specs, request)
        data = [{"object": "embedding", "index": i, "embedding": _encoded(o.embedding, req.encoding_format)}
                for i, o in enumerate(outs)]
        num_tokens = sum(o.meta_info.get("prompt_tokens", 0) for o in outs)
        return JSONResponse({"object": "list", "data": data, "model": model_name,
                             "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})


def _encoded(vector: list[float], encoding_format: str) -> list[float] | str:
    """A vector as the OpenAI API sends it: floats, or base64 of little-endian float32 bytes."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def _validate(model, body: Any, served_name: str):
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    try:
        req = model.model_validate(body)
    except ValidationError as exc:
        raise ApiError(validation_message(exc)) from None
    # "default" is kept for clients that do not know the name (the reference ignores the field).
    if req.model not in (served_name, DEFAULT_MODEL_ALIAS):
        raise ApiError(f"model: unknown model {req.model!r}; this server serves {served_name!r}",
                       status=404, err_type="invalid_request_error")
    if getattr(req, "lora_path", None) is not None:
        raise ApiError("lora_path: the OpenAI endpoints serve the base model; choose a LoRA adapter with "
                       "lora_path on /generate")
    if getattr(req, "stream_options", None) is not None and not req.stream:  # (as OpenAI and vLLM)
        raise ApiError("stream_options: only with stream: true")
    return req


def _prompts(tm: TokenizerManager, prompt: Any, name: str) -> list[tuple[list[int], str | None]]:
    """(input ids, text or None) per prompt of the request field `name`. Tokenizes: run it offloaded."""
    if isinstance(prompt, str):
        return [(tm.tokenize(prompt, name=name), prompt)]
    if not prompt:
        raise ApiError("prompt: must not be empty")
    if all(is_int(t) for t in prompt):
        return [(list(prompt), None)]
    tm.limits.check_counts(len(prompt), 1)  # before tokenizing any
    if all(isinstance(p, str) for p in prompt):
        return [(tm.tokenize(p, name=name), p) for p in prompt]
    return [(list(p), None) for p in prompt]


def _batch(tm: TokenizerManager, req, prompts, sampling: dict, return_logprob: bool,
           top_logprobs_num: int, logprob_start_len: int, identity: tuple[str | None, int | None, float | None],
           max_tokens_field: str = "max_tokens") -> GenerateBatch:
    """The ReqSpecs of an OpenAI request (stop strings are tokenized: run it offloaded). `max_tokens_field`:
    the request's field that gave `max_new_tokens` (chat's `max_completion_tokens` or `max_tokens`)."""
    specs = []
    for ids, text in prompts:
        try:
            params = sampling_params_from(sampling, tm.tokenizer, name="")
        except ApiError as exc:
            # Name the OpenAI fields, not the native ones they map to.
            exc.message = (exc.message.replace("max_new_tokens", max_tokens_field)
                           .replace("min_new_tokens", "min_tokens"))
            raise
        specs.append(ReqSpec(
            rid=new_rid(), input_ids=ids, sampling_params=params, input_text=text,
            return_logprob=bool(return_logprob), logprob_start_len=logprob_start_len,
            top_logprobs_num=top_logprobs_num, stream=req.stream,
            client_id=identity[0], priority=identity[1], slo_ttft_ms=identity[2],
        ))
    n = specs[0].sampling_params.n
    tm.limits.check_counts(len(specs), n, name="n")
    return GenerateBatch(specs=specs, n=n, is_batch=True, stream=req.stream)


def _chat_input_ids(tm: TokenizerManager, req: ChatCompletionRequest) -> list[int]:
    """The chat prompt's ids through the template (tokenizes: run it offloaded)."""
    tokenizer = tm.tokenizer
    if getattr(tokenizer, "chat_template", None) is None:
        raise ApiError("this model's tokenizer has no chat template; use /v1/completions")
    messages = []
    for k, msg in enumerate(req.messages):
        content = msg.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError(f"messages.{k}.content: only text parts are supported")
                texts.append(part["text"])
            content = "".join(texts)
        message = {"role": msg.role, "content": content or ""}
        if msg.name is not None:  # (as transformers passes it: a template may write it)
            message["name"] = msg.name
        messages.append(message)
    # A trailing assistant message is a prefix for the model to continue (as in the reference).
    continues = messages[-1]["role"] == "assistant"
    try:
        prompt = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=not continues, continue_final_message=continues,
        )
    except Exception as exc:  # the template itself raises on what it does not accept
        raise ApiError(f"messages: the chat template rejected them: {exc}") from None
    # The template already wrote the special tokens as text.
    return tm.tokenize(prompt, add_special_tokens=False, name="messages")
