"""MLA decode launch config by head count: 64-, 32- and 16-row head blocks at small batch.

The split kernel gives each program BLOCK_H heads of one sequence; with 16 heads per rank
(the TP8 share of 128) a 64-row block is three-quarters masked rows. This times block_h
64 (8 warps, DEFAULT_CONFIG), 32 (4 warps) and 16 (8 and 4 warps), each with its own default
split count, at 128, 64 and 16 heads, contexts 100 / 4k / 32k (block-table capacity 1k / 4k / 32k),
batch 1-64, BF16 cache, page size 64, graph-timed (caches cycled past L2); the output of
every config is checked against the fp32 reference. `default_config` follows the result.

  cd benchmarks && PYTHONPATH=.. python kernels_mla_heads.py [--out-dir results] [--commit SHA]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
from common import gpu_meta
from kernels_gemm_moe import graph_time_us

from moeserve.kernels.attention import mla_decode as md

PAGE = 64
SM_SCALE = 0.1
CONFIGS = {
    "bh64w8": md.DEFAULT_CONFIG,
    "bh32w4": md.MLADecodeConfig(block_h=32, num_warps=4),
    "bh16w8": md.MLADecodeConfig(block_h=16, num_warps=8),
    "bh16w4": md.MLADecodeConfig(block_h=16, num_warps=4),
}
CASES = [
    (heads, ctx, cap, batch)
    for heads, (ctx, cap), batch in itertools.product(
        (128, 64, 16), ((100, 1024), (4096, 4096), (32768, 32768)), (1, 2, 4, 8, 16, 64)
    )
    if not (ctx == 32768 and batch > 16)
]
CACHE_BYTES = 256 << 20  # cycle copies until one graph pass streams at least this much


def mla_case(heads: int, ctx: int, cap: int, batch: int, page: int = PAGE) -> tuple:
    """(cache copies cycled past L2, block tables (permuted pages), seq_lens, q, out, the fp32
    reference output on the last copy) for `batch` sequences of `ctx` tokens in a `cap`-token
    capacity."""
    pages_per = cap // page
    pages = pages_per * batch
    copies = max(2, min(8, CACHE_BYTES // (pages * page * 576 * 2) + 1))
    caches = [torch.randn(pages, page, 576, device="cuda").bfloat16() for _ in range(copies)]
    bt = torch.randperm(pages, device="cuda", dtype=torch.int32).view(batch, pages_per)
    sl = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, heads, 576, device="cuda").bfloat16()
    out = torch.empty(batch, heads, 512, device="cuda").bfloat16()
    ref = md.mla_decode_ref(q, caches[-1], bt, sl, SM_SCALE, torch.empty_like(out)).float()
    return caches, bt, sl, q, out, ref


def run_case(heads: int, ctx: int, cap: int, batch: int) -> list[dict]:
    caches, bt, sl, q, out, ref = mla_case(heads, ctx, cap, batch)
    rows = []
    for name, cfg in CONFIGS.items():
        splits = md.default_num_splits(batch, heads, cap, cfg, 132)
        ws = md.MLADecodeWorkspace.allocate(batch, heads, splits, "cuda")
        fns = [
            lambda c=c, cfg=cfg, splits=splits, ws=ws: md.mla_decode(
                q, c, bt, sl, SM_SCALE, out, num_splits=splits, workspace=ws, config=cfg
            )
            for c in caches
        ]
        us = graph_time_us(fns, 40, 5)["us"]
        fns[-1]()
        err = float((out.float() - ref).abs().max() / ref.abs().max())
        rows.append(
            dict(heads=heads, ctx=ctx, cap=cap, batch=batch, config=name, splits=splits, us=us,
                 rel_err=err, ok=err < 3e-2, default=cfg == md.default_config(heads, batch, cap))
        )  # fmt: skip
    print(
        f"H={heads} ctx={ctx} cap={cap} B={batch}: "
        + " | ".join(f"{r['config']} s{r['splits']} {r['us']:.2f} us" for r in rows),
        flush=True,
    )
    return rows


def write_markdown(path: Path, meta: dict, records: list) -> None:
    names = list(CONFIGS)
    lines = [
        "# MLA decode by head block (one GPU)",
        "",
        f"GPU {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, commit "
        f"{meta['commit']}. benchmarks/kernels_mla_heads.py: us per call, graph-timed, BF16 "
        "cache, page 64, each config with its own default split count; **bold** = "
        "`default_config` for that head count, batch and capacity. Checks against the fp32 "
        "reference: "
        f"{sum(r['ok'] for r in records)}/{len(records)}.",
        "",
        "| heads | context (capacity) | batch | " + " | ".join(names) + " |",
        "|---|---|---|" + "---|" * len(names),
    ]
    for key, group in itertools.groupby(
        records, lambda r: (r["heads"], r["ctx"], r["cap"], r["batch"])
    ):
        cells = []
        for r in group:
            cell = f"{r['us']:.2f} (s{r['splits']})"
            cells.append(f"**{cell}**" if r["default"] else cell)
        lines.append(f"| {key[0]} | {key[1]} ({key[2]}) | {key[3]} | " + " | ".join(cells) + " |")
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default="results")
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    meta = gpu_meta(args.commit)
    records = [r for case in CASES for r in run_case(*case)]
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels_mla_heads.json").write_text(
        json.dumps({"meta": meta, "records": records}, indent=1)
    )
    write_markdown(out / "kernels_mla_heads.md", meta, records)
    return 0 if all(r["ok"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
