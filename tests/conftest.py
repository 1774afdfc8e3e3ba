"""Shared fixtures: the tiny random llama, engines with the leak check on, the equality rule."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import warnings

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
    rms_norm_eps=1e-5,
)


@pytest.fixture(scope="session")
def default_model_folder() -> str:
    """The embedded SmolLM2 model, converted once to a cached safetensors folder."""
    from framework.model.loader import resolve_model

    return resolve_model(None)


@pytest.fixture(scope="session")
def default_tokenizer(default_model_folder):
    from framework.model.loader import load_tokenizer

    return load_tokenizer(default_model_folder)


def save_random_model(model, folder, tokenizer) -> str:
    """Redraw a random model's matrices from N(0, 0.2) and save it with `tokenizer` as an HF folder.
    Larger weights than the default init make the logits less flat, so greedy decoding meets
    fewer near-ties."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_model_folder(tmp_path_factory, default_tokenizer) -> str:
    """A tiny random-weight llama with the default model's tokenizer, saved as an HF folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=len(default_tokenizer),
        bos_token_id=default_tokenizer.bos_token_id,
        eos_token_id=default_tokenizer.eos_token_id,
        **TINY_CONFIG,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    return save_random_model(model, folder, default_tokenizer)


def tiny_settings(folder: str, **sections):
    """Settings for the tiny model, fp32, leak check on. `sections` override per section."""
    from framework.config import Settings

    base = {
        "model": {"path": folder, "dtype": "float32"},
        "cache": {"max_total_tokens": 20000},
        "scheduler": {"check_leaks": True},
    }
    for name, values in sections.items():
        base.setdefault(name, {}).update(values)
    return Settings.load(None, **base)


def assert_no_leak(engine) -> None:
    """Run the idle check with leaks as errors: all KV and request slots free or cached."""
    sched = engine.scheduler
    assert not sched.has_work()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sched.check_memory()
    assert sched.token_to_kv_pool.available_size() + sched.tree_cache.evictable_size() == sched.max_total_num_tokens
    assert sched.req_to_token_pool.available_size() == sched.req_to_token_pool.size


def leak_checked_engines(folder: str):
    """Generator for a fixture: yields a factory of engines on `folder`; after the test each engine
    is leak-checked and shut down (shut down even when its check fails)."""
    from framework.engine import Engine

    engines = []

    def factory(extra_plugins=(), **sections):
        engine = Engine(tiny_settings(folder, **sections), extra_plugins=extra_plugins)
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        try:
            assert_no_leak(engine)
        finally:
            engine.shutdown()


@pytest.fixture
def make_engine(tiny_model_folder):
    """Factory for engines on the tiny model; each is leak-checked and shut down after the test."""
    yield from leak_checked_engines(tiny_model_folder)


def _int_mm_is_exact() -> bool:
    from framework.model.int8 import int_mm_is_exact

    return int_mm_is_exact()


# model.quantization = "w8a8" refuses to start where torch._int_mm saturates (no int8 dot product, or
# oneDNN capped below one): its tests skip there.
needs_exact_int_mm = pytest.mark.skipif(not _int_mm_is_exact(), reason="torch._int_mm saturates on this CPU "
                                        "(no int8 dot product): model.quantization = 'w8a8' is refused here")


def count_int_mm_rows(monkeypatch) -> list[int]:
    """The row count of every torch._int_mm call from now on (model.quantization = "w8a8"'s GEMMs),
    in a list that grows as they are made."""
    rows: list[int] = []
    real = torch._int_mm

    def counted(a, b, **kw):
        rows.append(a.shape[0])
        return real(a, b, **kw)

    monkeypatch.setattr(torch, "_int_mm", counted)
    return rows


def check_greedy_equal(ours: list[int], ref: list[int], ref_logprobs_fn, tol: float = 0.01) -> int:
    """The project's equality rule for greedy outputs.

    Identical, or they first differ at a near-tie: there the reference's logprobs of the two
    tokens differ by less than `tol`. `ref_logprobs_fn(prefix_output_ids)` returns the reference's
    next-token logprobs (1-D tensor) after the given output prefix. Returns 1 if a tie was met.
    """
    n = min(len(ours), len(ref))
    for i in range(n):
        if ours[i] != ref[i]:
            logprobs = ref_logprobs_fn(ref[:i])
            gap = abs(float(logprobs[ref[i]]) - float(logprobs[ours[i]]))
            assert gap < tol, (
                f"outputs diverge at position {i} without a near-tie: ours {ours[i]}, ref {ref[i]}, "
                f"logprob gap {gap:.4f}\nours={ours}\nref ={ref}"
            )
            return 1
    assert len(ours) == len(ref), f"lengths differ: {len(ours)} vs {len(ref)}\nours={ours}\nref ={ref}"
    return 0


@pytest.fixture(scope="session")
def hf_tiny(tiny_model_folder):
    """transformers' LlamaForCausalLM on the tiny model's weights: the reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_folder, dtype=torch.float32)
    return model.eval()


