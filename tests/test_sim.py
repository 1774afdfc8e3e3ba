"""The sim worker: same scheduling decisions as the real worker, virtual time, cost models,
calibration, the timed driver on both backends, and bad profiles."""

from __future__ import annotations

import json

import numpy as np
import pytest

from framework import hookimpl
from framework.sim.costmodel import (FEATURES, BatchShape, CostModelError, ProfileCostModel, RooflineCostModel,
                                     fit_profile)
from framework.sim.hardware import HARDWARE
from framework.workload import TimedRequest
from tests.conftest import assert_no_leak, tiny_settings


class BatchLog:
    """Observer: every launched batch as (mode, prompt numbers, extend lens, prefix lens)."""

    def __init__(self, prompts: list[list[int]]):
        self.index = {tuple(p): i for i, p in enumerate(prompts)}
        self.batches: list[tuple] = []

    @hookimpl
    def prepare_batch(self, batch):
        if batch is not None:
            self.batches.append((
                batch.forward_mode.name,
                tuple(self.index[tuple(r.origin_input_ids)] for r in batch.reqs),
                tuple(batch.extend_lens),
                tuple(batch.prefix_lens),
            ))


def decision_prompts() -> list[list[int]]:
    """Unique prompts of varied lengths; groups share a prefix so that lpm reorders them."""
    rng = np.random.default_rng(3)
    shared = [list(map(int, rng.integers(100, 20000, size=n))) for n in (40, 70)]
    prompts = []
    for i in range(14):
        head = shared[i % 2] if i % 3 else []
        prompts.append(head + list(map(int, rng.integers(100, 20000, size=int(rng.integers(10, 90))))))
    return prompts


DECISION_SECTIONS = dict(
    # A pool too small for every request's output (retraction) and a small chunk (chunked prefill).
    cache={"max_total_tokens": 900},
    scheduler={"check_leaks": True, "chunked_prefill_size": 64, "max_prefill_tokens": 256,
               "init_new_token_ratio": 0.1},
)


def run_logged(folder, worker, policy, prompts, **sections):
    from framework.engine import Engine

    merged = {k: dict(v) for k, v in DECISION_SECTIONS.items()}
    for name, values in sections.items():
        merged.setdefault(name, {}).update(values)
    log = BatchLog(prompts)
    engine = Engine(tiny_settings(folder, plugins={"worker": worker, "policy": policy}, **merged), extra_plugins=(log,))
    try:
        outs = engine.generate(input_ids=prompts, sampling_params=[
            {"max_new_tokens": 24 + 4 * (i % 5), "ignore_eos": True, "temperature": 0} for i in range(len(prompts))
        ])
        assert_no_leak(engine)
        sched = engine.scheduler
        stats = (sched.num_retractions, sched.max_total_num_tokens, sched.req_to_token_pool.size)
    finally:
        engine.shutdown()
    return log.batches, [len(o["output_ids"]) for o in outs], stats


_real_runs: dict[tuple[str, str], tuple] = {}


def real_run(folder, policy, prompts):
    """The tp worker's run, once per policy (the slow half of the comparison)."""
    if (folder, policy) not in _real_runs:
        _real_runs[folder, policy] = run_logged(folder, "tp", policy, prompts)
    return _real_runs[folder, policy]


@pytest.mark.parametrize("policy", ["lpm", "fcfs", "dfs-weight"])
def test_same_batches_as_the_real_worker(tiny_model_folder, policy):
    prompts = decision_prompts()
    real, real_lens, real_stats = real_run(tiny_model_folder, policy, prompts)
    sim, sim_lens, sim_stats = run_logged(tiny_model_folder, "sim", policy, prompts)
    assert sim_stats == real_stats
    assert sim_lens == real_lens
    assert real_stats[0] > 0, "retraction not exercised"
    assert any(mode == "EXTEND" and 64 in ext for mode, _, ext, _ in real), "chunked prefill not exercised"
    assert any(mode == "EXTEND" and any(prefix) for mode, _, _, prefix in real), "no prefix reuse"
    assert len(sim) == len(real)
    for step, (ours, ref) in enumerate(zip(sim, real)):
        assert ours == ref, f"batch {step} differs: sim {ours} vs tp {ref}"


