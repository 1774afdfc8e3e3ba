"""Model executor tests: our paged llama vs transformers on the same weights, sampler, logprobs.

Batches are built by hand (allocating request and KV slots like the scheduler would). The KV free
list is shuffled so requests get scattered slots, which exercises the paged gathers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from framework.batch import DraftCheck, ForwardMode, ModelWorkerBatch, SamplingBatchInfo, idle_worker_batch, step_seed
from framework.model import ModelRunner, Sampler, cpu, llama
from framework.model import cpu_kernels as cpu_kernels_mod
from framework.model.logits import LogitsOutput
from tests.conftest import bool_bitmask

VOCAB = 1000
ATOL = 1e-4


def _tiny_config(cls=LlamaConfig, **overrides):
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        # Larger than HF's 0.02 so that logits vary enough for the comparisons to mean something.
        initializer_range=0.1, tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return cls(**kwargs)


def _tiny_hf(cls=LlamaForCausalLM, config=None, seed=0):
    torch.manual_seed(seed)
    return cls(config or _tiny_config()).eval()


def _runner(hf_model, max_total_tokens=2048, dtype=torch.float32, cpu_kernels="auto", max_running_requests=16,
            **kw) -> ModelRunner:
    runner = ModelRunner.from_hf_model(hf_model, dtype=dtype, max_total_tokens=max_total_tokens,
                                       max_running_requests=max_running_requests, cpu_kernels=cpu_kernels, **kw)
    pool = runner.token_to_kv_pool
    gen = torch.Generator().manual_seed(1)
    pool.free_slots = pool.free_slots[torch.randperm(pool.free_slots.numel(), generator=gen)]
    return runner


@pytest.fixture(scope="module")
def hf_model():
    return _tiny_hf()


# Every runner test runs with and without the C kernels (without: PyTorch's dense decode cache and
# grouped gathers).
@pytest.fixture(params=["auto", "off"])
def runner(hf_model, request):
    return _runner(hf_model, cpu_kernels=request.param)


@dataclass
class Req:
    tokens: list[int]  # the whole sequence this request will ever compute
    slot: int
    done: int = 0  # tokens already in the KV cache


def _new_reqs(runner: ModelRunner, lens: list[int], seed: int = 0) -> list[Req]:
    gen = torch.Generator().manual_seed(seed)
    slots = runner.req_to_token_pool.alloc(len(lens))
    return [Req(torch.randint(0, VOCAB, (n,), generator=gen).tolist(), s) for n, s in zip(lens, slots)]


def _batch(runner, reqs, lens, mode, logprob_start_lens=None, top_nums=None) -> ModelWorkerBatch:
    """Schedule `lens[i]` new tokens of each request, like prepare_for_extend/decode would."""
    num_tokens = sum(lens)
    locs = runner.token_to_kv_pool.alloc(num_tokens)
    input_ids, positions, pt = [], [], 0
    for r, n in zip(reqs, lens):
        runner.req_to_token_pool.req_to_token[r.slot, r.done : r.done + n] = locs[pt : pt + n]
        input_ids += r.tokens[r.done : r.done + n]
        positions += list(range(r.done, r.done + n))
        pt += n
    batch = ModelWorkerBatch(
        bid=0, forward_mode=mode, input_ids=torch.tensor(input_ids),
        positions=torch.tensor(positions), out_cache_loc=locs,
        req_pool_indices=torch.tensor([r.slot for r in reqs]),
        seq_lens=torch.tensor([r.done + n for r, n in zip(reqs, lens)]),
        prefix_lens=[r.done for r in reqs], extend_lens=list(lens), sampling_info=None,
        return_logprob=logprob_start_lens is not None,
        top_logprobs_nums=top_nums or [0] * len(reqs),
        extend_logprob_start_lens=logprob_start_lens or [],
    )
    for r, n in zip(reqs, lens):
        r.done += n
    return batch


def _hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def _check_last(hf_model, out: LogitsOutput, reqs: list[Req], atol=ATOL) -> None:
    for i, r in enumerate(reqs):
        ref = _hf_logits(hf_model, r.tokens[: r.done])[-1]
        torch.testing.assert_close(out.next_token_logits[i].float(), ref, atol=atol, rtol=0)


# -- forward vs transformers --------------------------------------------------------------------


def test_prefill_batch_matches_hf(hf_model, runner):
    reqs = _new_reqs(runner, [7, 1, 23, 12])
    out = runner.forward(_batch(runner, reqs, [7, 1, 23, 12], ForwardMode.EXTEND))
    assert out.next_token_logits.shape == (4, VOCAB) and out.next_token_logits.dtype == torch.float32
    _check_last(hf_model, out, reqs)


@pytest.mark.parametrize("tile", [5, 16])
def test_tiled_prefill_matches_hf(hf_model, runner, monkeypatch, tile):
    """Large passes run the token-wise layer parts in tiles; tiles that cut through requests
    must not change the result."""
    monkeypatch.setattr(llama, "PREFILL_TILE", tile)
    assert len(llama.token_tiles(7 + 1 + 23 + 12)) > 2
    reqs = _new_reqs(runner, [7, 1, 23, 12])
    out = runner.forward(_batch(runner, reqs, [7, 1, 23, 12], ForwardMode.EXTEND))
    _check_last(hf_model, out, reqs)


def test_extend_with_prefix_matches_hf(hf_model, runner):
    reqs = _new_reqs(runner, [30, 18])
    runner.forward(_batch(runner, reqs, [11, 5], ForwardMode.EXTEND))
    # Second chunk reuses the first chunk's KV; logprobs cover every row of the chunk.
    out = runner.forward(_batch(runner, reqs, [19, 13], ForwardMode.EXTEND, [0, 0], [0, 0]))
    _check_last(hf_model, out, reqs)
    for i, (r, prefix_len) in enumerate(zip(reqs, [11, 5])):
        ref = torch.log_softmax(_hf_logits(hf_model, r.tokens), dim=-1)
        positions = range(prefix_len, len(r.tokens) - 1)
        expected = [ref[p, r.tokens[p + 1]].item() for p in positions]
        assert out.input_token_logprobs[i] == pytest.approx(expected, abs=ATOL)


def test_bf16_prefill_attention_runs_on_the_c_kernel():
    """With head_dim 64 in bf16, multi-token requests (a plain prefill and one over a cached
    prefix) are attended by the C kernel (AMX tiles or AVX512-BF16 vectors) where there is one;
    the logits stay close to fp32 transformers."""
    hf = _tiny_hf(config=_tiny_config(hidden_size=128, intermediate_size=256, num_attention_heads=2,
                                      num_key_value_heads=1))
    runner = _runner(hf, dtype=torch.bfloat16, packed_weights=True)
    backend = runner.model.attn_backend
    if backend.extend_kernel is None:
        pytest.skip("no prefill attention kernel here (no C compiler or no AVX512-BF16)")
    calls: list[int] = []
    real = backend.extend_kernel
    backend.extend_kernel = lambda *args: calls.append(args[8]) or real(*args)  # the KV length
    reqs = _new_reqs(runner, [40, 23])
    out = runner.forward(_batch(runner, reqs, [21, 23], ForwardMode.EXTEND))
    _check_last(hf, out, reqs, atol=0.1)
    out = runner.forward(_batch(runner, reqs[:1], [19], ForwardMode.EXTEND))  # over a 21-token prefix
    _check_last(hf, out, reqs[:1], atol=0.1)
    layers = hf.config.num_hidden_layers
    assert calls == [21, 23] * layers + [40] * layers


def test_bf16_decode_attention_runs_on_amx_tiles():
    """With head_dim 64 in bf16, decode steps are attended on the AMX tiles where the CPU has
    them (decode_attention_tiles), and the logits stay close to fp32 transformers."""
    from framework.model import cpu_kernels

    hf = _tiny_hf(config=_tiny_config(hidden_size=128, intermediate_size=256, num_attention_heads=2,
                                      num_key_value_heads=1))
    runner = _runner(hf, dtype=torch.bfloat16, packed_weights=True)
    backend = runner.model.attn_backend
    lib = cpu_kernels.load("decode_attention")
    if backend.decode_kernel is None or not lib.decode_attention_tiles(2, 1, 64, 1, 1):
        pytest.skip("no decode kernel on AMX tiles here (no C compiler or no AMX tiles)")
    assert backend.decode_tiles
    calls: list[int] = []
    real = backend.decode_kernel
    backend.decode_kernel = lambda *args: calls.append(args[-1]) or real(*args)  # the tiles flag
    prompt_lens = [5, 40, 17]
    reqs = _new_reqs(runner, [n + 3 for n in prompt_lens])
    runner.forward(_batch(runner, reqs, prompt_lens, ForwardMode.EXTEND))
    calls.clear()  # the prefill's short extends took the kernel too
    for _ in range(3):
        out = runner.forward(_batch(runner, reqs, [1] * len(reqs), ForwardMode.DECODE))
        _check_last(hf, out, reqs, atol=0.15)  # the vector path is off by up to ~0.1 here too
    assert calls == [1] * (3 * hf.config.num_hidden_layers)


@pytest.mark.parametrize("kv_dtype", [None, torch.float8_e5m2, torch.int8])
def test_decode_path_gives_the_layers_bits(kv_dtype, monkeypatch):
    """A bf16 decode step on the decode path (framework/model/decode_path.py) writes the same KV
    and gives the same logits, bit for bit, as the same step through the layers; a model whose
    layers it would not call alike (a wrapped linear layer, as LoRA makes) keeps the layers."""
    from framework.model.decode_path import DecodePath

    hf = _tiny_hf(config=_tiny_config(hidden_size=128, intermediate_size=256, num_attention_heads=2,
                                      num_key_value_heads=1))
    runner = _runner(hf, dtype=torch.bfloat16, packed_weights=True, kv_dtype=kv_dtype)
    model = runner.model
    if model.decode_path() is None:
        pytest.skip("no decode path here (no C kernels, or no AVX512-BF16 for the packed GEMMs)")
    runs = []
    real_run = DecodePath.run
    monkeypatch.setattr(DecodePath, "run", lambda self, *a: runs.append(1) or real_run(self, *a))
    prompt_lens = [5, 40, 17, 1]
    reqs = _new_reqs(runner, [n + 4 for n in prompt_lens])
    runner.forward(_batch(runner, reqs, prompt_lens, ForwardMode.EXTEND))
    pool = runner.token_to_kv_pool
    for _ in range(4):
        batch = _batch(runner, reqs, [1] * len(reqs), ForwardMode.DECODE)
        locs = batch.out_cache_loc
        fast = runner.forward(batch).next_token_logits.clone()
        kv = step_kv(pool, locs)
        model._decode_path = False  # the layers, on the same step (same slots, same inputs)
        slow = runner.forward(batch).next_token_logits
        model.reset_decode_path()
        assert torch.equal(fast, slow)
        assert_same_step_kv(pool, kv, locs, kv_dtype)
    assert len(runs) == 4

    layer = model.model.layers[1].self_attn
    layer.o_proj = Wrapped(layer.o_proj)
    model.reset_decode_path()
    assert model.decode_path() is None


def test_bf16_prefill_tiles_write_their_q_and_outputs_in_place(monkeypatch):
    """A bf16 pass in several tiles: each tile's q (rope_kv) and MLP output (the packed GEMM) go
    straight into the pass's tensors (no torch.cat, no copies); the logits and the KV written are
    those of the same pass in one tile, bit for bit (the kernels' sums do not depend on the rows
    next to them), and near fp32 transformers."""
    from framework.model import cpu_kernels as ck

    hf = _tiny_hf(config=_tiny_config(hidden_size=128, intermediate_size=256, num_attention_heads=2,
                                      num_key_value_heads=1))
    runner = _runner(hf, dtype=torch.bfloat16, packed_weights=True)
    kernels = runner.model.kernels
    if kernels is None or kernels.gemm is None:
        pytest.skip("no C kernels or no packed GEMMs (AVX512-BF16) here")
    into = {"rope_kv": 0, "linear": 0}
    for cls, name in ((ck.FusedOps, "rope_kv"), (ck.PackedGemm, "linear")):
        real = getattr(cls, name)

        def spy(self, *args, _real=real, _name=name, **kwargs):
            into[_name] += kwargs.get("out") is not None
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, spy)
    lens = [7, 1, 23, 12]
    results = []
    for tile in (4096, 16):
        monkeypatch.setattr(llama, "PREFILL_TILE", tile)
        reqs = _new_reqs(runner, lens)
        batch = _batch(runner, reqs, lens, ForwardMode.EXTEND)
        out = runner.forward(batch)
        _check_last(hf, out, reqs, atol=0.15)  # bf16 against fp32 transformers
        logits = out.next_token_logits
        pool = runner.token_to_kv_pool
        kv = [(pool.k_buffer[i][batch.out_cache_loc].clone(), pool.v_buffer[i][batch.out_cache_loc].clone())
              for i in range(len(pool.k_buffer))]
        results.append((logits, kv))
    (logits_one, kv_one), (logits_tiled, kv_tiled) = results
    assert torch.equal(logits_one, logits_tiled)
    for (k1, v1), (k2, v2) in zip(kv_one, kv_tiled):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    layers, tiles = hf.config.num_hidden_layers, len(llama.token_tiles(sum(lens)))
    assert tiles == 3 and into == {"rope_kv": layers * tiles, "linear": layers * tiles}


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8])
def test_fp32_layers_rotate_and_write_the_kv_in_one_kernel(kv_dtype, monkeypatch):
    """An fp32 model's layers take rope_kv (kernels/fused_ops.c's rope_kv_f32) for q, k and the KV
    write, every layer of every pass, and the logits and the KV written are those of PyTorch's
    RopeTables.apply + set_kv bit for bit (into an fp32 pool and an int8 pool with its scales)."""
    hf = _tiny_hf(config=_tiny_config(hidden_size=128, intermediate_size=256, num_attention_heads=2,
                                      num_key_value_heads=1))
    results, calls = [], []
    for kernel in (True, False):
        runner = _runner(hf, dtype=torch.float32, kv_dtype=kv_dtype)
        fused = runner.model.kernels.fused if runner.model.kernels is not None else None
        if fused is None:
            pytest.skip("no C kernels here (no C compiler)")
        if kernel:
            real = cpu_kernels_mod.FusedOps.rope_kv
            monkeypatch.setattr(cpu_kernels_mod.FusedOps, "rope_kv",
                                lambda self, qkv, *a, **kw: calls.append(qkv.dtype) or real(self, qkv, *a, **kw))
        else:
            monkeypatch.setattr(cpu_kernels_mod.FusedOps, "supports_rope_kv", lambda self, k_pool, dtype=None: False)
        prompt_lens = [5, 40, 17]
        reqs = _new_reqs(runner, [n + 2 for n in prompt_lens])
        steps = [runner.forward(_batch(runner, reqs, prompt_lens, ForwardMode.EXTEND)).next_token_logits.clone()]
        steps.append(runner.forward(_batch(runner, reqs, [1] * len(reqs), ForwardMode.DECODE)).next_token_logits)
        pool = runner.token_to_kv_pool
        kv = [pool.k_buffer[0].clone(), pool.v_buffer[0].clone(), *(x.clone() for x in _scales(pool, 0))]
        results.append((steps, kv))
        if kernel:
            monkeypatch.undo()
    assert calls == [torch.float32] * (2 * hf.config.num_hidden_layers)
    (steps_c, kv_c), (steps_t, kv_t) = results
    assert all(torch.equal(a, b) for a, b in zip(steps_c, steps_t))
    assert all(torch.equal(a, b) for a, b in zip(kv_c, kv_t))


def _scales(pool, layer: int) -> tuple:
    """An int8 pool's K and V scales of `layer`; () for other pools."""
    return (pool.k_scale[layer], pool.v_scale[layer]) if pool.dtype == torch.int8 else ()


