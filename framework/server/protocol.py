"""The native API: /generate request parsing and response formatting (reference section 3.1).

`parse_generate` checks a JSON body field by field and gives the per-prompt `ReqSpec`s the
TokenizerManager sends; every problem is an `ApiError` with a message naming the field.
`native_output` turns a detokenized output into the reference's response dict.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable

from framework.messages import GenerateReqInput
from framework.request import SamplingParams

if TYPE_CHECKING:
    from framework.messages import StrOutput

GENERATE_FIELDS = {
    "text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len",
    "top_logprobs_num", "return_text_in_logprobs", "stream", "session", "lora_path",
}
# Fields of the reference this build does not serve: a clear 400 instead of silently ignoring them.
UNSUPPORTED_FIELDS = {"input_embeds", "image_data", "modalities"}


class ApiError(Exception):
    """An error answered as JSON: ``{"error": {"message", "type", "code"}}`` with `status`."""

    def __init__(self, message: str, status: int = 400, err_type: str = "invalid_request_error"):
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type

    def to_json(self) -> dict:
        return {"error": {"message": self.message, "type": self.err_type, "code": self.status}}


@dataclass
class ReqSpec(GenerateReqInput):
    """One request as the TokenizerManager sends it to the scheduler, plus what only the
    tokenizer side needs."""

    return_text_in_logprobs: bool = False

    def to_message(self) -> GenerateReqInput:
        """The scheduler's part of the spec (the tokenizer-side fields stay here)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(GenerateReqInput)}
        return GenerateReqInput(**fields)

    def copy_for_sample(self, j: int) -> "ReqSpec":
        """The j-th of n parallel samples: own rid and its own copy of the sampling params."""
        return replace(self, rid=f"{self.rid}-{j}", sampling_params=replace(self.sampling_params))


@dataclass
class GenerateBatch:
    """A parsed /generate body: one spec per prompt, before the n parallel samples."""

    specs: list[ReqSpec]
    n: int = 1
    is_batch: bool = False
    stream: bool = False
    extras: dict[str, Any] = field(default_factory=dict)


def new_rid() -> str:
    return uuid.uuid4().hex


# ---------------------------------------------------------------------------------------------
# Field checks


def is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ApiError(f"{name}: must be true or false, got {value!r}")
    return value


