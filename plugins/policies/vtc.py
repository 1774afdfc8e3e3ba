"""Virtual Token Counter fairness (Sheng et al., "Fairness in Serving Large Language Models",
OSDI 2024, Algorithm 2).

Every client (``req.client_id``; requests without one form the client None) has a counter of the
weighted tokens it was served: ``input_weight`` per prompt token computed (a prefix-cache hit costs
nothing, a retracted request's re-prefill counts again) plus ``output_weight`` per output token,
added as batches are served (`on_batch_result`). A client is *backlogged* while it has requests in
the waiting queue.

Admission: the backlogged client with the smallest counter goes first with its oldest request.
One round may admit several requests, so the order is built by simulating the counters: after
picking a request its client's simulated counter grows by the request's prompt cost
(``input_weight`` × its prompt and output so far; cache hits are left out of this estimate, not
of the real charge), and the next pick is again the smallest. Ties go to
the client whose oldest request arrived first.

Counter lift (the paper's rule): when a client becomes backlogged, its counter is raised to the
smallest counter of the clients already backlogged, or, when none is, to the counter of the last
client that was served a prefill; it is never lowered. A client returning from idleness therefore
cannot claim the service it did not ask for.

Fairness bound (the paper's Theorem 4.1, in this module's units): while two clients f and g are
both backlogged, the service they receive over any interval differs by at most

    2 · U,   U = input_weight · L_in + output_weight · M

where L_in is the longest prompt admitted and M is the KV pool's size in tokens (the most output
tokens requests already running can be served before the next admission decision). The test
`tests/test_fairness_policies.py::test_vtc_keeps_two_backlogged_clients_within_the_bound`
checks it after every scheduler round.

Decode OOM: the victims are the running requests of the most-served client first (largest
counter); within a client, the reference's order (fewest output tokens, longest prompt on ties).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pydantic import BaseModel, Field

from framework import hookimpl
from framework.request import StashKey

PLUGIN_KIND = "policy"


class VtcSettings(BaseModel):
    input_weight: float = Field(1.0, gt=0, description="Counter cost of one prompt token computed (the paper's w_p).")
    output_weight: float = Field(2.0, gt=0, description="Counter cost of one output token (the paper's w_q).")


@hookimpl
def register_settings(register):
    register("vtc", VtcSettings)


@dataclass
class VtcState:
    #: Weighted tokens served, by client id.
    counters: dict[str | None, float] = field(default_factory=dict)
    #: Counter of the client last served a prefill (the lift when no client is backlogged).
    last_served: float = 0.0


STATE_KEY: StashKey[VtcState] = StashKey("vtc_state")
#: Output tokens of the request already charged.
CHARGED_OUTPUT_KEY: StashKey[int] = StashKey("vtc_charged_output")


def state_of(view) -> VtcState:
    return view.stash.setdefault(STATE_KEY, VtcState())


def counters(view) -> dict[str | None, float]:
    """The clients' counters (for tests and observers; read them, do not change them)."""
    return state_of(view).counters


@hookimpl
def on_request_received(req, view):
    state = state_of(view)
    client = req.client_id
    others = {r.client_id for r in view.waiting_queue if r is not req}
    if client in others:
        return
    current = state.counters.get(client, 0.0)
    if others:
        lift = min(state.counters.get(c, 0.0) for c in others)
    else:
        lift = state.last_served
    state.counters[client] = max(current, lift)


@hookimpl
def on_batch_result(batch, view):
    if batch.forward_mode.is_idle():
        return
    options = view.settings.plugin_section("vtc")
    state = state_of(view)
    if batch.forward_mode.is_extend():
        decoding = {id(r) for r in batch.decoding_reqs or ()}
        for req, num_tokens in zip(batch.reqs, batch.extend_lens):
            if id(req) not in decoding:
                charge(state, req.client_id, options.input_weight * num_tokens)
                state.last_served = state.counters[req.client_id]
    for req in batch.reqs:
        num_output = len(req.output_ids) - req.num_draft_tokens
        new = num_output - req.stash.get(CHARGED_OUTPUT_KEY, 0)
        if new > 0:
            charge(state, req.client_id, options.output_weight * new)
            req.stash[CHARGED_OUTPUT_KEY] = num_output


def charge(state: VtcState, client: str | None, cost: float) -> None:
    state.counters[client] = state.counters.get(client, 0.0) + cost


@hookimpl
def select_prefill(view):
    options = view.settings.plugin_section("vtc")
    state = state_of(view)
    by_client: dict[str | None, list] = {}
    for req in sorted(view.waiting_queue, key=lambda r: r.arrival_time):
        by_client.setdefault(req.client_id, []).append(req)
    simulated = {c: state.counters.get(c, 0.0) for c in by_client}
    heads = {c: 0 for c in by_client}
    order = []
    while simulated:
        client = min(simulated, key=lambda c: (simulated[c], by_client[c][heads[c]].arrival_time))
        req = by_client[client][heads[client]]
        order.append(req)
        simulated[client] += options.input_weight * (len(req.origin_input_ids) + len(req.output_ids))
        heads[client] += 1
        if heads[client] == len(by_client[client]):
            del simulated[client]
    return order


@hookimpl
def on_decode_oom(batch, view):
    served = state_of(view).counters
    return sorted(batch.reqs,
                  key=lambda r: (-served.get(r.client_id, 0.0), len(r.output_ids), -len(r.origin_input_ids)))
