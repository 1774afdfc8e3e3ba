"""`bench offline --roofline`: the timed run against what this machine's GEMMs and memory allow.

The work is counted from the run itself (each request's prompt, cached and completion tokens)
and the model's shapes:

* GEMM FLOPs: 2 per multiply-add of every decoder layer's linear layers for each token through
  the layers (the prompt tokens not taken from the cache, and one token a decode step), and of the
  LM head for each sampled token;
* decode attention's KV reads: a decode step of a request of length L reads the K and V of its L
  tokens in every layer (the pool's bytes a token, `TokenToKVPool.cell_size`).

The rates are measured on this machine right after the run, with the engine's threads: the best
GEMM rate at the layers' own shapes (2,048 rows; `F.linear` in the model's dtype, and
`torch._int_mm` or kernels/int8_ops.c's own int8 GEMM, the faster, for the int8 layers of
model.quantization = "w8a8", whose LM head stays in the model's dtype unless model.int8_lm_head;
kernels/w4_gemm.c for the layers of "w4a8", its int8 LM head at the int8 rate),
and the memory's read rate (a sum over 256 MiB of fp32). So:

* the **GEMM-bound limit** is the run's GEMM FLOPs at those rates: no engine doing the same GEMMs
  in the same precision is faster on this machine (issue 17's "GEMM-bound limit");
* adding decode's KV reads at the read rate gives the bound of a step that runs its GEMMs and its
  attention one after the other, as ours does.

Both are stated as seconds, as output tok/s over the run's output tokens, and as the run's share
of them (its output tok/s over theirs). Attention's arithmetic, the element-wise ops, sampling and
the scheduler are left out: the bounds are lower bounds on the run's time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

GEMM_ROWS = 2048  # rows of the measured GEMMs: a prefill chunk's
READ_BYTES = 256 << 20
MIN_SECONDS = 0.25  # each rate is the best over repetitions filling at least this long


@dataclass(frozen=True)
class RequestTokens:
    """One finished request's token counts (its meta_info)."""

    prompt: int
    cached: int
    completion: int


def layer_macs(cfg) -> int:
    """Multiply-adds of one token through one decoder layer's linear layers (q, k, v, o, gate,
    up, down) of a ModelConfig."""
    q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    attention = cfg.hidden_size * (q_out + 2 * kv_out) + q_out * cfg.hidden_size
    return attention + 3 * cfg.hidden_size * cfg.intermediate_size


def count_work(cfg, kv_bytes_per_token: int, requests: list[RequestTokens]) -> dict[str, float]:
    """The run's work: tokens through the layers, LM-head rows, GEMM FLOPs and decode's KV bytes."""
    layer_tokens = sum(r.prompt - r.cached + max(r.completion - 1, 0) for r in requests)
    lm_head_rows = sum(r.completion for r in requests)
    # decode step j (1 .. completion - 1) of a request reads prompt + j tokens
    kv_tokens = sum((r.completion - 1) * r.prompt + (r.completion - 1) * r.completion // 2
                    for r in requests if r.completion > 1)
    return {
        "layer_tokens": layer_tokens,
        "lm_head_rows": lm_head_rows,
        "layer_flop": 2.0 * layer_macs(cfg) * cfg.num_layers * layer_tokens,
        "lm_head_flop": 2.0 * cfg.hidden_size * cfg.vocab_size * lm_head_rows,
        "kv_read_bytes": float(kv_tokens) * kv_bytes_per_token,
    }


def _best_rate(fn, work: float) -> float:
    """Best work / s of `fn` over repetitions lasting at least MIN_SECONDS (after one warm-up)."""
    fn()
    best, spent = 0.0, 0.0
    while spent < MIN_SECONDS:
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        spent += took
        best = max(best, work / took)
    return best


def gemm_shapes(cfg) -> list[tuple[int, int]]:
    """(in, out) of the layers' largest GEMMs: gate_up and down."""
    return [(cfg.hidden_size, 2 * cfg.intermediate_size), (cfg.intermediate_size, cfg.hidden_size)]


