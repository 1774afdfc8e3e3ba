"""Cost models: the predicted duration of one forward pass (one scheduler step) from its shape.

A batch's shape is, per request, its extend length (tokens computed this pass) and its sequence
length after the pass. A request that computes one token is a decode token, whether the batch is a
decode batch or a mixed prefill+decode batch; the others are prefill (extend) tokens.

* `ProfileCostModel` (``cost_model = "profile"``): a linear model fitted by `batchyard sim
  calibrate` on measured steps of the real engine. Features, one coefficient each (seconds per
  unit): prefill tokens; prefill attention (each prefill token times the context it attends to,
  its prefix plus half its own extend); decode requests; decode context tokens (KV read); and a
  constant per step. The step time measured is the scheduler loop's (forward pass and scheduler
  work together), so the simulated clock also pays the scheduler's overhead.
* `RooflineCostModel` (``cost_model = "roofline"``): from the model config and a hardware entry
  (framework/sim/hardware.py): max(FLOPs / usable peak, bytes moved / usable bandwidth) plus the
  all-reduces of tensor parallelism and a fixed overhead per step. An estimate, not a measurement.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from framework.sim.hardware import FROM_PROFILE, HARDWARE, Hardware, hardware_names

FEATURES = ("prefill_tokens", "prefill_attention", "decode_reqs", "decode_context", "step")
PROFILE_VERSION = 1


class CostModelError(ValueError):
    """A cost model cannot be built (unreadable profile, unknown hardware); one line naming it."""


@dataclass
class BatchShape:
    """Per request of one pass: tokens computed and sequence length after the pass."""

    extend_lens: Sequence[int]
    seq_lens: Sequence[int] | None
    # (prefill tokens, prefill attention, decode requests, decode context, prefill context,
    # requests): computed once, from the lists or (decode batches) from the tensors directly.
    _stats: tuple[float, ...] | None = field(default=None, repr=False)

    @classmethod
    def of(cls, worker_batch) -> "BatchShape":
        if worker_batch.forward_mode.is_decode():
            bs = len(worker_batch.extend_lens)
            return cls(worker_batch.extend_lens, None, (0.0, 0.0, bs, float(worker_batch.seq_lens.sum()), 0.0, bs))
        return cls(list(worker_batch.extend_lens), worker_batch.seq_lens.tolist())

    def stats(self) -> tuple[float, ...]:
        if self._stats is None:
            prefill = attention = decode_reqs = decode_ctx = prefill_ctx = 0.0
            for ext, seq in zip(self.extend_lens, self.seq_lens):
                if ext == 1:
                    decode_reqs += 1
                    decode_ctx += seq
                else:
                    prefill += ext
                    attention += ext * (seq - ext + (ext + 1) / 2)
                    prefill_ctx += seq
            self._stats = (prefill, attention, decode_reqs, decode_ctx, prefill_ctx, len(self.extend_lens))
        return self._stats

    def features(self) -> list[float]:
        """The profile model's features, in `FEATURES` order."""
        return [*self.stats()[:4], 1.0]


# -- fitting ---------------------------------------------------------------------------------------


