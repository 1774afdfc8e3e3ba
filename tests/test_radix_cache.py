"""Tests of the radix prefix cache (plugins/caches/radix.py) and its eviction policies.

Example tests pin the reference behaviour (section N); a Hypothesis state machine drives random
inserts, matches, locks, evictions and request lifecycles against a dict model of what is cached.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from framework.config import Settings
from framework.memory import ReqToTokenPool, TokenToKVPool
from framework.request import Req, SamplingParams
from plugins.caches import radix
from plugins.caches.eviction import (
    EVICTION_POLICIES,
    EvictionPolicy,
    LFUEviction,
    LRUEviction,
    PriorityEviction,
    get_eviction_policy,
)
from plugins.caches.radix import RadixCache, TreeNode

# ---------------------------------------------------------------------------------------------
# Helpers


def make_pools(kv_size: int = 64, num_req_slots: int = 4, max_context_len: int = 32):
    req_pool = ReqToTokenPool(num_req_slots, max_context_len)
    kv_pool = TokenToKVPool(kv_size, torch.float32, num_kv_heads=1, head_dim=1, num_layers=1)
    return req_pool, kv_pool


def make_cache(**kwargs) -> RadixCache:
    return RadixCache(*make_pools(), **kwargs)


def indices(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


class FreeRecorder:
    """An evict callback that records every tensor it is given."""

    def __init__(self):
        self.calls: list[list[int]] = []

    def __call__(self, kv_indices: torch.Tensor) -> None:
        self.calls.append(kv_indices.tolist())


def path_tokens(cache: RadixCache, node: TreeNode) -> tuple[int, ...]:
    """The tokens from the root to `node`; fails if `node` is no longer attached to the tree."""
    tokens: list[int] = []
    while node is not cache.root_node:
        parent = node.parent
        assert parent.children.get(node.key[0]) is node, "node is detached from the tree"
        tokens[:0] = node.key
        node = parent
    return tuple(tokens)


def tree_nodes(cache: RadixCache) -> list[TreeNode]:
    """Every node but the root, walked independently of the cache's own helpers."""
    nodes, stack = [], list(cache.root_node.children.values())
    while stack:
        node = stack.pop()
        nodes.append(node)
        stack.extend(node.children.values())
    return nodes


def tree_contents(cache: RadixCache) -> dict[tuple[int, ...], int]:
    """Map every cached prefix to the KV index of its last token; checks the tree's shape."""
    contents: dict[tuple[int, ...], int] = {}
    stack = [(cache.root_node, ())]
    while stack:
        node, prefix = stack.pop()
        for first_token, child in node.children.items():
            assert child.parent is node
            assert len(child.key) == len(child.value) > 0
            assert child.key[0] == first_token
            assert child.value.dtype == torch.int64
            child_prefix = prefix
            for token, kv_index in zip(child.key, child.value.tolist()):
                child_prefix = child_prefix + (token,)
                contents[child_prefix] = kv_index
            stack.append((child, child_prefix))
    return contents


def prefill(cache, req_pool, kv_pool, rid, tokens, priority=None) -> Req:
    """Admit a request the way the scheduler does: match, lock, allocate, write its row, and
    sample one output token (whose KV does not exist yet)."""
    req = Req(rid, tokens, SamplingParams())
    if priority is not None:
        req.priority = priority
    req.req_pool_idx = req_pool.alloc(1)[0]
    req.init_next_round_input(cache)
    cache.inc_lock_ref(req.last_node)
    prefix_len = len(req.prefix_indices)
    new_kv = kv_pool.alloc(len(req.fill_ids) - prefix_len)
    row = req_pool.req_to_token[req.req_pool_idx]
    row[:prefix_len] = req.prefix_indices
    row[prefix_len : len(req.fill_ids)] = new_kv
    req.output_ids.append(99)
    return req


def decode(req_pool, kv_pool, req: Req, token: int) -> None:
    """One decode step: the last token gets its KV slot, a new token is sampled."""
    req_pool.req_to_token[req.req_pool_idx, req.seqlen() - 1] = kv_pool.alloc(1)[0]
    req.output_ids.append(token)


# ---------------------------------------------------------------------------------------------
# Tree operations


def test_reset_root_is_locked_and_empty():
    cache = make_cache()
    assert cache.root_node.lock_ref == 1
    assert cache.root_node.key == [] and cache.root_node.value.numel() == 0
    assert cache.evictable_size() == cache.protected_size() == cache.total_size() == 0


