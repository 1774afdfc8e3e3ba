"""Longest output first (reference E2 `lof`): largest max_new_tokens first, stable on ties."""

from framework import hookimpl

PLUGIN_KIND = "policy"
PLUGIN_NAME = "lof"


@hookimpl
def select_prefill(scheduler, adder):
    queue = scheduler.waiting_queue
    queue.sort(key=lambda r: -r.sampling_params.max_new_tokens)
    return adder.admit_waiting(scheduler, list(queue), prefix_computed=False)
