"""The data-parallel controller (reference A5): one process between the TokenizerManager and the
replicas, which routes every message to the input socket(s) it belongs to.

    TokenizerManager --PUSH--> controller --PUSH--> replica 0 .. N-1 input sockets
    replicas' control replies and ReplicaFinished --PUSH--> controller --PUSH--> TokenizerManager
    replicas' outputs --PUSH--> the one detokenizer (not through the controller)

A "replica" is anything with an input socket: a whole scheduler (or a TP group's rank 0) for
data-parallel replicas, or one attention rank with DP attention. `ReplicaRouter` decides where each
message goes (a pure object, unit-tested on its own); `ReplyCollector` merges the replies of the
messages sent to every replica; `DataParallelController` moves the bytes.

Routing, by message:
  * generate: a session's requests go to the replica holding the session; others to the replica
    `parallel.load_balance_method` picks (round_robin, or shortest_queue: the fewest unfinished
    requests, which the reference declares but does not implement);
  * abort: to the replica holding the request (nowhere once it has finished);
  * open_session: to the picked replica, where the session then stays; close_session: there;
  * everything else (flush_cache, get_stats, ...): to all; their replies are merged into one.

A replica's load is the number of requests sent to it that it has not yet reported finished
(`ReplicaFinished`, sent by the replica whenever an output carries a finish reason): its running
and waiting requests plus those still in transit, so a burst is spread before any report arrives.
"""

from __future__ import annotations

import logging
from dataclasses import fields
from typing import Any, Callable, Literal

import zmq

from framework.clients import merge_clients
from framework.config import Settings
from framework.messages import (
    AbortReq,
    BatchTokenOut,
    CloseSessionReq,
    GenerateReqInput,
    OpenSessionReq,
    ReplicaFinished,
    SchedulerStats,
)
from framework.server.ipc import IpcNames, make_socket, recv_waiting, setup_child_process

logger = logging.getLogger(__name__)

POLL_MS = 1000


class ReplicaRouter:
    """Where each message goes: a list of replica indices (see the module docstring)."""

    def __init__(self, num_replicas: int, method: Literal["round_robin", "shortest_queue"] = "round_robin"):
        if num_replicas < 1:
            raise ValueError("the router needs at least one replica")
        if method not in ("round_robin", "shortest_queue"):
            raise ValueError(f"unknown load_balance_method {method!r}")
        self.num_replicas = num_replicas
        self.method = method
        self.loads = [0] * num_replicas  # unfinished requests sent to each replica
        self.replica_of_rid: dict[str, int] = {}
        self.replica_of_session: dict[str, int] = {}
        self._next = 0

    def route(self, msg: Any) -> list[int]:
        if isinstance(msg, GenerateReqInput):
            replica = self.replica_of_session.get(msg.session_id) if msg.session_id is not None else None
            if replica is None:
                replica = self.pick()
            self.replica_of_rid[msg.rid] = replica
            self.loads[replica] += 1
            return [replica]
        if isinstance(msg, AbortReq):
            replica = self.replica_of_rid.get(msg.rid)
            return [] if replica is None else [replica]
        if isinstance(msg, OpenSessionReq):
            # An id already open stays where it is (that replica answers that it exists).
            replica = self.replica_of_session.setdefault(msg.session_id, self.pick())
            return [replica]
        if isinstance(msg, CloseSessionReq):
            # An unknown id still gets its "does not exist" answer, from replica 0.
            return [self.replica_of_session.pop(msg.session_id, 0)]
        return list(range(self.num_replicas))

    def pick(self) -> int:
        """The next replica for new work: in turn, or the least loaded (ties in turn)."""
        n = self.num_replicas
        if self.method == "round_robin":
            replica = self._next
        else:
            replica = min(range(n), key=lambda i: (self.loads[i], (i - self._next) % n))
        self._next = (replica + 1) % n
        return replica

    def finished(self, report: ReplicaFinished) -> None:
        for rid in report.rids:
            if self.replica_of_rid.get(rid) == report.dp_rank:
                del self.replica_of_rid[rid]
                self.loads[report.dp_rank] -= 1


def combine_stats(replies: list[SchedulerStats]) -> SchedulerStats:
    """One SchedulerStats for all replicas: counts summed, ratios recomputed, the parts kept."""
    summed = {
        f.name: sum(getattr(r, f.name) for r in replies)
        for f in fields(SchedulerStats) if f.name not in ("request_id", "dp_rank", "replicas", "clients")
    }
    # Bounded again where it is shown (the TokenizerManager), which knows the label limit.
    summed["clients"] = merge_clients(r.clients for r in replies)
    summed["token_usage"] = summed["num_used_tokens"] / max(summed["max_total_num_tokens"], 1)
    summed["cache_hit_rate"] = sum(r.cache_hit_rate for r in replies) / len(replies)
    ordered = sorted(replies, key=lambda r: -1 if r.dp_rank is None else r.dp_rank)
    return SchedulerStats(request_id=replies[0].request_id, replicas=ordered, **summed)


