"""A testing kit for plugin authors: run a few scheduling rounds on invented requests, no model.

    from framework.testing import SchedulerHarness

    def test_my_policy_admits_shortest_first():
        h = SchedulerHarness(mypolicy_module)       # or SchedulerHarness(policy="lpm")
        for ids in ([1, 2, 3, 4], [5], [6, 7]):
            h.add(ids, max_new_tokens=2)
        h.run()
        assert h.prefill_batches()[0] == ["r1", "r2", "r0"]
        h.check_no_leak()

The harness is the real `Scheduler` with `FakeWorker`, a worker whose pools come from a tiny model
configuration (one layer, one head of size one) and whose "forward pass" returns deterministic
non-EOS tokens at once. Everything else (policies, the prefix cache, the budget, retraction) is
the production code, so a round takes about a millisecond.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import torch

from framework import hookimpl
from framework.batch import ModelWorkerBatch
from framework.config import Settings
from framework.memory import ReqToTokenPool, TokenToKVPool
from framework.messages import BatchTokenOut, GenerateReqInput
from framework.request import SamplingParams
from framework.worker import BatchResult, ResolvedHandle

#: The tiny model configuration the fake worker's pools are sized from.
TINY_MODEL = dict(num_layers=1, num_kv_heads=1, head_dim=1, vocab_size=512, context_len=2048)
FAKE_EOS_TOKEN_ID = 0


class FakeWorker:
    """A `framework.worker.Worker` without a model: next token = a hash of the request's last
    input token and its length, never EOS. Plain (not pipelined), synchronous, no timing."""

    is_pipelined = False
    supports_output_penalties = True
    is_generation = True
    image_info = None
    tokenizer = None
    hidden_size = 1

    def __init__(self, max_total_num_tokens: int = 4096, max_running_requests: int = 64):
        self.vocab_size = TINY_MODEL["vocab_size"]
        self.context_len = TINY_MODEL["context_len"]
        self.eos_token_ids = {FAKE_EOS_TOKEN_ID}
        self.max_total_num_tokens = max_total_num_tokens
        self.max_running_requests = max_running_requests
        self.req_to_token_pool = ReqToTokenPool(max_running_requests, self.context_len + 4)
        self.token_to_kv_pool = TokenToKVPool(
            max_total_num_tokens, torch.float32, TINY_MODEL["num_kv_heads"], TINY_MODEL["head_dim"],
            TINY_MODEL["num_layers"],
        )
        self.num_batches = 0

    def next_token(self, last_input_id: int, seq_len: int) -> int:
        return 1 + (last_input_id * 31 + seq_len * 7) % (self.vocab_size - 1)

    def launch(self, batch: ModelWorkerBatch) -> ResolvedHandle:
        self.num_batches += 1
        ends = itertools.accumulate(batch.extend_lens)
        ids = batch.input_ids.tolist()
        seq_lens = batch.seq_lens.tolist()
        next_ids = [self.next_token(ids[end - 1], n) for end, n in zip(ends, seq_lens)]
        embeddings = [[0.0] for _ in next_ids] if batch.is_embedding else None
        return ResolvedHandle(BatchResult(next_token_ids=[] if batch.is_embedding else next_ids, embeddings=embeddings))

    def run_in_forward_thread(self, fn: Callable[[], Any]) -> Any:
        return fn()

    def update_weights(self, model_path: str) -> tuple[bool, str]:
        return False, "the fake worker has no weights"

    def shutdown(self) -> None:
        pass


class FakeWorkerPlugin:
    """A worker plugin object: pass it in ``extra_plugins`` and it takes the selected worker's place."""

    PLUGIN_KIND = "worker"

    @hookimpl
    def create_worker(self, settings: Settings, tp_rank: int) -> FakeWorker:
        sched = settings.scheduler
        return FakeWorker(
            max_total_num_tokens=settings.cache.max_total_tokens or 4096,
            max_running_requests=sched.max_running_requests or 64,
        )