def test_the_decision_check_sees_an_accounting_error(tiny_model_folder, monkeypatch):
    """A sim whose KV pool is a few slots off takes other decisions, and the comparison says so."""
    from plugins.workers import sim as sim_plugin

    prompts = decision_prompts()
    real, _, _ = real_run(tiny_model_folder, "lpm", prompts)
    sizes = sim_plugin.pool_sizes
    monkeypatch.setattr(sim_plugin, "pool_sizes", lambda *a: (sizes(*a)[0] - 20,) + sizes(*a)[1:])
    off, _, _ = run_logged(tiny_model_folder, "sim", "lpm", prompts)
    assert off != real


# -- virtual time and the driver ---------------------------------------------------------------------


def write_profile(path, **coef) -> str:
    profile = {"kind": "batchyard-sim-profile", "version": 1, "coef": {name: coef.get(name, 0.0) for name in FEATURES}}
    path.write_text(json.dumps(profile))
    return str(path)


def test_virtual_clock_follows_the_cost_model(tiny_model_folder, tmp_path):
    """10 ms per step: a prefill at the arrival, then one decode step per further token."""
    from framework.sim.driver import run_workload

    profile = write_profile(tmp_path / "p.json", step=0.01)
    requests = [
        TimedRequest("a", 1.0, list(range(100, 120)), 5),
        TimedRequest("b", 100.0, list(range(200, 210)), 3, client_id="c1", priority=2),
    ]
    overrides = {"model": {"path": tiny_model_folder}, "plugin": {"sim": {"cost_model": "profile", "profile": profile}}}
    result = run_workload(overrides, requests)
    a, b = result.records
    assert a.token_times == pytest.approx([1.01, 1.02, 1.03, 1.04, 1.05])
    assert (a.first_token_s, a.finish_s, a.output_len, a.finish_reason) == (pytest.approx(1.01), pytest.approx(1.05), 5, "length")
    assert b.token_times == pytest.approx([100.01, 100.02, 100.03])
    assert (b.client_id, b.priority, b.input_len) == ("c1", 2, 10)
    assert result.duration_s == pytest.approx(100.03)
    assert result.wall_s < 30  # a jump over 99 idle seconds, not a wait
    assert result.num_retractions == 0
    assert result.queue_samples and all(t <= 100.03 + 1e-9 for t, _, _ in result.queue_samples)


def test_exact_output_lengths_and_prefix_hits_on_a_busy_run(tiny_model_folder):
    from framework.sim.driver import run_workload

    rng = np.random.default_rng(0)
    system = list(map(int, rng.integers(100, 20000, size=200)))
    requests = [
        TimedRequest(f"r{i}", i * 0.002, system + list(map(int, rng.integers(100, 20000, size=20))), int(rng.integers(1, 60)))
        for i in range(300)
    ]
    overrides = {"model": {"path": tiny_model_folder}, "cache": {"max_total_tokens": 6000}}
    result = run_workload(overrides, requests)
    assert [r.output_len for r in result.records] == [r.output_len for r in requests]
    assert all(r.finish_reason == "length" for r in result.records)
    assert all(r.first_token_s >= r.arrival_s for r in result.records)
    assert result.cache_hit_rate > 0.8
    assert sum(r.cached_tokens for r in result.records) > 0.8 * 200 * 300


def test_a_request_whose_output_would_be_cut_short_is_refused_before_the_run(tiny_model_folder):
    """400 prompt tokens and 300 to generate do not fit in a 512-token pool: the scheduler would
    clip the output to 110 tokens, and the run would not be the one asked for."""
    from framework.sim.driver import run_workload

    requests = [TimedRequest("r0", 0.0, list(range(100, 500)), 300)]
    overrides = {"model": {"path": tiny_model_folder}, "cache": {"max_total_tokens": 512}}
    with pytest.raises(ValueError, match=r"request r0: its prompt \(400 tokens\) and output_len \(300\) exceed the "
                                         r"510 tokens a request may hold here"):
        run_workload(overrides, requests)
    requests[0].output_len = 100
    assert run_workload(overrides, requests).records[0].output_len == 100


