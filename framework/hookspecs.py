"""Every batchyard hook, grouped by phase. This module is the contract between the core and plugins.

Plugins implement hooks with `from framework import hookimpl`. The core calls them only through
`framework.plugins.Hooks`, always with keyword arguments.

Exactly one *policy*, one *cache* and one *worker* plugin are active at a time, chosen by name in
the `[plugins]` settings section; the others are blocked before they can register. *Observer*
plugins (metrics, tracing, fairness counters, ...) stack: every installed observer is active unless
listed in `plugins.disable`. Each kind may implement only the hooks listed for it in `KIND_HOOKS`;
a plugin implementing another kind's hook is a start-up error.

Plugin contract v1: the core owns every change to queues, pools and the cache. Hooks get read-only
views (`framework.views`) and return their decisions; the core applies them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from framework import hookspec

if TYPE_CHECKING:
    from framework.batch import ScheduleBatch
    from framework.budget import AdderView
    from framework.cache import BasePrefixCache
    from framework.config import Settings
    from framework.memory import ReqToTokenPool, TokenToKVPool
    from framework.request import Req
    from framework.views import BatchView, SchedulerView
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
    :return: nothing. A section registered by two plugins is a start-up error naming both.

    Any plugin kind may implement it.
    """


@hookspec(firstresult=True)
def create_worker(settings: "Settings", tp_rank: int) -> "Worker":
    """Build the model worker: it owns the model, the KV pools and the forward pass.

    Called once at scheduler start-up. Stops at first non-None result.

    :param settings: the validated settings tree.
    :param tp_rank: this scheduler process's tensor-parallel rank (0 when not parallel).
    :return: an object implementing `framework.worker.Worker`; the scheduler runs every batch on it.
        Anything else (None, an object lacking one of its members) is a start-up error naming the plugin.

    Implemented by worker plugins only (`tp`, `overlap`, `framework.testing.FakeWorkerPlugin`).
    """


@hookspec(firstresult=True)
def create_cache(
    settings: "Settings",
    req_to_token_pool: "ReqToTokenPool",
    token_to_kv_pool: "TokenToKVPool",
) -> "BasePrefixCache":
    """Build the prefix cache over the worker's pools.

    Called once at start-up, after `create_worker`. Stops at first non-None result.

    :param settings: the validated settings tree.
    :param req_to_token_pool: the worker's request-slot pool.
    :param token_to_kv_pool: the worker's KV pool.
    :return: a `framework.cache.BasePrefixCache`; the core alone calls its mutating verbs. Anything
        else (None included) is a start-up error naming the plugin.

    Implemented by cache plugins only (`radix`, `chunk`).
    """


# ---------------------------------------------------------------------------------------------
# Admission


@hookspec
def on_request_received(req: "Req", view: "SchedulerView") -> None:
    """A request entered the waiting queue (after validation and clamping of max_new_tokens).

    :param req: the request. A plugin may keep state of its own in ``req.stash`` (e.g. a fairness
        plugin's client id); everything else on it is the core's.
    :param view: read-only view of the scheduler.
    :return: ignored (broadcast to every active plugin).

    Any plugin kind may implement it.
    """


# ---------------------------------------------------------------------------------------------
# Scheduling


@hookspec(firstresult=True)
def select_prefill(view: "SchedulerView", adder: "AdderView") -> "list[Req] | None":
    """Choose, in order, the waiting requests to admit into the next prefill batch.

    Called when the scheduler may start a prefill: the waiting queue is not empty, the running
    batch is below `max_running_requests`, and a continuing chunked request (if any) already took
    its share of the budget. Stops at first non-None result.

    :param view: read-only view: ``view.waiting_queue`` (a tuple in queue order: the order returned
        last round, then new arrivals and retracted requests), running counts,
        ``view.match_prefix(req)`` (does not change the request), settings, ``view.stash``.
    :param adder: read-only view of this round's token budgets (`framework.budget.AdderView`).
    :return: the requests to admit, in order, each from ``view.waiting_queue`` at most once (any
        iterable of them); or None to admit nothing. Anything else is refused like an exception
        (`framework.plugins.PluginReturnError`): the waiting requests fail. The core runs the reference's admission loop over them (running-
        request cap, LoRA cap, the four token budgets; prefixes matched through ``view`` are
        reused), locks their prefixes and removes the admitted ones from the waiting queue. The
        returned order becomes the queue's order; requests left out stay behind them.

    Implemented by policy plugins only (`lpm`, `fcfs`, `dfs-weight`, `lof`, `random`, ...); every
    policy must implement it (there is no core fallback: a policy without it is refused at start-up).
    """


