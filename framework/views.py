"""Read-only views the core hands to hooks (plugin contract v1).

A hook reads the scheduler and its batches through these; it never holds the mutable objects, so
every change to queues, pools and the cache is made by the core from what hooks return. Setting an
attribute on a view raises; its request collections are tuples and its numbers copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from framework.batch import ForwardMode, ScheduleBatch
    from framework.config import Settings
    from framework.request import Req, Stash
    from framework.scheduler import Scheduler


class ReadOnlyError(AttributeError):
    """A plugin tried to change the core's state through a view."""


class ReadOnlyView:
    """Base of the views: reads go through properties; setting or deleting an attribute raises."""

    __slots__ = ("_target",)

    def __init__(self, target: Any):
        object.__setattr__(self, "_target", target)

    def __setattr__(self, name: str, value: Any) -> None:
        raise ReadOnlyError(
            f"{type(self).__name__} is read-only: hooks return their decisions and the core applies them"
        )

    __delattr__ = __setattr__


@dataclass(frozen=True)
class PrefixMatch:
    """The longest cached prefix of a waiting request's next input."""

    #: Tokens of the prefix found in the cache.
    length: int
    #: The cache node where the prefix ends (radix cache: walk ``node.children``; read only).
    node: Any


class SchedulerView(ReadOnlyView):
    """What a hook may read of the scheduler."""

    __slots__ = ()

    @property
    def waiting_queue(self) -> tuple["Req", ...]:
        """The waiting requests, in queue order."""
        return tuple(self._target.waiting_queue)

    @property
    def num_running(self) -> int:
        running = self._target.running_batch
        return running.batch_size() if running is not None else 0

    @property
    def max_running_requests(self) -> int:
        return self._target.max_running_requests

    @property
    def settings(self) -> "Settings":
        return self._target.settings

    @property
    def stash(self) -> "Stash":
        """Scheduler-wide plugin state (`framework.request.StashKey`); plugins may write it."""
        return self._target.stash

    @property
    def tp_rank(self) -> int:
        return self._target.tp_rank

    @property
    def new_token_ratio(self) -> float:
        return self._target.new_token_ratio.value

    @property
    def retract_decode_steps(self) -> int:
        return self._target.retract_decode_steps

    @property
    def num_free_kv_tokens(self) -> int:
        """KV slots free now or held only by the cache (evictable)."""
        sched = self._target
        return sched.token_to_kv_pool.available_size() + sched.tree_cache.evictable_size()

    @property
    def max_total_num_tokens(self) -> int:
        return self._target.max_total_num_tokens

    @property
    def vocab_size(self) -> int:
        return self._target.worker.vocab_size

    @property
    def num_retractions(self) -> int:
        return self._target.num_retractions

    @property
    def cache_shares_prefixes(self) -> bool:
        """False for a cache that shares nothing between requests (the chunk cache)."""
        return not self._target.tree_cache.disable

    @property
    def cache_name(self) -> str:
        return type(self._target.tree_cache).__name__

    @property
    def cache_root(self) -> Any:
        """The radix cache's root node, for policies that walk the tree (read only)."""
        return self._target.tree_cache.root_node

    def live_requests(self) -> tuple[tuple["Req", ...], tuple["Req", ...]]:
        """(waiting, running) requests: waiting counts the grammar queue and a request being
        chunked; running, the unfinished requests of the batches in flight."""
        waiting, running = self._target.live_requests()
        return tuple(waiting), tuple(running)

    def match_prefix(self, req: "Req") -> PrefixMatch:
        """Match `req`'s next input against the cache. The request is not changed; the core
        reuses this match if the request is admitted this round."""
        return self._target.match_waiting_prefix(req)

    def idle_batch(self) -> "ScheduleBatch":
        """A fresh IDLE batch (no tokens), for `prepare_batch` wrappers (DP attention)."""
        return self._target.new_idle_batch()


class BatchView(ReadOnlyView):
    """What an observer or a retraction policy may read of a batch."""

    __slots__ = ()

    @property
    def forward_mode(self) -> "ForwardMode":
        return self._target.forward_mode

    @property
    def reqs(self) -> tuple["Req", ...]:
        return tuple(self._target.reqs)

    @property
    def decoding_reqs(self) -> tuple["Req", ...] | None:
        reqs = self._target.decoding_reqs
        return None if reqs is None else tuple(reqs)

    @property
    def seq_lens(self) -> list[int]:
        return self._target.seq_lens.tolist()

    @property
    def extend_lens(self) -> list[int]:
        return list(self._target.extend_lens or ())

    @property
    def extend_num_tokens(self) -> int:
        return self._target.extend_num_tokens

    @property
    def global_num_tokens(self) -> list[int] | None:
        counts = self._target.global_num_tokens
        return None if counts is None else list(counts)

    @property
    def return_logprob(self) -> bool:
        return self._target.return_logprob

    @property
    def is_embedding(self) -> bool:
        return self._target.is_embedding

    @property
    def stash(self) -> "Stash":
        """Per-batch plugin state; plugins may write it."""
        return self._target.stash

    def batch_size(self) -> int:
        return self._target.batch_size()


__all__ = ["BatchView", "PrefixMatch", "ReadOnlyError", "ReadOnlyView", "SchedulerView"]
