"""`bench offline --breakdown` and `bench one-batch --breakdown`: where the engine's time goes,
part by part, in the timed run.

While active, `Breakdown` wraps the methods that run each part of a pass with wall-clock timers
(and puts them back on exit, so nothing is left behind and an untimed run pays nothing):

* ``attention``: the attention backend's forward (gathers, kernels, softmax), every layer;
* ``gemm``: the layers' linear layers (the packed GEMM kernel, oneDNN, or ``F.linear``; with
  model.quantization = "w8a8" or "w4a8" the int8 GEMMs with their quantizations and dequantizations);
* ``lm_head``: the logits of each pass;
* ``elementwise``: RMSNorms (with their residual adds, and in int8 the quantization of their
  output), RoPE with the KV writes, SiLU·up;
* ``other``: the rest of the forward pass (the embedding lookup, the attention plan, Python
  between the kernels: ``forward`` minus the parts above);
* ``sampling``: choosing the next tokens from the logits.

Times are split by the kind of pass (``prefill`` also covers mixed passes, ``decode`` the pure
decode steps). A part called inside another timed part counts for the outer one only (the LM head's
GEMM is ``lm_head``, not ``gemm``), so the parts add up to the forward time. Decode steps on the
decode path (framework/model/decode_path.py) report the end of each kernel call instead, so the
Python between its kernels counts for the kernel after it. Each timed call
costs ~1 µs more (two clock reads and a Python call): tens of milliseconds over a W200 run.
"""

from __future__ import annotations

import importlib
import time
from collections import defaultdict
from typing import Any, Callable

# (module, class or None for a module function, attribute, part)
TIMED: tuple[tuple[str, str | None, str, str], ...] = (
    ("framework.model.attention", "TorchNativeAttention", "forward", "attention"),
    ("framework.model.llama", None, "linear", "gemm"),
    ("framework.model.llama", None, "packed_linear", "gemm"),
    ("framework.model.llama", None, "packed_linear_unary", "gemm"),
    ("framework.model.llama", None, "packed_linear_binary", "gemm"),
    ("framework.model.cpu_kernels", "PackedGemm", "_run", "gemm"),
    ("framework.model.int8", "Int8Ops", "quantize", "gemm"),
    ("framework.model.int8", "Int8Ops", "linear", "gemm"),
    ("framework.model.int8", "Int8Ops", "gate_up", "gemm"),
    ("framework.model.int8", "Int8Ops", "rms_norm_quantize", "elementwise"),
    ("framework.model.w4a8", "W4Ops", "quantize", "gemm"),
    ("framework.model.w4a8", "W4Ops", "linear", "gemm"),
    ("framework.model.w4a8", "W4Ops", "gate_up", "gemm"),
    ("framework.model.w4a8", "W4Ops", "rms_norm_quantize", "elementwise"),
    ("framework.model.w4a8", "W4Ops", "rms_norm_quantize_f32", "elementwise"),
    ("framework.model.llama", "LlamaForCausalLM", "compute_logits", "lm_head"),
    ("framework.model.llama", "RMSNorm", "forward", "elementwise"),
    ("framework.model.llama", "RMSNorm", "add_and_norm", "elementwise"),
    ("framework.model.cpu_kernels", "FusedOps", "rope_kv", "elementwise"),
    ("framework.model.cpu_kernels", "FusedOps", "silu_mul", "elementwise"),
    ("framework.model.rotary", "RopeTables", "apply", "elementwise"),
    ("framework.memory", "TokenToKVPool", "set_kv", "elementwise"),
    ("framework.model.runner", "ModelRunner", "sample", "sampling"),
)
PARTS = ("attention", "gemm", "lm_head", "elementwise", "other")
PHASES = ("prefill", "decode")


