"""The scheduler process: the same `Scheduler` as the offline engine, fed from a ZMQ socket.

The loop blocks on its PULL socket whenever the scheduler has nothing to do, and drains it without
blocking otherwise. It never busy-polls: a spinning process steals a core from the forward pass,
which on a two-thread CPU forward costs a 3-4x slowdown.
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

from framework.config import Settings
from framework.messages import SchedulerFailed, SchedulerReady
from framework.server.dp_controller import reporting_finished
from framework.server.ipc import IpcNames, make_socket, recv_waiting, setup_child_process
from framework.server.placement import pin_scheduler_process

logger = logging.getLogger(__name__)

# While idle the loop wakes this often to run one idle iteration (leak check, ratio reset).
IDLE_POLL_MS = 2000


def run_scheduler_process(settings: Settings, ipc: IpcNames, ready_writer: Any, dp_rank: int | None = None) -> None:
    """Entry point of the spawned scheduler process (reference A7).

    `dp_rank` is given for a replica behind the data-parallel controller: `ipc.tokenizer` is then
    the controller, which also gets the replica's `ReplicaFinished` reports. Without it, the
    `DP_RANK` environment variable names the replica this scheduler is (an outside router started
    it); it picks the process's core share and names the replica in logs and stats."""
    behind_controller = dp_rank is not None
    dp_rank = dp_rank_from_env() if dp_rank is None else dp_rank
    setup_child_process("scheduler" if dp_rank is None else f"scheduler DP{dp_rank}", settings.server.log_level)
    from framework.scheduler import Scheduler

    context = zmq.Context()
    recv_from_tokenizer = make_socket(context, zmq.PULL, ipc.scheduler)
    send_to_detokenizer = make_socket(context, zmq.PUSH, ipc.detokenizer)
    send_to_tokenizer = make_socket(context, zmq.PUSH, ipc.tokenizer)
    output_sink = send_to_detokenizer.send_pyobj
    if behind_controller:
        output_sink = reporting_finished(output_sink, send_to_tokenizer.send_pyobj, dp_rank)
    try:
        pin_scheduler_process(settings.parallel, dp_rank)  # before the model loads, so its threads fit
        scheduler = Scheduler(
            settings, output_sink=output_sink, reply_sink=send_to_tokenizer.send_pyobj, dp_rank=dp_rank
        )
    except Exception as exc:
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
    timeout = settings.scheduler.watchdog_timeout
    Watchdog(scheduler, timeout, on_timeout=lambda stalled: _exit_on_watchdog(stalled, timeout)).start()
    try:
        event_loop(scheduler, recv_from_tokenizer)
    except Exception:
        # Reference Q3: any scheduler error takes the server down; the main process notices the
        # exit and stops serving.
        logger.exception("Scheduler hit an exception; the server stops")
        sys.exit(1)


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
