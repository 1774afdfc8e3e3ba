"""Timed workloads: arrival processes, trace files (and their bad lines), datasets with arrivals,
client mixes. A stand-in tokenizer keeps these in milliseconds."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from framework.workload import (
    WorkloadError,
    WorkloadSpec,
    assign_clients,
    build_workload,
    gamma_arrivals,
    load_trace,
    poisson_arrivals,
)


class WordTokenizer:
    """One id per word (its length + 10); ids 0-2 are special."""

    all_special_ids = [0, 1, 2]

    def __len__(self):
        return 100

    def encode(self, text):
        return [10 + len(word) for word in text.split()]

    def decode(self, ids, **kwargs):
        return " ".join("x" * max(i - 10, 1) for i in ids)


def test_poisson_arrivals_are_bench_serving_draws():
    times = poisson_arrivals(5, rate=4.0, seed=3)
    rng = np.random.RandomState(3)  # what `bench serving --request-rate 4 --seed 3` sleeps
    expected = [0.0] + np.cumsum([rng.exponential(0.25) for _ in range(4)]).tolist()
    assert times == pytest.approx(expected)
    gaps = np.diff(poisson_arrivals(20_000, rate=10.0, seed=1))
    assert gaps.mean() == pytest.approx(0.1, rel=0.03)
    assert poisson_arrivals(3, math.inf) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("cv", [0.5, 1.0, 3.0])
def test_gamma_arrivals_keep_the_rate_and_set_the_burstiness(cv):
    gaps = np.diff(gamma_arrivals(20_000, rate=5.0, cv=cv, seed=2))
    assert gaps.mean() == pytest.approx(0.2, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.08)


@pytest.mark.parametrize("call, message", [
    (lambda: poisson_arrivals(3, 0.0), "request rate must be > 0"),
    (lambda: gamma_arrivals(3, 1.0, cv=0.0), "cv must be > 0"),
    (lambda: assign_clients(3, {"a": -1.0}), "client weights must be >= 0"),
])
def test_bad_arrival_parameters(call, message):
    with pytest.raises(WorkloadError, match=message):
        call()


def test_client_mix_follows_the_weights():
    clients = assign_clients(10_000, {"a": 3.0, "b": 1.0}, seed=1)
    assert clients.count("a") / len(clients) == pytest.approx(0.75, abs=0.02)
    assert assign_clients(2, {}) == [None, None]


def write_trace(tmp_path, lines) -> str:
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return str(path)


def test_trace_replay(tmp_path):
    path = write_trace(tmp_path, [
        {"arrival_s": 1.5, "prompt": "two words", "output_len": 3, "client_id": "b", "priority": 2},
        "",
        {"arrival_s": 0.5, "prompt_len": 6, "output_len": 4},
    ])
    reqs = load_trace(path, WordTokenizer())
    assert [r.arrival_s for r in reqs] == [0.5, 1.5]  # sorted by arrival
    synthetic, text = reqs
    assert len(synthetic.input_ids) == 6 and all(3 <= t < 100 for t in synthetic.input_ids)
    assert (synthetic.output_len, synthetic.client_id, synthetic.priority) == (4, None, None)
    assert (text.input_ids, text.output_len, text.client_id, text.priority) == ([13, 15], 3, "b", 2)
    assert text.rid == "trace-1" and synthetic.rid == "trace-3"  # named after their lines


def test_a_trace_line_may_carry_a_first_token_deadline(tmp_path):
    path = write_trace(tmp_path, [{"arrival_s": 0, "prompt_len": 4, "output_len": 2, "slo_ttft_ms": 250}])
    (req,) = load_trace(path, WordTokenizer())
    assert req.slo_ttft_ms == 250
    from framework.sim.driver import make_message

    assert make_message(req).slo_ttft_ms == 250


@pytest.mark.parametrize("bad_line, message", [
    ({"prompt_len": 4, "output_len": 2}, "line 2: arrival_s: missing field"),
    ({"arrival_s": 1, "prompt_len": 4}, "line 2: output_len: missing field"),
    ({"arrival_s": 1, "output_len": 2}, "line 2: give exactly one of the fields prompt, prompt_len"),
    ({"arrival_s": 1, "prompt": "a", "prompt_len": 4, "output_len": 2}, "line 2: give exactly one"),
    ({"arrival_s": -1, "prompt_len": 4, "output_len": 2}, "line 2: arrival_s: Input should be greater"),
    ({"arrival_s": 1, "prompt_len": 4, "output_len": "many"}, "line 2: output_len: Input should be a valid integer"),
    ({"arrival_s": 1, "prompt": "", "output_len": 2}, "line 2: prompt: encodes to no tokens"),
    ({"arrival_s": 1, "prompt_len": 4, "output_len": 2, "priorty": 1}, "line 2: priorty: Extra inputs are not permitted"),
    ({"arrival_s": 1, "prompt_len": 4, "output_len": 2, "slo_ttft_ms": -1}, "line 2: slo_ttft_ms: Input should be"),
    ("{not json", "line 2: not JSON"),
    ("[1, 2]", "line 2: expected a JSON object, got list"),
])
def test_bad_trace_line_is_named(tmp_path, bad_line, message):
    path = write_trace(tmp_path, [{"arrival_s": 0, "prompt_len": 4, "output_len": 2}, bad_line])
    with pytest.raises(WorkloadError) as info:
        load_trace(path, WordTokenizer())
    assert str(info.value).startswith(f"trace {path} {message}")
    assert "\n" not in str(info.value)


def test_dataset_workload_with_arrivals_and_clients():
    spec = WorkloadSpec(dataset="generated-shared-prefix", gsp_num_groups=3, gsp_prompts_per_group=4,
                        gsp_system_prompt_len=20, gsp_question_len=5, gsp_output_len=7, rate=8.0, seed=4,
                        clients={"a": 1.0, "b": 1.0}, num_requests=10)
    samples: dict = {}
    reqs = build_workload(spec, WordTokenizer(), samples)
    assert len(reqs) == 10 and all(len(r.input_ids) == 25 and r.output_len == 7 for r in reqs)
    assert [r.arrival_s for r in reqs] == pytest.approx(poisson_arrivals(10, 8.0, 4))
    assert {r.client_id for r in reqs} == {"a", "b"}
    # Another rate reuses the sample: same prompts, new arrival times.
    faster = build_workload(spec.model_copy(update={"rate": 80.0}), WordTokenizer(), samples)
    assert len(samples) == 1
    assert [r.input_ids for r in faster] == [r.input_ids for r in reqs]
    assert faster[-1].arrival_s < reqs[-1].arrival_s


def test_trace_dataset_needs_a_file():
    with pytest.raises(WorkloadError, match="dataset = trace needs trace"):
        build_workload(WorkloadSpec(dataset="trace"), WordTokenizer())
