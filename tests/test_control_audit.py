"""Control endpoints while the server is busy: weight updates against the requests in flight.

The TokenizerManager runs here without a server: a fake scheduler (its `send_to_scheduler`)
records what is sent and answers on the event loop.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from framework.messages import GenerateReqInput, SchedulerReady, StrOutput, UpdateWeightsReq, UpdateWeightsReqOutput
from framework.metrics import ServerMetrics
from framework.request import FinishLength, SamplingParams
from framework.server import tokenizer_manager
from framework.server.ipc import IpcNames
from framework.server.protocol import ApiError, ReqSpec, embedding_specs
from framework.server.tokenizer_manager import TokenizerManager


@pytest.fixture
def tm(tmp_path):
    ipc = IpcNames(*(f"ipc://{tmp_path}/{n}" for n in ("t", "s", "d")))
    ready = SchedulerReady(max_total_num_tokens=100, max_req_input_len=50, context_len=64, vocab_size=10, pid=0)
    tm = TokenizerManager(ipc, ready, tokenizer=None, metrics=ServerMetrics("m"))
    yield tm
    tm.close()


def _finish(tm: TokenizerManager, rid: str) -> None:
    meta = {"prompt_tokens": 1, "completion_tokens": 1}
    tm._on_output(StrOutput(rid, "", [1], FinishLength(1), meta), time.monotonic())


def _fake_scheduler(tm: TokenizerManager, sent: list, update_s: float = 0.0, request_s: float = 0.0) -> None:
    """Requests finish after `request_s`, except the rid "long" (finished by the test); a weight
    update answers success after `update_s`."""
    loop = asyncio.get_running_loop()

    def send(msg):
        sent.append(msg)
        if isinstance(msg, UpdateWeightsReq):
            reply = UpdateWeightsReqOutput(msg.request_id, True, f"Updated weights from {msg.model_path}")
            loop.call_later(update_s, lambda: tm.pending[msg.request_id].set_result(reply))
        elif isinstance(msg, GenerateReqInput) and msg.rid != "long":
            loop.call_later(request_s, _finish, tm, msg.rid)

    tm.send_to_scheduler = SimpleNamespace(send_pyobj=send)


@pytest.mark.parametrize("kind", ["encode", "health_generate"])
def test_requests_without_a_generate_body_wait_for_a_weight_update(tm, kind):
    """New requests wait while an update runs (docs/api.md); /encode, /v1/embeddings and
    /health_generate were sent at once: they ran beside the old weights' requests, kept the update
    waiting (a steady stream of them starved it into its 60 s 'still running' refusal), and the
    update was sent only after them."""
    sent: list = []

    async def scenario():
        _fake_scheduler(tm, sent, request_s=0.05)
        if kind == "encode":
            long, late = embedding_specs(["long", "late"], [[1], [1]], [None, None])
        else:
            long, late = (ReqSpec(rid=rid, input_ids=[0], sampling_params=SamplingParams(max_new_tokens=1))
                          for rid in ("long", "late"))
        running = asyncio.ensure_future(tm.run_all([long]))
        await asyncio.sleep(0)
        update = asyncio.ensure_future(tm.update_weights_from_disk("/models/step2"))
        await asyncio.sleep(0.05)  # the update now waits for "long"
        late_done = asyncio.ensure_future(tm.run_all([late]))
        await asyncio.sleep(0.05)
        _finish(tm, "long")
        await asyncio.wait_for(asyncio.gather(running, late_done), 5)
        assert await asyncio.wait_for(update, 5) == (True, "Updated weights from /models/step2")

    tm.ready.is_generation = kind != "encode"
    asyncio.run(scenario())
    order = [type(m).__name__ if isinstance(m, UpdateWeightsReq) else m.rid for m in sent]
    assert order == ["long", "UpdateWeightsReq", "late"]


def test_a_weight_update_waits_for_its_answer_past_the_control_timeout(tm, monkeypatch):
    """Loading a large checkpoint (or converting a GGUF) outlasts CONTROL_TIMEOUT_S: the update was
    answered 503 'did not answer in time' and new requests let through while the scheduler went on
    to swap the weights, so /get_model_info kept the old path. It waits for the scheduler's answer
    (a dead scheduler still wakes it with a 503)."""
    monkeypatch.setattr(tokenizer_manager, "CONTROL_TIMEOUT_S", 0.1)
    sent: list = []

    async def scenario():
        _fake_scheduler(tm, sent, update_s=0.4)
        return await tm.update_weights_from_disk("/models/big")

    assert asyncio.run(scenario()) == (True, "Updated weights from /models/big")


def test_a_weight_update_ends_with_503_when_the_scheduler_dies(tm):
    async def scenario():
        _fake_scheduler(tm, [], update_s=60.0)
        update = asyncio.ensure_future(tm.update_weights_from_disk("/models/big"))
        await asyncio.sleep(0.05)
        tm.mark_dead("The scheduler process died.")
        with pytest.raises(ApiError) as err:
            await asyncio.wait_for(update, 5)
        assert err.value.status == 503

    asyncio.run(scenario())
    assert not tm.model_update_lock.locked()
