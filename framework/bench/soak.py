"""`batchyard bench soak`: a bounded soak run against a server this tool starts (issue 18, item 7).

Requests arrive at a steady Poisson rate for `--duration` seconds: ShareGPT prompts (mixed
lengths) with outputs capped at `--max-output-len`, a share of them streamed and cut after a few
chunks (client aborts), a share constrained by a regex or a JSON schema. Every `--window` seconds
the tool records the window's throughput and the RSS of every server process. At the end it waits
for the idle state and checks it from outside (no request anywhere, every KV and request slot
free or cached) and reports: throughput per window and its spread, RSS growth per process, leaks,
failures. Exit status 0 when there were no failures and no leak.

The server binds 127.0.0.1 on a free port and is stopped (SIGTERM, then SIGKILL of its process
group) whatever happens.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field

import httpx

from framework.server.local import LocalServer

logger = logging.getLogger(__name__)

REGEXES = [r"(yes|no), because [a-z ]{5,20}\.", r"[0-9]{3}-[0-9]{4}", r"(red|green|blue)( and (red|green|blue))?"]
SCHEMA = json.dumps({"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                     "age": {"type": "integer"}},
                     "required": ["name", "age"], "additionalProperties": False})
START_TIMEOUT_S = 180.0
IDLE_TIMEOUT_S = 30.0


@dataclass
class Window:
    start: float
    end: float | None = None  # (the next window's start; the last one's, the run's end after its drain)
    completed: int = 0
    aborted: int = 0
    failed: int = 0
    output_tokens: int = 0
    rss_mib: dict[str, float] = field(default_factory=dict)


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def idle_problems(info: dict) -> list[str]:
    """What keeps a /get_server_info snapshot from being the idle state (empty: idle)."""
    s = info["scheduler_stats"]
    found = []
    if info["num_inflight_requests"]:
        found.append(f"{info['num_inflight_requests']} requests in flight in the HTTP server")
    if s["num_running_reqs"] or s["num_queue_reqs"] or s.get("num_grammar_queue_reqs"):
        found.append(f"running={s['num_running_reqs']} queued={s['num_queue_reqs']}")
    if s["kv_available"] + s["kv_evictable"] != s["max_total_num_tokens"]:
        found.append(f"KV free or cached {s['kv_available'] + s['kv_evictable']} of {s['max_total_num_tokens']}")
    if s["req_slots_free"] != s["req_slots_total"]:
        found.append(f"request slots free {s['req_slots_free']} of {s['req_slots_total']}")
    return found


class Soak:
    def __init__(self, args, prompts: list, url: str, pids: dict[str, int]):
        self.args = args
        self.prompts = prompts
        self.url = url
        self.pids = pids
        self.rng = random.Random(args.seed)
        self.windows: list[Window] = []
        self.errors: list[str] = []

    def _window(self) -> Window:
        return self.windows[-1]

    async def one(self, client: httpx.AsyncClient, i: int) -> None:
        req = self.prompts[i % len(self.prompts)]
        params = {"max_new_tokens": max(1, min(req.output_len, self.args.max_output_len)), "ignore_eos": True}
        roll = self.rng.random()
        cut = roll < self.args.abort_fraction
        if not cut and roll < self.args.abort_fraction + self.args.grammar_fraction:
            params.pop("ignore_eos")  # a grammar ends its request when it completes
            params.update({"json_schema": SCHEMA} if self.rng.random() < 0.5 else {"regex": self.rng.choice(REGEXES)})
        body = {"text": req.prompt, "sampling_params": params, "stream": cut}
        try:
            if cut:
                async with client.stream("POST", "/generate", json=body) as resp:
                    chunks = 0
                    async for line in resp.aiter_lines():
                        chunks += line.startswith("data: ")
                        if chunks >= 2:
                            break
                self._window().aborted += 1
                return
            resp = await client.post("/generate", json=body)
            if resp.status_code != 200:
                raise RuntimeError(f"status {resp.status_code}: {resp.text[:200]}")
            out = resp.json()
            reason = out["meta_info"]["finish_reason"]["type"]
            if reason == "abort":
                raise RuntimeError(f"aborted by the server: {out['meta_info']['finish_reason']}")
            self._window().completed += 1
            self._window().output_tokens += len(out["output_ids"])
        except Exception as exc:  # counted and reported; the soak goes on
            self._window().failed += 1
            if len(self.errors) < 20:
                self.errors.append(f"{type(exc).__name__}: {exc}")

    async def run(self) -> None:
        args = self.args
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
        async with httpx.AsyncClient(base_url=self.url, timeout=args.request_timeout, limits=limits) as client:
            start = time.monotonic()
            self.windows.append(Window(start))
            tasks: set[asyncio.Task] = set()
            i = 0
            next_arrival = start
            while time.monotonic() - start < args.duration:
                now = time.monotonic()
                if now - self._window().start >= args.window:
                    self._window().rss_mib = self.rss()
                    self._window().end = now
                    self.windows.append(Window(now))
                if now >= next_arrival:
                    task = asyncio.ensure_future(self.one(client, i))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    i += 1
                    next_arrival += self.rng.expovariate(args.request_rate)
                await asyncio.sleep(max(0.0, min(next_arrival - time.monotonic(), 0.05)))
            if tasks:
                await asyncio.wait(tasks)
            self._window().rss_mib = self.rss()
            self._window().end = time.monotonic()

    def rss(self) -> dict[str, float]:
        return {name: round(rss_mib(pid) or 0.0, 1) for name, pid in self.pids.items()}


def summarize(soak: Soak, idle: list[str], args) -> dict:
    # The last window is cut short by the end of the run; the first warms up.
    full = soak.windows[:-1] if len(soak.windows) > 2 else soak.windows
    # Over each window's own length (a run shorter than two windows: its one, partial, window).
    rates = [w.output_tokens / max((w.end if w.end is not None else w.start + args.window) - w.start, 1e-9)
             for w in full]
    steady = rates[1:] if len(rates) > 2 else rates
    mean = statistics.fmean(steady) if steady else 0.0
    first, last = soak.windows[0].rss_mib, soak.windows[-1].rss_mib
    return {
        "duration_s": args.duration,
        "request_rate": args.request_rate,
        "completed": sum(w.completed for w in soak.windows),
        "aborted_by_client": sum(w.aborted for w in soak.windows),
        "failed": sum(w.failed for w in soak.windows),
        "output_tokens": sum(w.output_tokens for w in soak.windows),
        "throughput_tok_s_by_window": [round(r, 1) for r in rates],
        "throughput_tok_s_mean": round(mean, 1),
        "throughput_cv": round(statistics.pstdev(steady) / mean, 3) if mean else None,
        "rss_mib_by_window": [w.rss_mib for w in soak.windows],
        "rss_growth_mib": {name: round(last.get(name, 0.0) - first.get(name, 0.0), 1) for name in first},
        "idle_problems": idle,
        "errors": soak.errors,
    }


def main(args) -> int:
    from framework.bench.common import load_bench_tokenizer
    from framework.bench.datasets import sample_sharegpt
    from framework.bench.results import ContentionMeter, append_jsonl, bench_args, hardware_info, make_record

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    tokenizer = load_bench_tokenizer(args.tokenizer)
    prompts = sample_sharegpt(tokenizer, args.num_prompts, seed=args.seed, path=args.dataset_path)
    log_path = args.server_log or os.path.join(tempfile.mkdtemp(prefix="batchyard-soak-"), "server.log")
    serve_args = list(args.server_args or [])
    if serve_args[:1] == ["--"]:
        serve_args = serve_args[1:]
    server = LocalServer(["--server.log-level", "warning", *serve_args], log_path)
    try:
        try:
            server.wait_ready(START_TIMEOUT_S)
        except RuntimeError as exc:  # it exited or never answered; its log says why
            logger.error("%s", exc)
            return 2 if server.proc.returncode == 2 else 1  # 2: `batchyard serve` refused its flags
        info = httpx.get(server.url + "/get_server_info", timeout=30).json()
        meter = ContentionMeter()
        soak = Soak(args, prompts, server.url, info["process_ids"])
        asyncio.run(soak.run())
        idle = ["not idle yet"]
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        while idle and time.monotonic() < deadline:
            idle = idle_problems(httpx.get(server.url + "/get_server_info", timeout=30).json())
            time.sleep(0.2)
        summary = summarize(soak, idle, args)
        hardware = hardware_info(info.get("model", {}).get("dtype"), meter)
        alive = server.proc.poll() is None
    finally:
        exit_code = server.stop()
    summary["server_exit_code"] = exit_code
    print(json.dumps({**summary, "cpu": hardware["cpu"], "other_cpu_busy": hardware.get("other_cpu_busy"),
                      "server_log": log_path}, indent=1))
    append_jsonl(args.output_file, make_record("soak", "batchyard", bench_args(args), {"prompts": len(prompts)},
                                               summary, hardware))
    ok = alive and not summary["failed"] and not idle
    return 0 if ok else 1
