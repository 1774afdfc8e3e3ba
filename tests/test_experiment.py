"""`batchyard experiment`: a policy grid on the sim worker end to end (files, table, plots, lpm's
hit rate above fcfs's), the same on a local Ray, and bad experiment files stopped before anything
runs with one error line."""

from __future__ import annotations

import json
import math
import sys
import textwrap
from pathlib import Path

import pytest

from framework.cli import main
from framework.experiment.metrics import jain_index
from framework.experiment.report import COLUMNS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOTS = ("latency_vs_rate.png", "throughput.png", "cache_hit_rate.png", "ttft_cdf.png", "itl_cdf.png",
         "queue.png")

# 16 groups of 4 prompts with a 512-token system prompt, all at once, against a 4000-token KV pool:
# the prefixes do not all fit, so the order requests are admitted in decides what stays cached.
EXPERIMENT = """
[experiment]
name = "prefix-test"

[slo]
ttft_ms = 50

[cache]
max_total_tokens = 4000

[scheduler]
max_prefill_tokens = 2048
chunked_prefill_size = 1024

[grid]
{grid}

[[workload]]
name = "gsp"
dataset = "generated-shared-prefix"
gsp_num_groups = 16
gsp_prompts_per_group = 4
gsp_system_prompt_len = 512
gsp_question_len = 32
gsp_output_len = 16
rates = [inf]
clients = {{ a = 1.0, b = 1.0 }}
"""


def write_experiment(tmp_path, policies=("lpm", "fcfs", "dfs-weight"), extra: str = "",
                     grid: str | None = None) -> str:
    path = tmp_path / "exp.toml"
    grid = grid or f'"plugins.policy" = {json.dumps(list(policies))}'
    path.write_text(EXPERIMENT.format(grid=grid) + textwrap.dedent(extra))
    return str(path)


def run_experiment(path: str, out, *flags: str) -> int:
    return main(["experiment", "run", path, "--out", str(out), "--disable-tqdm", *flags])