def gemm_rate(cfg, kind: str) -> float:
    """Best FLOP/s (OP/s for int8) of this machine's GEMMs at the layers' shapes: `kind` is a
    float dtype's name (F.linear; for float32, also kernels/f32_gemm.c where the engine runs its
    float32 GEMMs there, CPUs without AVX-512: whichever is faster), "int8" (torch._int_mm, and
    kernels/int8_ops.c's own GEMM where the engine runs its int8 GEMMs there, `own_gemm_wanted`:
    whichever is faster; the own GEMM's time includes its end, fp32 out) or "w4a8"
    (kernels/w4_gemm.c, its end included, fp32 out; 0 where it does not build)."""
    import torch

    f32_gemm = own_int8 = w4 = None
    if kind == "float32":
        from framework.model.cpu_kernels import load_f32_gemm

        f32_gemm = load_f32_gemm()
    if kind == "int8":
        from framework.model.int8 import Int8Ops, quantize_weight

        own_int8 = Int8Ops.load(torch.float32)
        if not own_int8.packs:
            own_int8 = None
    if kind == "w4a8":
        from framework.model.w4a8 import W4Ops

        w4 = W4Ops.load(torch.float32)
        if not w4.packs:
            return 0.0
    gen = torch.Generator().manual_seed(0)
    best = 0.0
    for k, n in gemm_shapes(cfg):
        fns = []
        if kind == "w4a8":
            rows = w4.quantize(torch.randn(GEMM_ROWS, k, generator=gen))
            weight = w4.make(torch.randn(n, k, generator=gen))
            fns.append(lambda rows=rows, weight=weight: w4.linear(rows, weight))
        elif kind == "int8":
            x = torch.randint(-127, 128, (GEMM_ROWS, k), dtype=torch.int8, generator=gen)
            w = torch.randint(-127, 128, (k, n), dtype=torch.int8, generator=gen)
            fns.append(lambda x=x, w=w: torch._int_mm(x, w))
            if own_int8 is not None:
                rows = own_int8.quantize(torch.randn(GEMM_ROWS, k, generator=gen))
                weight = own_int8.pack(quantize_weight(torch.randn(n, k, generator=gen)))
                if weight.packed is not None:
                    fns.append(lambda rows=rows, weight=weight: own_int8.linear(rows, weight))
        else:
            dtype = getattr(torch, kind)
            x = torch.randn(GEMM_ROWS, k, generator=gen).to(dtype)
            w = torch.randn(n, k, generator=gen).to(dtype)
            fns.append(lambda x=x, w=w: torch.nn.functional.linear(x, w))
            if f32_gemm is not None:
                fns.append(lambda x=x, p=f32_gemm.pack(w), n=n: f32_gemm.linear(x, p, n))
        for fn in fns:
            best = max(best, _best_rate(fn, 2.0 * GEMM_ROWS * k * n))
    return best


# The GEMMs a model.quantization runs its layers on (gemm_rate's kind); "none": the model's dtype.
LAYER_GEMMS = {"w8a8": "int8", "w4a8": "w4a8"}


