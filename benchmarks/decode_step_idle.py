"""GPU idle inside a batch-1 decode step, measured without a profiler: the engine's own decode
loop (overlap scheduling, CUDA graphs) on one GPU holding rank 0's share of Kimi-K2.5 at TP8-EP
(`--simulate-rank tp8-ep`, dummy weights), 2 and 6 layers, 400 timed steps after 40 of warm-up.
Idle per step = wall ms per step - the step's kernel time (decode_layer.py --rank's profiled
kernel ms of the same configuration); the profiler itself is not used here because its CUPTI
tracing slows the host enough to make a short step host-bound (it reported 0.29 ms of idle at
6 layers where this loop measures 0.01 ms).

Run on the GPU machine from the repository root:
  PYTHONPATH=$PWD python benchmarks/decode_step_idle.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_layer import CONFIGS, warm_single_request  # noqa: E402

WARMUP_STEPS = 40
TIMED_STEPS = 400


def ms_per_step(layers: int) -> float:
    eng = warm_single_request(
        CONFIGS["kimi-k2.5-nvfp4"], layers, WARMUP_STEPS, TIMED_STEPS, simulate_rank="tp8-ep"
    )
    t0 = time.perf_counter()
    for _ in range(TIMED_STEPS):
        eng.step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1000 / TIMED_STEPS
    eng.shutdown()
    torch.cuda.empty_cache()
    return ms


def main() -> None:
    for layers in (2, 6):
        print(f"layers {layers}: plain ms/step {ms_per_step(layers):.3f}", flush=True)


if __name__ == "__main__":
    main()
