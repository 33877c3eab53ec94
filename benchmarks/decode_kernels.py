"""The kernels of one served decode step, in launch order, with their GPU time and the gap
before each: where a batch-1 step's time goes, kernel by kernel.

Run on the GPU machine from the repository root:
  PYTHONPATH=$PWD python benchmarks/decode_kernels.py [deepseek-v3-fp8] [kimi-k2.5-nvfp4]
      [--rank tp8-ep]   (one GPU holding rank 0's share, as in decode_layer.py --rank)
      [KEY=VALUE ...]   (engine settings, e.g. pdl=on)

Method: the engine of benchmarks/decode_layer.py (dummy weights in the serving format, CUDA
graphs) with one MoE layer (DeepSeek-V3: 3 dense + 1 MoE, Kimi-K2.5: 1 + 1), one 64-token
request, 12 decode steps of warm-up; then a kernel-only torch.profiler trace of 10 steps
(CUPTI sees the kernels inside graph replays). Steps are split at their device-to-host copy
of the sampled ids; the middle step is printed. The MoE layer's kernels are the ones between
the last dense layer's and the LM head's.
"""

from __future__ import annotations

import sys

import torch
from decode_layer import CONFIGS, OPTIONAL, _setting, warm_single_request
from torch.profiler import ProfilerActivity, profile

WARMUP_STEPS = 12
TRACED_STEPS = 10
LAYERS = {"deepseek-v3-fp8": 4, "kimi-k2.5-nvfp4": 2}  # the dense layers + one MoE layer


def step_kernels(
    name: str, layers: int, rank: str | None = None, settings: dict | None = None
) -> list[tuple[int, int, str]]:
    """(start ns, end ns, name) of the device activities of one batch-1 decode step."""
    settings = dict(settings or {}, **({"simulate_rank": rank} if rank else {}))
    path = {**CONFIGS, **OPTIONAL}[name]
    engine = warm_single_request(path, layers, WARMUP_STEPS, TRACED_STEPS, **settings)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(TRACED_STEPS):
            engine.step()
        torch.cuda.synchronize()
    engine.shutdown()
    events = sorted(
        (e.start_ns(), e.end_ns(), e.name())
        for e in prof.profiler.kineto_results.events()
        if e.device_type() == torch.autograd.DeviceType.CUDA
    )
    steps, current = [], []
    for e in events:
        current.append(e)
        if "DtoH" in e[2]:  # a step ends with the copy of its sampled ids
            steps.append(current)
            current = []
    return steps[len(steps) // 2]


def main() -> None:
    args = sys.argv[1:]
    rank = None
    if "--rank" in args:
        i = args.index("--rank")
        rank = args[i + 1]
        del args[i : i + 2]
    settings = dict(_setting(a) for a in args if "=" in a)
    for name in [a for a in args if "=" not in a] or list(LAYERS):
        step = step_kernels(name, LAYERS[name], rank, settings)
        busy = sum(end - start for start, end, _ in step) / 1e3
        span = (step[-1][1] - step[0][0]) / 1e3
        where = " ".join([rank or "one GPU", *(f"{k}={v}" for k, v in settings.items())])
        print(f"== {name} {where} L={LAYERS[name]} B=1: {len(step)} events, "
              f"span {span:.1f} us, busy {busy:.1f} us")  # fmt: skip
        prev = step[0][0]
        for start, end, kernel in step:
            gap, us = (start - prev) / 1e3, (end - start) / 1e3
            print(f"  {gap:7.2f} gap {us:8.2f} us  {kernel[:110]}")
            prev = end
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