def read_rate() -> float:
    """Bytes/s of a sum over READ_BYTES of fp32 (the memory's read rate with torch's threads)."""
    import torch

    x = torch.ones(READ_BYTES // 4, dtype=torch.float32)
    return _best_rate(lambda: x.sum(), float(READ_BYTES))


def measure_rates(dtype: str, quantization: str, cfg, int8_lm_head: bool = False) -> dict[str, float]:
    """The rates the bounds use: the model dtype's GEMMs, int8 GEMMs where the layers (and with
    `int8_lm_head` the LM head) run them, the memory's reads."""
    rates = {"gemm_flops": gemm_rate(cfg, dtype)}
    layer_kind = LAYER_GEMMS.get(quantization)
    rates["layer_gemm_flops"] = gemm_rate(cfg, layer_kind) if layer_kind else rates["gemm_flops"]
    if int8_lm_head:  # (w8a8's int8 GEMMs, also under w4a8)
        rates["lm_head_flops"] = rates["layer_gemm_flops"] if layer_kind == "int8" else gemm_rate(cfg, "int8")
    else:
        rates["lm_head_flops"] = rates["gemm_flops"]
    rates["read_bytes_per_s"] = read_rate()
    return rates


def bounds(work: dict[str, float], rates: dict[str, float], wall: float, output_tokens: int) -> dict[str, float]:
    """The GEMM-bound limit and the bound with decode's KV reads, against the run's wall time."""
    gemm_s = (work["layer_flop"] / rates["layer_gemm_flops"]
              + work["lm_head_flop"] / rates.get("lm_head_flops", rates["gemm_flops"]))
    kv_s = work["kv_read_bytes"] / rates["read_bytes_per_s"]
    out = {"gemm_bound_s": gemm_s, "kv_read_s": kv_s, "gemm_kv_bound_s": gemm_s + kv_s, "run_s": wall}
    for key in ("gemm_bound", "gemm_kv_bound"):
        seconds = out[f"{key}_s"]
        out[f"{key}_output_throughput"] = output_tokens / seconds if seconds > 0 else float("inf")
        out[f"share_of_{key}"] = seconds / wall if wall > 0 else float("nan")
    return out


def run_shape(runner) -> dict[str, Any]:
    """What the bounds need of a ModelRunner (taken before the engine shuts down): its model's
    config, the KV pool's bytes a token, its dtype and quantization (and whether the LM head is int8)."""
    pool = runner.token_to_kv_pool
    return {"cfg": runner.model_config,
            "kv_bytes_per_token": pool.cell_size(pool.num_kv_heads, pool.head_dim, pool.num_layers, pool.dtype),
            "dtype": str(runner.dtype).replace("torch.", ""),
            "quantization": getattr(runner, "quantization", None) or "none",
            "int8_lm_head": bool(getattr(runner, "int8_lm_head", False))}


def roofline(shape: dict[str, Any], requests: list[RequestTokens], wall: float) -> dict[str, Any]:
    """Work, rates and bounds of a run (`run_shape` of its runner), for the record."""
    import torch

    cfg = shape["cfg"]
    work = count_work(cfg, shape["kv_bytes_per_token"], requests)
    int8_lm_head = shape.get("int8_lm_head", False)
    rates = measure_rates(shape["dtype"], shape["quantization"], cfg, int8_lm_head)
    output_tokens = sum(r.completion for r in requests)
    return {"dtype": shape["dtype"], "quantization": shape["quantization"], "int8_lm_head": int8_lm_head,
            "threads": torch.get_num_threads(),
            "kv_bytes_per_token": shape["kv_bytes_per_token"], **work, **rates,
            **bounds(work, rates, wall, output_tokens)}


def format_roofline(r: dict[str, Any]) -> str:
    """The roofline record as a table."""
    layer_kind = LAYER_GEMMS.get(r["quantization"], r["dtype"])
    rate = f"{r['dtype']} {r['gemm_flops'] / 1e12:.3f} TFLOP/s"
    if layer_kind != r["dtype"]:
        rate += f", {layer_kind} {r['layer_gemm_flops'] / 1e12:.3f} TOP/s"
    if r.get("int8_lm_head") and layer_kind != "int8":
        rate += f", int8 LM head {r['lm_head_flops'] / 1e12:.3f} TOP/s"
    gemm_tflop = (r["layer_flop"] + r["lm_head_flop"]) / 1e12
    lines = [" Bounds on this machine (measured) ".center(62, "="),
             f"{'GEMMs':<24}{gemm_tflop:.2f} T (layers {r['layer_flop'] / 1e12:.2f} in {layer_kind}, "
             f"LM head {r['lm_head_flop'] / 1e12:.2f}{' in int8' if r.get('int8_lm_head') else ''})",
             f"{'GEMM rate':<24}{rate}",
             f"{'decode KV reads':<24}{r['kv_read_bytes'] / 1e9:.1f} GB at {r['read_bytes_per_s'] / 1e9:.1f} GB/s",
             f"{'':<24}{'s':>10}{'out tok/s':>12}{'run/bound':>12}"]
    for key, label in (("gemm_bound", "GEMM-bound limit"), ("gemm_kv_bound", "+ decode KV reads")):
        lines.append(f"{label:<24}{r[key + '_s']:>10.2f}{r[key + '_output_throughput']:>12.1f}"
                     f"{r['share_of_' + key]:>12.1%}")
    lines.append(f"{'this run':<24}{r['run_s']:>10.2f}")
    lines.append("=" * 62)
    return "\n".join(lines)
