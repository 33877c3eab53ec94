"""MLA decode launch config by head count: 64-, 32- and 16-row head blocks at small batch.

The split kernel gives each program BLOCK_H heads of one sequence; with 16 heads per rank
(the TP8 share of 128) a 64-row block is three-quarters masked rows. This times block_h
64 (8 warps, DEFAULT_CONFIG), 32 (4 warps) and 16 (8 and 4 warps), each with its own default
split count, at 128, 64 and 16 heads, contexts 100 / 4k / 32k (block-table capacity 1k / 4k / 32k),
batch 1-64, BF16 cache, page size 64, graph-timed (caches cycled past L2); the output of
every config is checked against the fp32 reference. `default_config` follows the result.

  cd benchmarks && PYTHONPATH=.. python kernels_mla_heads.py [--out-dir results] [--commit SHA]

``--fused-merge`` times instead the split kernel's fused merge (one launch) against the
two-kernel path (split + merge launch) of the same default config and split count: 8 heads
(the TP8 share of Kimi-K2.5's 64), 16 and 128 heads, batch 1 / 8 / 64, 256 / 1024 / 4096
cached tokens per sequence in a 4096-token capacity, us per call in a CUDA graph, each
output checked against the fp32 reference. It prints a table (and writes
kernels_mla_fused_merge.json / .md where --out-dir is given):

  PYTHONPATH=$PWD python benchmarks/kernels_mla_heads.py --fused-merge [--out-dir DIR]

(Its H200 result is summarised in mla_decode's module docstring, "Measured": why the
two-kernel path stays the default.)

``--smoke`` (with ``--fused-merge``) runs toy sizes on the CPU under TRITON_INTERPRET=1 to
check the script itself (no graphs, no meaningful times).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"
    # the interpreter shims (numpy loop bounds, bf16 dot, fp8 rounding) live with the tests
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.kernels.interpreter_shims import install_interpreter_shims

    install_interpreter_shims()

import torch  # noqa: E402
from common import gpu_meta  # noqa: E402
from kernels_gemm_moe import graph_time_us  # noqa: E402

from moeserve.kernels.attention import mla_decode as md  # noqa: E402

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


def mla_case(
    heads: int, ctx: int, cap: int, batch: int, page: int = PAGE, device: str = "cuda"
) -> tuple:
    """(cache copies cycled past L2, block tables (permuted pages), seq_lens, q, out, the fp32
    reference output on the last copy) for `batch` sequences of `ctx` tokens in a `cap`-token
    capacity."""
    pages_per = cap // page
    pages = pages_per * batch
    copies = max(2, min(8, CACHE_BYTES // (pages * page * 576 * 2) + 1))
    caches = [torch.randn(pages, page, 576, device=device).bfloat16() for _ in range(copies)]
    bt = torch.randperm(pages, device=device, dtype=torch.int32).view(batch, pages_per)
    sl = torch.full((batch,), ctx, device=device, dtype=torch.int32)
    q = torch.randn(batch, heads, 576, device=device).bfloat16()
    out = torch.empty(batch, heads, 512, device=device).bfloat16()
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


# --fused-merge: (heads, batch, cached tokens) at FUSED_CAPACITY tokens of block table
FUSED_CASES = list(itertools.product((8, 16, 128), (1, 8, 64), (256, 1024, 4096)))
FUSED_CAPACITY = 4096
SMOKE_CASES = [(8, 1, 40), (20, 2, 100)]  # CPU interpreter: toy sizes
SMOKE_CAPACITY = 512  # 4 splits (by the >= 128 tokens per split bound)
SMOKE_PAGE = 16
GRAPH_CALLS, GRAPH_REPS = 40, 5
MAX_REL_ERR = 3e-2  # of the largest |reference| value: bf16 q, probabilities and partials


def run_fused_case(heads: int, batch: int, ctx: int, cap: int, smoke: bool) -> dict:
    """One (heads, batch, tokens) point: two-kernel and fused us per call for the default
    config and split count of the static sizes (as the server launches them)."""
    device, page = ("cpu", SMOKE_PAGE) if smoke else ("cuda", PAGE)
    caches, bt, sl, q, out, ref = mla_case(heads, ctx, cap, batch, page, device)
    sms = md.device_sm_count(torch.device(device))
    cfg = md.default_config(heads, batch, cap)
    if smoke:  # 16-token tiles: several splits at toy lengths
        cfg = dataclasses.replace(cfg, block_h=16, block_n=16, num_warps=4, num_stages=1)
    splits = md.default_num_splits(batch, heads, cap, cfg, sms)
    ws = md.MLADecodeWorkspace.allocate(batch, heads, splits, device)
    min_tiles = md.min_split_tiles(cfg.min_split_tokens or cfg.block_n, cfg.block_n)
    row = dict(heads=heads, batch=batch, ctx=ctx, cap=cap, block_h=cfg.block_h, splits=splits,
               active=md.active_splits(ctx, splits, cfg.block_n, min_tiles))  # fmt: skip
    for name, fused in (("two_kernel", False), ("fused", True)):
        run_cfg = dataclasses.replace(cfg, fused_merge=fused)
        fns = [
            lambda c=c, run_cfg=run_cfg: md.mla_decode(
                q, c, bt, sl, SM_SCALE, out, num_splits=splits, workspace=ws, config=run_cfg
            )
            for c in caches
        ]
        row[f"{name}_us"] = graph_time_us(fns, GRAPH_CALLS, GRAPH_REPS)["us"]
        out.fill_(float("nan"))
        fns[-1]()
        err = float((out.float() - ref).abs().max() / ref.abs().max())
        row[f"{name}_err"] = err
    row["counters_zero"] = not bool(ws.counters.any())
    row["ok"] = (
        row["counters_zero"]
        and row["two_kernel_err"] < MAX_REL_ERR
        and row["fused_err"] < MAX_REL_ERR
    )
    return row


def fused_table(records: list[dict]) -> list[str]:
    lines = [
        "| heads | batch | tokens (capacity) | block_h | splits (active) | two-kernel us |"
        " fused us | fused / two-kernel | ok |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['heads']} | {r['batch']} | {r['ctx']} ({r['cap']}) | {r['block_h']} | "
            f"{r['splits']} ({r['active']}) | {r['two_kernel_us']:.2f} | {r['fused_us']:.2f} | "
            f"{r['fused_us'] / r['two_kernel_us']:.2f} | {'yes' if r['ok'] else 'NO'} |"
        )
    return lines


def fused_merge_main(out_dir: str | None, commit: str | None, smoke: bool) -> int:
    cases = [(h, b, n, SMOKE_CAPACITY) for h, b, n in SMOKE_CASES] if smoke else [
        (h, b, n, FUSED_CAPACITY) for h, b, n in FUSED_CASES
    ]  # fmt: skip
    records = []
    for case in cases:
        records.append(run_fused_case(*case, smoke=smoke))
        r = records[-1]
        print(
            f"H={r['heads']} B={r['batch']} ctx={r['ctx']}: s{r['splits']} a{r['active']} "
            f"two-kernel {r['two_kernel_us']:.2f} us, fused {r['fused_us']:.2f} us"
            + ("" if r["ok"] else f" CHECK FAILED {r}"),
            flush=True,
        )
    meta = {} if smoke else gpu_meta(commit)
    title = (
        f"MLA decode fused merge vs split + merge launch (GPU {meta.get('gpu', 'none: smoke')}, "
        f"triton {meta.get('triton', '-')}, commit {meta.get('commit', '-')}): us per call in "
        "a CUDA graph, BF16 cache, page 64, default config and split count."
    )
    table = fused_table(records)
    print("\n" + title + "\n\n" + "\n".join(table))
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "kernels_mla_fused_merge.json").write_text(
            json.dumps({"meta": meta, "records": records}, indent=1)
        )
        (out / "kernels_mla_fused_merge.md").write_text(
            "# MLA decode: fused merge\n\n" + title + "\n\n" + "\n".join(table) + "\n"
        )
    return 0 if all(r["ok"] for r in records) else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default=None, help="default: results (--fused-merge: none)")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--fused-merge", action="store_true", help="fused vs two-kernel merge")
    ap.add_argument("--smoke", action="store_true", help="--fused-merge at toy sizes on a CPU")
    args = ap.parse_args()
    if args.fused_merge and args.smoke:
        return fused_merge_main(args.out_dir, args.commit, smoke=True)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    if args.fused_merge:
        return fused_merge_main(args.out_dir, args.commit, smoke=False)
    meta = gpu_meta(args.commit)
    records = [r for case in CASES for r in run_case(*case)]
    out = Path(args.out_dir or "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels_mla_heads.json").write_text(
        json.dumps({"meta": meta, "records": records}, indent=1)
    )
    write_markdown(out / "kernels_mla_heads.md", meta, records)
    return 0 if all(r["ok"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