def test_match_on_empty_tree_returns_empty_int64_and_root():
    cache = make_cache()
    kv, node = cache.match_prefix("r", [1, 2, 3])
    assert kv.dtype == torch.int64 and kv.numel() == 0
    assert node is cache.root_node


def test_match_splits_node_where_key_diverges():
    cache = make_cache()
    cache.insert([1, 2, 3, 4], indices(10, 11, 12, 13))
    (child,) = cache.root_node.children.values()

    kv, node = cache.match_prefix("r", [1, 2, 5])

    assert kv.tolist() == [10, 11]
    assert node.key == [1, 2] and node.value.tolist() == [10, 11]
    assert node.parent is cache.root_node
    # The lower half keeps its identity: a request pointing at it still sees all 4 tokens.
    assert node.children == {3: child}
    assert child.key == [3, 4] and child.value.tolist() == [12, 13]
    assert path_tokens(cache, child) == (1, 2, 3, 4)
    assert cache.total_size() == cache.evictable_size() == 4


def test_match_splits_node_where_key_ends():
    cache = make_cache()
    cache.insert([1, 2, 3], indices(10, 11, 12))
    kv, node = cache.match_prefix("r", [1])
    assert kv.tolist() == [10]
    assert node.key == [1] and list(node.children) == [2]


def test_match_full_path_over_several_nodes():
    cache = make_cache()
    cache.insert([1, 2, 3], indices(10, 11, 12))
    cache.insert([1, 2, 4, 5], indices(20, 21, 22, 23))
    kv, node = cache.match_prefix("r", [1, 2, 4, 5, 6])
    assert kv.tolist() == [10, 11, 22, 23]
    assert path_tokens(cache, node) == (1, 2, 4, 5)


def test_insert_returns_length_of_already_cached_prefix():
    cache = make_cache()
    assert cache.insert([1, 2, 3], indices(10, 11, 12)) == 0
    assert cache.insert([1, 2, 3, 4, 5], indices(20, 21, 22, 23, 24)) == 3
    assert cache.insert([1, 2], indices(30, 31)) == 2
    assert cache.insert([1, 9], indices(40, 41)) == 1
    assert cache.insert([], indices()) == 0
    # Only the new suffixes were stored: the already-cached entries keep their first indices.
    assert tree_contents(cache) == {
        (1,): 10, (1, 2): 11, (1, 2, 3): 12, (1, 2, 3, 4): 23, (1, 2, 3, 4, 5): 24, (1, 9): 41,
    }
    assert cache.evictable_size() == cache.total_size() == 6


def test_insert_does_not_alias_the_callers_tensor():
    cache = make_cache()
    value = indices(10, 11)
    cache.insert([1, 2], value)
    value[:] = 0
    assert cache.match_prefix("r", [1, 2])[0].tolist() == [10, 11]


def test_insert_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="2 tokens but value has 1"):
        make_cache().insert([1, 2], indices(10))


def test_lock_and_unlock_move_tokens_between_evictable_and_protected():
    cache = make_cache()
    cache.insert([1, 2, 3, 4], indices(10, 11, 12, 13))
    _, upper = cache.match_prefix("r", [1, 2])
    _, leaf = cache.match_prefix("r", [1, 2, 3, 4])

    assert cache.inc_lock_ref(upper) == -2
    assert (cache.evictable_size(), cache.protected_size()) == (2, 2)
    assert cache.inc_lock_ref(leaf) == -2  # only the leaf goes 0 -> 1
    assert (upper.lock_ref, leaf.lock_ref) == (2, 1)
    assert (cache.evictable_size(), cache.protected_size()) == (0, 4)

    assert cache.dec_lock_ref(upper) == 0  # upper still held by the leaf's lock
    assert cache.dec_lock_ref(leaf) == 4
    assert (cache.evictable_size(), cache.protected_size()) == (4, 0)
    assert cache.root_node.lock_ref == 1


def test_lock_on_root_is_a_no_op():
    cache = make_cache()
    cache.insert([1], indices(10))
    assert cache.inc_lock_ref(cache.root_node) == 0
    assert cache.dec_lock_ref(cache.root_node) == 0
    assert cache.root_node.lock_ref == 1


def test_unbalanced_unlock_raises_and_changes_nothing():
    cache = make_cache()
    cache.insert([1, 2], indices(10, 11))
    _, node = cache.match_prefix("r", [1, 2])
    with pytest.raises(RuntimeError, match="not locked"):
        cache.dec_lock_ref(node)
    assert (cache.evictable_size(), cache.protected_size()) == (2, 0)


