"""Run a token-id workload through vLLM's offline `LLM.generate` and print one JSON line.

This file runs under *vLLM's* interpreter (its own venv, `batchyard bench peers setup vllm`), not
batchyard's: it imports nothing from batchyard. `bench offline --backend vllm` starts it as

    VLLM_PYTHON vllm_runner.py --model FOLDER --data WORKLOAD.jsonl [--dtype bfloat16 ...]

WORKLOAD.jsonl has one request a line: {"prompt_ids": [...], "output_len": n}. Every request is
greedy with EOS ignored, so it generates exactly output_len tokens. One warm-up request (ids not
taken from the workload) runs first and the prefix cache is reset; only the one generate() call
over all requests is timed. vLLM logs to stderr; the last stdout line is the result:

    {"elapsed_s": ..., "output_tokens": ..., "input_tokens": ..., "requests": ..., "vllm": "0.32.0",
     "other_cpu_busy": ..., "settings": {...}}

vLLM's CPU backend wants tcmalloc and Intel OpenMP preloaded; the loader reads LD_PRELOAD only
when a program starts, so the script sets it and starts itself again once.
"""

import argparse
import json
import os
import sys
import time

# framework/preload.py has the same paths for the engine; this script imports nothing from batchyard.
TCMALLOC_PATHS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4")
REEXEC_FLAG = "_BATCHYARD_VLLM_PRELOADED"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="Hugging Face folder (config.json + safetensors)")
    ap.add_argument("--data", required=True, help="JSONL workload: prompt_ids, output_len")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--kv-cache-dtype", default="auto", help="vLLM's kv_cache_dtype (auto, fp8_e5m2, ...)")
    ap.add_argument("--kv-cache-gb", type=int, default=4, help="VLLM_CPU_KVCACHE_SPACE")
    ap.add_argument("--threads-bind", default=None,
                    help="VLLM_CPU_OMP_THREADS_BIND (default: every CPU of the machine, e.g. 0-1; "
                         "vLLM's own 'auto' leaves one core to its engine process)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--enforce-eager", action="store_true", help="no torch.compile")
    ap.add_argument("--no-preload", action="store_true", help="leave LD_PRELOAD as it is")
    return ap.parse_args(argv)


def preload(prefix: str, current: str = "") -> str:
    """LD_PRELOAD for vLLM's CPU backend: tcmalloc and the venv `prefix`'s Intel OpenMP, then `current`."""
    libs = [p for p in current.replace(" ", ":").split(":") if p]
    extra = []
    tcmalloc = next((p for p in TCMALLOC_PATHS if os.path.exists(p)), None)
    if tcmalloc and not any("tcmalloc" in p for p in libs):
        extra.append(tcmalloc)
    iomp = os.path.join(prefix, "lib", "libiomp5.so")
    if os.path.exists(iomp) and not any("omp" in os.path.basename(p) for p in libs):
        extra.append(iomp)
    return ":".join(extra + libs)


def preload_and_reexec(args) -> None:
    """Start this script again with tcmalloc and the venv's libiomp5 in LD_PRELOAD."""
    if args.no_preload or os.environ.get(REEXEC_FLAG) == "1":
        return
    env = dict(os.environ, LD_PRELOAD=preload(sys.prefix, os.environ.get("LD_PRELOAD", "")), **{REEXEC_FLAG: "1"})
    os.execve(sys.executable, [sys.executable, os.path.abspath(__file__)] + sys.argv[1:], env)


def tree_cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` and all its live descendants (vLLM runs an engine-core child)."""
    tick = os.sysconf("SC_CLK_TCK")
    total, todo, seen = 0.0, [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            continue
    return total


def machine_busy_seconds() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def load_workload(path):
    reqs = []
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                reqs.append(([int(t) for t in r["prompt_ids"]], int(r["output_len"])))
    if not reqs:
        sys.exit(f"no requests in {path}")
    return reqs


def main(argv=None) -> None:
    args = parse_args(argv)
    preload_and_reexec(args)
    ncpu = os.cpu_count() or 1
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gb)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.threads_bind or f"0-{ncpu - 1}"
    for key, value in (("VLLM_TARGET_DEVICE", "cpu"), ("VLLM_LOGGING_STREAM", "ext://sys.stderr"),
                       ("VLLM_NO_USAGE_STATS", "1"), ("DO_NOT_TRACK", "1"), ("HF_HUB_OFFLINE", "1"),
                       ("TRANSFORMERS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(key, value)
    reqs = load_workload(args.data)

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    settings = dict(model=args.model, dtype=args.dtype, max_model_len=max(2048, max(len(p) + n for p, n in reqs)),
                    max_num_seqs=args.max_num_seqs, enable_prefix_caching=True, enable_chunked_prefill=True,
                    enforce_eager=args.enforce_eager, skip_tokenizer_init=True, seed=0,
                    kv_cache_dtype=args.kv_cache_dtype)
    if args.max_num_batched_tokens:
        settings["max_num_batched_tokens"] = args.max_num_batched_tokens
    print(f"[vllm_runner] LLM({settings}) bind={os.environ['VLLM_CPU_OMP_THREADS_BIND']} "
          f"LD_PRELOAD={os.environ.get('LD_PRELOAD', '')}", file=sys.stderr, flush=True)
    llm = LLM(**settings)

    def params(n):
        return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False)

    vocab_hi = max(max(p) for p, _ in reqs if p) + 1
    warm = [(7919 * i + 13) % vocab_hi for i in range(256)]
    llm.generate([TokensPrompt(prompt_token_ids=warm)], params(16), use_tqdm=False)
    llm.reset_prefix_cache()

    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in reqs]
    busy0, own0 = machine_busy_seconds(), tree_cpu_seconds(os.getpid())
    start = time.perf_counter()
    outs = llm.generate(prompts, [params(n) for _, n in reqs], use_tqdm=False)
    elapsed = time.perf_counter() - start
    other = (machine_busy_seconds() - busy0) - (tree_cpu_seconds(os.getpid()) - own0)
    result = {
        "elapsed_s": elapsed,
        "requests": len(outs),
        "input_tokens": sum(len(p) for p, _ in reqs),
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "vllm": vllm.__version__,
        "other_cpu_busy": min(1.0, max(0.0, other / (elapsed * ncpu))),
        "settings": {**settings, "threads_bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
                     "kv_cache_gb": args.kv_cache_gb},
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
