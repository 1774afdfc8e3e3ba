"""Data-parallel attention (reference L2): the ranks' batches line up for the MLP collectives.

With ``parallel.enable_dp_attention`` every rank schedules its own requests (own input socket, own
KV pool) while the MLP is tensor-parallel over all ranks' tokens. So every pass is collective: each
iteration the ranks all-gather their token counts, and a rank with nothing to run while another
has tokens runs an IDLE batch (a forward pass with no tokens that still joins the MLP's
all-gathers and all-reduces). The model reads the counts from `global_num_tokens` to pad and slice.

A default plugin: active always, a no-op unless DP attention is on. The rest of DP attention is in
the model (framework/model/llama.py) and the scheduler process's event loop.
"""

from __future__ import annotations

import logging

from framework import hookimpl
from framework.batch import ScheduleBatch
from framework.distributed import get_parallel_context
from framework.request import StashKey

PLUGIN_KIND = "default"

logger = logging.getLogger(__name__)

#: IDLE batches this rank ran since it last had work of its own (logged when the streak ends).
IDLE_STREAK: StashKey[int] = StashKey("dp_attention_idle_streak")
#: IDLE batches this rank ran in all.
NUM_IDLE_BATCHES: StashKey[int] = StashKey("dp_attention_num_idle_batches")


def num_tokens_of(batch: ScheduleBatch | None) -> int:
    """Tokens this rank computes in the pass: the rows it contributes to the MLP."""
    if batch is None or batch.input_ids is None:
        return 0
    return int(batch.input_ids.shape[0])


@hookimpl(wrapper=True)
def prepare_batch(view):
    # A wrapper: the batch the scheduler built (or None) comes from the other implementations.
    batch = yield
    if not view.settings.parallel.enable_dp_attention:
        return batch
    global_num_tokens = get_parallel_context().all_gather_int(num_tokens_of(batch))
    if batch is None and max(global_num_tokens) > 0:
        batch = view.idle_batch()
    if batch is not None:
        batch.global_num_tokens = global_num_tokens
    note_idle(view, batch)
    return batch


def note_idle(view, batch: ScheduleBatch | None) -> None:
    stash = view.stash
    streak = stash.get(IDLE_STREAK, 0)
    if batch is not None and batch.forward_mode.is_idle():
        stash[IDLE_STREAK] = streak + 1
        stash[NUM_IDLE_BATCHES] = stash.get(NUM_IDLE_BATCHES, 0) + 1
    elif streak:
        stash[IDLE_STREAK] = 0
        logger.info(
            "DP attention rank %d: ran %d IDLE batches while other ranks were busy (total %d)",
            view.tp_rank, streak, stash[NUM_IDLE_BATCHES],
        )
