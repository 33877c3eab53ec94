"""Kernel choice by device capability for the NVFP4 / FP8 GEMM and MoE paths.

"torch"         the pure-torch references (CPU, or no Triton)
"triton_w4a16"  the Triton W4A16 / W8A16 kernels in this package (sm80+, tuned on sm90)
"blackwell_fp4" native FP4 tensor cores (sm100+): named here, not written yet, so it falls back
                to "triton_w4a16" with one log line
"""

from __future__ import annotations

import logging
from typing import Literal

import torch

log = logging.getLogger(__name__)

KernelChoice = Literal["torch", "triton_w4a16", "blackwell_fp4"]
AVAILABLE: frozenset[str] = frozenset({"torch", "triton_w4a16"})
MIN_TRITON_CAPABILITY = (8, 0)  # bf16 tensor cores
BLACKWELL_CAPABILITY = (10, 0)


def preferred_kernel(device: torch.device | str) -> KernelChoice:
    """What the hardware would ideally run, before checking what exists."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return "torch"
    cap = torch.cuda.get_device_capability(dev)
    if cap >= BLACKWELL_CAPABILITY:
        return "blackwell_fp4"
    if cap >= MIN_TRITON_CAPABILITY:
        return "triton_w4a16"
    return "torch"


def select_kernel(
    device: torch.device | str, capability: tuple[int, int] | None = None
) -> KernelChoice:
    """The implementation to use for NVFP4/FP8 GEMMs and the fused MoE on `device`.

    `capability` overrides the queried compute capability (tests, planning for another GPU).
    Falling back from a preferred but missing kernel logs one line naming both.
    """
    dev = torch.device(device)
    if capability is None:
        want = preferred_kernel(dev)
    elif capability >= BLACKWELL_CAPABILITY:
        want = "blackwell_fp4"
    elif capability >= MIN_TRITON_CAPABILITY:
        want = "triton_w4a16"
    else:
        want = "torch"
    if want in AVAILABLE:
        return want
    fallback: KernelChoice = "triton_w4a16"
    log.info("kernel %s is not implemented yet; using %s", want, fallback)
    return fallback
