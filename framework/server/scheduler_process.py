"""The scheduler process: the same `Scheduler` as the offline engine, fed from a ZMQ socket.

The loop blocks on its PULL socket whenever the scheduler has nothing to do, and drains it without
blocking otherwise. It never busy-polls: a spinning process steals a core from the forward pass,
which on a two-thread CPU forward costs a 3-4x slowdown.

With tensor parallelism there is one such process per rank (reference A4): rank 0 alone reads the
tokenizer's socket and broadcasts what it read, so every rank runs the same scheduling decisions;
only rank 0 sends outputs. With DP attention every rank reads its own socket (each is one replica
behind the data-parallel controller) and sends its own outputs, and the ranks step together (see
`dp_attention_event_loop`).
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from typing import Any, Callable

import zmq

from framework.config import Settings, SettingsError
from framework.distributed import ParallelContext, init_parallel
from framework.messages import SchedulerFailed, SchedulerReady
from framework.model.loader import ModelFolderError
from framework.server.dp_controller import reporting_finished
from framework.server.ipc import (
    IpcNames, freeze_startup_objects, make_socket, recv_waiting, setup_child_process,
)
from framework.server.placement import pin_scheduler_process

logger = logging.getLogger(__name__)

# While idle the loop wakes this often to run one idle iteration (leak check, ratio reset).
IDLE_POLL_MS = 2000


# DP attention, all ranks idle: how long each waits for a request before the ranks check in again.
DP_IDLE_POLL_MS = 50


def run_scheduler_process(
    settings: Settings, ipc: IpcNames, ready_writer: Any, dp_rank: int | None = None, tp_rank: int = 0,
    dist_init_addr: str | None = None,
) -> None:
    """Entry point of the spawned scheduler process of one rank (reference A7).

    `dp_rank` is given for a replica (or a DP-attention rank) behind the data-parallel controller:
    `ipc.tokenizer` is then the controller, which also gets the replica's `ReplicaFinished`
    reports. Without it, the `DP_RANK` environment variable names the replica this scheduler is
    (an outside router started it); it picks the process's core share and names the replica in
    logs and stats. `tp_rank` is the process's rank in its tensor-parallel group, which meets at
    `dist_init_addr` (host:port)."""
    behind_controller = dp_rank is not None
    dp_rank = dp_rank_from_env() if dp_rank is None else dp_rank
    setup_child_process(scheduler_log_name(dp_rank, tp_rank, settings.parallel.tp_size), settings.server.log_level)
    from framework.scheduler import Scheduler

    dp_attention = settings.parallel.enable_dp_attention
    context = zmq.Context()
    recv_from_tokenizer = None
    output_sink = reply_sink = None
    try:
        pin_scheduler_process(settings.parallel, dp_rank, tp_rank)  # before the model loads, so its threads fit
        par = init_parallel(settings, tp_rank, dist_init_addr or "")
        if tp_rank == 0 or dp_attention:
            recv_from_tokenizer = make_socket(context, zmq.PULL, ipc.scheduler)
            output_sink = make_socket(context, zmq.PUSH, ipc.detokenizer).send_pyobj
            reply_sink = make_socket(context, zmq.PUSH, ipc.tokenizer).send_pyobj
            if behind_controller:
                output_sink = reporting_finished(output_sink, reply_sink, dp_rank)
        scheduler = Scheduler(
            settings, output_sink=output_sink, tp_rank=tp_rank, reply_sink=reply_sink, dp_rank=dp_rank
        )
        if dp_attention and "dp-attention" not in scheduler.plugins.active:
            raise ValueError("parallel.enable_dp_attention needs the dp-attention plugin (it is disabled)")
    except Exception as exc:
        if isinstance(exc, (SettingsError, ModelFolderError)):  # the operator's to fix, said in full: no traceback
            logger.error("Scheduler start-up failed: %s", exc)
        else:
            logger.exception("Scheduler start-up failed")
        ready_writer.send(SchedulerFailed(f"{type(exc).__name__}: {exc}"))
        sys.exit(1)
    ready_writer.send(
        SchedulerReady(
            max_total_num_tokens=scheduler.max_total_num_tokens,
            max_req_input_len=scheduler.max_req_input_len,
            context_len=scheduler.worker.context_len,
            vocab_size=scheduler.worker.vocab_size,
            pid=os.getpid(),
            hidden_size=scheduler.worker.hidden_size,
            is_generation=scheduler.is_generation,
        )
    )
    ready_writer.close()
    logger.info("%d start-up objects frozen out of the garbage collector's walks", freeze_startup_objects())
    timeout = settings.scheduler.watchdog_timeout
    Watchdog(scheduler, timeout, on_timeout=lambda stalled: _exit_on_watchdog(stalled, timeout)).start()
    try:
        if par.tp_size == 1:
            event_loop(scheduler, recv_from_tokenizer)
        elif dp_attention:
            dp_attention_event_loop(scheduler, recv_from_tokenizer, par)
        else:
            tp_event_loop(scheduler, recv_from_tokenizer, par)
    except Exception:
        # Reference Q3: any scheduler error takes the server down; the main process notices the
        # exit and stops serving. A rank whose peer died lands here too (its collective fails).
        logger.exception("Scheduler hit an exception; the server stops")
        sys.exit(1)


def scheduler_log_name(dp_rank: int | None, tp_rank: int, tp_size: int) -> str:
    """How the process names itself in logs: "scheduler", "scheduler DP1", "scheduler TP1", ..."""
    name = "scheduler" if dp_rank is None else f"scheduler DP{dp_rank}"
    return name if tp_size == 1 else f"{name} TP{tp_rank}"


def dp_rank_from_env() -> int | None:
    """The replica named by `DP_RANK` (reference 4.6: read only when set), or None."""
    value = os.environ.get("DP_RANK")
    if value is None:
        return None
    try:
        rank = int(value)
    except ValueError:
        raise ValueError(f"DP_RANK must be an integer, got {value!r}") from None
    if rank < 0:
        raise ValueError(f"DP_RANK must be >= 0, got {rank}")
    return rank


def event_loop(scheduler, sock: zmq.Socket) -> None:
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while True:
        if scheduler.has_work() or poller.poll(IDLE_POLL_MS):
            _drain(scheduler, sock)
        scheduler.run_once()


def tp_event_loop(scheduler, sock: zmq.Socket | None, par: ParallelContext) -> None:
    """Rank 0 reads (blocking while idle, as `event_loop`); every rank gets the same messages.

    The other ranks wait in the broadcast, so every rank runs `run_once` the same number of times
    on the same input: their batches, and so their collectives, match (reference A4).
    """
    poller = zmq.Poller()
    if sock is not None:
        poller.register(sock, zmq.POLLIN)
    while True:
        received = []
        if sock is not None and (scheduler.has_work() or poller.poll(IDLE_POLL_MS)):
            received = recv_waiting(sock)
        for msg in par.broadcast_pyobj(received):
            scheduler.send(msg)
        scheduler.run_once()


def dp_attention_event_loop(scheduler, sock: zmq.Socket, par: ParallelContext) -> None:
    """Each rank reads its own socket; all ranks call `run_once` in step (reference L2).

    `run_once` is collective (the dp-attention plugin all-gathers token counts in prepare_batch),
    so a rank may wait only when every rank is idle: the ranks first agree whether any has work.
    """
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    while True:
        _drain(scheduler, sock)
        if not par.any_true(scheduler.has_work()) and poller.poll(DP_IDLE_POLL_MS):
            _drain(scheduler, sock)
        scheduler.run_once()


def _drain(scheduler, sock: zmq.Socket) -> None:
    for msg in recv_waiting(sock):
        scheduler.send(msg)


class Watchdog(threading.Thread):
    """Calls `on_timeout` when one forward pass runs longer than `timeout` seconds (reference Q2).

    It checks every timeout/2: a batch is running (`cur_batch` set) and `forward_ct` has not moved
    since the last change it saw more than `timeout` ago. An idle scheduler never trips it.
    """

    def __init__(self, scheduler, timeout: float, on_timeout: Callable[[float], None]):
        super().__init__(name="watchdog", daemon=True)
        self.scheduler = scheduler
        self.timeout = timeout
        self.on_timeout = on_timeout

    def run(self) -> None:
        last_ct = self.scheduler.forward_ct
        last_change = time.monotonic()
        while True:
            time.sleep(self.timeout / 2)
            now = time.monotonic()
            ct = self.scheduler.forward_ct
            if self.scheduler.cur_batch is None or ct != last_ct:
                last_ct, last_change = ct, now
                continue
            if now - last_change > self.timeout:
                self.on_timeout(now - last_change)
                return


def _exit_on_watchdog(stalled_s: float, timeout: float) -> None:
    logger.error(
        "Watchdog: one forward pass has run for %.3g s, over scheduler.watchdog_timeout (%g s); "
        "the scheduler exits so the server does not hang. Stacks follow.", stalled_s, timeout,
    )
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    # os._exit: the stuck forward pass holds the main thread, so a normal exit would wait on it.
    os._exit(3)
