"""The absorbed MLA products (kernels/attention/mla_absorb.py) against the bmm they replace.

Per decode step and MLA layer, q_nope [T, H, 128] @ W_UK [H, 128, 512] and
o_lat [T, H, 512] @ W_UV[H]^T [512, 128], on kv_b_proj as published: block-FP8 (DeepSeek-V3/R1)
or bf16 (Kimi-K2.5). Peer: torch.bmm on the dense bf16 weight (the path used before, and still
above the tables' max_m). H = 128 (one GPU) and 16 (the TP8 share). Graph-timed like
kernels_gemm_moe.py (weights cycled past L2); % of 4.3 TB/s on the weight bytes the product
reads. Every kernel output is checked against the fp32 torch reference.

  cd benchmarks && PYTHONPATH=.. python kernels_mla_absorb.py [--sweep] [--commit SHA]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
from common import gpu_meta
from kernels_gemm_moe import HBM_BYTES_PER_S, graph_time_us, n_copies

from moeserve.kernels.attention import mla_absorb as ma
from moeserve.kernels.configs import tile_config
from moeserve.kernels.gemm.fp8_block_gemm import dequantize_fp8_block

NOPE, V, LAT = 128, 128, 512
TOKENS = (1, 2, 4, 8, 16, 32, 64)
SWEEP_TOKENS = (1, 2, 4)
HEADS = (128, 16)
FORMATS = ("fp8", "bf16")


def log(*a: object) -> None:
    print(*a, flush=True)


def rand_kv_b(heads: int, fmt: str, copies: int) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    rows = heads * (NOPE + V)
    out = []
    for _ in range(copies):
        if fmt == "bf16":
            out.append((torch.randn(rows, LAT, device="cuda").mul_(0.05).bfloat16(), None))
        else:
            w = torch.randn(rows, LAT, device="cuda").clamp_(-400, 400).to(torch.float8_e4m3fn)
            s = torch.rand(rows // 128, LAT // 128, device="cuda") * 1e-3 + 1e-4
            out.append((w, s))
    return out


def weight_bytes(heads: int, fmt: str, mode: str) -> int:
    rows = heads * (NOPE if mode == "uk" else V)
    per = 1 if fmt == "fp8" else 2
    scales = rows // 128 * (LAT // 128) * 4 if fmt == "fp8" else 0
    return rows * LAT * per + scales


def candidates(mode: str, fmt: str) -> list[dict[str, int]]:
    if mode == "uk":
        grid = itertools.product((64, 128), (16, 32), (2, 4), (0, 3))
        return [
            dict(BLOCK_L=bl, BLOCK_D=bd, num_warps=w, num_stages=1, STAGES=st)
            for bl, bd, w, st in grid
        ]
    ks = (64, 128) if fmt == "fp8" else (32, 64)
    grid = itertools.product((8, 16, 32), ks, (1, 2), (0, 3))
    return [
        dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=1, STAGES=st) for bn, bk, w, st in grid
    ]


def bench(records: list, checks: list, sweep: bool) -> None:
    for fmt, heads in itertools.product(FORMATS, HEADS[:1] if sweep else HEADS):
        copies = n_copies(weight_bytes(heads, fmt, "uk") * 2)
        weights = rand_kv_b(heads, fmt, copies)
        dense = [
            (w.float() if s is None else dequantize_fp8_block(w, s, torch.float32))
            .bfloat16()
            .view(heads, NOPE + V, LAT)
            for w, s in weights
        ]
        for t in SWEEP_TOKENS if sweep else TOKENS:
            x_uk = torch.randn(t, heads, NOPE, device="cuda").bfloat16()
            x_uv = torch.randn(t, heads, LAT, device="cuda").bfloat16()
            for mode in ("uk", "uv"):
                x = x_uk if mode == "uk" else x_uv
                n_out = LAT if mode == "uk" else V
                out = torch.empty(t, heads, n_out, device="cuda", dtype=torch.bfloat16)
                if mode == "uk":
                    peer_fns = [
                        lambda d=d, x=x, out=out: torch.bmm(
                            x.transpose(0, 1), d[:, :NOPE], out=out.transpose(0, 1)
                        )
                        for d in dense
                    ]
                else:
                    peer_fns = [
                        lambda d=d, x=x, out=out: torch.bmm(
                            x.transpose(0, 1), d[:, NOPE:].transpose(1, 2), out=out.transpose(0, 1)
                        )
                        for d in dense
                    ]
                peer = graph_time_us(peer_fns, 60, 5)["us"]
                nbytes = weight_bytes(heads, fmt, mode)
                shipped = tile_config(ma.TABLES[mode], t, ma.table_key(weights[0][0], heads))
                configs = [shipped] + (candidates(mode, fmt) if sweep else [])
                for i, cfg in enumerate(configs):
                    fns = [
                        lambda w=w, s=s, cfg=cfg, x=x, out=out, mode=mode: ma.absorb_gemv(
                            x, w, s, out, mode, NOPE, cfg
                        )
                        for w, s in weights
                    ]
                    try:
                        us = graph_time_us(fns, 60, 5)["us"]
                    except Exception as e:  # noqa: BLE001 (a config may not compile)
                        log(f"{fmt} H={heads} T={t} {mode} {cfg}: {type(e).__name__}: {e}")
                        continue
                    if i == 0:
                        ref = ma.absorb_ref(x, *weights[-1], mode, NOPE)
                        fns[-1]()
                        err = float((out.float() - ref).abs().max() / ref.abs().max())
                        checks.append(
                            dict(fmt=fmt, heads=heads, T=t, mode=mode, rel_err=err, ok=err < 2e-2)
                        )
                    rec = dict(
                        fmt=fmt,
                        heads=heads,
                        T=t,
                        mode=mode,
                        us=us,
                        pct_hbm=100 * nbytes / (us * 1e-6) / HBM_BYTES_PER_S,
                        peer="torch.bmm bf16",
                        peer_us=peer,
                        speedup_vs_peer=peer / us,
                        config=cfg,
                        shipped=i == 0,
                        used=t <= ma.absorb_max_rows(mode, weights[0][0], heads),
                    )
                    records.append(rec)
                    log(
                        f"{fmt} H={heads} T={t} {mode}: {us:.2f} us "
                        f"({rec['pct_hbm']:.1f}%) bmm {peer:.2f} us {'*' if i == 0 else ''} {cfg}"
                    )


def write_markdown(path: Path, meta: dict, records: list, checks: list) -> None:
    lines = [
        "# Absorbed MLA products on kv_b_proj's stored weight (one GPU)",
        "",
        f"GPU {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, commit "
        f"{meta['commit']}. benchmarks/kernels_mla_absorb.py. Graph-timed (weights cycled past "
        "L2); % of 4.3 TB/s on the weight bytes one product reads. Peer: torch.bmm on the dense "
        "bf16 weight, in the same run.",
        "",
        f"Checks against the fp32 torch reference: {sum(c['ok'] for c in checks)}/{len(checks)}.",
        "",
        "`served`: the layer uses the kernel at this T (tiles.json max_m), else bmm.",
        "",
        "| format | heads | T | product | us | % HBM | bmm us | x bmm | served | config |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        if not r["shipped"]:
            continue
        lines.append(
            f"| {r['fmt']} | {r['heads']} | {r['T']} | {r['mode']} | {r['us']:.2f} | "
            f"{r['pct_hbm']:.1f} | {r['peer_us']:.2f} | {r['speedup_vs_peer']:.2f} | "
            f"{'kernel' if r['used'] else 'bmm'} | {json.dumps(r['config'], sort_keys=True)} |"
        )
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default="results")
    ap.add_argument("--sweep", action="store_true", help="time candidate tiles too")
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        log("needs a CUDA GPU")
        return 2
    meta = gpu_meta(args.commit)
    records: list = []
    checks: list = []
    bench(records, checks, args.sweep)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    name = "kernels_mla_absorb_sweep" if args.sweep else "kernels_mla_absorb"
    (out / f"{name}.json").write_text(
        json.dumps({"meta": meta, "records": records, "checks": checks}, indent=1)
    )
    write_markdown(out / f"{name}.md", meta, records, checks)
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
