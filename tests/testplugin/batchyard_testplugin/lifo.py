"""Last in, first out: the newest waiting request is admitted first.

It declares a settings section, ``[plugin.lifo]``, to exercise `register_settings`, and numbers
requests as they arrive (`on_request_received`, in ``req.stash``): the waiting queue keeps the
order the policy returned last round, so arrival order is the plugin's own to remember.
"""

import itertools

from pydantic import BaseModel, Field

from framework import hookimpl
from framework.request import StashKey

PLUGIN_KIND = "policy"

ARRIVAL: StashKey[int] = StashKey("lifo_arrival")
_COUNTER = itertools.count()


class LifoSettings(BaseModel):
    max_new_per_round: int = Field(0, ge=0, description="Admit at most this many per round (0: no cap).")


@hookimpl
def register_settings(register):
    register("lifo", LifoSettings)


@hookimpl
def on_request_received(req):
    req.stash[ARRIVAL] = next(_COUNTER)


@hookimpl
def select_prefill(view):
    cap = view.settings.plugin_section("lifo").max_new_per_round
    ordered = sorted(view.waiting_queue, key=lambda r: -r.stash.get(ARRIVAL, -1))
    if cap:
        ordered = ordered[:cap]
    return ordered
