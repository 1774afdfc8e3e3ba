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
    register("lpm", LpmSettings)


_warned_no_sharing = False


def match_all(view) -> dict[int, int]:
    """Matched prefix length of every waiting request, by ``id(req)``."""
    return {id(req): view.match_prefix(req).length for req in view.waiting_queue}


def fcfs_when_no_sharing(view, policy_name: str) -> bool:
    """True (and a notice once) when the cache cannot share prefixes, so prefix policies are FCFS."""
    global _warned_no_sharing
    if view.cache_shares_prefixes:
        return False
    if not _warned_no_sharing:
        logger.info("%s: the %s cache shares no prefixes; scheduling FCFS instead", policy_name, view.cache_name)
        _warned_no_sharing = True
    return True


@hookimpl
def select_prefill(view):
    queue = view.waiting_queue
    if fcfs_when_no_sharing(view, "lpm") or len(queue) > FCFS_FALLBACK_QUEUE_LEN:
        return list(queue)
    prefix_len = match_all(view)
    ordered = sorted(queue, key=lambda r: -prefix_len[id(r)])
    options = view.settings.plugin_section("lpm")
    if options.in_batch_prefix_caching:
        ordered = hold_back_shared(ordered, prefix_len, options.check_threshold, options.share_threshold)
    return ordered


def hold_back_shared(ordered: list, prefix_len: dict[int, int], check_threshold: int, share_threshold: int) -> list:
    """Drop from this round the requests whose uncached prefix an earlier request in `ordered`
    shares: "shares" means equal first `share_threshold` tokens, so a set of those keys suffices.
    A request that has those tokens cached already is not held back: its sharers hit them too."""
    seen: set[tuple[int, ...]] = set()
    kept = []
    for req in ordered:
        fill_ids = req.origin_input_ids + req.output_ids
        # input_embeds prompts are placeholder ids: equal ids do not mean a shared prefix.
        shares_ids = req.input_embeds is None
        cached = prefix_len[id(req)]
        if shares_ids and cached <= check_threshold and cached < share_threshold < len(fill_ids):
            key = tuple(fill_ids[:share_threshold])
            if key in seen:
                continue
            seen.add(key)
        kept.append(req)
    return kept
