"""Radix prefix cache (reference section N): shares the KV of common prompt prefixes between requests.

The cache is a radix tree over token ids. Each node holds a run of tokens (`key`) and the KV slot
indices of those tokens (`value`, int64, same length); the tokens of a node's whole prefix are the
keys on the path from the root. Children are keyed by the first token of their key, so two children
of a node never start with the same token.

A running request locks the path to its `last_node` (`lock_ref > 0`), and locked nodes are never
evicted. `evict` frees whole unlocked leaves in the order given by an `EvictionPolicy`
(`plugins/caches/eviction.py`, LRU by default).

Size accounting: every token the tree holds is counted in exactly one of `evictable_size()` (its
node is unlocked) and `protected_size()` (locked).

`RadixCache(..., disable=True)` is the reference's "disabled radix cache": nothing is shared,
finished requests free all their KV.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from framework import hookimpl
from framework.cache import BasePrefixCache
from plugins.caches.chunk import ChunkCache
from plugins.caches.eviction import EvictionPolicy, get_eviction_policy

if TYPE_CHECKING:
    from framework.memory import ReqToTokenPool, TokenToKVPool
    from framework.request import Req

logger = logging.getLogger(__name__)

#: How many nodes `pretty_print` lists before summarising the rest (OOM logs must stay readable).
PRETTY_PRINT_MAX_NODES = 200


def _empty_indices() -> torch.Tensor:
    return torch.empty((0,), dtype=torch.int64)


def _common_prefix_len(node_key: list[int], key: Sequence[int], start: int) -> int:
    """Length of the common prefix of `node_key` and `key[start:]` (without copying `key`)."""
    limit = min(len(node_key), len(key) - start)
    prefix_len = 0
    while prefix_len < limit and node_key[prefix_len] == key[start + prefix_len]:
        prefix_len += 1
    return prefix_len


def _req_priority(req: "Req") -> int:
    return req.priority if req.priority is not None else 0


class TreeNode:
    """A node of the radix tree: the edge from its parent carries `key` and its KV `value`."""

    def __init__(
        self,
        key: list[int] | None = None,
        value: torch.Tensor | None = None,
        parent: "TreeNode | None" = None,
        access_time: int = 0,
    ):
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.key: list[int] = key if key is not None else []
        self.value: torch.Tensor = value if value is not None else _empty_indices()
        self.lock_ref = 0
        # Bookkeeping read by the eviction policies.
        self.last_access_time = access_time
        self.hit_count = 0
        self.priority = 0

    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        return (
            f"TreeNode(key_len={len(self.key)}, lock_ref={self.lock_ref}, "
            f"children={len(self.children)})"
        )


class RadixCache(BasePrefixCache):
    """The radix-tree prefix cache (reference N), with a pluggable eviction order."""

    def __init__(
        self,
        req_to_token_pool: "ReqToTokenPool",
        token_to_kv_pool: "TokenToKVPool",
        disable: bool = False,
        eviction: str | EvictionPolicy = "lru",
    ):
        super().__init__(req_to_token_pool, token_to_kv_pool)
        self.disable = disable
        if isinstance(eviction, EvictionPolicy):
            self.eviction_policy = eviction
        else:
            self.eviction_policy = get_eviction_policy(eviction)
        # A logical clock instead of time.time(): LRU order stays exact when operations happen
        # within one clock tick, and tests are deterministic.
        self._clock = itertools.count(1)
        self.reset()

    def reset(self) -> None:
        """Drop the whole tree. The root is locked forever so that it is never evicted."""
        self.root_node = TreeNode(access_time=self._tick())
        self.root_node.lock_ref = 1
        self.evictable_size_ = 0
        self.protected_size_ = 0

    # -- lookups and inserts ---------------------------------------------------------------------

    def match_prefix(self, rid: str, key: Sequence[int]) -> tuple[torch.Tensor, TreeNode]:
        """Return (KV indices of the longest cached prefix of `key`, the node where it ends).

        A node that `key` leaves in the middle is split so that the match ends exactly at a node.
        Every node on the path counts a hit and is touched. `rid` is unused: the tree is shared.
        """
        if self.disable:
            return _empty_indices(), self.root_node
        path, _ = self._walk(key)
        for node in path:
            node.hit_count += 1
        return self._path_indices(path), (path[-1] if path else self.root_node)

    def insert(self, key: Sequence[int], value: torch.Tensor, priority: int = 0) -> int:
        """Cache `value[i]` as the KV of token `key[i]`; return the length of the prefix of `key`
        that was already cached (those entries of `value` are NOT stored: the caller frees them).

        `priority` is the priority of the request the tokens belong to; every node on the path
        keeps the largest one it has seen.
        """
        if self.disable:
            return 0
        if len(key) != len(value):
            raise ValueError(f"insert: key has {len(key)} tokens but value has {len(value)} indices")
        path, prefix_len = self._walk(key)
        for node in path:
            node.priority = max(node.priority, priority)
        if prefix_len < len(key):
            parent = path[-1] if path else self.root_node
            # Clone so the tree never aliases a caller's buffer (e.g. a row of req_to_token).
            leaf = TreeNode(
                key=list(key[prefix_len:]),
                value=value[prefix_len:].to(torch.int64).clone(),
                parent=parent,
                access_time=parent.last_access_time,
            )
            leaf.priority = priority
            parent.children[leaf.key[0]] = leaf
            self.evictable_size_ += len(leaf.key)
        return prefix_len

    # -- request lifecycle -----------------------------------------------------------------------

    def cache_finished_req(self, req: "Req", token_ids: list[int] | None = None) -> None:
        """Cache a finished request's tokens, free its duplicate KV and its slot, drop its lock.

        `token_ids` defaults to `(origin + output)[:-1]`: the last sampled token has no KV yet.
        """
        if token_ids is None:
            token_ids = (req.origin_input_ids + req.output_ids)[:-1]
        # Clone: the request slot is freed below and may be rewritten while a grouped free
        # (TokenToKVPool.free_group_begin) still holds the slices.
        kv_indices = self.req_to_token_pool.req_to_token[req.req_pool_idx, : len(token_ids)].clone()

        if self.disable:
            self.token_to_kv_pool.free(kv_indices)
            self.free_req_slot(req)
            return

        new_prefix_len = self.insert(token_ids, kv_indices, _req_priority(req))
        # Tokens past the request's own matched prefix that another request cached meanwhile:
        # the tree keeps its copy, ours is a duplicate.
        self.token_to_kv_pool.free(kv_indices[len(req.prefix_indices) : new_prefix_len])
        self.free_req_slot(req)
        self.dec_lock_ref(req.last_node)

    def cache_unfinished_req(self, req: "Req", token_ids: list[int] | None = None) -> None:
        """Cache a running request's computed tokens (`req.fill_ids` by default) and re-point the
        request at the cached copy: its prefix, its req_to_token row and its lock."""
        if self.disable:
            return
        if token_ids is None:
            token_ids = req.fill_ids
        prefix_len = len(req.prefix_indices)
        # Clone: the row is rewritten below, and a grouped free may still hold the slice.
        kv_indices = self.req_to_token_pool.req_to_token[req.req_pool_idx, : len(token_ids)].clone()

        new_prefix_len = self.insert(token_ids, kv_indices, _req_priority(req))
        self.token_to_kv_pool.free(kv_indices[prefix_len:new_prefix_len])

        # Everything is cached now; a second walk finds the node to lock and the tree's indices,
        # which replace the duplicates just freed. Not a hit: nothing was reused.
        path, matched_len = self._walk(token_ids)
        if matched_len != len(token_ids):
            raise RuntimeError(f"cache_unfinished_req: {matched_len} of {len(token_ids)} tokens cached")
        new_indices = self._path_indices(path)
        new_last_node = path[-1] if path else self.root_node
        self.req_to_token_pool.write(
            (req.req_pool_idx, slice(prefix_len, len(new_indices))), new_indices[prefix_len:]
        )

        self.dec_lock_ref(req.last_node)
        self.inc_lock_ref(new_last_node)
        req.prefix_indices = new_indices
        req.last_node = new_last_node

    # -- locking ---------------------------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode | None) -> int:
        """Lock `node` and its ancestors (the root excluded); return the change of evictable size."""
        if self.disable or node is None:
            return 0
        delta = 0
        while node is not self.root_node:
            if node.lock_ref == 0:
                self.evictable_size_ -= len(node.value)
                self.protected_size_ += len(node.value)
                delta -= len(node.value)
            node.lock_ref += 1
            node = node.parent
        return delta

    def dec_lock_ref(self, node: TreeNode | None) -> int:
        """Release a lock taken by `inc_lock_ref`; return the change of evictable size."""
        if self.disable or node is None or node is self.root_node:
            return 0
        # Ancestors hold at least the locks of their descendants, so checking the start suffices
        # to keep an unbalanced release from leaving the counts half updated.
        if node.lock_ref <= 0:
            raise RuntimeError("dec_lock_ref: node is not locked")
        delta = 0
        while node is not self.root_node:
            if node.lock_ref == 1:
                self.evictable_size_ += len(node.value)
                self.protected_size_ -= len(node.value)
                delta += len(node.value)
            node.lock_ref -= 1
            node = node.parent
        return delta

    # -- eviction --------------------------------------------------------------------------------

    def evict(self, num_tokens: int, evict_callback: Callable[[torch.Tensor], None]) -> None:
        """Free unlocked leaves, smallest eviction key first, until `num_tokens` tokens are freed
        or nothing unlocked is left. Whole leaves go, so more than asked may be freed."""
        if self.disable:
            return
        policy = self.eviction_policy
        # The counter breaks key ties in insertion order, so nodes themselves are never compared.
        tie_breaker = itertools.count()
        heap = [(policy.priority(leaf), next(tie_breaker), leaf) for leaf in self._unlocked_leaves()]
        heapq.heapify(heap)

        num_evicted = 0
        while num_evicted < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            evict_callback(leaf.value)
            num_evicted += len(leaf.value)
            parent = leaf.parent
            self._delete_leaf(leaf)
            # A locked leaf keeps its ancestors locked, so an unlocked parent has no locked child.
            if parent.is_leaf() and parent.lock_ref == 0 and parent is not self.root_node:
                heapq.heappush(heap, (policy.priority(parent), next(tie_breaker), parent))

    # -- sizes and debugging ---------------------------------------------------------------------

    def evictable_size(self) -> int:
        return self.evictable_size_

    def protected_size(self) -> int:
        return self.protected_size_

    def total_size(self) -> int:
        """Tokens held by the tree, counted by walking it (a cross-check of the two counters)."""
        return sum(len(node.value) for node in self._nodes())

    def pretty_print(self) -> str:
        """The tree, one node per line, indented by depth; never raises."""
        lines = [
            f"RadixCache(eviction={self.eviction_policy.name}, disable={self.disable}, "
            f"evictable={self.evictable_size_}, protected={self.protected_size_})"
        ]
        stack = [(child, 1) for child in reversed(list(self.root_node.children.values()))]
        num_listed = 0
        while stack and num_listed < PRETTY_PRINT_MAX_NODES:
            node, depth = stack.pop()
            head = node.key[:8]
            more = "..." if len(node.key) > 8 else ""
            lines.append(
                f"{'  ' * depth}{head}{more} len={len(node.key)} lock_ref={node.lock_ref} "
                f"hits={node.hit_count} priority={node.priority} t={node.last_access_time}"
            )
            num_listed += 1
            stack.extend((child, depth + 1) for child in reversed(list(node.children.values())))
        if stack:
            lines.append(f"... and more nodes not listed (limit {PRETTY_PRINT_MAX_NODES})")
        return "\n".join(lines)

    # -- internals -------------------------------------------------------------------------------

    def _tick(self) -> int:
        return next(self._clock)

    def _walk(self, key: Sequence[int]) -> tuple[list[TreeNode], int]:
        """Follow `key` from the root, touching every node on the way; return the path (root
        excluded) and how many tokens of `key` it covers.

        Where `key` ends or diverges inside a node, that node is split so the path ends on a node
        boundary; the upper half is new and the lower half keeps its identity, so a request whose
        `last_node` is the lower half still points at its full prefix.
        """
        now = self._tick()
        self.root_node.last_access_time = now
        node = self.root_node
        path: list[TreeNode] = []
        matched_len = 0
        while matched_len < len(key):
            child = node.children.get(key[matched_len])
            if child is None:
                break
            prefix_len = _common_prefix_len(child.key, key, matched_len)
            if prefix_len < len(child.key):
                child = self._split_node(child, prefix_len)
            child.last_access_time = now
            path.append(child)
            matched_len += prefix_len
            node = child
        return path, matched_len

    def _split_node(self, child: TreeNode, split_len: int) -> TreeNode:
        """Cut `child` after `split_len` tokens; return the new upper node (the parent of `child`).

        The upper node inherits the lock count and the policy bookkeeping: every lock and hit on
        `child` covered its first `split_len` tokens too. Sizes do not change.
        """
        upper = TreeNode(
            key=child.key[:split_len],
            value=child.value[:split_len],
            parent=child.parent,
            access_time=child.last_access_time,
        )
        upper.lock_ref = child.lock_ref
        upper.hit_count = child.hit_count
        upper.priority = child.priority
        upper.children = {child.key[split_len]: child}
        child.parent.children[child.key[0]] = upper
        child.parent = upper
        child.key = child.key[split_len:]
        child.value = child.value[split_len:]
        return upper

    def _delete_leaf(self, leaf: TreeNode) -> None:
        del leaf.parent.children[leaf.key[0]]
        self.evictable_size_ -= len(leaf.key)

    @staticmethod
    def _path_indices(path: list[TreeNode]) -> torch.Tensor:
        return torch.cat([node.value for node in path]) if path else _empty_indices()

    def _nodes(self):
        """Every node except the root, parents before children."""
        stack = list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _unlocked_leaves(self) -> list[TreeNode]:
        return [node for node in self._nodes() if node.is_leaf() and node.lock_ref == 0]


# ---------------------------------------------------------------------------------------------
# Plugin registration

PLUGIN_KIND = "cache"


@hookimpl
def create_cache(settings, req_to_token_pool, token_to_kv_pool):
    if settings.model.lora_paths:
        # KV computed under one LoRA adapter is wrong for another, so nothing is shared while
        # adapters are loaded; the reference requires --disable-radix-cache (AB1), which picks
        # the chunk cache when chunked prefill is on (B3).
        if settings.scheduler.chunked_prefill_size is not None:
            logger.warning("cache radix: LoRA adapters with chunked prefill: running the chunk cache "
                           "(no prefix sharing), as the reference does")
            return ChunkCache(req_to_token_pool, token_to_kv_pool)
        logger.warning("cache radix: LoRA adapters are loaded: the radix cache shares no prefixes")
        return RadixCache(req_to_token_pool, token_to_kv_pool, disable=True)
    return RadixCache(req_to_token_pool, token_to_kv_pool, eviction=settings.cache.eviction)
