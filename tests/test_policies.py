"""Each policy's ordering on hand-built waiting queues equals the reference's (section E)."""

from __future__ import annotations

import importlib
import sys
from types import SimpleNamespace

import pytest
import torch

from framework.config import Settings
from framework.memory import ReqToTokenPool, TokenToKVPool
from framework.request import Req, SamplingParams, Stash
from framework.scheduler import Scheduler
from framework.views import SchedulerView
from plugins.caches.chunk import ChunkCache
from plugins.caches.radix import RadixCache
from plugins.policies.lpm import LpmSettings


def make_cache(cls=RadixCache, sequences=()):
    kv = TokenToKVPool(1000, torch.float32, 1, 1, 1)
    cache = cls(ReqToTokenPool(8, 64), kv)
    for seq in sequences:
        cache.insert(list(seq), kv.alloc(len(seq)))
    return cache


def make_scheduler(cache, reqs, **lpm):
    """Just what `SchedulerView` reads, around a cache and a waiting queue."""
    settings = Settings.load(None)
    settings.plugin["lpm"] = lpm
    settings.register_plugin_section("lpm", LpmSettings)
    sched = SimpleNamespace(
        tree_cache=cache, waiting_queue=list(reqs), settings=settings, stash=Stash(), prefix_matches={}
    )
    sched.match_waiting_prefix = lambda r: Scheduler.match_waiting_prefix(sched, r)
    return sched


def req(rid, ids, max_new=16):
    return Req(rid, ids, SamplingParams(max_new_tokens=max_new))


def order(policy, scheduler):
    """What the policy returns: (rids in order, whether it matched every waiting prefix)."""
    module = importlib.import_module(f"plugins.policies.{policy}")
    chosen = module.select_prefill(view=SchedulerView(scheduler))
    matched = len(scheduler.prefix_matches) == len(scheduler.waiting_queue)
    return SimpleNamespace(ordered=[r.rid for r in chosen], prefix_computed=matched)


def test_fcfs_keeps_arrival_order():
    reqs = [req(str(i), [i + 1, 2, 3]) for i in range(5)]
    adder = order("fcfs", make_scheduler(make_cache(), reqs))
    assert adder.ordered == ["0", "1", "2", "3", "4"] and adder.prefix_computed is False


def test_lpm_sorts_by_matched_prefix_stably():
    cache = make_cache(sequences=[[1, 2, 3, 4, 5, 6], [9, 9]])
    reqs = [
        req("none", [7, 7, 7]),
        req("two", [1, 2, 8, 8]),
        req("five", [1, 2, 3, 4, 5, 0]),
        req("two-b", [1, 2, 9]),
        req("one", [9, 8]),
    ]
    sched = make_scheduler(cache, reqs, in_batch_prefix_caching=False)
    adder = order("lpm", sched)
    assert adder.ordered == ["five", "two", "two-b", "one", "none"]
    assert adder.prefix_computed is True
    by_rid = {r.rid: r for r in sched.waiting_queue}
    lengths = [len(sched.prefix_matches[id(by_rid[rid])][0]) for rid in adder.ordered]
    assert lengths == [5, 2, 2, 1, 0]
    # The view's match leaves the requests as they were: the core sets their prefix on admission.
    assert all(len(r.prefix_indices) == 0 for r in sched.waiting_queue)


def test_lpm_falls_back_to_fcfs_over_128_waiting():
    cache = make_cache(sequences=[[5, 5, 5, 5]])
    reqs = [req(str(i), [1, 2, 3]) for i in range(129)] + [req("hit", [5, 5, 5, 5, 1])]
    adder = order("lpm", make_scheduler(cache, reqs))
    assert adder.ordered[-1] == "hit" and adder.prefix_computed is False


def test_lpm_with_128_waiting_still_sorts():
    cache = make_cache(sequences=[[5, 5, 5, 5]])
    reqs = [req(str(i), [1, 2, 3]) for i in range(127)] + [req("hit", [5, 5, 5, 5, 1])]
    adder = order("lpm", make_scheduler(cache, reqs))
    assert adder.ordered[0] == "hit"


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_prefix_policies_are_fcfs_on_a_cache_that_shares_nothing(policy):
    reqs = [req("a", [1, 2, 3]), req("b", [4, 5])]
    module = policy.replace("-", "_")
    adder = order(module, make_scheduler(make_cache(ChunkCache), reqs))
    assert adder.ordered == ["a", "b"] and adder.prefix_computed is False


def test_dfs_weight_post_order_heaviest_child_first():
    cache = make_cache(sequences=[[1, 2, 3, 4], [1, 2, 5, 6], [7, 8]])
    reqs = [
        req("r1", [1, 2, 3, 4, 9]),  # ends at [3, 4]
        req("r2", [1, 2, 5, 6, 9]),  # ends at [5, 6]
        req("r3", [1, 2, 5, 6, 10]),  # ends at [5, 6]
        req("r4", [7, 8, 1]),  # ends at [7, 8]
        req("r5", [1, 2, 11]),  # ends at [1, 2]
        req("r6", [20]),  # ends at the root
    ]
    adder = order("dfs_weight", make_scheduler(cache, reqs))
    # [1,2] weighs 4 (r5 + [5,6]:2 + [3,4]:1), [7,8] weighs 1; children before their node's own.
    assert adder.ordered == ["r2", "r3", "r1", "r5", "r4", "r6"]
    assert adder.prefix_computed is True