class Breakdown:
    """Context manager: time the parts (module docstring) of every pass run inside it."""

    def __init__(self) -> None:
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)  # (phase, part) -> s
        self.passes: dict[str, int] = defaultdict(int)
        self._phase = "prefill"
        self._depth = 0  # timed parts open (only the outermost one counts)
        self._saved: list[tuple[Any, str, Any]] = []
        self._start = 0.0
        self._last_mark = 0.0
        self.wall = 0.0

    # -- patching -------------------------------------------------------------------------------

    def __enter__(self) -> "Breakdown":
        from framework.model.decode_path import DecodePath
        from framework.model.runner import ModelRunner

        self._patch(ModelRunner, "forward", self._timed_forward)
        # The decode path calls the kernels itself: it reports each one's end to this clock.
        self._saved.append((DecodePath, "mark", vars(DecodePath)["mark"]))
        DecodePath.mark = self._mark
        for module_name, owner_name, attr, part in TIMED:
            module = importlib.import_module(module_name)
            owner = module if owner_name is None else getattr(module, owner_name)
            self._patch(owner, attr, self._timed_part(part))
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.perf_counter() - self._start
        for owner, attr, original in reversed(self._saved):
            setattr(owner, attr, original)
        self._saved.clear()

    def _patch(self, owner: Any, attr: str, wrap: Callable[[Callable], Callable]) -> None:
        # The attribute as the owner itself holds it (a class's own method, a module's function):
        # that is what goes back on exit.
        original = vars(owner)[attr]
        self._saved.append((owner, attr, original))
        setattr(owner, attr, wrap(original))

    def _timed_part(self, part: str) -> Callable[[Callable], Callable]:
        def wrap(fn: Callable) -> Callable:
            def timed(*args, **kwargs):
                if self._depth:
                    return fn(*args, **kwargs)
                self._depth += 1
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.seconds[(self._phase, part)] += time.perf_counter() - start
                    self._depth -= 1
            return timed
        return wrap

    def _mark(self, part: str | None) -> None:
        """The decode path's clock: the time since its last mark goes to `part` (None: start)."""
        now = time.perf_counter()
        if part is not None:
            self.seconds[(self._phase, part)] += now - self._last_mark
        self._last_mark = now

    def _timed_forward(self, fn: Callable) -> Callable:
        def forward(runner, batch, *args, **kwargs):
            self._phase = "decode" if batch.forward_mode.is_decode() else "prefill"
            start = time.perf_counter()
            try:
                return fn(runner, batch, *args, **kwargs)
            finally:
                self.seconds[(self._phase, "forward")] += time.perf_counter() - start
                self.passes[self._phase] += 1
        return forward

    # -- results --------------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """{phase: {part: s, "forward": s, "passes": n}, "sampling": s, "outside": s, "wall": s}:
        `other` is the forward time the parts leave; `outside` the wall time outside forward
        passes and sampling (the scheduler, tokens out)."""
        out: dict[str, Any] = {}
        inside = 0.0
        for phase in PHASES:
            forward = self.seconds[(phase, "forward")]
            parts = {p: self.seconds[(phase, p)] for p in PARTS if p != "other"}
            parts["other"] = max(forward - sum(parts.values()), 0.0)
            out[phase] = {**parts, "forward": forward, "passes": self.passes[phase]}
            inside += forward
        sampling = sum(self.seconds[(phase, "sampling")] for phase in PHASES)
        out["sampling"] = sampling
        out["outside"] = max(self.wall - inside - sampling, 0.0)
        out["wall"] = self.wall
        return out


def format_breakdown(summary: dict[str, Any]) -> str:
    """The summary as a table, seconds and share of the wall time."""
    wall = summary["wall"] or float("nan")
    lines = [" Where the time went (in-engine timers) ".center(50, "="),
             f"{'part':<20}{'prefill s':>10}{'decode s':>10}{'share':>10}"]
    labels = {"attention": "attention", "gemm": "GEMMs", "lm_head": "LM head",
              "elementwise": "norms, RoPE, SiLU", "other": "other in forward", "forward": "forward passes"}
    for part, label in labels.items():
        pre, dec = summary["prefill"][part], summary["decode"][part]
        lines.append(f"{label:<20}{pre:>10.3f}{dec:>10.3f}{(pre + dec) / wall:>10.1%}")
    lines.append(f"{'passes':<20}{summary['prefill']['passes']:>10}{summary['decode']['passes']:>10}")
    for key, label in (("sampling", "sampling"), ("outside", "outside the passes")):
        lines.append(f"{label:<20}{summary[key]:>20.3f}{summary[key] / wall:>10.1%}")
    lines.append(f"{'run':<20}{summary['wall']:>20.3f}")
    lines.append("=" * 50)
    return "\n".join(lines)