def step_kv(pool, locs: torch.Tensor) -> list[list[torch.Tensor]]:
    """Every layer's K and V (and an int8 pool's scales) at a step's slots `locs`, copied."""
    return [[b[locs].clone() for b in (pool.k_buffer[i], pool.v_buffer[i], *_scales(pool, i))]
            for i in range(len(pool.k_buffer))]


def assert_same_step_kv(pool, kv: list[list[torch.Tensor]], locs: torch.Tensor, kv_dtype) -> None:
    """The pool holds `kv` (step_kv's copies) at `locs` again, bit for bit: the same step, run the
    other way, wrote the same K, V (and an int8 pool's scales)."""
    for i, bufs in enumerate(kv):
        again = (pool.k_buffer[i], pool.v_buffer[i], *_scales(pool, i))
        assert len(again) == (4 if kv_dtype == torch.int8 else 2)
        assert all(torch.equal(b, a[locs]) for b, a in zip(bufs, again))


class Wrapped(torch.nn.Module):
    """What LoRA does to a targeted projection: the layer inside a module of its own (the decode
    paths then leave the model to its layers)."""

    def __init__(self, base):
        super().__init__()
        self.base = base

    def forward(self, x):
        return self.base(x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kv_dtype,stored,min_cosine", [
    (torch.float8_e5m2, torch.uint8, 0.97),  # steps of 12-25 % move single logits by up to ~1: cosines 0.98-0.993
    (torch.int8, torch.int8, 0.999),  # a bf16 pool's cosines: 0.9999
])
def test_an_fp8_or_int8_kv_cache_is_read_alike_by_the_kernels_and_pytorch(dtype, kv_dtype, stored, min_cosine,
                                                                         monkeypatch):
    """A float8_e5m2 KV pool (model.kv_cache_dtype = "fp8_e5m2"): prefill (AMX kernel or SDPA) and
    decode (C kernel, tiles or vectors, or PyTorch's dense decode) read the same e5m2 values. An
    int8 pool ("int8"): prefill over bf16(value x scale), decode on the C kernel (the integers, the
    scales on scores and probabilities; on VNNI the bf16 query rounded to int8) or PyTorch's dense
    decode over the widened rows. Either way the kernels' logits match PyTorch's (in fp32 to 1e-4),
    and both stay near fp32 transformers (e5m2 keeps 2 mantissa bits of K and V, int8 about bf16's).
    (The fp32 GEMM and element-wise kernels of CPUs without AVX-512 are kept out: their K and V
    differ from PyTorch's in the last bit, which now and then rounds to another int8 step.)"""
    monkeypatch.setattr(cpu_kernels_mod, "load_f32_gemm", lambda: None)
    monkeypatch.setattr(cpu_kernels_mod.FusedOps, "supports_f32", staticmethod(lambda x, weight=None: False))
    hf = _tiny_hf(config=_tiny_config(hidden_size=128, intermediate_size=256, num_attention_heads=2,
                                      num_key_value_heads=1))
    logits = {}
    for kernels in ("auto", "off"):
        runner = _runner(hf, dtype=dtype, cpu_kernels=kernels, kv_dtype=kv_dtype)
        pool = runner.token_to_kv_pool
        assert pool.dtype == kv_dtype and pool.k_buffer[0].dtype == stored
        assert len(_scales(pool, 0)) == (2 if kv_dtype == torch.int8 else 0)
        prompt_lens = [5, 40, 17]
        reqs = _new_reqs(runner, [n + 3 for n in prompt_lens])
        steps = [runner.forward(_batch(runner, reqs, prompt_lens, ForwardMode.EXTEND))]
        for _ in range(3):
            steps.append(runner.forward(_batch(runner, reqs, [1] * len(reqs), ForwardMode.DECODE)))
        for i, r in enumerate(reqs):
            ref = _hf_logits(hf, r.tokens[: r.done])[-1]
            assert F.cosine_similarity(steps[-1].next_token_logits[i].float(), ref, dim=0) > min_cosine
        logits[kernels] = torch.stack([out.next_token_logits for out in steps])
        if kernels == "auto" and runner.cpu_kernels is None:
            pytest.skip("no C kernels here (no C compiler)")
    # In bf16 the two paths' K/V differ by bf16 roundings before they are rounded to e5m2 (or int8),
    # which now and then lands them a whole step apart: up to 0.12 here (0.08 with a bf16 pool). In
    # fp32 an int8 pool's steps (1/127 of a row's largest value, far finer than e5m2's) are met by
    # the paths' last-bit differences too (an AMD EPYC Zen 3: attention outputs 5e-7 apart in the
    # first layer, logits up to 0.002 apart three layers on).
    atol = 0.2 if dtype == torch.bfloat16 else 0.02 if kv_dtype == torch.int8 else 1e-4
    torch.testing.assert_close(logits["auto"], logits["off"], atol=atol, rtol=0)


