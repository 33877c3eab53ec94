"""Sweep of the CUDA-core GEMV kernels with and without a software-pipelined K loop (`STAGES`).

Triton pipelines loads that feed no tl.dot only when the loop names its stages
(`tl.range(..., num_stages=S)`); the GEMV kernels did not, so each program kept at most one or
two weight tiles in flight in registers. With STAGES the tiles stream into shared memory by
cp.async. This script times the tile configs that tiles.json's STAGES entries and the
fp8_block_gemv table were chosen from, next to the shipped choice, on the full-size shapes:
  dense    NVFP4 GEMV (Kimi-K2.5 shapes), M=1, with and without PDL
  dense2   NVFP4 GEMV, M=1/2/4, the dispatcher's own choice ("auto") as the baseline
  moe      fused NVFP4 MoE GEMV path, 8 of 384 experts, M=1/8
  fp8      fused block-FP8 MoE GEMV path, 8 of 256 experts, M=1
  fp8_dense  dense block-FP8 (DeepSeek-V3 shapes): the tl.dot kernel vs GEMV configs, M=1/2/4
  fp8_small  more GEMV configs for the block-FP8 shapes under 16 MB, M=1
  fp8_moe_rows  block-FP8 MoE GEMV blocks of 2/4 slots, M=4/8/16
  w16      the same MoE GEMV on bf16 weights, 8 of 64 DeepSeek-size experts, M=1
  f16      NVFP4 GEMV (M=1/2/4) and MoE GEMV (M=1/8) with f16x2 products (F16=1)
  moe_m1_tiles  the one-token NVFP4 MoE on the tiles read_floor.py reads fastest
  gate_up  the fused NVFP4 gate/up + SiLU GEMV against two GEMVs + SiLU + multiply, M=1/4, on
           Kimi-K2.5's shared expert and dense MLP, whole and a TP8 rank's slice
  moe_split  the one-token NVFP4 MoE with split-K, on one TP8-EP rank's bank (48 experts, 2 or 3
           of a token's 8 slots local, the others another rank's) and on all 384 experts
Graph-timed like kernels_gemm_moe.py (weights cycled past L2; % of 4.3 TB/s); every candidate's
output is compared with the shipped kernel's or the torch reference (printed as err).

  PYTHONPATH=$PWD python benchmarks/kernels_stages_sweep.py dense moe fp8 fp8_dense dense2
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import traceback

import torch
from kernels_fp8 import SHAPES as FP8_SHAPES
from kernels_fp8 import rand_fp8_experts
from kernels_gemm_moe import (
    GEMM_SHAPES,
    HBM_BYTES_PER_S,
    graph_time_us,
    n_copies,
    nvfp4_bytes,
    rand_nvfp4,
    rand_nvfp4_experts,
)

from moeserve.kernels.configs import tile_config
from moeserve.kernels.gemm import fp8_block_gemm as f8
from moeserve.kernels.gemm import nvfp4_gemm as nv
from moeserve.kernels.gemm import splitk
from moeserve.kernels.moe import nvfp4 as moe_mod
from moeserve.kernels.moe.fp8 import fused_moe_fp8

records: list[dict] = []


def log(*a: object) -> None:
    print(*a, flush=True)


def pct(nbytes: float, us: float) -> float:
    return 100 * nbytes / (us * 1e-6) / HBM_BYTES_PER_S


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return (got.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()


def _gemv_cfg(bn: int, bk: int, w: int, st: int, sk: int, **extra: int) -> dict:
    return dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, num_warps=w, num_stages=1, STAGES=st, **extra)


NVFP4_M1 = [
    (32, 256, 4, 3, 0),
    (32, 256, 4, 4, 0),
    (32, 256, 4, 6, 0),
    (16, 256, 2, 4, 0),
    (16, 256, 2, 6, 0),
    (16, 256, 2, 8, 0),
    (64, 256, 8, 4, 0),
    (64, 256, 8, 6, 0),
    (16, 512, 4, 4, 0),
    (32, 512, 8, 4, 0),
    (32, 256, 4, 4, 1),
    (32, 256, 4, 4, 2),
    (16, 256, 2, 4, 8),
    (16, 256, 4, 4, 0),
]  # BLOCK_N, BLOCK_K, num_warps, STAGES, SPLIT_K


def _time_product(kind: str, call, ws: list, ref, nbytes: float, **fields) -> None:
    """Time call(w) cycling over the weight copies ws (one CUDA graph), compare call(ws[0]) with
    ref (when given), then record and print one row."""
    try:
        err = rel_err(call(ws[0]), ref) if ref is not None else float("nan")
        t = graph_time_us([lambda w=w: call(w) for w in ws], 100)
    except Exception as e:  # noqa: BLE001
        log(f"{kind} {fields} failed {e!r}"[:300])
        return
    p = pct(nbytes, t["us"])
    records.append(dict(kind=kind, **fields, us=t["us"], pct=p, err=err))
    shape, m, cfg = fields.get("shape"), fields.get("M"), fields.get("cfg")
    log(
        f"{kind} {shape:15s} M={m} {fields.get('kernel', '')} {t['us']:7.2f} us {p:5.1f}% "
        f"err {err:.1e} {cfg}"
    )


def _nvfp4_call(x, out, wsp, cfg, kernel):
    return lambda w: nv.nvfp4_gemm(x, *w, out=out, workspace=wsp, config=cfg, kernel=kernel)


def dense() -> None:
    for name, (n, k) in GEMM_SHAPES.items():
        ws = rand_nvfp4(n, k, n_copies(n * k // 2 + n * k // 16), "cuda")
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
        wsp = splitk.SplitKWorkspace.create(16 * n, 4096, "cuda")
        ref = nv.nvfp4_gemm_ref(x, *ws[0])
        cands = [(tile_config("nvfp4_gemv", 1, f"{n}x{k}"), True)]
        cands += [(_gemv_cfg(*c, PDL=p), False) for c in NVFP4_M1 for p in (0, 1)]
        for cfg, base in cands:
            call = _nvfp4_call(x, out, wsp, cfg, "gemv")
            nbytes = nvfp4_bytes(1, n, k)
            _time_product("dense", call, ws, ref, nbytes, shape=name, M=1, cfg=cfg, base=base)
        del ws
        torch.cuda.empty_cache()


def dense2(ms: tuple[int, ...] = (1, 2, 4)) -> None:
    cands = [("auto", None)] + [
        ("gemv", _gemv_cfg(*c, PDL=p))
        for *c, p in (
            (16, 512, 4, 4, 0, 0),
            (16, 256, 2, 4, 8, 1),
            (16, 256, 2, 4, 8, 0),
            (32, 256, 4, 4, 1, 0),
            (32, 256, 4, 3, 0, 0),
            (16, 256, 4, 4, 0, 0),
            (16, 256, 2, 4, 0, 0),
            (16, 256, 2, 3, 4, 0),
        )
    ]
    for name, (n, k) in GEMM_SHAPES.items():
        ws = rand_nvfp4(n, k, n_copies(n * k // 2 + n * k // 16), "cuda")
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            wsp = splitk.SplitKWorkspace.create(16 * n, 4096, "cuda")
            for kern, cfg in cands:
                call = _nvfp4_call(x, out, wsp, cfg, None if kern == "auto" else kern)
                nbytes = nvfp4_bytes(m, n, k)
                _time_product(
                    "dense2", call, ws, None, nbytes, shape=name, M=m, kernel=kern, cfg=cfg
                )
        del ws
        torch.cuda.empty_cache()


def _routes(e_: int, m: int, topk: int, n: int) -> tuple[list, list]:
    routes = [
        torch.stack([torch.randperm(e_, device="cuda")[:topk] for _ in range(m)]).int()
        for _ in range(n)
    ]
    return routes, [torch.rand(m, topk, device="cuda") for _ in range(n)]


def _moe_inputs(e_: int, m: int, topk: int, h: int, per_expert: int, n: int) -> tuple:
    """n routings of m tokens, x, out, and the bytes of the distinct experts they touch."""
    routes, tws = _routes(e_, m, topk, n)
    x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(m, h, device="cuda", dtype=torch.bfloat16)
    nbytes = statistics.mean(len(torch.unique(r)) for r in routes) * per_expert + 4 * m * h
    return routes, tws, x, out, nbytes


def _moe_sweep(kind: str, run, cands: list, m: int, routes, tws, nbytes: float) -> None:
    ref = run(routes[0], tws[0], None)
    for cfg in cands:
        try:
            err = rel_err(run(routes[0], tws[0], cfg), ref)
            fns = [
                lambda r=r, tw=tw, cfg=cfg: run(r, tw, cfg)
                for r, tw in zip(routes, tws, strict=True)
            ]
            t = graph_time_us(fns, 40 if kind == "moe_nvfp4" else 32, reps=5)
        except Exception as e:  # noqa: BLE001
            log(f"{kind} M={m} {cfg} failed {e!r}"[:300])
            continue
        p = pct(nbytes, t["us"])
        records.append(dict(kind=kind, M=m, cfg=cfg, us=t["us"], pct=p, err=err))
        log(f"{kind} M={m} {t['us']:7.1f} us {p:5.1f}% err {err:.1e} {cfg or 'BASE'}")


KIMI_MOE = (384, 7168, 2048, 8)  # experts, hidden, expert intermediate, top-k


def _kimi_moe_gemv_sweep(kind: str, ms: tuple[int, ...], cands_for) -> None:
    """fused_moe_nvfp4's CUDA-core GEMV path on Kimi-K2.5's MoE (random experts) at each token
    count m, over the configs cands_for(m, tiles.json's config for m) (None = the shipped)."""
    e_, h, i, topk = KIMI_MOE
    experts = rand_nvfp4_experts(e_, h, i, "cuda")
    per_expert = 3 * i * h // 2 + 3 * i * h // 16
    for m in ms:
        routes, tws, x, out, nbytes = _moe_inputs(e_, m, topk, h, per_expert, 20)
        base = tile_config("moe_gemv", m, f"{e_}:{2 * i}x{h}")

        def run(r, tw, cfg, x=x, out=out):
            return moe_mod.fused_moe_nvfp4(
                x, r, tw, *experts, out=out, gate_up_config=cfg, kernel="gemv"
            ).clone()

        _moe_sweep(kind, run, cands_for(m, base), m, routes, tws, nbytes)


def moe_nvfp4(ms: tuple[int, ...] = (1, 8)) -> None:
    def cands(m: int, base: dict) -> list:
        mp = 1 if m == 1 else 2
        return [None] + [
            dict(
                MP=mp,
                BLOCK_N=bn,
                DOWN_BLOCK_N=dbn,
                BLOCK_K=bk,
                num_warps=w,
                num_stages=1,
                STAGES=st,
            )
            for bn, dbn, bk, w, st in (
                (16, 16, 256, 2, 4),
                (16, 16, 256, 2, 6),
                (16, 16, 256, 2, 8),
                (16, 32, 256, 2, 4),
                (32, 32, 256, 4, 4),
                (32, 32, 256, 4, 6),
                (16, 16, 512, 4, 4),
                (32, 64, 256, 4, 4),
                (16, 16, 256, 4, 4),
                (8, 16, 256, 2, 4),
            )
        ]

    _kimi_moe_gemv_sweep("moe_nvfp4", ms, cands)


def moe_fp8(ms: tuple[int, ...] = (1,)) -> None:
    e_, h, i, topk = 256, 7168, 2048, 8
    w13, s13, w2, s2 = rand_fp8_experts(e_, h, i)
    per_expert = 3 * i * h + 4 * 3 * (i // 128) * (h // 128)
    cands = [None] + [
        dict(MP=1, BLOCK_N=bn, DOWN_BLOCK_N=dbn, BLOCK_K=128, num_warps=w, num_stages=1, STAGES=st)
        for bn, dbn, w, st in (
            (32, 64, 4, 3),
            (32, 64, 4, 4),
            (32, 64, 4, 6),
            (16, 32, 4, 4),
            (16, 32, 2, 4),
            (64, 64, 8, 4),
        )
    ]
    for m in ms:
        routes, tws, x, out, nbytes = _moe_inputs(e_, m, topk, h, per_expert, 16)

        def run(r, tw, cfg, x=x, out=out):
            return fused_moe_fp8(
                x, r, tw, w13, s13, w2, s2, out=out, kernel="gemv", config=cfg
            ).clone()

        _moe_sweep("moe_fp8", run, cands, m, routes, tws, nbytes)


def _fp8_dense_shape(name: str, n: int, k: int, ms: tuple[int, ...], cands: list) -> None:
    one = n * k + 4 * (-(-n // 128)) * (-(-k // 128))
    ws = []
    for _ in range(n_copies(n * k)):
        w = (torch.randn(n, k, device="cuda") * 0.5).to(torch.float8_e4m3fn)
        s = torch.rand(-(-n // 128), -(-k // 128), device="cuda") * 0.01 + 1e-3
        ws.append((w, s))
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        wsp = splitk.SplitKWorkspace.create(16 * n, 4096, "cuda")
        ref = f8.fp8_block_gemm_ref(x, *ws[0])
        for kern, cfg in cands if m == 1 else cands[:5]:

            def call(w, x=x, out=out, wsp=wsp, cfg=cfg, kern=kern):
                return f8.fp8_block_gemm(x, *w, out=out, workspace=wsp, config=cfg, kernel=kern)

            nbytes = one + 2 * m * (k + n)
            _time_product("fp8_dense", call, ws, ref, nbytes, shape=name, M=m, kernel=kern, cfg=cfg)
    del ws
    torch.cuda.empty_cache()


def fp8_dense(ms: tuple[int, ...] = (1, 2, 4)) -> None:
    cands = [("mma", None)] + [
        ("gemv", _gemv_cfg(bn, 128, w, st, sk))
        for bn, w, st, sk in (
            (16, 2, 4, 0),
            (16, 2, 3, 0),
            (16, 2, 6, 0),
            (32, 4, 4, 0),
            (32, 2, 4, 0),
            (64, 4, 4, 0),
            (16, 4, 4, 0),
            (16, 2, 4, 1),
            (32, 4, 3, 0),
            (64, 8, 4, 0),
        )
    ]
    for name, (n, k) in FP8_SHAPES.items():
        _fp8_dense_shape(name, n, k, ms, cands)


def fp8_small() -> None:
    """A second pass over the block-FP8 shapes under 16 MB, where ramp and tail dominate (M=1)."""
    small = {
        k: FP8_SHAPES[k] for k in ("shared_gate_up", "shared_down", "q_a_kv_a_proj", "kv_b_proj")
    }
    cands = [
        ("gemv", _gemv_cfg(bn, 128, w, st, sk))
        for bn, w, st, sk in (
            (32, 2, 4, 0),
            (16, 2, 4, 1),
            (32, 2, 4, 1),
            (16, 2, 2, 0),
            (32, 2, 2, 0),
            (16, 2, 3, 2),
            (32, 2, 3, 2),
            (16, 1, 4, 0),
            (32, 1, 4, 0),
            (16, 1, 3, 1),
            (8, 1, 4, 0),
            (64, 2, 4, 0),
        )
    ]
    for name, (n, k) in small.items():
        _fp8_dense_shape(name, n, k, (1,), cands)


def moe_fp8_rows(ms: tuple[int, ...] = (4, 8, 16)) -> None:
    """The MP=2/4 GEMV blocks of the block-FP8 MoE with and without STAGES."""
    e_, h, i, topk = 256, 7168, 2048, 8
    w13, s13, w2, s2 = rand_fp8_experts(e_, h, i)
    per_expert = 3 * i * h + 4 * 3 * (i // 128) * (h // 128)
    for m in ms:
        routes, tws, x, out, nbytes = _moe_inputs(e_, m, topk, h, per_expert, 16)
        cands = [None] + [
            dict(
                MP=mp,
                BLOCK_N=bn,
                DOWN_BLOCK_N=dbn,
                BLOCK_K=128,
                num_warps=w,
                num_stages=1,
                STAGES=st,
            )
            for mp in (2, 4)
            for bn, dbn, w, st in ((16, 32, 2, 4), (32, 64, 4, 4), (32, 32, 2, 3), (64, 64, 4, 4))
        ]

        def run(r, tw, cfg, x=x, out=out):
            return fused_moe_fp8(
                x, r, tw, w13, s13, w2, s2, out=out, kernel="gemv", config=cfg
            ).clone()

        _moe_sweep("moe_fp8", run, cands, m, routes, tws, nbytes)


def moe_w16(ms: tuple[int, ...] = (1,)) -> None:
    """The bf16-weight MoE GEMV (same kernel, 2 B/weight), 8 of 64 DeepSeek-size experts."""
    e_, h, i, topk = 64, 7168, 2048, 8
    w13 = torch.randn(e_, 2 * i, h, device="cuda", dtype=torch.bfloat16) * 0.05
    w2 = torch.randn(e_, h, i, device="cuda", dtype=torch.bfloat16) * 0.05
    per_expert = 3 * i * h * 2
    cands = [None] + [
        dict(MP=1, BLOCK_N=bn, DOWN_BLOCK_N=dbn, BLOCK_K=bk, num_warps=w, num_stages=1, STAGES=st)
        for bn, dbn, bk, w, st in (
            (16, 32, 128, 2, 4),
            (32, 64, 128, 4, 4),
            (16, 32, 64, 2, 4),
            (32, 32, 128, 2, 3),
            (16, 16, 128, 2, 3),
        )
    ]
    for m in ms:
        routes, tws, x, out, nbytes = _moe_inputs(e_, m, topk, h, per_expert, 16)

        def run(r, tw, cfg, x=x, out=out):
            return fused_moe_fp8(
                x, r, tw, w13, None, w2, None, out=out, kernel="gemv", config=cfg
            ).clone()

        _moe_sweep("moe_w16", run, cands, m, routes, tws, nbytes)


def f16() -> None:
    """NVFP4 GEMV and MoE GEMV with f16x2 products (F16=1) next to the same tiles without."""
    for name, (n, k) in GEMM_SHAPES.items():
        ws = rand_nvfp4(n, k, n_copies(n * k // 2 + n * k // 16), "cuda")
        for m in (1, 2, 4):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            wsp = splitk.SplitKWorkspace.create(16 * n, 4096, "cuda")
            ref = nv.nvfp4_gemm_ref(x, *ws[0])
            base = tile_config("nvfp4_gemv", m, f"{n}x{k}")
            cands = [base, dict(base, F16=1)]
            cands += [
                dict(_gemv_cfg(*c), F16=1)
                for c in (
                    (32, 256, 4, 3, 0),
                    (16, 256, 2, 4, 0),
                    (32, 512, 4, 3, 0),
                    (64, 256, 4, 3, 0),
                    (32, 256, 4, 0, 0),
                    (16, 512, 4, 3, 0),
                )
            ]
            for cfg in cands:
                call = _nvfp4_call(x, out, wsp, cfg, "gemv")
                nbytes = nvfp4_bytes(m, n, k)
                _time_product("f16", call, ws, ref, nbytes, shape=name, M=m, cfg=cfg)
        del ws
        torch.cuda.empty_cache()
    moe_nvfp4_f16()


def moe_nvfp4_f16(ms: tuple[int, ...] = (1, 8)) -> None:
    def cands(m: int, base: dict) -> list:
        return [None, dict(base, F16=1)] + [
            dict(base, F16=1, STAGES=st, BLOCK_N=bn, DOWN_BLOCK_N=dbn, num_warps=w)
            for bn, dbn, w, st in ((16, 16, 2, 3), (16, 32, 2, 4), (32, 32, 4, 3), (16, 16, 4, 0))
        ]

    _kimi_moe_gemv_sweep("moe_nvfp4_f16", ms, cands)


# (gate_up BLOCK_N, DOWN_BLOCK_N, BLOCK_K, num_warps, STAGES): neighbours of the shipped config,
# the wider tiles (32 words per thread: 3.1 loop instructions per weight in the sm_90a SASS
# against 3.6) and read_floor.py's fastest read tiles
MOE_M1_TILES = (
    (16, 32, 256, 2, 3),
    (32, 32, 256, 2, 3),
    (16, 32, 512, 2, 3),
    (32, 64, 256, 2, 3),
    (16, 32, 512, 2, 4),
    (32, 32, 256, 2, 4),
    (8, 32, 512, 2, 3),
    (16, 64, 512, 4, 3),
    (32, 32, 512, 4, 3),
)


def moe_m1_tiles() -> None:
    """The one-token NVFP4 MoE (F16 GEMV path) on the tiles that read fastest."""

    def cands(m: int, base: dict) -> list:
        return [None] + [
            dict(base, BLOCK_N=bn, DOWN_BLOCK_N=dbn, BLOCK_K=bk, num_warps=w, STAGES=st)
            for bn, dbn, bk, w, st in MOE_M1_TILES
        ]

    _kimi_moe_gemv_sweep("moe_m1_tiles", (1,), cands)


MOE_SPLITS = [
    (16, 32, 1, 1),
    (16, 32, 2, 1),
    (16, 32, 4, 1),
    (16, 32, 4, 2),
    (16, 32, 7, 2),
    (16, 32, 7, 4),
    (32, 32, 4, 2),
    (32, 64, 4, 2),
    (32, 32, 7, 2),
    (16, 64, 4, 4),
    (8, 32, 4, 2),
]  # BLOCK_N, DOWN_BLOCK_N, SPLIT_K, DOWN_SPLIT_K


def moe_split() -> None:
    """One token, split-K candidates: rank 0 of TP8-EP (48 experts; `local` of the 8 slots on
    this rank, the rest ids of other ranks, which the kernels skip) and the whole bank."""
    _, h, i, topk = KIMI_MOE
    per_expert = 3 * i * h // 2 + 3 * i * h // 16
    for e_, local in ((48, 2), (48, 3), (384, 8)):
        experts = rand_nvfp4_experts(e_, h, i, "cuda")
        routes = []
        for _ in range(20):
            mine = torch.randperm(e_, device="cuda")[:local]
            other = e_ + torch.arange(topk - local, device="cuda")
            routes.append(torch.cat([mine, other])[None].int())
        tws = [torch.rand(1, topk, device="cuda") for _ in routes]
        x = torch.randn(1, h, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(1, h, device="cuda", dtype=torch.bfloat16)
        base = tile_config("moe_gemv", 1, f"{e_}:{2 * i}x{h}")
        counters = torch.zeros(
            moe_mod.combine_counters_needed(h, i, topk), dtype=torch.int32, device="cuda"
        )

        def run(r, tw, cfg, x=x, out=out, experts=experts, counters=counters):
            return moe_mod.fused_moe_nvfp4(
                x, r, tw, *experts, out=out, gate_up_config=cfg, kernel="gemv",
                combine_counters=counters,
            ).clone()  # fmt: skip

        cands = [None] + [
            dict(base, BLOCK_N=bn, DOWN_BLOCK_N=dbn, SPLIT_K=sk, DOWN_SPLIT_K=dsk)
            for bn, dbn, sk, dsk in MOE_SPLITS
        ]
        log(f"# moe_split: {e_} experts, {local} of {topk} slots local")
        _moe_sweep(f"moe_split_{e_}_{local}", run, cands, 1, routes, tws, local * per_expert)
        del experts
        torch.cuda.empty_cache()


GATE_UP_SHAPES = {
    "shared/8": (256, 7168),
    "dense/8": (2304, 7168),
    "shared": (2048, 7168),
    "dense": (18432, 7168),
}
GATE_UP_TILES = [
    (16, 256, 2, 0, 0),
    (16, 256, 2, 0, 3),
    (16, 256, 2, 4, 3),
    (16, 256, 2, 7, 3),
    (16, 256, 2, 14, 0),
    (8, 256, 2, 0, 3),
    (8, 256, 2, 14, 3),
    (32, 256, 4, 0, 3),
    (16, 512, 4, 0, 3),
    (16, 256, 4, 7, 3),
]  # BLOCK_N, BLOCK_K, num_warps, SPLIT_K, STAGES


def gate_up() -> None:
    """The MLP's gate and up projections into SiLU * up: today's four launches against the
    fused one (kernels/gemm/nvfp4_gate_up.py), weights cycled past L2."""
    from moeserve.kernels.gemm import nvfp4_gate_up as gu

    for name, (n, k) in GATE_UP_SHAPES.items():
        copies = n_copies(2 * (n * k // 2 + n * k // 16))
        gates, ups = rand_nvfp4(n, k, copies, "cuda"), rand_nvfp4(n, k, copies, "cuda")
        pairs = list(zip(gates, ups, strict=True))
        wsp = splitk.SplitKWorkspace.create(16 * 2 * n, 4096, "cuda")
        for m in (1, 4):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

            def four(w, x=x, wsp=wsp):
                g = nv.nvfp4_gemm(x, *w[0], workspace=wsp)
                u = nv.nvfp4_gemm(x, *w[1], workspace=wsp)
                return torch.nn.functional.silu(g) * u

            ref = four(pairs[0])
            nbytes = 2 * nvfp4_bytes(m, n, k)
            _time_product("gate_up", four, pairs, ref, nbytes, shape=name, M=m, cfg="4 launches")
            cands = [None] + [
                dict(_gemv_cfg(bn, bk, w, st, sk), F16=int(m == 1))
                for bn, bk, w, sk, st in GATE_UP_TILES
            ]
            for cfg in cands:

                def fused(w, x=x, cfg=cfg, wsp=wsp):
                    return gu.nvfp4_gate_up_silu(x, w[0][:3], w[1][:3], wsp, config=cfg)

                label = cfg or "table"
                _time_product("gate_up", fused, pairs, ref, nbytes, shape=name, M=m, cfg=label)
        del gates, ups, pairs
        torch.cuda.empty_cache()


def moe_rows_f16(ms: tuple[int, ...] = (4, 8, 16, 32)) -> None:
    """NVFP4 MoE at a few tokens: the dispatcher's choice (the mma.sync GEMV from 5 tokens)
    against the CUDA-core GEMV with F16 products (blocks of 1 and 2 slots)."""
    e_, h, i, topk = 384, 7168, 2048, 8
    experts = rand_nvfp4_experts(e_, h, i, "cuda")
    per_expert = 3 * i * h // 2 + 3 * i * h // 16
    one = dict(MP=1, BLOCK_N=16, BLOCK_K=256, num_warps=2, num_stages=1, DOWN_BLOCK_N=16)
    cands = [
        (None, None),
        ("gemv", dict(one, PREFETCH=2, F16=1)),
        ("gemv", dict(one, MP=2, F16=1, PREFETCH=2)),
        ("gemv", dict(one, MP=2, BLOCK_N=32, DOWN_BLOCK_N=32, num_warps=4, F16=1)),
    ]
    for m in ms:
        routes, tws, x, out, nbytes = _moe_inputs(e_, m, topk, h, per_expert, 20)
        for kern, cfg in cands:

            def run(r, tw, cfg, x=x, out=out, kern=kern):
                return moe_mod.fused_moe_nvfp4(
                    x,
                    r,
                    tw,
                    *experts,
                    out=out,
                    gate_up_config=cfg,
                    kernel=kern,
                ).clone()

            _moe_sweep(f"moe_rows_f16[{kern or 'auto'}]", run, [cfg], m, routes, tws, nbytes)


def _ds_moe9():
    """DeepSeek-V3's one-token MoE as served: 9 distinct of 257 block-FP8 experts (the shared
    expert a bank row), direct blocks, the combine in the down launch -> (run(route, weights,
    config), 16 routings, their weights, bytes of the distinct experts)."""
    e_, h, i, slots = 257, 7168, 2048, 9
    bank = rand_fp8_experts(e_, h, i)
    per_expert = 3 * i * h + 4 * 3 * (i // 128) * (h // 128)
    routes, tws, x, out, nbytes = _moe_inputs(e_, 1, slots, h, per_expert, 16)
    counters = torch.zeros(h, dtype=torch.int32, device="cuda")

    def run(r, tw, cfg):
        return fused_moe_fp8(
            x, r, tw, *bank, out=out, kernel="gemv", config=cfg, combine_counters=counters
        ).clone()

    return run, routes, tws, nbytes


def ds_one_token() -> None:
    """DeepSeek-V3's batch-1 decode products as served (since 52d2447): the fused block-FP8 MoE
    with the shared expert as a ninth slot (9 distinct of 257 experts, one token, direct
    blocks, combine in the down launch), its gate_up and down tiles varied separately
    (DOWN_* keys), products summed per tile or once per program (LATE_SUM); and the dense
    M=1 GEMVs of attention with deeper split-K and pipelines."""
    run, routes, tws, nbytes = _ds_moe9()
    base = dict(MP=1, BLOCK_N=16, DOWN_BLOCK_N=32, BLOCK_K=128, num_warps=2, num_stages=1)
    base["STAGES"] = 4
    gate_up = [
        dict(BLOCK_N=bn, num_warps=w, STAGES=st, LATE_SUM=ls, DOWN_WARPS=2, DOWN_STAGES=4)
        for bn, w, st, ls in (
            (16, 2, 4, 1),
            (16, 2, 6, 0),
            (16, 2, 8, 0),
            (16, 2, 6, 1),
            (32, 2, 4, 0),
            (32, 2, 4, 1),
            (32, 4, 4, 0),
            (32, 4, 6, 1),
            (8, 1, 4, 0),
            (8, 1, 8, 0),
            (16, 1, 4, 0),
            (16, 4, 4, 1),
        )
    ]
    down = [
        dict(DOWN_BLOCK_N=bn, DOWN_WARPS=w, DOWN_STAGES=st, DOWN_BLOCK_K=bk)
        for bn, w, st, bk in (
            (16, 2, 4, 128),
            (16, 1, 4, 128),
            (32, 2, 6, 128),
            (32, 4, 4, 128),
            (64, 4, 4, 128),
            (64, 2, 4, 128),
            (32, 2, 8, 64),
            (16, 1, 6, 128),
            (8, 1, 4, 128),
        )
    ]
    cands = [None] + [{**base, **c} for c in gate_up + down]
    _moe_sweep("ds_moe9", run, cands, 1, routes, tws, nbytes)
    del run
    torch.cuda.empty_cache()
    dense = [
        _gemv_cfg(bn, 128, w, st, sk, **extra)
        for bn, w, st, sk, extra in (
            (32, 2, 4, 0, {}),
            (32, 2, 4, 0, {"LATE_SUM": 1}),
            (32, 2, 6, 0, {}),
            (32, 2, 8, 0, {}),
            (16, 2, 4, 0, {}),
            (32, 2, 4, 12, {}),
            (32, 2, 4, 16, {}),
            (16, 1, 4, 16, {}),
            (16, 1, 4, 28, {}),
            (32, 1, 6, 16, {"LATE_SUM": 1}),
            (64, 2, 4, 16, {}),
            (64, 4, 4, 28, {}),
        )
    ]
    for name in ("q_a_kv_a_proj", "q_b_proj", "o_proj"):
        n, k = FP8_SHAPES[name]
        _fp8_dense_shape(name, n, k, (1,), [("gemv", None)] + [("gemv", c) for c in dense])


def ds_moe_down() -> None:
    """A second pass over ds_one_token's MoE part: the shipped one-token config (32-row gate_up
    tiles, LATE_SUM) against down-launch variants and wider gate_up tiles."""
    run, routes, tws, nbytes = _ds_moe9()
    cands = [None] + [
        dict(c)
        for c in (
            dict(DOWN_BLOCK_N=16, DOWN_WARPS=1),
            dict(DOWN_BLOCK_N=16, DOWN_WARPS=2),
            dict(DOWN_BLOCK_N=64, DOWN_WARPS=2),
            dict(DOWN_BLOCK_N=64, DOWN_WARPS=4),
            dict(DOWN_STAGES=3),
            dict(DOWN_STAGES=6),
            dict(DOWN_BLOCK_N=32, DOWN_WARPS=1),
            dict(DOWN_BLOCK_K=64, DOWN_STAGES=6),
            dict(BLOCK_N=64, num_warps=2),
            dict(BLOCK_N=64, num_warps=4),
            dict(BLOCK_N=32, num_warps=1),
            dict(STAGES=3),
            dict(STAGES=5),
        )
    ]
    _moe_sweep("ds_moe9_down", run, cands, 1, routes, tws, nbytes)
    del run
    torch.cuda.empty_cache()


def ds_absorb() -> None:
    """The absorbed MLA products at one row, 128 heads, block-FP8 kv_b_proj (DeepSeek-V3's
    decode): W_UK with whole-head tiles (BLOCK_D 64 / 128: every load of a program in flight
    at once) and W_UV with its products summed once per program (LATE_SUM)."""
    from kernels_mla_absorb import rand_kv_b, weight_bytes

    from moeserve.kernels.attention import mla_absorb as ma

    heads, nope, lat = 128, 128, 512
    weights = rand_kv_b(heads, "fp8", n_copies(weight_bytes(heads, "fp8", "uk") * 2))
    uk = [None] + [
        dict(BLOCK_L=bl, BLOCK_D=bd, num_warps=w, num_stages=1, STAGES=0)
        for bl, bd, w in (
            (64, 64, 4),
            (128, 64, 4),
            (64, 128, 4),
            (32, 128, 4),
            (64, 128, 8),
            (128, 128, 8),
            (32, 64, 2),
            (64, 64, 2),
            (32, 128, 2),
        )
    ]
    uv = [None] + [
        dict(BLOCK_N=bn, BLOCK_K=128, num_warps=w, num_stages=1, STAGES=st, LATE_SUM=ls)
        for bn, w, st, ls in (
            (16, 2, 3, 1),
            (8, 1, 3, 1),
            (32, 2, 3, 1),
            (16, 4, 0, 1),
            (16, 2, 0, 1),
            (32, 4, 0, 1),
            (8, 2, 0, 1),
        )
    ]
    for mode, cands, width in (("uk", uk, nope), ("uv", uv, lat)):
        x = torch.randn(1, heads, width, device="cuda").bfloat16()
        out = torch.empty(1, heads, lat if mode == "uk" else 128, device="cuda").bfloat16()
        ref = ma.absorb_ref(x, *weights[0], mode, nope)
        nbytes = weight_bytes(heads, "fp8", mode)
        for cfg in cands:

            def call(w, cfg=cfg, x=x, out=out, mode=mode):
                return ma.absorb_gemv(x, *w, out, mode, nope, cfg)

            _time_product("ds_absorb", call, weights, ref, nbytes, shape=mode, M=1, cfg=cfg)


PARTS = {
    "moe_m1_tiles": moe_m1_tiles,
    "moe_split": moe_split,
    "gate_up": gate_up,
    "ds_absorb": ds_absorb,
    "ds_one_token": ds_one_token,
    "ds_moe_down": ds_moe_down,
    "moe_rows_f16": moe_rows_f16,
    "f16": f16,
    "dense": dense,
    "dense2": dense2,
    "moe": moe_nvfp4,
    "fp8": moe_fp8,
    "fp8_dense": fp8_dense,
    "fp8_small": fp8_small,
    "fp8_moe_rows": moe_fp8_rows,
    "w16": moe_w16,
}


def main() -> int:
    out = os.environ.get("OUT", "benchmarks/results")
    for part in sys.argv[1:] or list(PARTS):
        try:
            PARTS[part]()
        except Exception:  # noqa: BLE001
            traceback.print_exc()
        with open(f"{out}/kernels_stages_sweep.json", "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
