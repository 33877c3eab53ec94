# ruff: noqa: B023 -- the closures below are called within their loop iteration
"""Microbenchmarks of the fused attention-side kernels at Kimi-K2.5 / DeepSeek-V3 shapes, each
next to the torch ops it replaces, all timed inside CUDA graphs.

Run on the GPU machine from the repository root:

    PYTHONPATH=$PWD python benchmarks/fused_kernels.py --out benchmarks/results

Sections (T = tokens per call, 1 / 8 / 64):
- rms_norm [T, 7168], add_rmsnorm [T, 7168] (residual add fused) vs F.rms_norm (+ the add);
- rms_norm_pair: both MLA a-norms on the merged [T, 1536 + 576] output, in place, vs two
  F.rms_norm on the split (the kv part made contiguous, as the old path did);
- route: router logits -> top-8 ids and weights, Kimi (E 384, 1 group) and DeepSeek (E 256,
  8 groups keep 4) vs moeserve.layers.routing.select_experts (torch: sigmoid, topk, gather...);
- rope + cache write (64 and 8 heads = TP8, BF16 and FP8 cache) vs RotaryEmbedding + the
  plain cache-write kernel + the cat of the absorbed query (the ops it replaced);
- merged q_a + kv_a GEMM [7168 -> 2112] vs the two GEMMs (bf16 cuBLAS, weights cycled past L2);
- one MLA attention layer forward (decode, 4k context, BF16 cache, dense BF16 weights; 64
  heads and 8 = TP8's share): time, % of HBM for its weight + cache bytes, and kernels
  launched per call (torch.profiler).

Every figure: median of 7 replays of a graph of ~100 calls (eager launches cost 13-16 us on
the reference machine). Writes fused_kernels.json and fused_kernels.md into --out.
``--smoke`` runs tiny shapes on the CPU under TRITON_INTERPRET=1 to check the script.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"
    # the interpreter shims (loop bounds, bf16 dot and rounding) live beside the kernel tests
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.kernels.interpreter_shims import install_interpreter_shims
    from tests.kernels.rounding_shim import install_bf16_rounding_shim

    install_interpreter_shims()
    install_bf16_rounding_shim()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from common import git_commit

from moeserve.kernels.attention import kv_cache as kvc  # noqa: E402
from moeserve.kernels.elementwise import norm as nk  # noqa: E402
from moeserve.kernels.routing import router as rk  # noqa: E402
from moeserve.layers.attention.mla_backends import TritonMLA  # noqa: E402
from moeserve.layers.routing import select_experts  # noqa: E402
from moeserve.models.registry import config_from_hf

HBM_BYTES_PER_S = 4.3e12
L2_FLUSH_BYTES = 256 << 20  # cycle weight copies until one pass exceeds the 50 MB L2
TOKENS = (1, 8, 64)
KIMI = dict(hidden=7168, heads=64, q_lora=1536, kv_lora=512, nope=128, rope=64, v=128)
ROUTERS = {  # name -> (experts, n_group, topk_group, routed_scaling_factor)
    "kimi E384 g1": (384, 1, 1, 2.827),
    "deepseek E256 g8/4": (256, 8, 4, 2.5),
}
TOP_K = 8
EPS = 1e-6
CONTEXT = 4096
PAGE = 64
GRAPH_CALLS = 100


def log(*a: object) -> None:
    print(*a, flush=True)


# ---- timing ----------------------------------------------------------------------------------
def graph_time_us(fns: list[Callable[[], object]], calls: int = GRAPH_CALLS) -> dict[str, float]:
    """Capture `calls` calls cycling over fns in one CUDA graph; median/min/max us per call."""
    for f in fns:
        f()
    if not torch.cuda.is_available():  # --smoke: one wall-clock call
        t0 = time.perf_counter()
        fns[0]()
        us = (time.perf_counter() - t0) * 1e6
        return {"us": us, "us_min": us, "us_max": us}
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    del graph
    return {"us": statistics.median(times), "us_min": min(times), "us_max": max(times)}


def copies(one_copy_bytes: int) -> int:
    if not torch.cuda.is_available():
        return 2
    return max(2, math.ceil(L2_FLUSH_BYTES / one_copy_bytes))


def kernels_per_call(fn: Callable[[], object]) -> int | None:
    """CUDA kernels one eager call launches (None without a GPU)."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def record(records: list, section: str, name: str, t: int, ours: dict, peer: dict, **kw) -> None:
    row = {
        "section": section,
        "kernel": name,
        "T": t,
        "us": ours["us"],
        "us_min": ours["us_min"],
        "us_max": ours["us_max"],
        "peer_us": peer["us"] if peer else None,
        "speedup_vs_peer": peer["us"] / ours["us"] if peer and ours["us"] > 0 else None,
        **kw,
    }
    if "bytes" in kw and ours["us"] > 0:
        row["pct_hbm"] = 100 * kw["bytes"] / (ours["us"] * 1e-6) / HBM_BYTES_PER_S
    records.append(row)
    sp = f" ({row['speedup_vs_peer']:.2f}x)" if row["speedup_vs_peer"] else ""
    peer_txt = f", peer {peer['us']:.2f} us" if peer else ""
    log(f"  {section} {name} T={t}: {ours['us']:.2f} us{peer_txt}{sp}")