def fit_nonnegative(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: refit without the features that came out
    negative until none does (a negative cost per token would make big batches free)."""
    scale = np.linalg.norm(x, axis=0)
    scale[scale == 0] = 1.0
    xs = x / scale
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(xs[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active = [a for a, s in zip(active, sol) if s >= 0] if (sol >= 0).any() else []
    return coef / scale


def fit_profile(samples: list[tuple[BatchShape, float]]) -> tuple[dict[str, float], dict[str, float]]:
    """Coefficients (seconds per feature unit) and the fit's errors on `samples`."""
    if len(samples) < len(FEATURES):
        raise ValueError(f"need at least {len(FEATURES)} measured steps to fit, got {len(samples)}")
    x = np.array([s.features() for s, _ in samples], dtype=np.float64)
    y = np.array([t for _, t in samples], dtype=np.float64)
    # Relative errors matter as much for a 5 ms decode step as for a 2 s prefill: weight by 1/y.
    w = 1.0 / np.maximum(y, 1e-6)
    coef = fit_nonnegative(x * w[:, None], y * w)
    # On a shared machine step times are right-skewed (a neighbour's burst stretches a step, never
    # shortens it), so the relative fit follows the typical step and undershoots the total.
    # Throughput and mean latencies follow the total: scale every coefficient to match it.
    coef *= y.sum() / max(float((x @ coef).sum()), 1e-12)
    pred = x @ coef
    rel = (pred - y) / np.maximum(y, 1e-9)
    fit = {
        "num_steps": int(len(y)),
        "mean_abs_rel_error": float(np.mean(np.abs(rel))),
        "p90_abs_rel_error": float(np.percentile(np.abs(rel), 90)),
        "median_rel_error": float(np.median(rel)),
        "total_time_rel_error": float(pred.sum() / y.sum() - 1.0),
    }
    return dict(zip(FEATURES, map(float, coef))), fit


# -- the profile file -------------------------------------------------------------------------------


def load_profile(path: str | Path) -> dict[str, Any]:
    """A calibration profile, checked; `CostModelError` naming the file and the problem."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise CostModelError(f"plugin.sim.profile: cannot read {path}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CostModelError(f"plugin.sim.profile: {path} is not JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("kind") != "batchyard-sim-profile":
        raise CostModelError(f"plugin.sim.profile: {path} is not a batchyard sim profile (run `batchyard sim calibrate`)")
    if data.get("version") != PROFILE_VERSION:
        raise CostModelError(f"plugin.sim.profile: {path} has version {data.get('version')!r}; expected {PROFILE_VERSION}")
    coef = data.get("coef")
    if not isinstance(coef, dict):
        raise CostModelError(f"plugin.sim.profile: {path} has no 'coef' table")
    for name in FEATURES:
        value = coef.get(name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) or value < 0:
            raise CostModelError(f"plugin.sim.profile: {path}: coef.{name} must be a finite number >= 0, got {value!r}")
    return data


# -- the models ---------------------------------------------------------------------------------------


class ProfileCostModel:
    """The fitted linear model. A TP size other than the calibrated one divides the per-token
    terms by the ratio (an estimate: the profile was measured on one rank)."""

    def __init__(self, profile: dict[str, Any], tp_size: int = 1):
        self.profile = profile
        self.coef = [float(profile["coef"][name]) for name in FEATURES]
        speedup = tp_size / int(profile.get("tp_size", 1))
        if speedup != 1:
            self.coef = [c / speedup for c in self.coef[:-1]] + [self.coef[-1]]

    def predict(self, shape: BatchShape) -> float:
        return sum(c * f for c, f in zip(self.coef, shape.features()))


class RooflineCostModel:
    """max(compute time, memory time) + tensor-parallel all-reduces + a fixed step overhead."""

    def __init__(self, model_config, dtype_bytes: int, hardware: Hardware, tp_size: int = 1,
                 flops_efficiency: float = 0.5, bandwidth_efficiency: float = 0.8,
                 step_overhead_s: float = 0.0, kv_dtype_bytes: int | None = None):
        cfg = model_config
        h, hd = cfg.hidden_size, cfg.head_dim
        attn_params = h * cfg.num_heads * hd * 2 + h * cfg.num_kv_heads * hd * 2
        self.layer_params = attn_params + 3 * h * cfg.intermediate_size
        self.num_layers = cfg.num_layers
        self.lm_head_params = cfg.vocab_size * h
        embed_params = 0 if cfg.tie_word_embeddings else cfg.vocab_size * h  # a lookup: read, not multiplied
        self.weight_bytes = (self.num_layers * self.layer_params + self.lm_head_params + embed_params) * dtype_bytes
        self.attn_flops_per_pair = 4 * cfg.num_layers * cfg.num_heads * hd  # QK^T and PV
        self.kv_bytes_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * hd * (kv_dtype_bytes or dtype_bytes)
        self.hidden_bytes = h * dtype_bytes
        self.hardware = hardware
        self.tp_size = tp_size
        self.flops = hardware.peak_flops * flops_efficiency
        self.bandwidth = hardware.mem_bandwidth * bandwidth_efficiency
        self.step_overhead_s = step_overhead_s

    def predict(self, shape: BatchShape) -> float:
        prefill, prefill_pairs, decode_reqs, decode_ctx, prefill_ctx, num_reqs = shape.stats()
        num_tokens = prefill + decode_reqs
        # A decode token attends to its whole context: one (query, key) pair per context token.
        pairs = prefill_pairs + decode_ctx
        context = prefill_ctx + decode_ctx
        flops = (2 * num_tokens * self.num_layers * self.layer_params
                 + 2 * num_reqs * self.lm_head_params + self.attn_flops_per_pair * pairs)
        moved = self.weight_bytes + context * self.kv_bytes_per_token
        tp = self.tp_size
        seconds = max(flops / tp / self.flops, moved / tp / self.bandwidth)
        if tp > 1:
            # Two all-reduces of the hidden states per layer (attention out, MLP out), ring algorithm.
            volume = 2 * (tp - 1) / tp * num_tokens * self.hidden_bytes
            link = self.hardware.link_bandwidth or self.bandwidth
            seconds += 2 * self.num_layers * (self.hardware.allreduce_latency_s + volume / link)
        return seconds + self.step_overhead_s


def resolve_hardware(name: str, profile_path: str | None) -> Hardware:
    if name == FROM_PROFILE:
        if not profile_path:
            raise CostModelError('plugin.sim.hardware: "profile" takes the measured entry of plugin.sim.profile, which is empty')
        entry = load_profile(profile_path).get("hardware")
        if not isinstance(entry, dict) or not entry.get("peak_flops") or not entry.get("mem_bandwidth"):
            raise CostModelError(f"plugin.sim.profile: {profile_path} has no measured hardware entry")
        return Hardware.from_dict(entry)
    if name not in HARDWARE:
        raise CostModelError(f"plugin.sim.hardware: unknown hardware {name!r}; known: {', '.join(hardware_names())}")
    return HARDWARE[name]


def build_cost_model(sim, model_config, dtype_bytes: int, tp_size: int = 1, kv_dtype_bytes: int | None = None):
    """The cost model `[plugin.sim]` (a `SimSettings`) names; `CostModelError` when it cannot be
    built. Called when the sim worker starts, and by tools that check a grid before running it.
    `kv_dtype_bytes`: the KV cache's element size where it differs from the weights'."""
    if sim.cost_model == "profile":
        if not sim.profile:
            raise CostModelError('plugin.sim.profile: cost_model = "profile" needs a profile file (make one with `batchyard sim calibrate`)')
        return ProfileCostModel(load_profile(sim.profile), tp_size)
    hardware = resolve_hardware(sim.hardware, sim.profile)
    return RooflineCostModel(
        model_config, dtype_bytes, hardware, tp_size, sim.flops_efficiency, sim.bandwidth_efficiency,
        sim.step_overhead_s, kv_dtype_bytes,
    )
