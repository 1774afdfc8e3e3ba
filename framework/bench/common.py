"""Glue shared by the tools: the tokenizer and the workload named by the command-line options."""

from __future__ import annotations

import logging

from framework.bench import datasets
from framework.bench.datasets import BenchRequest

logger = logging.getLogger(__name__)


def load_bench_tokenizer(path: str | None = None):
    """The tokenizer of `path` (a model folder or .gguf), or of the embedded default model."""
    from framework.model.loader import load_tokenizer, resolve_model

    folder = resolve_model(path)
    tokenizer = load_tokenizer(folder)
    if tokenizer is None:
        raise ValueError(f"{folder} has no tokenizer: pass --tokenizer")
    return tokenizer


def build_requests(args, tokenizer) -> list[BenchRequest]:
    """The workload of `args.dataset` with the sampling options, output cap applied."""
    name = args.dataset
    if name == "sharegpt":
        reqs = datasets.sample_sharegpt(
            tokenizer, args.num_prompts, seed=args.seed,
            fixed_output_len=args.sharegpt_output_len, path=args.dataset_path,
        )
    elif name == "random":
        reqs = datasets.sample_random(
            tokenizer, args.num_prompts, input_len=args.random_input_len,
            output_len=args.random_output_len, range_ratio=args.random_range_ratio,
            seed=args.seed, source=args.random_source, path=args.dataset_path,
        )
    elif name == "generated-shared-prefix":
        reqs = datasets.sample_generated_shared_prefix(
            tokenizer, num_groups=args.gsp_num_groups, prompts_per_group=args.gsp_prompts_per_group,
            system_prompt_len=args.gsp_system_prompt_len, question_len=args.gsp_question_len,
            output_len=args.gsp_output_len, seed=args.seed,
        )
    else:
        raise ValueError(f"unknown dataset {name!r}; choose from {', '.join(datasets.DATASET_NAMES)}")
    reqs = datasets.cap_output_len(reqs, args.max_output_len)
    if not reqs:
        raise ValueError(f"the {name} dataset gave no requests")
    stats = datasets.describe(reqs)
    logger.info(
        "%s: %d requests, %d input / %d output tokens (mean %.1f / %.1f)", name,
        stats["num_requests"], stats["total_input_tokens"], stats["total_output_tokens"],
        stats["mean_input_len"], stats["mean_output_len"],
    )
    return reqs
