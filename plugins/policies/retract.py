"""The reference's decode-OOM retraction (section I2), the fallback `on_decode_oom`.

Victims: the request with the fewest output tokens first, the longest prompt on ties. Retract
until the free KV covers `retract_decode_steps` more decode steps of the remaining batch; a batch of
one request is never retracted to nothing. The new token ratio is re-estimated from the remaining
requests. A policy plugin can replace all of this by implementing `on_decode_oom` itself.
"""

from framework import hookimpl

PLUGIN_KIND = "default"
PLUGIN_NAME = "retract"


def retraction_order(reqs):
    """Indices sorted so that popping from the end yields the next victim."""
    return sorted(
        range(len(reqs)),
        key=lambda i: (len(reqs[i].output_ids), -len(reqs[i].origin_input_ids)),
        reverse=True,
    )


@hookimpl(trylast=True)
def on_decode_oom(batch, scheduler):
    steps = scheduler.retract_decode_steps
    kv_pool = scheduler.token_to_kv_pool
    order = retraction_order(batch.reqs)
    seq_lens = batch.seq_lens.tolist()
    retracted = []
    first_iter = True
    while kv_pool.available_size() < len(order) * steps or first_iter:
        if len(order) == 1:
            # The reference asserts here and dies; with one request left we let the decode step
            # try, and the allocator raises a clear out-of-memory error if it truly cannot run.
            break
        first_iter = False
        idx = order.pop()
        req = batch.reqs[idx]
        retracted.append(req)
        scheduler.retract_req(req, seq_lens[idx])
        scheduler.tree_cache.evict(max(0, len(order) * steps - kv_pool.available_size()), kv_pool.free)
    batch.filter_batch(keep_indices=sorted(order))
    remaining = batch.reqs
    total_max_new = sum(r.sampling_params.max_new_tokens for r in remaining)
    num_decoded = sum(len(r.output_ids) for r in remaining)
    new_ratio = min(1.0, (num_decoded + steps * len(remaining)) / max(total_max_new, 1))
    return retracted, new_ratio
