"""Longest output first (reference E2 `lof`): largest max_new_tokens first, stable on ties."""

from framework import hookimpl

PLUGIN_KIND = "policy"


@hookimpl
def select_prefill(view):
    return sorted(view.waiting_queue, key=lambda r: -r.sampling_params.max_new_tokens)
