"""Sampling features: batched penalties against transformers' logits processors (and the OpenAI
formula for frequency/presence), through filter / merge / retraction / mixed chunked prefill, and
per-request seeds. Engines are leak-checked by the `make_engine` fixture."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)

from framework import hookimpl
from framework.batch import SamplingBatchInfo, step_seed
from framework.model import Sampler
from framework.penalties import BatchPenalties, RepetitionPenalizer
from framework.request import Req, SamplingParams
from tests.conftest import check_greedy_equal

VOCAB = 64
EOS = 1


# -- the reference: transformers' processors, and the OpenAI formula ---------------------------------


def reference_penalized(logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams,
                        eos_ids: set[int]) -> torch.Tensor:
    """One request's next-token logits [vocab] after its penalties, computed independently."""
    counts = torch.bincount(torch.tensor(output, dtype=torch.int64), minlength=logits.shape[-1]).float()
    logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
    ids = torch.tensor([prompt + output])
    if params.repetition_penalty != 1.0:
        logits = RepetitionPenaltyLogitsProcessor(float(params.repetition_penalty))(ids, logits[None])[0]
    if params.min_new_tokens > 0:
        stops = sorted(set(params.stop_token_ids or ()) | eos_ids)
        logits = MinNewTokensLengthLogitsProcessor(len(prompt), params.min_new_tokens, stops)(ids, logits[None])[0]
    return logits


def make_req(rid: str, prompt: list[int], output: list[int] | None = None, **params) -> Req:
    sampling = SamplingParams(**params)
    sampling.verify()
    sampling.normalize()
    req = Req(rid, prompt, sampling, eos_token_ids={EOS})
    req.output_ids = list(output or [])
    return req


def assert_rows_match_reference(penalties: BatchPenalties, reqs: list[Req], logits: torch.Tensor) -> None:
    ours = penalties.apply(logits)
    for i, req in enumerate(reqs):
        ref = reference_penalized(logits[i], req.origin_input_ids, req.output_ids, req.sampling_params, {EOS})
        assert torch.equal(ours[i], ref), f"row {i} ({req.rid}) differs from the reference"


def decode_step(penalties: BatchPenalties, reqs: list[Req], gen: torch.Generator) -> None:
    """Check one step against the reference, then sample a token per request and count it."""
    logits = torch.randn(len(reqs), VOCAB, generator=gen) * 3
    assert_rows_match_reference(penalties, reqs, logits)
    # Tokens from a small range, so repeats (and the stop token 5, the EOS 1) actually occur.
    tokens = torch.randint(0, 8, (len(reqs),), generator=gen)
    for req, token in zip(reqs, tokens.tolist()):
        req.output_ids.append(token)
    penalties.cumulate_output_tokens(tokens)


def test_penalties_match_transformers_through_filter_and_merge():
    gen = torch.Generator().manual_seed(0)

    def prompt() -> list[int]:
        return torch.randint(0, VOCAB, (6,), generator=gen).tolist()

    reqs = [
        make_req("rep+freq", prompt(), repetition_penalty=1.3, frequency_penalty=0.5),
        make_req("plain", prompt()),
        make_req("presence+min_new", prompt(), presence_penalty=0.7, min_new_tokens=3, stop_token_ids=[5]),
        make_req("rep<1+min_new", prompt(), repetition_penalty=0.8, min_new_tokens=2),
    ]
    penalties = BatchPenalties.from_reqs(reqs, VOCAB)
    assert set(penalties.penalizers) == set(BatchPenalties.KINDS)
    # A logits row that a penalty does not touch is unchanged, bit for bit.
    logits = torch.randn(len(reqs), VOCAB, generator=gen)
    assert torch.equal(penalties.apply(logits)[1], logits[1])
    for _ in range(3):
        decode_step(penalties, reqs, gen)

    # Two requests finish: the others keep their rows.
    keep = [0, 3]
    penalties = penalties.filter(keep)
    reqs = [reqs[i] for i in keep]
    decode_step(penalties, reqs, gen)

    # A prefill joins: a fresh request and a retracted one that comes back with 4 outputs.
    joining = [
        make_req("fresh", prompt(), frequency_penalty=-0.4, presence_penalty=0.2, min_new_tokens=6),
        make_req("retracted", prompt(), [3, 3, 7, 5], repetition_penalty=1.5, frequency_penalty=1.0),
    ]
    penalties = penalties.merge(BatchPenalties.from_reqs(joining, VOCAB))
    reqs = reqs + joining
    for _ in range(3):
        decode_step(penalties, reqs, gen)

    # Rows kept up step by step equal rows rebuilt from the requests (what a retraction does).
    logits = torch.randn(len(reqs), VOCAB, generator=gen)
    rebuilt = BatchPenalties.from_reqs(reqs, VOCAB)
    assert torch.equal(penalties.apply(logits), rebuilt.apply(logits))

    # When no remaining request uses a penalizer, the filtered batch drops it.
    penalties = penalties.filter([2])
    reqs = [reqs[2]]
    assert RepetitionPenalizer not in penalties.penalizers
    decode_step(penalties, reqs, gen)


