"""The core's fallback hook implementations (`trylast`): what happens when no plugin decides.

Registered by the plugin manager under the name ``core-defaults``; any plugin allowed the hook
overrides them by returning something other than None.
"""

from __future__ import annotations

from framework import hookimpl

PLUGIN_KIND = "core"


@hookimpl(trylast=True)
def on_decode_oom(batch):
    """The reference's retraction order (section I2): the request with the fewest output tokens
    first, the longest prompt on ties. The core retracts from the front until the KV suffices."""
    # Sorted descending and read from the end, as the reference pops it: on an exact tie the
    # request later in the batch goes first.
    order = sorted(batch.reqs, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)), reverse=True)
    return order[::-1]


@hookimpl(trylast=True)
def prepare_batch(batch):
    """The batch the scheduler built, unchanged (None stays None)."""
    return batch
