# ruff: noqa: B023 -- the lambdas below bind their loop variables through default arguments
"""The MoE router in one launch (kernels/routing/router_fused.py: gate GEMV + routing) against the
two-launch path of DeepseekMoE.route (Router.forward = torch.mm(x, W^T, out_dtype=fp32), then
kernels/routing/router.py's route), at the published DeepSeek-V3 (E=256, 8 groups) and Kimi (E=384)
routing, H=7168, decode batches T = 1, 2, 4, 8.

Every time is us per router call from a CUDA graph of many calls (graph_time_us of
kernels_gemm_moe.py); the gate weights cycle through enough copies that each call reads its
weight from HBM, as in a decode step where ~60 layers' routers never share L2. `--sweep` also
times the fused kernel's launch shapes. Writes router_fused.{json,md} to --out-dir.

  PYTHONPATH=$PWD python benchmarks/router_fused.py --out-dir benchmarks/results [--sweep]
      [--commit SHA]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # the sibling benchmark modules
from common import gpu_meta  # noqa: E402
from kernels_gemm_moe import graph_time_us, n_copies  # noqa: E402

from moeserve.kernels.routing import router_fused as rf  # noqa: E402
from moeserve.kernels.routing.router import route  # noqa: E402
from moeserve.layers.moe import Router  # noqa: E402

HIDDEN = 7168
TOKENS = (1, 2, 4, 8)
TOP_K = 8
ROUTING = {  # published configs: name -> (E, n_group, topk_group, routed_scaling_factor)
    "deepseek-v3": (256, 8, 4, 2.5),
    "kimi": (384, 1, 1, 2.827),
}
SWEEP = [  # (block_e, block_k, split_k, num_warps, route_rows; 0 = all rows in one pass)
    (2, 512, 4, 4, 0),
    (1, 1024, 4, 4, 0),
    (1, 1024, 8, 4, 0),
    (1, 1024, 8, 4, 2),
    (1, 1024, 4, 4, 2),
    (2, 512, 4, 4, 1),
]
GRAPH_REPS = 15
HBM_BYTES_PER_S = 4.3e12


def log(*a: object) -> None:
    print(*a, flush=True)


def routers(e: int, copies: int) -> list[Router]:
    out = []
    gen = torch.Generator(device="cuda").manual_seed(e)
    bias = 0.1 * torch.randn(e, device="cuda", generator=gen)
    for _ in range(copies):
        with torch.device("cuda"):
            r = Router(e, HIDDEN, True, torch.bfloat16)
        with torch.no_grad():
            r.weight.copy_(torch.randn(e, HIDDEN, device="cuda", generator=gen) / HIDDEN**0.5)
            r.e_score_correction_bias.copy_(bias)
        r.process_weights_after_loading()
        out.append(r)
    return out


def kwargs(name: str) -> dict:
    _, n_group, topk_group, scale = ROUTING[name]
    return dict(
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=True,
        routed_scaling_factor=scale,
    )


def agreement(name: str, rs: list[Router], x: torch.Tensor, cfg: rf.FusedRouterConfig) -> float:
    """Share of rows whose fused expert-id set equals the two-launch path's (1.0 unless an
    fp32 summation-order difference flips a near tie); asserts the weights match there."""
    kw = kwargs(name)
    r = rs[0]
    ws = rf.RouterFusedWorkspace.create(r.weight.shape[0], "cuda")
    w, ids = rf.route_fused(
        x, r.weight, r.e_score_correction_bias, TOP_K, workspace=ws, config=cfg, **kw
    )
    bw, bids = route(r(x), r.e_score_correction_bias, TOP_K, **kw)
    same = (ids.sort(-1).values == bids.sort(-1).values).all(-1)
    # the logits the launch used, routed by route: identical ids (same semantics)
    lw, lids = route(ws.logits[: x.shape[0]].clone(), r.e_score_correction_bias, TOP_K, **kw)
    assert torch.equal(ids, lids), "fused routing differs from route on its own logits"
    torch.testing.assert_close(w, lw, rtol=1e-6, atol=1e-7)
    if same.any():
        torch.testing.assert_close(w[same], bw[same], rtol=1e-4, atol=1e-5)
    return same.float().mean().item()


def time_fused(name: str, rs: list[Router], x: torch.Tensor, cfg: rf.FusedRouterConfig) -> float:
    kw = kwargs(name)
    t = x.shape[0]
    ws = rf.RouterFusedWorkspace.create(rs[0].weight.shape[0], "cuda")
    wo = torch.empty(t, TOP_K, dtype=torch.float32, device="cuda")
    io = torch.empty(t, TOP_K, dtype=torch.int32, device="cuda")
    fns = [
        lambda r=r: rf.route_fused(
            x,
            r.weight,
            r.e_score_correction_bias,
            TOP_K,
            weights_out=wo,
            ids_out=io,
            workspace=ws,
            config=cfg,
            **kw,
        )
        for r in rs
    ]
    us = graph_time_us(fns, calls=2 * len(fns), reps=GRAPH_REPS)["us"]
    assert ws.counter.item() == 0
    return us


def time_two_launch(name: str, rs: list[Router], x: torch.Tensor) -> dict[str, float]:
    """DeepseekMoE.route's GPU path, and its two launches alone (route on hot logits)."""
    kw = kwargs(name)
    both = [lambda r=r: route(r(x), r.e_score_correction_bias, TOP_K, **kw) for r in rs]
    gemm = [lambda r=r: r(x) for r in rs]
    logits = rs[0](x)
    bias = rs[0].e_score_correction_bias
    alone = [lambda: route(logits, bias, TOP_K, **kw)]
    calls = 2 * len(rs)
    return {
        "two_launch_us": graph_time_us(both, calls=calls, reps=GRAPH_REPS)["us"],
        "gemm_us": graph_time_us(gemm, calls=calls, reps=GRAPH_REPS)["us"],
        "route_us": graph_time_us(alone, calls=calls, reps=GRAPH_REPS)["us"],
    }


