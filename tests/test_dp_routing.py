"""Data-parallel routing (ReplicaRouter, reply merging) and core placement, without processes."""

from __future__ import annotations

import os

import pytest

from framework.config import ParallelSettings
from framework.messages import (
    AbortReq,
    BatchTokenOut,
    CloseSessionReq,
    FlushCacheReq,
    FlushCacheReqOutput,
    GenerateReqInput,
    GetStatsReq,
    OpenSessionReq,
    ReplicaFinished,
    ReqOutput,
    SchedulerStats,
)
from framework.request import FinishLength, SamplingParams
from framework.server.dp_controller import (
    DataParallelController,
    ReplicaRouter,
    combine_stats,
    reporting_finished,
)
from framework.server.placement import plan_cores, process_slot


def gen(rid: str, session_id: str | None = None) -> GenerateReqInput:
    return GenerateReqInput(rid=rid, input_ids=[1, 2], sampling_params=SamplingParams(), session_id=session_id)


def route_one(router: ReplicaRouter, msg) -> int:
    (replica,) = router.route(msg)
    return replica


def test_round_robin_ignores_load():
    router = ReplicaRouter(3, "round_robin")
    assert [route_one(router, gen(f"r{i}")) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    router.finished(ReplicaFinished(1, ["r1", "r4"]))
    assert router.loads == [3, 0, 2]
    assert route_one(router, gen("r7")) == 1 and route_one(router, gen("r8")) == 2


def test_shortest_queue_follows_finished_reports():
    router = ReplicaRouter(3, "shortest_queue")
    # Idle replicas: ties are taken in turn, so a burst is spread before any report arrives.
    assert [route_one(router, gen(f"a{i}")) for i in range(6)] == [0, 1, 2, 0, 1, 2]
    # Replica 2 finishes both of its requests, replica 0 one: the new work goes to 2, then 0.
    router.finished(ReplicaFinished(2, ["a2", "a5"]))
    router.finished(ReplicaFinished(0, ["a0"]))
    assert router.loads == [1, 2, 0]
    assert [route_one(router, gen(f"b{i}")) for i in range(3)] == [2, 0, 2]
    assert router.loads == [2, 2, 2]
    # A report naming a request the replica does not hold (a stale duplicate) changes nothing.
    router.finished(ReplicaFinished(1, ["a0", "a2", "nope"]))
    assert router.loads == [2, 2, 2]


def test_aborts_go_to_the_replica_holding_the_request():
    router = ReplicaRouter(2, "shortest_queue")
    assert route_one(router, gen("x")) == 0 and route_one(router, gen("y")) == 1
    assert router.route(AbortReq("y")) == [1]
    assert router.route(AbortReq("x")) == [0]
    router.finished(ReplicaFinished(1, ["y"]))
    assert router.route(AbortReq("y")) == []  # finished: nothing left to abort
    assert router.route(AbortReq("never-sent")) == []


@pytest.mark.parametrize("method", ["round_robin", "shortest_queue"])
def test_sessions_stick_to_the_replica_that_opened_them(method):
    router = ReplicaRouter(2, method)
    assert router.route(OpenSessionReq("s-a")) == [0]
    assert router.route(OpenSessionReq("s-b")) == [1]
    assert router.route(OpenSessionReq("s-a")) == [0]  # already open: the same replica answers
    homes = {route_one(router, gen(f"t{i}", session_id="s-b")) for i in range(5)}
    assert homes == {1}
    assert router.route(CloseSessionReq("s-b")) == [1]
    # Closed or unknown ids still get their "does not exist" answer from one replica.
    assert router.route(CloseSessionReq("s-b")) == [0]


def test_control_messages_go_to_every_replica():
    router = ReplicaRouter(3)
    assert router.route(FlushCacheReq("f")) == [0, 1, 2]
    assert router.route(GetStatsReq("g")) == [0, 1, 2]


@pytest.mark.parametrize("bad", [(0, "round_robin"), (2, "random")])
def test_router_rejects_bad_arguments(bad):
    with pytest.raises(ValueError):
        ReplicaRouter(*bad)


def stats(dp_rank: int, **values) -> SchedulerStats:
    base = dict(request_id="q", num_running_reqs=0, num_queue_reqs=0, num_used_tokens=0, token_usage=0.0,
                gen_throughput=0.0, cache_hit_rate=0.0, max_total_num_tokens=100, kv_available=100,
                kv_evictable=0, req_slots_free=8, req_slots_total=8, num_sessions=0, forward_ct=0,
                num_received_reqs=0, dp_rank=dp_rank)
    base.update(values)
    return SchedulerStats(**base)


def test_stats_are_summed_and_keep_the_replicas():
    parts = [stats(1, num_running_reqs=3, num_used_tokens=60, kv_available=40, cache_hit_rate=0.5,
                   num_received_reqs=7),
             stats(0, num_queue_reqs=2, num_used_tokens=20, kv_available=80, num_received_reqs=5)]
    total = combine_stats(parts)
    assert (total.num_running_reqs, total.num_queue_reqs, total.num_received_reqs) == (3, 2, 12)
    assert total.max_total_num_tokens == 200 and total.kv_available == 120
    assert total.token_usage == pytest.approx(80 / 200)
    assert total.cache_hit_rate == pytest.approx(0.25)
    assert total.dp_rank is None and [r.dp_rank for r in total.replicas] == [0, 1]


class FakeSocket:
    def __init__(self):
        self.sent = []

    def send_pyobj(self, obj):
        self.sent.append(obj)


def make_controller(n: int, method: str = "round_robin"):
    tokenizer, replicas = FakeSocket(), [FakeSocket() for _ in range(n)]
    controller = DataParallelController(ReplicaRouter(n, method), None, None, tokenizer, replicas)
    return controller, tokenizer, replicas


def test_controller_merges_broadcast_replies_and_passes_single_ones():
    controller, tokenizer, replicas = make_controller(2)
    controller.dispatch(FlushCacheReq("f1"))
    assert [len(r.sent) for r in replicas] == [1, 1]
    controller.on_replica_message(FlushCacheReqOutput("f1", True))
    assert tokenizer.sent == []  # waits for the second replica
    failed = FlushCacheReqOutput("f1", False, "Cache not flushed: busy")
    controller.on_replica_message(failed)
    assert tokenizer.sent == [failed]

    controller.dispatch(OpenSessionReq("s", request_id="o1"))
    assert len(replicas[0].sent) == 2 and len(replicas[1].sent) == 1
    reply = object()
    controller.on_replica_message(reply)  # no request_id it waits on: forwarded as is
    assert tokenizer.sent[-1] is reply


def test_controller_counts_finished_reports_without_forwarding_them():
    controller, tokenizer, _ = make_controller(2, "shortest_queue")
    for rid in ("a", "b", "c"):
        controller.dispatch(gen(rid))
    assert controller.router.loads == [2, 1]
    controller.on_replica_message(ReplicaFinished(0, ["a", "c"]))
    assert controller.router.loads == [0, 1] and tokenizer.sent == []


def test_replica_sink_reports_only_finished_requests():
    outputs, reports = [], []
    sink = reporting_finished(outputs.append, reports.append, dp_rank=1)

    def out(rid, finished):
        return ReqOutput(rid=rid, vid=0, output_ids=[1], finished_reason=FinishLength(1) if finished else None,
                         meta_info={})

    sink(BatchTokenOut([out("a", False)]))
    sink(BatchTokenOut([out("b", True), out("c", False), out("d", True)]))
    assert len(outputs) == 2
    assert reports == [ReplicaFinished(1, ["b", "d"])]


@pytest.mark.parametrize(
    "cores, num_procs, expected",
    [
        ([0, 1], 2, [[0], [1]]),
        ([0, 1], 1, [[0, 1]]),
        ([0, 1, 2, 3, 4], 2, [[0, 1, 2], [3, 4]]),
        ([4, 5, 6, 7], 4, [[4], [5], [6], [7]]),
        ([0, 1], 5, [[0], [1], [0], [1], [0]]),
    ],
)
def test_plan_cores(cores, num_procs, expected):
    plan = plan_cores(cores, num_procs)
    assert plan == expected
    if num_procs <= len(cores):  # every core used exactly once
        assert sorted(c for share in plan for c in share) == sorted(cores)


def test_process_slot_numbers_replicas_then_ranks():
    assert process_slot(ParallelSettings(dp_size=2), dp_rank=1) == (1, 2)
    assert process_slot(ParallelSettings(dp_size=2, tp_size=2), dp_rank=1, tp_rank=1) == (3, 4)
    assert process_slot(ParallelSettings(tp_size=4, dp_size=4, enable_dp_attention=True), 2, tp_rank=2) == (2, 4)
    assert process_slot(ParallelSettings(), dp_rank=None) == (0, 1)
    with pytest.raises(ValueError, match="does not exist"):
        process_slot(ParallelSettings(dp_size=2), dp_rank=2)


def test_pin_scheduler_process_in_a_child():
    """The real call, in a child process so the test runner's affinity is left alone."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        # Off first: the pool's one worker keeps the affinity the second call gives it.
        off = pool.apply(_pin_and_report, (ParallelSettings(dp_size=2, cpu_affinity=False), 1))
        pinned, affinity, threads = pool.apply(_pin_and_report, (ParallelSettings(dp_size=2), 1))
    cores = sorted(os.sched_getaffinity(0))
    assert pinned == plan_cores(cores, 2)[1] == affinity
    assert threads == len(pinned)
    assert off[0] is None and off[1] == cores


def _pin_and_report(parallel, dp_rank):
    import torch

    from framework.server.placement import pin_scheduler_process

    pinned = pin_scheduler_process(parallel, dp_rank)
    return pinned, sorted(os.sched_getaffinity(0)), torch.get_num_threads()


def test_engine_refuses_data_parallel_replicas():
    from framework.engine import Engine

    with pytest.raises(ValueError, match="batchyard serve"):
        Engine(parallel={"dp_size": 2})