def test_the_hit_rate_counts_prompt_tokens_served_from_the_cache_only(tiny_model_folder):
    """Prompts that share nothing, prefilled in chunks: a request's own earlier chunks are no
    cache hits (the prefill log's counters took them for hits: 0.88 for one 2,048-token prompt in
    chunks of 128)."""
    from framework.sim.driver import run_workload

    rng = np.random.default_rng(1)
    requests = [TimedRequest(f"r{i}", 0.0, list(map(int, rng.integers(100, 20000, size=400))), 2) for i in range(4)]
    overrides = {"model": {"path": tiny_model_folder}, "scheduler": {"chunked_prefill_size": 128}}
    result = run_workload(overrides, requests)
    assert sum(r.cached_tokens for r in result.records) == 0
    assert result.cache_hit_rate == 0.0
    # Nor are a retracted request's own prompt and outputs, matched again at its re-prefill.
    requests = [TimedRequest(f"q{i}", 0.0, list(map(int, rng.integers(100, 20000, size=40))), 6) for i in range(12)]
    result = run_workload({**overrides, "scheduler": {"force_retract": True}}, requests)
    assert result.num_retractions > 0
    assert sum(r.cached_tokens for r in result.records) == 0 and result.cache_hit_rate == 0.0


def test_driver_runs_the_real_engine_on_the_wall_clock(tiny_model_folder):
    from framework.sim.driver import run_workload

    requests = [TimedRequest(f"r{i}", 0.05 * i, list(range(300 + i, 340 + i)), 6) for i in range(6)]
    result = run_workload({"model": {"path": tiny_model_folder, "dtype": "float32"}, "plugins": {"worker": "tp"}},
                          requests, backend="real")
    for req, rec in zip(requests, result.records):
        assert rec.output_len == 6 and rec.finish_reason == "length"
        assert rec.arrival_s <= rec.first_token_s <= rec.finish_s
        assert rec.token_times == sorted(rec.token_times)
    assert result.duration_s >= 0.25


@pytest.mark.parametrize("overrides, backend, message", [
    ({"plugins": {"worker": "tp"}}, "sim", "plugins.worker: backend sim runs the sim worker"),
    ({"plugins": {"worker": "sim"}}, "real", "plugins.worker: backend real needs a model worker"),
    ({}, "gpu", "backend: unknown backend 'gpu'"),
])
def test_driver_bad_backend(overrides, backend, message):
    from framework.sim.driver import run_workload

    with pytest.raises(ValueError, match=message):
        run_workload(overrides, [], backend=backend)


# -- cost models ---------------------------------------------------------------------------------------


def test_fit_recovers_known_coefficients():
    rng = np.random.default_rng(1)
    truth = dict(zip(FEATURES, (2e-4, 3e-8, 1e-3, 2e-6, 5e-3)))
    samples = []
    for _ in range(60):
        bs = int(rng.integers(1, 40))
        if rng.random() < 0.4:
            shape = BatchShape([int(x) for x in rng.integers(2, 600, size=bs % 4 + 1)], [])
            shape.seq_lens = [e + int(rng.integers(0, 500)) for e in shape.extend_lens]
        else:
            shape = BatchShape([1] * bs, [int(x) for x in rng.integers(10, 1500, size=bs)])
        samples.append((shape, float(np.dot(shape.features(), list(truth.values())))))
    coef, fit = fit_profile(samples)
    for name in FEATURES:
        assert coef[name] == pytest.approx(truth[name], rel=1e-6)
    assert fit["mean_abs_rel_error"] < 1e-9


