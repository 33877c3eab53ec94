"""GPUs that `moeserve plan` can plan for: memory, compute capability, bandwidth, interconnect.

Memory is `memory.total` as `nvidia-smi` reports it (MiB); torch's `mem_get_info` total is the
same figure or a little less. Bandwidth and links are the vendor's datasheet figures (leads,
not measurements). `interconnect`: whether GPUs of one host can read each other's memory (the
one-shot all-reduce needs it); PCIe cards are not assumed to have it (`moeserve plan --p2p`
says otherwise), and the engine probes it at start-up (`torch.cuda.can_device_access_peer`).
`ALL_REDUCE_FIGURES`: small all-reduce latencies measured on some kinds, each with its source,
for the plan's decode projection. Add a GPU here to plan for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MIB = 1 << 20
# what the engine's all-reduce choice depends on (see `moeserve.layers.kernel_plan`)
Interconnect = Literal["nvlink", "pcie-p2p", "pcie"]
GPUS_PER_HOST = 8  # the largest single-host deployment of every GPU below


@dataclass(frozen=True)
class GpuSpec:
    key: str  # the `--gpu` name
    name: str  # as nvidia-smi names it
    memory_mib: int
    capability: tuple[int, int]
    hbm_tb_s: float  # memory bandwidth, TB/s (datasheet)
    interconnect: Interconnect
    link: str  # the GPU-to-GPU link, in words

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * MIB

    @property
    def sm(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"

    def describe(self) -> str:
        return (
            f"{self.name}, {self.memory_bytes / (1 << 30):.1f} GiB, {self.sm}, "
            f"{self.hbm_tb_s:g} TB/s, {self.link}"
        )


GPUS: dict[str, GpuSpec] = {
    g.key: g
    for g in (
        GpuSpec("h100", "NVIDIA H100 80GB HBM3", 81559, (9, 0), 3.35, "nvlink", "NVLink 900 GB/s"),
        GpuSpec("h200", "NVIDIA H200", 143771, (9, 0), 4.8, "nvlink", "NVLink 900 GB/s"),
        GpuSpec("b200", "NVIDIA B200", 183359, (10, 0), 8.0, "nvlink", "NVLink 1.8 TB/s"),
        GpuSpec(
            "rtx-pro-6000",
            "NVIDIA RTX PRO 6000 Blackwell",
            97887,
            (12, 0),
            1.792,
            "pcie",
            "PCIe 5.0 x16, no NVLink",
        ),
        GpuSpec(
            "a100-80gb", "NVIDIA A100-SXM4-80GB", 81920, (8, 0), 2.039, "nvlink", "NVLink 600 GB/s"
        ),
        GpuSpec("l40s", "NVIDIA L40S", 46068, (8, 9), 0.864, "pcie", "PCIe 4.0 x16, no NVLink"),
    )
}


@dataclass(frozen=True)
class AllReduceFigures:
    """Small all-reduce latencies measured on a GPU kind (not here: `source` says where), for
    `moeserve plan`'s decode projection: the one-shot kernel over peer memory and NCCL."""

    gpus: int  # GPUs of the measurement
    one_shot_us: tuple[float, float]  # (low, high)
    nccl_us: float
    max_bytes: int  # the largest message the latencies cover
    source: str

    @property
    def one_shot_mid_us(self) -> float:
        return sum(self.one_shot_us) / 2


ALL_REDUCE_FIGURES: dict[str, AllReduceFigures] = {
    "rtx-pro-6000": AllReduceFigures(
        8,
        (7.5, 9.0),
        24.0,
        8 << 10,
        "custom one-shot all-reduces vs NCCL for messages up to 8 KB on 8 RTX PRO 6000 "
        "(PCIe, P2P ~54 GB/s, ~0.4 us), measured by others; not measured here",
    ),
    "h200": AllReduceFigures(
        2,
        (4.70, 4.70),
        14.63,
        14 << 10,
        "fused all-reduce + residual + RMSNorm of 14 KB on 2 H200 in a CUDA graph "
        "(benchmarks/results/allreduce.md); 8 GPUs not measured",
    ),
}


def gpu_spec(key: str) -> GpuSpec:
    from moeserve.config import ConfigError

    try:
        return GPUS[key]
    except KeyError:
        raise ConfigError(f"unknown GPU {key!r}; use one of {', '.join(GPUS)}") from None
