"""Per-client accounting: tokens served to each client and its requests waiting and running.

The `clients` observer plugin (plugins/observers/clients.py) keeps a `ClientLedger` in the
scheduler's stash and adds tokens as batches are served; `client_stats` reads it, with the live
queue counts, into `SchedulerStats.clients` for /metrics and /get_server_info. Policies may read
the ledger too (``scheduler.stash.get(CLIENT_LEDGER_KEY)``); nothing here decides anything.

Label cardinality is bounded: the `metrics.max_client_labels` clients with the most served tokens
keep their own label, the others are summed as "other", and requests without a client id are
"anonymous". A client whose id is one of those two names is counted in that series.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Iterable

from framework.messages import ClientStats
from framework.request import StashKey

if TYPE_CHECKING:
    from framework.request import Req
    from framework.scheduler import Scheduler

ANONYMOUS = "anonymous"
OTHER = "other"
# Idle clients beyond this many are folded into "other" so that a stream of new client ids cannot
# grow the ledger without bound (folding keeps the busiest ones).
MAX_TRACKED_CLIENTS = 10_000


@dataclass
class ClientTokens:
    prompt_tokens: int = 0
    output_tokens: int = 0

    @property
    def served_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


class ClientLedger:
    """Tokens served per client id (None: anonymous), counted as they are computed."""

    def __init__(self, max_tracked: int = MAX_TRACKED_CLIENTS):
        self.max_tracked = max_tracked
        self.tokens: dict[str | None, ClientTokens] = {}
        # What folded clients were served (they are counted as "other").
        self.folded = ClientTokens()

    def add(self, client_id: str | None, prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        entry = self.tokens.get(client_id)
        if entry is None:
            entry = self.tokens[client_id] = ClientTokens()
        entry.prompt_tokens += prompt_tokens
        entry.output_tokens += output_tokens

    def fold_idle(self, active: set[str | None]) -> None:
        """Past `max_tracked` clients, fold idle ones into "other", least served first, down to
        half the limit (so folding is rare)."""
        if len(self.tokens) <= self.max_tracked:
            return
        idle = sorted((c for c in self.tokens if c not in active), key=lambda c: self.tokens[c].served_tokens)
        for client in idle[: len(self.tokens) - self.max_tracked // 2]:
            entry = self.tokens.pop(client)
            self.folded.prompt_tokens += entry.prompt_tokens
            self.folded.output_tokens += entry.output_tokens


CLIENT_LEDGER_KEY: StashKey[ClientLedger] = StashKey("client_ledger")


def label_of(client_id: str | None) -> str:
    return ANONYMOUS if client_id is None else client_id


def client_stats(scheduler: "Scheduler", max_labels: int) -> dict[str, ClientStats]:
    """The scheduler's per-client stats, bounded to `max_labels` named clients; empty when the
    ledger is not kept (the `clients` observer disabled)."""
    ledger = scheduler.stash.get(CLIENT_LEDGER_KEY)
    if ledger is None:
        return {}
    stats: dict[str, ClientStats] = {}

    def entry(label: str) -> ClientStats:
        return stats.setdefault(label, ClientStats())

    for client_id, tokens in ledger.tokens.items():
        _add_tokens(entry(label_of(client_id)), tokens.prompt_tokens, tokens.output_tokens)
    if ledger.folded.served_tokens:
        _add_tokens(entry(OTHER), ledger.folded.prompt_tokens, ledger.folded.output_tokens)
    waiting, running = scheduler.live_requests()
    for req in waiting:
        entry(label_of(req.client_id)).num_waiting_reqs += 1
    for req in running:
        entry(label_of(req.client_id)).num_running_reqs += 1
    return bound_clients(stats, max_labels)


def _add_tokens(stats: ClientStats, prompt_tokens: int, output_tokens: int) -> None:
    stats.prompt_tokens += prompt_tokens
    stats.output_tokens += output_tokens
    stats.served_tokens += prompt_tokens + output_tokens


def add_stats(total: ClientStats, part: ClientStats) -> None:
    for f in fields(ClientStats):
        setattr(total, f.name, getattr(total, f.name) + getattr(part, f.name))


def bound_clients(stats: dict[str, ClientStats], max_labels: int) -> dict[str, ClientStats]:
    """At most `max_labels` named clients (the most served tokens first, then by name), plus
    "anonymous" and "other", which sums the rest. Ordered as listed."""
    named = sorted((c for c in stats if c not in (ANONYMOUS, OTHER)), key=lambda c: (-stats[c].served_tokens, c))
    result = {c: stats[c] for c in named[:max_labels]}
    if ANONYMOUS in stats:
        result[ANONYMOUS] = stats[ANONYMOUS]
    rest = [stats[c] for c in named[max_labels:]] + ([stats[OTHER]] if OTHER in stats else [])
    if rest:
        other = result[OTHER] = ClientStats()
        for part in rest:
            add_stats(other, part)
    return result


def merge_clients(parts: Iterable[dict[str, ClientStats]]) -> dict[str, ClientStats]:
    """Several schedulers' per-client stats summed by label (data-parallel replicas); bound the
    result again with `bound_clients`."""
    merged: dict[str, ClientStats] = {}
    for part in parts:
        for label, stats in part.items():
            add_stats(merged.setdefault(label, ClientStats()), stats)
    return merged
