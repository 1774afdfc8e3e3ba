"""First come, first served: admit waiting requests in arrival order (reference E2 `fcfs`).

Retracted requests were appended at the tail of the queue, so they wait behind newer arrivals.
"""

from framework import hookimpl

PLUGIN_KIND = "policy"
PLUGIN_NAME = "fcfs"


@hookimpl
def select_prefill(scheduler, adder):
    return adder.admit_waiting(scheduler, list(scheduler.waiting_queue), prefix_computed=False)
