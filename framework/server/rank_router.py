"""A minimal request router for DP attention: the tokenizer's socket to the ranks' sockets.

It stands in for the data-parallel controller (reference A5, which DP attention uses with
dp_size = tp_size): generate requests go round robin, a session's requests always to the same rank
(its history lives there), and every other message (abort, flush, sessions, stats) to all ranks.
The tokenizer takes the first reply to a control request and ignores the later ones.
"""

from __future__ import annotations

import itertools
import zlib

import zmq

from framework.messages import GenerateReqInput
from framework.server.ipc import IpcNames, make_socket, setup_child_process


def run_rank_router(ipc: IpcNames, num_ranks: int, log_level: str) -> None:
    setup_child_process("router", log_level)
    context = zmq.Context()
    recv_from_tokenizer = make_socket(context, zmq.PULL, ipc.scheduler)
    ranks = [make_socket(context, zmq.PUSH, ipc.scheduler_of_rank(r)) for r in range(num_ranks)]
    next_rank = itertools.cycle(range(num_ranks))
    while True:
        msg = recv_from_tokenizer.recv_pyobj()
        if not isinstance(msg, GenerateReqInput):
            for sock in ranks:
                sock.send_pyobj(msg)
        elif msg.session_id is not None:
            ranks[zlib.crc32(msg.session_id.encode()) % num_ranks].send_pyobj(msg)
        else:
            ranks[next(next_rank)].send_pyobj(msg)
