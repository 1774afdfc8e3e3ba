"""Timed workloads: requests with arrival times, and what a run of them recorded.

A workload is a list of `TimedRequest` (token ids, output length, arrival time in seconds from the
start of the run, optional client id, priority and first-token deadline). The same list drives the `sim` worker on a
virtual clock or the real Engine on the wall clock (`framework.sim.driver.run_workload`), which
returns a `RunResult` of one `RequestRecord` per request.

Where the requests come from:

* a `batchyard bench` dataset (sharegpt, random, generated-shared-prefix), sampled by the code
  in `framework.bench.datasets`, with arrivals drawn by
* `poisson_arrivals(n, rate, seed)`: exponential gaps of mean 1/rate, the first request at 0, the
  same draws as `batchyard bench serving --request-rate` with that seed; rate inf = all at 0;
* `gamma_arrivals(n, rate, cv, seed)`: gamma gaps with the same mean and coefficient of variation
  `cv` (burstiness: 1 is Poisson, above 1 bursty, below 1 smoother);
* or a trace file (`load_trace`): JSON lines with ``arrival_s``, ``prompt`` (text) or
  ``prompt_len`` (random token ids), ``output_len``, optional ``client_id``, ``priority`` and
  ``slo_ttft_ms``; any other field is an error.

`assign_clients` labels requests with client ids drawn by weight (a client mix for fairness work).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from framework.bench import datasets
from framework.bench.results import json_object_lines


class WorkloadError(ValueError):
    """A workload cannot be built; the message names the problem (file, line, field)."""


@dataclass
class TimedRequest:
    """One request of a timed workload."""

    rid: str
    arrival_s: float  # seconds from the start of the run
    input_ids: list[int]
    output_len: int  # tokens to generate (the run ignores EOS)
    client_id: str | None = None
    priority: int | None = None
    slo_ttft_ms: float | None = None  # a first-token deadline after arrival (the edf policy's)


@dataclass
class RequestRecord:
    """What one request went through; times in seconds on the run's clock, from the run start."""

    rid: str
    client_id: str | None
    priority: int | None
    arrival_s: float
    first_token_s: float | None  # None: never got a token
    finish_s: float | None  # None: did not finish
    token_times: list[float]  # one time per output token (first_token_s is token_times[0])
    input_len: int
    output_len: int  # tokens generated
    cached_tokens: int  # prompt tokens served from the prefix cache
    finish_reason: str | None


@dataclass
class RunResult:
    """A run of a workload on one backend."""

    records: list[RequestRecord]
    duration_s: float  # run clock (virtual for sim) from start to the last finish
    wall_s: float  # wall-clock seconds the run took
    num_retractions: int
    cache_hit_rate: float  # cached prompt tokens / prompt tokens
    queue_samples: list[tuple[float, int, int]] = field(default_factory=list)  # (t, waiting, running)


# -- arrivals ------------------------------------------------------------------------------------


def _check_rate(rate: float) -> None:
    if not rate > 0:
        raise WorkloadError(f"request rate must be > 0 (inf: all at once), got {rate!r}")


