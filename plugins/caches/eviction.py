"""Eviction order of the radix cache: which unlocked leaf is freed first.

The radix cache (`plugins/caches/radix.py`) only ever evicts whole unlocked leaves. It puts them in a
min-heap keyed by `EvictionPolicy.priority(node)` and evicts the smallest key first; a parent that
becomes a leaf joins the heap with its own key. A policy is therefore a pure function of a node.

Node fields a policy may read (all kept up to date by the cache):

- `last_access_time`: a logical clock, strictly increasing per cache operation (larger = more recent).
- `hit_count`: how many `match_prefix` lookups reused this node.
- `priority`: the largest `priority` of the requests whose tokens were cached through this node
  (`getattr(req, "priority", 0)`); larger means more important to keep.

Bundled policies: `lru` (the reference's order, the default), `lfu` and `priority`.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plugins.caches.radix import TreeNode


class EvictionPolicy(abc.ABC):
    """Orders unlocked leaves for eviction: the smallest `priority(node)` is evicted first."""

    #: The name under which the policy is registered in `EVICTION_POLICIES`.
    name: str = ""

    @abc.abstractmethod
    def priority(self, node: "TreeNode") -> Any:
        """A sortable key for `node`; must not change the node."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class LRUEviction(EvictionPolicy):
    """Least recently used first (reference N7)."""

    name = "lru"

    def priority(self, node: "TreeNode") -> int:
        return node.last_access_time


class LFUEviction(EvictionPolicy):
    """Fewest prefix hits first; among equally used nodes, the least recently used."""

    name = "lfu"

    def priority(self, node: "TreeNode") -> tuple[int, int]:
        return (node.hit_count, node.last_access_time)


class PriorityEviction(EvictionPolicy):
    """Lowest request priority first; among equal priorities, the least recently used."""

    name = "priority"

    def priority(self, node: "TreeNode") -> tuple[int, int]:
        return (node.priority, node.last_access_time)


EVICTION_POLICIES: dict[str, type[EvictionPolicy]] = {
    LRUEviction.name: LRUEviction,
    LFUEviction.name: LFUEviction,
    PriorityEviction.name: PriorityEviction,
}


def get_eviction_policy(name: str) -> EvictionPolicy:
    """A fresh instance of the policy registered as `name`; ValueError naming the known ones."""
    try:
        policy_cls = EVICTION_POLICIES[name]
    except (KeyError, TypeError):
        known = ", ".join(sorted(EVICTION_POLICIES))
        raise ValueError(f"unknown eviction policy {name!r} (known: {known})") from None
    return policy_cls()