def hf_next_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0, -1].float()
    return torch.log_softmax(logits, dim=-1)


def hf_greedy(hf_model, prompt: list[int], num_tokens: int) -> list[int]:
    """Greedy continuation by the reference with its own KV cache, EOS ignored."""
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]), max_new_tokens=num_tokens, min_new_tokens=num_tokens,
            do_sample=False, pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


def assert_same_greedy(runs: dict[str, list[list[int]]], prompts, baseline: list[list[int]], hf_model) -> int:
    """Every run's outputs equal `baseline` under the equality rule; returns the near-ties met."""
    ties = 0
    for name, outputs in runs.items():
        for prompt, ours, ref in zip(prompts, outputs, baseline):
            try:
                ties += check_greedy_equal(ours, ref, lambda prefix: hf_next_logprobs(hf_model, prompt + prefix))
            except AssertionError as exc:
                raise AssertionError(f"{name}: {exc}") from None
    return ties


@pytest.fixture(scope="session")
def sharegpt_prompts(default_tokenizer):
    """40 ShareGPT prompts (token ids), seeded, as the benchmark samples them."""
    from framework.bench.datasets import sample_sharegpt

    return [r.prompt_ids for r in sample_sharegpt(default_tokenizer, 40, seed=7)]


@pytest.fixture(scope="session")
def tiny_embedding_folder(tmp_path_factory, default_tokenizer) -> str:
    """A tiny random `LlamaModel` (a decoder without LM head: an embedding model) as an HF folder."""
    from transformers import LlamaConfig, LlamaModel

    folder = tmp_path_factory.mktemp("tiny-llama-embedding")
    config = LlamaConfig(vocab_size=len(default_tokenizer), **TINY_CONFIG)
    torch.manual_seed(1)
    model = LlamaModel(config)
    return save_random_model(model, folder, default_tokenizer)


@pytest.fixture(scope="session")
def hf_embedder(tiny_embedding_folder):
    from transformers import AutoModel

    return AutoModel.from_pretrained(tiny_embedding_folder, dtype=torch.float32).eval()


def hf_embedding(decoder, ids: list[int]) -> torch.Tensor:
    """The reference: transformers' last hidden state of the last token, normalized."""
    with torch.no_grad():
        hidden = decoder(torch.tensor([ids])).last_hidden_state[0, -1]
    return torch.nn.functional.normalize(hidden.float(), dim=0)


def assert_same_direction(ours: list[float], ref: torch.Tensor, min_cosine: float = 0.999) -> None:
    vec = torch.tensor(ours)
    assert vec.shape == ref.shape
    assert abs(float(vec.norm()) - 1.0) < 1e-4
    cosine = float(torch.dot(vec, ref))
    assert cosine >= min_cosine, f"cosine {cosine:.6f}"


def bool_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """[rows, vocab] bool -> xgrammar's int32 token bitmask (bit j of word w: token 32w + j)."""
    rows, vocab = allowed.shape
    words = (vocab + 31) // 32
    bits = torch.zeros(rows, words * 32, dtype=torch.int64)
    bits[:, :vocab] = allowed.to(torch.int64)
    packed = (bits.view(rows, words, 32) << torch.arange(32)).sum(dim=2)
    return torch.where(packed >= 1 << 31, packed - (1 << 32), packed).to(torch.int32)


@contextlib.contextmanager
def aiohttp_app_in_thread(app):
    """Serve the aiohttp `app` on 127.0.0.1 (a free port) from a thread of its own; yields its base
    URL, and stops it on exit (the bench's fake servers)."""
    from aiohttp import web

    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
