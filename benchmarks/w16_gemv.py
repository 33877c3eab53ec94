# ruff: noqa: B023 -- the lambdas below are called within the loop iteration that makes them
"""The 16-bit split-K GEMV (kernels/gemm/w16_gemv.py) against cuBLAS on MLA's bf16 projections
at decode sizes (DeepSeek-V3 / Kimi-K2.5 shapes, 1, 2 and 4 rows).

Shapes: the merged q_a + kv_a projection with its two RMSNorms fused (peer: F.linear, then
rms_norm_pair in place, as layers/attention/mla.py does), q_b on a TP8 rank and whole, o_proj
on a TP8 rank and whole. Every time is measured inside a CUDA graph (200 calls captured,
replayed, divided; kernels_gemm_moe.graph_time_us) with the weights cycling through enough
copies that they never sit in the 50 MB L2 between calls. Each kernel output is checked
against the fp32 torch reference before it is timed.

  PYTHONPATH=$PWD python benchmarks/w16_gemv.py [--sweep] [--out FILE] [--shapes q_b ...]

--sweep: per shape and row count, a coordinate search over BLOCK_N / BLOCK_K / SPLIT_K /
num_warps / STAGES / K_FOLD from the shipped tiles.json entry; prints the best and the
tiles.json entries that would ship it. --smoke: every shape scaled down by 16 on the CPU
(interpreter), one row, to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

if not torch.cuda.is_available():  # --smoke: the kernels run in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from common import gpu_meta  # noqa: E402
from kernels_gemm_moe import HBM_BYTES_PER_S, graph_time_us, n_copies  # noqa: E402

from moeserve.kernels.configs import tile_config  # noqa: E402
from moeserve.kernels.elementwise.norm import rms_norm_pair  # noqa: E402
from moeserve.kernels.gemm import w16_gemv as wg  # noqa: E402

# name -> (N, K, widths of the normalised segments from column 0)
SHAPES: dict[str, tuple[int, int, tuple[int, ...]]] = {
    "q_a+kv_a": (2112, 7168, (1536, 512)),
    "q_b_tp8": (1536, 1536, ()),
    "q_b": (24576, 1536, ()),
    "o_proj_tp8": (7168, 1024, ()),
    "o_proj": (7168, 16384, ()),
}
ROWS = (1, 2, 4)
CALLS = 200  # calls per captured graph
REPS = 7  # graph replays timed (median taken)
SWEEP_CALLS, SWEEP_REPS = 100, 5
EPS = 1e-6
SMOKE_DIV = 16  # --smoke divides N, K and the segment widths by this
DTYPE = torch.bfloat16
# one rounding of bf16, fp32 summation-order slack, and the same through the normalisation
ULP, FP32_SLACK, NORM_SLACK = 2.0**-7, 2.0**-18, 1e-5
SWEEP_GRID: dict[str, tuple[int, ...]] = {
    "BLOCK_N": (8, 16, 32, 64),
    "BLOCK_K": (128, 256, 512),
    "SPLIT_K": (0, 1, 2, 4, 8),
    "num_warps": (2, 4, 8),
    "STAGES": (0, 2, 3, 4, 6),
    "K_FOLD": (1, 8),
}
SWEEP_PASSES = 2  # rounds of the coordinate search


def log(*a: object) -> None:
    print(*a, flush=True)


@dataclass
class Case:
    """One shape at one row count: weight copies, inputs, norm segments, a workspace."""

    name: str
    n: int
    k: int
    t: int
    weights: list[torch.Tensor]
    x: torch.Tensor
    out: torch.Tensor
    segments: tuple[wg.NormSegment, ...]
    workspace: wg.W16Workspace

    @property
    def weight_bytes(self) -> int:
        return self.n * self.k * self.weights[0].element_size()


def make_case(name: str, n: int, k: int, widths: tuple[int, ...], t: int, dev: str) -> Case:
    gen = torch.Generator(device=dev).manual_seed(n + k + t)
    copies = n_copies(n * k * DTYPE.itemsize)
    weights = [
        (torch.randn(n, k, generator=gen, device=dev) * k**-0.5).to(DTYPE) for _ in range(copies)
    ]
    x = torch.randn(t, k, generator=gen, device=dev).to(DTYPE)
    segments, start = [], 0
    for width in widths:
        weight = (1.0 + 0.1 * torch.randn(width, generator=gen, device=dev)).to(DTYPE)
        segments.append(wg.NormSegment(start, width, weight, EPS))
        start += width
    # room for any split the sweep may choose (at most one per K tile of the smallest BLOCK_K)
    ws = wg.W16Workspace.allocate(t, n, triton.cdiv(k, min(SWEEP_GRID["BLOCK_K"])), dev)
    out = torch.empty(t, n, dtype=DTYPE, device=dev)
    return Case(name, n, k, t, weights, x, out, tuple(segments), ws)


def ours(case: Case, cfg: dict[str, int]) -> list:
    return [
        lambda w=w: wg.w16_gemv(case.x, w, case.out, case.segments, case.workspace, cfg)
        for w in case.weights
    ]


def cublas(case: Case) -> list:
    def call(w: torch.Tensor) -> None:
        y = F.linear(case.x, w)
        if case.segments:
            a, b = case.segments
            rms_norm_pair(y, a.weight, b.weight, a.eps, b.eps, out=y)

    return [lambda w=w: call(w) for w in case.weights]


def check(case: Case, cfg: dict[str, int]) -> float:
    """Largest error of our output on the last weight copy as a multiple of its tolerance
    (<= 1 passes: one bf16 rounding of the fp32 reference, plus fp32 slack)."""
    w = case.weights[-1]
    got = wg.w16_gemv(case.x, w, case.out, case.segments, case.workspace, cfg).float()
    ref = case.x.float() @ w.float().t()
    tol = ULP * ref.abs() + FP32_SLACK * (case.x.float().abs() @ w.float().abs().t())
    for seg in case.segments:
        cols = slice(seg.start, seg.start + seg.width)
        v = ref[:, cols].clone()
        ref[:, cols] = v * torch.rsqrt(v.pow(2).mean(1, keepdim=True) + seg.eps) * seg.weight
        tol[:, cols] = ULP * ref[:, cols].abs() + NORM_SLACK
    return float(((got - ref).abs() / tol).max())


def time_us(fns: list, calls: int, reps: int) -> float:
    return graph_time_us(fns, calls, reps)["us"]


def sweep_case(
    case: Case, shipped: dict[str, int], shipped_us: float, passes: int
) -> tuple[dict, float]:
    """Coordinate search from the shipped config: each parameter in turn over its grid values,
    the others held at the best so far; `passes` rounds. Returns (best config, its us)."""
    tried: dict[tuple, float] = {}

    def key(c: dict[str, int]) -> tuple:
        return tuple(sorted(c.items()))

    best, best_us = dict(shipped), shipped_us
    tried[key(best)] = best_us
    for _ in range(passes):
        for param, values in SWEEP_GRID.items():
            for v in values:
                cfg = {**best, param: v}
                if key(cfg) in tried or cfg["BLOCK_K"] % cfg.get("K_FOLD", 1):
                    continue
                try:
                    if check(case, cfg) > 1.0:
                        log(f"  {case.name} T={case.t} {cfg}: WRONG RESULT")
                        tried[key(cfg)] = float("inf")
                        continue
                    us = time_us(ours(case, cfg), SWEEP_CALLS, SWEEP_REPS)
                except Exception as e:  # noqa: BLE001 (a config may not compile or fit)
                    log(f"  {case.name} T={case.t} {cfg}: {type(e).__name__}: {str(e)[:200]}")
                    tried[key(cfg)] = float("inf")
                    continue
                tried[key(cfg)] = us
                if us < best_us:
                    best, best_us = cfg, us
    return best, best_us


def table_entries(best: dict[tuple[str, int], dict]) -> dict[str, list[dict]]:
    """tiles.json "w16_gemv" entries ("NxK" -> max_m list) that would ship the sweep's best."""
    out: dict[str, list[dict]] = {}
    for (name, t), cfg in sorted(best.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        n, k, _ = SHAPES[name]
        out.setdefault(f"{n}x{k}", []).append({"max_m": t, **cfg})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true", help="search tile configs per shape and T")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--rows", nargs="*", type=int, default=list(ROWS))
    ap.add_argument("--out", type=Path, default=None, help="write the records as JSON here")
    ap.add_argument("--passes", type=int, default=SWEEP_PASSES, help="coordinate-search rounds")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU interpreter)")
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.smoke:
        log("no CUDA GPU: run with --smoke to check the script in the interpreter")
        return 1
    dev = "cuda" if on_gpu else "cpu"
    div = SMOKE_DIV if args.smoke else 1
    rows = [1] if args.smoke else args.rows
    meta = gpu_meta(args.commit) if on_gpu else {"gpu": "cpu (interpreter)"}
    log(json.dumps(meta))
    records, best = [], {}
    header = (f"{'shape':<11} {'T':>1} {'N x K':>12} {'MB':>6} {'w16 us':>7} {'cuBLAS us':>9} "
              f"{'x':>5} {'GB/s':>6} {'%HBM':>5} {'err/tol':>7}  config")  # fmt: skip
    log(header)
    for name in args.shapes:
        n, k, widths = SHAPES[name]
        n, k, widths = n // div, k // div, tuple(w // div for w in widths)
        for t in rows:
            case = make_case(name, n, k, widths, t, dev)
            shipped = tile_config(wg.TABLE, t, f"{n}x{k}")
            start = time.perf_counter()
            err = check(case, shipped)
            us = time_us(ours(case, shipped), CALLS, REPS)
            peer_us = time_us(cublas(case), CALLS, REPS)
            gbs = case.weight_bytes / (us * 1e-6) / 1e9
            rec = dict(
                shape=name, T=t, N=n, K=k, norms=list(widths), us=us, cublas_us=peer_us,
                speedup=peer_us / us, gb_per_s=gbs, pct_hbm=100 * gbs * 1e9 / HBM_BYTES_PER_S,
                err_over_tol=err, ok=err <= 1.0, config=shipped,
                split=wg.planned_split(t, n, k, torch.device(dev), shipped),
            )  # fmt: skip
            log(f"{name:<11} {t:>1} {f'{n}x{k}':>12} {case.weight_bytes / 1e6:>6.1f} {us:>7.2f} "
                f"{peer_us:>9.2f} {peer_us / us:>5.2f} {gbs:>6.0f} {rec['pct_hbm']:>5.1f} "
                f"{err:>7.2f}  {shipped} split {rec['split']}")  # fmt: skip
            if args.sweep:
                cfg, best_us = sweep_case(case, shipped, us, args.passes)
                best[(name, t)] = cfg
                rec.update(best_config=cfg, best_us=best_us, best_speedup=peer_us / best_us)
                log(f"  best {best_us:.2f} us ({peer_us / best_us:.2f}x cuBLAS): {cfg} "
                    f"[{time.perf_counter() - start:.0f} s]")  # fmt: skip
            records.append(rec)
            del case
    if best:
        log('tiles.json "w16_gemv" entries for the swept shapes:')
        log(json.dumps(table_entries(best), indent=1))
    if args.out:
        args.out.write_text(json.dumps({"meta": meta, "records": records}, indent=1))
        log(f"wrote {args.out}")
    return 0 if all(r["ok"] for r in records) else 2


if __name__ == "__main__":
    sys.exit(main())