def combine_replies(replies: list[Any]) -> Any:
    """The one reply the TokenizerManager gets for a message sent to every replica: merged stats;
    else the first failure (a `success` field that is False); else the first reply."""
    if isinstance(replies[0], SchedulerStats):
        return combine_stats(replies)
    failed = [r for r in replies if getattr(r, "success", True) is False]
    return failed[0] if failed else replies[0]


class ReplyCollector:
    """Holds the replies to a message sent to several replicas until all have answered."""

    def __init__(self):
        self._waiting: dict[str, tuple[int, list[Any]]] = {}

    def expect(self, request_id: str, count: int) -> None:
        self._waiting[request_id] = (count, [])

    def add(self, reply: Any) -> Any | None:
        """The reply to forward now, or None while more are due. Replies nobody collects (a
        single replica's answer) pass straight through."""
        request_id = getattr(reply, "request_id", None)
        if request_id not in self._waiting:
            return reply
        count, replies = self._waiting[request_id]
        replies.append(reply)
        if len(replies) < count:
            return None
        del self._waiting[request_id]
        return combine_replies(replies)


class DataParallelController:
    """The controller's loop: requests in from the tokenizer side, replies and reports from the
    replicas, each moved as the router and the collector say."""

    def __init__(self, router: ReplicaRouter, recv_requests: zmq.Socket, recv_replies: zmq.Socket,
                 send_to_tokenizer: zmq.Socket, send_to_replicas: list[zmq.Socket]):
        if len(send_to_replicas) != router.num_replicas:
            raise ValueError("one input socket per replica is needed")
        self.router = router
        self.collector = ReplyCollector()
        self.recv_requests = recv_requests
        self.recv_replies = recv_replies
        self.send_to_tokenizer = send_to_tokenizer
        self.send_to_replicas = send_to_replicas

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.recv_requests, zmq.POLLIN)
        poller.register(self.recv_replies, zmq.POLLIN)
        while True:
            for sock, _ in poller.poll(POLL_MS):
                handle = self.dispatch if sock is self.recv_requests else self.on_replica_message
                for msg in recv_waiting(sock):
                    handle(msg)

    def dispatch(self, msg: Any) -> None:
        replicas = self.router.route(msg)
        request_id = getattr(msg, "request_id", None)
        if len(replicas) > 1 and request_id is not None:
            self.collector.expect(request_id, len(replicas))
        for replica in replicas:
            self.send_to_replicas[replica].send_pyobj(msg)
        logger.debug("%s -> replicas %s; loads %s", type(msg).__name__, replicas, self.router.loads)

    def on_replica_message(self, msg: Any) -> None:
        if isinstance(msg, ReplicaFinished):
            self.router.finished(msg)
            return
        reply = self.collector.add(msg)
        if reply is not None:
            self.send_to_tokenizer.send_pyobj(reply)


def reporting_finished(output_sink: Callable[[BatchTokenOut], None], report: Callable[[Any], None],
                       dp_rank: int) -> Callable[[BatchTokenOut], None]:
    """A replica's output sink that also tells the controller which requests finished."""

    def sink(out: BatchTokenOut) -> None:
        output_sink(out)
        rids = [o.rid for o in out.outputs if o.finished_reason is not None]
        if rids:
            report(ReplicaFinished(dp_rank, rids))

    return sink


def run_dp_controller_process(settings: Settings, ipc: IpcNames, replica_inputs: list[str]) -> None:
    """Entry point of the spawned controller: `ipc.scheduler` in, one PUSH per replica input out."""
    setup_child_process("dp_controller", settings.server.log_level)
    context = zmq.Context()
    controller = DataParallelController(
        ReplicaRouter(len(replica_inputs), settings.parallel.load_balance_method),
        recv_requests=make_socket(context, zmq.PULL, ipc.scheduler),
        recv_replies=make_socket(context, zmq.PULL, ipc.controller),
        send_to_tokenizer=make_socket(context, zmq.PUSH, ipc.tokenizer),
        send_to_replicas=[make_socket(context, zmq.PUSH, endpoint) for endpoint in replica_inputs],
    )
    logger.info("Data-parallel controller: %d replicas, %s", len(replica_inputs),
                settings.parallel.load_balance_method)
    controller.run()
