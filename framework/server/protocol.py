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

from framework.images import ImageError, images_per_prompt
from framework.messages import GenerateReqInput
from framework.request import (
    MAX_PARAM_INT,
    SamplingParams,
    check_logprob_args,
    input_embeds_tensor,
    split_input_embeds,
)

if TYPE_CHECKING:
    from framework.messages import StrOutput
    from framework.server.limits import RequestLimits

GENERATE_FIELDS = {
    "text", "input_ids", "input_embeds", "sampling_params", "rid", "return_logprob",
    "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs", "stream", "session", "image_data",
    "lora_path", "client_id", "priority", "slo_ttft_ms",
}
# /encode (reference EmbeddingReqInput); its sampling_params are accepted and ignored.
ENCODE_FIELDS = {"text", "input_ids", "rid", "sampling_params", "client_id", "priority", "slo_ttft_ms"}
# Fields of the reference this build does not serve: a clear 400 instead of silently ignoring them.
UNSUPPORTED_FIELDS = {"modalities"}


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
    # The request's images as sent (data URLs, paths, base64); preprocessed into `image_inputs`.
    image_data: list[str] | None = None
    # time.monotonic() when the request was taken on, before a prefix warm-up (n > 1) that its
    # latency metrics and request timeout must include; None: when it is submitted.
    arrival: float | None = None

    def to_message(self) -> GenerateReqInput:
        """The scheduler's part of the spec (the tokenizer-side fields stay here)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(GenerateReqInput)}
        return GenerateReqInput(**fields)

    def copy_for_sample(self, j: int) -> "ReqSpec":
        """The j-th of n parallel samples: own rid and its own copy of the sampling params. With a
        seed, sample j draws with seed + j: the samples differ, and sample 0 is the n = 1 answer."""
        params = replace(self.sampling_params)
        if params.seed is not None:
            params.seed += j
        return replace(self, rid=f"{self.rid}-{j}", sampling_params=params)


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


@dataclass
class Prompts:
    """The prompts of a request body: ids per prompt, and the text or the vectors they came from."""

    is_batch: bool
    id_lists: list[list[int]]
    texts: list[str | None]
    embeds: list[Any]  # per prompt an input_embeds tensor, or None


def check_fields(body: Any, allowed: set[str]) -> dict:
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    unsupported = sorted(UNSUPPORTED_FIELDS & set(body))
    if unsupported:
        raise ApiError(f"not supported by this server: {', '.join(unsupported)}")
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ApiError(f"unknown field(s): {', '.join(unknown)}")
    return body


def parse_prompts(body: dict, tokenize: Callable[[str], list[int]], hidden_size: int | None = None) -> Prompts:
    """`text`, `input_ids` or (with `hidden_size`) `input_embeds`: exactly one, single or a batch."""
    sources = ["text", "input_ids"] + (["input_embeds"] if hidden_size is not None else [])
    given = [name for name in sources if body.get(name) is not None]
    if len(given) != 1:
        raise ApiError(f"give exactly one of {', '.join(sources[:-1])} or {sources[-1]}")
    text, input_ids = body.get("text"), body.get("input_ids")
    if text is not None:
        if isinstance(text, str):
            is_batch, prompts = False, [text]
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            is_batch, prompts = True, list(text)
        else:
            raise ApiError("text: must be a string or a non-empty list of strings")
        return Prompts(is_batch, [tokenize(t) for t in prompts], list(prompts), [None] * len(prompts))
    if input_ids is not None:
        if is_token_list(input_ids):
            is_batch, id_lists = False, [list(input_ids)]
        elif isinstance(input_ids, list) and input_ids and all(is_token_list(x) for x in input_ids):
            is_batch, id_lists = True, [list(x) for x in input_ids]
        else:
            raise ApiError("input_ids: must be a list of integers or a non-empty list of such lists")
        return Prompts(is_batch, id_lists, [None] * len(id_lists), [None] * len(id_lists))
    single, values = split_input_embeds(body["input_embeds"])
    try:
        embeds = [input_embeds_tensor(v, hidden_size) for v in values]
    except ValueError as exc:
        raise ApiError(str(exc)) from None
    # Placeholder ids: the vectors are the prompt.
    return Prompts(not single, [[0] * len(e) for e in embeds], [None] * len(embeds), embeds)


def parse_rids(rids: Any, count: int, is_batch: bool) -> list[str]:
    if rids is None:
        return [new_rid() for _ in range(count)]
    if is_batch:
        if not (isinstance(rids, list) and len(rids) == count and all(isinstance(r, str) and r for r in rids)):
            raise ApiError("rid: a batch needs a list with one non-empty string per prompt")
    else:
        if not (isinstance(rids, str) and rids):
            raise ApiError("rid: must be a non-empty string")
        rids = [rids]
    if len(set(rids)) != len(rids):
        raise ApiError("rid: the rids of a batch must differ")
    return rids


def parse_encode(body: Any, tokenize: Callable[[str], list[int]],
                 limits: "RequestLimits") -> tuple[list[ReqSpec], bool]:
    """Check an /encode body (reference EmbeddingReqInput): its specs and whether it is a batch."""
    check_fields(body, ENCODE_FIELDS)
    limits.check_counts(num_prompts(body), 1)
    prompts = parse_prompts(body, tokenize)
    if not isinstance(body.get("sampling_params") or {}, (dict, list)):
        raise ApiError("sampling_params: must be an object (it is ignored by /encode)")
    rids = parse_rids(body.get("rid"), len(prompts.id_lists), prompts.is_batch)
    specs = embedding_specs(rids, prompts.id_lists, prompts.texts)
    for spec, identity in zip(specs, parse_identities(body, len(specs), prompts.is_batch, limits)):
        spec.client_id, spec.priority, spec.slo_ttft_ms = identity
    return specs, prompts.is_batch


def embedding_specs(rids: list[str], id_lists: list[list[int]], texts: list[str | None]) -> list[ReqSpec]:
    """Embedding requests: one prefill each, answered with the pooled vector (reference Y3)."""
    params = SamplingParams(max_new_tokens=0)
    params.normalize(None)
    return [
        ReqSpec(rid=rid, input_ids=ids, sampling_params=replace(params), input_text=text, is_embedding=True)
        for rid, ids, text in zip(rids, id_lists, texts)
    ]


def parse_identities(body: dict, count: int, is_batch: bool,
                     limits: "RequestLimits") -> list[tuple[str | None, int | None, float | None]]:
    """(client_id, priority, slo_ttft_ms) per prompt: each field one value for all prompts, or
    in a batch one per prompt."""
    per_prompt = [_per_item(name, body.get(name), count, is_batch) for name in ("client_id", "priority", "slo_ttft_ms")]
    return [limits.check_identity(*values) for values in zip(*per_prompt)]


def num_prompts(body: dict) -> int:
    """How many prompts a body's `text` or `input_ids` holds (before they are checked)."""
    text, input_ids = body.get("text"), body.get("input_ids")
    if isinstance(text, list):
        return len(text)
    if isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list):
        return len(input_ids)
    return 1


