"""The overlap worker (reference TpModelWorkerClient, section K), the default for generation models.

It wraps the plain `TpWorker` and runs its forward passes on a forward thread, so the scheduler
builds batch k+1 and processes batch k-1's result while batch k computes. `launch` returns at once
with negative placeholders for the batch's next-token ids (K2); the next decode step is built from
them, and the forward thread swaps them for the sampled ids through a future-token map before its
forward pass (K3). Batches run in launch order, so a placeholder is always resolved from a batch
that already ran.

Grammar handshake (DUMMY_FIRST, reference C2/C3 and 4.1): a batch with a `vocab_mask_ready` event
is sampled only once the event fires, between the forward pass and sampling. The scheduler sets it
after it has processed batch k-1's result (so each matcher has accepted its request's last token)
and filled batch k's vocab mask; at the start of a pipeline it fills the mask right after launch.

Control calls (`update_weights`, the profiler's start and stop) run on the forward thread too,
after every batch launched before them: new weights never change under a forward pass, and the
profiler records the operators of the thread that runs the model.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from functools import partial
from typing import Any, Callable

import torch

from framework import hookimpl
from framework.worker import BatchResult, ResolvedHandle
from plugins.workers import tp

PLUGIN_KIND = "worker"

logger = logging.getLogger(__name__)


class FutureTokenMap:
    """Placeholder `-j` stands for `ids[j]`. Ranges are handed out cyclically (reference K1/K2).

    Only the placeholders of the last launched batch are still read when the next one is built
    (the scheduler has processed every older result by then), so a cycle of three maximal batches
    never hands out a live range twice.
    """

    def __init__(self, max_batch_size: int):
        self.max_batch_size = max_batch_size
        self.limit = 3 * max_batch_size
        self.ids = torch.zeros(self.limit + max_batch_size + 1, dtype=torch.int64)
        self.ct = 0

    def allocate(self, batch_size: int) -> tuple[int, list[int]]:
        """Called on the scheduler thread: the range start and the placeholders of a new batch."""
        if batch_size > self.max_batch_size:
            raise ValueError(f"batch of {batch_size} requests exceeds the {self.max_batch_size} request slots")
        start = self.ct
        self.ct = (self.ct + batch_size) % self.limit
        return start, list(range(-(start + 1), -(start + batch_size + 1), -1))

    def resolve(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Called on the forward thread: a copy of `input_ids` with placeholders replaced."""
        is_future = input_ids < 0
        if not bool(is_future.any()):
            return input_ids
        return torch.where(is_future, self.ids[(-input_ids).clamp(min=0)], input_ids)

    def store(self, start: int, token_ids: list[int]) -> None:
        self.ids[start + 1 : start + 1 + len(token_ids)] = torch.tensor(token_ids, dtype=torch.int64)


class FutureHandle:
    """A launched batch: placeholders now, the `BatchResult` once the forward thread is done."""

    __slots__ = ("next_token_ids", "_future")

    def __init__(self, next_token_ids: list[int], future: Future):
        self.next_token_ids = next_token_ids
        self._future = future

    def result(self) -> BatchResult:
        # An exception on the forward thread is raised here, in the scheduler's thread.
        return self._future.result()


class OverlapWorker:
    """Pipelined worker: the scheduler thread enqueues, the forward thread computes."""

    is_pipelined = True
    supports_output_penalties = False

    def __init__(self, inner: tp.TpWorker):
        self.inner = inner
        self.runner = inner.runner  # read by tools that report the model's dtype (bench)
        self.req_to_token_pool = inner.req_to_token_pool
        self.token_to_kv_pool = inner.token_to_kv_pool
        self.max_total_num_tokens = inner.max_total_num_tokens
        self.max_running_requests = inner.max_running_requests
        self.context_len = inner.context_len
        self.tokenizer = inner.tokenizer
        self.vocab_size = inner.vocab_size
        self.eos_token_ids = inner.eos_token_ids
        self.hidden_size = inner.hidden_size
        self.is_generation = inner.is_generation
        self.image_info = inner.image_info
        # No batch holds more requests than there are request slots.
        self.future_map = FutureTokenMap(self.req_to_token_pool.size)
        self.input_queue: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None
        # Daemon: a scheduler process that exits on an error must not wait for this thread.
        self.forward_thread = threading.Thread(target=self.forward_loop, name="forward", daemon=True)
        self.forward_thread.start()

    def launch(self, batch) -> FutureHandle | ResolvedHandle:
        if batch.forward_mode.is_idle():
            return ResolvedHandle(BatchResult(next_token_ids=[]))
        start, placeholders = self.future_map.allocate(batch.batch_size)
        return FutureHandle(placeholders, self.submit(partial(self.run_batch, batch, start)))

    def submit(self, task: Callable[[], Any]) -> Future:
        """Queue `task` for the forward thread, behind everything queued before it."""
        future: Future = Future()
        self.input_queue.put((task, future))
        return future

    def forward_loop(self) -> None:
        while True:
            item = self.input_queue.get()
            if item is None:
                return
            task, future = item
            if self.error is not None:
                # Later batches depend on the failed one's tokens: fail them too, never hang.
                future.set_exception(self.error)
                continue
            try:
                result = task()
            except BaseException as exc:  # handed to the scheduler thread by the future
                self.error = exc
                future.set_exception(exc)
            else:
                future.set_result(result)

    def run_batch(self, batch, start: int) -> BatchResult:
        result = self.forward(batch)
        self.future_map.store(start, result.next_token_ids)
        return result

    def forward(self, batch) -> BatchResult:
        batch.input_ids = self.future_map.resolve(batch.input_ids)
        logits_output = self.inner.runner.forward(batch)
        if batch.vocab_mask_ready is not None:
            batch.vocab_mask_ready.wait()
        return self.inner.sample(logits_output, batch)

    def run_in_forward_thread(self, fn: Callable[[], Any]) -> Any:
        """`fn()` on the forward thread, after every batch launched before; waits for its result."""
        return self.submit(fn).result()

    def update_weights(self, model_path: str) -> tuple[bool, str]:
        # Batches still in flight (of requests already finished) run on the old weights first.
        return self.run_in_forward_thread(partial(self.inner.update_weights, model_path))

    def shutdown(self) -> None:
        if self.forward_thread.is_alive():
            self.input_queue.put(None)
            self.forward_thread.join()
        self.inner.shutdown()


def overlap_fallback_reason(settings, worker) -> str | None:
    """Why the overlap worker cannot serve this model and settings, or None when it can.

    Embedding models (a worker whose `is_generation` is False) never overlap (reference K7, Y2);
    DP attention turns overlap off (L1), and so does tensor parallelism here: the forward thread's
    collectives would interleave with the scheduler thread's broadcasts; `worker.overlap_penalties = "fallback"` keeps
    frequency/presence/repetition penalties exact, which the pipelined worker cannot (W4).
    """
    if not getattr(worker, "is_generation", True):
        return "embedding models run on the plain worker"
    if settings.parallel.enable_dp_attention:
        return "DP attention disables the overlap scheduler"
    if settings.parallel.tp_size > 1:
        return "tensor-parallel ranks run their collectives on one thread"
    if settings.worker.overlap_penalties == "fallback":
        return 'worker.overlap_penalties = "fallback" keeps penalties exact'
    return None


@hookimpl
def create_worker(settings, tp_rank):
    inner = tp.create_worker(settings=settings, tp_rank=tp_rank)
    reason = overlap_fallback_reason(settings, inner)
    if reason is not None:
        logger.info("Overlap worker not used (%s); running the plain tp worker.", reason)
        return inner
    return OverlapWorker(inner)