# ---- sections ----------------------------------------------------------------------------------
def bench_norms(dev: str, dims: dict, records: list) -> None:
    h, q_lora, lat = dims["hidden"], dims["q_lora"], dims["kv_lora"] + dims["rope"]
    w = torch.ones(h, device=dev, dtype=torch.bfloat16)
    wa = torch.ones(q_lora, device=dev, dtype=torch.bfloat16)
    wb = torch.ones(dims["kv_lora"], device=dev, dtype=torch.bfloat16)
    for t in TOKENS:
        x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
        r = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
        ours = graph_time_us([lambda: nk.rms_norm(x, w, EPS)])
        peer = graph_time_us([lambda: F.rms_norm(x, (h,), w, EPS)])
        record(records, "norm", "rms_norm", t, ours, peer, shape=f"[{t}, {h}]")
        ours = graph_time_us([lambda: nk.add_rmsnorm(x, r, w, EPS)])
        peer = graph_time_us([lambda: F.rms_norm(x + r, (h,), w, EPS)])
        record(records, "norm", "add_rmsnorm", t, ours, peer, shape=f"[{t}, {h}]")
        qkv = torch.randn(t, q_lora + lat, device=dev, dtype=torch.bfloat16)

        def pair_peer() -> None:
            qa, c = qkv[:, :q_lora], qkv[:, q_lora : q_lora + dims["kv_lora"]]
            F.rms_norm(qa, (q_lora,), wa, EPS)
            F.rms_norm(c.contiguous(), (dims["kv_lora"],), wb, EPS)

        ours = graph_time_us([lambda: nk.rms_norm_pair(qkv, wa, wb, EPS, EPS, out=qkv)])
        peer = graph_time_us([pair_peer])
        record(records, "norm", "rms_norm_pair", t, ours, peer, shape=f"[{t}, {q_lora}+{lat}]")


def bench_router(dev: str, records: list, tokens: tuple[int, ...]) -> None:
    for name, (experts, n_group, topk_group, scale) in ROUTERS.items():
        bias = 0.1 * torch.randn(experts, device=dev)
        kw = dict(n_group=n_group, topk_group=topk_group, routed_scaling_factor=scale)
        for t in tokens:
            logits = torch.randn(t, experts, device=dev)
            w = torch.empty(t, TOP_K, device=dev)
            i = torch.empty(t, TOP_K, device=dev, dtype=torch.int32)
            ours = graph_time_us(
                [lambda: rk.route(logits, bias, TOP_K, out_weights=w, out_ids=i, **kw)]
            )
            peer = graph_time_us(
                [lambda: select_experts(logits, TOP_K, correction_bias=bias, **kw)]
            )
            record(records, "router", f"route {name}", t, ours, peer, shape=f"[{t}, {experts}]")


def bench_rope_cache(dev: str, dims: dict, records: list, heads_list: tuple[int, ...]) -> None:
    from moeserve.config import RopeScaling
    from moeserve.layers.rotary import RotaryEmbedding

    yarn = RopeScaling(
        type="yarn",
        factor=64.0,
        original_max_position_embeddings=4096,
        beta_fast=1.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    )
    rot = RotaryEmbedding(64, 4096, 50000.0, yarn, interleaved=True).to(dev)
    q_lora, kv, nope = dims["q_lora"], dims["kv_lora"], dims["nope"]
    for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        tag = "bf16" if cache_dtype == torch.bfloat16 else "fp8"
        scale = torch.tensor([0.05], device=dev) if tag == "fp8" else None
        cache = torch.zeros(1024, PAGE, kv + 64, device=dev).to(cache_dtype)
        for heads in heads_list:
            for t in TOKENS:
                qkv = torch.randn(t, q_lora + kv + 64, device=dev, dtype=torch.bfloat16)
                q = torch.randn(t, heads, nope + 64, device=dev, dtype=torch.bfloat16)
                q_abs = torch.empty(t, heads, kv + 64, device=dev, dtype=torch.bfloat16)
                q_lat = torch.randn(t, heads, kv, device=dev, dtype=torch.bfloat16)
                pos = torch.randint(0, 100_000, (t,), device=dev)
                slots = torch.randperm(1024 * PAGE, device=dev)[:t]
                c, k_pe = qkv[:, q_lora : q_lora + kv], qkv[:, q_lora + kv :]
                rope = kvc.CacheRope(pos, rot.cos, rot.sin, q[..., nope:], q_abs[..., kv:])

                def ours_fn() -> None:
                    kvc.write_mla_cache(c, k_pe, cache, slots, scale, rope)

                def peer_fn() -> None:  # the replaced sequence: rotary, write, cat
                    q_pe, kp = rot(pos, q[..., nope:], k_pe.unsqueeze(1))
                    kvc.write_mla_cache(
                        c.contiguous(), kp.squeeze(1).contiguous(), cache, slots, scale
                    )
                    torch.cat([q_lat, q_pe], dim=-1)

                ours, peer = graph_time_us([ours_fn]), graph_time_us([peer_fn])
                record(
                    records, "rope_cache", f"rope+write {tag} cache, {heads} heads", t, ours, peer
                )


