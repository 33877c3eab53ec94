"""Where the one-token NVFP4 MoE GEMV's time goes: the shipped kernels with parts removed.

The fused NVFP4 MoE at one token reads 8 experts' 189 MB in ~81 us (57% of HBM), where a
kernel that only reads the same bytes in the same tiles takes ~58 us (read_floor.py). This
script times the shipped F16 GEMV path (gate_up + down + combine, tiles.json's config) with
its per-tile pieces swapped for cheaper stand-ins, each in its own process (Triton compiles a
helper into its callers once):

  base    as shipped
  nox     the x pairs are constants: no x load, scaling, f16 conversion or pair shuffle
  nodec   the E2M1 decode is one AND per pair instead of ~3 instructions (wrong values)
  both    nox and nodec

Outputs of the ablated variants are meaningless; only the times matter. The stand-ins follow
`nvfp4_gemv._tile_dot_f16`'s signature, so this script tracks that helper (results/
moe_nvfp4_ablation.json was measured at 9db3324, before the loop changes of 12693f4).

  PYTHONPATH=$PWD python benchmarks/moe_nvfp4_ablation.py --out-dir DIR
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

VARIANTS = ("base", "nox", "nodec", "both")


def _nodec_asm() -> str:
    lines = [".reg .b32 r, a;", ".reg .b16 lo, hi;", ".reg .f32 flo, fhi;"]
    first = True
    for w, q in ((0, "$1"), (1, "$2")):
        for j in range(4):
            lines.append(f"and.b32 r, {q}, {0x8E008E00 >> j:#010x};")
            x = f"${3 + 4 * w + j}"
            lines.append(f"mul.rn.f16x2 a, r, {x};" if first else f"fma.rn.f16x2 a, r, {x}, a;")
            first = False
    lines += ["mov.b32 {lo, hi}, a;", "cvt.f32.f16 flo, lo;", "cvt.f32.f16 fhi, hi;"]
    lines.append("add.f32 $0, flo, fhi;")
    return "{\n" + "\n".join(lines) + "\n}"


def _patch(variant: str) -> None:
    import triton
    import triton.language as tl

    from moeserve.kernels.gemm import nvfp4_gemv as g

    asm = tl.constexpr(_nodec_asm() if variant in ("nodec", "both") else g._f16x2_dot_asm())
    const_x = variant in ("nox", "both")

    @triton.jit
    def tile_dot(q0, q1, s, x_row, ok, kw, K, xs, BW: tl.constexpr, DECODE: tl.constexpr):
        if CONST_X:  # noqa: F821 (set in the globals below)
            p = tl.full((BW // 2,), 0x3C003C00, tl.int32) + (kw & 0)
            a0, a1, a2, a3, b0, b1, b2, b3 = p, p, p, p, p, p, p, p
        else:  # as nvfp4_gemv._tile_dot_f16 on the GPU
            xf = g._load_x(x_row, ok, kw, K, BW) * xs
            xf = tl.permute(tl.reshape(xf, (BW // 2, 2, 2, 4)), (0, 1, 3, 2))
            lo, hi = tl.split(xf)
            pairs = tl.inline_asm_elementwise(
                "cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=tl.int32,
                is_pure=True, pack=1,
            )  # fmt: skip
            w0, w1 = tl.split(tl.permute(pairs, (0, 2, 1)))
            a0, a1, a2, a3 = g._split4(w0)
            b0, b1, b2, b3 = g._split4(w1)
        v = tl.inline_asm_elementwise(
            ASM,  # noqa: F821
            "=f,r,r,r,r,r,r,r,r,r,r",
            [q0, q1, a0[None, :], a1[None, :], a2[None, :], a3[None, :], b0[None, :],
             b1[None, :], b2[None, :], b3[None, :]],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )  # fmt: skip
        return v * s

    tile_dot.fn.__globals__.update(ASM=asm, CONST_X=tl.constexpr(const_x), g=g)
    g._tile_dot_f16 = tile_dot


def run_variant(variant: str) -> dict:
    import torch
    from kernels_gemm_moe import graph_time_us, rand_nvfp4_experts

    if variant != "base":
        _patch(variant)
    from moeserve.kernels.moe import nvfp4 as moe_mod

    e_, h, i, topk = 384, 7168, 2048, 8
    experts = rand_nvfp4_experts(e_, h, i, "cuda")
    routes = [torch.randperm(e_, device="cuda")[:topk].int()[None, :] for _ in range(20)]
    tws = [torch.rand(1, topk, device="cuda") for _ in routes]
    x = torch.randn(1, h, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(1, h, device="cuda", dtype=torch.bfloat16)
    nbytes = topk * (3 * i * h // 2 + 3 * i * h // 16)

    def call(r, tw):
        moe_mod.fused_moe_nvfp4(x, r, tw, *experts, out=out, kernel="gemv")

    fns = [lambda r=r, tw=tw: call(r, tw) for r, tw in zip(routes, tws, strict=True)]
    t = graph_time_us(fns, 40, reps=5)
    return {"variant": variant, "us": t["us"], "pct": 100 * nbytes / (t["us"] * 1e-6) / 4.3e12}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", choices=VARIANTS)
    ap.add_argument("--out-dir", default="benchmarks/results")
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant)), flush=True)
        return 0
    rows = []
    for v in VARIANTS:
        p = subprocess.run(
            [sys.executable, __file__, "--variant", v], capture_output=True, text=True
        )
        line = (p.stdout.strip().splitlines() or [""])[-1]
        if p.returncode or not line.startswith("{"):
            print(v, "failed", p.stderr[-2000:], flush=True)
            continue
        rows.append(json.loads(line))
        print(f"{v:6s} {rows[-1]['us']:7.2f} us {rows[-1]['pct']:5.1f}%", flush=True)
    Path(args.out_dir, "moe_nvfp4_ablation.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
