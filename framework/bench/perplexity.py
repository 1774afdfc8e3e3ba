"""`batchyard bench perplexity`: how well a model under some settings predicts real conversations.

What a setting that changes the outputs (model.dtype, model.kv_cache_dtype, model.quantization)
costs in quality, measured the same way for each: `--num-prompts` ShareGPT conversations (first
two turns, shuffled with `--seed`, through the model's chat template, cut to `--max-len` tokens)
are scored token by token (teacher forcing), and the tool reports

* ``perplexity``: exp of the mean negative log-likelihood of every token after the first;
* ``top1_accuracy``: how often the model's most likely next token is the text's;
* ``tokens``: how many tokens were scored.

``--backend batchyard`` (the default) runs the engine with the command's settings (prompt logprobs
of one-token requests, no prefix cache shared between them); ``--backend hf`` runs transformers on
the same folder in float32, the reference the equality tests use. One record per run
(``--output-file``), as the other tools.
"""

from __future__ import annotations

import math
import random

import torch


def conversations(tokenizer, num: int, max_len: int, seed: int, path: str | None = None,
                  min_len: int = 16) -> list[list[int]]:
    """Token ids of `num` ShareGPT conversations (user turn, assistant turn) in the chat template,
    each cut to `max_len` tokens; shorter than `min_len` ones are skipped."""
    from framework.bench.datasets import load_sharegpt_pairs

    if num < 1:
        raise ValueError(f"--num-prompts must be at least 1, got {num}")
    if max_len < min_len:
        raise ValueError(f"--max-len must be at least {min_len} tokens, got {max_len}")
    pairs = load_sharegpt_pairs(path)
    random.Random(seed).shuffle(pairs)
    out: list[list[int]] = []
    for user, assistant in pairs:
        if len(out) == num:
            break
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        ids = tokenizer.apply_chat_template(messages, tokenize=True)
        ids = list(getattr(ids, "input_ids", ids))[:max_len]
        if len(ids) >= min_len:
            out.append(ids)
    if len(out) < num:
        raise ValueError(f"only {len(out)} ShareGPT conversations of {min_len}+ tokens, {num} asked for")
    return out


def score(token_logprobs: list[float], top1_hits: list[bool]) -> dict:
    """The metrics (module docstring) of the scored tokens' logprobs and top-1 hits."""
    if not token_logprobs:
        raise ValueError("no tokens were scored")
    nll = -sum(token_logprobs) / len(token_logprobs)
    return {"tokens": len(token_logprobs), "mean_nll": nll, "perplexity": math.exp(nll),
            "top1_accuracy": sum(top1_hits) / len(top1_hits)}


def engine_scores(engine, prompts: list[list[int]], progress: bool = True) -> tuple[list[float], list[bool]]:
    """Each prompt's token logprobs (after the first token) and whether each was the engine's
    top-1, from one-token requests with prompt logprobs."""
    from tqdm import tqdm

    logprobs: list[float] = []
    hits: list[bool] = []
    for ids in tqdm(prompts, desc="scoring", unit="conv", disable=not progress):
        out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 1, "temperature": 0},
                              return_logprob=True, logprob_start_len=0, top_logprobs_num=1)
        meta = out["meta_info"]
        for (lp, token), top in zip(meta["input_token_logprobs"][1:], meta["input_top_logprobs"][1:]):
            logprobs.append(lp)
            hits.append(top[0][1] == token)
    return logprobs, hits


def hf_scores(folder: str, prompts: list[list[int]], progress: bool = True) -> tuple[list[float], list[bool]]:
    """The same from transformers in float32 on `folder`."""
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    logprobs: list[float] = []
    hits: list[bool] = []
    with torch.no_grad():
        for ids in tqdm(prompts, desc="scoring (hf)", unit="conv", disable=not progress):
            x = torch.tensor([ids])
            lp = torch.log_softmax(model(x).logits[0, :-1].float(), dim=-1)
            target = x[0, 1:]
            logprobs += lp.gather(1, target[:, None])[:, 0].tolist()
            hits += (lp.argmax(dim=-1) == target).tolist()
    return logprobs, hits


def main(args) -> int:
    from framework.bench.offline import engine_dtype
    from framework.bench.results import (ContentionMeter, append_jsonl, bench_args, format_report, hardware_info,
                                         make_record)
    from framework.bench.settings import bench_settings, settings_record
    from framework.engine import Engine
    from framework.model.loader import load_tokenizer, resolve_model

    settings = bench_settings(args)
    folder = resolve_model(settings.model.path)
    prompts = conversations(load_tokenizer(folder), args.num_prompts, args.max_len, args.seed, args.dataset_path)
    meter = ContentionMeter()
    workload = {"dataset": "sharegpt", "conversations": len(prompts), "max_len": args.max_len, "seed": args.seed}
    int8_head = False
    if args.backend == "hf":
        metrics = score(*hf_scores(folder, prompts, not args.disable_tqdm))
        dtype, engine_settings = "float32", {}
    else:
        with Engine(settings) as engine:
            metrics = score(*engine_scores(engine, prompts, not args.disable_tqdm))
            dtype, engine_settings = engine_dtype(engine), settings_record(settings)
            # (what the runner made of model.int8_lm_head: "auto" keeps a bf16 head on AMX tiles)
            runner = getattr(engine.scheduler.worker, "runner", None)
            int8_head = getattr(runner, "int8_lm_head", settings.model.int8_head) is True
    title = f"Perplexity ({args.backend}, {dtype}, model.quantization = {settings.model.quantization}"
    title += ", int8 LM head)" if int8_head else ")"
    print(format_report(title, metrics))
    record = make_record("perplexity", args.backend, bench_args(args), workload, metrics, hardware_info(dtype, meter),
                         engine_settings=engine_settings)
    append_jsonl(args.output_file, record)
    return 0
