"""Fault injection for the reliability suite: raises inside a hook on request.

A `default` plugin (stacked, so it is active wherever the test package is installed; the kind that
may implement ``prepare_batch`` besides the hooks every kind may), inert unless its settings section
turns it on (``[plugin.faults] enabled = true``). It then raises in hook H whenever H concerns a
request whose prompt text contains ``RAISE-IN:H``. ``select_prefill`` and ``on_decode_oom`` are
policy hooks, out of a stacked plugin's reach: tests/reliability/test_plugin_faults.py covers them
in process with a plugin object of no kind.
"""

from pydantic import BaseModel, Field

from framework import hookimpl

PLUGIN_KIND = "default"


class FaultSettings(BaseModel):
    enabled: bool = Field(False, description="Raise in hook H for requests whose prompt contains RAISE-IN:H.")


@hookimpl
def register_settings(register):
    register("faults", FaultSettings)


def _maybe_raise(view, hook, reqs):
    if view.settings.plugin_section("faults").enabled:
        if any(f"RAISE-IN:{hook}" in (r.origin_input_text or "") for r in reqs):
            raise RuntimeError(f"injected fault in {hook}")


@hookimpl
def on_request_received(req, view):
    _maybe_raise(view, "on_request_received", [req])


@hookimpl
def prepare_batch(batch, view):
    # Returns None: it only inspects the batch, the core's default returns it.
    if batch is not None:
        _maybe_raise(view, "prepare_batch", batch.reqs)


@hookimpl
def on_batch_result(batch, result, view):
    _maybe_raise(view, "on_batch_result", batch.reqs)


@hookimpl
def on_request_finished(req, view):
    _maybe_raise(view, "on_request_finished", [req])