def test_split_of_locked_node_keeps_lock_accounting():
    cache = make_cache()
    cache.insert([1, 2, 3, 4], indices(10, 11, 12, 13))
    _, leaf = cache.match_prefix("r", [1, 2, 3, 4])
    cache.inc_lock_ref(leaf)
    _, upper = cache.match_prefix("r", [1, 2, 7])  # splits the locked node
    assert upper.lock_ref == leaf.lock_ref == 1
    assert (cache.evictable_size(), cache.protected_size()) == (0, 4)
    assert cache.dec_lock_ref(leaf) == 4
    assert upper.lock_ref == 0


# ---------------------------------------------------------------------------------------------
# Eviction


def test_evict_lru_order_whole_leaves():
    cache = make_cache()
    cache.insert([1, 1], indices(10, 11))
    cache.insert([2, 2], indices(20, 21))
    cache.insert([3, 3], indices(30, 31))
    cache.match_prefix("r", [1, 1])  # [1, 1] is now the most recently used

    freed = FreeRecorder()
    cache.evict(1, freed)
    assert freed.calls == [[20, 21]]  # the whole leaf, although 1 token was asked
    cache.evict(3, freed)
    assert freed.calls == [[20, 21], [30, 31], [10, 11]]
    assert cache.total_size() == cache.evictable_size() == 0


def test_evict_skips_locked_leaves_and_their_ancestors():
    cache = make_cache()
    cache.insert([1, 1], indices(10, 11))
    cache.insert([2, 2], indices(20, 21))
    cache.insert([3, 3], indices(30, 31))
    _, locked = cache.match_prefix("r", [1, 1])
    cache.match_prefix("r", [2, 2])
    cache.inc_lock_ref(locked)

    freed = FreeRecorder()
    cache.evict(100, freed)
    assert freed.calls == [[30, 31], [20, 21]]
    assert cache.match_prefix("r", [1, 1])[0].tolist() == [10, 11]
    assert (cache.evictable_size(), cache.protected_size()) == (0, 2)


def test_evict_reaches_a_parent_once_its_children_are_gone():
    cache = make_cache()
    cache.insert([1, 2, 3], indices(10, 11, 12))
    cache.insert([1, 2, 4], indices(20, 21, 22))
    freed = FreeRecorder()
    cache.evict(100, freed)
    assert freed.calls == [[12], [22], [10, 11]]
    assert cache.root_node.children == {}


def test_evict_keeps_parent_of_a_locked_child():
    cache = make_cache()
    cache.insert([1, 2, 3], indices(10, 11, 12))
    cache.insert([1, 2, 4], indices(20, 21, 22))
    _, leaf = cache.match_prefix("r", [1, 2, 4])
    cache.inc_lock_ref(leaf)
    freed = FreeRecorder()
    cache.evict(100, freed)
    assert freed.calls == [[12]]
    assert cache.match_prefix("r", [1, 2, 4])[0].tolist() == [10, 11, 22]


def test_evict_zero_tokens_frees_nothing():
    cache = make_cache()
    cache.insert([1], indices(10))
    freed = FreeRecorder()
    cache.evict(0, freed)
    assert freed.calls == []


def test_lfu_evicts_least_hit_first_ties_by_lru():
    cache = make_cache(eviction="lfu")
    cache.insert([1], indices(10))
    cache.insert([2], indices(20))
    cache.insert([3], indices(30))
    cache.match_prefix("r", [1])
    cache.match_prefix("r", [1])
    cache.match_prefix("r", [3])
    cache.match_prefix("r", [2])
    cache.match_prefix("r", [3])  # hits: [1]=2, [2]=1, [3]=2; [3] more recent than [1]

    freed = FreeRecorder()
    cache.evict(3, freed)
    assert freed.calls == [[20], [10], [30]]


def test_lfu_split_node_inherits_hits():
    cache = make_cache(eviction="lfu")
    cache.insert([1, 2], indices(10, 11))
    cache.match_prefix("r", [1, 2])
    _, upper = cache.match_prefix("r", [1, 3])
    assert upper.hit_count == 2  # one hit before the split, one now
    assert upper.children[2].hit_count == 1


