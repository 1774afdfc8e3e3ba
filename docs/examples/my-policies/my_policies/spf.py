"""Shortest prompt first: admit the waiting requests with the fewest prompt tokens first.

Short prompts get their first token sooner, so mean TTFT drops under load; long prompts can wait
for as long as shorter ones keep arriving (no aging here: that is the next experiment).
"""

from framework import hookimpl

PLUGIN_KIND = "policy"


@hookimpl
def select_prefill(scheduler, adder):
    queue = scheduler.waiting_queue
    queue.sort(key=lambda req: len(req.origin_input_ids))  # stable: equal lengths keep arrival order
    return adder.admit_waiting(scheduler, list(queue), prefix_computed=False)
