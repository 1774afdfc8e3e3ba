"""`batchyard bench`: benchmark tools built to count exactly what SGLang's scripts count.

    serving    async HTTP client against a running server (bench_serving): TTFT, TPOT, ITL, E2E
    offline    in-process Engine throughput, all requests at once (bench_offline_throughput),
               optionally against Hugging Face transformers in the same process (--backend hf/both)
    one-batch  prefill and decode latency of one static batch (bench_one_batch)
    plot       charts comparing the runs of a results JSONL file

Modules: `datasets` (ShareGPT, random, generated-shared-prefix), `metrics` (the reference's
calculate_metrics), `results` (JSON lines + hardware line), one module per tool, and `cli`.
See docs/performance.md for how to run them and the numbers measured so far.
"""
