"""The worker boundary: what a worker plugin provides to the scheduler.

One scheduler loop serves every worker. ``launch(batch)`` returns a handle; ``handle.result()``
blocks until the batch's `BatchResult` is ready. A plain worker's handle is already resolved; a
pipelined (overlap) worker's resolves on its forward thread, and the loop processes the previous
batch's result after launching the next one.

``handle.next_token_ids`` is known at launch: the real ids for a plain worker, negative
placeholders for a pipelined one. The scheduler feeds them to the next decode step of requests
whose result it has not processed yet; the worker resolves placeholders before its forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    from framework.batch import ModelWorkerBatch
    from framework.memory import ReqToTokenPool, TokenToKVPool


@dataclass
class BatchResult:
    """What one forward pass produced, one entry per request of the batch."""

    next_token_ids: list[int]
    # Logprobs (only when the batch asked for them).
    next_token_logprobs: list[float] | None = None
    next_token_top_logprobs: list[list[tuple[float, int]]] | None = None
    input_token_logprobs: list[list[float]] | None = None
    input_top_logprobs: list[list[list[tuple[float, int]]]] | None = None
    normalized_prompt_logprobs: list[float] | None = None
    # An embedding batch's pooled vectors (its next_token_ids are empty).
    embeddings: list[list[float]] | None = None
    # Batches with a DraftCheck: per request, how many of its draft tokens the model agreed with
    # (its next_token_ids entry is then the model's token after those).
    kept_draft_tokens: list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class ResultHandle(Protocol):
    #: One id per request of the batch, known at launch: real, or a negative placeholder.
    next_token_ids: list[int]

    def result(self) -> BatchResult: ...


class ResolvedHandle:
    """A handle whose result is already known (the plain worker)."""

    __slots__ = ("_result", "next_token_ids")

    def __init__(self, result: BatchResult):
        self._result = result
        self.next_token_ids = result.next_token_ids

    def result(self) -> BatchResult:
        return self._result


class Worker(Protocol):
    """What `create_worker` must return."""

    #: True when `launch` returns before the forward pass is done (the overlap worker).
    is_pipelined: bool
    #: False when frequency/presence/repetition penalties cannot be applied (their token history
    #: lags one step behind a pipelined worker); the scheduler then drops them with a warning.
    supports_output_penalties: bool
    req_to_token_pool: "ReqToTokenPool"
    token_to_kv_pool: "TokenToKVPool"
    max_total_num_tokens: int
    max_running_requests: int
    context_len: int
    tokenizer: Any
    eos_token_ids: set[int]
    vocab_size: int
    #: Set by multimodal models (framework.multimodal.ImageTokenInfo); None otherwise.
    image_info: Any
    hidden_size: int
    #: False for an embedding model: its batches are embedding batches (`batch.is_embedding`),
    #: answered with `BatchResult.embeddings`.
    is_generation: bool

    def launch(self, batch: "ModelWorkerBatch") -> ResultHandle: ...

    def run_in_forward_thread(self, fn: Callable[[], Any]) -> Any:
        """`fn()` in the thread that runs the forward passes, after every batch already launched;
        returns its result (the profiler starts there: it records that thread's operators)."""
        ...

    def update_weights(self, model_path: str) -> tuple[bool, str]:
        """Load new weights of the same architecture; on failure keep the old ones (R4)."""
        ...

    def shutdown(self) -> None: ...


#: What `create_worker`'s answer must have (checked at start-up).
WORKER_MEMBERS: tuple[str, ...] = (
    *Worker.__annotations__, *(name for name, value in vars(Worker).items() if callable(value) and name[0] != "_"),
)