def bench_qkv_a(dev: str, dims: dict, records: list) -> None:
    h, sizes = dims["hidden"], [dims["q_lora"], dims["kv_lora"] + dims["rope"]]
    nbytes = h * sum(sizes) * 2
    n = copies(nbytes)
    merged = [torch.randn(sum(sizes), h, device=dev, dtype=torch.bfloat16) for _ in range(n)]
    parts = [m.split(sizes) for m in merged]
    parts = [(a.contiguous(), b.contiguous()) for a, b in parts]
    for t in TOKENS:
        x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
        ours = graph_time_us([lambda w=w: F.linear(x, w) for w in merged])
        peer = graph_time_us([lambda p=p: (F.linear(x, p[0]), F.linear(x, p[1])) for p in parts])
        record(
            records, "gemm", "merged q_a+kv_a GEMM", t, ours, peer,
            shape=f"[{t}, {h}] x [{h}, {sum(sizes)}]", bytes=nbytes + 2 * t * (h + sum(sizes)),
        )  # fmt: skip


def _layer_config(dims: dict) -> dict:
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": 1024,
        "hidden_size": dims["hidden"],
        "intermediate_size": 2 * dims["hidden"],
        "moe_intermediate_size": 256,
        "num_hidden_layers": 1,
        "num_attention_heads": dims["heads"],
        "num_key_value_heads": dims["heads"],
        "q_lora_rank": dims["q_lora"],
        "kv_lora_rank": dims["kv_lora"],
        "qk_nope_head_dim": dims["nope"],
        "qk_rope_head_dim": dims["rope"],
        "v_head_dim": dims["v"],
        "n_routed_experts": 8,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "routed_scaling_factor": 2.827,
        "norm_topk_prob": True,
        "rms_norm_eps": EPS,
        "rope_theta": 50000.0,
        "max_position_embeddings": 262144,
        "rope_scaling": {
            "type": "yarn",
            "factor": 64.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "tie_word_embeddings": False,
        "attention_bias": False,
    }


def bench_attention_layer(
    dev: str, dims: dict, records: list, context: int, heads_list: tuple[int, ...]
) -> None:
    """One MLA layer forward (decode rows only) on the kernel path, dense BF16 weights; 8
    heads is one rank's share under TP8 (the same per-rank shapes)."""
    for heads in heads_list:
        _bench_attention_layer(dev, {**dims, "heads": heads}, records, context)