def test_lof_longest_max_new_tokens_first():
    reqs = [req("a", [1], 5), req("b", [1], 50), req("c", [1], 5), req("d", [1], 500)]
    adder = order("lof", make_scheduler(make_cache(), reqs))
    assert adder.ordered == ["d", "b", "a", "c"]


def test_random_is_a_seeded_permutation():
    reqs = [req(str(i), [1]) for i in range(20)]
    first = order("random", make_scheduler(make_cache(), reqs)).ordered
    again = order("random", make_scheduler(make_cache(), reqs)).ordered
    assert sorted(first) == sorted(r.rid for r in reqs)
    assert first == again and first != [r.rid for r in reqs]


def test_lpm_in_batch_prefix_caching_holds_back_sharers():
    system = list(range(100, 140))
    reqs = [
        req("g1-a", system + [1]),
        req("g1-b", system + [2]),
        req("g2-a", [7] * 40 + [1]),
        req("g1-c", system + [3]),
        req("g2-b", [7] * 40 + [2]),
        req("short", [5, 6]),
    ]
    adder = order("lpm", make_scheduler(make_cache(), reqs))
    assert adder.ordered == ["g1-a", "g2-a", "short"]
    off = order("lpm", make_scheduler(make_cache(), reqs, in_batch_prefix_caching=False))
    assert off.ordered == [r.rid for r in reqs]


def test_lpm_in_batch_ignores_requests_that_already_hit_the_cache():
    system = list(range(100, 140))
    cache = make_cache(sequences=[system])
    reqs = [req("a", system + [1]), req("b", system + [2])]
    adder = order("lpm", make_scheduler(cache, reqs))
    assert adder.ordered == ["a", "b"]


@pytest.mark.parametrize("check_threshold", [32, 64])
def test_lpm_in_batch_admits_sharers_whose_shared_prefix_is_cached(check_threshold):
    # The shared 32 tokens (share_threshold) are cached, the rest differs: every request already
    # hits the shared part, so holding them back would only admit one a round.
    system = list(range(100, 132))
    cache = make_cache(sequences=[system + [1, 2]])
    reqs = [req(str(i), system + [10 + i, 20 + i]) for i in range(4)]
    adder = order("lpm", make_scheduler(cache, reqs, check_threshold=check_threshold))
    assert adder.ordered == ["0", "1", "2", "3"]


def test_dfs_weight_walks_a_tree_deeper_than_the_recursion_limit():
    # One node per token, as a long session's turns make; deeper than Python's recursion limit.
    depth = sys.getrecursionlimit() + 100
    kv = TokenToKVPool(depth + 10, torch.float32, 1, 1, 1)
    cache = RadixCache(ReqToTokenPool(8, 64), kv)
    for n in range(1, depth + 1):
        # Only the last token is new; insert stores value[prefix:], so the rest may be anything.
        cache.insert(list(range(n)), torch.cat([torch.zeros(n - 1, dtype=torch.int64), kv.alloc(1)]))
    reqs = [req("root", [depth + 5]), req("mid", list(range(depth // 2)) + [-1]), req("deep", list(range(depth)) + [-1])]
    adder = order("dfs_weight", make_scheduler(cache, reqs))
    assert adder.ordered == ["deep", "mid", "root"]


def test_third_party_policy_from_toml_changes_admission_order(tmp_path, tiny_model_folder):
    """The lifo policy from the test package (installed via its entry point) admits newest first."""
    from framework import hookimpl
    from framework.engine import Engine

    path = tmp_path / "serve.toml"
    path.write_text(
        f"[model]\npath = '{tiny_model_folder}'\ndtype = 'float32'\n"
        "[cache]\nmax_total_tokens = 5000\n[scheduler]\ncheck_leaks = true\n"
        "[plugins]\npolicy = 'lifo'\n[plugin.lifo]\nmax_new_per_round = 1\n"
    )
    first_tokens = []

    class Order:
        @hookimpl
        def on_batch_result(self, batch, result):
            if batch.forward_mode.is_extend():
                first_tokens.extend(r.origin_input_ids[0] for r in batch.reqs if len(r.output_ids) == 1)

    engine = Engine(path, extra_plugins=(Order(),))
    try:
        assert "lifo" in engine.scheduler.plugins.active
        engine.generate(input_ids=[[10, 1], [20, 1], [30, 1]], sampling_params={"max_new_tokens": 2})
    finally:
        engine.shutdown()
    assert first_tokens == [30, 20, 10]
