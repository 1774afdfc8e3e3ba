"""Fault injection for the reliability suite: raises inside a hook on request.

An observer, so it is active wherever the test package is installed, and inert unless its
settings section turns it on (``[plugin.faults] enabled = true``). It then raises in hook H
whenever H concerns a request whose prompt text contains ``RAISE-IN:H``.
"""

from pydantic import BaseModel, Field

from framework import hookimpl

PLUGIN_KIND = "observer"
PLUGIN_NAME = "faults"


class FaultSettings(BaseModel):
    enabled: bool = Field(False, description="Raise in hook H for requests whose prompt contains RAISE-IN:H.")


@hookimpl
def register_settings(register):
    register("faults", FaultSettings)


def _maybe_raise(scheduler, hook, reqs):
    if scheduler.settings.plugin_section("faults").enabled:
        if any(f"RAISE-IN:{hook}" in (r.origin_input_text or "") for r in reqs):
            raise RuntimeError(f"injected fault in {hook}")


@hookimpl
def on_request_received(req, scheduler):
    _maybe_raise(scheduler, "on_request_received", [req])


@hookimpl(tryfirst=True)  # before the policy, whose answer would end the call
def select_prefill(scheduler, adder):
    _maybe_raise(scheduler, "select_prefill", scheduler.waiting_queue)


@hookimpl
def prepare_batch(batch, scheduler):
    if batch is not None:
        _maybe_raise(scheduler, "prepare_batch", batch.reqs)
    return batch


@hookimpl
def on_batch_result(batch, result, scheduler):
    _maybe_raise(scheduler, "on_batch_result", batch.reqs)


@hookimpl
def on_request_finished(req, scheduler):
    _maybe_raise(scheduler, "on_request_finished", [req])
