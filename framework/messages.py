"""Typed messages between the tokenizer side and the scheduler (reference section A6).

They are plain dataclasses, pickled over ZMQ in server mode and passed through in-process queues by
the offline Engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from framework.request import FinishReason, SamplingParams


@dataclass
class GenerateReqInput:
    """A tokenized generation request (TokenizedGenerateReqInput)."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    input_text: str | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    session_id: str | None = None
    session_rid: str | None = None


@dataclass
class AbortReq:
    rid: str


@dataclass
class FlushCacheReq:
    pass


@dataclass
class ReqOutput:
    """One request's state as emitted by the scheduler (an element of BatchTokenIDOut)."""

    rid: str
    vid: int
    output_ids: list[int]  # all output ids so far
    finished_reason: FinishReason | None
    meta_info: dict[str, Any]
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True


@dataclass
class BatchTokenOut:
    outputs: list[ReqOutput] = field(default_factory=list)