@hookspec(firstresult=True)
def on_decode_oom(batch: "BatchView", view: "SchedulerView") -> "list[Req] | tuple[list[Req], float] | None":
    """The next decode step would run out of KV slots: choose the requests to retract.

    Called from the decode scheduling step when the running batch's next step does not fit in the
    KV pool (or when ``scheduler.force_retract`` is set and the batch has more than 10 requests).
    Stops at first non-None result.

    :param batch: read-only view of the running batch (``batch.reqs``, ``batch.seq_lens``).
    :param view: read-only view of the scheduler (``view.retract_decode_steps``,
        ``view.num_free_kv_tokens``).
    :return: the victims in retraction order, optionally with a new token ratio:
        ``victims`` (distinct requests of ``batch.reqs``, any sequence: ``batch.reqs`` itself is
        a tuple of victims) or ``(victims, new_token_ratio)`` (a pair whose second item is a number
        in [0, 1] or None, or whose first is a list or tuple). Anything else is refused like an exception
        (`framework.plugins.PluginReturnError`): the batch's requests fail. The core retracts from the front of the
        list while the free KV does not cover ``retract_decode_steps`` more decode steps of the
        rest of the batch (at least one victim, never the batch's last request), evicting cache
        entries as it goes, then filters the batch; retracted requests go to the tail of the
        waiting queue and are re-prefilled with their output so far. Without a ratio the core
        estimates it from the remaining requests (reference I3). An empty list retracts nothing,
        which only a ``force_retract`` call can afford: victims that leave the next decode step
        without a KV slot per remaining request are refused as above once retracted.

    Implemented by policy plugins; the core's `trylast` default (`framework.defaults`) returns
    the reference's order: fewest output tokens first, longest prompt on ties.
    """


@hookspec(firstresult=True)
def prepare_batch(batch: "ScheduleBatch | None", view: "SchedulerView") -> "ScheduleBatch | None":
    """Last look at the batch chosen for this iteration, before it runs.

    Called every iteration, with None when the scheduler has nothing to run. Stops at first
    non-None result; the core's `trylast` default returns ``batch`` unchanged, so an ordinary
    implementation that returns None only inspects it. A ``wrapper=True`` implementation gets the
    result of the others from its ``yield`` and returns the batch to run: it may replace None by an
    IDLE batch (``view.idle_batch()``; DP attention does, so the ranks' collectives line up).

    :param batch: the batch to run (the core's own object: set worker-facing fields only, such as
        ``global_num_tokens``), or None.
    :param view: read-only view of the scheduler.
    :return: the batch to run, or None for none. Replacing a batch the scheduler built (its KV
        slots are already allocated), or answering anything but None or an IDLE batch where
        ``batch`` was None, is refused like an exception (`framework.plugins.PluginReturnError`):
        the built batch runs and its requests fail.

    Implemented by worker plugins and the stacked `default` plugins (`dp-attention`).
    """


# ---------------------------------------------------------------------------------------------
# Results


@hookspec
def on_batch_result(batch: "BatchView", result: "BatchResult", view: "SchedulerView") -> None:
    """A batch's result was processed: tokens appended, finished requests released.

    :param batch: read-only view of the batch as it ran (``batch.forward_mode`` tells prefill,
        decode and mixed passes apart).
    :param result: the worker's `BatchResult` (next token ids, logprobs); read it only.
    :param view: read-only view of the scheduler.
    :return: ignored (broadcast). For metrics, fairness counters, tracing.

    Any plugin kind may implement it.
    """


@hookspec
def on_request_finished(req: "Req", view: "SchedulerView") -> None:
    """A request finished (stop token or string, length, or abort) and its KV was released.

    :param req: the request; ``req.finished_reason`` says why.
    :param view: read-only view of the scheduler.
    :return: ignored (broadcast).

    Any plugin kind may implement it.
    """


@hookspec
def on_idle(view: "SchedulerView") -> None:
    """An iteration had nothing to run.

    Called after the scheduler's own idle work (leak check, new-token-ratio reset).

    :param view: read-only view of the scheduler.
    :return: ignored (broadcast).

    Any plugin kind may implement it.
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

#: Hooks every kind may implement.
OBSERVER_HOOKS = ("register_settings", "on_request_received", "on_batch_result", "on_request_finished", "on_idle")

#: The hooks each plugin kind may implement (checked at start-up).
KIND_HOOKS: dict[str, tuple[str, ...]] = {
    "policy": OBSERVER_HOOKS + ("select_prefill", "on_decode_oom"),
    "cache": OBSERVER_HOOKS + ("create_cache",),
    "worker": OBSERVER_HOOKS + ("create_worker", "prepare_batch"),
    "observer": OBSERVER_HOOKS,
    "default": OBSERVER_HOOKS + ("prepare_batch",),
}

__all__ = ["ALL_HOOKS", "KIND_HOOKS", "OBSERVER_HOOKS"]
