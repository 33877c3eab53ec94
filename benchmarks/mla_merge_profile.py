"""Kernel time of mla_decode's two launches (split-KV kernel, merge kernel), by torch.profiler,
at short contexts with many rows and at 4k: where a slow merge shows. Prints one line per case.

  PYTHONPATH=$PWD python benchmarks/mla_merge_profile.py
"""

import torch
from torch.profiler import ProfilerActivity, profile

from moeserve.kernels.attention import mla_decode as md

PS = 64
for heads, ctx, cap, batch, splits in [
    (128, 100, 1024, 16, 4),
    (128, 100, 1024, 16, 1),
    (64, 100, 1024, 64, 2),
    (64, 100, 1024, 64, 1),
    (128, 100, 1024, 8, 8),
    (128, 100, 1024, 8, 1),
    (128, 4096, 4096, 8, 8),
    (128, 4096, 4096, 1, 32),
    (16, 32768, 32768, 1, 132),
]:
    pages_per = cap // PS
    pages = pages_per * batch
    cache = torch.randn(pages, PS, 576, device="cuda").bfloat16()
    bt = torch.randperm(pages, device="cuda", dtype=torch.int32).view(batch, pages_per)
    sl = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, heads, 576, device="cuda").bfloat16()
    out = torch.empty(batch, heads, 512, device="cuda").bfloat16()
    ws = md.MLADecodeWorkspace.allocate(batch, heads, splits, "cuda")
    for _ in range(3):
        md.mla_decode(q, cache, bt, sl, 0.1, out, num_splits=splits, workspace=ws)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(20):
            md.mla_decode(q, cache, bt, sl, 0.1, out, num_splits=splits, workspace=ws)
        torch.cuda.synchronize()
    tot = {}
    for e in p.events():
        if e.device_type.name == "CUDA":
            tot[e.name[:40]] = tot.get(e.name[:40], 0) + e.device_time / 20
    print(
        f"H={heads} ctx={ctx} B={batch} s={splits}:",
        {k: round(v, 2) for k, v in tot.items()},
        flush=True,
    )
