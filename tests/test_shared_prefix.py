"""Prefix cache hit rate on a shared-prefix workload: 8 groups x 16 requests sharing a 500-token
system prompt (issue 3). Throughputs are printed for the notes, never asserted."""

from __future__ import annotations

import random
import time

import pytest

GROUPS, PER_GROUP, SYSTEM_LEN, QUESTION_LEN = 8, 16, 500, 20
PARAMS = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def workload():
    rng = random.Random(0)
    systems = [[rng.randrange(100, 40000) for _ in range(SYSTEM_LEN)] for _ in range(GROUPS)]
    groups = [
        [systems[g] + [rng.randrange(100, 40000) for _ in range(QUESTION_LEN)] for _ in range(PER_GROUP)]
        for g in range(GROUPS)
    ]
    return groups


def hit_rate(results) -> float:
    cached = sum(r["meta_info"]["cached_tokens"] for r in results)
    total = sum(r["meta_info"]["prompt_tokens"] for r in results)
    return cached / total


def run(engine, batches):
    results = []
    start = time.perf_counter()
    for batch in batches:
        results.extend(engine.generate(input_ids=batch, sampling_params=PARAMS))
    elapsed = time.perf_counter() - start
    tokens = sum(r["meta_info"]["prompt_tokens"] + r["meta_info"]["completion_tokens"] for r in results)
    return hit_rate(results), tokens / elapsed


@pytest.mark.parametrize("cache, expected", [("radix", 0.85), ("chunk", 0.0)])
def test_first_of_each_group_then_the_rest(make_engine, workload, cache, expected):
    engine = make_engine(plugins={"cache": cache})
    firsts = [g[0] for g in workload]
    rest = [r for g in workload for r in g[1:]]
    rate, throughput = run(engine, [firsts, rest])
    print(f"{cache}: hit rate {rate:.3f}, {throughput:.0f} tokens/s")
    if cache == "radix":
        assert rate >= expected
    else:
        assert rate == 0.0


def test_burst_with_in_batch_prefix_caching(make_engine, workload):
    # Interleave the groups, as independent clients would arrive.
    burst = [workload[g][i] for i in range(PER_GROUP) for g in range(GROUPS)]
    rates = {}
    for in_batch in (True, False):
        engine = make_engine(plugin={"lpm": {"in_batch_prefix_caching": in_batch}})
        rates[in_batch], throughput = run(engine, [burst])
        print(f"burst, in-batch prefix caching {'on' if in_batch else 'off'}: "
              f"hit rate {rates[in_batch]:.3f}, {throughput:.0f} tokens/s")
    assert rates[True] >= 0.80
    assert rates[True] > rates[False]
