"""The prefix-cache contract that cache plugins implement (reference sections N, O).

A prefix cache maps token-id prefixes to KV slot indices so that requests can share KV. The
scheduler talks to it only through these methods.

Locking rule: a request holds exactly one lock on the path to its `last_node` from admission
(`PrefillAdder.add_one_req`) until `cache_finished_req`, a retraction, or the re-lock done by
`cache_unfinished_req`. A locked node is never evicted. `inc_lock_ref` / `dec_lock_ref` return the
change of `evictable_size()` they caused (<= 0 and >= 0 respectively), which the admission budget uses.

Which methods mutate:
- `match_prefix` may split a node and touches access times, but never frees or allocates KV.
- `insert`, `cache_finished_req`, `cache_unfinished_req`, `evict`, `reset` change what is cached
  and may free KV slots through the token pool.
- `evictable_size`, `protected_size`, `total_size` are pure queries.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from framework.memory import ReqToTokenPool, TokenToKVPool
    from framework.request import Req


class BasePrefixCache(abc.ABC):
    """Base class of every prefix cache plugin."""

    #: True when the cache never shares prefixes between requests (LPM/DFS fall back to FCFS).
    disable: bool = False

    def __init__(self, req_to_token_pool: "ReqToTokenPool", token_to_kv_pool: "TokenToKVPool"):
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool

    @abc.abstractmethod
    def reset(self) -> None:
        """Drop everything cached (the caller clears the pools)."""

    @abc.abstractmethod
    def match_prefix(self, rid: str, key: list[int]) -> tuple[torch.Tensor, Any]:
        """Return (KV indices of the longest cached prefix of `key`, the node it ends at)."""

    @abc.abstractmethod
    def cache_finished_req(self, req: "Req", token_ids: list[int] | None = None) -> None:
        """A request finished: keep what is worth keeping, free the rest and its request slot,
        and release the request's lock."""

    @abc.abstractmethod
    def cache_unfinished_req(self, req: "Req", token_ids: list[int] | None = None) -> None:
        """A request's computed tokens (`req.fill_ids`) become cached while it keeps running; re-point
        `req.prefix_indices` / `req.last_node` at the cached copy and move its lock there."""

    @abc.abstractmethod
    def evict(self, num_tokens: int, evict_callback: Callable[[torch.Tensor], None]) -> None:
        """Free at least `num_tokens` unlocked cached tokens if possible, passing their KV
        indices to `evict_callback`."""

    @abc.abstractmethod
    def inc_lock_ref(self, node: Any) -> int:
        """Lock `node` and its ancestors; return the change of evictable size (<= 0)."""

    @abc.abstractmethod
    def dec_lock_ref(self, node: Any) -> int:
        """Release a lock taken by `inc_lock_ref`; return the change of evictable size (>= 0)."""

    @abc.abstractmethod
    def evictable_size(self) -> int:
        """Tokens cached and not locked: they count as free KV for admission."""

    def protected_size(self) -> int:
        """Tokens cached and locked by running requests."""
        return 0

    def total_size(self) -> int:
        """All tokens held by the cache."""
        return self.evictable_size() + self.protected_size()

    def pretty_print(self) -> str:
        """A readable dump for OOM logs; never raises (the reference's chunk cache did, QUIRK 16)."""
        return f"{type(self).__name__}(evictable={self.evictable_size()}, protected={self.protected_size()})"

    def retract_req(self, req: "Req", kv_len: int) -> None:
        """Give back what a retracted request holds: the KV it computed beyond its cached prefix
        (its first `kv_len` positions are written), its request slot and its lock (reference I2).
        Caches whose prefix is private to the request (chunk) override this to free everything."""
        start = 0 if self.disable else len(req.prefix_indices)
        self.token_to_kv_pool.free(self.req_to_token_pool.req_to_token[req.req_pool_idx, start:kv_len])
        self.free_req_slot(req)
        if not self.disable:
            self.dec_lock_ref(req.last_node)

    def free_req_slot(self, req: "Req") -> None:
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