def test_roofline_is_memory_bound_at_decode_and_compute_bound_at_prefill(tiny_model_folder):
    from framework.model.config import ModelConfig
    from framework.model.loader import load_hf_config

    cfg = ModelConfig.from_hf_config(load_hf_config(tiny_model_folder))
    h100 = RooflineCostModel(cfg, 2, HARDWARE["h100"])
    model = h100
    one = model.predict(BatchShape([1], [100]))
    assert one == pytest.approx(model.weight_bytes / (HARDWARE["h100"].mem_bandwidth * 0.8), rel=0.05)
    assert model.predict(BatchShape([1] * 64, [1000] * 64)) > one
    big = BatchShape([100_000], [100_000])
    assert model.predict(big) > 100 * one
    assert RooflineCostModel(cfg, 2, HARDWARE["h200"]).predict(BatchShape([1], [100])) < one
    tp2 = RooflineCostModel(cfg, 2, HARDWARE["h100"], tp_size=2)
    assert tp2.predict(big) < model.predict(big)


def test_profile_model_scales_with_tp():
    profile = {"coef": dict(zip(FEATURES, (1e-4, 0.0, 1e-3, 0.0, 1e-2))), "tp_size": 1}
    shape = BatchShape([100, 1], [100, 50])
    one, two = ProfileCostModel(profile).predict(shape), ProfileCostModel(profile, tp_size=2).predict(shape)
    assert one == pytest.approx(100 * 1e-4 + 1e-3 + 1e-2)
    assert two == pytest.approx((100 * 1e-4 + 1e-3) / 2 + 1e-2)


BAD_PROFILES = [
    (None, "cannot read"),
    ("{not json", "is not JSON"),
    (json.dumps({"kind": "other"}), "is not a batchyard sim profile"),
    (json.dumps({"kind": "batchyard-sim-profile", "version": 7, "coef": {}}), "has version 7"),
    (json.dumps({"kind": "batchyard-sim-profile", "version": 1}), "has no 'coef' table"),
    (json.dumps({"kind": "batchyard-sim-profile", "version": 1, "coef": {"step": -1}}), "coef.prefill_tokens must be"),
]


@pytest.mark.parametrize("content, message", BAD_PROFILES)
def test_unreadable_profile_is_one_clear_error(tiny_model_folder, tmp_path, content, message):
    from framework.config import SettingsError
    from framework.engine import Engine
    from framework.sim.costmodel import load_profile

    path = tmp_path / "profile.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(CostModelError) as info:
        load_profile(path)
    text = str(info.value)
    assert text.startswith("plugin.sim.profile: ") and message in text and str(path) in text and "\n" not in text
    # The settings check reads it too: at start-up, and in an experiment's grid check.
    settings = tiny_settings(tiny_model_folder, plugins={"worker": "sim"},
                             plugin={"sim": {"cost_model": "profile", "profile": str(path)}})
    with pytest.raises(SettingsError) as info:
        Engine(settings)
    header, line = str(info.value).splitlines()
    assert header == "invalid settings:"
    assert line.startswith("plugin.sim.profile: ") and message in line and str(path) in line


@pytest.mark.parametrize("sim, message", [
    ({"cost_model": "profile"}, 'cost_model = "profile" needs a profile file'),
    ({"hardware": "tpu9"}, "plugin.sim.hardware: unknown hardware 'tpu9'; known: a100, h100, h200, profile"),
    ({"hardware": "profile"}, 'plugin.sim.hardware: "profile" takes the measured entry'),
])
def test_bad_sim_settings(tiny_model_folder, sim, message):
    from framework.engine import Engine

    with pytest.raises(CostModelError, match=message):
        Engine(tiny_settings(tiny_model_folder, plugins={"worker": "sim"}, plugin={"sim": sim}))


def test_unknown_sim_setting_is_a_settings_error(tiny_model_folder):
    from framework.config import SettingsError
    from framework.engine import Engine

    with pytest.raises(SettingsError, match="plugin.sim.cost: Extra inputs are not permitted"):
        Engine(tiny_settings(tiny_model_folder, plugins={"worker": "sim"}, plugin={"sim": {"cost": "x"}}))


