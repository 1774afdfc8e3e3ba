"""Last in, first out: the newest waiting request is admitted first.

It declares a settings section, ``[plugin.lifo]``, to exercise `register_settings`.
"""

from pydantic import BaseModel, Field

from framework import hookimpl

PLUGIN_KIND = "policy"
PLUGIN_NAME = "lifo"


class LifoSettings(BaseModel):
    max_new_per_round: int = Field(0, ge=0, description="Admit at most this many per round (0: no cap).")


@hookimpl
def register_settings(register):
    register("lifo", LifoSettings)


@hookimpl
def select_prefill(scheduler, adder):
    cap = scheduler.settings.plugin_section("lifo").max_new_per_round
    ordered = list(reversed(scheduler.waiting_queue))
    if cap:
        ordered = ordered[:cap]
    return adder.admit_waiting(scheduler, ordered, prefix_computed=False)