def test_priority_evicts_low_priority_first_ties_by_lru():
    req_pool, kv_pool = make_pools()
    cache = RadixCache(req_pool, kv_pool, eviction="priority")
    high = prefill(cache, req_pool, kv_pool, "high", [1, 1, 1], priority=5)
    low = prefill(cache, req_pool, kv_pool, "low", [2, 2, 2])  # no priority: 0
    old_low = prefill(cache, req_pool, kv_pool, "old", [3, 3, 3], priority=0)
    low_kv = req_pool.req_to_token[low.req_pool_idx, :3].tolist()
    old_low_kv = req_pool.req_to_token[old_low.req_pool_idx, :3].tolist()
    cache.cache_finished_req(old_low)
    cache.cache_finished_req(high)
    cache.cache_finished_req(low)  # the most recently used, but low priority

    freed = FreeRecorder()
    cache.evict(1, freed)
    cache.evict(1, freed)
    # Both priority-0 prompts go before the older priority-5 one, the older of them first.
    assert freed.calls == [old_low_kv, low_kv]
    assert {node.key[0]: node.priority for node in tree_nodes(cache)} == {1: 5}


def test_priority_node_keeps_max_of_requests_through_it():
    cache = make_cache(eviction="priority")
    cache.insert([1, 2, 3], indices(10, 11, 12), priority=1)
    cache.insert([1, 2], indices(20, 21), priority=7)  # splits [1, 2, 3]
    cache.insert([1, 2, 3], indices(30, 31, 32), priority=3)
    _, upper = cache.match_prefix("r", [1, 2])
    assert upper.priority == 7
    assert upper.children[3].priority == 3


def test_policy_keys():
    node = TreeNode(access_time=5)
    node.hit_count, node.priority = 2, 9
    assert LRUEviction().priority(node) == 5
    assert LFUEviction().priority(node) == (2, 5)
    assert PriorityEviction().priority(node) == (9, 5)


def test_registry_and_unknown_name():
    assert sorted(EVICTION_POLICIES) == ["lfu", "lru", "priority"]
    for name, policy_cls in EVICTION_POLICIES.items():
        policy = get_eviction_policy(name)
        assert isinstance(policy, policy_cls) and policy.name == name
    message = r"unknown eviction policy 'fifo' \(known: lfu, lru, priority\)"
    with pytest.raises(ValueError, match=message):
        get_eviction_policy("fifo")
    with pytest.raises(ValueError, match="known: lfu, lru, priority"):
        make_cache(eviction="fifo")


def test_cache_accepts_a_policy_instance():
    class MostRecentFirst(EvictionPolicy):
        name = "mru"

        def priority(self, node):
            return -node.last_access_time

    cache = make_cache(eviction=MostRecentFirst())
    cache.insert([1], indices(10))
    cache.insert([2], indices(20))
    freed = FreeRecorder()
    cache.evict(1, freed)
    assert freed.calls == [[20]]


def test_default_eviction_is_lru():
    assert isinstance(make_cache().eviction_policy, LRUEviction)


# ---------------------------------------------------------------------------------------------
# Request lifecycle


def test_cache_finished_req_frees_duplicates_and_slot():
    req_pool, kv_pool = make_pools(kv_size=32)
    cache = RadixCache(req_pool, kv_pool)
    # Two requests with the same prompt are prefilled before either is cached.
    first = prefill(cache, req_pool, kv_pool, "a", [1, 2, 3, 4])
    second = prefill(cache, req_pool, kv_pool, "b", [1, 2, 3, 4])
    decode(req_pool, kv_pool, first, 7)
    first_kv = req_pool.req_to_token[first.req_pool_idx, :5].tolist()
    second_kv = req_pool.req_to_token[second.req_pool_idx, :4].tolist()
    first_slot, second_slot = first.req_pool_idx, second.req_pool_idx
    assert kv_pool.available_size() == 32 - 9

    cache.cache_finished_req(first)  # caches (origin + output)[:-1] = [1, 2, 3, 4, 99]
    assert kv_pool.available_size() == 32 - 9
    assert first.req_pool_idx is None and first_slot in req_pool.free_slots
    assert tree_contents(cache)[(1, 2, 3, 4, 99)] == first_kv[4]

    cache.cache_finished_req(second)  # [1, 2, 3, 4]: all duplicates of the first request's
    assert kv_pool.available_size() == 32 - 5
    assert sorted(kv_pool.free_slots.tolist()[-4:]) == sorted(second_kv)
    assert second_slot in req_pool.free_slots
    assert cache.match_prefix("r", [1, 2, 3, 4, 99])[0].tolist() == first_kv
    assert (cache.evictable_size(), cache.protected_size()) == (5, 0)


