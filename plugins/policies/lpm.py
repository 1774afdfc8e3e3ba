"""Longest prefix match first (reference E2 `lpm`), the default policy.

Every waiting request's prefix is matched in the cache and the queue is sorted by matched length,
longest first; the sort is stable so ties keep arrival order. With more than 128 waiting requests
the round falls back to FCFS, as in the reference, because matching every request costs more than
the better order gains. When the cache shares nothing (chunk cache) the policy is FCFS for good.

Beyond the reference, *in-batch prefix caching* (as later SGLang versions do; setting
``[plugin.lpm] in_batch_prefix_caching``, on by default): when several waiting requests share a
prefix that is not cached yet, only the first of them is admitted this round; the others wait
until its prefill has put the prefix in the cache, and then hit it.
"""

from __future__ import annotations

import logging

from pydantic import BaseModel, Field

from framework import hookimpl

PLUGIN_KIND = "policy"
PLUGIN_NAME = "lpm"
FCFS_FALLBACK_QUEUE_LEN = 128

logger = logging.getLogger(__name__)


class LpmSettings(BaseModel):
    in_batch_prefix_caching: bool = Field(
        True, description="Hold back waiting requests that share an uncached prefix with one admitted first."
    )
    check_threshold: int = Field(
        32, ge=0, description="Only requests whose cached prefix is at most this long are checked."
    )
    share_threshold: int = Field(
        32, gt=0, description="Requests sharing at least this many leading tokens count as sharing a prefix."
    )


@hookimpl
def register_settings(register):
    register(PLUGIN_NAME, LpmSettings)
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
    ordered = list(queue)
    options = scheduler.settings.plugin_section(PLUGIN_NAME)
    if options.in_batch_prefix_caching:
        ordered = hold_back_shared(ordered, options.check_threshold, options.share_threshold)
    return adder.admit_waiting(scheduler, ordered, prefix_computed=True)


def hold_back_shared(ordered: list, check_threshold: int, share_threshold: int) -> list:
    """Drop from this round the requests whose uncached prefix an earlier request in `ordered`
    shares: "shares" means equal first `share_threshold` tokens, so a set of those keys suffices."""
    seen: set[tuple[int, ...]] = set()
    kept = []
    for req in ordered:
        # input_embeds prompts are placeholder ids: equal ids do not mean a shared prefix.
        shares_ids = req.input_embeds is None
        if shares_ids and len(req.prefix_indices) <= check_threshold and len(req.fill_ids) > share_threshold:
            key = tuple(req.fill_ids[:share_threshold])
            if key in seen:
                continue
            seen.add(key)
        kept.append(req)
    return kept
