# ruff: noqa: B023 -- the lambdas below are called within the loop iteration
"""How fast can a kernel that only READS the weights go? The floor under the GEMV targets
of results/kernels.md.

A GEMV at one token reads every weight byte once and does little else, so no GEMV can beat a
kernel that reads the same bytes in the same pattern and throws them away (xor-sums them, so
the loads are not removed). This script times such read-only kernels, graph-timed with the
weights cycled past L2 exactly like kernels_gemm_moe.py, and prints % of 4.3 TB/s:

  dense  one contiguous matrix of the byte size of each Kimi-K2.5 NVFP4 GEMV shape (packed +
         scales) and of 4..256 MB, the best of a config sweep, next to cuBLAS bf16 GEMV
         (torch.mv) on a bf16 matrix of the same bytes (the vendor's streaming read);
  moe    the fused NVFP4 MoE's one-token pattern: 8 of 384 Kimi experts, gate_up and down
         each read in the tiles of the shipped GEMV config (and a few others), next to the
         shipped fused_moe_nvfp4 itself on the same routings.

The gap between a kernel and its read floor is what compute and instruction issue cost; the
gap between the floor and 100% is what the memory system allows at that size.

  PYTHONPATH=$PWD python benchmarks/read_floor.py [dense] [moe] --out-dir DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from common import gpu_meta
from kernels_gemm_moe import (
    GEMM_SHAPES,
    HBM_BYTES_PER_S,
    graph_time_us,
    n_copies,
    nvfp4_bytes,
    rand_nvfp4_experts,
)

from moeserve.kernels.configs import tile_config
from moeserve.kernels.moe import nvfp4 as moe_mod

MB = 1 << 20
DENSE_SIZES_MB = (4, 8, 16, 32, 64, 128, 256)
# (words per program step, num_warps, STAGES, programs per SM)
DENSE_CONFIGS = [
    (w, nw, st, ps)
    for w, nw in ((512, 4), (1024, 4), (1024, 8), (2048, 8))
    for st in (2, 4)
    for ps in (2, 4, 8)
]
MOE_TILES = [  # (gate_up rows per program, down rows per program, BLOCK_K codes, warps, STAGES)
    (32, 32, 256, 2, 4),
    (32, 32, 256, 2, 6),
    (64, 64, 256, 4, 4),
    (64, 64, 512, 4, 4),
    (32, 64, 512, 4, 3),
    (128, 128, 256, 8, 4),
]
records: list[dict] = []


def log(*a: object) -> None:
    print(*a, flush=True)


def pct(nbytes: float, us: float) -> float:
    return 100 * nbytes / (us * 1e-6) / HBM_BYTES_PER_S


@triton.jit
def _stream_read_kernel(
    w_ptr, out_ptr, n_words, words_per_prog, BW: tl.constexpr, STAGES: tl.constexpr
):
    """Program p xor-sums words [p * words_per_prog, +words_per_prog) in steps of BW."""
    pid = tl.program_id(0)
    base = pid.to(tl.int64) * words_per_prog
    offs = tl.arange(0, BW)
    acc = tl.zeros((BW,), dtype=tl.int32)
    for it in tl.range(0, words_per_prog // BW, num_stages=STAGES):
        o = base + it * BW + offs
        acc ^= tl.load(w_ptr + o, mask=o < n_words, other=0)
    tl.store(out_ptr + pid * BW + offs, acc)


@triton.jit
def _expert_rows_read_kernel(
    w_ptr, s_ptr, ids_ptr, out_ptr, ROWS, KW,
    BLOCK_R: tl.constexpr, BW: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    """Grid (slots, row tiles): program (j, n) reads rows [n * BLOCK_R, +BLOCK_R) of expert
    ids[j] (packed words [ROWS, KW] and their e4m3 scale bytes [ROWS, KW / 2] per expert) along
    K in tiles of BW words, the access of the fused MoE GEMV, and xor-sums them."""
    slot = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(ids_ptr + slot).to(tl.int64)
    r = pid_n * BLOCK_R + tl.arange(0, BLOCK_R)
    w_rows = w_ptr + (e * ROWS + r[:, None]) * KW
    s_rows = s_ptr + (e * ROWS + r[:, None]) * (KW // 2)
    cw = tl.arange(0, BW)[None, :]
    cs = tl.arange(0, BW // 2)[None, :]
    acc = tl.zeros((BLOCK_R, BW), dtype=tl.int32)
    sacc = tl.zeros((BLOCK_R, BW // 2), dtype=tl.int32)
    for it in tl.range(0, KW // BW, num_stages=STAGES):
        acc ^= tl.load(w_rows + it * BW + cw)
        sacc ^= tl.load(s_rows + it * (BW // 2) + cs).to(tl.int32)
    v = tl.xor_sum(acc, axis=1) ^ tl.xor_sum(sacc, axis=1)
    tl.store(out_ptr + slot * ROWS + r, v)


def _record(kind: str, nbytes: float, us: float, **fields) -> float:
    p = pct(nbytes, us)
    records.append(dict(kind=kind, bytes=nbytes, us=us, pct=p, **fields))
    log(f"{kind:10s} {nbytes / MB:8.1f} MB {us:8.2f} us {p:5.1f}%  {fields}")
    return p


def dense() -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sizes = {f"{mb} MB": mb * MB for mb in DENSE_SIZES_MB}
    sizes.update({f"{k} ({n}x{kk})": nvfp4_bytes(0, n, kk) for k, (n, kk) in GEMM_SHAPES.items()})
    for name, nbytes in sizes.items():
        n_words = nbytes // 4
        copies = [torch.randint(-(2**31), 2**31 - 1, (n_words,), dtype=torch.int32, device="cuda")
                  for _ in range(n_copies(nbytes))]  # fmt: skip
        best = None
        for bw, nw, st, ps in DENSE_CONFIGS:
            progs = ps * sms
            per = triton.cdiv(triton.cdiv(n_words, progs), bw) * bw
            grid = (triton.cdiv(n_words, per),)
            out = torch.empty(grid[0] * bw, dtype=torch.int32, device="cuda")

            def call(w, per=per, grid=grid, out=out, bw=bw, nw=nw, st=st):
                _stream_read_kernel[grid](w, out, n_words, per, BW=bw, STAGES=st, num_warps=nw)

            t = graph_time_us([lambda w=w: call(w) for w in copies], 100)["us"]
            cfg = dict(BW=bw, num_warps=nw, STAGES=st, programs_per_sm=ps)
            if best is None or t < best[0]:
                best = (t, cfg)
        _record("read", nbytes, best[0], shape=name, cfg=best[1])
        # cuBLAS bf16 GEMV on a matrix of the same bytes (rows of 4096 values)
        k = 4096
        n = nbytes // (2 * k)
        mats = [c[: n * k // 2].view(torch.bfloat16).view(n, k) for c in copies]
        x = torch.randn(k, device="cuda", dtype=torch.bfloat16)
        t = graph_time_us([lambda m=m: torch.mv(m, x) for m in mats], 100)["us"]
        _record("cublas_mv", 2 * n * k, t, shape=name)
        del copies, mats
        torch.cuda.empty_cache()


def moe() -> None:
    e_, h, i, topk = 384, 7168, 2048, 8
    w13, s13, g13, w2, s2, g2 = rand_nvfp4_experts(e_, h, i, "cuda")
    per_expert = 3 * i * h // 2 + 3 * i * h // 16
    gate_bytes, down_bytes = 2 * i * h * 9 // 16, i * h * 9 // 16
    routes = [torch.randperm(e_, device="cuda")[:topk].int()[None, :] for _ in range(20)]
    tws = [torch.rand(1, topk, device="cuda") for _ in routes]
    nbytes = topk * per_expert
    x = torch.randn(1, h, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(1, h, device="cuda", dtype=torch.bfloat16)
    cfg = tile_config("moe_gemv", 1, f"{e_}:{2 * i}x{h}")

    def shipped(r, tw):
        moe_mod.fused_moe_nvfp4(x, r, tw, w13, s13, g13, w2, s2, g2, out=out, kernel="gemv")

    t = graph_time_us(
        [lambda r=r, tw=tw: shipped(r, tw) for r, tw in zip(routes, tws, strict=True)], 40, reps=5
    )
    _record("moe_shipped", nbytes, t["us"], cfg=cfg)
    w13i, w2i = w13.view(torch.int32), w2.view(torch.int32)
    s13b, s2b = s13.view(torch.uint8), s2.view(torch.uint8)
    ys = torch.empty(topk * max(2 * i, h), dtype=torch.int32, device="cuda")
    ids = [r.flatten() for r in routes]
    tiles = [(2 * cfg["BLOCK_N"], cfg.get("DOWN_BLOCK_N", cfg["BLOCK_N"]), cfg["BLOCK_K"],
              cfg["num_warps"], cfg.get("STAGES", 2))] + MOE_TILES  # fmt: skip
    for gr, dr, bk, nw, st in tiles:
        bw = bk // 8

        def gate(j):
            _expert_rows_read_kernel[(topk, 2 * i // gr)](
                w13i, s13b, j, ys, 2 * i, h // 8, BLOCK_R=gr, BW=bw, STAGES=st, num_warps=nw
            )

        def down(j):
            _expert_rows_read_kernel[(topk, h // dr)](
                w2i, s2b, j, ys, h, i // 8, BLOCK_R=dr, BW=bw, STAGES=st, num_warps=nw
            )

        tile = dict(gate_rows=gr, down_rows=dr, BLOCK_K=bk, num_warps=nw, STAGES=st)
        tg = graph_time_us([lambda j=j: gate(j) for j in ids], 40, reps=5)["us"]
        td = graph_time_us([lambda j=j: down(j) for j in ids], 40, reps=5)["us"]
        tb = graph_time_us([lambda j=j: (gate(j), down(j)) for j in ids], 40, reps=5)["us"]
        _record("moe_read_gate_up", topk * gate_bytes, tg, tile=tile)
        _record("moe_read_down", topk * down_bytes, td, tile=tile)
        _record("moe_read_both", nbytes, tb, tile=tile)


PARTS = {"dense": dense, "moe": moe}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("parts", nargs="*", default=list(PARTS))
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    meta = gpu_meta(args.commit)
    log(json.dumps(meta))
    for part in args.parts:
        PARTS[part]()
    path = Path(args.out_dir) / "read_floor.json"
    path.write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    by_kind: dict[str, list[float]] = {}
    for r in records:
        by_kind.setdefault(r["kind"], []).append(r["pct"])
    log({k: round(statistics.mean(v), 1) for k, v in by_kind.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