def test_merge_with_a_batch_without_penalties_pads_neutral_rows():
    plain = BatchPenalties.from_reqs([make_req("a", [2, 3])], VOCAB)
    assert not plain.is_active
    penalized = BatchPenalties.from_reqs([make_req("b", [4, 4], [4], repetition_penalty=2.0)], VOCAB)
    logits = torch.randn(2, VOCAB)
    for merged, plain_row in ((plain.merge(penalized), 0), (penalized.merge(plain), 1)):
        out = merged.apply(logits)
        assert torch.equal(out[plain_row], logits[plain_row])
        assert not torch.equal(out[1 - plain_row], logits[1 - plain_row])


def test_sampler_applies_penalties_and_keeps_raw_logits():
    reqs = [make_req("greedy", [9], temperature=0, min_new_tokens=2, stop_token_ids=[5]),
            make_req("sampled", [9], min_new_tokens=2)]
    penalties = BatchPenalties.from_reqs(reqs, VOCAB)
    logits = torch.zeros(2, VOCAB)
    logits[:, 5] = 50.0  # row 0's stop token
    logits[:, EOS] = 49.0
    raw = logits.clone()
    info = SamplingBatchInfo.from_reqs(reqs, penalties)
    for _ in range(20):
        ids = Sampler()(logits, info)
        assert ids[0] not in (5, EOS) and ids[1] != EOS
    assert torch.equal(logits, raw)
    # Once min_new_tokens outputs exist, the stop tokens are back.
    penalties.cumulate_output_tokens(torch.tensor([7, 7]))
    penalties.cumulate_output_tokens(torch.tensor([7, 7]))
    assert Sampler()(logits, SamplingBatchInfo.from_reqs(reqs, penalties))[0] == 5


@pytest.mark.parametrize("own", [{}, {"top_p": 0.8}, {"top_k": 50}], ids=["plain", "top_p", "top_k"])
@pytest.mark.parametrize("neighbour", [{"temperature": 0}, {"top_p": 0.9}, {"top_k": 40}, {"min_p": 0.1}, {}],
                         ids=["greedy", "top_p", "top_k", "min_p", "plain"])
def test_a_seeded_row_draws_the_same_whatever_its_neighbours_filter(own, neighbour):
    """docs/api.md, Seeds: the same draws whatever else is in the batch. Before, a batch where any
    row filtered (greedy is top_k 1) drew every row from its sorted candidates, so an unfiltered
    seeded row took another token next to a greedy one than alone."""
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))  # a flat distribution
    for step in range(20):
        seeded = make_req("seeded", [9], seed=step, **own)
        alone = Sampler()(logits[:1], SamplingBatchInfo.from_reqs([seeded]))
        reqs = [seeded, make_req("n1", [9], **neighbour), make_req("n2", [9], seed=3, **neighbour)]
        for order in ([0, 1, 2], [1, 0, 2], [2, 1, 0]):
            batch = [reqs[i] for i in order]
            ids = Sampler()(logits[order], SamplingBatchInfo.from_reqs(batch))
            assert ids[order.index(0)] == alone[0], (step, order)


def test_step_seed_depends_on_seed_and_step_only():
    keys = {step_seed(seed, step) for seed in range(50) for step in range(50)}
    assert len(keys) == 2500  # nearby seeds and steps do not collide
    assert step_seed(7, 3) == step_seed(7, 3) and 0 <= step_seed(-1, 0) < 1 << 64


# -- end to end on the tiny llama -------------------------------------------------------------------


NEW = 16


def hf_penalized_logits(hf_model, prompt: list[int], output: list[int], params: dict, eos: int) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + output])).logits[0, -1].float()
    sampling = SamplingParams(**params)
    sampling.normalize()
    return reference_penalized(logits, prompt, output, sampling, {eos})


def reference_greedy(hf_model, prompt: list[int], params: dict, eos: int) -> list[int]:
    """Greedy decoding over the reference's penalized logits, with the scheduler's stop rules."""
    output: list[int] = []
    stops = set(params.get("stop_token_ids") or ()) | {eos}
    while len(output) < params["max_new_tokens"]:
        token = int(hf_penalized_logits(hf_model, prompt, output, params, eos).argmax())
        output.append(token)
        if not params.get("ignore_eos") and len(output) > params.get("min_new_tokens", 0) and token in stops:
            break
    return output


def assert_equal_to_reference(hf_model, prompts, params_list, outputs, refs, eos) -> int:
    ties = 0
    for prompt, params, ours, ref in zip(prompts, params_list, outputs, refs):
        ties += check_greedy_equal(
            ours, ref,
            lambda prefix, prompt=prompt, params=params: torch.log_softmax(
                hf_penalized_logits(hf_model, prompt, prefix, params, eos), -1),
        )
    return ties


def greedy(**extra) -> dict:
    return {"temperature": 0, "max_new_tokens": NEW, "min_new_tokens": NEW, "ignore_eos": True, **extra}


@pytest.fixture
def make_engine(make_engine):
    """Penalties apply only on the plain worker (the overlap worker drops them, as 0.3.6): ask for
    the documented fallback."""

    def factory(extra_plugins=(), **sections):
        sections.setdefault("worker", {}).setdefault("overlap_penalties", "fallback")
        return make_engine(extra_plugins, **sections)

    return factory


