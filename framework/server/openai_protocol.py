"""Request models of the OpenAI-compatible API (reference 3.2, `openai_api/protocol.py`).

Types are strict (a string is not a number) and values are checked again by SamplingParams; null
for an optional field is its default, as in the OpenAI API.
Unknown fields are ignored, as in the reference, so newer clients keep working.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from framework.server.protocol import ApiError


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_the_default(cls, data: Any) -> Any:
        # The OpenAI API takes null for every optional field (the openai client sends
        # `temperature=None` as null); a required field's null is still refused.
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}


class StreamOptions(_Strict):
    include_usage: bool = False


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class _SamplingExtras(_Strict):
    """Fields both endpoints share; the last group are the reference's extensions."""

    model: str
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # accepted and ignored, as in the reference
    n: int = 1
    seed: int | None = None  # the reference ignores it; here it seeds the sampler
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    top_p: float = 1.0
    user: str | None = None  # the client id (framework.request.check_client_id)
    # Extensions.
    priority: int | None = None
    slo_ttft_ms: float | None = None
    top_k: int = -1
    min_p: float = 0.0
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    no_stop_trim: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    regex: str | None = None
    json_schema: str | None = None
    response_format: ResponseFormat | None = None
    # Known so that it is refused (openai_api._validate) rather than ignored: no adapters here.
    lora_path: str | None = None

    def sampling_dict(self, max_new_tokens: int | None, temperature: float) -> dict[str, Any]:
        return {
            "temperature": temperature, "max_new_tokens": max_new_tokens, "min_new_tokens": self.min_tokens,
            "stop": self.stop, "stop_token_ids": self.stop_token_ids, "top_p": self.top_p,
            "top_k": self.top_k, "min_p": self.min_p, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty, "repetition_penalty": self.repetition_penalty,
            "regex": self.regex, "json_schema": self.json_schema_of_response_format(), "n": self.n,
            "no_stop_trim": self.no_stop_trim, "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens, "seed": self.seed,
        }


    def json_schema_of_response_format(self) -> str | None:
        """The JSON schema string that `response_format` asks for, else the `json_schema` extension.

        `json_object` is any JSON object (the reference ignores it). Bad combinations are an ApiError (400).
        """
        fmt = self.response_format
        if fmt is None or fmt.type == "text":
            return self.json_schema
        if self.json_schema is not None or self.regex is not None:
            raise ApiError("response_format: cannot be combined with json_schema or regex")
        if fmt.type == "json_object":
            return json.dumps({"type": "object"})
        spec = fmt.json_schema
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ApiError("response_format.json_schema.schema: required, a JSON schema object")
        if not isinstance(spec["schema"], dict):
            raise ApiError(f"response_format.json_schema.schema: must be a JSON schema object, got "
                           f"{type(spec['schema']).__name__}")
        return json.dumps(spec["schema"])


class CompletionRequest(_SamplingExtras):
    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = None
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    max_tokens: int = 16
    suffix: str | None = None
    temperature: float = 1.0


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingExtras):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float = 0.7


class EmbeddingRequest(_Strict):
    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None  # must be the model's hidden size when given
    user: str | None = None  # the client id, as for completions
    priority: int | None = None  # extension
    slo_ttft_ms: float | None = None  # extension