# -- calibration ---------------------------------------------------------------------------------------


def test_quick_calibration_fits_a_usable_profile(tiny_model_folder, tmp_path):
    from framework.sim.calibrate import CalibrationPlan, calibrate, write_profile as save
    from framework.sim.costmodel import load_profile
    from framework.sim.driver import run_workload

    settings = tiny_settings(tiny_model_folder, plugins={"worker": "tp"})
    profile = calibrate(settings, CalibrationPlan.quick())
    path = tmp_path / "profile.json"
    save(profile, path)
    loaded = load_profile(path)
    assert loaded["worker"] == "tp" and loaded["dtype"] == "float32" and loaded["cpu"]
    assert set(loaded["coef"]) == set(FEATURES) and all(v >= 0 for v in loaded["coef"].values())
    assert len(loaded["samples"]) == loaded["fit"]["num_steps"] >= 20
    assert loaded["fit"]["total_time_rel_error"] == pytest.approx(0, abs=1e-9)
    measured = sum(t for _, _, t in loaded["samples"])
    predicted = sum(ProfileCostModel(loaded).predict(BatchShape(e, s)) for e, s, _ in loaded["samples"])
    assert predicted == pytest.approx(measured)
    assert ProfileCostModel(loaded).predict(BatchShape([1], [20])) > 0
    assert loaded["hardware"]["peak_flops"] > 0 and loaded["hardware"]["mem_bandwidth"] > 0
    overrides = {"model": {"path": tiny_model_folder},
                 "plugin": {"sim": {"cost_model": "roofline", "hardware": "profile", "profile": str(path)}}}
    result = run_workload(overrides, [TimedRequest("x", 0.0, list(range(100, 150)), 4)])
    assert result.records[0].finish_s > 0


def test_validate_cli_rejects_an_unreadable_profile_before_running(tmp_path, capsys):
    from framework.cli import main

    missing = tmp_path / "none.json"
    assert main(["sim", "validate", "--profile", str(missing), "--num-prompts", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"batchyard: plugin.sim.profile: cannot read {missing}: No such file or directory"


@pytest.mark.parametrize("flags, message", [
    (["--num-prompts", "0"], "argument --num-prompts: must be at least 1, got 0"),
    (["--request-rates", "1", "0"], "argument --request-rates: must be greater than 0, got 0"),
    (["--request-rates", "-2"], "argument --request-rates: must be greater than 0, got -2"),
    (["--max-output-len", "-1"], "argument --max-output-len: must be at least 1, got -1"),
])
def test_validate_cli_rejects_bad_counts_and_rates_before_running(monkeypatch, capsys, flags, message):
    """A usage error, before the real engine runs any rate (a bad second rate used to fail after
    the first one's real run, in pydantic's many lines)."""
    import framework.sim.validate
    from framework.cli import main

    monkeypatch.setattr(framework.sim.validate, "validate_rate", lambda *a, **k: pytest.fail("a rate ran"))
    with pytest.raises(SystemExit) as exc:
        main(["sim", "validate", "--profile", "docs/examples/sim/profile.json", *flags])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_a_config_alone_is_enough(tiny_model_folder, tmp_path):
    """No weights: a folder with only config.json (here an 8B-shaped llama), any tokenizer."""
    from framework.engine import Engine

    config = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
              "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "model_type": "llama"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    settings = tiny_settings(str(tmp_path), model={"tokenizer_path": tiny_model_folder, "dtype": "bfloat16"},
                             plugins={"worker": "sim"}, cache={"max_total_tokens": 50000})
    engine = Engine(settings)
    try:
        out = engine.generate(input_ids=list(range(100, 1100)), sampling_params={"max_new_tokens": 3, "ignore_eos": True})
        assert len(out["output_ids"]) == 3
        # An 8B model on the h100 roofline: a decode step reads ~16 GB of weights, a few ms.
        assert 0.003 < engine.scheduler.clock.now() < 0.1
        assert_no_leak(engine)
    finally:
        engine.shutdown()