def test_cache_finished_req_never_frees_the_matched_prefix():
    req_pool, kv_pool = make_pools(kv_size=32)
    cache = RadixCache(req_pool, kv_pool)
    cache.cache_finished_req(prefill(cache, req_pool, kv_pool, "a", [1, 2, 3]))  # caches [1, 2, 3]
    shared_kv = cache.match_prefix("r", [1, 2, 3])[0].tolist()
    num_free = kv_pool.available_size()

    req = prefill(cache, req_pool, kv_pool, "b", [1, 2, 3, 5])
    assert req.prefix_indices.tolist() == shared_kv
    assert cache.protected_size() == 3
    cache.cache_finished_req(req)
    assert kv_pool.available_size() == num_free - 1  # its own token 5 is now cached, nothing freed
    assert set(shared_kv).isdisjoint(kv_pool.free_slots.tolist())
    assert (cache.evictable_size(), cache.protected_size()) == (4, 0)


def test_cache_finished_req_with_explicit_token_ids():
    req_pool, kv_pool = make_pools()
    cache = RadixCache(req_pool, kv_pool)
    req = prefill(cache, req_pool, kv_pool, "a", [1, 2, 3])
    cache.cache_finished_req(req, token_ids=[1, 2])
    assert tree_contents(cache).keys() == {(1,), (1, 2)}


def test_cache_unfinished_req_repoints_row_and_moves_lock():
    req_pool, kv_pool = make_pools(kv_size=32)
    cache = RadixCache(req_pool, kv_pool)
    first = prefill(cache, req_pool, kv_pool, "a", [1, 2, 3, 4])
    second = prefill(cache, req_pool, kv_pool, "b", [1, 2, 3, 4])
    first_kv = req_pool.req_to_token[first.req_pool_idx, :4].tolist()
    second_kv = req_pool.req_to_token[second.req_pool_idx, :4].tolist()

    cache.cache_unfinished_req(first)
    assert first.prefix_indices.tolist() == first_kv
    assert path_tokens(cache, first.last_node) == (1, 2, 3, 4)
    assert first.last_node.lock_ref == 1
    assert (cache.evictable_size(), cache.protected_size()) == (0, 4)

    num_free = kv_pool.available_size()
    cache.cache_unfinished_req(second)
    # Its duplicates are freed and its row now points at the cached copy.
    assert kv_pool.available_size() == num_free + 4
    assert sorted(kv_pool.free_slots.tolist()[-4:]) == sorted(second_kv)
    assert req_pool.req_to_token[second.req_pool_idx, :4].tolist() == first_kv
    assert second.prefix_indices.tolist() == first_kv
    assert second.last_node is first.last_node and first.last_node.lock_ref == 2

    # The second request runs on; caching again moves its lock down to the longer prefix.
    decode(req_pool, kv_pool, second, 8)
    second.fill_ids = second.origin_input_ids + second.output_ids[:-1]
    old_node = second.last_node
    cache.cache_unfinished_req(second)
    assert path_tokens(cache, second.last_node) == (1, 2, 3, 4, 99)
    assert second.last_node.parent is old_node
    assert (old_node.lock_ref, second.last_node.lock_ref) == (2, 1)
    assert (cache.evictable_size(), cache.protected_size()) == (0, 5)

    cache.cache_finished_req(first)
    cache.cache_finished_req(second)  # [1, 2, 3, 4, 99] is cached already: nothing new
    assert (cache.evictable_size(), cache.protected_size()) == (5, 0)
    assert kv_pool.available_size() == kv_pool.size - 5
    assert req_pool.available_size() == req_pool.size


def test_cache_unfinished_req_writes_inside_a_free_group():
    """Grouped frees hold tensors until the group ends; the row rewrite must not change them."""
    req_pool, kv_pool = make_pools(kv_size=16)
    cache = RadixCache(req_pool, kv_pool)
    first = prefill(cache, req_pool, kv_pool, "a", [1, 2])
    second = prefill(cache, req_pool, kv_pool, "b", [1, 2])
    second_kv = req_pool.req_to_token[second.req_pool_idx, :2].tolist()
    cache.cache_unfinished_req(first)
    kv_pool.free_group_begin()
    cache.cache_unfinished_req(second)
    cache.cache_finished_req(second)
    kv_pool.free_group_end()
    free = kv_pool.free_slots.tolist()
    assert len(free) == len(set(free))
    assert sorted(free[-2:]) == sorted(second_kv)


