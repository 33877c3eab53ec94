"""Benchmark the MLA kernels (decode, cache write, prefill) on one GPU, with torch peers.

Run on the GPU machine (results land in --out as kernels_mla.json / kernels_mla.md):

    PYTHONPATH=$PWD python benchmarks/kernels_mla.py --out benchmarks/results

Every time is taken inside a CUDA graph (capture N calls, replay, divide): eager launches
cost 13-16 us on the reference machine. Caches smaller than ~256 MB are replicated and the
graph cycles through the copies, so repeated calls stream from HBM, not from the 50 MB L2.
Bandwidth figures count the cache bytes the attention must read (seq_len x 576 x itemsize
per sequence), against 4.3 TB/s (H200 read bandwidth measured here).

Steps: (1) correctness on the GPU against the fp32 references at Kimi-K2.5 shapes, incl.
CUDA-graph replay with new seq_lens / block tables; (2) a sweep of decode launch configs
at two shapes, picking the fastest per cache dtype; (3) the decode grid (context 4k, 32k,
128k x batch 1, 8, 64 x BF16 / FP8, page size 64), each at a few split counts, next to the
torch peer (matmul + softmax over the gathered cache); (4) page-size comparison;
(5) cache write and prefill with their peers.

``--smoke`` runs everything at toy sizes on the CPU under TRITON_INTERPRET=1 (no graphs,
no meaningful times) to check the script itself.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from functools import partial

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"
    # The interpreter shims (numpy>=2.4 loop bounds, bf16 dot, fp8 rounding) live in the
    # kernel tests; importing those modules installs them.
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "kernels"))
    import test_kv_cache  # noqa: F401
    import test_mla_decode  # noqa: F401

import torch  # noqa: E402
import triton  # noqa: E402
from common import git_commit

from moeserve.kernels.attention import kv_cache as kvc  # noqa: E402
from moeserve.kernels.attention import mla_decode as dec  # noqa: E402
from moeserve.kernels.attention import mla_prefill as pre  # noqa: E402

HBM_BYTES_PER_S = 4.3e12
HEADS = 64  # Kimi-K2.5 (DeepSeek-V3 has 128)
SM_SCALE = 0.14468  # Kimi-K2.5 softmax scale (192-dim head with YaRN mscale)
L2_ROTATE_BYTES = 256 * 2**20
GRAPH_TARGET_MS = 30.0
MAX_COPIES = 64
FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class Env:
    device: str
    smoke: bool
    calls: int  # calls per captured graph for the Triton kernels
    peer_calls: int
    reps: int


# ----------------------------------------------------------------------------- timing


def time_calls(env: Env, fns: list[Callable[[], object]], calls: int) -> dict[str, float]:
    """Median/min/max microseconds per call; ``fns`` are cycled (L2 rotation)."""
    if env.smoke:
        t0 = time.perf_counter()
        fns[0]()
        return {"median_us": (time.perf_counter() - t0) * 1e6, "min_us": 0.0, "max_us": 0.0}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in fns[: min(len(fns), 3)]:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    # One eager call sizes the graph: ~GRAPH_TARGET_MS of work, 10 <= calls <= `calls`.
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    fns[0]()
    end.record()
    end.synchronize()
    calls = max(10, min(calls, int(GRAPH_TARGET_MS / max(start.elapsed_time(end), 1e-3))))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(env.reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    times.sort()
    return {
        "median_us": times[len(times) // 2],
        "min_us": times[0],
        "max_us": times[-1],
        "calls_per_graph": calls,
    }


def bw_fields(nbytes: float, us: float) -> dict[str, float]:
    gbs = nbytes / (us * 1e-6) / 1e9 if us > 0 else 0.0
    return {"bytes": nbytes, "GB_s": gbs, "pct_hbm": 100.0 * gbs * 1e9 / HBM_BYTES_PER_S}


# ----------------------------------------------------------------------------- data


def random_cache(num_pages: int, page_size: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    if dtype == FP8:
        # Random finite e4m3 codes (no 0x7f/0xff NaN), magnitudes ~0.02..8.
        codes = torch.randint(
            0x18, 0x58, (num_pages, page_size, 576), dtype=torch.uint8, device=device
        )
        sign = torch.randint(0, 2, codes.shape, dtype=torch.uint8, device=device) << 7
        return (codes | sign).view(FP8)
    return torch.randn(num_pages, page_size, 576, dtype=dtype, device=device)


@dataclass
class DecodeCase:
    batch: int
    ctx: int
    dtype: torch.dtype
    page_size: int
    q: torch.Tensor
    caches: list[torch.Tensor]
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    kv_scale: torch.Tensor | None
    out: torch.Tensor

    @property
    def cache_bytes(self) -> int:
        return self.batch * self.ctx * 576 * self.caches[0].element_size()


def make_decode_case(
    batch: int, ctx: int, dtype: torch.dtype, page_size: int, device: str, rotate: bool = True
) -> DecodeCase:
    pages_per_seq = triton.cdiv(ctx, page_size)
    num_pages = batch * pages_per_seq
    one = num_pages * page_size * 576 * (1 if dtype == FP8 else 2)
    copies = 1
    if rotate:
        copies = max(1, min(MAX_COPIES, math.ceil(L2_ROTATE_BYTES / one)))
    caches = [random_cache(num_pages, page_size, dtype, device) for _ in range(copies)]
    perm = torch.randperm(num_pages, device=device).int()
    bt = perm.view(batch, pages_per_seq).contiguous()
    seq = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    q = (torch.randn(batch, HEADS, 576, device=device) * 0.5).to(torch.bfloat16)
    scale = torch.tensor([0.05], device=device) if dtype == FP8 else None
    out = torch.empty(batch, HEADS, 512, dtype=torch.bfloat16, device=device)
    return DecodeCase(batch, ctx, dtype, page_size, q, caches, bt, seq, scale, out)


def torch_decode_peer(case: DecodeCase, cache: torch.Tensor) -> torch.Tensor:
    """What torch alone does: gather the cache rows, then bf16 matmul / softmax / matmul."""
    kv = cache[case.block_tables.long()].view(case.batch, -1, 576)[:, : case.ctx]
    if case.dtype == FP8:
        kv = kv.to(torch.bfloat16) * case.kv_scale.to(torch.bfloat16)
    scores = torch.matmul(case.q, kv.transpose(1, 2)).float() * SM_SCALE
    probs = torch.softmax(scores, dim=-1).to(torch.bfloat16)
    return torch.matmul(probs, kv[..., :512])


# ----------------------------------------------------------------------------- correctness


def err_stats(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float | bool]:
    diff = (got.float() - ref.float()).abs()
    ref_max = float(ref.float().abs().max())
    max_abs = float(diff.max())
    return {
        "max_abs_err": max_abs,
        "mean_abs_err": float(diff.mean()),
        "ref_abs_max": ref_max,
        "finite": bool(torch.isfinite(got.float()).all()),
        "pass": bool(torch.isfinite(got.float()).all()) and max_abs <= 1e-2 + 2e-2 * ref_max,
    }


def nan_case(seq_lens: list[int], page_size: int, dtype: torch.dtype, heads: int, device: str):
    """Permuted pages, NaN everywhere no sequence owns (incl. the tail of last pages)."""
    pages = [triton.cdiv(n, page_size) for n in seq_lens]
    num_pages = sum(pages) + 5
    perm = torch.randperm(num_pages, device=device)
    bt = torch.full((len(seq_lens), max(pages) + 2), 1 << 30, dtype=torch.int32, device=device)
    cache = torch.full((num_pages, page_size, 576), float("nan"), device=device)
    used = 0
    for b, n in enumerate(seq_lens):
        ids = perm[used : used + pages[b]]
        used += pages[b]
        bt[b, : pages[b]] = ids.int()
        tok = torch.arange(n, device=device)
        cache[ids[tok // page_size], tok % page_size] = torch.randn(n, 576, device=device)
    scale = None
    if dtype == FP8:
        scale = torch.tensor([1.0 / 64], device=device)
        cache = (cache / scale).clamp(-448, 448).to(FP8)
    else:
        cache = cache.to(dtype)
    q = torch.randn(len(seq_lens), heads, 576, device=device).to(torch.bfloat16)
    seq = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return q, cache, bt, seq, scale


def check_decode(
    env: Env,
    configs: list[dec.MLADecodeConfig],
    page_sizes: tuple[int, ...] = (64, 1),
    split_counts: tuple[int | None, ...] = (None, 1, 7, 300),
) -> list[dict]:
    lens = [5000, 1000, 33, 0] if not env.smoke else [70, 17]
    heads = HEADS if not env.smoke else 4
    results = []
    for dtype in (torch.bfloat16, FP8):
        for page_size in page_sizes:
            q, cache, bt, seq, scale = nan_case(lens, page_size, dtype, heads, env.device)
            ref = dec.mla_decode_ref(
                q,
                cache,
                bt,
                seq,
                SM_SCALE,
                torch.empty(q.shape[0], heads, 512, device=env.device),
                scale,
            )
            for cfg in configs:
                if cfg.fp8_qk and dtype != FP8:
                    continue
                for splits in split_counts:
                    out = torch.full_like(ref, float("nan"), dtype=torch.bfloat16)
                    row = {
                        "kernel": "mla_decode",
                        "dtype": str(dtype),
                        "page_size": page_size,
                        "seq_lens": lens,
                        "num_splits": splits,
                        "config": asdict(cfg),
                    }
                    try:
                        dec.mla_decode(q, cache, bt, seq, SM_SCALE, out, scale, splits, config=cfg)
                        row.update(err_stats(out, ref))
                        if cfg.fp8_qk:  # experimental, judged by a looser bound
                            row["pass"] = row["finite"] and row["max_abs_err"] < 0.1 * max(
                                1.0, row["ref_abs_max"]
                            )
                    except Exception as exc:  # record and go on: one config must not end the run
                        row.update({"pass": False, "error": repr(exc)[:300]})
                    results.append(row)
    return results


def check_decode_graph(env: Env) -> dict:
    """Capture once with a workspace, then replay with new seq_lens and block tables."""
    if env.smoke:
        return {"kernel": "mla_decode graph replay", "skipped": "smoke"}
    q, cache, bt, seq, _ = nan_case([3000, 2000], 64, torch.bfloat16, HEADS, env.device)
    ws = dec.MLADecodeWorkspace.allocate(2, HEADS, 64, env.device)
    out = torch.empty(2, HEADS, 512, dtype=torch.bfloat16, device=env.device)
    splits = 64
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dec.mla_decode(q, cache, bt, seq, SM_SCALE, out, None, splits, ws)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dec.mla_decode(q, cache, bt, seq, SM_SCALE, out, None, splits, ws)
    # New step: sequences swap lengths and the second one's pages are the first's.
    seq.copy_(torch.tensor([1999, 2999], dtype=torch.int32, device=env.device))
    bt_new = bt.clone()
    bt_new[0], bt_new[1] = bt[1], bt[0]
    bt.copy_(bt_new)
    q.copy_(torch.randn_like(q.float()).to(torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    ref = dec.mla_decode_ref(
        q, cache, bt, seq, SM_SCALE, torch.empty(2, HEADS, 512, device=env.device)
    )
    return {"kernel": "mla_decode graph replay", **err_stats(out, ref)}


def check_cache_write(env: Env) -> list[dict]:
    results = []
    tokens = 300 if not env.smoke else 20
    for dtype in (torch.bfloat16, FP8):
        c = (torch.randn(tokens, 512, device=env.device) * 30).to(torch.bfloat16)
        k_pe = torch.randn(tokens, 64, device=env.device).to(torch.bfloat16)
        slots = torch.randperm(64 * 16, device=env.device)[:tokens].long()
        slots[::7] = -1
        scale = torch.tensor([0.05], device=env.device) if dtype == FP8 else None
        a = torch.zeros(16, 64, 576, dtype=dtype, device=env.device)
        b = torch.zeros_like(a)
        kvc.write_mla_cache(c, k_pe, a, slots, scale)
        kvc.write_mla_cache_ref(c, k_pe, b, slots, scale)
        same = torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        results.append(
            {"kernel": "write_mla_cache", "dtype": str(dtype), "bit_exact": same, "pass": same}
        )
    return results


def check_prefill(env: Env) -> list[dict]:
    results = []
    prefix, new = ([0, 1500, 37], [700, 300, 1]) if not env.smoke else ([0, 9], [7, 5])
    heads = HEADS if not env.smoke else 4
    for dtype in (torch.bfloat16, FP8):
        totals = [p + n for p, n in zip(prefix, new, strict=True)]
        _, cache, bt, seq, scale = nan_case(totals, 64, dtype, heads, env.device)
        q = torch.randn(sum(new), heads, 576, device=env.device).to(torch.bfloat16)
        cu = torch.tensor(
            [0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device=env.device
        )
        out = torch.full(
            (sum(new), heads, 512), float("nan"), dtype=torch.bfloat16, device=env.device
        )
        ref = torch.empty(sum(new), heads, 512, device=env.device)
        pre.mla_prefill_ref(q, cache, cu, seq, bt, SM_SCALE, ref, scale)
        row = {"kernel": "mla_prefill", "dtype": str(dtype), "prefix": prefix, "new": new}
        try:
            pre.mla_prefill(q, cache, cu, seq, bt, SM_SCALE, out, scale, max(new))
            row.update(err_stats(out, ref))
        except Exception as exc:
            row.update({"pass": False, "error": repr(exc)[:300]})
        results.append(row)
    return results


# ----------------------------------------------------------------------------- decode perf


def decode_fns(
    case: DecodeCase, cfg: dec.MLADecodeConfig, splits: int, ws: dec.MLADecodeWorkspace | None
) -> list[Callable[[], object]]:
    def make(cache: torch.Tensor) -> Callable[[], object]:
        return lambda: dec.mla_decode(
            case.q,
            cache,
            case.block_tables,
            case.seq_lens,
            SM_SCALE,
            case.out,
            case.kv_scale,
            splits,
            ws,
            cfg,
        )

    return [make(c) for c in case.caches]


def _programs(batch: int, cfg: dec.MLADecodeConfig) -> int:
    return batch * triton.cdiv(HEADS, cfg.block_h) * cfg.vsplit


def _waves_to_splits(batch: int, ctx: int, cfg: dec.MLADecodeConfig, sms: int, waves) -> set:
    """Whole-wave split counts (rounded down: a few CTAs past a wave cost a whole wave)."""
    out = set()
    for w in waves:
        want = max(1, int(w * sms) // _programs(batch, cfg))
        out.add(max(1, min(want, ctx // 128, dec.MAX_SPLITS)))
    return out


def split_candidates(batch: int, ctx: int, cfg: dec.MLADecodeConfig, sms: int) -> list[int]:
    """0.5, 1, 2 and 3 waves of CTAs (>= 128 tokens per split), and the library default."""
    out = _waves_to_splits(batch, ctx, cfg, sms, (0.5, 1, 2, 3))
    out.add(dec.default_num_splits(batch, HEADS, ctx, cfg, sms))
    return sorted(out)


def sweep_splits(batch: int, ctx: int, cfg: dec.MLADecodeConfig, sms: int) -> list[int]:
    """Only the 1- and 2-wave split counts, to keep config sweeps short."""
    return sorted(_waves_to_splits(batch, ctx, cfg, sms, (1, 2)))


def time_decode(
    env: Env, case: DecodeCase, cfg: dec.MLADecodeConfig, splits_list: list[int], sms: int
) -> dict:
    ws = dec.MLADecodeWorkspace.allocate(case.batch, HEADS, max(splits_list), env.device)
    per_split = []
    for splits in splits_list:
        t = time_calls(env, decode_fns(case, cfg, splits, ws), env.calls)
        per_split.append({"num_splits": splits, **t, **bw_fields(case.cache_bytes, t["median_us"])})
    best = min(per_split, key=lambda r: r["median_us"])
    default = dec.default_num_splits(case.batch, HEADS, case.ctx, cfg, sms)
    return {"best": best, "per_split": per_split, "default_num_splits": default}


def sweep_configs(
    env: Env, configs: list[dec.MLADecodeConfig], sms: int, shapes: list[tuple[int, int]]
) -> tuple[list[dict], dict]:
    rows = []
    best: dict[str, tuple[float, dec.MLADecodeConfig]] = {}
    for dtype in (torch.bfloat16, FP8):
        cases = [make_decode_case(b, c, dtype, 64, env.device) for b, c in shapes]
        for cfg in configs:
            if cfg.fp8_qk and dtype != FP8:
                continue
            row = {"dtype": str(dtype), "config": asdict(cfg), "shapes": []}
            log_sum = 0.0
            try:
                for case in cases:
                    splits = sweep_splits(case.batch, case.ctx, cfg, sms)
                    r = time_decode(env, case, cfg, splits, sms)
                    row["shapes"].append({"batch": case.batch, "ctx": case.ctx, **r["best"]})
                    log_sum += math.log(r["best"]["median_us"] + 1e-9)
                    print(
                        f"  sweep {dtype} {cfg} B={case.batch} ctx={case.ctx}: "
                        f"{r['best']['median_us']:.1f} us ({r['best']['pct_hbm']:.0f}% HBM, "
                        f"splits {r['best']['num_splits']})",
                        flush=True,
                    )
            except Exception as exc:
                row["error"] = repr(exc)[:300]
                print(f"  sweep {dtype} {cfg}: FAILED {row['error']}", flush=True)
                rows.append(row)
                continue
            rows.append(row)
            key = "fp8_qk" if cfg.fp8_qk else str(dtype)
            if key not in best or log_sum < best[key][0]:
                best[key] = (log_sum, cfg)
        del cases
        torch.cuda.empty_cache() if not env.smoke else None
    return rows, {k: v[1] for k, v in best.items()}


def decode_grid(
    env: Env,
    best: dict,
    sms: int,
    batches: list[int],
    ctxs: list[int],
    fp8_qk_cfg: dec.MLADecodeConfig | None,
    rows: list[dict],
    on_row: Callable[[], None],
) -> list[dict]:
    for ctx in ctxs:
        for batch in batches:
            times = {}
            for dtype in (torch.bfloat16, FP8):
                cfg = best[str(dtype)]
                case = make_decode_case(batch, ctx, dtype, 64, env.device)
                row = {
                    "batch": batch,
                    "ctx": ctx,
                    "dtype": str(dtype),
                    "page_size": 64,
                    "config": asdict(cfg),
                    "cache_bytes": case.cache_bytes,
                    "l2_rotation_copies": len(case.caches),
                }
                try:
                    r = time_decode(env, case, cfg, split_candidates(batch, ctx, cfg, sms), sms)
                    row.update(
                        {
                            "triton": r["best"],
                            "per_split": r["per_split"],
                            "default_num_splits": r["default_num_splits"],
                        }
                    )
                    times[str(dtype)] = r["best"]["median_us"]
                except Exception as exc:
                    row["triton_error"] = repr(exc)[:300]
                if fp8_qk_cfg is not None and dtype == FP8:
                    try:
                        r = time_decode(
                            env,
                            case,
                            fp8_qk_cfg,
                            split_candidates(batch, ctx, fp8_qk_cfg, sms),
                            sms,
                        )
                        row["triton_fp8_qk"] = r["best"]
                    except Exception as exc:
                        row["triton_fp8_qk_error"] = repr(exc)[:300]
                try:
                    peer_fns = [partial(torch_decode_peer, case, c) for c in case.caches]
                    t = time_calls(env, peer_fns, env.peer_calls)
                    row["torch_peer"] = {**t, **bw_fields(case.cache_bytes, t["median_us"])}
                    if "triton" in row:
                        row["speedup_vs_torch"] = t["median_us"] / row["triton"]["median_us"]
                except Exception as exc:  # e.g. out of memory for the gathered copy
                    row["torch_peer_error"] = repr(exc)[:200]
                rows.append(row)
                tri = row.get("triton", {})
                print(
                    f"decode B={batch:3d} ctx={ctx:6d} {str(dtype):20s} "
                    f"triton {tri.get('median_us', float('nan')):9.1f} us "
                    f"{tri.get('GB_s', 0):7.0f} GB/s {tri.get('pct_hbm', 0):5.1f}% "
                    f"(splits {tri.get('num_splits')}) | torch "
                    f"{row.get('torch_peer', {}).get('median_us', float('nan')):9.1f} us",
                    flush=True,
                )
                del case
                if not env.smoke:
                    torch.cuda.empty_cache()
            if len(times) == 2:
                rows[-1]["fp8_speedup_vs_bf16"] = times["torch.bfloat16"] / times[str(FP8)]
            on_row()
    return rows


def page_size_rows(
    env: Env, best: dict, sms: int, batch: int, ctx: int, sizes: list[int]
) -> list[dict]:
    rows = []
    cfg = best["torch.bfloat16"]
    for ps in sizes:
        case = make_decode_case(batch, ctx, torch.bfloat16, ps, env.device)
        try:
            r = time_decode(env, case, cfg, sweep_splits(batch, ctx, cfg, sms), sms)
            rows.append({"page_size": ps, "batch": batch, "ctx": ctx, **r["best"]})
            print(
                f"page size {ps:4d}: {r['best']['median_us']:.1f} us "
                f"{r['best']['pct_hbm']:.1f}% HBM",
                flush=True,
            )
        except Exception as exc:
            rows.append({"page_size": ps, "error": repr(exc)[:300]})
        del case
    return rows


# ----------------------------------------------------------------------------- write/prefill


def torch_write_peer(c, k_pe, flat, slots, scale) -> None:
    rows = torch.cat([c, k_pe], dim=-1)
    if flat.dtype == FP8:
        rows = (rows.float() / scale).clamp(-448, 448)
    flat[slots] = rows.to(flat.dtype)


def torch_prefill_peer(q, cache, bt, prefix: int, total: int, scale) -> torch.Tensor:
    kv = cache[bt[0].long()].view(-1, 576)[:total]
    if cache.dtype == FP8:
        kv = kv.to(torch.bfloat16) * scale.to(torch.bfloat16)
    s = torch.matmul(q.transpose(0, 1), kv.t()).float() * SM_SCALE
    pos = torch.arange(prefix, total, device=kv.device)
    mask = torch.arange(total, device=kv.device)[None, :] > pos[:, None]
    s = s.masked_fill(mask, float("-inf"))
    return torch.matmul(torch.softmax(s, -1).to(torch.bfloat16), kv[:, :512])


def cache_write_rows(env: Env, token_counts: list[int]) -> list[dict]:
    rows = []
    for dtype in (torch.bfloat16, FP8):
        for tokens in token_counts:
            pages = triton.cdiv(tokens, 64) * 4
            cache = torch.zeros(pages, 64, 576, dtype=dtype, device=env.device)
            c = torch.randn(tokens, 512, device=env.device).to(torch.bfloat16)
            k_pe = torch.randn(tokens, 64, device=env.device).to(torch.bfloat16)
            slots = torch.randperm(pages * 64, device=env.device)[:tokens].long()
            scale = torch.tensor([0.05], device=env.device) if dtype == FP8 else None
            nbytes = tokens * (576 * 2 + 8 + 576 * cache.element_size())
            flat = cache.view(-1, 576)

            call = partial(kvc.write_mla_cache, c, k_pe, cache, slots, scale)
            t = time_calls(env, [call], env.calls)
            peer = partial(torch_write_peer, c, k_pe, flat, slots, scale)
            p = time_calls(env, [peer], env.calls)
            rows.append(
                {
                    "tokens": tokens,
                    "dtype": str(dtype),
                    "triton": {**t, **bw_fields(nbytes, t["median_us"])},
                    "torch_peer": {**p, **bw_fields(nbytes, p["median_us"])},
                }
            )
            print(
                f"cache write T={tokens:5d} {str(dtype):20s} {t['median_us']:7.2f} us "
                f"| torch {p['median_us']:7.2f} us",
                flush=True,
            )
    return rows


def prefill_rows(env: Env, shapes: list[tuple[int, int]]) -> list[dict]:
    rows = []
    heads = HEADS if not env.smoke else 4
    for prefix, new in shapes:
        for dtype in (torch.bfloat16, FP8):
            total = prefix + new
            pages = triton.cdiv(total, 64)
            cache = random_cache(pages, 64, dtype, env.device)
            bt = torch.randperm(pages, device=env.device).int()[None]
            seq = torch.tensor([total], dtype=torch.int32, device=env.device)
            cu = torch.tensor([0, new], dtype=torch.int32, device=env.device)
            q = (torch.randn(new, heads, 576, device=env.device) * 0.5).to(torch.bfloat16)
            scale = torch.tensor([0.05], device=env.device) if dtype == FP8 else None
            out = torch.empty(new, heads, 512, dtype=torch.bfloat16, device=env.device)
            visible = new * prefix + new * (new + 1) // 2
            flops = 2.0 * heads * visible * (576 + 512)
            row = {"prefix": prefix, "new": new, "dtype": str(dtype), "flops": flops}
            call = partial(pre.mla_prefill, q, cache, cu, seq, bt, SM_SCALE, out, scale, new)
            t = time_calls(env, [call], max(2, env.calls // 10))
            row["triton"] = {**t, "TFLOP_s": flops / (t["median_us"] * 1e-6) / 1e12}
            try:
                peer = partial(torch_prefill_peer, q, cache, bt, prefix, total, scale)
                p = time_calls(env, [peer], max(2, env.peer_calls // 2))
                row["torch_peer"] = {**p, "TFLOP_s": flops / (p["median_us"] * 1e-6) / 1e12}
            except Exception as exc:
                row["torch_peer_error"] = repr(exc)[:200]
            rows.append(row)
            print(
                f"prefill prefix={prefix} new={new} {str(dtype):20s} "
                f"{t['median_us']:9.1f} us {row['triton']['TFLOP_s']:6.1f} TFLOP/s | torch "
                f"{row.get('torch_peer', {}).get('median_us', float('nan')):9.1f} us",
                flush=True,
            )
    return rows


# ----------------------------------------------------------------------------- report


def kernel_diagnostics() -> list[dict]:
    """Registers, spills, shared memory and MMA/pipelining markers of every compiled
    decode split kernel. Only counts are kept: one file per kernel would exceed what the
    GPU machine returns (run 2 lost its JSON that way)."""
    rows = []
    fn = dec._mla_decode_split_kernel
    caches = getattr(fn, "device_caches", {})
    for dev, entry in caches.items():
        kernels = entry[0]
        for i, kern in enumerate(kernels.values()):
            row: dict = {"device": str(dev), "index": i}
            try:
                consts = getattr(kern.src, "constants", {})
                row["constexprs"] = {str(k): str(v) for k, v in dict(consts).items()}
            except Exception as exc:
                row["constexprs_error"] = repr(exc)[:100]
            for name in ("n_regs", "n_spills"):
                row[name] = getattr(kern, name, None)
            md = getattr(kern, "metadata", None)
            for name in ("num_warps", "num_stages", "shared"):
                row[name] = getattr(md, name, None)
            ttgir = kern.asm.get("ttgir", "") if hasattr(kern, "asm") else ""
            row["warp_group_dot"] = ttgir.count("warp_group_dot")
            row["mma_v2_dot"] = ttgir.count("tt.dot ")
            row["async_copy"] = ttgir.count("async_copy_global_to_local")
            row["local_alloc"] = ttgir.count("local_alloc")
            row["convert_layout"] = ttgir.count("convert_layout")
            rows.append(row)
            print(f"  kernel {i}: {row}", flush=True)
    return rows


def meta(device: str, commit_arg: str | None = None) -> dict:
    """Run provenance. Pass `commit` where the checkout's git metadata may be stale (the GPU
    machine's copy of the tree)."""
    commit = git_commit()
    gpu = torch.cuda.get_device_name(0) if device == "cuda" else "cpu (interpreter smoke)"
    return {
        "git_commit": commit_arg or commit,
        "gpu": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": sys.version.split()[0],
        "date_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "hbm_bytes_per_s": HBM_BYTES_PER_S,
        "heads": HEADS,
        "sm_scale": SM_SCALE,
    }