def check_outputs(out, policies) -> dict[str, dict]:
    """The files are there and well-formed; the results by policy."""
    lines = (out / "results.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["grid"]["plugins.policy"] for r in records] == list(policies)
    for rec in records:
        assert rec["backend"] == "sim" and rec["experiment"] == "prefix-test"
        assert rec["settings"]["plugins"] == {"policy": rec["grid"]["plugins.policy"], "worker": "sim"}
        assert rec["workload"]["num_requests"] == 64 and math.isinf(float(rec["rate"]))
        m = rec["metrics"]
        assert m["completed"] == 64 and m["failed"] == 0
        assert 0 < m["cache_hit_rate"] < 1 and m["output_throughput"] > 0
        assert 0 < m["median_ttft_ms"] <= m["p99_ttft_ms"]
        assert 0 <= m["goodput"] <= m["request_throughput"]
        assert 0 < m["jain_fairness"] <= 1 and set(rec["clients"]) == {"a", "b"}
        assert len(rec["ttft_ms_quantiles"]) == 101 and rec["queue"]
    table = (out / "table.md").read_text().splitlines()
    header = next(line for line in table if line.startswith("| workload"))
    assert [c.strip() for c in header.strip("|").split("|")] == (
        ["workload", "rate", "policy"] + [c[0] for c in COLUMNS])
    rows = [line for line in table if line.startswith("| gsp")]
    assert [row.split("|")[3].strip() for row in rows[:len(policies)]] == list(policies)
    clients = [row.split("|")[4:6] for row in rows[len(policies):]]  # the per-client table
    assert [(c.strip(), int(n)) for c, n in clients] == [
        (client, rec["clients"][client]["num_requests"]) for rec in records for client in ("a", "b")]
    for name in PLOTS:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, name
    return {r["grid"]["plugins.policy"]: r["metrics"] for r in records}


def test_policy_grid_on_sim(tmp_path, capsys):
    """Two worker processes run the three cells; lpm keeps more of the shared prefixes than fcfs."""
    policies = ("lpm", "fcfs", "dfs-weight")
    out = tmp_path / "out"
    assert run_experiment(write_experiment(tmp_path, policies), out, "--jobs", "2") == 0
    by_policy = check_outputs(out, policies)
    assert by_policy["lpm"]["cache_hit_rate"] > by_policy["fcfs"]["cache_hit_rate"] + 0.05
    assert "| gsp | inf | lpm |" in capsys.readouterr().out  # the table is printed too


def test_two_cells_on_local_ray(tmp_path):
    pytest.importorskip("ray")
    out = tmp_path / "out"
    assert run_experiment(write_experiment(tmp_path, ("lpm", "fcfs")), out, "--ray", "local", "--no-plots") == 0
    lines = (out / "results.jsonl").read_text().splitlines()
    by_policy = {json.loads(x)["grid"]["plugins.policy"]: json.loads(x)["metrics"] for x in lines}
    assert by_policy["lpm"]["cache_hit_rate"] > by_policy["fcfs"]["cache_hit_rate"]

    # The table can be redrawn from results.jsonl alone.
    (out / "table.md").unlink()
    assert main(["experiment", "report", str(out), "--no-plots"]) == 0
    assert "| gsp | inf | fcfs |" in (out / "table.md").read_text()


def test_dry_run_lists_cells(tmp_path, capsys):
    grid = 'plugins.policy = ["lpm", "fcfs", "dfs-weight"]'  # unquoted: a nested table to TOML
    path = write_experiment(tmp_path, grid=grid, extra="""
        [[workload]]
        name = "random"
        dataset = "random"
        num_requests = 4
        rates = [1, 2]
        seeds = [1, 2]
        """)
    assert main(["experiment", "run", path, "--dry-run"]) == 0
    cells = capsys.readouterr().out.splitlines()
    assert len(cells) == 3 * (1 + 2 * 2)


def test_dry_run_builds_the_workloads(tmp_path, capsys):
    """A missing trace fails the dry run as it fails a run, before anything."""
    path = write_experiment(tmp_path, extra='[[workload]]\nname = "t"\ndataset = "trace"\ntrace = "gone.jsonl"\n')
    assert main(["experiment", "run", path, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "workload t: trace" in err and "gone.jsonl: cannot read" in err
    assert not (tmp_path / "prefix-test-results").exists()


TRACE_MISSING_OUTPUT_LEN = (
    '{"arrival_s": 0.0, "prompt_len": 8, "output_len": 4}\n'
    '{"arrival_s": 0.5, "prompt_len": 8}\n'
)

BAD_EXPERIMENTS = [
    pytest.param(
        '"plugins.policy" = ["lpm", "nope"]', "",
        "grid plugins.policy='nope': plugins.policy: unknown policy plugin 'nope'; installed: ",
        id="unknown-plugin-in-grid"),
    pytest.param(
        '"plugins.policy" = ["lpm", "radix"]', "",
        "unknown policy plugin 'radix' ('radix' is a cache plugin)", id="plugin-of-another-kind"),
    pytest.param(
        '"scheduler.max_prefil_tokens" = [1024]', "",
        "grid key 'scheduler.max_prefil_tokens' is no setting (did you mean scheduler.max_prefill_tokens?)",
        id="grid-key-no-setting"),
    pytest.param(
        '"plugin.lpm.nope" = [1]', "", "grid key 'plugin.lpm.nope' is no setting: [plugin.lpm] has ",
        id="plugin-option-no-setting"),
    pytest.param(
        '"plugin.nobody.x" = [1]', "", "grid key 'plugin.nobody.x' is no setting: no installed plugin declares",
        id="plugin-section-nobody-declares"),
    pytest.param(
        '"scheduler.max_prefill_tokens" = [1024, -1]', "",
        "grid scheduler.max_prefill_tokens=-1: invalid settings: scheduler.max_prefill_tokens: Input should "
        "be greater than 0 (got -1)", id="grid-value-invalid"),
    pytest.param(
        '"plugins.policy" = []', "", "grid key 'plugins.policy': expected a non-empty list", id="empty-grid-list"),
    pytest.param(
        'plugins.policy = ["lpm"]\nplugins.polcy = ["fcfs"]', "",
        "grid key 'plugins.polcy' is no setting (did you mean plugins.policy?)", id="unquoted-key-no-setting"),
    pytest.param(
        "", '[[workload]]\ndataset = "trace"\ntrace = "trace.jsonl"\nname = "t"\n',
        "workload t: trace {dir}/trace.jsonl line 2: output_len: missing field", id="trace-missing-field"),
    pytest.param(
        "", '[[workload]]\ndataset = "trace"\ntrace = "none.jsonl"\nname = "t"\n',
        "workload t: trace {dir}/none.jsonl: cannot read", id="trace-missing-file"),
    pytest.param(
        "", '[[workload]]\ndataset = "trace"\ntrace = "trace.jsonl"\nname = "t"\nrates = [10, 1000]\n',
        "workload t: rates: a trace's requests arrive at the trace's own arrival_s times", id="trace-with-rates"),
    pytest.param(
        "", '[[workload]]\ndataset = "trace"\ntrace = "trace.jsonl"\nname = "t"\narrival = "gamma"\ncv = 4.0\n',
        "workload t: arrival, cv: a trace's requests arrive", id="trace-with-arrivals"),
    pytest.param(
        "", '[[workload]]\ndataset = "gsp"\n', "workload[1].dataset: Input should be", id="unknown-dataset"),
    pytest.param(
        "", '[[workload]]\nname = "r"\nrates = [0]\n', "workload r: rates: every rate must be > 0",
        id="zero-rate"),
    pytest.param("", '[[workload]]\nname = "r"\nrate = 2\nrates = [1, 4]\n',
                 "workload r: rate and rates: give one or the other", id="rate-and-rates"),
    pytest.param("", '[[workload]]\nname = "s"\nseed = 2\nseeds = [1, 4]\n',
                 "workload s: seed and seeds: give one or the other", id="seed-and-seeds"),
    pytest.param("", '[[workload]]\nname = "s"\nseeds = [1, -1]\n', "workload s: seed -1 is outside 0 .. 2**32 - 1",
                 id="negative-seed"),
    pytest.param("", "[sceduler]\nx = 1\n", "unknown section [sceduler]", id="unknown-section"),
    pytest.param(
        '"plugins.worker" = ["tp"]', "", "grid plugins.worker='tp': plugins.worker: backend sim runs the sim worker",
        id="model-worker-on-sim"),
    pytest.param("", "[experiment.x]\n", "experiment.x: Extra inputs are not permitted", id="bad-experiment-key"),
    pytest.param("", "[slo]\nttft_ms = -5\n", "slo.ttft_ms: Input should be greater than 0", id="bad-slo"),
    pytest.param("", '[[workload]]\nname = "g"\ndataset = "generated-shared-prefix"\ngsp_output_len = 0\n',
                 "workload[1].gsp_output_len: Input should be greater than 0", id="gsp-output-len-zero"),
    pytest.param("", '[[workload]]\nname = "r"\ndataset = "random"\nrandom_input_len = -10\n',
                 "workload[1].random_input_len: Input should be greater than 0", id="random-input-len-negative"),
    pytest.param("", '[plugin.lpm]\nin_batch_prefix_cachin = false\n',
                 "option 'plugin.lpm.in_batch_prefix_cachin' is no setting: [plugin.lpm] has",
                 id="misspelt-option-in-a-base-section"),
    pytest.param("", '[plugin.sim]\nhardwre = "a100"\n', "plugin.sim.hardwre: Extra inputs are not permitted",
                 id="misspelt-option-of-a-model-that-forbids-extras"),
    pytest.param('"plugin.sim.cost_model" = ["roofline", "profile"]', "",
                 "grid plugin.sim.cost_model='profile': plugin.sim.profile: cost_model = \"profile\" needs a profile",
                 id="profile-cost-model-without-a-profile"),
    pytest.param('"plugin.sim.hardware" = ["a100", "a1000"]', "",
                 "grid plugin.sim.hardware='a1000': plugin.sim.hardware: unknown hardware 'a1000'",
                 id="unknown-hardware-in-the-grid"),
]


@pytest.mark.parametrize("grid_line, extra, message", BAD_EXPERIMENTS)
def test_bad_experiment_is_one_line_before_anything_runs(tmp_path, capsys, monkeypatch, grid_line, extra, message):
    import framework.sim.driver

    def must_not_run(*args, **kwargs):
        raise AssertionError("a cell ran despite a bad experiment file")

    monkeypatch.setattr(framework.sim.driver, "run_workload", must_not_run)
    (tmp_path / "trace.jsonl").write_text(TRACE_MISSING_OUTPUT_LEN)
    path = write_experiment(tmp_path, grid=grid_line or '"plugins.policy" = ["lpm"]', extra=extra)
    if extra.startswith("[slo]"):  # replaces the file's own [slo]
        text = open(path).read().replace("[slo]\nttft_ms = 50\n", "", 1)
        open(path, "w").write(text)
    out = tmp_path / "out"
    assert run_experiment(path, out) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("batchyard experiment: ")
    assert message.format(dir=tmp_path) in err[0]
    assert not out.exists()


def test_jain_index():
    assert jain_index([5, 5, 5]) == pytest.approx(1.0)
    assert jain_index([9, 0, 0]) == pytest.approx(1 / 3)
    assert jain_index([]) == 1.0


def test_ray_missing_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError
    out = tmp_path / "out"
    assert run_experiment(write_experiment(tmp_path), out, "--ray", "local") == 2
    assert capsys.readouterr().err.strip() == (
        "batchyard experiment: --ray needs the ray package: pip install 'batchyard[cluster]'")
    assert not out.exists()


@pytest.mark.parametrize("name, needs", [("experiment-prefix.toml", None), ("experiment-spf.toml", "my_policies"),
                                         ("experiment-fairness.toml", None)])
def test_docs_example_files_check(name, needs, capsys):
    """The example files of docs/research.md pass every check (spf: once docs/examples/my-policies
    is installed, as the worked example says)."""
    if needs:
        pytest.importorskip(needs)
    path = Path(__file__).parent.parent / "docs" / "examples" / name
    assert main(["experiment", "run", str(path), "--dry-run"]) == 0
    assert len(capsys.readouterr().out.splitlines()) in (12, 9)


def test_ray_without_a_cluster_is_one_line(tmp_path, capsys):
    pytest.importorskip("ray")
    out = tmp_path / "out"
    assert run_experiment(write_experiment(tmp_path), out, "--ray", "auto") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("batchyard experiment: --ray auto: Could not find any running Ray instance")
    assert not out.exists()


def test_trace_workload_runs_in_process(tmp_path):
    """A replayed trace (relative to the experiment file) with clients and priorities, one job."""
    lines = [{"arrival_s": 0.01 * i, "prompt_len": 40 + i, "output_len": 3 + i % 4,
              "client_id": "ab"[i % 2], "priority": i % 3} for i in range(12)]
    lines.append({"arrival_s": 0.2, "prompt": "The capital of France is", "output_len": 5, "client_id": "a"})
    (tmp_path / "trace.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    path = tmp_path / "exp.toml"
    path.write_text('[grid]\n"plugins.policy" = ["fcfs"]\n'
                    '[[workload]]\nname = "replay"\ndataset = "trace"\ntrace = "trace.jsonl"\n')
    out = tmp_path / "out"
    assert run_experiment(str(path), out, "--jobs", "1", "--no-plots") == 0
    (rec,) = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert rec["workload"]["num_requests"] == 13 and rec["workload"]["last_arrival_s"] == 0.2
    assert rec["metrics"]["completed"] == 13
    assert rec["metrics"]["total_output_tokens"] == sum(x["output_len"] for x in lines)
    assert {c: v["num_requests"] for c, v in rec["clients"].items()} == {"a": 7, "b": 6}
    assert 0 < rec["metrics"]["jain_fairness"] <= 1
    assert "| replay | trace |" in (out / "table.md").read_text()  # no rate: the trace's own times


def test_a_trace_that_starts_late_keeps_its_throughput(tmp_path):
    """Throughputs are over the first arrival to the last finish: the same trace shifted by 100 s
    (a slice of a longer log) is the same run, not one 500 times slower."""
    lines = [{"arrival_s": 0.01 * i, "prompt_len": 64, "output_len": 8, "client_id": "ab"[i % 2]} for i in range(10)]
    path = tmp_path / "exp.toml"
    text = '[grid]\n"plugins.policy" = ["fcfs"]\n'
    for name, offset in (("early", 0.0), ("late", 100.0)):
        shifted = [{**x, "arrival_s": x["arrival_s"] + offset} for x in lines]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(json.dumps(x) for x in shifted) + "\n")
        text += f'[[workload]]\nname = "{name}"\ndataset = "trace"\ntrace = "{name}.jsonl"\n'
    path.write_text(text)
    out = tmp_path / "out"
    assert run_experiment(str(path), out, "--jobs", "1", "--no-plots") == 0
    early, late = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    for key in ("duration_s", "request_throughput", "output_throughput", "goodput", "median_ttft_ms"):
        assert late["metrics"][key] == pytest.approx(early["metrics"][key], rel=1e-6), key
    for client in ("a", "b"):
        for key in ("token_throughput", "all_busy_throughput"):
            assert late["clients"][client][key] == pytest.approx(early["clients"][client][key], rel=1e-6)


def test_a_policy_that_admits_nothing_is_one_line(tmp_path, capsys, monkeypatch):
    """A policy under development that never admits a request stalls the run: one error line
    naming the policy, not a traceback."""
    import plugins.policies.fcfs
    from framework import hookimpl

    @hookimpl
    def select_prefill(view):
        return []

    monkeypatch.setattr(plugins.policies.fcfs, "select_prefill", select_prefill)
    path = tmp_path / "exp.toml"
    path.write_text('[grid]\n"plugins.policy" = ["fcfs"]\n[[workload]]\ndataset = "random"\nrandom_source = "ids"\n'
                    'num_requests = 3\nrandom_input_len = 16\nrandom_output_len = 3\nrates = [inf]\n')
    assert run_experiment(str(path), tmp_path / "out", "--jobs", "1", "--no-plots") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("batchyard experiment: the scheduler made no progress in 1000 iterations with 3 requests "
                       "waiting (does policy 'fcfs' admit any of them?)")
    assert not any("Traceback" in line for line in err)


def test_an_output_folder_that_cannot_be_made_fails_before_any_cell(tmp_path, capsys, monkeypatch):
    import framework.sim.driver

    monkeypatch.setattr(framework.sim.driver, "run_workload", lambda *a, **k: pytest.fail("a cell ran"))
    path = write_experiment(tmp_path, grid='"plugins.policy" = ["lpm"]')
    (tmp_path / "a-file").write_text("")
    assert run_experiment(path, tmp_path / "a-file") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "output folder" in err[-1] and "cannot be made" in err[-1]


@pytest.mark.parametrize("line, message", [
    ("not json", "line 1: not JSON"),
    ('{"bad": 1}', "line 1: not an experiment record (no cell, label, grid"),
])
def test_report_on_a_broken_results_file_is_one_line(tmp_path, capsys, line, message):
    from framework.cli import main

    (tmp_path / "results.jsonl").write_text(line + "\n")
    assert main(["experiment", "report", str(tmp_path), "--no-plots"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "results.jsonl" in err[0]


def test_a_report_of_merged_results_labels_each_rows_backend_and_slo():
    from framework.experiment.report import render_table

    def record(cell, backend, ttft):
        return {"cell": cell, "label": f"c{cell}", "grid": {"plugins.policy": "fcfs"}, "seed": 1, "rate": 10.0,
                "backend": backend, "slo": {"ttft_ms": ttft}, "workload": {"name": "w", "dataset": "random"},
                "metrics": {"completed": 5}}

    one = render_table([record(0, "sim", 200), record(1, "sim", 200)])
    assert "SLO TTFT ≤ 200 ms); backend sim." in one and "| backend |" not in one
    merged = render_table([record(0, "sim", 200), record(1, "real", 50)])
    assert "(each row's SLO); backend per row." in merged
    assert "| w | 10 | sim | TTFT ≤ 200 ms | fcfs |" in merged and "| w | 10 | real | TTFT ≤ 50 ms | fcfs |" in merged


def test_a_report_of_merged_results_shows_every_files_grid_keys():
    """Merged files from grids over different settings: each key gets a column ("–" where a
    record's grid lacks it), or the rows of the second file could not be told apart."""
    from framework.experiment.report import render_table

    def record(cell, grid):
        return {"cell": cell, "label": f"c{cell}", "grid": grid, "seed": 1, "rate": 10.0, "backend": "sim",
                "workload": {"name": "w", "dataset": "random"}, "metrics": {"completed": 5}}

    table = render_table([record(0, {"plugins.policy": "lpm"}),
                          record(1, {"plugins.policy": "lpm", "cache.eviction": "lru"}),
                          record(2, {"plugins.policy": "lpm", "cache.eviction": "lfu"})])
    assert "| workload | rate | policy | eviction | req/s |" in table
    assert "| w | 10 | lpm | – |" in table
    assert "| w | 10 | lpm | lru |" in table and "| w | 10 | lpm | lfu |" in table


@pytest.mark.e2e
def test_a_cell_on_the_real_engine(tmp_path):
    """backend = "real": the same experiment path on the default model, wall clock, one job."""
    path = tmp_path / "exp.toml"
    path.write_text('[experiment]\nbackend = "real"\n[worker]\nnum_threads = 1\n'
                    '[[workload]]\ndataset = "random"\nrandom_source = "ids"\nnum_requests = 2\n'
                    'random_input_len = 16\nrandom_output_len = 3\nrandom_range_ratio = 1.0\nrates = [inf]\n')
    out = tmp_path / "out"
    assert run_experiment(str(path), out, "--no-plots") == 0
    (rec,) = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert rec["backend"] == "real" and "plugins" not in rec["settings"] and rec["label"] == "base"
    assert rec["metrics"]["completed"] == 2 and rec["metrics"]["total_output_tokens"] == 6
    assert 0 < rec["metrics"]["median_ttft_ms"] <= rec["metrics"]["median_e2e_latency_ms"]


def test_a_real_cell_in_this_process_shows_its_requests_progress(monkeypatch):
    """A real cell runs for minutes: run in this process it gets a bar over its requests (the bar
    over cells alone sat at 0 meanwhile); sim cells, seconds each, and --disable-tqdm get none."""
    import framework.sim.driver
    from framework.experiment.runner import run_cells
    from framework.experiment.spec import Cell, Slo
    from framework.workload import RequestRecord, RunResult, TimedRequest, WorkloadSpec

    seen = []

    def fake_run(settings, requests, backend="sim", progress=False):
        seen.append((backend, progress))
        rec = RequestRecord("r", None, None, 0.0, 0.1, 0.2, [0.1, 0.2], 4, 2, 0, "length")
        return RunResult([rec], duration_s=0.2, wall_s=0.2, num_retractions=0, cache_hit_rate=0.0)

    monkeypatch.setattr(framework.sim.driver, "run_workload", fake_run)
    requests = {("w", 1.0, 1): [TimedRequest("r", 0.0, [1, 2, 3, 4], 2)]}
    cells = [Cell(i, {}, {}, WorkloadSpec(rate=1.0), ("w", 1.0, 1), backend) for i, backend in enumerate(["real", "sim"])]
    run_cells(cells, requests, Slo(), jobs=1, progress=True)
    run_cells(cells, requests, Slo(), jobs=1, progress=False)
    assert seen == [("real", True), ("sim", False), ("real", False), ("sim", False)]


def test_the_mean_queue_is_over_time_not_over_iterations():
    """A queue of 10 for the first second of a 10 s run averages 1, not the 3.3 of its three
    samples (a drained queue's iterations are many and short)."""
    from framework.experiment.metrics import time_mean_waiting

    assert time_mean_waiting([(0.0, 10, 0), (1.0, 0, 1), (10.0, 0, 0)]) == pytest.approx(1.0)
    assert time_mean_waiting([(0.0, 4, 0), (0.5, 2, 0), (0.75, 2, 0), (1.0, 0, 0)]) == pytest.approx(3.0)
    assert time_mean_waiting([]) == 0.0 and time_mean_waiting([(2.0, 5, 0)]) == 5.0
