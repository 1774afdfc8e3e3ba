"""Detokenizer: cumulative token ids in, cumulative text out (reference T2).

Decoding is incremental: per request a `DecodeStatus` remembers the text committed so far and two
offsets into the output ids. Each step decodes only the ids from `surr_offset` on and takes the
part past the surrounding text, so the work per step stays small. Text ending in U+FFFD (an
incomplete UTF-8 sequence split across tokens) is never committed; the printable part before it
is shown instead, so a stream never carries a broken character that a later token would fix.
Finished requests get their stop string or stop token trimmed unless `no_stop_trim`.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import zmq

from framework.messages import BatchStrOut, BatchTokenOut, ReqOutput, StrOutput
from framework.request import FinishMatchedStr, FinishMatchedToken
from framework.server.ipc import IpcNames, freeze_startup_objects, make_socket, setup_child_process

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"
# Statuses kept at most; the oldest is dropped first (a request that never finished, e.g. one
# whose finish message was lost with a dead scheduler).
MAX_TRACKED_REQS = 1 << 15


@dataclass
class DecodeStatus:
    vid: int
    decoded_text: str = ""
    surr_offset: int = 0
    read_offset: int = 0
    # The text the last output showed: a stream's cumulative text never gets shorter.
    shown_text: str = ""


def is_cjk(ch: str) -> bool:
    cp = ord(ch)
    return (
        0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
        or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F
    )


def find_printable_text(text: str) -> str:
    """The part of not-yet-committed text that is safe to show (the reference's rule).

    A whole line, or up to a CJK character (they are words), or up to the last space otherwise,
    so a word split across tokens is not shown half-formed. Never includes a trailing U+FFFD.
    """
    if text.endswith(REPLACEMENT_CHAR):
        text = text.rstrip(REPLACEMENT_CHAR)
        return text if text and (text.endswith("\n") or is_cjk(text[-1])) else text[: text.rfind(" ") + 1]
    if text.endswith("\n") or (text and is_cjk(text[-1])):
        return text
    return text[: text.rfind(" ") + 1]


class IncrementalDetokenizer:
    """Per-request decode state over one tokenizer; `step` turns a ReqOutput into a StrOutput."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.statuses: OrderedDict[str, DecodeStatus] = OrderedDict()

    def _decode(self, ids: list[int], out: ReqOutput) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=out.skip_special_tokens,
            spaces_between_special_tokens=out.spaces_between_special_tokens,
        )

    def step(self, out: ReqOutput) -> StrOutput:
        if out.embedding is not None:  # an embedding request: nothing to decode
            return StrOutput(rid=out.rid, text="", output_ids=[], finished_reason=out.finished_reason,
                             meta_info=out.meta_info, embedding=out.embedding)
        status = self.statuses.get(out.rid)
        if status is None or status.vid != out.vid:
            status = DecodeStatus(vid=out.vid)
            self.statuses[out.rid] = status
            if len(self.statuses) > MAX_TRACKED_REQS:
                self.statuses.popitem(last=False)
        ids = out.output_ids
        finished = out.finished_reason is not None
        if finished and not out.no_stop_trim and isinstance(out.finished_reason, FinishMatchedToken):
            ids = ids[:-1]
        surr_text = self._decode(ids[status.surr_offset : status.read_offset], out)
        read_text = self._decode(ids[status.surr_offset :], out)
        new_text = read_text[len(surr_text) :]

        if finished:
            text = status.decoded_text + new_text
            if not out.no_stop_trim and isinstance(out.finished_reason, FinishMatchedStr):
                pos = text.find(out.finished_reason.matched)
                if pos != -1:
                    text = text[:pos]
            self.statuses.pop(out.rid, None)
        elif new_text and not new_text.endswith(REPLACEMENT_CHAR):
            status.decoded_text += new_text
            status.surr_offset = status.read_offset
            status.read_offset = len(ids)
            text = status.decoded_text
        else:
            text = status.decoded_text + find_printable_text(new_text)
            # Several tokens per output (stream_interval > 1) can turn a printable end ("\n", a CJK
            # character) into a word cut back to its last space; what was shown before stays final.
            if len(text) < len(status.shown_text) and (status.decoded_text + new_text).startswith(status.shown_text):
                text = status.shown_text
        if not finished:
            status.shown_text = text
        return StrOutput(
            rid=out.rid, text=text, output_ids=list(out.output_ids),
            finished_reason=out.finished_reason, meta_info=out.meta_info,
        )

    def process(self, batch: BatchTokenOut) -> BatchStrOut:
        return BatchStrOut([self.step(out) for out in batch.outputs])


def run_detokenizer_process(tokenizer_folder: str, ipc: IpcNames, log_level: str) -> None:
    """Entry point of the spawned detokenizer process: a blocking receive loop."""
    setup_child_process("detokenizer", log_level)
    from framework.model.loader import load_tokenizer

    context = zmq.Context()
    recv_from_scheduler = make_socket(context, zmq.PULL, ipc.detokenizer)
    send_to_tokenizer = make_socket(context, zmq.PUSH, ipc.tokenizer)
    detok = IncrementalDetokenizer(load_tokenizer(tokenizer_folder))
    freeze_startup_objects()
    logger.info("Detokenizer ready")
    while True:
        msg = recv_from_scheduler.recv_pyobj()
        if isinstance(msg, BatchTokenOut):
            send_to_tokenizer.send_pyobj(detok.process(msg))
        else:
            logger.error("detokenizer received an unknown message: %r", type(msg).__name__)