def markdown(meta: dict, rows: list[dict], sweep: list[dict]) -> str:
    out = [
        "# MoE router in one launch (gate GEMV + routing) vs Router.forward + route",
        "",
        f"GPU {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, commit "
        f"{meta['commit']}. benchmarks/router_fused.py: us per router call from a CUDA graph, "
        f"gate weights (bf16 [E, {HIDDEN}]) cycled past L2. `two launches` = "
        "torch.mm(out_dtype=fp32) + kernels/routing/router.py route (DeepseekMoE.route's GPU "
        "path); "
        "`gemm` / `route` = each alone (route on hot logits); `fused` = route_fused with its "
        "default launch shape (plan_config), `best fused` = the best swept shape; "
        "`HBM floor` = weight bytes / 4.3 TB/s; `ids agree` = rows whose expert set equals the "
        "two-launch path's (differences only from fp32 summation order at near ties).",
        "",
        "| routing | E | T | two launches us | gemm us | route us | fused us | best fused us "
        "| best shape (e, k, split, warps, rows) | speedup (best) | HBM floor us | ids agree |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['routing']} | {r['E']} | {r['T']} | {r['two_launch_us']:.2f} | "
            f"{r['gemm_us']:.2f} | {r['route_us']:.2f} | {r['fused_us']:.2f} | "
            f"{r['best_fused_us']:.2f} | {tuple(r['best_shape'])} | "
            f"{r['two_launch_us'] / r['best_fused_us']:.2f}x | {r['hbm_floor_us']:.2f} | "
            f"{r['ids_agree']:.2f} |"
        )
    if sweep:
        out += [
            "",
            "## Launch-shape sweep (fused us)",
            "",
            "| routing | T | " + " | ".join(str(tuple(s)) for s in SWEEP) + " |",
            "|---|---|" + "---|" * len(SWEEP),
        ]
        for s in sweep:
            cells = [f"{s['us'].get(str(tuple(c)), float('nan')):.2f}" for c in SWEEP]
            out.append(f"| {s['routing']} | {s['T']} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--sweep", action="store_true", help="also time every launch shape in SWEEP")
    ap.add_argument(
        "--sweep-tokens", type=int, nargs="*", default=list(TOKENS), help="T values swept"
    )
    args = ap.parse_args()
    meta = gpu_meta(args.commit)
    log(json.dumps(meta))
    rows, sweep = [], []
    with torch.inference_mode():
        for name, (e, *_rest) in ROUTING.items():
            rs = routers(e, n_copies(e * HIDDEN * 2))
            log(f"{name}: E={e}, {len(rs)} weight copies")
            for t in TOKENS:
                x = torch.randn(t, HIDDEN, device="cuda", dtype=torch.bfloat16)
                default = rf.plan_config(t, e, HIDDEN)
                row = {
                    "routing": name,
                    "E": e,
                    "T": t,
                    "default_shape": list(vars(default).values()),
                }
                row.update(time_two_launch(name, rs, x))
                row["ids_agree"] = agreement(name, rs, x, default)
                row["fused_us"] = time_fused(name, rs, x, default)
                shapes = {str(tuple(vars(default).values())): row["fused_us"]}
                if args.sweep and t in args.sweep_tokens:
                    for c in SWEEP:
                        try:
                            if str(c) in shapes:
                                continue
                            cfg = rf.FusedRouterConfig(*c)
                            agreement(name, rs, x, cfg)
                            shapes[str(c)] = time_fused(name, rs, x, cfg)
                        except Exception as exc:  # a shape that fails to compile / fit: skip
                            log(f"  shape {c} failed: {type(exc).__name__}: {exc}")
                    sweep.append({"routing": name, "T": t, "us": shapes})
                best = min(shapes, key=shapes.get)
                row["best_fused_us"] = shapes[best]
                row["best_shape"] = [int(v) for v in best.strip("()").split(",")]
                row["hbm_floor_us"] = e * HIDDEN * 2 / HBM_BYTES_PER_S * 1e6
                rows.append(row)
                log(json.dumps(row))
                log("  sweep:", json.dumps(shapes))
                md = write(Path(args.out_dir), meta, rows, sweep)  # a killed run keeps its rows
            del rs
            torch.cuda.empty_cache()
    log(md)
    return 0


def write(out: Path, meta: dict, rows: list[dict], sweep: list[dict]) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / "router_fused.json").write_text(
        json.dumps({"meta": meta, "rows": rows, "sweep": sweep}, indent=1) + "\n"
    )
    md = markdown(meta, rows, sweep)
    (out / "router_fused.md").write_text(md)
    return md


if __name__ == "__main__":
    sys.exit(main())
