"""Per-client accounting (an observer: it counts, it decides nothing).

Keeps the scheduler's `ClientLedger` (framework/clients.py) up to date: each prefill pass adds the
prompt tokens it computed (prefix-cache hits cost nothing and are not counted; a chunked prompt
counts chunk by chunk; a retracted request's re-prefill counts again, as it is computed again),
and every output token is counted once, when its batch's result is processed (jump-forward
drafts only once the model kept them). Disable it with ``plugins.disable = ["clients"]``.
"""

from framework import hookimpl
from framework.clients import CLIENT_LEDGER_KEY, ClientLedger
from framework.request import StashKey

PLUGIN_KIND = "observer"

# Output tokens of the request already counted.
COUNTED_OUTPUT_KEY: StashKey[int] = StashKey("clients_counted_output")


def ledger_of(view) -> ClientLedger:
    return view.stash.setdefault(CLIENT_LEDGER_KEY, ClientLedger())


def count_output(ledger: ClientLedger, req) -> None:
    num_output = len(req.output_ids) - req.num_draft_tokens
    new = num_output - req.stash.get(COUNTED_OUTPUT_KEY, 0)
    if new > 0:
        ledger.add(req.client_id, output_tokens=new)
        req.stash[COUNTED_OUTPUT_KEY] = num_output


@hookimpl
def on_request_received(view):
    ledger_of(view)


@hookimpl
def on_batch_result(batch, view):
    if batch.forward_mode.is_idle():
        return
    ledger = ledger_of(view)
    if batch.forward_mode.is_extend():
        # Requests decoding inside this pass (mixed chunks, drafts) compute output tokens, not prompt.
        decoding = {id(r) for r in batch.decoding_reqs or ()}
        for req, num_tokens in zip(batch.reqs, batch.extend_lens):
            if id(req) not in decoding:
                ledger.add(req.client_id, prompt_tokens=num_tokens)
    for req in batch.reqs:
        count_output(ledger, req)


@hookimpl
def on_request_finished(req, view):
    ledger = ledger_of(view)
    count_output(ledger, req)
    if len(ledger.tokens) > ledger.max_tracked:
        waiting, running = view.live_requests()
        ledger.fold_idle({r.client_id for r in waiting + running})
