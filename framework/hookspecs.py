"""Every batchyard hook, grouped by phase. This module is the contract between the core and plugins.

Plugins implement hooks with `from framework import hookimpl`. The core calls them only through
`framework.plugins.Hooks`, always with keyword arguments.

Exactly one *policy*, one *cache* and one *worker* plugin are active at a time, chosen by name in
the `[plugins]` settings section; the others are blocked before they can register. *Observer*
plugins (metrics, tracing, fairness counters, ...) stack: every installed observer is active unless
listed in `plugins.disable`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from framework import hookspec

if TYPE_CHECKING:
    from framework.batch import ScheduleBatch
    from framework.budget import PrefillAdder
    from framework.cache import BasePrefixCache
    from framework.config import Settings
    from framework.memory import ReqToTokenPool, TokenToKVPool
    from framework.request import Req
    from framework.scheduler import Scheduler
    from framework.worker import BatchResult, Worker


# ---------------------------------------------------------------------------------------------
# Startup


@hookspec
def register_settings(register: Callable[[str, type], None]) -> None:
    """Declare this plugin's own settings section.

    Called once at start-up, before any other hook, for every active plugin.

    :param register: ``register(section_name, pydantic_model_class)``. The section's values are
        read from ``[plugin.<section_name>]`` in the TOML file (or env
        ``BATCHYARD_PLUGIN__<SECTION>__<FIELD>``) and validated with the model; the instance is then
        available as ``settings.plugin_section(section_name)``.

    Implemented by any plugin that has options.
    """


@hookspec(firstresult=True)
def create_worker(settings: "Settings", tp_rank: int) -> "Worker":
    """Build the model worker: it owns the model, the KV pools and the forward pass.

    Called once at scheduler start-up. Stops at first non-None result.

    :param settings: the validated settings tree.
    :param tp_rank: this scheduler process's tensor-parallel rank (0 when not parallel).
    :return: an object implementing `framework.worker.Worker`.

    Implemented by the active worker plugin (`tp`, `overlap`, `dp_attention`, `sim`).
    """


@hookspec(firstresult=True)
def create_cache(
    settings: "Settings",
    req_to_token_pool: "ReqToTokenPool",
    token_to_kv_pool: "TokenToKVPool",
) -> "BasePrefixCache":
    """Build the prefix cache over the worker's pools.

    Called once at start-up, after `create_worker`. Stops at first non-None result.

    :return: a `framework.cache.BasePrefixCache`.

    Implemented by the active cache plugin (`radix`, `chunk`).
    """


# ---------------------------------------------------------------------------------------------
# Admission


@hookspec
def on_request_received(req: "Req", scheduler: "Scheduler") -> None:
    """A request entered the waiting queue (after validation and clamping of max_new_tokens).

    Broadcast to every active plugin; return values are ignored. A plugin may set fields of its own
    in ``req.stash`` here (e.g. a fairness plugin's client id).
    """


# ---------------------------------------------------------------------------------------------
# Scheduling


@hookspec(firstresult=True)
def select_prefill(scheduler: "Scheduler", adder: "PrefillAdder") -> "list[Req] | None":
    """Choose the requests of the next prefill batch.

    Called when the scheduler may start a prefill: the waiting queue is not empty, the running
    batch is below `max_running_requests`, and a continuing chunked request (if any) was already
    added to `adder`. The policy orders ``scheduler.waiting_queue`` and admits requests through the
    budget, usually with ``adder.admit_waiting(scheduler, ordered, prefix_computed)``, which applies
    the reference's admission loop. Stops at first non-None result.

    :param adder: the `PrefillAdder` holding this round's token budgets.
    :return: the newly admitted requests (``adder.can_run_list``), or None to admit nothing.
        The scheduler removes admitted requests from the waiting queue.

    Implemented by the active policy plugin (`lpm`, `fcfs`, `dfs-weight`, `lof`, `random`).
    """


@hookspec(firstresult=True)
def on_decode_oom(batch: "ScheduleBatch", scheduler: "Scheduler") -> "tuple[list[Req], float] | None":
    """The next decode step would run out of KV slots: retract requests.

    Called from the decode scheduling step when `batch.check_decode_mem()` fails (or when
    `scheduler.force_retract` is set and the batch has more than 10 requests). The implementation
    picks victims, releases them with ``scheduler.retract_req(req)``, removes them from `batch`
    (``batch.filter_batch(keep_indices=...)``) and estimates a new token ratio. Stops at first
    non-None result.

    :return: ``(retracted_requests, new_token_ratio)``. The retracted requests are appended to the
        waiting queue and later re-prefilled with their output so far.

    The bundled `retract` plugin implements the reference's order (fewest output tokens first,
    longest prompt on ties) as a fallback (`trylast`); a policy may implement its own.
    """


@hookspec
def prepare_batch(batch: "ScheduleBatch | None", scheduler: "Scheduler") -> "ScheduleBatch | None":
    """Last look at the batch chosen for this iteration, before it runs.

    Chained: each implementation receives the previous one's return value (None means "no batch")
    and returns the batch to run. It may replace None by an IDLE batch (DP attention does, so the
    ranks' collectives line up) but must not drop a batch the scheduler built: its KV slots are
    already allocated. An implementation returning the batch unchanged is a no-op.

    Implemented by the DP-attention worker; observers may inspect it.
    """


# ---------------------------------------------------------------------------------------------
# Results


@hookspec
def on_batch_result(batch: "ScheduleBatch", result: "BatchResult", scheduler: "Scheduler") -> None:
    """A batch's result was processed: tokens appended, finished requests released.

    Broadcast; return values are ignored. For metrics, fairness counters, tracing.

    :param batch: the batch as it ran (its ``forward_mode`` tells prefill from decode).
    :param result: the worker's `BatchResult` (next token ids, logprobs).
    """


@hookspec
def on_request_finished(req: "Req", scheduler: "Scheduler") -> None:
    """A request finished (stop token or string, length, or abort) and its KV was released.

    Broadcast; return values are ignored. ``req.finished_reason`` says why.
    """


@hookspec
def on_idle(scheduler: "Scheduler") -> None:
    """An iteration had nothing to run.

    Broadcast; called after the scheduler's own idle work (leak check, new-token-ratio reset).
    """


ALL_HOOKS = (
    "register_settings",
    "create_worker",
    "create_cache",
    "on_request_received",
    "select_prefill",
    "on_decode_oom",
    "prepare_batch",
    "on_batch_result",
    "on_request_finished",
    "on_idle",
)

__all__ = ["ALL_HOOKS"]
