"""MLA decode (Triton split kernel + merge) under the per-sequence split rule: the fewest
tokens a split streams (`MLADecodeConfig.min_split_tokens`) against the capacity-sized static
split count, at the batch / context / capacity points of batch-1 and small-batch decode.

One tile (64 tokens) is the rule before d773e06 plus its one change at one tile: a
sequence in one split writes `out` itself and the merge returns. Graph-timed like
kernels_mla_heads.py (caches cycled past L2), 16-token pages (the engine's default), the
engine's launch config (`default_config`, `default_num_splits`); every output is checked
against `mla_decode_ref`.

  PYTHONPATH=$PWD python benchmarks/mla_split_rule.py [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from common import gpu_meta
from kernels_gemm_moe import graph_time_us
from kernels_mla_heads import SM_SCALE, mla_case

from moeserve.kernels.attention import mla_decode as md

PAGE = 16
MIN_TOKENS = (64, 128, 256, 512)
CASES = [  # heads, context, capacity, batch
    (128, 100, 1024, 1),
    (128, 1000, 1024, 1),
    (128, 2000, 16384, 1),
    (128, 4096, 4096, 1),
    (128, 100, 1024, 8),
    (128, 2000, 16384, 8),
    (16, 100, 1024, 1),
    (16, 2000, 16384, 1),
    (16, 2000, 16384, 8),
]


def run_case(heads: int, ctx: int, cap: int, batch: int) -> list[dict]:
    caches, bt, sl, q, out, ref = mla_case(heads, ctx, cap, batch, PAGE)
    base = md.default_config(heads, batch, cap)
    splits = md.default_num_splits(batch, heads, cap, base, 132)
    ws = md.MLADecodeWorkspace.allocate(batch, heads, splits, "cuda")
    rows = []
    for tokens in MIN_TOKENS:
        cfg = md.MLADecodeConfig(**{**base.__dict__, "min_split_tokens": tokens})
        fns = [
            lambda c=c, cfg=cfg: md.mla_decode(
                q, c, bt, sl, SM_SCALE, out, num_splits=splits, workspace=ws, config=cfg
            )
            for c in caches
        ]
        us = graph_time_us(fns, 40, 5)["us"]
        fns[-1]()
        err = float((out.float() - ref).abs().max() / ref.abs().max())
        active = md.active_splits(ctx, splits, cfg.block_n, md.min_split_tiles(tokens, cfg.block_n))
        rows.append(
            dict(heads=heads, ctx=ctx, cap=cap, batch=batch, min_split_tokens=tokens,
                 splits=splits, active=active, us=us, rel_err=err, ok=err < 3e-2)
        )  # fmt: skip
    print(
        f"H={heads} ctx={ctx} cap={cap} B={batch} splits={splits}: "
        + " | ".join(f"min {r['min_split_tokens']} ({r['active']}) {r['us']:.2f} us" for r in rows),
        flush=True,
    )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default="benchmarks/results")
    args = ap.parse_args()
    records = []
    for case in CASES:
        records += run_case(*case)
        torch.cuda.empty_cache()
    path = Path(args.out_dir) / "mla_split_rule.json"
    path.write_text(json.dumps(dict(meta=gpu_meta(), records=records), indent=1))
    return 0 if all(r["ok"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
