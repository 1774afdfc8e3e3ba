"""Sessions: continual prompting over a conversation's KV (reference section M, 0.3.6.post1).

A session is an ordered history of requests. A request that names ``session_id`` and
``session_rid`` continues from that earlier request: its input is the earlier request's full token
history (``origin_input_ids + output_ids``) followed by the new input ids. The earlier request's KV
is in the radix cache, so the continuation gets a prefix hit; no KV is pinned by the session itself.

Semantics follow the reference:
  * continuing from a rid drops the history after it (branching);
  * a request without ``session_rid`` starts a fresh history;
  * the capacity (``capacity_of_str_len``) is stored, not enforced; sessions never expire;
  * closing a session does not abort its in-flight requests.
Deviations: an unknown rid leaves the history as it was (the reference pops it empty first), and
so does a request refused for any other reason (too long, an unknown adapter): the history is cut
only when a request is admitted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from framework.request import Req


class SessionError(ValueError):
    """The request cannot continue this session; the message says why."""


@dataclass
class Session:
    session_id: str
    capacity_of_str_len: int = 0
    reqs: list[Req] = field(default_factory=list)

    def _position(self, session_rid: str) -> int:
        for i in range(len(self.reqs) - 1, -1, -1):
            if self.reqs[i].rid == session_rid:
                return i
        raise SessionError(
            f"Invalid request: requested session rid {session_rid} does not exist in the session history"
        )

    def history_for(self, session_rid: str | None) -> list[int]:
        """Token ids to put before a new request's input. The history itself is cut after the rid
        only when the request is admitted (`append`): a refused request leaves it as it was."""
        if session_rid is None:
            return []
        last = self.reqs[self._position(session_rid)]
        max_new = last.sampling_params.max_new_tokens
        # A finished request never holds more than max_new_tokens outputs; the slice is the
        # reference's guard for one still running.
        outputs = last.output_ids if max_new is None else last.output_ids[:max_new]
        return list(last.origin_input_ids) + list(outputs)

    def append(self, session_rid: str | None, req: Req) -> None:
        """An admitted request: the history after its rid is dropped (all of it without a rid:
        a fresh history), then the request is appended."""
        if session_rid is None:
            self.reqs = []
        else:  # (history_for found the rid for this same request)
            del self.reqs[self._position(session_rid) + 1 :]
        self.reqs.append(req)


class SessionController:
    """All open sessions of one scheduler; paired verbs `open`/`close`."""

    def __init__(self):
        self.sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self.sessions)

    def open(self, session_id: str, capacity_of_str_len: int = 0) -> bool:
        """False if the id is taken (the existing session is kept)."""
        if session_id in self.sessions:
            return False
        self.sessions[session_id] = Session(session_id, capacity_of_str_len)
        return True

    def close(self, session_id: str) -> bool:
        """False if there is no such session."""
        return self.sessions.pop(session_id, None) is not None

    def input_ids_for(self, session_id: str, session_rid: str | None, input_ids: list[int]) -> list[int]:
        """The full input of a session request; raises SessionError for an unknown id or rid."""
        session = self.sessions.get(session_id)
        if session is None:
            raise SessionError(f"Invalid request: session id {session_id} does not exist")
        return session.history_for(session_rid) + list(input_ids)

    def record(self, session_id: str, session_rid: str | None, req: Req) -> None:
        """Append an admitted request to its session's history (it may be continued from),
        dropping the history after the rid it continues from."""
        session = self.sessions.get(session_id)
        if session is not None:
            session.append(session_rid, req)
