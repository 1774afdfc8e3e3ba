"""Typed messages between the tokenizer side and the scheduler (reference section A6).

They are plain dataclasses, pickled over ZMQ in server mode and passed through in-process queues by
the offline Engine.

Server-mode routes (framework/server): TokenizerManager -> Scheduler: GenerateReqInput, AbortReq and
the control requests; Scheduler -> Detokenizer: BatchTokenOut; Detokenizer -> TokenizerManager:
BatchStrOut; Scheduler -> TokenizerManager: the control replies (``*Output``, SchedulerStats), each
carrying the ``request_id`` of the request it answers. With data parallelism a controller stands
between: TokenizerManager -> controller -> one or all replicas; the replicas' control replies and
``ReplicaFinished`` reports go to the controller, which forwards (or combines) the replies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from framework.multimodal import ImageInputs
from framework.request import FinishReason, SamplingParams


@dataclass
class GenerateReqInput:
    """A tokenized request (TokenizedGenerateReqInput; with `is_embedding`, the reference's
    TokenizedEmbeddingReqInput: a prefill whose output is the pooled hidden state)."""

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
    # Request identity (checked by framework.request.check_identity before it is sent).
    client_id: str | None = None
    priority: int | None = None
    slo_ttft_ms: float | None = None
    image_inputs: ImageInputs | None = None
    is_embedding: bool = False
    # [len(input_ids), hidden] float32 prompt vectors; input_ids are then placeholders (zeros).
    input_embeds: Any = None
    lora_path: str | None = None


@dataclass
class AbortReq:
    rid: str


@dataclass
class FlushCacheReq:
    # Set when the sender waits for a FlushCacheReqOutput; None: fire and forget (offline engine).
    request_id: str | None = None


@dataclass
class ReqOutput:
    """One request's state as emitted by the scheduler (an element of BatchTokenIDOut)."""

    rid: str
    vid: int
    output_ids: list[int]  # all output ids so far
    finished_reason: FinishReason | None
    meta_info: dict[str, Any]
    embedding: list[float] | None = None  # an embedding request's output
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True


@dataclass
class BatchTokenOut:
    outputs: list[ReqOutput] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Server mode: detokenized outputs, control requests and their replies


@dataclass
class StrOutput:
    """One request's detokenized state (an element of BatchStrOut): the text is cumulative."""

    rid: str
    text: str
    output_ids: list[int]
    finished_reason: FinishReason | None
    meta_info: dict[str, Any]
    embedding: list[float] | None = None


@dataclass
class BatchStrOut:
    outputs: list[StrOutput] = field(default_factory=list)


@dataclass
class FlushCacheReqOutput:
    request_id: str | None
    success: bool
    message: str = ""


@dataclass
class OpenSessionReq:
    """Open a session under an id chosen by the sender (a uuid4 hex, as in the reference)."""

    session_id: str
    capacity_of_str_len: int = 0
    request_id: str | None = None


@dataclass
class OpenSessionReqOutput:
    request_id: str | None
    session_id: str
    success: bool
    message: str = ""


@dataclass
class CloseSessionReq:
    session_id: str
    request_id: str | None = None


@dataclass
class CloseSessionReqOutput:
    request_id: str | None
    session_id: str
    success: bool
    message: str = ""


@dataclass
class UpdateWeightsReq:
    """Load new weights from a local folder into the running worker (reference R4)."""

    model_path: str
    request_id: str | None = None


@dataclass
class UpdateWeightsReqOutput:
    request_id: str | None
    success: bool
    message: str = ""


@dataclass
class ProfileReq:
    """Start or stop the torch profiler in the scheduler process (reference R5)."""

    action: str  # "start" or "stop"
    request_id: str | None = None


@dataclass
class ProfileReqOutput:
    request_id: str | None
    success: bool
    message: str = ""  # on a successful stop: the trace file's path


@dataclass
class GetStatsReq:
    """Ask for a SchedulerStats snapshot (for /get_server_info and /metrics)."""

    request_id: str | None = None


@dataclass
class ClientStats:
    """One client's share of the scheduler (framework/clients.py); an element of
    `SchedulerStats.clients`, keyed by the client's label."""

    served_tokens: int = 0  # prompt_tokens + output_tokens
    prompt_tokens: int = 0  # computed by prefill passes (prefix-cache hits are not)
    output_tokens: int = 0
    num_waiting_reqs: int = 0
    num_running_reqs: int = 0


@dataclass
class SchedulerStats:
    """The scheduler's gauges (reference S3) plus the pools' free counts, at one moment."""

    request_id: str | None
    num_running_reqs: int
    num_queue_reqs: int
    num_used_tokens: int
    token_usage: float
    gen_throughput: float
    cache_hit_rate: float
    max_total_num_tokens: int
    kv_available: int
    kv_evictable: int
    req_slots_free: int
    req_slots_total: int
    num_sessions: int
    forward_ct: int
    num_received_reqs: int = 0
    num_grammar_queue_reqs: int = 0  # requests whose grammar is still compiling
    # Per client: the `metrics.max_client_labels` clients with the most served tokens, then
    # "anonymous" (no client id) and "other" (the rest).
    clients: dict[str, ClientStats] = field(default_factory=dict)
    # The replica this scheduler is (None without data parallelism); a data-parallel
    # controller's aggregate has None here and the replicas' own stats in `replicas`.
    dp_rank: int | None = None
    replicas: list["SchedulerStats"] = field(default_factory=list)


@dataclass
class ReplicaFinished:
    """Replica -> data-parallel controller: these requests finished (their last output was sent).

    The controller's load of a replica and its abort routing are the requests it sent there that
    have not been reported finished."""

    dp_rank: int
    rids: list[str]


@dataclass
class SchedulerReady:
    """Start-up handshake (reference A2), sent once the model and the pools are ready."""

    max_total_num_tokens: int
    max_req_input_len: int
    context_len: int
    vocab_size: int
    pid: int
    hidden_size: int = 0
    is_generation: bool = True


@dataclass
class SchedulerFailed:
    """Start-up failed; the message is the error, for the server's log."""

    message: str
