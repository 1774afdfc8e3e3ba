"""`batchyard bench`: dataset rules, metric definitions, and each tool end to end on a tiny model
(offline, one-batch, plot) or against a fake SSE server started here (serving)."""

from __future__ import annotations

import asyncio
import json
import math
import random

import numpy as np
import pytest

from framework.bench import datasets
from framework.bench.datasets import BenchRequest
from framework.bench.metrics import RequestResult, compute_metrics, summarize
from framework.bench.results import read_jsonl
from framework.cli import main as cli_main
from framework.preload import running_allocator
from tests.conftest import aiohttp_app_in_thread


class WordTokenizer:
    """One token per whitespace-separated word: lengths in the tests are word counts."""

    def encode(self, text, add_special_tokens=True):
        return list(range(len(text.split())))


def words(n: int) -> str:
    return " ".join(["w"] * n)


def conversation(prompt_words: int, reply_words: int, turns: int = 2) -> dict:
    conv = [{"from": "human", "value": words(prompt_words)}, {"from": "gpt", "value": words(reply_words)}]
    return {"id": f"{prompt_words}-{reply_words}", "conversations": conv[:turns]}


# -- datasets ------------------------------------------------------------------------------------


@pytest.fixture
def sharegpt_file(tmp_path):
    """A ShareGPT-shaped file cut off in the middle of its last element, like the packaged one."""
    items = [
        conversation(10, 20),            # kept
        conversation(10, 20, turns=1),   # one turn: dropped
        conversation(3, 20),             # prompt < 4: dropped
        conversation(10, 3),             # output < 4: dropped
        conversation(1025, 10),          # prompt > 1024: dropped (also with a fixed output len)
        conversation(1000, 1049),        # prompt + output > 2048: dropped unless fixed output len
        conversation(4, 4),              # exactly at the lower bounds: kept
        conversation(1024, 1024),        # exactly 2048: kept
        conversation(50, 60),            # kept
    ]
    text = json.dumps(items + [conversation(7, 7)], indent=2)
    cut = text.rindex('"from": "gpt"')  # inside the last element
    path = tmp_path / "sharegpt.json"
    path.write_text(text[:cut])
    return str(path), items


def test_iter_json_array_stops_at_truncated_tail():
    text = '[ {"a": 1},\n {"a": [2, 3]} , {"a": "x'
    assert list(datasets.iter_json_array(text)) == [{"a": 1}, {"a": [2, 3]}]
    assert list(datasets.iter_json_array("[]")) == []


def test_sharegpt_filtering_rules(sharegpt_file):
    path, items = sharegpt_file
    reqs = datasets.sample_sharegpt(WordTokenizer(), 100, seed=1, path=path)
    got = sorted((r.prompt_len, r.output_len) for r in reqs)
    assert got == [(4, 4), (10, 20), (50, 60), (1024, 1024)]
    # The truncated element (7, 7) never appears.
    assert all(r.prompt_len != 7 for r in reqs)


def test_sharegpt_fixed_output_len_and_seeded_order(sharegpt_file):
    path, items = sharegpt_file
    reqs = datasets.sample_sharegpt(WordTokenizer(), 100, seed=3, fixed_output_len=16, path=path)
    # The fixed length replaces the reply's and lifts the 2048 total rule, not the 1024 prompt rule.
    # (10, 3) is back too: its output length is now 16.
    assert sorted(r.prompt_len for r in reqs) == [4, 10, 10, 50, 1000, 1024]
    assert {r.output_len for r in reqs} == {16}
    # Order: the reference's random.seed(seed); random.shuffle(pairs) over the >=2-turn pairs.
    pairs = [(c["conversations"][0]["value"], c["conversations"][1]["value"])
             for c in items if len(c["conversations"]) >= 2]
    random.seed(3)
    random.shuffle(pairs)
    expected = [len(p.split()) for p, _ in pairs if len(p.split()) in (4, 10, 50, 1000, 1024)]
    assert [r.prompt_len for r in reqs] == expected
    assert len(datasets.sample_sharegpt(WordTokenizer(), 2, seed=3, fixed_output_len=16, path=path)) == 2
    with pytest.raises(ValueError):
        datasets.sample_sharegpt(WordTokenizer(), 2, fixed_output_len=3, path=path)