@pytest.fixture(scope="module")
def prompts(sharegpt_prompts):
    return [p[:64] for p in sharegpt_prompts[:12]]


@pytest.fixture(scope="module")
def plain_refs(hf_tiny, prompts):
    """The reference's unpenalized greedy outputs."""
    return [reference_greedy(hf_tiny, p, greedy(), hf_tiny.config.eos_token_id) for p in prompts]


def test_repetition_penalty_greedy_equals_transformers_generate(make_engine, hf_tiny, prompts, plain_refs):
    # The random model rarely repeats itself; a penalty can only matter where it does.
    subset = [p for p, ref in zip(prompts, plain_refs) if len(set(ref)) < len(ref)][:4]
    assert len(subset) >= 3
    engine = make_engine()
    penalized = [r["output_ids"] for r in engine.generate(input_ids=subset, sampling_params=greedy(repetition_penalty=1.8))]
    plain = [r["output_ids"] for r in engine.generate(input_ids=subset, sampling_params=greedy())]
    assert all(a != b for a, b in zip(penalized, plain))  # the penalty changes what greedy picks
    eos = hf_tiny.config.eos_token_id
    refs = []
    for prompt in subset:
        with torch.no_grad():
            out = hf_tiny.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                   repetition_penalty=1.8, pad_token_id=0)
        refs.append(out[0, len(prompt):].tolist())
    ties = assert_equal_to_reference(hf_tiny, subset, [greedy(repetition_penalty=1.8)] * len(subset), penalized,
                                     refs, eos)
    print(f"near-ties: {ties}")


def mixed_settings(prompt_count: int, stop_candidates: list[int]) -> list[dict]:
    """Per-request settings that differ, with lengths that differ so requests leave mid-run."""
    kinds = [
        {},
        {"repetition_penalty": 1.6},
        {"frequency_penalty": 1.5, "presence_penalty": 0.5},
        {"presence_penalty": -1.0, "repetition_penalty": 0.7},
        {"frequency_penalty": 2.0, "repetition_penalty": 1.3},
    ]
    settings = []
    for i in range(prompt_count):
        params = greedy(max_new_tokens=NEW - 2 * (i % 3), min_new_tokens=0, **kinds[i % len(kinds)])
        if i % 4 == 3:
            # A stop token the request would emit early, masked until min_new_tokens.
            params.update(ignore_eos=False, min_new_tokens=3, stop_token_ids=[stop_candidates[i]])
        settings.append(params)
    return settings


class ModeCounter:
    def __init__(self):
        self.mixed = 0

    @hookimpl
    def on_batch_result(self, batch, result):
        self.mixed += batch.forward_mode.name == "MIXED"


def test_batched_penalties_equal_the_reference(make_engine, hf_tiny, prompts, plain_refs):
    """Twelve requests with different penalties in one engine: finishes (filter), arrivals in
    several prefill rounds (merge), forced retraction and mixed chunked prefill. Each request's
    greedy output equals the reference computed for it alone."""
    eos = hf_tiny.config.eos_token_id
    settings = mixed_settings(len(prompts), [out[1] for out in plain_refs])
    counter = ModeCounter()
    engine = make_engine(
        extra_plugins=(counter,),
        scheduler={"force_retract": True, "enable_mixed_chunk": True,
                   "chunked_prefill_size": 64, "max_prefill_tokens": 128},
    )
    outputs = [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params=settings)]
    assert engine.scheduler.num_retractions > 0 and counter.mixed > 0
    refs = [reference_greedy(hf_tiny, p, s, eos) for p, s in zip(prompts, settings)]
    assert sum(o != p[: len(o)] for o, p in zip(outputs, plain_refs)) >= 4
    ties = assert_equal_to_reference(hf_tiny, prompts, settings, outputs, refs, eos)
    print(f"near-ties: {ties}")
    assert ties <= 2


def test_seeded_request_is_the_same_whatever_the_batch(make_engine, prompts):
    """A seeded request alone, and among eleven others under forced retraction, samples the same."""
    seeded = {"temperature": 0.9, "max_new_tokens": NEW, "ignore_eos": True, "repetition_penalty": 1.2}
    engine = make_engine(scheduler={"force_retract": True, "chunked_prefill_size": 64})
    alone = [engine.generate(input_ids=prompts[i], sampling_params={**seeded, "seed": 100 + i})["output_ids"]
             for i in (0, 5)]
    params = [{"temperature": 1.0, "max_new_tokens": NEW - (i % 4), "ignore_eos": True} for i in range(len(prompts))]
    params[0] = {**seeded, "seed": 100}
    params[5] = {**seeded, "seed": 105}
    batched = engine.generate(input_ids=prompts, sampling_params=params)
    assert engine.scheduler.num_retractions > 0
    assert [batched[0]["output_ids"], batched[5]["output_ids"]] == alone
    other_seed = engine.generate(input_ids=prompts[0], sampling_params={**seeded, "seed": 7})["output_ids"]
    assert other_seed != alone[0]
