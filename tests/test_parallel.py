"""Tensor parallelism, DP attention, replicas of several ranks and the multi-node arguments, on real
server subprocesses.

Every parallel layout must give the same greedy outputs as one rank (the in-process Engine, tp 1)
under the project's equality rule, with gloo collectives between the ranks' processes.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import httpx
import pytest
import torch

from framework.distributed import ParallelConfigError, check_layout, check_lora_layout, check_model_fits, node_ranks
from framework.config import ParallelSettings
from framework.model.config import ModelConfig
from tests.conftest import assert_same_greedy
from tests.conftest_server import ROOT, free_port, pid_alive, running_server, tiny_server_args

NUM_NEW_TOKENS = 8
GREEDY = {"max_new_tokens": NUM_NEW_TOKENS, "temperature": 0, "ignore_eos": True}
REQUEST_TIMEOUT_S = 120.0  # a deadlock between ranks fails the test instead of hanging it


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(3, 40, (16,), generator=gen).tolist()
    return [torch.randint(100, 40000, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def single_rank_outputs(tiny_model_folder, prompts) -> list[list[int]]:
    from framework.engine import Engine
    from tests.conftest import tiny_settings

    with Engine(tiny_settings(tiny_model_folder)) as engine:
        return [out["output_ids"] for out in engine.generate(input_ids=prompts, sampling_params=GREEDY)]


def generate_all(url: str, prompts: list[list[int]], params: dict = GREEDY) -> list[list[int]]:
    resp = httpx.post(url + "/generate", json={"input_ids": prompts, "sampling_params": params},
                      timeout=REQUEST_TIMEOUT_S)
    assert resp.status_code == 200, resp.text
    return [out["output_ids"] for out in resp.json()]


def assert_both_replicas_served(info: dict, num_requests: int) -> None:
    """Behind the controller: stats merged from replicas 0 and 1, each of which got requests."""
    replicas = info["scheduler_stats"]["replicas"]
    assert [r["dp_rank"] for r in replicas] == [0, 1], replicas
    received = [r["num_received_reqs"] for r in replicas]
    assert sum(received) == num_requests and min(received) > 0, received


def test_two_replicas_of_two_ranks_match_one_rank(tiny_model_folder, prompts, single_rank_outputs, hf_tiny, tmp_path):
    """dp_size 2 x tp_size 2: the controller in front of two tensor-parallel groups (plain TP on
    one node is what each replica runs; the two-node test covers TP without the controller)."""
    args = tiny_server_args(tiny_model_folder) + ["--parallel.tp-size", "2", "--parallel.dp-size", "2"]
    with running_server(args, tmp_path / "server.log") as server:
        outputs = generate_all(server.url, prompts)
        info = httpx.get(server.url + "/get_server_info").json()
    ties = assert_same_greedy({"dp2 x tp2": outputs}, prompts, single_rank_outputs, hf_tiny)
    print(f"dp2 x tp2: {ties} near-ties")
    pids = info["process_ids"]
    assert {"dp_controller", "scheduler-dp0", "scheduler-dp0-tp1", "scheduler-dp1", "scheduler-dp1-tp1"} <= set(pids)
    assert_both_replicas_served(info, len(prompts))
    assert not any(pid_alive(pid) for pid in pids.values()), "processes left after shutdown"


def idle_counts(log: str) -> list[tuple[int, int]]:
    return [(int(r), int(n)) for r, n in re.findall(r"DP attention rank (\d+): ran (\d+) IDLE batches", log)]


def test_dp_attention_matches_one_rank_and_idles(tiny_model_folder, prompts, single_rank_outputs, hf_tiny, tmp_path):
    args = tiny_server_args(tiny_model_folder) + ["--parallel.tp-size", "2", "--parallel.enable-dp-attention", "true"]
    with running_server(args, tmp_path / "server.log") as server:
        outputs = generate_all(server.url, prompts)
        # One request: one rank busy for its NUM_NEW_TOKENS passes, the other empty. The empty
        # rank must run one IDLE batch per pass of the busy one, and nothing may deadlock.
        # The ranks log the end of an IDLE streak one iteration after it ends: let them settle.
        time.sleep(1.0)
        seen = len(idle_counts(server.log()))
        [single] = generate_all(server.url, [prompts[0]])
        deadline = time.monotonic() + 10
        while len(idle_counts(server.log())) == seen and time.monotonic() < deadline:
            time.sleep(0.1)
        streaks = idle_counts(server.log())[seen:]
        info = httpx.get(server.url + "/get_server_info").json()
    ties = assert_same_greedy({"dp-attention": outputs, "dp-attention alone": [single]},
                              prompts, single_rank_outputs, hf_tiny)
    print(f"dp attention: {ties} near-ties, IDLE streaks after the single request: {streaks}")
    assert len(streaks) == 1, streaks
    assert streaks[0][1] == NUM_NEW_TOKENS
    pids = info["process_ids"]
    assert {"scheduler", "scheduler-tp1", "dp_controller"} <= set(pids)
    assert_both_replicas_served(info, len(prompts) + 1)
    assert not any(pid_alive(pid) for pid in pids.values()), "processes left after shutdown"


def test_two_nodes_on_loopback(tiny_model_folder, prompts, single_rank_outputs, hf_tiny, tmp_path):
    addr = f"127.0.0.1:{free_port()}"
    common = tiny_server_args(tiny_model_folder) + [
        "--parallel.tp-size", "2", "--parallel.nnodes", "2", "--parallel.dist-init-addr", addr,
        "--parallel.dist-secret", "shared-by-the-nodes",  # authenticates rank 0's broadcasts
    ]
    node1_log = tmp_path / "node1.log"
    with open(node1_log, "w") as log:
        node1 = subprocess.Popen(
            [sys.executable, "-m", "framework.cli", "serve", *common, "--parallel.node-rank", "1"],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        with running_server(common + ["--parallel.node-rank", "0"], tmp_path / "node0.log") as server:
            outputs = generate_all(server.url, prompts)
            pids = httpx.get(server.url + "/get_server_info").json()["process_ids"]
        # Node 0 stopped: node 1's rank loses its peer and the node shuts down by itself.
        node1.wait(30)
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait(5)
    log = node1_log.read_text()
    assert_same_greedy({"two nodes": outputs}, prompts, single_rank_outputs, hf_tiny)
    assert "scheduler-tp1" not in pids, "rank 1 must run on node 1"
    node1_pids = [int(p) for p in re.findall(r"'scheduler-tp1': (\d+)", log)]
    assert node1_pids, log
    assert not any(pid_alive(pid) for pid in [*pids.values(), *node1_pids]), "processes left after shutdown"


def test_tp_size_that_does_not_divide_the_heads_fails_at_start(tiny_model_folder, capfd):
    """`serve` in this process: the check comes before anything is spawned."""
    from framework.server.launch import serve
    from tests.conftest import tiny_settings

    assert serve(tiny_settings(tiny_model_folder, parallel={"tp_size": 3})) == 1
    assert "parallel.tp_size: the model's 4 attention heads do not divide into tp_size=3 ranks" in capfd.readouterr().err


@pytest.mark.parametrize("parallel", [{"tp_size": 2}, {"tp_size": 2, "enable_dp_attention": True}])
def test_lora_adapters_with_sharded_layers_fail_at_start(tiny_model_folder, capfd, parallel):
    """Adapters are loaded whole: before the check, each rank died on a shape mismatch instead."""
    from framework.server.launch import serve
    from tests.conftest import tiny_settings

    settings = tiny_settings(tiny_model_folder, parallel=parallel, model={"lora_paths": ["a=/no/such/adapter"]})
    assert serve(settings) == 1
    assert "model.lora_paths: LoRA adapters need parallel.tp_size = 1 (got 2)" in capfd.readouterr().err


def test_lora_adapters_with_replicas_pass_the_layout_check():
    check_lora_layout(ParallelSettings(dp_size=2), ["a=/adapters/a"])
    check_lora_layout(ParallelSettings(tp_size=2), [])


def test_engine_refuses_tensor_parallelism(tiny_model_folder):
    from framework.engine import Engine
    from tests.conftest import tiny_settings

    with pytest.raises(ValueError, match="one process per rank: use `batchyard serve`"):
        Engine(tiny_settings(tiny_model_folder, parallel={"tp_size": 2}))


def _config(**fields) -> ModelConfig:
    base = dict(architecture="LlamaForCausalLM", vocab_size=10, hidden_size=64, intermediate_size=128,
                num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                rope_theta=1e4, context_len=64, tie_word_embeddings=True, attention_bias=False)
    return ModelConfig(**{**base, **fields})


@pytest.mark.parametrize(
    "fields, tp, dp_attention, message",
    [
        ({}, 4, False, "2 KV heads do not divide into tp_size=4"),
        ({"num_heads": 6, "num_kv_heads": 6}, 4, False, "6 attention heads do not divide"),
        ({"intermediate_size": 100}, 3, True, "intermediate size 100 does not divide by tp_size=3"),
    ],
)
def test_model_fits_errors(fields, tp, dp_attention, message):
    with pytest.raises(ParallelConfigError, match=message):
        check_model_fits(_config(**fields), tp, dp_attention)


def test_model_fits_dp_attention_keeps_heads_whole():
    check_model_fits(_config(), 4, True)  # heads are not split with DP attention


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"tp_size": 3, "nnodes": 2}, "must be a multiple of parallel.nnodes"),
        ({"tp_size": 2, "nnodes": 2, "node_rank": 2, "dist_init_addr": "h:1"}, "must be below nnodes"),
        ({"tp_size": 2, "nnodes": 2}, "dist_init_addr .* is required"),
        ({"tp_size": 2, "nnodes": 2, "dist_init_addr": "h:1", "enable_dp_attention": True}, "runs on one node"),
        ({"tp_size": 2, "dp_size": 2, "nnodes": 2, "dist_init_addr": "h:1"}, "runs its replicas on one node"),
        ({"tp_size": 2, "dp_size": 2, "dist_init_addr": "h:1"}, "names one rendezvous"),
    ],
)
def test_layout_errors(fields, message):
    with pytest.raises(ParallelConfigError, match=message):
        check_layout(ParallelSettings(**fields))


def test_layouts_with_replicas():
    check_layout(ParallelSettings(tp_size=2, dp_size=2))
    check_layout(ParallelSettings(tp_size=2, enable_dp_attention=True, dp_size=4))  # dp_size becomes tp_size
    # DP_RANK set: one replica of its own, which may span nodes.
    check_layout(ParallelSettings(tp_size=2, dp_size=2, nnodes=2, dist_init_addr="h:1"), one_replica=True)
    with pytest.raises(ParallelConfigError, match="unset DP_RANK"):
        check_layout(ParallelSettings(tp_size=2, enable_dp_attention=True), one_replica=True)


def test_node_ranks():
    assert node_ranks(ParallelSettings(tp_size=4, nnodes=2, node_rank=1, dist_init_addr="h:1")) == [2, 3]
    assert node_ranks(ParallelSettings(tp_size=2)) == [0, 1]


def test_dp_attention_plugin_on_one_rank_sets_global_counts(make_engine, prompts, single_rank_outputs):
    """In one process the plugin's collectives are trivial, but it must still fill
    `global_num_tokens` with this rank's count and never invent an IDLE batch."""
    from framework import hookimpl

    seen = []

    class Recorder:
        @hookimpl
        def on_batch_result(self, batch, result):
            seen.append((batch.forward_mode.name, batch.global_num_tokens, batch.extend_num_tokens))

    engine = make_engine(extra_plugins=(Recorder(),), parallel={"enable_dp_attention": True})
    outputs = [o["output_ids"] for o in engine.generate(input_ids=prompts[:4], sampling_params=GREEDY)]
    assert outputs == single_rank_outputs[:4]
    assert seen and all(mode != "IDLE" for mode, _, _ in seen)
    assert all(counts == [num_tokens] for _, counts, num_tokens in seen), seen


def test_dp_attention_plugin_is_a_no_op_when_off(make_engine, prompts):
    from framework import hookimpl

    seen = []

    class Recorder:
        @hookimpl
        def on_batch_result(self, batch, result):
            seen.append(batch.global_num_tokens)

    engine = make_engine(extra_plugins=(Recorder(),))
    engine.generate(input_ids=prompts[:2], sampling_params=GREEDY)
    assert seen and all(counts is None for counts in seen)


def test_overlap_worker_falls_back_with_tensor_parallelism():
    from framework.config import Settings
    from plugins.workers.overlap import overlap_fallback_reason

    assert overlap_fallback_reason(Settings(), object()) is None
    assert "tensor-parallel" in overlap_fallback_reason(Settings(parallel={"tp_size": 2}), object())