@pytest.mark.parametrize("source", ["ids", "sharegpt"])
def test_random_lengths_within_range(default_tokenizer, sharegpt_file, source):
    path, _ = sharegpt_file
    reqs = datasets.sample_random(default_tokenizer, 40, input_len=64, output_len=20, range_ratio=0.5,
                                  seed=5, source=source, path=path)
    assert len(reqs) == 40
    assert all(32 <= r.prompt_len <= 64 for r in reqs)
    assert all(10 <= r.output_len <= 20 for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 1
    fixed = datasets.sample_random(default_tokenizer, 5, 16, 8, 1.0, seed=5, source=source, path=path)
    assert [(r.prompt_len, r.output_len) for r in fixed] == [(16, 8)] * 5
    # Lengths follow numpy's legacy generator seeded like the reference.
    rng = np.random.RandomState(5)
    assert [r.prompt_len for r in reqs] == list(rng.randint(32, 65, size=40))


def test_generated_shared_prefix_groups_share_prefix(default_tokenizer):
    reqs = datasets.sample_generated_shared_prefix(default_tokenizer, num_groups=3, prompts_per_group=4,
                                                   system_prompt_len=24, question_len=6, output_len=7, seed=2)
    assert len(reqs) == 12
    assert all(r.prompt_len == 30 and r.output_len == 7 for r in reqs)
    groups: dict[tuple, list] = {}
    for r in reqs:
        groups.setdefault(tuple(r.prompt_ids[:24]), []).append(tuple(r.prompt_ids[24:]))
    assert len(groups) == 3 and all(len(q) == 4 for q in groups.values())
    assert len({q for qs in groups.values() for q in qs}) == 12  # questions differ
    special = set(default_tokenizer.all_special_ids)
    assert not any(t in special for r in reqs for t in r.prompt_ids)


def test_output_cap():
    reqs = [BenchRequest("a", [1], 10), BenchRequest("b", [1], 3)]
    assert [r.output_len for r in datasets.cap_output_len(reqs, 5)] == [5, 3]


# -- metrics -------------------------------------------------------------------------------------


def test_metrics_match_the_reference_definitions():
    results = [
        RequestResult(True, prompt_len=100, output_len=10, ttft=0.1, latency=1.0, itl=[0.1] * 9, generated_text="a"),
        RequestResult(True, prompt_len=50, output_len=4, ttft=0.2, latency=0.8, itl=[0.1, 0.2, 0.3]),
        RequestResult(True, prompt_len=10, output_len=1, ttft=0.3, latency=0.3, itl=[]),
        RequestResult(False, prompt_len=999, output_len=0, error="boom"),
    ]
    m = compute_metrics(results, duration=2.0)
    assert m["completed"] == 3 and m["failed"] == 1
    assert m["total_input_tokens"] == 160 and m["total_output_tokens"] == 15
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["input_throughput"] == pytest.approx(80.0)
    assert m["output_throughput"] == pytest.approx(7.5)
    assert m["total_throughput"] == pytest.approx(87.5)
    assert m["concurrency"] == pytest.approx((1.0 + 0.8 + 0.3) / 2.0)
    # TTFT over all successes; p99 by linear interpolation: 0.2 + 0.98 * 0.1.
    assert m["mean_ttft_ms"] == pytest.approx(200.0)
    assert m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["p99_ttft_ms"] == pytest.approx(298.0)
    assert m["std_ttft_ms"] == pytest.approx(np.std([100, 200, 300]))
    # TPOT excludes the first token and single-token requests: (1.0-0.1)/9 and (0.8-0.2)/3.
    assert m["mean_tpot_ms"] == pytest.approx((100.0 + 200.0) / 2)
    assert m["median_tpot_ms"] == pytest.approx(150.0)
    # ITL pools every gap of every request: nine 0.1 gaps plus 0.1, 0.2, 0.3.
    itls = [0.1] * 10 + [0.2, 0.3]
    assert m["mean_itl_ms"] == pytest.approx(1000 * sum(itls) / 12)
    assert m["median_itl_ms"] == pytest.approx(100.0)
    assert m["p90_itl_ms"] == pytest.approx(1000 * np.percentile(itls, 90))
    assert m["p99_itl_ms"] == pytest.approx(1000 * (0.2 + 0.89 * 0.1))
    assert m["median_e2e_latency_ms"] == pytest.approx(800.0)
    assert m["p99_e2e_latency_ms"] == pytest.approx(1000 * (0.8 + 0.98 * 0.2))


def test_summarize_empty_is_zero():
    assert summarize([]) == {"mean": 0.0, "median": 0.0, "std": 0.0, "p90": 0.0, "p99": 0.0}


# -- offline, one-batch and plot on a tiny random llama ------------------------------------------


@pytest.fixture(scope="module")
def bench_model(tmp_path_factory, default_tokenizer) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("bench-llama")
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    default_tokenizer.save_pretrained(folder)
    return str(folder)


TINY_ENGINE = ["--dtype", "float32", "--cache.max-total-tokens", "4096", "--disable-tqdm"]
TINY_WORKLOAD = ["--dataset", "random", "--random-source", "ids", "--num-prompts", "5",
                 "--random-input-len", "24", "--random-output-len", "6", "--random-range-ratio", "1"]


def read_lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_records_name_the_cpu_kind_and_a_capped_onednn(monkeypatch, tmp_path):
    """Under a hypervisor CPUs of different kinds share one model name: a record also says the
    vendor, family, model and the kernels' instruction sets, and when oneDNN was held below the
    CPU (the no-AMX proxy)."""
    from framework.bench import results

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("vendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
                       "model name\t: AMD EPYC 9R14\nflags\t\t: fpu avx2 avx512f avx512_bf16 sse4_2\n\n"
                       "processor\t: 1\nflags\t\t: amx_bf16\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(cpuinfo if path == "/proc/cpuinfo" else path, *a, **k))
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    kind = results.cpu_kind()
    assert kind == {"vendor": "AuthenticAMD", "family": "25", "model": "17", "isa": ["avx2", "avx512f", "avx512_bf16"],
                    "onednn_max_cpu_isa": "AVX512_CORE_BF16", "allocator": running_allocator()}
    assert results.cpu_model() == "AMD EPYC 9R14"
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert results.hardware_info("bfloat16")["cpu_kind"]["onednn_max_cpu_isa"] is None


def test_offline_both_backends_write_records(bench_model, tmp_path):
    out = tmp_path / "results.jsonl"
    argv = ["bench", "offline", "--model.path", bench_model, *TINY_ENGINE, *TINY_WORKLOAD,
            "--warmup-requests", "1", "--backend", "both", "--output-file", str(out)]
    assert cli_main(argv) == 0
    ours, hf = read_lines(out)
    for record, backend in ((ours, "batchyard"), (hf, "hf")):
        assert record["tool"] == "offline" and record["backend"] == backend and record["dataset"] == "random"
        m = record["metrics"]
        assert m["completed"] == 5 and m["total_input_tokens"] == 120 and m["total_output_tokens"] == 30
        for key in ("duration_s", "request_throughput", "input_throughput", "output_throughput", "total_throughput"):
            assert m[key] > 0
        assert m["output_throughput"] == pytest.approx(30 / m["duration_s"])
        hw = record["hardware"]
        assert hw["dtype"] == "float32" and hw["cores"] >= 1 and hw["torch"] and "cpu" in hw
        assert set(hw["cpu_kind"]) == {"vendor", "family", "model", "isa", "onednn_max_cpu_isa", "allocator"}
        assert 0.0 <= hw["other_cpu_busy"] <= 1.0
        assert record["args"]["num_prompts"] == 5 and record["workload"]["num_requests"] == 5
    assert ours["engine_settings"]["model"]["path"] == bench_model
    assert hf["hf_mode"] == "continuous"
    assert ours["vs_hf"]["ratio"]["output_throughput"] == pytest.approx(
        ours["metrics"]["output_throughput"] / hf["metrics"]["output_throughput"])

    # Static HF fallback, and the plot over everything written so far.
    argv = ["bench", "offline", "--model.path", bench_model, *TINY_ENGINE, *TINY_WORKLOAD,
            "--backend", "hf", "--hf-mode", "static", "--hf-batch-size", "2", "--output-file", str(out)]
    assert cli_main(argv) == 0
    static = read_lines(out)[-1]
    assert static["hf_mode"] == "static" and static["metrics"]["total_output_tokens"] == 30
    png = tmp_path / "plot.png"
    assert cli_main(["bench", "plot", str(out), "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_offline_breakdown_times_the_parts_of_the_run(bench_model, tmp_path):
    """`--breakdown`: the parts of each kind of pass add up to its forward time, the forward
    passes and sampling fit in the run, the pass counts are the run's (one prefill of the five
    prompts, five decode steps for six tokens each), and the timed methods are the originals
    again afterwards."""
    from framework.model.attention import TorchNativeAttention
    from framework.model import llama

    forward, linear = TorchNativeAttention.forward, llama.linear
    out = tmp_path / "results.jsonl"
    argv = ["bench", "offline", "--model.path", bench_model, *TINY_ENGINE, *TINY_WORKLOAD,
            "--warmup-requests", "1", "--breakdown", "--output-file", str(out)]
    assert cli_main(argv) == 0
    assert TorchNativeAttention.forward is forward and llama.linear is linear
    record = read_lines(out)[0]
    bd = record["breakdown"]
    assert bd["prefill"]["passes"] == 1 and bd["decode"]["passes"] == 5
    for phase in ("prefill", "decode"):
        parts = bd[phase]
        assert parts["attention"] > 0 and parts["gemm"] > 0 and parts["lm_head"] > 0 and parts["elementwise"] > 0
        assert sum(parts[p] for p in ("attention", "gemm", "lm_head", "elementwise", "other")) == pytest.approx(
            parts["forward"])
    inside = bd["prefill"]["forward"] + bd["decode"]["forward"] + bd["sampling"]
    assert bd["sampling"] > 0 and inside <= bd["wall"]
    assert bd["wall"] == pytest.approx(record["metrics"]["duration_s"], rel=0.2)


def test_offline_breakdown_needs_our_backend(bench_model, caplog):
    argv = ["bench", "offline", "--model.path", bench_model, *TINY_ENGINE, *TINY_WORKLOAD,
            "--backend", "hf", "--breakdown"]
    assert cli_main(argv) == 2
    assert "--breakdown times batchyard's passes" in caplog.text


def _smollm2_shape():
    from types import SimpleNamespace

    return SimpleNamespace(hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
                           head_dim=64, vocab_size=49152)


def test_roofline_counts_the_runs_work():
    """The GEMM FLOPs and KV bytes of a run, by hand: SmolLM2's 3,538,944 multiply-adds a token
    and layer (perf-anchors 5.1); a request of 10 prompt tokens, 4 from the cache, and 3 output
    tokens runs 6 prompt tokens and 2 decode steps through the layers, samples 3 rows and reads
    11 + 12 tokens of KV; one of 5 tokens and 1 output token runs 5 and reads none."""
    from framework.bench.roofline import RequestTokens, count_work, layer_macs

    cfg = _smollm2_shape()
    assert layer_macs(cfg) == 3_538_944
    work = count_work(cfg, 1000, [RequestTokens(10, 4, 3), RequestTokens(5, 0, 1)])
    assert work["layer_tokens"] == 13 and work["lm_head_rows"] == 4
    assert work["layer_flop"] == 2 * 3_538_944 * 30 * 13
    assert work["lm_head_flop"] == 2 * 576 * 49152 * 4
    assert work["kv_read_bytes"] == (11 + 12) * 1000


def test_roofline_bounds_put_the_run_against_the_rates():
    """Layer GEMMs at their own rate (int8 in w8a8), the LM head at the dtype's, the KV reads at the
    read rate; the shares are bound over run."""
    from framework.bench.roofline import bounds

    work = {"layer_flop": 8e12, "lm_head_flop": 1e12, "kv_read_bytes": 20e9}
    rates = {"layer_gemm_flops": 0.8e12, "gemm_flops": 0.5e12, "read_bytes_per_s": 40e9}
    b = bounds(work, rates, wall=20.0, output_tokens=6000)
    assert b["gemm_bound_s"] == pytest.approx(10 + 2) and b["kv_read_s"] == pytest.approx(0.5)
    assert b["gemm_kv_bound_s"] == pytest.approx(12.5)
    assert b["gemm_bound_output_throughput"] == pytest.approx(500.0)
    assert b["share_of_gemm_bound"] == pytest.approx(0.6) and b["share_of_gemm_kv_bound"] == pytest.approx(0.625)
    # model.int8_lm_head: the LM head at its own (int8) rate
    b = bounds(work, {**rates, "lm_head_flops": 0.8e12}, wall=20.0, output_tokens=6000)
    assert b["gemm_bound_s"] == pytest.approx(10 + 1.25)


def test_roofline_measures_the_layers_gemms_in_their_precision(monkeypatch):
    """w8a8's layers are bounded at torch._int_mm's rate, its LM head at the dtype's; other runs use
    the dtype's rate for both. The int8 rate is a real measurement at the layers' shapes."""
    from types import SimpleNamespace

    from framework.bench import roofline

    small = SimpleNamespace(hidden_size=64, intermediate_size=128)
    monkeypatch.setattr(roofline, "GEMM_ROWS", 64)
    monkeypatch.setattr(roofline, "MIN_SECONDS", 0.01)
    assert roofline.gemm_rate(small, "int8") > 0 and roofline.gemm_rate(small, "bfloat16") > 0
    asked = []
    monkeypatch.setattr(roofline, "gemm_rate", lambda cfg, kind: asked.append(kind) or {"int8": 2.0}.get(kind, 1.0))
    monkeypatch.setattr(roofline, "read_rate", lambda: 3.0)
    assert roofline.measure_rates("bfloat16", "w8a8", small) == {"gemm_flops": 1.0, "layer_gemm_flops": 2.0,
                                                                  "lm_head_flops": 1.0, "read_bytes_per_s": 3.0}
    assert roofline.measure_rates("bfloat16", "w8a8", small, int8_lm_head=True)["lm_head_flops"] == 2.0
    assert roofline.measure_rates("float32", "none", small)["layer_gemm_flops"] == 1.0
    assert asked == ["bfloat16", "int8", "bfloat16", "int8", "float32"]
    # w4a8: its layers at kernels/w4_gemm.c's rate, its int8 LM head at the int8 rate
    monkeypatch.setattr(roofline, "gemm_rate", lambda cfg, kind: {"int8": 2.0, "w4a8": 4.0}.get(kind, 1.0))
    rates = roofline.measure_rates("float32", "w4a8", small, int8_lm_head=True)
    assert rates["layer_gemm_flops"] == 4.0 and rates["lm_head_flops"] == 2.0
    assert roofline.measure_rates("float32", "w4a8", small)["lm_head_flops"] == 1.0
    assert "w4a8 0.000 TOP/s" in roofline.format_roofline({
        "quantization": "w4a8", "dtype": "float32", "gemm_flops": 1.0, "layer_gemm_flops": 4.0, "lm_head_flops": 2.0,
        "int8_lm_head": True, "layer_flop": 1.0, "lm_head_flop": 1.0, "kv_read_bytes": 1.0, "read_bytes_per_s": 1.0,
        **roofline.bounds({"layer_flop": 1.0, "lm_head_flop": 1.0, "kv_read_bytes": 1.0},
                          {"layer_gemm_flops": 4.0, "lm_head_flops": 2.0, "gemm_flops": 1.0, "read_bytes_per_s": 1.0},
                          1.0, 1)})


def test_the_w4a8_rate_is_a_real_measurement(monkeypatch):
    from types import SimpleNamespace

    import torch

    from framework.bench import roofline
    from framework.model.w4a8 import W4Ops

    if not W4Ops.load(torch.float32).packs:
        pytest.skip("kernels/w4_gemm.c does not build here")
    monkeypatch.setattr(roofline, "GEMM_ROWS", 64)
    monkeypatch.setattr(roofline, "MIN_SECONDS", 0.01)
    assert roofline.gemm_rate(SimpleNamespace(hidden_size=64, intermediate_size=128), "w4a8") > 0


def test_roofline_takes_the_faster_of_mkl_and_the_f32_kernel(monkeypatch):
    """Where the engine runs its float32 GEMMs on kernels/f32_gemm.c (CPUs without AVX-512), the
    float32 rate is the better of F.linear's and the kernel's at the same shapes."""
    from types import SimpleNamespace

    from framework.bench import roofline
    from framework.model import cpu_kernels

    small = SimpleNamespace(hidden_size=64, intermediate_size=128)
    monkeypatch.setattr(roofline, "GEMM_ROWS", 64)
    monkeypatch.setattr(roofline, "MIN_SECONDS", 0.01)
    timed = []

    class Gemm:
        def pack(self, w):
            return w

        def linear(self, x, packed, n):
            timed.append(n)
            return x @ packed.t()

    monkeypatch.setattr(cpu_kernels, "load_f32_gemm", lambda: Gemm())
    assert roofline.gemm_rate(small, "float32") > 0
    assert set(timed) == {256, 64}  # (gate_up's and down's columns)
    timed.clear()
    assert roofline.gemm_rate(small, "bfloat16") > 0 and timed == []
    # the kernel's timings better than F.linear's: the rate is the kernel's
    monkeypatch.setattr(roofline, "_best_rate", lambda fn, work: (timed.clear(), fn(), 5.0 if timed else 1.0)[-1])
    assert roofline.gemm_rate(small, "float32") == 5.0


def test_offline_roofline_bounds_the_run(bench_model, tmp_path, capsys):
    """`--roofline`: the record's work is the run's (random ids: no prefix from the cache; the tiny
    model's fp32 pool holds 2 layers x K and V x 2 KV heads x 16 x 4 bytes a token), the rates are
    measured, and the table is printed."""
    out = tmp_path / "results.jsonl"
    argv = ["bench", "offline", "--model.path", bench_model, *TINY_ENGINE, *TINY_WORKLOAD,
            "--warmup-requests", "1", "--roofline", "--output-file", str(out)]
    assert cli_main(argv) == 0
    record = read_lines(out)[0]
    roof, metrics = record["roofline"], record["metrics"]
    assert roof["kv_bytes_per_token"] == 512 and roof["dtype"] == "float32" and roof["quantization"] == "none"
    assert roof["layer_tokens"] == 5 * 24 + 5 * (6 - 1)
    assert roof["lm_head_rows"] == metrics["total_output_tokens"] == 5 * 6
    assert roof["kv_read_bytes"] == 5 * sum(24 + j for j in range(1, 6)) * 512
    assert roof["gemm_flops"] > 0 and roof["read_bytes_per_s"] > 0
    assert roof["layer_gemm_flops"] == roof["gemm_flops"]
    assert 0 < roof["gemm_bound_s"] < roof["gemm_kv_bound_s"]
    assert roof["share_of_gemm_bound"] == pytest.approx(roof["gemm_bound_s"] / metrics["duration_s"])
    assert "GEMM-bound limit" in capsys.readouterr().out


def test_offline_roofline_needs_our_backend(bench_model, caplog):
    argv = ["bench", "offline", "--model.path", bench_model, *TINY_ENGINE, *TINY_WORKLOAD,
            "--backend", "hf", "--roofline"]
    assert cli_main(argv) == 2
    assert "--roofline bounds batchyard's run" in caplog.text


def test_breakdown_counts_a_part_inside_another_once(bench_model):
    """The LM head's GEMM is the LM head's time, not also the GEMMs': a timed call inside
    another timed part counts for the outer one only."""
    import torch
    from transformers import AutoConfig

    from framework.bench.breakdown import Breakdown
    from framework.model.config import ModelConfig
    from framework.model.llama import LlamaForCausalLM

    config = ModelConfig.from_hf_config(AutoConfig.from_pretrained(bench_model))
    model = LlamaForCausalLM(config)
    with Breakdown() as timing:
        model.compute_logits(torch.zeros(3, config.hidden_size))  # its GEMM runs in `linear`
    assert timing.seconds[("prefill", "lm_head")] > 0
    assert timing.seconds[("prefill", "gemm")] == 0


def test_one_batch_times_prefill_and_decode(bench_model, tmp_path):
    out = tmp_path / "one.jsonl"
    argv = ["bench", "one-batch", "--model.path", bench_model, *TINY_ENGINE, "--batch-size", "2", "3",
            "--input-len", "16", "--output-len", "4", "--output-file", str(out)]
    assert cli_main(argv) == 0
    records = read_lines(out)
    assert [r["metrics"]["batch_size"] for r in records] == [2, 3]
    for r in records:
        m = r["metrics"]
        bs = m["batch_size"]
        assert r["tool"] == "one-batch"
        assert m["prefill_batches"] == 1 and m["decode_steps"] == 3 and m["output_tokens"] == 4 * bs
        assert m["prefill_throughput"] == pytest.approx(bs * 16 / m["prefill_latency_s"])
        assert m["median_decode_throughput"] == pytest.approx(bs / m["median_decode_latency_s"])
        assert m["median_decode_iteration_latency_s"] >= m["median_decode_latency_s"]
        assert "breakdown" not in r and "breakdown" not in m


def test_one_batch_breakdown_times_the_timed_batch(bench_model, tmp_path):
    """`--breakdown` on one-batch: the timed batch's passes only (the warm-up has its own),
    its parts adding up to each kind of pass's forward time."""
    out = tmp_path / "one.jsonl"
    argv = ["bench", "one-batch", "--model.path", bench_model, *TINY_ENGINE, "--batch-size", "2",
            "--input-len", "16", "--output-len", "4", "--breakdown", "--output-file", str(out)]
    assert cli_main(argv) == 0
    (record,) = read_lines(out)
    bd = record["breakdown"]
    assert bd["prefill"]["passes"] == 1 and bd["decode"]["passes"] == 3
    for phase in ("prefill", "decode"):
        parts = bd[phase]
        assert parts["attention"] > 0 and parts["gemm"] > 0
        assert sum(parts[p] for p in ("attention", "gemm", "lm_head", "elementwise", "other")) == pytest.approx(
            parts["forward"])
    assert "breakdown" not in record["metrics"]


# -- serving against a fake SSE server -----------------------------------------------------------


class FakeServer:
    """A tiny aiohttp app speaking the native /generate and the OpenAI /v1/completions streams."""

    TOKEN_DELAY_S = 0.002

    def __init__(self):
        self.bodies: list[dict] = []
        self.peers: list[tuple] = []
        self.fail_next = 0

    def app(self):
        from aiohttp import web

        app = web.Application()
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/flush_cache", lambda request: web.Response(text="ok"))
        return app

    async def _stream(self, request, chunks):
        from aiohttp import web

        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for chunk in chunks:
            await asyncio.sleep(self.TOKEN_DELAY_S)
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    async def generate(self, request):
        from aiohttp import web

        body = await request.json()
        self.bodies.append(body)
        self.peers.append(request.transport.get_extra_info("peername"))  # one per client connection
        if self.fail_next:
            self.fail_next -= 1
            return web.Response(status=500, text="internal error")
        n = body["sampling_params"]["max_new_tokens"]
        chunks = [{"text": "ab" * (i + 1), "meta_info": {"prompt_tokens": len(body["input_ids"]),
                                                       "completion_tokens": i + 1}} for i in range(n)]
        return await self._stream(request, chunks)

    async def completions(self, request):
        body = await request.json()
        self.bodies.append(body)
        n = body["max_tokens"]
        chunks = [{"choices": [{"index": 0, "text": "ab"}]} for _ in range(n)]
        chunks.append({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n}})
        return await self._stream(request, chunks)


@pytest.fixture
def fake_server():
    """Run FakeServer on 127.0.0.1 in a thread of its own; yields (server, base_url)."""
    server = FakeServer()
    with aiohttp_app_in_thread(server.app()) as url:
        yield server, url


@pytest.mark.parametrize("backend", ["batchyard", "openai", "vllm"])
def test_serving_client_times_streamed_tokens(fake_server, backend):
    from framework.bench.serving import run_serving

    server, url = fake_server
    reqs = [BenchRequest("one two three", [1, 2, 3], 5) for _ in range(4)]
    results, duration = asyncio.run(run_serving(
        reqs, backend, url, model="fake", request_rate=200.0, max_concurrency=2, warmup_requests=1,
        flush_cache=True, progress=False,
    ))
    assert len(server.bodies) == 5  # one warm-up, four measured
    body = server.bodies[1]
    if backend == "batchyard":
        assert body == {"input_ids": [1, 2, 3], "stream": True,
                        "sampling_params": {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}}
    elif backend == "openai":
        assert body["prompt"] == "one two three" and body["max_tokens"] == 5 and body["stream"] is True
    else:  # vLLM gets the very token ids
        assert body["prompt"] == [1, 2, 3] and body["max_tokens"] == 5 and body["ignore_eos"] is True
    for r in results:
        assert r.success, r.error
        assert r.output_len == 5 and r.prompt_len == 3 and r.generated_text == "ab" * 5
        assert len(r.itl) == 4  # one gap per token after the first; the usage chunk is no token
        assert 0 < r.ttft <= r.latency and all(g > 0 for g in r.itl)
        assert r.latency >= r.ttft + sum(r.itl) - 1e-6
    m = compute_metrics(results, duration)
    assert m["completed"] == 4 and m["total_output_tokens"] == 20
    for key in ("mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "median_e2e_latency_ms", "output_throughput"):
        assert m[key] > 0
    assert m["median_itl_ms"] >= 1000 * FakeServer.TOKEN_DELAY_S * 0.5


def test_serving_client_sends_each_request_on_a_connection_of_its_own(fake_server):
    """No connection is reused, however briefly idle: servers close kept-alive connections on their
    own terms (uvicorn after 5 s idle, llama.cpp's server after some requests), and a request sent
    on one being closed fails (reused, 4-7 of 16 back-to-back requests to llama.cpp's server did)."""
    from framework.bench.serving import client_session, send_request

    server, url = fake_server
    req = BenchRequest("one two three", [1, 2, 3], 2)

    async def three_requests() -> list[tuple]:
        async with client_session() as session:
            for _ in range(3):
                result = await send_request(session, "batchyard", url, req)
                assert result.success, result.error
        return list(server.peers)

    peers = asyncio.run(three_requests())
    assert len(peers) == 3 and len(set(peers)) == 3, f"connections reused: {peers}"


def test_serving_cli_records_and_counts_failures(fake_server, tmp_path):
    server, url = fake_server
    out = tmp_path / "serving.jsonl"
    argv = ["bench", "serving", "--base-url", url, *TINY_WORKLOAD, "--num-prompts", "3",
            "--warmup-requests", "0", "--output-file", str(out), "--disable-tqdm"]
    assert cli_main(argv) == 0
    server.fail_next = 1
    assert cli_main(argv + ["--request-rate", "100"]) == 1  # a failed request fails the run
    ok, partial = read_lines(out)
    assert ok["tool"] == "serving" and ok["backend"] == "batchyard" and ok["request_rate"] == "inf"
    assert ok["metrics"]["completed"] == 3 and ok["metrics"]["total_output_tokens"] == 18
    assert ok["metrics"]["total_input_tokens"] == 72
    assert "total_output_tokens_retokenized" in ok["metrics"] and ok["hardware"]["cpu"] is not None
    assert partial["metrics"]["completed"] == 2 and partial["metrics"]["failed"] == 1
    assert partial["request_rate"] == 100.0 and math.isfinite(partial["metrics"]["mean_ttft_ms"])


def test_offline_extra_sampling_params_constrain_every_request(bench_model, tmp_path):
    """A grammar for every request (warm-up included): random weights still stop at the regex's
    end, and the record keeps the parameters, the passes and the jumped tokens."""
    out = tmp_path / "grammar.jsonl"
    argv = ["bench", "offline", "--model.path", bench_model, *TINY_ENGINE, *TINY_WORKLOAD,
            "--warmup-requests", "1", "--no-ignore-eos", "--plugins.worker", "tp",
            "--extra-sampling-params", '{"regex": "(yes|no), sir"}', "--output-file", str(out)]
    assert cli_main(argv) == 0
    (record,) = read_lines(out)
    assert record["args"]["extra_sampling_params"] == {"regex": "(yes|no), sir"}
    m = record["metrics"]
    # "yes"/"no" then the forced ", sir" then EOS: at most 6 tokens, fewer than the 6 x 5 unconstrained.
    assert m["completed"] == 5 and m["total_output_tokens"] < 30
    assert 0 < m["forward_passes"] and m["jump_forward_tokens"] > 0 and m["jump_forward_dropped"] >= 0


@pytest.mark.parametrize("value", ["{not json", "[1, 2]"])
def test_bench_json_options_are_checked(value, capsys):
    with pytest.raises(SystemExit):
        cli_main(["bench", "offline", "--extra-sampling-params", value])
    assert "--extra-sampling-params" in capsys.readouterr().err


def test_offline_extra_sampling_params_need_our_backend(bench_model):
    argv = ["bench", "offline", "--model.path", bench_model, *TINY_ENGINE, *TINY_WORKLOAD,
            "--backend", "both", "--extra-sampling-params", '{"regex": "a+"}']
    assert cli_main(argv) == 2


@pytest.mark.parametrize("value, field", [('{"regex": "(abc"}', "regex"), ('{"tempreture": 0}', "tempreture")])
def test_offline_bad_extra_sampling_params_are_a_usage_error(bench_model, value, field, caplog):
    """Checked before the model loads: exit status 2 and a message naming the field."""
    argv = ["bench", "offline", "--model.path", bench_model, *TINY_ENGINE, *TINY_WORKLOAD,
            "--extra-sampling-params", value]
    assert cli_main(argv) == 2
    assert "--extra-sampling-params" in caplog.text and field in caplog.text


def test_perplexity_scores_tokens_as_transformers_does(bench_model, tmp_path):
    """`bench perplexity`: the engine in float32 scores the conversations as transformers does
    (perplexity and top-1 accuracy of the same tokens); bf16 and w8a8 settings are scored too (bf16
    alone where w8a8 is refused: torch._int_mm not exact)."""
    from framework.model.int8 import int_mm_is_exact

    quantization = "w8a8" if int_mm_is_exact() else "none"
    out = tmp_path / "ppl.jsonl"
    base = ["bench", "perplexity", "--model.path", bench_model, "--num-prompts", "4", "--max-len", "48",
            "--disable-tqdm", "--cache.max-total-tokens", "4096", "--output-file", str(out)]
    assert cli_main([*base, "--dtype", "float32"]) == 0
    assert cli_main([*base, "--backend", "hf"]) == 0
    assert cli_main([*base, "--dtype", "bfloat16", "--model.quantization", quantization]) == 0
    ours, hf, w8 = read_lines(out)
    assert (ours["tool"], ours["backend"], hf["backend"]) == ("perplexity", "batchyard", "hf")
    assert ours["workload"] == hf["workload"] == {"dataset": "sharegpt", "conversations": 4, "max_len": 48, "seed": 1}
    assert ours["metrics"]["tokens"] == hf["metrics"]["tokens"] == w8["metrics"]["tokens"] == 4 * 47
    assert ours["metrics"]["perplexity"] == pytest.approx(hf["metrics"]["perplexity"], rel=1e-4)
    assert ours["metrics"]["top1_accuracy"] == pytest.approx(hf["metrics"]["top1_accuracy"], abs=1 / 188)
    assert w8["engine_settings"]["model"]["quantization"] == quantization and w8["hardware"]["dtype"] == "bfloat16"
    assert w8["metrics"]["perplexity"] == pytest.approx(hf["metrics"]["perplexity"], rel=0.05)


@pytest.mark.parametrize("flags,message", [(["--num-prompts", "0"], "--num-prompts: must be at least 1"),
                                           (["--max-len", "8"], "--max-len must be at least 16")])
def test_perplexity_bad_options_are_usage_errors(bench_model, flags, message, caplog, capsys):
    """Checked before the model loads: exit status 2 and a message naming the option (argparse's
    for a count below 1)."""
    argv = ["bench", "perplexity", "--model.path", bench_model, "--disable-tqdm", *flags]
    try:
        code = cli_main(argv)
    except SystemExit as exc:
        code = exc.code
    assert code == 2
    assert message in caplog.text + capsys.readouterr().err


def test_perplexity_score_definitions():
    from framework.bench.perplexity import score

    m = score([math.log(0.5), math.log(0.25)], [True, False])
    assert m["tokens"] == 2 and m["top1_accuracy"] == 0.5
    assert m["perplexity"] == pytest.approx(math.sqrt(8)) and m["mean_nll"] == pytest.approx(1.5 * math.log(2))
    with pytest.raises(ValueError, match="no tokens"):
        score([], [])


@pytest.mark.parametrize("argv, flag", [
    (["offline", "--num-prompts", "-3"], "--num-prompts"),  # it ran all of ShareGPT
    (["offline", "--random-input-len", "0"], "--random-input-len"),
    (["serving", "--request-rate", "0"], "--request-rate"),  # ZeroDivisionError after the warm-up
    (["serving", "--request-rate", "-1"], "--request-rate"),
    (["serving", "--max-concurrency", "0"], "--max-concurrency"),
    (["one-batch", "--input-len", "0"], "--input-len"),
    (["one-batch", "--batch-size", "-1"], "--batch-size"),
    (["soak", "--window", "0"], "--window"),
    (["perplexity", "--num-prompts", "0"], "--num-prompts"),
])
def test_bench_counts_rates_and_lengths_are_checked_before_the_run(argv, flag, capsys):
    with pytest.raises(SystemExit) as caught:
        cli_main(["bench", *argv])
    assert caught.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and ("must be at least" in err or "must be greater than 0" in err), err


def test_a_bad_output_file_is_refused_before_the_run(tmp_path, capsys):
    """It was found when the results were written, after the whole run."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert cli_main(["bench", "one-batch", "--output-file", str(blocker / "sub.jsonl")]) == 2
    assert f"--output-file {blocker / 'sub.jsonl'}: cannot be created" in capsys.readouterr().err
    assert cli_main(["bench", "one-batch", "--output-file", str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err
    # Tried rather than judged by permission bits, which root passes everywhere, /proc included
    assert cli_main(["bench", "one-batch", "--output-file", "/proc/batchyard-results.jsonl"]) == 2
    assert "--output-file /proc/batchyard-results.jsonl: cannot be created" in capsys.readouterr().err


def test_one_batch_without_decode_steps_reports_none_and_refuses_what_it_cannot_run(bench_model, tmp_path, capsys):
    """output_len 1 has no decode step: its decode metrics are None ("n/a"), not bs / 1e-9; an
    input over the context is skipped as one over the KV pool is."""
    out = tmp_path / "one.jsonl"
    argv = ["bench", "one-batch", "--model.path", bench_model, *TINY_ENGINE, "--batch-size", "1",
            "--input-len", "8", "100000", "--output-len", "1", "--no-warmup", "--output-file", str(out)]
    assert cli_main(argv) == 0
    [record] = read_lines(out)
    m = record["metrics"]
    assert m["decode_steps"] == 0 and m["output_tokens"] == 1
    assert m["median_decode_throughput"] is None and m["median_decode_latency_s"] is None
    assert "n/a" in capsys.readouterr().out


def test_bench_plot_reads_bad_files_as_usage_errors(tmp_path, capsys):
    missing, bad, array = tmp_path / "missing.jsonl", tmp_path / "bad.jsonl", tmp_path / "array.jsonl"
    bad.write_text('{"tool": "offline"}\n{"tool": \n')
    array.write_text("[1, 2]\n")
    for path, message in ((missing, "cannot read it"), (bad, "line 2: not JSON"),
                          (array, "line 1: expected a JSON object, got list")):
        assert cli_main(["bench", "plot", str(path), "-o", str(tmp_path / "p.png")]) == 2
        assert message in capsys.readouterr().err


def test_a_results_file_cut_short_at_its_end_keeps_its_whole_records(tmp_path, caplog):
    """A run stopped while appending leaves a last line without its newline: that line is skipped
    with a warning (a broken line anywhere else is still an error, above)."""
    path = tmp_path / "cut.jsonl"
    path.write_text('{"tool": "offline"}\n{"tool": "serving"}\n{"tool": "off')
    assert read_jsonl(str(path)) == [{"tool": "offline"}, {"tool": "serving"}]
    assert "line 3: cut short" in caplog.text
    path.write_text('{"tool": "offline"}\n{"tool": "off\n')
    with pytest.raises(ValueError, match="line 2: not JSON"):
        read_jsonl(str(path))


def test_sharegpt_refuses_a_count_below_one_whoever_calls_it(sharegpt_file):
    """The loop stopped at == num_prompts: a negative count took every conversation (argparse
    refuses it on the command line; workloads and other callers get this)."""
    with pytest.raises(ValueError, match="--num-prompts must be at least 1, got -3"):
        datasets.sample_sharegpt(WordTokenizer(), -3, path=sharegpt_file)


def test_sharegpt_skips_malformed_conversations(tmp_path, caplog):
    path = tmp_path / "odd.json"
    path.write_text(json.dumps([{"conversations": ["a", "b"]}, {"conversations": [{"value": 5}, {"value": "x"}]},
                                conversation(20, 20)]))
    pairs = datasets.load_sharegpt_pairs(str(path))
    assert len(pairs) == 1
    with pytest.raises(ValueError, match="cannot read it"):
        datasets.load_sharegpt_pairs(str(tmp_path / "nope.json"))


def test_soak_rates_are_over_each_windows_own_length():
    """A run shorter than its window: 120 tokens over the 8 s it lasted, not over --window 30."""
    from types import SimpleNamespace

    from framework.bench.soak import Window, summarize

    soak = SimpleNamespace(windows=[Window(100.0, end=108.0, output_tokens=120)], errors=[])
    summary = summarize(soak, [], SimpleNamespace(window=30.0, duration=8.0, request_rate=2.0))
    assert summary["throughput_tok_s_by_window"] == [15.0] and summary["throughput_tok_s_mean"] == 15.0


def test_roofline_int8_rate_takes_the_own_int8_gemm_where_the_engine_does(monkeypatch):
    """Where the engine runs its int8 GEMMs on kernels/int8_ops.c's own kernel (Int8Ops.packs),
    the int8 rate is the better of torch._int_mm's and that kernel's; elsewhere torch._int_mm's."""
    from types import SimpleNamespace

    import torch

    from framework.bench import roofline
    from framework.model import int8

    small = SimpleNamespace(hidden_size=64, intermediate_size=128)
    monkeypatch.setattr(roofline, "GEMM_ROWS", 64)
    monkeypatch.setattr(roofline, "MIN_SECONDS", 0.01)
    timed = []
    real = int8.Int8Ops.linear
    monkeypatch.setattr(int8.Int8Ops, "linear", lambda self, x, w, **kw: timed.append(w.out_features) or real(self, x, w, **kw))
    own = int8.Int8Ops.load(torch.float32).packs
    assert roofline.gemm_rate(small, "int8") > 0
    assert set(timed) == ({256, 64} if own else set())  # (gate_up's and down's columns)
    monkeypatch.setattr(int8, "own_gemm_wanted", lambda flags=None, tiles=None: False)
    timed.clear()
    assert roofline.gemm_rate(small, "int8") > 0 and timed == []
