"""Bounds on everything a request's size decides (server.* settings), checked where it is parsed.

A request may only cost what these bounds allow: its body's bytes, its JSON's nesting and number
lengths, its prompt's bytes before tokenizing, its top logprobs per position, its samples and the
requests it starts. Anything over a bound is a 400 naming the field and the setting; nothing of it
reaches the scheduler, where one bad request would take every other one down with it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from framework.config import ServerSettings
from framework.request import check_identity
from framework.server.protocol import ApiError, check_int


@dataclass(frozen=True)
class RequestLimits:
    max_request_bytes: int
    max_json_depth: int
    max_json_number_digits: int
    max_prompt_bytes: int
    # Already the smaller of the setting and the vocabulary size.
    max_top_logprobs_num: int
    max_n: int
    max_batch_requests: int
    max_client_id_chars: int = 256
    # Whether max_prompt_bytes is the setting's (else derived from the longest input).
    prompt_bytes_set: bool = False

    @classmethod
    def from_settings(cls, server: ServerSettings, vocab_size: int, max_req_input_len: int,
                      token_bytes: int) -> "RequestLimits":
        """`token_bytes`: the most UTF-8 bytes one token's text can take (see `max_token_bytes`)."""
        prompt_bytes = server.max_prompt_bytes or max_req_input_len * token_bytes
        return cls(
            max_request_bytes=server.max_request_bytes, max_json_depth=server.max_json_depth,
            max_json_number_digits=server.max_json_number_digits, max_prompt_bytes=prompt_bytes,
            max_top_logprobs_num=min(server.max_top_logprobs_num, vocab_size), max_n=server.max_n,
            max_batch_requests=server.max_batch_requests, max_client_id_chars=server.max_client_id_chars,
            prompt_bytes_set=server.max_prompt_bytes is not None,
        )

    # -- JSON ------------------------------------------------------------------------------------

    def parse_json(self, raw: bytes, allow_empty: bool = False) -> Any:
        """The body as JSON, or an ApiError: malformed, NaN/Infinity, a number with more than
        `max_json_number_digits` characters, nesting deeper than `max_json_depth`, or a string
        that is not Unicode text (a lone surrogate escape such as \\ud800)."""
        if not raw.strip() and allow_empty:
            return {}
        try:
            value = json.loads(raw, parse_int=self._number(int), parse_float=self._number(float),
                               parse_constant=_no_constant)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(f"malformed JSON body: {exc}") from None
        except RecursionError:
            raise ApiError(f"malformed JSON body: nested deeper than {self.max_json_depth} levels "
                           "(server.max_json_depth)") from None
        check_json_value(value, self.max_json_depth)
        return value

    def _number(self, convert):
        limit = self.max_json_number_digits

        def parse(text: str):
            if len(text) > limit:
                raise ApiError(f"malformed JSON body: a number of {len(text)} characters is over the "
                               f"limit of {limit} (server.max_json_number_digits)")
            return convert(text)

        return parse

    # -- request fields --------------------------------------------------------------------------

    def check_prompt_bytes(self, text: str, name: str = "text") -> None:
        """Before tokenizing: a prompt of more bytes than `max_prompt_bytes` cannot fit the context."""
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > self.max_prompt_bytes:
            if self.prompt_bytes_set:
                raise ApiError(f"{name}: the prompt is {size} bytes, more than server.max_prompt_bytes allows "
                               f"({self.max_prompt_bytes} bytes)")
            raise ApiError(f"{name}: the prompt is {size} bytes, more than the longest input this server takes "
                           f"could be ({self.max_prompt_bytes} bytes: its tokens times the longest token's bytes; "
                           "server.max_prompt_bytes sets another bound)")

    def check_top_logprobs_num(self, value: Any, name: str = "top_logprobs_num") -> int:
        check_int(name, value, minimum=0)
        if value > self.max_top_logprobs_num:
            raise ApiError(f"{name}: must be <= {self.max_top_logprobs_num} (server.max_top_logprobs_num "
                           f"and the vocabulary size), got {value}")
        return value

    def check_identity(self, client_id: Any, priority: Any, slo_ttft_ms: Any,
                       client_id_name: str = "client_id") -> tuple[str | None, int | None, float | None]:
        """A request's client id (at most `max_client_id_chars`, no control characters), priority
        (an integer, |p| <= 2^31 - 1) and slo_ttft_ms (a finite number >= 0); each may be null."""
        try:
            return check_identity(client_id, priority, slo_ttft_ms, self.max_client_id_chars, client_id_name)
        except ValueError as exc:
            raise ApiError(str(exc)) from None

    def check_counts(self, num_prompts: int, n: int, name: str = "sampling_params.n") -> None:
        """`n` samples of `num_prompts` prompts: n <= max_n, and at most max_batch_requests in all."""
        if n > self.max_n:
            raise ApiError(f"{name}: must be <= {self.max_n} (server.max_n), got {n}")
        total = num_prompts * n
        if total > self.max_batch_requests:
            raise ApiError(f"{num_prompts} prompts x n = {n} make {total} requests, over the limit of "
                           f"{self.max_batch_requests} (server.max_batch_requests)")


def _no_constant(name: str):
    raise ApiError(f"malformed JSON body: {name} is not a JSON number")


def check_json_value(value: Any, max_depth: int) -> None:
    """Nesting at most `max_depth` (containers in containers) and only encodable strings, keys
    included: a lone surrogate would fail later in the tokenizer or in the JSON answer."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            _check_text(item)
            continue
        if isinstance(item, dict):
            children = [*item.keys(), *item.values()]
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > max_depth:
            raise ApiError(f"malformed JSON body: nested deeper than {max_depth} levels (server.max_json_depth)")
        stack.extend((child, depth + 1) for child in children if isinstance(child, (str, dict, list)))


def _check_text(text: str) -> None:
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(f"malformed JSON body: the string {text[:40]!r} is not valid Unicode text "
                       f"(a lone surrogate at position {exc.start})") from None


def max_token_bytes(tokenizer: Any) -> int:
    """The most UTF-8 bytes of one token's vocabulary entry: an upper bound on the text one token
    stands for (a byte-level entry spells each byte with one or two bytes, a SentencePiece one its
    text, "▁" or "<0x..>" for fewer bytes), so a prompt over `context x this` cannot fit."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return max((len(t.encode("utf-8", "surrogatepass")) for t in tokens if isinstance(t, str)), default=1)