def markdown(res: dict) -> str:
    m = res["meta"]
    lines = [
        "# MLA kernels benchmark (Kimi-K2.5 shapes: 64 heads, 576/512, page size 64)",
        "",
        f"GPU {m['gpu']}, torch {m['torch']}, triton {m['triton']}, commit {m['git_commit']},"
        f" {m['date_utc']}. Times are per call inside CUDA graphs; % is of 4.3 TB/s on the"
        " cache bytes; caches < 256 MB rotate through copies so reads come from HBM.",
        "",
        f"Correctness on GPU: {res['correctness_summary']}",
        "",
        f"Decode configs chosen by the sweep: {res.get('chosen_configs')}",
        "",
        "## MLA decode",
        "",
        "| ctx | batch | cache | cache MB | Triton us | GB/s | % HBM | splits | torch us |"
        " torch % HBM | speedup | FP8 vs BF16 | FP8-QK us (exp.) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res.get("decode", []):
        t = r.get("triton", {})
        p = r.get("torch_peer", {})
        qk = r.get("triton_fp8_qk", {})
        lines.append(
            f"| {r['ctx']} | {r['batch']} | {'fp8' if 'float8' in r['dtype'] else 'bf16'} | "
            f"{r['cache_bytes'] / 1e6:.1f} | {t.get('median_us', float('nan')):.1f} | "
            f"{t.get('GB_s', 0):.0f} | {t.get('pct_hbm', 0):.1f} | {t.get('num_splits', '-')} | "
            f"{p.get('median_us', float('nan')):.1f} | {p.get('pct_hbm', 0):.1f} | "
            f"{r.get('speedup_vs_torch', float('nan')):.1f}x | "
            f"{r.get('fp8_speedup_vs_bf16', float('nan')):.2f}x | "
            f"{qk.get('median_us', float('nan')):.1f} |"
        )
    if res.get("page_sizes"):
        lines += [
            "",
            "## Page size (bf16)",
            "",
            "| page size | batch | ctx | us | % HBM |",
            "|---|---|---|---|---|",
        ]
        for r in res["page_sizes"]:
            lines.append(
                f"| {r['page_size']} | {r.get('batch')} | {r.get('ctx')} | "
                f"{r.get('median_us', float('nan')):.1f} | {r.get('pct_hbm', 0):.1f} |"
            )
    if res.get("cache_write"):
        lines += [
            "",
            "## Cache write",
            "",
            "| tokens | cache | Triton us | GB/s | torch us |",
            "|---|---|---|---|---|",
        ]
        for r in res["cache_write"]:
            lines.append(
                f"| {r['tokens']} | {r['dtype']} | {r['triton']['median_us']:.2f} | "
                f"{r['triton']['GB_s']:.0f} | {r['torch_peer']['median_us']:.2f} |"
            )
    if res.get("prefill"):
        lines += [
            "",
            "## Prefill (absorbed form, causal, batch 1)",
            "",
            "| prefix | new | cache | Triton us | TFLOP/s | torch us | torch TFLOP/s |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in res["prefill"]:
            p = r.get("torch_peer", {})
            lines.append(
                f"| {r['prefix']} | {r['new']} | {r['dtype']} | "
                f"{r['triton']['median_us']:.1f} | {r['triton']['TFLOP_s']:.1f} | "
                f"{p.get('median_us', float('nan')):.1f} | "
                f"{p.get('TFLOP_s', float('nan')):.1f} |"
            )
    if res.get("notes"):
        lines += ["", "## Notes", ""] + [f"- {n}" for n in res["notes"]]
    return "\n".join(lines) + "\n"


# Run 1 (all vsplit=1) found (64, 64, 8, 2) best of (64|32 heads) x (32|64 tokens) x
# (4|8 warps) x (2|3 stages) at ~37% of HBM. Offline compiles (sm_90a TTGIR + ptxas) then
# showed Triton's cp.async pipelining issues the next tile's copy after the compute and
# waits for all copies at the top of the loop (no overlap), and that vsplit=1 with 8 warps
# duplicates q @ k^T across the two warpgroups. This sweep pits it against value-split
# variants, register prefetch (prefetch=True, num_stages=1) and 2-CTAs-per-SM configs
# (~110 KB shared memory, <= 255 registers x 128 threads).
SWEEP_CONFIGS = [
    dec.MLADecodeConfig(64, 64, 8, 2),
    dec.MLADecodeConfig(64, 32, 4, 2, vsplit=2),
    dec.MLADecodeConfig(64, 16, 4, 2, vsplit=2, ctas_per_sm=2),
    dec.MLADecodeConfig(64, 32, 8, 1, vsplit=2, prefetch=True),
    dec.MLADecodeConfig(64, 16, 4, 1, vsplit=2, prefetch=True, ctas_per_sm=2),
]
FP8_QK_CONFIGS = [
    dec.MLADecodeConfig(64, 64, 8, 2, fp8_qk=True),
    dec.MLADecodeConfig(64, 32, 4, 2, fp8_qk=True, vsplit=2),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--skip-sweep", action="store_true", help="use DEFAULT_CONFIG")
    ap.add_argument("--sections", default="check,sweep,diagnostics,decode,pages,write,prefill")
    ap.add_argument("--commit", default=None, help="commit id to record (default: git)")
    args = ap.parse_args()
    sections = set(args.sections.split(","))
    smoke = args.smoke
    device = "cpu" if smoke else "cuda"
    env = Env(
        device,
        smoke,
        calls=1 if smoke else 100,
        peer_calls=1 if smoke else 10,
        reps=1 if smoke else 5,
    )
    sms = 132 if smoke else torch.cuda.get_device_properties(0).multi_processor_count
    torch.manual_seed(0)
    res: dict = {"meta": meta(device, args.commit), "notes": []}
    print(json.dumps(res["meta"]), flush=True)
    t_start = time.time()

    fp8_qk_cfg = FP8_QK_CONFIGS[0]
    if smoke:
        small = dec.MLADecodeConfig(16, 16, 4, 1)
        small2 = dec.MLADecodeConfig(16, 16, 4, 1, vsplit=2)
        fp8_qk_cfg = replace(small, fp8_qk=True)
        sweep_cfgs = [small, small2, fp8_qk_cfg]
    else:
        sweep_cfgs = SWEEP_CONFIGS + FP8_QK_CONFIGS

    def section(name: str, fn: Callable[[], object]) -> object:
        if name not in sections:
            return None
        t0 = time.time()
        try:
            value = fn()
        except Exception:
            tb = traceback.format_exc()
            print(tb, flush=True)
            res.setdefault("errors", {})[name] = tb[-2000:]
            value = None
        print(f"[{name}] {time.time() - t0:.1f}s (total {time.time() - t_start:.1f}s)", flush=True)
        return value

    def save() -> None:
        """Write JSON + markdown now, so a run cut short by a time limit still reports."""
        res["total_seconds"] = time.time() - t_start
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "kernels_mla.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)
        with open(os.path.join(args.out, "kernels_mla.md"), "w") as f:
            f.write(markdown(res))

    checks: list[dict] = []
    # Every swept config is checked at page size 64 (the sweep compiles them anyway), the
    # default and FP8-QK ones also at page size 1.
    checks += section("check", lambda: check_decode(env, [dec.DEFAULT_CONFIG, fp8_qk_cfg])) or []
    others = [c for c in sweep_cfgs if c not in (dec.DEFAULT_CONFIG, fp8_qk_cfg)]
    checks += section("check", lambda: check_decode(env, others, (64,), (None, 7))) or []
    checks += [section("check", lambda: check_decode_graph(env)) or {}]
    checks += section("check", lambda: check_cache_write(env)) or []
    checks += section("check", lambda: check_prefill(env)) or []
    res["correctness"] = checks
    bad = [c for c in checks if c and not c.get("pass", True)]
    res["correctness_summary"] = f"{len(checks) - len(bad)}/{len(checks)} checks pass" + (
        f"; FAILED: {bad}" if bad else ""
    )
    print(res["correctness_summary"], flush=True)
    save()

    best = {"torch.bfloat16": dec.DEFAULT_CONFIG, str(FP8): dec.DEFAULT_CONFIG}
    if not args.skip_sweep:
        shapes = [(1, 32768), (64, 4096)] if not smoke else [(1, 64)]
        swept = section("sweep", lambda: sweep_configs(env, sweep_cfgs, sms, shapes))
        if swept:
            res["sweep"], chosen = swept
            best.update(chosen)
    qk_cfg = best.pop("fp8_qk", fp8_qk_cfg)
    res["chosen_configs"] = {k: asdict(v) for k, v in best.items()}
    res["chosen_configs"]["fp8_qk (experimental)"] = asdict(qk_cfg)
    save()
    batches, ctxs = ([1, 8, 64], [4096, 32768, 131072]) if not smoke else ([1, 2], [40])
    res["decode"] = []
    res["compiled_kernels"] = section("diagnostics", kernel_diagnostics) or []
    section(
        "decode",
        lambda: decode_grid(env, best, sms, batches, ctxs, qk_cfg, res["decode"], save),
    )
    save()
    res["page_sizes"] = (
        section(
            "pages",
            lambda: page_size_rows(
                env,
                best,
                sms,
                8 if not smoke else 1,
                32768 if not smoke else 40,
                [1, 16, 64, 256] if not smoke else [1, 16],
            ),
        )
        or []
    )
    save()
    res["cache_write"] = (
        section("write", lambda: cache_write_rows(env, [1, 64, 8192] if not smoke else [3])) or []
    )
    save()
    res["prefill"] = (
        section(
            "prefill",
            lambda: prefill_rows(
                env, [(0, 2048), (14336, 2048)] if not smoke else [(0, 8), (9, 5)]
            ),
        )
        or []
    )
    save()
    print(markdown(res), flush=True)


if __name__ == "__main__":
    main()
