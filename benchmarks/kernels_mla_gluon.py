"""Gluon (TMA ring + wgmma) vs Triton MLA decode on one Hopper GPU, same process.

us per call inside CUDA graphs (kernels_gemm_moe.graph_time_us), BF16 cache, page 64,
heads 8/16/64/128, batch 1/8/64, context 100 (block-table capacity 1024), 4096 and 32768
(capacity = context). The cache is copied until one pass over the copies reads more than
L2 holds, and the graph cycles through the copies, so reads come from HBM. "% HBM" is of
4.3 TB/s on the cache bytes that must be read (seq_len x 576 x 2 per sequence). Each
kernel runs with its own default split count (Triton: `default_config`, too); every
output is checked against the fp32 reference `mla_decode_ref`.

    PYTHONPATH=$PWD python benchmarks/kernels_mla_gluon.py --out $OUT [--commit SHA]
        [--quick] [--sweep]

--sweep adds Gluon variants (ring geometry, split counts) per case, for tuning;
--profile prints per-kernel device times (split kernel vs merge) for a few cases.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import gpu_meta  # noqa: E402
from kernels_gemm_moe import graph_time_us  # noqa: E402

from moeserve.kernels.attention import mla_decode as md  # noqa: E402
from moeserve.kernels.attention import mla_decode_gluon as mg  # noqa: E402

PAGE = 64
SM_SCALE = 0.1
HBM_BYTES_PER_US = 4.3e6  # 4.3 TB/s, measured on the H200
L2_FLUSH_BYTES = 256 << 20  # one pass over the copies reads at least this much
MAX_COPIES = 64
GRAPH_BYTES = 4 << 30  # cache bytes one graph replay should stream (sets the call count)
MIN_CALLS, MAX_CALLS = 8, 100
REPS = 5
REL_TOL = 3e-2  # max |out - ref| / max |ref| (bf16 output)
HEADS = (8, 16, 64, 128)
BATCHES = (1, 8, 64)
CONTEXTS = ((100, 1024), (4096, 4096), (32768, 32768))  # (tokens, block-table capacity)
SM_COUNT = 132  # H200; the split heuristics are static (graph-safe)
MAX_SWEEP_SPLITS = 264
ALL_HEADS = 1 << 16  # small_heads_max that sends every head count to the few-head kernel


def _cases(quick: bool) -> list[tuple[int, int, int, int]]:
    heads = (16, 64) if quick else HEADS
    batches = (1, 8) if quick else BATCHES
    ctxs = CONTEXTS[1:2] if quick else CONTEXTS
    return [(h, c, cap, b) for h, (c, cap), b in itertools.product(heads, ctxs, batches)]


def _default_splits(batch: int, heads: int, cap: int, cfg: mg.GluonMLAConfig | None) -> int:
    """The split count mla_decode_gluon picks by default for this config."""
    return mg.gluon_default_num_splits(batch, heads, cap, SM_COUNT, cfg)


def _variants(batch: int, heads: int, cap: int, sweep: bool) -> dict[str, dict]:
    """Gluon launch variants timed for a case: the default, plus tuning candidates."""
    out = {"gluon": {}}
    if not sweep:
        return out
    default = _default_splits(batch, heads, cap, None)
    for s in sorted({max(1, default // 2), default * 2} - {default}):
        if 1 <= s <= min(md.MAX_SPLITS, MAX_SWEEP_SPLITS):
            out[f"gluon_s{s}"] = {"num_splits": s}
    # The 64-row kernel only, and the few-head kernel only (16-head blocks, each tile read
    # by several programs), whichever the default did not pick.
    out["gluon_pad64"] = {"config": mg.GluonMLAConfig(small_heads_max=0, small_max_tiles=0)}
    if heads > mg.SMALL_BLOCK_H:
        out["gluon_small16"] = {"config": mg.GluonMLAConfig(small_heads_max=ALL_HEADS)}
    return out


def run_case(heads: int, ctx: int, cap: int, batch: int, sweep: bool) -> dict:
    pages_per = cap // PAGE
    pages = pages_per * batch
    read_bytes = batch * ctx * md.LATENT_DIM * 2
    copies = max(2, min(MAX_COPIES, math.ceil(L2_FLUSH_BYTES / read_bytes)))
    calls = max(MIN_CALLS, min(MAX_CALLS, GRAPH_BYTES // read_bytes), copies)
    gen = torch.Generator("cuda").manual_seed(heads * 1000 + batch)
    caches = [
        torch.randn(pages, PAGE, md.LATENT_DIM, device="cuda", generator=gen).bfloat16()
        for _ in range(copies)
    ]
    bt = torch.randperm(pages, device="cuda", dtype=torch.int32, generator=gen)
    bt = bt.view(batch, pages_per)
    sl = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, heads, md.LATENT_DIM, device="cuda", generator=gen).bfloat16()
    out = torch.empty(batch, heads, md.KV_LORA_RANK, device="cuda").bfloat16()
    ref = md.mla_decode_ref(q, caches[-1], bt, sl, SM_SCALE, torch.empty_like(out).float())

    def timed(fn_of_cache) -> dict:
        fns = [lambda c=c: fn_of_cache(c) for c in caches]
        t = graph_time_us(fns, calls, REPS)
        out.fill_(float("nan"))
        fns[-1]()
        err = float((out.float() - ref).abs().max() / ref.abs().max())
        return dict(us=t["us"], us_min=t["us_min"], rel_err=err, ok=err < REL_TOL,
                    hbm_pct=100.0 * read_bytes / (t["us"] * HBM_BYTES_PER_US))  # fmt: skip

    res = {}
    cfg = md.default_config(heads)
    t_splits = md.default_num_splits(batch, heads, cap, cfg, SM_COUNT)
    variants = _variants(batch, heads, cap, sweep)
    for kw in variants.values():
        kw.setdefault("num_splits", _default_splits(batch, heads, cap, kw.get("config")))
    most = max([t_splits] + [kw["num_splits"] for kw in variants.values()])
    ws = md.MLADecodeWorkspace.allocate(batch, heads, most, "cuda")
    res["triton"] = timed(
        lambda c: md.mla_decode(q, c, bt, sl, SM_SCALE, out, num_splits=t_splits, workspace=ws)
    ) | {"splits": t_splits}
    for name, kw in variants.items():
        splits, conf = kw["num_splits"], kw.get("config")
        try:
            small = mg._use_small_kernel(
                batch, heads, cap, conf or mg.DEFAULT_GLUON_CONFIG, SM_COUNT
            )
            res[name] = timed(
                lambda c, s=splits, conf=conf: mg.mla_decode_gluon(
                    q, c, bt, sl, SM_SCALE, out, num_splits=s, workspace=ws, config=conf
                )
            ) | {"splits": splits, "kernel": "few-head" if small else "64-row"}
        except Exception as e:  # noqa: BLE001 (a failed variant is recorded, not fatal)
            res[name] = {"error": f"{type(e).__name__}: {e}"[:500], "ok": False}
    caches.clear()
    torch.cuda.empty_cache()
    row = dict(heads=heads, ctx=ctx, cap=cap, batch=batch, read_mb=read_bytes / 1e6, res=res)
    print(
        f"H={heads:3d} ctx={ctx:5d} cap={cap:5d} B={batch:2d}: "
        + " | ".join(
            f"{k} s{v['splits']} {v['us']:.2f}us {v['hbm_pct']:.1f}%{'' if v['ok'] else ' BAD'}"
            if "us" in v
            else f"{k} ERR {v['error'][:120]}"
            for k, v in res.items()
        ),
        flush=True,
    )
    return row


PROFILE_CASES = ((64, 4096, 4096, 1), (16, 4096, 4096, 1), (64, 32768, 32768, 1),
                 (64, 32768, 32768, 8), (128, 32768, 32768, 64))  # fmt: skip


def profile_case(heads: int, ctx: int, cap: int, batch: int) -> dict:
    """Per-kernel device us per call (torch.profiler), Gluon and Triton defaults."""
    pages_per = cap // PAGE
    cache = torch.randn(pages_per * batch, PAGE, md.LATENT_DIM, device="cuda").bfloat16()
    bt = torch.randperm(pages_per * batch, device="cuda", dtype=torch.int32)
    bt = bt.view(batch, pages_per)
    sl = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, heads, md.LATENT_DIM, device="cuda").bfloat16()
    out = torch.empty(batch, heads, md.KV_LORA_RANK, device="cuda").bfloat16()
    calls = 20
    kernels = {
        "triton": lambda: md.mla_decode(q, cache, bt, sl, SM_SCALE, out),
        "gluon": lambda: mg.mla_decode_gluon(q, cache, bt, sl, SM_SCALE, out),
    }
    res = {}
    for name, fn in kernels.items():
        fn()
        torch.cuda.synchronize()
        acts = [torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
        per = {}
        for ev in prof.key_averages():
            dev_us = getattr(ev, "self_device_time_total", None)
            if dev_us is None:
                dev_us = getattr(ev, "self_cuda_time_total", 0.0)
            if dev_us > 0:
                per[ev.key[:60]] = dev_us / calls
        res[name] = per
    print(f"PROFILE H={heads} ctx={ctx} B={batch}: {json.dumps(res)}", flush=True)
    return dict(heads=heads, ctx=ctx, cap=cap, batch=batch, kernels_us=res)


def write_markdown(path: Path, meta: dict, rows: list[dict]) -> None:
    checks = [v["ok"] for r in rows for v in r["res"].values()]
    lines = [
        "# MLA decode: Gluon (TMA ring + wgmma) vs Triton, one H200",
        "",
        f"GPU {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, commit "
        f"{meta['commit']}. `benchmarks/kernels_mla_gluon.py`: us per call, graph-timed "
        "(cache copies cycled past L2), BF16 cache, page 64, each kernel with its own default "
        "split count (s). % HBM = cache bytes / (us x 4.3 TB/s). Checks against the fp32 "
        f"reference: {sum(checks)}/{len(checks)} pass.",
        "",
        "| heads | context (capacity) | batch | cache MB | Triton us (s) | Triton % HBM "
        "| Gluon us (s) | Gluon % HBM | Gluon speedup |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t, g = r["res"]["triton"], r["res"].get("gluon", {})
        if "us" not in g:
            lines.append(f"| {r['heads']} | {r['ctx']} ({r['cap']}) | {r['batch']} | "
                         f"{r['read_mb']:.1f} | {t['us']:.2f} (s{t['splits']}) | "
                         f"{t['hbm_pct']:.1f} | error | | |")  # fmt: skip
            continue
        lines.append(
            f"| {r['heads']} | {r['ctx']} ({r['cap']}) | {r['batch']} | {r['read_mb']:.1f} | "
            f"{t['us']:.2f} (s{t['splits']}) | {t['hbm_pct']:.1f} | "
            f"{g['us']:.2f} (s{g['splits']}{', ' + g['kernel'] if 'kernel' in g else ''}) | "
            f"{g['hbm_pct']:.1f} | {t['us'] / g['us']:.2f}x |"
        )
    extra = sorted({k for r in rows for k in r["res"]} - {"triton", "gluon"})
    if extra:
        lines += ["", "Gluon variants (us):", "", "| heads | ctx | batch | " + " | ".join(extra)]
        lines.append("|---|---|---|" + "---|" * len(extra))
        for r in rows:
            cells = [
                f"{r['res'][k]['us']:.2f} (s{r['res'][k]['splits']})"
                if "us" in r["res"].get(k, {})
                else "-"
                for k in extra
            ]
            lines.append(f"| {r['heads']} | {r['ctx']} | {r['batch']} | " + " | ".join(cells))
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--quick", action="store_true", help="a few cases only")
    ap.add_argument("--sweep", action="store_true", help="also time Gluon tuning variants")
    ap.add_argument("--profile", action="store_true", help="per-kernel times, a few cases")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 2
    meta = gpu_meta(args.commit)
    if args.profile:
        meta["profile"] = [profile_case(*case) for case in PROFILE_CASES]
    rows = [run_case(*case, sweep=args.sweep) for case in _cases(args.quick)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernels_mla_gluon.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    write_markdown(out / "kernels_mla_gluon.md", meta, rows)
    return 0 if all(v["ok"] for r in rows for v in r["res"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
