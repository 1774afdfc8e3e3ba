"""Hardware table for the roofline cost model.

Peak dense bf16 tensor FLOP/s, HBM bandwidth and the NVLink bandwidth per GPU from the vendors'
public data sheets (SXM parts). A roofline built on them is an estimate: real kernels reach a
fraction of the peaks (`[plugin.sim] flops_efficiency` and `bandwidth_efficiency`).

The CPU of this machine has no data sheet entry: `batchyard sim calibrate` measures a matmul's
FLOP/s and a large copy's bandwidth and stores them in the profile as ``hardware``; the roofline
reads that entry with ``hardware = "profile"``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # FLOP/s, dense bf16 (a measured CPU entry: the dtype it was measured in)
    mem_bandwidth: float  # bytes/s
    link_bandwidth: float = 0.0  # bytes/s per direction between TP ranks (0: no TP link)
    allreduce_latency_s: float = 10e-6  # fixed cost of one all-reduce
    source: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Hardware":
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


HARDWARE: dict[str, Hardware] = {
    hw.name: hw
    for hw in (
        Hardware("a100", 312e12, 2.039e12, 300e9, source="NVIDIA A100 80GB SXM data sheet"),
        Hardware("h100", 989e12, 3.35e12, 450e9, source="NVIDIA H100 SXM data sheet"),
        Hardware("h200", 989e12, 4.8e12, 450e9, source="NVIDIA H200 SXM data sheet"),
    )
}

#: `[plugin.sim] hardware` value that takes the measured entry of the profile file.
FROM_PROFILE = "profile"


def hardware_names() -> list[str]:
    return sorted(HARDWARE) + [FROM_PROFILE]