def parse_generate(body: Any, tokenize: Callable[[str], list[int]], tokenizer: Any,
                   hidden_size: int, limits: "RequestLimits") -> GenerateBatch:
    """Check a /generate body (reference GenerateReqInput) and build its ReqSpecs."""
    check_fields(body, GENERATE_FIELDS)
    # Before tokenizing: a batch too large is refused without doing the work.
    limits.check_counts(num_prompts(body), 1)
    prompts = parse_prompts(body, tokenize, hidden_size)
    is_batch, id_lists, texts = prompts.is_batch, prompts.id_lists, prompts.texts
    count = len(id_lists)

    stream = check_bool("stream", body.get("stream", False))
    params_in = _per_item("sampling_params", body.get("sampling_params"), count, is_batch)
    if isinstance(body.get("sampling_params"), list) and not is_batch:
        raise ApiError("sampling_params: must be an object for a single prompt")
    rids = parse_rids(body.get("rid"), count, is_batch)

    return_logprob = _per_item("return_logprob", body.get("return_logprob", False), count, is_batch)
    start_lens = _per_item("logprob_start_len", body.get("logprob_start_len", -1), count, is_batch)
    top_nums = _per_item("top_logprobs_num", body.get("top_logprobs_num", 0), count, is_batch)
    lora_paths = _per_item("lora_path", body.get("lora_path"), count, is_batch)
    with_text = check_bool("return_text_in_logprobs", body.get("return_text_in_logprobs", False))
    identities = parse_identities(body, count, is_batch, limits)

    session_id = session_rid = None
    if body.get("session") is not None:
        session = body["session"]
        if is_batch:
            raise ApiError("session: only a single (non-batch) request can carry a session")
        if not (isinstance(session, list) and len(session) == 2 and isinstance(session[0], str)
                and (session[1] is None or isinstance(session[1], str))):
            raise ApiError("session: must be [session_id, session_rid or null]")
        session_id, session_rid = session

    try:
        images = images_per_prompt(body.get("image_data"), count, is_batch)
    except ImageError as exc:
        raise ApiError(str(exc)) from None
    if session_id is not None and images[0] is not None:
        raise ApiError("image_data: a session request cannot carry images")

    specs = []
    for i in range(count):
        name = f"sampling_params[{i}]" if is_batch and isinstance(body.get("sampling_params"), list) else "sampling_params"
        params = sampling_params_from(params_in[i], tokenizer, name)
        limits.check_top_logprobs_num(top_nums[i])  # (with the server's cap)
        try:
            # A session request's input also holds its history, known only to the scheduler.
            check_logprob_args(return_logprob[i], start_lens[i], top_nums[i], MAX_PARAM_INT,
                               len(id_lists[i]) if session_id is None else None)
        except ValueError as exc:
            raise ApiError(str(exc)) from None
        specs.append(
            ReqSpec(
                rid=rids[i], input_ids=id_lists[i], sampling_params=params, input_text=texts[i],
                return_logprob=return_logprob[i],
                logprob_start_len=start_lens[i],
                top_logprobs_num=top_nums[i],
                return_text_in_logprobs=with_text, stream=stream,
                session_id=session_id, session_rid=session_rid, image_data=images[i],
                input_embeds=prompts.embeds[i],
                lora_path=check_optional_str("lora_path", lora_paths[i]),
                client_id=identities[i][0], priority=identities[i][1], slo_ttft_ms=identities[i][2],
            )
        )
    ns = {s.sampling_params.n for s in specs}
    if len(ns) != 1:
        raise ApiError("sampling_params.n: must be the same for every prompt of a batch")
    n = ns.pop()
    if n > 1 and session_id is not None:
        raise ApiError("sampling_params.n: a session request takes n = 1")
    limits.check_counts(count, n)
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