def test_no_amx_runs_the_paths_of_a_cpu_without_amx():
    """worker.cpu_kernels = "no_amx": the packed GEMMs, prefill attention and decode attention on
    AVX512-BF16 vectors, off the tiles, as on a CPU without AMX, with logits close to fp32
    transformers (on such a CPU "auto" takes these paths by itself)."""
    hf = _tiny_hf(config=_tiny_config(hidden_size=128, intermediate_size=256, num_attention_heads=2,
                                      num_key_value_heads=1))
    runner = _runner(hf, dtype=torch.bfloat16, packed_weights=True, cpu_kernels="no_amx")
    kernels, backend = runner.cpu_kernels, runner.model.attn_backend
    if kernels is None or kernels.gemm is None:
        pytest.skip("no C GEMM kernel here (no C compiler, or no AVX512-BF16)")
    assert not kernels.gemm.tiles and not kernels.decode_tiles and not kernels.extend_attention.tiles
    assert backend.extend_kernel is kernels.extend_attention and not backend.decode_tiles
    flags: list[int] = []
    real = backend.decode_kernel
    backend.decode_kernel = lambda *args: flags.append(args[-1]) or real(*args)  # the tiles flag
    extends: list[int] = []
    real_extend = backend.extend_kernel
    backend.extend_kernel = lambda *args: extends.append(args[8]) or real_extend(*args)  # the KV length
    rows: list[int] = []
    for name in ("linear", "gate_up"):
        real_gemm = getattr(kernels.gemm, name)
        setattr(kernels.gemm, name, lambda x, *a, real_gemm=real_gemm, **kw: rows.append(x.shape[0]) or real_gemm(x, *a, **kw))
    prompt_lens = [5, 40, 17]
    reqs = _new_reqs(runner, [n + 2 for n in prompt_lens])
    out = runner.forward(_batch(runner, reqs, prompt_lens, ForwardMode.EXTEND))
    _check_last(hf, out, reqs, atol=0.15)
    for _ in range(2):
        out = runner.forward(_batch(runner, reqs, [1] * len(reqs), ForwardMode.DECODE))
        _check_last(hf, out, reqs, atol=0.15)
    layers = hf.config.num_hidden_layers
    assert flags and set(flags) == {0}
    # the longer prompts by the prefill kernel on the vectors (5 tokens: the decode kernel's rows)
    assert extends == [40, 17] * layers
    # on the vectors: the prefill's layer GEMMs (62 rows) and every LM head (3 rows); each decode
    # step's layer GEMMs too, through the decode path where the model takes it (its own calls of
    # the same kernel, told the same: not the tiles)
    path = runner.model.decode_path()
    assert rows.count(62) == 4 * layers and rows.count(3) == (3 if path else 1 + 2 * (4 * layers + 1))
    assert path is None or not path.gemm.tiles
    auto = _runner(hf, dtype=torch.bfloat16, packed_weights=True)
    assert auto.model.attn_backend.decode_tiles and auto.cpu_kernels.decode_tiles


