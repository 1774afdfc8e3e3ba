"""Longest prefix match first (reference E2 `lpm`), the default policy.

Every waiting request's prefix is matched in the cache and the queue is sorted by matched length,
longest first; the sort is stable so ties keep arrival order. With more than 128 waiting requests
the round falls back to FCFS, as in the reference, because matching every request costs more than
the better order gains. When the cache shares nothing (chunk cache) the policy is FCFS for good.
"""

from __future__ import annotations

import logging

from framework import hookimpl

PLUGIN_KIND = "policy"
PLUGIN_NAME = "lpm"
FCFS_FALLBACK_QUEUE_LEN = 128

logger = logging.getLogger(__name__)
_warned_no_sharing = False


def match_all(scheduler) -> None:
    cache = scheduler.tree_cache
    for req in scheduler.waiting_queue:
        req.prefix_indices, req.last_node = cache.match_prefix(rid=req.rid, key=req.adjust_max_prefix_ids())


def fcfs_when_no_sharing(scheduler, policy_name: str) -> bool:
    """True (and a notice once) when the cache cannot share prefixes, so prefix policies are FCFS."""
    global _warned_no_sharing
    if not scheduler.tree_cache.disable:
        return False
    if not _warned_no_sharing:
        logger.info("%s: the %s cache shares no prefixes; scheduling FCFS instead",
                    policy_name, type(scheduler.tree_cache).__name__)
        _warned_no_sharing = True
    return True


@hookimpl
def select_prefill(scheduler, adder):
    queue = scheduler.waiting_queue
    if fcfs_when_no_sharing(scheduler, PLUGIN_NAME) or len(queue) > FCFS_FALLBACK_QUEUE_LEN:
        return adder.admit_waiting(scheduler, list(queue), prefix_computed=False)
    match_all(scheduler)
    queue.sort(key=lambda r: -len(r.prefix_indices))
    return adder.admit_waiting(scheduler, list(queue), prefix_computed=True)
