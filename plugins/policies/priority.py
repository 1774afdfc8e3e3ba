"""Strict priority with aging, prefix-aware on ties.

A waiting request's effective priority is its priority plus ``aging_rate`` points per second it
has waited (``view.now() - req.arrival_time`` on the scheduler's clock, so aging runs on the sim
worker's virtual time too). Requests are admitted by effective priority, highest first; on equal
effective priority the longer cached prefix goes first (it costs less to prefill), then the older
request. With aging a low-priority request overtakes a stream of higher-priority newcomers once it
has waited (difference in priority) / ``aging_rate`` seconds; ``aging_rate = 0`` is strict
priority, which can starve.

Convention: ``Req.priority`` is "larger is more important" (as the priority-aware radix eviction
reads it); ``[plugin.priority] lower_is_higher = true`` flips it for clients that send ranks
(0 = most important). A request without a priority has ``default_priority``.

Decode OOM: the lowest (static, not aged) priority is retracted first; on ties, the reference's
order (fewest output tokens, longest prompt).

The prefix tie-break matches every waiting request against the cache, so, as lpm does, it is
skipped in rounds with more than 128 waiting requests (ties then keep arrival order).
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from framework import hookimpl
from plugins.policies.lpm import FCFS_FALLBACK_QUEUE_LEN

PLUGIN_KIND = "policy"


class PrioritySettings(BaseModel):
    aging_rate: float = Field(
        1.0, ge=0, description="Priority points a waiting request gains per second waited (0: strict priority)."
    )
    lower_is_higher: bool = Field(
        False, description="True: a lower priority number is more important (ranks); false: larger is more important."
    )
    default_priority: int = Field(0, description="Priority of a request that gives none.")
    prefix_tie_break: bool = Field(True, description="On equal effective priority, the longer cached prefix first.")


@hookimpl
def register_settings(register):
    register("priority", PrioritySettings)


def base_priority(req, options: PrioritySettings) -> float:
    """The request's priority with "larger is more important" whatever the convention."""
    p = options.default_priority if req.priority is None else req.priority
    return -p if options.lower_is_higher else p


def effective_priority(req, now: float, options: PrioritySettings) -> float:
    return base_priority(req, options) + options.aging_rate * max(0.0, now - req.arrival_time)


@hookimpl
def select_prefill(view):
    options = view.settings.plugin_section("priority")
    now = view.now()
    queue = view.waiting_queue
    # As lpm: past this many waiting requests, matching each one costs more than the tie-break gains.
    use_prefix = options.prefix_tie_break and view.cache_shares_prefixes and len(queue) <= FCFS_FALLBACK_QUEUE_LEN
    prefix_len = {id(r): view.match_prefix(r).length if use_prefix else 0 for r in queue}
    return sorted(queue, key=lambda r: (-effective_priority(r, now, options), -prefix_len[id(r)], r.arrival_time))


@hookimpl
def on_decode_oom(batch, view):
    options = view.settings.plugin_section("priority")
    return sorted(batch.reqs, key=lambda r: (base_priority(r, options), len(r.output_ids), -len(r.origin_input_ids)))