def _bench_attention_layer(dev: str, dims: dict, records: list, context: int) -> None:
    from moeserve.layers.attention.metadata import AttentionMetadata, ForwardContext
    from moeserve.layers.attention.mla import MLAAttention
    from moeserve.layers.rotary import RotaryEmbedding

    cfg = config_from_hf(_layer_config(dims))
    rot = RotaryEmbedding(
        cfg.mla.qk_rope_head_dim,
        cfg.max_position_embeddings,
        cfg.rope_theta,
        cfg.rope_scaling,
        True,
    ).to(dev)
    with torch.device(dev):
        layer = MLAAttention(cfg, "model.layers.0.self_attn", rot, None, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("norm.weight") or name == "kv_scale":
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02)
    layer.use_backend(TritonMLA)  # also under --smoke (interpreter)
    weight_bytes = sum(
        p.numel() * p.element_size() for n, p in layer.named_parameters() if "norm" not in n
    )
    for t in TOKENS:
        pages_per_seq = -(-context // PAGE)
        layer.bind_kv_cache(t * pages_per_seq + 1, PAGE, torch.bfloat16, dev)
        table = torch.randperm(t * pages_per_seq, device=dev).view(t, pages_per_seq).int()
        seq = torch.full((t,), context, dtype=torch.int32, device=dev)
        pos = seq.long() - 1
        slots = table[:, -1].long() * PAGE + (context - 1) % PAGE
        md = AttentionMetadata(
            slots, table, seq, torch.arange(t + 1, dtype=torch.int32, device=dev), PAGE,
            [context] * t, [1] * t,
        )  # fmt: skip
        ctx = ForwardContext(md)
        x = torch.randn(t, dims["hidden"], device=dev, dtype=torch.bfloat16)
        shared: dict = {}
        if dev == "cuda":
            layer.prepare_cuda_graph(t, context, shared)
        ours = graph_time_us([lambda: layer(pos, x, ctx)], calls=20)
        count = kernels_per_call(lambda: layer(pos, x, ctx))
        cache_bytes = t * context * (dims["kv_lora"] + dims["rope"]) * 2
        record(
            records, "layer", f"MLA attention forward, {dims['heads']} heads, ctx {context}",
            t, ours, {},
            bytes=weight_bytes + cache_bytes, kernels=count, heads=dims["heads"],
        )  # fmt: skip
        log(f"    kernels per call: {count}")


# ---- output ------------------------------------------------------------------------------------
def write_markdown(path: Path, meta: dict, records: list) -> None:
    lines = [
        "# Fused attention-side kernels vs the torch ops they replace",
        "",
        f"GPU {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, commit "
        f"{meta['commit']}, {meta['date']}. Each time is the median per call of 7 replays of a "
        f"CUDA graph of ~{GRAPH_CALLS} calls; % HBM is of {HBM_BYTES_PER_S / 1e12} TB/s.",
        "",
        "| section | kernel | T | us (min-max) | peer us | speedup | % HBM | kernels | shape |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:

        def f(k: str, fmt: str = ".2f") -> str:
            v = r.get(k)
            return "" if v is None else format(v, fmt)

        lines.append(
            f"| {r['section']} | {r['kernel']} | {r['T']} | {r['us']:.2f} "
            f"({r['us_min']:.2f}-{r['us_max']:.2f}) | {f('peer_us')} | {f('speedup_vs_peer')} | "
            f"{f('pct_hbm', '.1f')} | {r.get('kernels') or ''} | {r.get('shape', '')} |"
        )
    lines += [
        "",
        "Peers: F.rms_norm (+ the add); two F.rms_norm on the split merged output; "
        "select_experts (torch); RotaryEmbedding + the plain cache-write kernel + the cat of "
        "the absorbed query; two bf16 GEMMs. The attention layer row counts its weight and "
        "cache bytes; its kernel count is of one eager call.",
    ]
    path.write_text("\n".join(lines) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--commit", default=None, help="commit id to record (the GPU machine's copy)")
    ap.add_argument("--skip", default="", help="comma list of: norm,router,rope,gemm,layer")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter")
    args = ap.parse_args()
    dev, dims, heads, context = "cuda", dict(KIMI), (64, 8), CONTEXT
    global TOKENS
    if args.smoke:
        dev, heads, context, TOKENS = "cpu", (2,), 128, (1, 3)
        dims.update(hidden=256, heads=2, q_lora=128, nope=32, v=32)
        ROUTERS["deepseek E256 g8/4"] = (64, 8, 4, 2.5)
        ROUTERS["kimi E384 g1"] = (48, 1, 1, 2.827)
    commit = git_commit(args.commit)
    meta = {
        "gpu": torch.cuda.get_device_name() if dev == "cuda" else "cpu (smoke)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": commit,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "hbm_bytes_per_s": HBM_BYTES_PER_S,
        "dims": dims,
        "context": context,
        "timing": f"CUDA graph of {GRAPH_CALLS} calls (20 for the layer), median of 7 replays",
    }
    log(json.dumps(meta))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records: list = []
    skip = set(filter(None, args.skip.split(",")))
    sections = (
        ("norm", lambda: bench_norms(dev, dims, records)),
        ("router", lambda: bench_router(dev, records, TOKENS)),
        ("rope", lambda: bench_rope_cache(dev, dims, records, heads)),
        ("gemm", lambda: bench_qkv_a(dev, dims, records)),
        ("layer", lambda: bench_attention_layer(dev, dims, records, context, heads)),
    )
    rc = 0
    for name, fn in sections:
        if name in skip:
            continue
        log(f"== {name} ==")
        try:
            with torch.inference_mode():
                fn()
        except Exception:  # noqa: BLE001 -- report and go on with the next section
            traceback.print_exc()
            rc = 1
        (out / "fused_kernels.json").write_text(
            json.dumps({"meta": meta, "results": records}, indent=1) + "\n"
        )
        write_markdown(out / "fused_kernels.md", meta, records)
    return rc


if __name__ == "__main__":
    sys.exit(main())
