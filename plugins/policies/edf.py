"""Earliest deadline first, on each request's time-to-first-token deadline.

A request's deadline is ``arrival_time + slo_ttft_ms / 1000`` on the scheduler's clock (requests
without ``slo_ttft_ms`` use ``[plugin.edf] default_slo_ttft_ms``; when that is not set either they
have no deadline). Admission order:

1. requests that can still meet their deadline, earliest deadline first;
2. requests without a deadline, oldest first;
3. requests whose deadline has passed (demoted, not dropped: they are still served, earliest
   missed deadline first, once nothing meetable is waiting).

A deadline counts as missed when ``now + min_prefill_ms`` is past it: ``min_prefill_ms`` is the
least time a prefill takes on this server (0: only deadlines already in the past).

Decode OOM: decoding requests have met or missed their TTFT deadline already, so the victims are
those with the most slack first: no deadline, then the latest deadline; on ties, the reference's
order (fewest output tokens, longest prompt).
"""

from __future__ import annotations

import math

from pydantic import BaseModel, Field

from framework import hookimpl

PLUGIN_KIND = "policy"


class EdfSettings(BaseModel):
    default_slo_ttft_ms: float | None = Field(
        None, gt=0, description="TTFT deadline (ms after arrival) of a request that gives none; unset: no deadline."
    )
    min_prefill_ms: float = Field(
        0.0, ge=0, description="A deadline closer than this is counted as missed (the shortest prefill's time)."
    )


@hookimpl
def register_settings(register):
    register("edf", EdfSettings)


def deadline(req, options: EdfSettings) -> float:
    """Seconds on the scheduler's clock by which the first token is due (inf: no deadline)."""
    slo_ms = req.slo_ttft_ms if req.slo_ttft_ms is not None else options.default_slo_ttft_ms
    return math.inf if slo_ms is None else req.arrival_time + slo_ms / 1000.0


@hookimpl
def select_prefill(view):
    options = view.settings.plugin_section("edf")
    cutoff = view.now() + options.min_prefill_ms / 1000.0

    def key(req):
        due = deadline(req, options)
        if math.isinf(due):
            return (1, req.arrival_time)
        return (0, due) if due >= cutoff else (2, due)

    return sorted(view.waiting_queue, key=key)


@hookimpl
def on_decode_oom(batch, view):
    options = view.settings.plugin_section("edf")
    return sorted(batch.reqs, key=lambda r: (-deadline(r, options), len(r.output_ids), -len(r.origin_input_ids)))