def test_decode_steps_match_hf(hf_model, runner):
    prompt_lens = [3, 17, 9, 40, 1]
    num_steps = 4
    reqs = _new_reqs(runner, [n + num_steps for n in prompt_lens])
    runner.forward(_batch(runner, reqs, prompt_lens, ForwardMode.EXTEND))
    refs = [_hf_logits(hf_model, r.tokens) for r in reqs]
    for _ in range(num_steps):
        out = runner.forward(_batch(runner, reqs, [1] * len(reqs), ForwardMode.DECODE))
        for i, r in enumerate(reqs):
            torch.testing.assert_close(out.next_token_logits[i], refs[i][r.done - 1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("draft_lens", [[0, 3, 0, 2], [5, 1, 2, 19]])
def test_decode_step_with_drafts_matches_hf(hf_model, runner, draft_lens):
    """A decode step in which some requests also compute draft tokens (jump-forward): each
    draft row's logits are those of the position before the draft, also a 20-token extend
    (past the kernel's short-extend rows, so SDPA) next to kernel rows."""
    prompt_lens = [9, 30, 4, 17]
    reqs = _new_reqs(runner, [n + 1 + d for n, d in zip(prompt_lens, draft_lens)], seed=3)
    runner.forward(_batch(runner, reqs, prompt_lens, ForwardMode.EXTEND))
    batch = _batch(runner, reqs, [1 + d for d in draft_lens], ForwardMode.MIXED)
    batch.draft_check = DraftCheck(lens=draft_lens, tokens=[], sampling_info=None)
    out = runner.forward(batch)
    _check_last(hf_model, out, reqs)
    assert out.draft_logits.shape == (sum(draft_lens), VOCAB)
    row = 0
    for r, n in zip(reqs, draft_lens):
        ref = _hf_logits(hf_model, r.tokens)
        for j in range(n):
            # Draft j of the request is its token r.done - n + j; its row scores it.
            torch.testing.assert_close(out.draft_logits[row].float(), ref[r.done - n - 1 + j], atol=ATOL, rtol=0)
            row += 1


def test_decode_cache_with_finishing_and_reordered_requests(hf_model, runner):
    """The dense decode cache: requests leave the batch, the order changes, groups split by length."""
    prompt_lens = [30, 28, 8, 7, 3, 16]
    num_steps = 6
    reqs = _new_reqs(runner, [n + num_steps for n in prompt_lens], seed=3)
    runner.forward(_batch(runner, reqs, prompt_lens, ForwardMode.EXTEND))
    refs = [_hf_logits(hf_model, r.tokens) for r in reqs]
    live = list(range(len(reqs)))
    for step in range(num_steps):
        if step in (2, 4):
            live.pop(1)  # a request finishes
        if step == 3:
            live.reverse()
        batch_reqs = [reqs[i] for i in live]
        out = runner.forward(_batch(runner, batch_reqs, [1] * len(batch_reqs), ForwardMode.DECODE))
        for i, r in enumerate(batch_reqs):
            torch.testing.assert_close(out.next_token_logits[i], refs[live[i]][r.done - 1], atol=ATOL, rtol=0)


def test_decode_cache_outgrows_its_headroom(hf_model, runner):
    prompt_lens = [3, 5]
    num_steps = 70
    reqs = _new_reqs(runner, [n + num_steps for n in prompt_lens], seed=4)
    runner.forward(_batch(runner, reqs, prompt_lens, ForwardMode.EXTEND))
    refs = [_hf_logits(hf_model, r.tokens) for r in reqs]
    for _ in range(num_steps):
        out = runner.forward(_batch(runner, reqs, [1] * len(reqs), ForwardMode.DECODE))
        for i, r in enumerate(reqs):
            torch.testing.assert_close(out.next_token_logits[i], refs[i][r.done - 1], atol=ATOL, rtol=0)


def _decode_and_check(hf_model, runner, reqs, steps=1):
    for _ in range(steps):
        out = runner.forward(_batch(runner, reqs, [1] * len(reqs), ForwardMode.DECODE))
        for i, r in enumerate(reqs):
            ref = _hf_logits(hf_model, r.tokens[: r.done])[-1]
            torch.testing.assert_close(out.next_token_logits[i], ref, atol=ATOL, rtol=0)


def test_decode_cache_kept_across_a_prefill(hf_model, runner):
    """New requests prefilled between decode steps join the dense cache as a new group; the old
    rows keep appending."""
    old = _new_reqs(runner, [20 + 8, 9 + 8], seed=5)
    runner.forward(_batch(runner, old, [20, 9], ForwardMode.EXTEND))
    _decode_and_check(hf_model, runner, old, steps=2)
    new = _new_reqs(runner, [4 + 8, 30 + 8], seed=6)
    runner.forward(_batch(runner, new, [4, 30], ForwardMode.EXTEND))
    _decode_and_check(hf_model, runner, old + new, steps=3)
    _decode_and_check(hf_model, runner, [new[1], old[0], new[0]], steps=2)


def test_decode_cache_slot_reused_by_a_one_token_prefill(hf_model, runner):
    """A finished request's slot given to a new request whose prefill is one token on top of a
    cached prefix (radix hit): the slot's old dense row has the matching length but the wrong KV."""
    a, c = _new_reqs(runner, [9 + 2, 10], seed=7)
    runner.forward(_batch(runner, [a, c], [9, 10], ForwardMode.EXTEND))
    _decode_and_check(hf_model, runner, [a], steps=1)  # a's dense row now holds 10 positions
    slot = a.slot  # a finished; the scheduler hands its request slot to b
    b = Req(c.tokens[:10] + [1, 2, 3], slot)
    req_to_token = runner.req_to_token_pool.req_to_token
    req_to_token[slot, :10] = req_to_token[c.slot, :10]  # b's prefix is c's KV
    b.done = 10
    out = runner.forward(_batch(runner, [b], [1], ForwardMode.EXTEND))
    torch.testing.assert_close(out.next_token_logits[0], _hf_logits(hf_model, b.tokens[:11])[-1], atol=ATOL, rtol=0)
    _decode_and_check(hf_model, runner, [b], steps=2)


def test_mixed_batch_matches_hf(hf_model, runner):
    running = _new_reqs(runner, [12, 6, 25], seed=1)
    new = _new_reqs(runner, [14, 9], seed=2)
    # new[1] is a chunked prefill: its first 5 tokens are already cached.
    runner.forward(_batch(runner, running + new[1:], [11, 5, 24, 5], ForwardMode.EXTEND))
    # Prefill chunks first, then the running requests as one-token extends (like mix_with_running).
    reqs = new + running
    out = runner.forward(_batch(runner, reqs, [14, 4, 1, 1, 1], ForwardMode.MIXED))
    _check_last(hf_model, out, reqs)


def test_idle_batch_returns_empty(runner):
    out = runner.forward(idle_worker_batch())
    assert out.next_token_logits.shape == (0, VOCAB)


def test_qwen2_bias_and_llama3_rope_match_hf():
    rope = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    models = [
        _tiny_hf(LlamaForCausalLM, _tiny_config(rope_parameters=rope, tie_word_embeddings=True)),
        _tiny_hf(Qwen2ForCausalLM, _tiny_config(Qwen2Config)),
    ]
    for hf in models:
        runner = _runner(hf)
        reqs = _new_reqs(runner, [40, 21])
        runner.forward(_batch(runner, reqs, [39, 20], ForwardMode.EXTEND))
        out = runner.forward(_batch(runner, reqs, [1, 1], ForwardMode.DECODE))
        _check_last(hf, out, reqs)


@pytest.mark.parametrize("cpu_kernels", ["auto", "off"])
def test_bf16_close_to_fp32(hf_model, cpu_kernels):
    runner = _runner(hf_model, dtype=torch.bfloat16, cpu_kernels=cpu_kernels)
    reqs = _new_reqs(runner, [20, 9])
    runner.forward(_batch(runner, reqs, [19, 8], ForwardMode.EXTEND))
    out = runner.forward(_batch(runner, reqs, [1, 1], ForwardMode.DECODE))
    assert out.next_token_logits.dtype == torch.bfloat16  # widened only where the sampler needs it
    _check_last(hf_model, out, reqs, atol=0.1)


def _packed_modules(runner) -> int:
    return sum(getattr(m, "packed", None) is not None for m in runner.model.modules())


@pytest.mark.skipif(not cpu.packed_linear_supported(), reason="torch's oneDNN has no bf16 on this CPU")
def test_bf16_prepacked_weights_match_the_plain_gemms(hf_model):
    """worker.packed_weights: the same passes with the weights prepacked for oneDNN and without give
    the same logits up to bf16 rounding, and both stay close to fp32 transformers."""
    packed = _runner(hf_model, dtype=torch.bfloat16, packed_weights=True)
    plain = _runner(hf_model, dtype=torch.bfloat16, packed_weights=False)
    assert _packed_modules(packed) == 3 * 4 and packed.model.packed_lm_head is not None
    assert _packed_modules(plain) == 0 and plain.model.packed_lm_head is None
    outs = []
    for runner in (packed, plain):
        reqs = _new_reqs(runner, [30, 7, 12])
        first = runner.forward(_batch(runner, reqs, [29, 6, 11], ForwardMode.EXTEND))
        out = runner.forward(_batch(runner, reqs, [1, 1, 1], ForwardMode.DECODE))
        _check_last(hf_model, out, reqs, atol=0.1)
        outs.append((first.next_token_logits.float(), out.next_token_logits.float()))
    for a, b in zip(*outs):
        assert torch.allclose(a, b, atol=0.05), (a - b).abs().max()
    # float32 never packs
    assert _packed_modules(_runner(hf_model, dtype=torch.float32, packed_weights=True)) == 0


def test_gemm_row_buckets_are_few_and_tight():
    rows = [cpu.gemm_rows(m) for m in range(1, 4097)]
    assert rows[:16] == list(range(1, 17))  # decode batches run at their own size
    assert all(m <= r <= m + m // 8 for m, r in enumerate(rows, start=1))
    assert all(a <= b for a, b in zip(rows, rows[1:]))
    assert len(set(rows[:2048])) == 72
    assert [cpu.gemm_rows(m) for m in (17, 113, 120, 121, 2047, 2049)] == [18, 120, 120, 128, 2048, 2304]


@pytest.mark.skipif(not cpu.packed_linear_supported(), reason="torch's oneDNN has no bf16 on this CPU")
def test_packed_gemms_run_at_warmed_row_counts(hf_model, monkeypatch):
    """Every packed GEMM of a pass runs at a row count `warm_packed_gemms` built (oneDNN compiles a
    kernel per new row count); the padded rows do not change the real ones."""
    runner = _runner(hf_model, dtype=torch.bfloat16, packed_weights=True)
    seen: list[tuple] = []  # (rows, input width, output width, post-op) of each GEMM run
    for name in ("_pointwise", "_pointwise_binary"):
        real = getattr(cpu, name)

        def record(x, *args, real=real):
            out = real(x, *args)
            seen.append((x.shape[0], x.shape[1], out.shape[1], args[-1]))
            return out
        monkeypatch.setattr(cpu, name, record)
    kernels = runner.cpu_kernels
    small = kernels.gemm if kernels is not None else None
    if small is not None:
        monkeypatch.setattr(small, "rows", 8)  # (1,024 or 256) so that oneDNN gets the rest here
    # the rows the packed GEMM kernel takes (up to gemm.rows) never reach oneDNN
    first = small.rows + 1 if small is not None else 1
    assert runner.model.c_gemm_rows() == first - 1
    buckets = {cpu.gemm_rows(m) for m in range(first, 65)}
    assert runner.model.warm_packed_gemms(max_rows=64, max_head_rows=8) == len(buckets)
    warmed = set(seen)
    assert {rows for rows, *_ in warmed} == buckets
    seen.clear()
    reqs = _new_reqs(runner, [29, 7, 12])
    runner.forward(_batch(runner, reqs, [28, 6, 11], ForwardMode.EXTEND))  # 45 rows
    out = runner.forward(_batch(runner, reqs, [1, 1, 1], ForwardMode.DECODE))
    rows = {r for r, *_ in seen}
    assert 48 in rows and 45 not in rows and set(seen) <= warmed, set(seen) - warmed
    _check_last(hf_model, out, reqs, atol=0.1)
    x = torch.randn(45, hf_model.config.hidden_size, dtype=torch.bfloat16)
    weight = runner.model.model.layers[0].self_attn.qkv_proj.weight
    packed = cpu.pack_linear_weight(weight)
    assert torch.equal(cpu.packed_linear(x, packed, None), cpu.packed_linear(cpu.pad_rows(x, 48), packed, None)[:45])
    assert torch.allclose(cpu.packed_linear(x, packed, None).float(), F.linear(x, weight).float(), atol=0.05)


@pytest.mark.skipif(not cpu.packed_linear_supported(), reason="torch's oneDNN has no bf16 on this CPU")
@pytest.mark.parametrize("vectors", [False, True], ids=["default", "vectors"])
def test_decode_gemms_run_on_the_c_gemm_kernels(hf_model, monkeypatch, vectors):
    """A pass of up to `rows` rows (`gemm.rows`, cut to 4 here) runs its GEMMs (and the LM head)
    on the packed GEMM kernel where there is one, a row more on oneDNN; the logits stay close to
    fp32 transformers. The kernel takes AMX tiles where there are, else AVX512-BF16 vectors: both
    run here where the CPU has tiles."""
    runner = _runner(hf_model, dtype=torch.bfloat16, packed_weights=True, max_running_requests=64)
    if runner.cpu_kernels is None or runner.cpu_kernels.gemm is None:
        pytest.skip("no C GEMM kernel here (no C compiler, or no AVX512-BF16)")
    kernel = runner.cpu_kernels.gemm
    monkeypatch.setattr(kernel, "rows", 4)
    if vectors:
        monkeypatch.setattr(kernel, "tiles", False)

    streamed: list[int] = []  # rows of the calls that store past the caches

    def spy(kernel) -> list[int]:
        """The rows of every call of the C function (the layers' and the decode path's alike)."""
        calls: list[int] = []
        real = kernel._gemm

        def call(*args):  # (x, x_stride, packed, other, other_stride, y, y_stride, rows, ..., stream)
            calls.append(args[7])
            if args[13]:
                streamed.append(args[7])
            return real(*args)

        monkeypatch.setattr(kernel, "_gemm", call)
        return calls

    calls = spy(kernel)
    layers = hf_model.config.num_hidden_layers
    most = kernel.rows
    reqs = _new_reqs(runner, [21])
    runner.forward(_batch(runner, reqs, [20], ForwardMode.EXTEND))
    assert calls == [1]  # 20 rows on oneDNN, the LM head's one row here
    calls.clear()
    out = runner.forward(_batch(runner, reqs, [1], ForwardMode.DECODE))
    assert len(calls) == 4 * layers + 1 and set(calls) == {1}  # qkv, o, gate_up, down; the LM head
    assert streamed == [1, 1]  # the LM head's logits only (both passes), stored past the caches
    _check_last(hf_model, out, reqs, atol=0.1)
    if most > 1:
        lens = [5 + i for i in range(most)]
        reqs = _new_reqs(runner, lens)
        runner.forward(_batch(runner, reqs, [n - 1 for n in lens], ForwardMode.EXTEND))
        calls.clear()
        out = runner.forward(_batch(runner, reqs, [1] * most, ForwardMode.DECODE))
        assert len(calls) == 4 * layers + 1 and set(calls) == {most}
        _check_last(hf_model, out, reqs, atol=0.1)
    calls.clear()
    lens = [5 + i for i in range(most + 1)]
    reqs = _new_reqs(runner, lens)
    runner.forward(_batch(runner, reqs, [n - 1 for n in lens], ForwardMode.EXTEND))
    runner.forward(_batch(runner, reqs, [1] * (most + 1), ForwardMode.DECODE))
    assert calls == []  # one row more than the kernel takes, everywhere
    off = _runner(hf_model, dtype=torch.bfloat16, packed_weights=False)  # worker.packed_weights off: oneDNN only
    calls = spy(off.cpu_kernels.gemm)
    reqs = _new_reqs(off, [9])
    off.forward(_batch(off, reqs, [8], ForwardMode.EXTEND))
    off.forward(_batch(off, reqs, [1], ForwardMode.DECODE))
    assert calls == []


# -- logprobs -----------------------------------------------------------------------------------


def test_input_logprobs_match_hf(hf_model, runner):
    reqs = _new_reqs(runner, [10, 15, 4])
    start_lens = [0, 6, 3]  # the last request only gets its next-token logprob
    batch = _batch(runner, reqs, [10, 15, 4], ForwardMode.EXTEND, start_lens, [0, 3, 2])
    out = runner.forward(batch)
    _check_last(hf_model, out, reqs)
    for i, r in enumerate(reqs):
        ref = torch.log_softmax(_hf_logits(hf_model, r.tokens), dim=-1)
        expected = [ref[p, r.tokens[p + 1]].item() for p in range(start_lens[i], len(r.tokens) - 1)]
        assert out.input_token_logprobs[i] == pytest.approx(expected, abs=ATOL)
        mean = sum(expected) / len(expected) if expected else 0.0
        assert out.normalized_prompt_logprobs[i] == pytest.approx(mean, abs=ATOL)
        k = batch.top_logprobs_nums[i]
        assert len(out.input_top_logprobs[i]) == (len(expected) if k else 0)
        if k:
            vals, ids = ref[-1].topk(k)
            assert [t for _, t in out.next_token_top_logprobs[i]] == ids.tolist()
            assert [v for v, _ in out.next_token_top_logprobs[i]] == pytest.approx(vals.tolist(), abs=ATOL)
            if expected:
                vals, ids = ref[start_lens[i]].topk(k)
                assert [t for _, t in out.input_top_logprobs[i][0]] == ids.tolist()

    batch.sampling_info = _info([1, 1, 1], top_ks=[1, 1, 1])
    next_ids = runner.sample(out, batch)
    ref_lp = torch.log_softmax(out.next_token_logits, dim=-1)
    assert torch.equal(next_ids, out.next_token_logits.argmax(-1))
    torch.testing.assert_close(out.next_token_logprobs, ref_lp.gather(1, next_ids[:, None])[:, 0])


# -- sampler ------------------------------------------------------------------------------------


def _info(temps, top_ps=None, top_ks=None, min_ps=None, seeds=None) -> SamplingBatchInfo:
    """`seeds`: per row a request seed (its first step's key is used) or None."""
    bs = len(temps)
    top_ks = top_ks or [1 << 30] * bs
    min_ps = min_ps or [0.0] * bs
    return SamplingBatchInfo(
        temperatures=torch.tensor(temps, dtype=torch.float32).view(bs, 1),
        top_ps=torch.tensor(top_ps or [1.0] * bs, dtype=torch.float32),
        top_ks=torch.tensor(top_ks, dtype=torch.int64),
        min_ps=torch.tensor(min_ps, dtype=torch.float32),
        seeds=[None if s is None else step_seed(s, 0) for s in seeds or [None] * bs],
        is_all_greedy=all(k <= 1 for k in top_ks),
        need_min_p_sampling=any(p > 0 for p in min_ps),
    )


def _logits(bs, vocab=VOCAB, seed=0, scale=1.0):
    return torch.randn(bs, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def test_sampler_greedy_is_argmax():
    logits = _logits(6)
    ids = Sampler()(logits, _info([1.0] * 6, top_ks=[1] * 6))
    assert ids.dtype == torch.int64 and torch.equal(ids, logits.argmax(-1))


def test_sampler_takes_bf16_logits():
    """bf16 logits (the no-logprob path of a bf16 model): greedy rows are the argmax of their fp32
    widening, sampled rows come from the widened logits."""
    logits = _logits(6).to(torch.bfloat16)
    greedy = Sampler()(logits, _info([1.0] * 6, top_ks=[1] * 6))
    assert torch.equal(greedy, logits.float().argmax(-1))
    info = _info([0.7] * 6, seeds=list(range(6)))
    assert torch.equal(Sampler()(logits, info), Sampler()(logits.float(), info))


def test_sampler_greedy_rows_in_mixed_batch():
    logits = _logits(8, scale=0.1)  # nearly flat: sampled rows almost never hit the argmax
    top_ks = [1, 1 << 30, 1, 1 << 30, 1 << 30, 1, 1 << 30, 1]
    for _ in range(5):
        ids = Sampler()(logits, _info([1.5] * 8, top_ks=top_ks))
        greedy = [i for i, k in enumerate(top_ks) if k == 1]
        assert torch.equal(ids[greedy], logits.argmax(-1)[greedy])


@pytest.mark.parametrize("cpu_kernels", ["auto", "off"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampler_check_greedy_equals_masked_greedy(dtype, cpu_kernels):
    """Draft rows: the shortcut (unmasked argmax where it is the draft) gives exactly the masked
    argmax, on rows whose argmax is the draft, is another allowed token, or is masked out."""
    bs = 12
    logits = _logits(bs).to(dtype)
    top = logits.float().argmax(-1)
    gen = torch.Generator().manual_seed(1)
    allowed = torch.rand(bs, VOCAB, generator=gen) < 0.3
    expected = torch.randint(0, VOCAB, (bs,), generator=gen)
    expected[:4] = top[:4]  # the draft is the argmax
    allowed[torch.arange(4, 8), top[4:8]] = False  # the argmax is masked out
    allowed[torch.arange(8, 12), top[8:12]] = True  # the argmax is allowed but not the draft
    allowed[torch.arange(bs), expected] = True  # a draft is always allowed
    mask = bool_bitmask(allowed)
    info = _info([1.0] * bs, top_ks=[1] * bs)
    info.vocab_mask = mask
    from framework.model.cpu_kernels import pick

    kernels = pick(cpu_kernels, "cpu")
    sampler = Sampler(kernels.fused if kernels else None)
    full = sampler(logits, info)
    assert torch.equal(sampler.check_greedy(logits, info, expected), full)
    assert torch.equal(full[:4], expected[:4]) and not torch.equal(full[4:8], top[4:8])


def test_sampler_seeded_is_reproducible():
    logits = _logits(3, scale=0.1)
    a = Sampler()(logits, _info([1.0] * 3, seeds=[42, None, 7]))
    b = Sampler()(logits, _info([1.0] * 3, seeds=[42, None, 7]))
    assert a[0] == b[0] and a[2] == b[2]
    # A seeded row does not depend on its position or its neighbours.
    c = Sampler()(logits[[2, 0]], _info([1.0] * 2, seeds=[7, 42]))
    assert c[0] == a[2] and c[1] == a[0]
    # Different seeds give different draws (over a near-flat 1000-token distribution).
    draws = Sampler()(logits[[0] * 4], _info([1.0] * 4, seeds=[1, 2, 3, 4]))
    assert len(set(draws.tolist())) > 1
    # Seeded rows also go through the filtered path reproducibly.
    f1 = Sampler()(logits, _info([1.0] * 3, top_ks=[50] * 3, top_ps=[0.9] * 3, seeds=[5, 6, 7]))
    f2 = Sampler()(logits, _info([1.0] * 3, top_ks=[50] * 3, top_ps=[0.9] * 3, seeds=[5, 6, 7]))
    assert torch.equal(f1, f2)


def test_sampler_tiny_top_p_is_argmax():
    logits = _logits(5, scale=0.5)
    ids = Sampler()(logits, _info([1.0] * 5, top_ps=[1e-6] * 5))
    assert torch.equal(ids, logits.argmax(-1))


def test_sampler_top_k_and_min_p_restrict_support():
    base = _logits(1, scale=2.0)[0]
    logits = base.repeat(200, 1)
    probs = torch.softmax(base, -1)
    ids = Sampler()(logits, _info([1.0] * 200, top_ks=[3] * 200))
    assert set(ids.tolist()) <= set(probs.topk(3).indices.tolist())
    min_p = 0.3
    allowed = set(torch.nonzero(probs >= probs.max() * min_p).flatten().tolist())
    ids = Sampler()(logits, _info([1.0] * 200, min_ps=[min_p] * 200))
    assert set(ids.tolist()) <= allowed and len(allowed) < VOCAB


def test_sampler_partial_sort_is_exact(monkeypatch):
    from framework.model import sampler as sampler_mod

    logits = _logits(6, scale=4.0)  # peaky enough that the top 64 hold > top_p of the mass
    info = _info([1.0] * 6, top_ps=[0.8, 0.5, 0.9, 0.7, 0.6, 0.8], min_ps=[0.0, 0.01] + [0.0] * 4,
                 seeds=list(range(6)))
    monkeypatch.setattr(sampler_mod, "_NUM_CANDIDATES", 64)
    partial = Sampler()(logits, info)
    monkeypatch.setattr(sampler_mod, "_NUM_CANDIDATES", VOCAB)
    assert torch.equal(partial, Sampler()(logits, info))


def test_sampler_matches_distribution():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05] + [0.0] * 6)
    logits = probs.log().repeat(4000, 1)  # zero-probability tokens have -inf logits
    ids = Sampler()(logits, _info([1.0] * 4000))
    freq = torch.bincount(ids, minlength=10).float() / 4000
    torch.testing.assert_close(freq, probs, atol=0.03, rtol=0)
    # Temperature 0.5 squares the probabilities (renormalized).
    ids = Sampler()(logits, _info([0.5] * 4000))
    freq = torch.bincount(ids, minlength=10).float() / 4000
    torch.testing.assert_close(freq, probs**2 / (probs**2).sum(), atol=0.03, rtol=0)


# -- the real default model ---------------------------------------------------------------------


@pytest.mark.e2e
def test_default_model_matches_transformers():
    from transformers import AutoModelForCausalLM

    from framework.model import resolve_model

    folder = resolve_model(None, None)
    t0 = time.perf_counter()
    assert resolve_model(None, None) == folder
    assert time.perf_counter() - t0 < 1.0  # cached: no reconversion

    runner = ModelRunner(folder, dtype=torch.float32, max_total_tokens=256, max_running_requests=4)
    assert runner.tokenizer is not None
    assert runner.max_total_num_tokens == 256
    tokens = runner.tokenizer.encode("The capital of France is")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([tokens + [tokens[-1]]])).logits[0].float()

    slot = runner.req_to_token_pool.alloc(1)
    req = Req(tokens + [tokens[-1]], slot[0])
    out = runner.forward(_batch(runner, [req], [len(tokens)], ForwardMode.EXTEND))
    torch.testing.assert_close(out.next_token_logits[0], ref[len(tokens) - 1], atol=1e-3, rtol=0)
    out = runner.forward(_batch(runner, [req], [1], ForwardMode.DECODE))
    torch.testing.assert_close(out.next_token_logits[0], ref[-1], atol=1e-3, rtol=0)


def test_bf16_on_a_cpu_without_bf16_arithmetic_is_named(hf_model, monkeypatch, caplog):
    """A bf16 model on a CPU without avx512_bf16 or amx_bf16 (AVX2 CPUs such as an AMD EPYC Zen 3,
    where PyTorch's bf16 GEMMs run ~10x slower than float32) starts with a warning that says so;
    float32 does not warn, nor bf16 where the CPU has bf16 arithmetic."""
    from framework.model.cpu import has_bf16_arithmetic

    assert has_bf16_arithmetic("fpu avx2 avx512f avx512_bf16") and has_bf16_arithmetic("fpu amx_bf16 amx_tile")
    assert not has_bf16_arithmetic("fpu fma avx2") and not has_bf16_arithmetic("fpu avx512f avx512_vnni")
    for available, dtype, warns in ((False, torch.bfloat16, True), (False, torch.float32, False),
                                    (True, torch.bfloat16, False)):
        monkeypatch.setattr("framework.model.runner.has_bf16_arithmetic", lambda: available)
        caplog.clear()
        with caplog.at_level("WARNING", logger="framework.model.runner"):
            _runner(hf_model, dtype=dtype)
        assert ("without bf16 arithmetic" in caplog.text) == warns, (available, dtype)