def test_disabled_cache_shares_nothing_and_frees_everything():
    req_pool, kv_pool = make_pools(kv_size=16)
    cache = RadixCache(req_pool, kv_pool, disable=True)
    assert cache.disable is True
    req = prefill(cache, req_pool, kv_pool, "a", [1, 2, 3])
    assert req.prefix_indices.numel() == 0 and req.last_node is cache.root_node
    decode(req_pool, kv_pool, req, 5)
    slot = req.req_pool_idx

    cache.cache_unfinished_req(req)  # a no-op
    assert req.prefix_indices.numel() == 0
    assert cache.insert([1, 2], indices(1, 2)) == 0
    assert cache.total_size() == 0

    cache.cache_finished_req(req)  # frees origin + output - 1 = 4 tokens
    assert kv_pool.available_size() == 16
    assert slot in req_pool.free_slots
    kv, node = cache.match_prefix("b", [1, 2, 3])
    assert kv.numel() == 0 and node is cache.root_node
    assert cache.inc_lock_ref(node) == cache.dec_lock_ref(node) == 0
    freed = FreeRecorder()
    cache.evict(10, freed)
    assert freed.calls == []
    assert cache.evictable_size() == cache.protected_size() == 0


def test_pretty_print_lists_nodes_and_never_raises():
    cache = make_cache()
    assert "evictable=0" in cache.pretty_print()
    cache.insert(list(range(20)), torch.arange(1, 21))
    cache.insert([0, 1, 5], indices(30, 31, 32))
    text = cache.pretty_print()
    assert "RadixCache(eviction=lru" in text
    assert "len=18" in text and "len=2" in text and "len=1" in text


def test_reset_drops_everything():
    cache = make_cache()
    cache.insert([1, 2], indices(10, 11))
    cache.inc_lock_ref(cache.match_prefix("r", [1])[1])
    cache.reset()
    assert cache.total_size() == cache.evictable_size() == cache.protected_size() == 0
    assert cache.match_prefix("r", [1, 2])[0].numel() == 0


def test_plugin_hook_builds_a_radix_cache_with_the_configured_eviction():
    req_pool, kv_pool = make_pools()
    lfu_settings = Settings.load(None, cache={"eviction": "lfu"})
    cache = radix.create_cache(settings=lfu_settings, req_to_token_pool=req_pool, token_to_kv_pool=kv_pool)
    assert isinstance(cache, RadixCache) and isinstance(cache.eviction_policy, LFUEviction)
    assert cache.req_to_token_pool is req_pool and cache.token_to_kv_pool is kv_pool
    assert radix.PLUGIN_KIND == "cache"


# ---------------------------------------------------------------------------------------------
# Property tests: a state machine against a dict model

TOKENS = st.lists(st.integers(0, 3), max_size=8)
PROMPTS = st.lists(st.integers(0, 3), min_size=1, max_size=8)
PRIORITIES = st.integers(0, 2)


def longest_cached_len(model: dict[tuple[int, ...], int], tokens) -> int:
    prefix_len = 0
    while prefix_len < len(tokens) and tuple(tokens[: prefix_len + 1]) in model:
        prefix_len += 1
    return prefix_len