class _Recorder:
    def __init__(self):
        self.batches: list[tuple[str, list[str]]] = []

    @hookimpl
    def on_batch_result(self, batch):
        self.batches.append((batch.forward_mode.name, [r.rid for r in batch.reqs]))


class SchedulerHarness:
    """The real scheduler on a `FakeWorker`, leak check on.

    :param plugins: plugin modules or objects to register. One with ``PLUGIN_KIND = "policy"`` (or
        ``"cache"``) takes the place of the one named in the settings.
    :param policy, cache_plugin: bundled or installed plugins by name.
    :param sections: settings overrides by section, e.g. ``scheduler={"chunked_prefill_size": 64}``
        or ``cache={"max_total_tokens": 512}``.
    """

    def __init__(self, *plugins: Any, policy: str = "fcfs", cache_plugin: str = "radix", **sections: Any):
        base: dict[str, dict] = {
            "plugins": {"policy": policy, "cache": cache_plugin, "worker": "tp"},
            "cache": {"max_total_tokens": 4096},
            "scheduler": {"check_leaks": True},
        }
        for name, values in sections.items():
            base.setdefault(name, {}).update(values)
        from framework.scheduler import Scheduler  # the scheduler imports the model package

        self.recorder = _Recorder()
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, Any] = {}
        self.scheduler = Scheduler(
            Settings.load(None, **base), output_sink=self._collect,
            extra_plugins=(FakeWorkerPlugin(), self.recorder, *plugins),
        )
        self._rids = (f"r{i}" for i in itertools.count())

    def _collect(self, out: BatchTokenOut) -> None:
        for o in out.outputs:
            self.outputs[o.rid] = list(o.output_ids)
            if o.finished_reason is not None:
                self.finished[o.rid] = o.finished_reason

    def add(self, input_ids: list[int], max_new_tokens: int = 4, rid: str | None = None, **params: Any) -> str:
        """Queue a request (delivered at the next step); returns its rid (``r0``, ``r1``, ...)."""
        rid = rid or next(self._rids)
        sampling = SamplingParams(max_new_tokens=max_new_tokens, **params)
        sampling.verify()
        sampling.normalize(None)
        self.scheduler.send(GenerateReqInput(rid=rid, input_ids=list(input_ids), sampling_params=sampling))
        return rid

    def step(self) -> tuple[str, list[str]] | None:
        """One scheduler iteration; the batch it ran as (mode, rids), or None."""
        before = len(self.recorder.batches)
        self.scheduler.run_once()
        return self.recorder.batches[-1] if len(self.recorder.batches) > before else None

    def run(self, max_steps: int = 10_000) -> list[tuple[str, list[str]]]:
        """Step until nothing is left to do (then one idle step); every batch run, in order."""
        start = len(self.recorder.batches)
        for _ in range(max_steps):
            if not self.scheduler.has_work():
                break
            self.scheduler.run_once()
        else:
            raise RuntimeError(f"still busy after {max_steps} steps")
        self.scheduler.run_once()
        return self.recorder.batches[start:]

    @property
    def batches(self) -> list[tuple[str, list[str]]]:
        """Every batch run so far as (forward mode name, rids)."""
        return list(self.recorder.batches)

    def prefill_batches(self) -> list[list[str]]:
        """The rids of each prefill (extend) batch so far, in batch order."""
        return [rids for mode, rids in self.recorder.batches if mode in ("EXTEND", "MIXED")]

    @property
    def waiting_rids(self) -> list[str]:
        return [r.rid for r in self.scheduler.waiting_queue]

    def check_no_leak(self) -> None:
        """Every KV and request slot is free or held by the cache (raises MemoryLeakError)."""
        self.scheduler.check_memory()

    def close(self) -> None:
        self.scheduler.shutdown()

    def __enter__(self) -> "SchedulerHarness":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["FakeWorker", "FakeWorkerPlugin", "SchedulerHarness", "TINY_MODEL"]