def poisson_arrivals(n: int, rate: float, seed: int = 1) -> list[float]:
    """Arrival times of `n` requests with exponential gaps of mean 1/rate, the first at 0.

    Draws as `batchyard bench serving` does (a legacy RandomState seeded with `seed`, one gap per
    request after the first), so a simulated run sees the arrivals a served benchmark sent.
    """
    _check_rate(rate)
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.RandomState(seed).exponential(1.0 / rate, size=n - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def gamma_arrivals(n: int, rate: float, cv: float = 1.0, seed: int = 1) -> list[float]:
    """Arrival times with gamma gaps of mean 1/rate and coefficient of variation `cv`.

    Shape k = 1/cv², scale = 1/(rate·k): the mean stays 1/rate while the spread grows with cv
    (cv = 1 is the exponential, i.e. Poisson arrivals, though not the same draws).
    """
    _check_rate(rate)
    if not cv > 0:
        raise WorkloadError(f"gamma arrivals: cv must be > 0, got {cv!r}")
    if n <= 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    shape = 1.0 / (cv * cv)
    gaps = np.random.default_rng(seed).gamma(shape, 1.0 / (rate * shape), size=n - 1)
    return [0.0] + np.cumsum(gaps).tolist()


def assign_clients(n: int, weights: dict[str, float], seed: int = 1) -> list[str | None]:
    """A client id per request, drawn independently with probability proportional to weight.

    With Poisson arrivals at rate λ this is the superposition of one Poisson stream per client at
    λ·w/Σw. No weights: every request has client None.
    """
    if not weights:
        return [None] * n
    names = list(weights)
    w = np.asarray([weights[c] for c in names], dtype=np.float64)
    if (w < 0).any() or w.sum() <= 0:
        raise WorkloadError(f"client weights must be >= 0 with a positive sum, got {weights}")
    picks = np.random.default_rng(seed + 7919).choice(len(names), size=n, p=w / w.sum())
    return [names[i] for i in picks]


# -- trace files ---------------------------------------------------------------------------------


class _TraceLine(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelt optional field would silently do nothing

    arrival_s: float = Field(ge=0)
    prompt: str | None = None
    prompt_len: int | None = Field(None, gt=0)
    output_len: int = Field(gt=0)
    client_id: str | None = None
    priority: int | None = None
    slo_ttft_ms: float | None = Field(None, ge=0)


def _synthetic_ids(length: int, plain_ids: np.ndarray, rng: np.random.Generator) -> list[int]:
    return [int(t) for t in rng.choice(plain_ids, size=length)]


def load_trace(path: str | Path, tokenizer, seed: int = 1) -> list[TimedRequest]:
    """The requests of a JSONL trace, sorted by arrival (see the module docstring for fields).

    ``prompt`` text is tokenized; ``prompt_len`` gets that many random non-special token ids
    (seeded, distinct per line, so such prompts share no prefix). Raises WorkloadError naming the
    file, the line and the field for the first bad line.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise WorkloadError(f"trace {path}: cannot read ({exc.strerror or exc})") from None
    rng = np.random.default_rng(seed)
    plain: np.ndarray | None = None
    out: list[TimedRequest] = []
    try:
        lines = list(json_object_lines(text.splitlines(), f"trace {path}"))
    except ValueError as exc:
        raise WorkloadError(str(exc)) from None
    for lineno, raw in lines:
        where = f"trace {path} line {lineno}"
        try:
            entry = _TraceLine(**raw)
        except ValidationError as exc:
            err = exc.errors()[0]
            name = ".".join(str(p) for p in err["loc"])
            problem = "missing field" if err["type"] == "missing" else err["msg"]
            raise WorkloadError(f"{where}: {name}: {problem}") from None
        if (entry.prompt is None) == (entry.prompt_len is None):
            raise WorkloadError(f"{where}: give exactly one of the fields prompt, prompt_len")
        if entry.prompt is not None:
            ids = list(tokenizer.encode(entry.prompt))
            if not ids:
                raise WorkloadError(f"{where}: prompt: encodes to no tokens")
        else:
            if plain is None:
                plain = datasets._plain_token_ids(tokenizer)  # the bench sampler's id pool
            ids = _synthetic_ids(entry.prompt_len, plain, rng)
        out.append(TimedRequest(
            rid=f"trace-{lineno}", arrival_s=entry.arrival_s, input_ids=ids, output_len=entry.output_len,
            client_id=entry.client_id, priority=entry.priority, slo_ttft_ms=entry.slo_ttft_ms,
        ))
    if not out:
        raise WorkloadError(f"trace {path}: no requests")
    out.sort(key=lambda r: r.arrival_s)  # stable: equal times keep file order
    return out


# -- workload specs ------------------------------------------------------------------------------


class WorkloadSpec(BaseModel):
    """One timed workload: a dataset or a trace, an arrival process at a rate, a seed.

    Dataset options mirror `batchyard bench`'s flags (without the ``--``), e.g. ``gsp_num_groups``.
    """

    model_config = ConfigDict(extra="forbid")

    name: str = Field("", description="Label in results and plots; empty: the dataset's name.")
    dataset: Literal["sharegpt", "random", "generated-shared-prefix", "trace"] = "sharegpt"
    num_requests: int | None = Field(
        None, gt=0, description="Requests to draw (sharegpt, random: default 1000); caps the others."
    )
    arrival: Literal["poisson", "gamma"] = Field("poisson", description="Arrival process (not for traces).")
    rate: float = Field(math.inf, gt=0, description="Mean request rate, req/s; inf: all at once.")
    cv: float = Field(1.0, gt=0, description="Coefficient of variation of gamma gaps (burstiness).")
    seed: int = Field(1, description="Seed of the dataset sample, arrivals and client draw.")
    clients: dict[str, float] = Field(
        default_factory=dict, description="Client id -> weight; each request gets one by weight."
    )
    trace: str | None = Field(None, description="JSONL trace file (dataset = trace).")
    dataset_path: str | None = None
    sharegpt_output_len: int | None = None
    # (bounds: a request has a prompt token and an output token at least; an empty system prompt is
    # allowed, a group without prompts is not)
    random_input_len: int = Field(1024, gt=0)
    random_output_len: int = Field(1024, gt=0)
    random_range_ratio: float = 0.0
    random_source: Literal["sharegpt", "ids"] = "sharegpt"
    gsp_num_groups: int = Field(64, gt=0)
    gsp_prompts_per_group: int = Field(16, gt=0)
    gsp_system_prompt_len: int = Field(2048, ge=0)
    gsp_question_len: int = Field(128, gt=0)
    gsp_output_len: int = Field(256, gt=0)
    max_output_len: int | None = Field(None, gt=0, description="Cap on every request's output length.")

    @property
    def label(self) -> str:
        return self.name or self.dataset


def _dataset_requests(spec: WorkloadSpec, tokenizer) -> list[datasets.BenchRequest]:
    """The bench dataset's requests for `spec`, drawn by framework.bench.datasets."""
    n = spec.num_requests or 1000
    if spec.dataset == "sharegpt":
        reqs = datasets.sample_sharegpt(tokenizer, n, seed=spec.seed,
                                        fixed_output_len=spec.sharegpt_output_len, path=spec.dataset_path)
    elif spec.dataset == "random":
        reqs = datasets.sample_random(
            tokenizer, n, input_len=spec.random_input_len, output_len=spec.random_output_len,
            range_ratio=spec.random_range_ratio, seed=spec.seed, source=spec.random_source,
            path=spec.dataset_path,
        )
    else:
        reqs = datasets.sample_generated_shared_prefix(
            tokenizer, num_groups=spec.gsp_num_groups, prompts_per_group=spec.gsp_prompts_per_group,
            system_prompt_len=spec.gsp_system_prompt_len, question_len=spec.gsp_question_len,
            output_len=spec.gsp_output_len, seed=spec.seed,
        )
        if spec.num_requests is not None:
            reqs = reqs[: spec.num_requests]
    return datasets.cap_output_len(reqs, spec.max_output_len)


def build_workload(spec: WorkloadSpec, tokenizer, samples: dict | None = None) -> list[TimedRequest]:
    """The timed requests of `spec`, in arrival order. Raises WorkloadError for bad input.

    `samples`, when given, caches dataset samples across calls: specs that differ only in their
    arrival process or rate reuse one sample (and its tokenization).
    """
    if spec.dataset == "trace":
        if not spec.trace:
            raise WorkloadError("dataset = trace needs trace = <path of a JSONL file>")
        out = load_trace(spec.trace, tokenizer, seed=spec.seed)
        if spec.num_requests is not None:
            out = out[: spec.num_requests]
        if spec.max_output_len is not None:
            for r in out:
                r.output_len = min(r.output_len, spec.max_output_len)
    else:
        key = spec.model_dump_json(exclude={"name", "arrival", "rate", "cv", "clients"})
        reqs = None if samples is None else samples.get(key)
        if reqs is None:
            try:
                reqs = _dataset_requests(spec, tokenizer)
            except (ValueError, FileNotFoundError) as exc:
                raise WorkloadError(f"{spec.dataset}: {exc}") from None
            if not reqs:
                raise WorkloadError(f"the {spec.dataset} dataset gave no requests")
            if samples is not None:
                samples[key] = reqs
        if spec.arrival == "poisson":
            times = poisson_arrivals(len(reqs), spec.rate, spec.seed)
        else:
            times = gamma_arrivals(len(reqs), spec.rate, spec.cv, spec.seed)
        out = [
            TimedRequest(rid=f"{spec.label}-{i}", arrival_s=t, input_ids=list(r.prompt_ids), output_len=r.output_len)
            for i, (r, t) in enumerate(zip(reqs, times))
        ]
    if spec.clients:
        for r, client in zip(out, assign_clients(len(out), spec.clients, spec.seed)):
            r.client_id = client
    return out


def describe(requests: list[TimedRequest]) -> dict[str, float]:
    """Size and span of a timed workload, stored with every result."""
    stats = datasets.size_stats(len(requests), sum(len(r.input_ids) for r in requests), sum(r.output_len for r in requests))
    stats["last_arrival_s"] = max((r.arrival_s for r in requests), default=0.0)
    stats["num_clients"] = len({r.client_id for r in requests if r.client_id is not None})
    return stats