class RadixCacheMachine(RuleBasedStateMachine):
    """Random inserts, matches, locks, evictions and request lifecycles.

    The model maps each cached prefix (a tuple of tokens) to the KV index of its last token; the
    tree must hold exactly that. KV ownership is tracked too: every KV index is held by the tree,
    by a running request (beyond its cached prefix), or is free in the pool — exactly once.
    """

    KV_SIZE = 20
    NUM_REQ_SLOTS = 3
    MAX_CONTEXT_LEN = 24

    def __init__(self):
        super().__init__()
        self.req_pool, self.kv_pool = make_pools(self.KV_SIZE, self.NUM_REQ_SLOTS, self.MAX_CONTEXT_LEN)
        self.cache: RadixCache | None = None
        self.model: dict[tuple[int, ...], int] = {}
        self.locks: list[tuple[TreeNode, tuple[int, ...]]] = []  # locks the test took directly
        self.reqs: list[Req] = []
        self.num_reqs_started = 0

    @initialize(eviction=st.sampled_from(sorted(EVICTION_POLICIES)))
    def make_cache(self, eviction):
        self.cache = RadixCache(self.req_pool, self.kv_pool, eviction=eviction)

    # -- helpers ---------------------------------------------------------------------------------

    def alloc_kv(self, num_tokens: int) -> torch.Tensor | None:
        """Allocate like `ScheduleBatch.alloc_token_slots`: evict and retry once."""
        kv = self.kv_pool.alloc(num_tokens)
        if kv is None:
            self.evict_and_check(num_tokens - self.kv_pool.available_size())
            kv = self.kv_pool.alloc(num_tokens)
        return kv

    def record_cached(self, tokens, kv_indices: list[int]) -> None:
        for pos in range(len(tokens)):
            self.model.setdefault(tuple(tokens[: pos + 1]), kv_indices[pos])

    def evict_and_check(self, num_tokens: int) -> None:
        cache = self.cache
        policy = cache.eviction_policy
        evictable_before = cache.evictable_size()
        nodes_before = tree_nodes(cache)
        key_of = {node.value[0].item(): (node, policy.priority(node)) for node in nodes_before}
        locked_kv = {i for n in nodes_before if n.lock_ref > 0 for i in n.value.tolist()}
        unlocked_leaves = [n for n in nodes_before if not n.children and n.lock_ref == 0]
        tree_kv = set(self.model.values())

        chunks: list[list[int]] = []

        def free_and_record(kv_indices: torch.Tensor) -> None:
            chunks.append(kv_indices.tolist())
            self.kv_pool.free(kv_indices)

        cache.evict(num_tokens, free_and_record)

        freed = [i for chunk in chunks for i in chunk]
        assert len(freed) == len(set(freed)), "an index was freed twice"
        assert set(freed) <= tree_kv, "evicted an index the tree did not hold"
        assert not set(freed) & locked_kv, "evicted a locked node"
        if evictable_before >= num_tokens:
            assert len(freed) >= num_tokens
        else:
            assert len(freed) == evictable_before and cache.evictable_size() == 0
        if chunks:
            assert len(freed) - len(chunks[-1]) < num_tokens, "evicted more leaves than needed"

        # Whole nodes only, and never one ranked after a leaf that stayed (the heap's order).
        evicted_keys = []
        for chunk in chunks:
            node, key = key_of[chunk[0]]
            assert chunk == node.value.tolist()
            evicted_keys.append(key)
        still_there = {id(n) for n in tree_nodes(cache)}
        for leaf in unlocked_leaves:
            if id(leaf) in still_there:
                assert all(key <= policy.priority(leaf) for key in evicted_keys)

        freed_set = set(freed)
        self.model = {prefix: i for prefix, i in self.model.items() if i not in freed_set}

    def pick_req(self, pick: int) -> Req:
        return self.reqs[pick % len(self.reqs)]

    # -- raw tree operations ---------------------------------------------------------------------

    @rule(tokens=TOKENS, priority=PRIORITIES)
    def insert(self, tokens, priority):
        kv = self.alloc_kv(len(tokens))
        if kv is None:
            return
        expected_len = longest_cached_len(self.model, tokens)
        assert self.cache.insert(tokens, kv, priority=priority) == expected_len
        # The caller owns the duplicates of the already-cached prefix.
        self.kv_pool.free(kv[:expected_len])
        self.record_cached(tokens, kv.tolist())

    @rule(tokens=TOKENS, lock=st.booleans())
    def match(self, tokens, lock):
        expected_len = longest_cached_len(self.model, tokens)
        kv, node = self.cache.match_prefix("probe", tokens)
        assert kv.dtype == torch.int64
        assert kv.tolist() == [self.model[tuple(tokens[: pos + 1])] for pos in range(expected_len)]
        assert path_tokens(self.cache, node) == tuple(tokens[:expected_len])
        if lock:
            evictable_before = self.cache.evictable_size()
            delta = self.cache.inc_lock_ref(node)
            assert delta <= 0 and self.cache.evictable_size() - evictable_before == delta
            self.locks.append((node, tuple(tokens[:expected_len])))

    @precondition(lambda self: self.locks)
    @rule(pick=st.integers(0, 20))
    def unlock(self, pick):
        node, _ = self.locks.pop(pick % len(self.locks))
        evictable_before = self.cache.evictable_size()
        delta = self.cache.dec_lock_ref(node)
        assert delta >= 0 and self.cache.evictable_size() - evictable_before == delta

    @rule(num_tokens=st.integers(0, 30))
    def evict(self, num_tokens):
        self.evict_and_check(num_tokens)

    # -- request lifecycle -----------------------------------------------------------------------

    @precondition(lambda self: self.req_pool.available_size() > 0)
    @rule(prompt=PROMPTS, priority=PRIORITIES)
    def start_req(self, prompt, priority):
        cache = self.cache
        req = Req(f"r{self.num_reqs_started}", prompt, SamplingParams())
        req.priority = priority
        self.num_reqs_started += 1
        req.req_pool_idx = self.req_pool.alloc(1)[0]
        req.init_next_round_input(cache)  # matches at most len(prompt) - 1 tokens
        expected_len = longest_cached_len(self.model, prompt[:-1])
        expected = [self.model[tuple(prompt[: pos + 1])] for pos in range(expected_len)]
        assert req.prefix_indices.tolist() == expected
        cache.inc_lock_ref(req.last_node)
        self.reqs.append(req)  # before allocating: an eviction there must see its lock

        prefix_len = len(req.prefix_indices)
        new_kv = self.alloc_kv(len(prompt) - prefix_len)
        if new_kv is None:
            self.reqs.remove(req)
            cache.dec_lock_ref(req.last_node)
            self.req_pool.free(req.req_pool_idx)
            return
        row = self.req_pool.req_to_token[req.req_pool_idx]
        row[:prefix_len] = req.prefix_indices
        row[prefix_len : len(prompt)] = new_kv
        req.output_ids.append(0)  # sampled; its KV comes with the next decode step

    @precondition(lambda self: self.reqs)
    @rule(pick=st.integers(0, 20), token=st.integers(0, 3))
    def decode(self, pick, token):
        req = self.pick_req(pick)
        if req.seqlen() >= self.MAX_CONTEXT_LEN:
            return
        kv = self.alloc_kv(1)
        if kv is None:
            return
        self.req_pool.req_to_token[req.req_pool_idx, req.seqlen() - 1] = kv[0]
        req.output_ids.append(token)

    @precondition(lambda self: self.reqs)
    @rule(pick=st.integers(0, 20))
    def cache_unfinished(self, pick):
        req = self.pick_req(pick)
        tokens = (req.origin_input_ids + req.output_ids)[:-1]
        req.fill_ids = tokens
        row_before = self.req_pool.req_to_token[req.req_pool_idx, : len(tokens)].tolist()
        self.cache.cache_unfinished_req(req)
        self.record_cached(tokens, row_before)

        expected = [self.model[tuple(tokens[: pos + 1])] for pos in range(len(tokens))]
        assert req.prefix_indices.tolist() == expected
        assert self.req_pool.req_to_token[req.req_pool_idx, : len(tokens)].tolist() == expected
        assert path_tokens(self.cache, req.last_node) == tuple(tokens)

    @precondition(lambda self: self.reqs)
    @rule(pick=st.integers(0, 20))
    def finish(self, pick):
        req = self.pick_req(pick)
        self.reqs.remove(req)
        tokens = (req.origin_input_ids + req.output_ids)[:-1]
        slot = req.req_pool_idx
        row_before = self.req_pool.req_to_token[slot, : len(tokens)].tolist()
        self.cache.cache_finished_req(req)
        self.record_cached(tokens, row_before)
        assert req.req_pool_idx is None and slot in self.req_pool.free_slots
        assert longest_cached_len(self.model, tokens) == len(tokens)

    # -- invariants ------------------------------------------------------------------------------

    @invariant()
    def tree_holds_exactly_the_model(self):
        assert tree_contents(self.cache) == self.model

    @invariant()
    def sizes_add_up(self):
        nodes = tree_nodes(self.cache)
        evictable = sum(len(n.value) for n in nodes if n.lock_ref == 0)
        protected = sum(len(n.value) for n in nodes if n.lock_ref > 0)
        assert self.cache.evictable_size() == evictable
        assert self.cache.protected_size() == protected
        assert self.cache.total_size() == evictable + protected == len(self.model)

    @invariant()
    def lock_counts_match_holders(self):
        expected: dict[int, int] = {}
        holders = [node for node, _ in self.locks] + [req.last_node for req in self.reqs]
        for node in holders:
            while node is not self.cache.root_node:
                expected[id(node)] = expected.get(id(node), 0) + 1
                node = node.parent
        for node in tree_nodes(self.cache):
            assert node.lock_ref == expected.get(id(node), 0)
        assert self.cache.root_node.lock_ref == 1

    @invariant()
    def locked_prefixes_stay_cached(self):
        for node, tokens in self.locks:
            assert path_tokens(self.cache, node) == tokens
        for req in self.reqs:
            prefix_len = len(req.prefix_indices)
            tokens = tuple(req.origin_input_ids + req.output_ids)
            assert path_tokens(self.cache, req.last_node) == tokens[:prefix_len]
            row = self.req_pool.req_to_token[req.req_pool_idx]
            assert row[:prefix_len].tolist() == req.prefix_indices.tolist()

    @invariant()
    def every_kv_index_has_exactly_one_owner(self):
        owned = list(self.model.values()) + self.kv_pool.free_slots.tolist()
        for req in self.reqs:
            # A running request owns the KV past its cached prefix; the last token has none yet.
            row = self.req_pool.req_to_token[req.req_pool_idx]
            owned += row[len(req.prefix_indices) : req.seqlen() - 1].tolist()
        assert sorted(owned) == list(range(1, self.KV_SIZE + 1))


TestRadixCacheMachine = RadixCacheMachine.TestCase
TestRadixCacheMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
