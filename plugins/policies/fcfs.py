"""First come, first served: admit waiting requests in arrival order (reference E2 `fcfs`).

Retracted requests were appended at the tail of the queue, so they wait behind newer arrivals.
"""

from framework import hookimpl

PLUGIN_KIND = "policy"


@hookimpl
def select_prefill(view):
    return list(view.waiting_queue)