def check_int(name: str, value: Any, minimum: int | None = None) -> int:
    if not is_int(value):
        raise ApiError(f"{name}: must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ApiError(f"{name}: must be >= {minimum}, got {value}")
    return value


def check_optional_str(name: str, value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise ApiError(f"{name}: must be a string or null, got {value!r}")
    return value


def is_token_list(x: Any) -> bool:
    return isinstance(x, list) and all(is_int(t) for t in x)


def sampling_params_from(data: Any, tokenizer: Any, name: str = "sampling_params") -> SamplingParams:
    """SamplingParams from a user dict, verified and normalized; errors as ApiError."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ApiError(f"{name}: must be an object, got {type(data).__name__}")
    try:
        params = SamplingParams.from_dict(data)
        if params.stop is not None and not (
            isinstance(params.stop, str) or (isinstance(params.stop, list) and all(isinstance(s, str) for s in params.stop))
        ):
            raise ValueError("sampling_params.stop: must be a string or a list of strings")
        if params.stop_token_ids is not None and not isinstance(params.stop_token_ids, list):
            raise ValueError("sampling_params.stop_token_ids: must be a list of integers")
        for flag in ("no_stop_trim", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens"):
            if not isinstance(getattr(params, flag), bool):
                raise ValueError(f"sampling_params.{flag}: must be true or false")
        if params.regex is not None or params.json_schema is not None:
            raise ValueError("sampling_params: regex and json_schema (constrained decoding) are not supported")
        params.verify()
        params.normalize(tokenizer)
    except (TypeError, ValueError) as exc:
        message = str(exc)
        message = message.replace("sampling_params.", f"{name}." if name else "", 1)
        raise ApiError(message.replace("sampling_params", name or "request", 1)) from None
    return params


def _per_item(name: str, value: Any, count: int, is_batch: bool) -> list[Any]:
    """A scalar broadcast to every prompt of a batch, or a list with one value per prompt."""
    if is_batch and isinstance(value, list) and name != "input_ids":
        if len(value) != count:
            raise ApiError(f"{name}: got {len(value)} values for {count} prompts")
        return value
    return [value] * count


def parse_generate(body: Any, tokenize: Callable[[str], list[int]], tokenizer: Any) -> GenerateBatch:
    """Check a /generate body (reference GenerateReqInput) and build its ReqSpecs."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    unsupported = sorted(UNSUPPORTED_FIELDS & set(body))
    if unsupported:
        raise ApiError(f"not supported by this server: {', '.join(unsupported)}")
    unknown = sorted(set(body) - GENERATE_FIELDS)
    if unknown:
        raise ApiError(f"unknown field(s): {', '.join(unknown)}")
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise ApiError("give exactly one of text or input_ids")

    if text is not None:
        if isinstance(text, str):
            is_batch, prompts = False, [text]
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            is_batch, prompts = True, list(text)
        else:
            raise ApiError("text: must be a string or a non-empty list of strings")
        id_lists = [tokenize(t) for t in prompts]
        texts: list[str | None] = list(prompts)
    else:
        if is_token_list(input_ids):
            is_batch, id_lists = False, [list(input_ids)]
        elif isinstance(input_ids, list) and input_ids and all(is_token_list(x) for x in input_ids):
            is_batch, id_lists = True, [list(x) for x in input_ids]
        else:
            raise ApiError("input_ids: must be a list of integers or a non-empty list of such lists")
        texts = [None] * len(id_lists)
    count = len(id_lists)

    stream = check_bool("stream", body.get("stream", False))
    params_in = _per_item("sampling_params", body.get("sampling_params"), count, is_batch)
    if isinstance(body.get("sampling_params"), list) and not is_batch:
        raise ApiError("sampling_params: must be an object for a single prompt")
    rids = body.get("rid")
    if rids is None:
        rids = [new_rid() for _ in range(count)]
    elif is_batch:
        if not (isinstance(rids, list) and len(rids) == count and all(isinstance(r, str) and r for r in rids)):
            raise ApiError("rid: a batch needs a list with one non-empty string per prompt")
    else:
        if not (isinstance(rids, str) and rids):
            raise ApiError("rid: must be a non-empty string")
        rids = [rids]
    if len(set(rids)) != len(rids):
        raise ApiError("rid: the rids of a batch must differ")

    return_logprob = _per_item("return_logprob", body.get("return_logprob", False), count, is_batch)
    start_lens = _per_item("logprob_start_len", body.get("logprob_start_len", -1), count, is_batch)
    top_nums = _per_item("top_logprobs_num", body.get("top_logprobs_num", 0), count, is_batch)
    lora_paths = _per_item("lora_path", body.get("lora_path"), count, is_batch)
    with_text = check_bool("return_text_in_logprobs", body.get("return_text_in_logprobs", False))

    session_id = session_rid = None
    if body.get("session") is not None:
        session = body["session"]
        if is_batch:
            raise ApiError("session: only a single (non-batch) request can carry a session")
        if not (isinstance(session, list) and len(session) == 2 and isinstance(session[0], str)
                and (session[1] is None or isinstance(session[1], str))):
            raise ApiError("session: must be [session_id, session_rid or null]")
        session_id, session_rid = session

    specs = []
    for i in range(count):
        name = f"sampling_params[{i}]" if is_batch and isinstance(body.get("sampling_params"), list) else "sampling_params"
        params = sampling_params_from(params_in[i], tokenizer, name)
        start = check_int("logprob_start_len", start_lens[i], minimum=-1)
        # A session request's input also holds its history, known only to the scheduler.
        if session_id is None and start > 0 and start >= len(id_lists[i]):
            raise ApiError(f"logprob_start_len: must be < the prompt length ({len(id_lists[i])}), got {start}")
        specs.append(
            ReqSpec(
                rid=rids[i], input_ids=id_lists[i], sampling_params=params, input_text=texts[i],
                return_logprob=check_bool("return_logprob", return_logprob[i]),
                logprob_start_len=start,
                top_logprobs_num=check_int("top_logprobs_num", top_nums[i], minimum=0),
                return_text_in_logprobs=with_text, stream=stream,
                session_id=session_id, session_rid=session_rid,
                lora_path=check_optional_str("lora_path", lora_paths[i]),
            )
        )
    ns = {s.sampling_params.n for s in specs}
    if len(ns) != 1:
        raise ApiError("sampling_params.n: must be the same for every prompt of a batch")
    n = ns.pop()
    if n > 1 and session_id is not None:
        raise ApiError("sampling_params.n: a session request takes n = 1")
    return GenerateBatch(specs=specs, n=n, is_batch=is_batch or n > 1, stream=stream)


# ---------------------------------------------------------------------------------------------
# Responses


def logprob_entries(pairs: list | None, decode: Callable[[int], str] | None) -> list | None:
    """[(logprob, id), ...] -> [[logprob, id, text|None], ...] (reference convert_logprob_style)."""
    if pairs is None:
        return None
    return [[lp, tid, decode(tid) if decode else None] for lp, tid in pairs]


def top_logprob_entries(tops: list | None, decode: Callable[[int], str] | None) -> list | None:
    if tops is None:
        return None
    return [None if t is None else logprob_entries(t, decode) for t in tops]


def native_output(out: "StrOutput", spec: ReqSpec, decode: Callable[[int], str], text: str,
                  index: int | None = None) -> dict:
    """The /generate response dict of one request (reference 3.1 'Generate response')."""
    meta = dict(out.meta_info)
    if spec.return_logprob:
        dec = decode if spec.return_text_in_logprobs else None
        meta["input_token_logprobs"] = logprob_entries(meta.get("input_token_logprobs"), dec)
        meta["output_token_logprobs"] = logprob_entries(meta.get("output_token_logprobs"), dec)
        meta["input_top_logprobs"] = top_logprob_entries(meta.get("input_top_logprobs"), dec)
        meta["output_top_logprobs"] = top_logprob_entries(meta.get("output_top_logprobs"), dec)
    result = {"text": text, "output_ids": list(out.output_ids), "meta_info": meta}
    if index is not None:
        result["index"] = index
    return result
