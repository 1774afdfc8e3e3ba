"""Prometheus collectors (reference S3, S4), served by the main process at /metrics.

All metrics live in the main process, in a registry of their own (no global state, so tests can
build several). Request metrics are observed by the TokenizerManager as outputs arrive; the
scheduler gauges are refreshed from a `SchedulerStats` snapshot taken at scrape time, so they show
the state at that moment rather than at the last decode log.

Metric names follow the reference with a ``batchyard:`` prefix; every series has a ``model_name``
label. The per-client series (``client_*``) come from the same snapshot, with a ``client`` label
bounded by `metrics.max_client_labels` (framework/clients.py).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from framework.messages import ClientStats, SchedulerStats

# Buckets in seconds, from the reference's collector.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 15.0, 20.0, 25.0, 30.0)
ITL_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 40, 60, 80, 100, 150, 200, 250, 300, 350, 500, 1000)

PREFIX = "batchyard:"


class ServerMetrics:
    """The collectors of one server; `render()` gives the text exposition format."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.clients = ClientCollector(model_name)
        self.registry.register(self.clients)
        self.labels = {"model_name": model_name}
        names = ("model_name",)
        reg = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, names, registry=reg)

        self.num_running_reqs = gauge("num_running_reqs", "Requests in the running batch.")
        self.num_used_tokens = gauge("num_used_tokens", "KV slots in use (not free, not evictable).")
        self.token_usage = gauge("token_usage", "Fraction of the KV pool in use.")
        self.gen_throughput = gauge("gen_throughput", "Generation throughput (token/s) since the last decode log.")
        self.num_queue_reqs = gauge("num_queue_reqs", "Requests waiting to be scheduled.")
        self.cache_hit_rate = gauge("cache_hit_rate", "Prefix cache hit rate (cumulative).")
        self.kv_available = gauge("kv_available_tokens", "Free KV slots.")
        self.kv_evictable = gauge("kv_evictable_tokens", "KV slots held only by the prefix cache.")
        self.req_slots_free = gauge("req_slots_free", "Free request slots.")
        self.num_sessions = gauge("num_sessions", "Open sessions.")
        self.num_grammar_queue_reqs = gauge("num_grammar_queue_reqs", "Requests whose grammar is still compiling.")
        self.max_total_num_tokens = gauge("max_total_num_tokens", "KV slots in all (the pool's size).")
        self.req_slots_total = gauge("req_slots_total", "Request slots in all.")
        # Set by the HTTP server at scrape time: with the gauges above, the idle state is visible
        # from outside (no request anywhere, every KV and request slot free or cached).
        self.num_inflight_requests = gauge(
            "num_inflight_requests", "Requests the HTTP server is waiting on (sent, not yet answered)."
        )

        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", names, registry=reg)
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Generated tokens of finished requests.", names, registry=reg
        )
        self.num_requests = Counter(
            PREFIX + "num_requests", "Finished requests by finish reason.", names + ("finish_reason",), registry=reg
        )
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time from arrival to the first output token.",
            names, buckets=TTFT_BUCKETS, registry=reg,
        )
        self.inter_token_latency = Histogram(
            PREFIX + "inter_token_latency_seconds", "Time between two output tokens of a streamed request.",
            names, buckets=ITL_BUCKETS, registry=reg,
        )
        self.e2e_request_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Time from arrival to the last output.",
            names, buckets=E2E_BUCKETS, registry=reg,
        )

    # -- request metrics (TokenizerManager) -------------------------------------------------------

    def observe_first_token(self, seconds: float) -> None:
        self.time_to_first_token.labels(**self.labels).observe(seconds)

    def observe_inter_token(self, seconds_per_token: float, num_tokens: int) -> None:
        # One observation per token, so a coalesced chunk of k tokens weighs k.
        hist = self.inter_token_latency.labels(**self.labels)
        for _ in range(num_tokens):
            hist.observe(seconds_per_token)

    def observe_finished(self, prompt_tokens: int, completion_tokens: int, e2e_seconds: float,
                         finish_reason: str) -> None:
        self.prompt_tokens.labels(**self.labels).inc(prompt_tokens)
        self.generation_tokens.labels(**self.labels).inc(completion_tokens)
        self.num_requests.labels(finish_reason=finish_reason, **self.labels).inc()
        self.e2e_request_latency.labels(**self.labels).observe(e2e_seconds)

    # -- scheduler gauges -------------------------------------------------------------------------

    def set_scheduler_stats(self, stats: SchedulerStats) -> None:
        lb = self.labels
        self.num_running_reqs.labels(**lb).set(stats.num_running_reqs)
        self.num_used_tokens.labels(**lb).set(stats.num_used_tokens)
        self.token_usage.labels(**lb).set(stats.token_usage)
        self.gen_throughput.labels(**lb).set(stats.gen_throughput)
        self.num_queue_reqs.labels(**lb).set(stats.num_queue_reqs)
        self.cache_hit_rate.labels(**lb).set(stats.cache_hit_rate)
        self.kv_available.labels(**lb).set(stats.kv_available)
        self.kv_evictable.labels(**lb).set(stats.kv_evictable)
        self.req_slots_free.labels(**lb).set(stats.req_slots_free)
        self.num_sessions.labels(**lb).set(stats.num_sessions)
        self.num_grammar_queue_reqs.labels(**lb).set(stats.num_grammar_queue_reqs)
        self.max_total_num_tokens.labels(**lb).set(stats.max_total_num_tokens)
        self.req_slots_total.labels(**lb).set(stats.req_slots_total)
        self.clients.snapshot = dict(stats.clients)

    def set_inflight_requests(self, num: int) -> None:
        self.num_inflight_requests.labels(**self.labels).set(num)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ClientCollector:
    """The per-client series of the latest scheduler snapshot (already bounded, so the label set
    is small). A client that leaves the top N moves its tokens to "other"."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.snapshot: dict[str, ClientStats] = {}

    def collect(self):
        labels = ("model_name", "client")
        served = CounterMetricFamily(
            PREFIX + "client_served_tokens", "Tokens served per client: prompt tokens computed plus output tokens.",
            labels=labels,
        )
        waiting = GaugeMetricFamily(PREFIX + "client_num_waiting_reqs", "Waiting requests per client.", labels=labels)
        running = GaugeMetricFamily(PREFIX + "client_num_running_reqs", "Running requests per client.", labels=labels)
        for client, stats in self.snapshot.items():
            served.add_metric((self.model_name, client), stats.served_tokens)
            waiting.add_metric((self.model_name, client), stats.num_waiting_reqs)
            running.add_metric((self.model_name, client), stats.num_running_reqs)
        return [served, waiting, running]
