"""Decode time per full-size MoE layer: moeserve (dummy weights in the serving format, CUDA
graphs) against HF transformers' DeepseekV3 on the same shapes, batch 1 / 8 / 64.

Run on the GPU machine from the repository root:
  PYTHONPATH=$PWD python benchmarks/decode_layer.py --out benchmarks/results [--commit SHA]
  ... --parallel tp2-ep,tp2,tp1   (Kimi on 2+ GPUs: decode_layer_parallel.{json,md}, each
      engine in its own process, with the projection to 61 layers on 8 GPUs)
  ... --rank tp8-ep   (one GPU: rank 0's share of an 8-GPU TP + EP deployment, see below;
      decode_layer_rank.{json,md}; also tp8, tp4-ep, ...; --only / --deepseek pick configs)

Method. For each published config (benchmarks/configs/), the engine is built with
`--load-format dummy --num-layers L` for L = d+1 and d+5 (the first d layers are dense, the others
MoE): the slope (t[d+5] - t[d+1]) / 4 is one MoE layer. B requests (64-token prompts, greedy,
ignore_eos) are prefilled, then the engine's own decode steps are timed (wall clock of
`LLMEngine.step`, i.e. what a client sees, host work included) after warm-up. The engine's
decode profiler (`--profile-decode`) gives the kernels per layer, the kernel time and the GPU
idle (host gap) per step. % of HBM = the bytes one MoE layer reads per step / its time /
4.3 TB/s: attention, router, shared expert, and the distinct routed experts the batch
touches, E * (1 - (1 - k/E)^B) of them (uniform routing: the dummy router is random).
Peer: HF transformers' DeepseekV3ForCausalLM (bf16 weights, experts unquantized: HF has no
NVFP4 path) at 2 and 3 layers, one decode step per forward with its KV cache; its slope is
one MoE layer. Load time per layer is reported too (dummy weights generated on the GPU).

Rank simulation (`--rank tpN[-ep]`). The same two engines and slopes, built with
`--simulate-rank tpN[-ep]` (moeserve/parallel/simulated.py): one GPU holds exactly rank 0's
share of the layout (heads / N, dense and shared-expert intermediate / N, vocabulary / N,
and E / N whole experts with EP) and runs no collective. With EP the routed experts receive
the busiest rank's expected load under uniform routing (slots and distinct experts, the
rule and its figures in simulated.py's docstring); the table shows the expectation and the
mean over the measured layers. The fused all-reduce + add + RMSNorm is replaced by a local
add + RMSNorm inside the profiler's all-reduce scope; its slope is taken out of the kernel
slope and the all-reduce is added back analytically (`allreduce_us`): per call, the fused
one-shot all-reduce measured on 2 H200s (4.70 / 5.12 / 7.34 us at 1 / 8 / 64 tokens,
benchmarks/results/allreduce.md), and for N GPUs an estimate, stated, not measured: 8 us at
one token on 8 GPUs (a one-shot all-reduce reads 7 peers instead of 1; 4 GPUs interpolated)
plus N - 1 times the 2-GPU growth with tokens (each rank pushes its partial to N - 1 peers
over the same NVLink bandwidth). Projection per decode step of a model of n layers:
  step = n x (rank MoE layer kernel time + 2 all-reduces) + non-layer part + 1 all-reduce
where the non-layer part is the kernel-time line's value at 0 layers without the stand-ins
(embedding, final norm, LM head, sampler), the extra all-reduce is the embedding's, and
the dense layers count as MoE layers (an upper bound: Kimi has 1, DeepSeek-V3 3). The LM
head's all-gather of logits runs as a local copy and is not modelled. Reported GPU-bound and
with the measured GPU idle per step (host gaps) added.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import git_commit

HERE = Path(__file__).resolve().parent
CONFIGS = {"kimi-k2.5-nvfp4": HERE / "configs/kimi-k2.5-nvfp4"}
OPTIONAL = {"deepseek-v3-fp8": HERE / "configs/deepseek-v3-fp8"}
MOE_LAYERS_APART = 4  # the two engines differ by this many MoE layers
BATCHES = (1, 8, 64)
PROMPT = 64
WARMUP_STEPS = 8
TIMED_STEPS = 48
HBM_BYTES_PER_S = 4.3e12
# batch-1 ms per MoE layer on one H200 before the fused decode step (commit 45ee28c,
# shared/PERF.md) and, for DeepSeek FP8, before the fused block-FP8 MoE (the eager per-expert loop)
BEFORE_MS_PER_LAYER = {"kimi-k2.5-nvfp4": 0.345, "deepseek-v3-fp8": 6.0}
TARGET_MS = 0.20
# fused one-shot all-reduce + residual add + RMSNorm per call on 2 H200s, lamport protocol, by
# tokens (benchmarks/results/allreduce.md); the 8-GPU one-token figure is an estimate
ALLREDUCE_2GPU_US = {1: 4.70, 8: 5.12, 64: 7.34}
ALLREDUCE_8GPU_US_ONE_TOKEN = 8.0


def _engine(path: Path, layers: int, profile_steps: int, tp: int = 1, ep: bool = False, **settings):
    """The benchmark's engine; `settings`: more engine settings (--set, e.g. page_size=64)."""
    from moeserve.engine.core import build_engine

    return build_engine(
        str(path),
        tensor_parallel_size=tp,
        enable_expert_parallel=ep,
        load_format="dummy",
        num_layers=layers,
        max_model_len=1024,
        max_num_seqs=max(BATCHES),
        max_num_batched_tokens=max(BATCHES) * PROMPT,
        cuda_graph_max_bs=max(BATCHES),
        profile_decode=profile_steps,
        **settings,
    )


def warm_single_request(path: Path, layers: int, warmup: int, more: int, **settings):
    """An engine decoding one greedy 64-token-prompt request, `warmup` steps in, with `more`
    steps left to take (`settings`: engine settings, e.g. simulate_rank)."""
    from moeserve.sampling import SamplingParams

    engine = _engine(path, layers, 0, **settings)
    params = SamplingParams(max_tokens=warmup + more + 8, temperature=0, ignore_eos=True)
    engine.add_request("r0", list(range(10, 10 + PROMPT)), params)
    for _ in range(warmup):
        engine.step()
    torch.cuda.synchronize()
    return engine


def _decode_ms(engine, batch: int) -> tuple[float, dict]:
    """Median wall ms per decode step of `batch` sequences, and the decode profile."""
    from moeserve.engine.profile import DecodeProfiler
    from moeserve.sampling import SamplingParams

    steps = WARMUP_STEPS + TIMED_STEPS + 2
    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(batch)
    for i in range(batch):
        ids = torch.randint(10, 500, (PROMPT,), generator=gen).tolist()
        engine.add_request(f"b{batch}-{i}", ids, params)
    while any(r.num_computed < r.num_tokens - 1 for r in engine.scheduler.running) or (
        engine.scheduler.waiting
    ):
        engine.step()  # prefill (chunked) until every sequence decodes
    for _ in range(WARMUP_STEPS):
        engine.step()
    engine.profiler = DecodeProfiler(TIMED_STEPS, engine.runner.device)
    times = []
    for _ in range(TIMED_STEPS + 1):  # the first only starts the profiler
        t0 = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t0) * 1000)
    prof = engine.profiler.result
    while engine.has_unfinished():
        engine.step()
    assert prof is not None, "the profiler did not finish (steps were not decode-only?)"
    return statistics.median(times[1:]), {
        "kernel_ms": prof.kernel_ms,
        "idle_ms": prof.idle_ms,
        "between_steps_ms": prof.between_ms,
        "kernels_per_step": prof.kernels_per_step,
        "kernels_per_layer": prof.kernels_per_layer,
        "components_ms": prof.components_ms,
        "table": prof.table(),
    }


def _host_profile(engine, steps: int = 48) -> str:
    """Where the host's time goes in batch-1 decode steps (cProfile, top functions)."""
    import cProfile
    import io
    import pstats

    from moeserve.sampling import SamplingParams

    params = SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)
    engine.add_request("host-profile", list(range(10, 10 + PROMPT)), params)
    for _ in range(4):
        engine.step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    while engine.has_unfinished():
        engine.step()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(30)
    return out.getvalue()


def _layer_byte_parts(engine) -> tuple[int, float, int]:
    """(bytes of a MoE layer besides its routed experts, bytes of one routed expert, routed
    experts held) on rank 0: its slice under tensor parallelism, its experts under EP.
    Shared experts held as bank slots (layers/moe.py) count with the rest: read every step."""
    layer = next(lay for lay in engine.runner.model.model.layers if hasattr(lay.mlp, "experts"))
    experts = layer.mlp.experts
    e = experts.layout.num_local
    bank = sum(p.numel() * p.element_size() for p in experts.parameters())
    expert_bytes = bank / experts.layout.num_slots
    rest = sum(p.numel() * p.element_size() for p in layer.parameters()) - expert_bytes * e
    return int(rest), expert_bytes, e


def _moe_layer_bytes(engine, batch: int) -> tuple[int, float]:
    """Bytes one MoE layer reads per step at `batch` on rank 0, and the distinct experts it
    touches (uniform routing)."""
    rest, expert_bytes, e = _layer_byte_parts(engine)
    cfg = engine.loaded.config
    touched = e * (1 - (1 - cfg.moe.num_experts_per_tok / cfg.moe.n_routed_experts) ** batch)
    sim = _routing_overrides(engine)
    if sim:  # a simulated EP rank: the busiest rank's expected distinct experts
        touched = sim[0].expected(batch).distinct
    return int(rest + touched * expert_bytes), touched


def _routing_overrides(engine) -> list:
    """The routing overrides of a simulated expert-parallel rank's MoE layers, in order
    (empty otherwise)."""
    layers = engine.runner.model.model.layers
    return [r for lay in layers if (r := getattr(lay.mlp, "routing_override", None))]


def _routing_rows(engine) -> dict:
    """Per batch: the busiest rank's expected slots and distinct experts, a rank's mean
    slots, and each MoE layer's (slots, distinct) as the simulation routes them."""
    sims = _routing_overrides(engine)
    out = {}
    for b in BATCHES:
        e = sims[0].expected(b)
        out[str(b)] = {
            "expected_slots": e.slots,
            "expected_distinct": e.distinct,
            "mean_slots": e.mean_slots,
            "layers": [list(r.counts(b)) for r in sims],
        }
    return out


def _text_config(path: Path) -> dict:
    with open(path / "config.json") as f:
        raw = json.load(f)
    return raw.get("text_config", raw)


def _first_dense(path: Path) -> int:
    return int(_text_config(path).get("first_k_dense_replace", 0))


def layer_counts(path: Path) -> tuple[int, int]:
    """(L, L + 4) with one MoE layer in the smaller model: Kimi (1 dense layer) 2 and 6,
    DeepSeek-V3 (3 dense layers) 4 and 8."""
    lo = _first_dense(path) + 1
    return lo, lo + MOE_LAYERS_APART


def bench_engine(
    name: str, path: Path, layers: int, tp: int = 1, ep: bool = False, **settings
) -> dict:
    """One engine of `layers` layers: decode ms per step and profile at each batch."""
    torch.cuda.empty_cache()
    t0 = time.perf_counter()
    engine = _engine(path, layers, 0, tp, ep, **settings)
    row = {
        "load_s": engine.loaded.load_seconds,  # the weights alone (graphs, compilation apart)
        "start_s": time.perf_counter() - t0,
        "graphs": engine.runner.graph_status,
        "batches": {},
    }
    if layers == layer_counts(path)[0] and tp == 1 and "simulate_rank" not in settings:
        row["host_profile"] = _host_profile(engine)
        print(row["host_profile"], flush=True)
    for b in BATCHES:
        ms, prof = _decode_ms(engine, b)
        row["batches"][str(b)] = {"ms_per_step": ms, **prof}
        print(f"{name} L={layers} B={b}: {ms:.3f} ms/step", flush=True)
        print(prof["table"], flush=True)
    row["moe_layer_bytes"] = {str(b): _moe_layer_bytes(engine, b) for b in BATCHES}
    row["bytes_parts"] = _layer_byte_parts(engine)[:2]  # (rest, one expert)
    if _routing_overrides(engine):
        row["routing"] = _routing_rows(engine)
    engine.shutdown()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return row


def _engine_in_subprocess(name: str, layers: int, tp: int, ep: bool) -> dict:
    """`bench_engine` in a fresh process: torch keeps a process's symmetric-memory
    rendezvous across process groups, so a second tensor-parallel engine in one process
    cannot set up its one-shot all-reduce."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        layout = f"tp{tp}" + ("-ep" if ep else "")
        cmd = [sys.executable, __file__, "--engine", f"{name}:{layout}:{layers}", "--out", str(out)]
        subprocess.run(cmd, check=True)
        return json.loads(out.read_text())


def bench_moeserve(
    name: str, path: Path, tp: int = 1, ep: bool = False, isolated: bool = False, **settings
) -> dict:
    out: dict = {"config": str(path.relative_to(HERE.parent)), "layers": {}, "tp": tp, "ep": ep}
    out["settings"] = settings
    LAYERS = layer_counts(path)  # noqa: N806 (a constant of this config)
    out["layer_counts"] = list(LAYERS)
    for layers in LAYERS:
        if isolated:
            out["layers"][str(layers)] = _engine_in_subprocess(name, layers, tp, ep)
        else:
            out["layers"][str(layers)] = bench_engine(name, path, layers, tp, ep, **settings)
    return summarize(out)


def summarize(out: dict) -> dict:
    """Per MoE layer from the two engines' rows: the wall-step slope (what a client sees,
    host work included) and the GPU kernel-time slope (the device alone; on a host whose
    step overhead varies run to run, the steadier of the two)."""
    layers = tuple(out["layer_counts"])
    apart = layers[1] - layers[0]
    row_of = {n: out["layers"][str(n)] for n in layers}
    lo, hi = (row_of[n] for n in layers)
    out["per_layer"] = {}
    for key in lo["batches"]:
        blo, bhi = lo["batches"][key], hi["batches"][key]
        ms = (bhi["ms_per_step"] - blo["ms_per_step"]) / apart
        gpu_ms = (bhi["kernel_ms"] - blo["kernel_ms"]) / apart
        nbytes, touched = lo["moe_layer_bytes"][key]
        limit_ms = nbytes / HBM_BYTES_PER_S * 1000
        kpl = bhi["kernels_per_layer"]
        moe_layers = [v for k, v in kpl.items() if int(k) >= layers[0] - 1]
        ar = [b["components_ms"].get("all-reduce", 0.0) for b in (blo, bhi)]
        out["per_layer"][key] = {
            "ms": ms,
            "gpu_ms": gpu_ms,
            "all_reduce_ms": (ar[1] - ar[0]) / apart,
            "step_ms": {str(n): row_of[n]["batches"][key]["ms_per_step"] for n in layers},
            "gpu_step_ms": {str(n): row_of[n]["batches"][key]["kernel_ms"] for n in layers},
            "bytes": nbytes,
            "experts_touched": touched,
            "limit_ms": limit_ms,
            "pct_hbm": 100 * limit_ms / ms if ms > 0 else 0.0,
            "pct_hbm_gpu": 100 * limit_ms / gpu_ms if gpu_ms > 0 else 0.0,
            "kernels_per_layer": statistics.median(moe_layers) if moe_layers else None,
            "idle_ms_per_step": bhi["idle_ms"],
            "idle_between_steps_ms": bhi["between_steps_ms"],
        }
    out["load_s_per_layer"] = (hi["load_s"] - lo["load_s"]) / apart
    return out


def bench_hf(path: Path) -> dict:
    """HF transformers' DeepseekV3 (bf16, experts unquantized) at 2 and 3 layers."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    with open(path / "config.json") as f:
        raw = json.load(f)
    text = raw.get("text_config", raw)
    skip = ("quantization_config", "architectures", "model_type", "auto_map")
    out: dict = {"layers": {}}
    print(f"HF: {torch.cuda.memory_allocated() / 2**30:.1f} GiB still allocated", flush=True)
    for layers in (2, 3, 2):  # the first run warms the GPU and libraries up: the last counts
        cfg = DeepseekV3Config(**{k: v for k, v in text.items() if k not in skip})
        cfg.num_hidden_layers = layers
        cfg._attn_implementation = "sdpa"
        torch.cuda.empty_cache()
        torch.set_default_dtype(torch.bfloat16)  # built in bf16: fp32 would not fit
        try:
            with torch.device("cuda"):
                model = DeepseekV3ForCausalLM(cfg).eval()
        finally:
            torch.set_default_dtype(torch.float32)
        res = {}
        for b in BATCHES:
            ids = torch.randint(10, 500, (b, PROMPT), device="cuda")
            with torch.inference_mode():
                o = model(ids, use_cache=True)
                past = o.past_key_values
                nxt = o.logits[:, -1:].argmax(-1)
                times = []
                for i in range(2 * WARMUP_STEPS + 16):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    o = model(nxt, past_key_values=past, use_cache=True)
                    nxt = o.logits[:, -1:].argmax(-1)
                    torch.cuda.synchronize()
                    if i >= 2 * WARMUP_STEPS:
                        times.append((time.perf_counter() - t0) * 1000)
                    past = o.past_key_values
            res[str(b)] = statistics.median(times)
            print(f"HF L={layers} B={b}: {res[str(b)]:.3f} ms/step", flush=True)
        out["layers"][str(layers)] = res
        del model
        gc.collect()
        torch.cuda.empty_cache()
    out["per_layer_ms"] = {
        str(b): out["layers"]["3"][str(b)] - out["layers"]["2"][str(b)] for b in BATCHES
    }
    return out


def _versions(commit: str | None) -> dict:
    import transformers
    import triton

    return {
        "commit": git_commit(commit),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }


def write_markdown(res: dict, path: Path) -> None:
    v = res["versions"]
    lines = [
        "# Decode time per full-size MoE layer (one GPU)",
        "",
        f"commit {v['commit']}, {v['gpu']}, torch {v['torch']}, triton {v['triton']}, "
        f"transformers {v['transformers']}. Method: benchmarks/decode_layer.py docstring "
        "(slope of L=d+5 vs L=d+1 steps, d dense layers; HF peer slope of 3 vs 2 layers)."
        + (f" Engine settings: {v['settings']}." if v.get("settings") else ""),
        "",
    ]
    for name, r in res["moeserve"].items():
        lines += [
            f"## {name}",
            "",
            "| batch | ms per MoE layer | limit (bytes / 4.3 TB/s) | % of HBM | kernels per "
            "layer | GPU idle per step (between steps) | HF transformers per layer | target |",
            "|---|---|---|---|---|---|---|---|",
        ]
        hf = res.get("hf", {}).get(name, {}).get("per_layer_ms", {})
        for b, p in r["per_layer"].items():
            target = f"<= {TARGET_MS} ms" if b == "1" else ""
            peer = f"{hf[b]:.3f} ms" if b in hf else "n/a"
            lines.append(
                f"| {b} | {p['ms']:.3f} ms | {p['limit_ms']:.3f} ms ({p['bytes'] / 1e6:.0f} MB, "
                f"{p['experts_touched']:.0f} experts) | {p['pct_hbm']:.0f}% | "
                f"{p['kernels_per_layer']} | {p['idle_ms_per_step'] * 1000:.0f} us "
                f"({(p.get('idle_between_steps_ms') or 0) * 1000:.0f} us) | {peer} | "
                f"{target} |"
            )
        lines += [
            "",
            f"Before (batch 1): {BEFORE_MS_PER_LAYER.get(name, float('nan'))} ms per MoE "
            f"layer. Dummy load: {r['load_s_per_layer']:.1f} s per full-size layer "
            "(target <= 5 s).",
            "",
        ]
    path.write_text("\n".join(lines) + "\n")


def _layout(name: str, flag: str = "--parallel") -> tuple[int, bool]:
    """ "tp2-ep" -> (2, True)."""
    tp, _, ep = name.partition("-")
    if not tp.startswith("tp") or not tp[2:].isdigit() or ep not in ("", "ep"):
        raise SystemExit(f"{flag}: {name!r} is not tpN or tpN-ep")
    return int(tp[2:]), ep == "ep"


def _split_bytes(runs: dict) -> tuple[float, float, float]:
    """(replicated, sharded at TP1, one expert) bytes of a MoE layer from the TP1 and TP2+EP
    runs: rest(tp) = R + S / tp, so the two measurements give R and S."""
    (b1, expert), (b2, _) = (
        runs[k]["layers"][str(runs[k]["layer_counts"][0])]["bytes_parts"] for k in ("tp1", "tp2-ep")
    )
    sharded = 2 * (b1 - b2)
    return b1 - sharded, sharded, expert


def project_tp8(runs: dict, total_layers: int = 61, ranks: int = 8) -> dict:
    """Per-layer GPU time and tok/s of the whole model on `ranks` GPUs (TP + EP) at each
    batch. A layer's GPU time without its all-reduce is fitted as fixed + bytes / speed
    through the TP1 and TP2+EP measurements (two points, the same kernels: what does not
    shrink with bytes read, launch and latency floors, stays); the all-reduce keeps its
    measured 2-GPU cost (an assumption: a one-shot all-reduce on 8 GPUs reads 7 peers)."""
    one, two = runs["tp1"], runs["tp2-ep"]
    replicated, sharded, expert = _split_bytes(runs)
    lo = min(int(n) for n in two["layers"])
    out = {}
    for b, p2 in two["per_layer"].items():
        p1 = one["per_layer"][b]
        t1, t2 = p1["gpu_ms"], p2["gpu_ms"] - p2["all_reduce_ms"]
        per_byte = max((t1 - t2) / (p1["bytes"] - p2["bytes"]), 1000 / HBM_BYTES_PER_S)
        fixed = max(t1 - per_byte * p1["bytes"], 0.0)
        nbytes = replicated + sharded / ranks + p1["experts_touched"] / ranks * expert
        layer = fixed + per_byte * nbytes + p2["all_reduce_ms"]
        idle = min(p2["step_ms"][n] - p2["gpu_step_ms"][n] for n in p2["step_ms"])
        step = p2["gpu_step_ms"][str(lo)] + (total_layers - lo) * layer + max(idle, 0.0)
        out[b] = {
            "layer_ms": layer,
            "fixed_ms": fixed,
            "gbps": 1 / per_byte / 1e6,
            "bytes": nbytes,
            "host_ms": max(idle, 0.0),
            "step_ms": step,
            "tok_s": int(b) * 1000 / step,
        }
    return out


def write_parallel_markdown(res: dict, path: Path) -> None:
    v = res["versions"]
    runs = res["moeserve"]
    lines = [
        "# Decode per full-size Kimi-K2.5 NVFP4 MoE layer: 1 GPU vs tensor / expert parallel",
        "",
        f"commit {v['commit']}, {v['gpus']} x {v['gpu']}, torch {v['torch']}, triton "
        f"{v['triton']}; all-reduce: {v.get('all_reduce', 'the default')}. Method: "
        "benchmarks/decode_layer.py docstring, every layout in the same run, each engine in "
        "its own process (slope of L=6 vs L=2 engine steps, CUDA graphs, dummy weights in the "
        "serving format). GPU ms = slope of the kernel time per step (decode profiler); wall "
        "ms = slope of the engine step time, host work included (noisy on this host: its "
        "step overhead varied 0.05-1.3 ms between engines). All-reduce = the profiler's "
        "all-reduce kernels per layer (two per layer); bytes and % of HBM per GPU (rank 0).",
        "",
        "| layout | batch | GPU ms per MoE layer | wall ms per MoE layer | all-reduce per layer "
        "(share of GPU ms) | bytes per GPU | % of HBM (GPU ms) | decode tok/s at L=6 (wall) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        hi = str(max(int(n) for n in r["layers"]))
        for b, p in r["per_layer"].items():
            share = 100 * p["all_reduce_ms"] / p["gpu_ms"] if p["gpu_ms"] > 0 else 0.0
            lines.append(
                f"| {name} | {b} | {p['gpu_ms']:.3f} | {p['ms']:.3f} | "
                f"{p['all_reduce_ms'] * 1000:.1f} us ({share:.0f}%) | {p['bytes'] / 1e6:.0f} MB "
                f"| {p['pct_hbm_gpu']:.0f}% | {int(b) * 1000 / p['step_ms'][hi]:.0f} |"
            )
    proj = res.get("projection_tp8")
    if proj:
        doc = " ".join(project_tp8.__doc__.split())
        lines += [
            "",
            "## Projection: 61 layers on 8 GPUs (TP8 + EP)",
            "",
            doc + " Bytes per GPU at 8: the replicated part of a layer, its sharded part / 8 "
            "and 1/8 of the distinct experts (replicated and sharded parts solved from the "
            "TP1 and TP2+EP layer sizes). Step = the TP2+EP GPU step at L=2 + 59 projected MoE "
            "layers + the smallest host overhead per step measured for TP2+EP.",
            "",
            "| batch | fixed ms per layer | fitted GB/s | bytes per GPU | ms per MoE layer | "
            "host ms per step | step (61 layers) | tok/s | target |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for b, p in proj.items():
            target = ">= 500 tok/s (PERF.md)" if b == "1" else ""
            lines.append(
                f"| {b} | {p['fixed_ms']:.3f} | {p['gbps']:.0f} | {p['bytes'] / 1e6:.0f} MB | "
                f"{p['layer_ms']:.3f} | {p['host_ms']:.3f} | {p['step_ms']:.2f} ms | "
                f"{p['tok_s']:.0f} | {target} |"
            )
    path.write_text("\n".join(lines) + "\n")


def finish_parallel(res: dict, out: Path) -> None:
    """Per-layer figures, the projection, JSON and markdown from the engines' rows."""
    for run in res["moeserve"].values():
        summarize(run)
    if {"tp1", "tp2-ep"} <= set(res["moeserve"]):
        res["projection_tp8"] = project_tp8(res["moeserve"])
    (out / "decode_layer_parallel.json").write_text(json.dumps(res, indent=1))
    write_parallel_markdown(res, out / "decode_layer_parallel.md")
    print((out / "decode_layer_parallel.md").read_text())


def main_parallel(layouts: list[str], out: Path, commit: str | None) -> None:
    path = CONFIGS["kimi-k2.5-nvfp4"]
    from moeserve.parallel.comm import DEFAULT_PROTOCOL

    versions = {**_versions(commit), "gpus": torch.cuda.device_count()}
    versions["all_reduce"] = f"auto (one-shot {DEFAULT_PROTOCOL} protocol up to 1 MiB)"
    res: dict = {"versions": versions, "moeserve": {}}
    for name in layouts:
        tp, ep = _layout(name)
        res["moeserve"][name] = bench_moeserve("kimi-k2.5-nvfp4", path, tp, ep, isolated=True)
        (out / "decode_layer_parallel.json").write_text(json.dumps(res, indent=1))
    finish_parallel(res, out)


# ---- rank simulation -------------------------------------------------------------------------
def _per_tokens(table: dict[int, float], tokens: int) -> float:
    """`table` (tokens -> value) at `tokens`: linear between its points, and beyond its last
    two."""
    xs = sorted(table)
    i = min(max(1, sum(x < tokens for x in xs)), len(xs) - 1)
    x0, x1 = xs[i - 1], xs[i]
    return table[x0] + (table[x1] - table[x0]) * (tokens - x0) / (x1 - x0)


def allreduce_us(tokens: int, ranks: int) -> float:
    """Fused all-reduce + residual add + RMSNorm per call for `tokens` rows of a `ranks`-GPU
    group: measured on 2 GPUs; for more, the one-token latency estimated (8 us on 8 GPUs,
    linear in the peers between) plus ranks - 1 times the 2-GPU growth with tokens (module
    docstring)."""
    two = _per_tokens(ALLREDUCE_2GPU_US, tokens)
    if ranks <= 2:
        return two
    one = ALLREDUCE_2GPU_US[1]
    latency = one + (ALLREDUCE_8GPU_US_ONE_TOKEN - one) * (ranks - 2) / 6
    return latency + (ranks - 1) * (two - one)


def project_rank(run: dict, ranks: int, total_layers: int) -> dict:
    """Per batch, for the all-reduce measured on 2 GPUs and estimated for `ranks`: the rank's
    MoE layer with its two all-reduces, and the decode step of `total_layers` layers (module
    docstring), GPU-bound and with the measured GPU idle per step."""
    lo, hi = run["layer_counts"]
    out = {}
    for b, p in run["per_layer"].items():
        stand_in = p["all_reduce_ms"]
        layer_ms = p["gpu_ms"] - stand_in
        row_lo = run["layers"][str(lo)]["batches"][b]
        non_layer = row_lo["kernel_ms"] - row_lo["components_ms"].get("all-reduce", 0.0)
        non_layer -= lo * layer_ms
        idle = min(run["layers"][str(n)]["batches"][b]["idle_ms"] for n in (lo, hi))
        variants = {}
        kinds = {"2-GPU measured": 2, f"{ranks}-GPU estimate": ranks} if ranks > 2 else {}
        for name, group in (kinds or {"2-GPU measured": 2}).items():
            ar = allreduce_us(int(b), group) / 1000
            layer = layer_ms + 2 * ar
            step = total_layers * layer + non_layer + ar
            variants[name] = {
                "allreduce_us": ar * 1000,
                "layer_ms": layer,
                "step_ms": step,
                "step_host_ms": step + idle,
                "tok_s": int(b) * 1000 / step,
                "tok_s_host": int(b) * 1000 / (step + idle),
            }
        out[b] = {
            "rank_layer_ms": layer_ms,
            "stand_in_ms": stand_in,
            "non_layer_ms": non_layer,
            "idle_ms": idle,
            "allreduce": variants,
        }
    return out


def _measured_slots(run: dict, b: str) -> tuple[float, float] | None:
    """Mean (slots, distinct experts) of the MoE layers the slope measures (the larger
    engine's layers beyond the smaller one's), None without simulated routing."""
    lo, hi = run["layer_counts"]
    rows = [run["layers"][str(n)].get("routing") for n in (lo, hi)]
    if rows[1] is None:
        return None
    counts = rows[1][b]["layers"][len(rows[0][b]["layers"]) :]
    return tuple(statistics.mean(c[i] for c in counts) for i in (0, 1))


def write_rank_markdown(res: dict, path: Path) -> None:
    v = res["versions"]
    layout = res["rank_layout"]
    ranks, ep = _layout(layout)
    lines = [
        f"# Decode per MoE layer of one simulated rank: rank 0 of {layout.upper()} on one GPU",
        "",
        f"commit {v['commit']}, {v['gpu']}, torch {v['torch']}, triton {v['triton']}. Method: "
        "benchmarks/decode_layer.py docstring (rank simulation: `--simulate-rank "
        f"{layout}`, slope of L=d+5 vs L=d+1 engines, CUDA graphs, dummy weights in the serving "
        "format). Kernel us = slope of the decode profiler's kernel time per step; stand-in = "
        "the local add + RMSNorm run in place of the fused all-reduce (two per layer), taken "
        "out of the rank's layer time; wall = slope of the engine step time."
        + (f" Engine settings: {v['settings']}." if v.get("settings") else ""),
        "",
    ]
    for name, run in res["moeserve"].items():
        total = res["total_layers"][name]
        lines += [
            f"## {name}",
            "",
            "| batch | routed slots on rank 0: busiest rank expected (measured layers; a rank's "
            "mean) | distinct experts | kernel us per MoE layer | stand-in us | rank layer us "
            "without it | wall us | bytes | % of HBM | kernels per layer |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        routing = run["layers"][str(run["layer_counts"][0])].get("routing")
        for b, p in run["per_layer"].items():
            proj = res["projection"][name][b]
            if routing is not None:
                r = routing[b]
                m = _measured_slots(run, b)
                slots = f"{r['expected_slots']:.2f} ({m[0]:.2f}; {r['mean_slots']:.0f})"
                distinct = f"{r['expected_distinct']:.2f} ({m[1]:.2f})"
            else:
                slots = distinct = "all experts' slices (TP)"
            lines.append(
                f"| {b} | {slots} | {distinct} | {p['gpu_ms'] * 1000:.1f} | "
                f"{proj['stand_in_ms'] * 1000:.1f} | {proj['rank_layer_ms'] * 1000:.1f} | "
                f"{p['ms'] * 1000:.1f} | {p['bytes'] / 1e6:.0f} MB | {p['pct_hbm_gpu']:.0f}% | "
                f"{p['kernels_per_layer']} |"
            )
        lines += [
            "",
            f"### Projection: {total} layers on {ranks} GPUs ({layout.upper()})",
            "",
            f"step = {total} x (rank layer + 2 all-reduces) + non-layer part + 1 all-reduce "
            "(the embedding's); the dense layers counted as MoE layers; the LM head's "
            "all-gather not modelled. All-reduce per call: measured on 2 H200s, or the "
            f"{ranks}-GPU estimate (docstring: {ALLREDUCE_8GPU_US_ONE_TOKEN} us at one token on 8 "
            "GPUs, stated, not measured).",
            "",
            "| batch | all-reduce | us per call | MoE layer + 2 all-reduces (us) | non-layer ms "
            "| step ms (GPU) | tok/s | GPU idle per step ms | step ms with it | tok/s with it |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for b, proj in res["projection"][name].items():
            for kind, q in proj["allreduce"].items():
                lines.append(
                    f"| {b} | {kind} | {q['allreduce_us']:.2f} | {q['layer_ms'] * 1000:.1f} | "
                    f"{proj['non_layer_ms']:.3f} | {q['step_ms']:.3f} | {q['tok_s']:.0f} | "
                    f"{proj['idle_ms']:.3f} | {q['step_host_ms']:.3f} | {q['tok_s_host']:.0f} |"
                )
        lines.append("")
    if ep:
        lines += [
            "Routing: with expert parallelism each MoE layer routes every token to m of rank 0's "
            "experts (the rest of its k slots to other ranks' experts, which the fused kernel "
            "skips), the layer's slots adding up to the busiest of the ranks' expected load "
            "(moeserve/parallel/simulated.py).",
            "",
        ]
    path.write_text("\n".join(lines) + "\n")


def finish_rank(res: dict, out: Path) -> None:
    """Per-layer figures, the projection, JSON and markdown of a rank-simulation run."""
    ranks, _ = _layout(res["rank_layout"])
    res["projection"] = {}
    for name, run in res["moeserve"].items():
        summarize(run)
        res["projection"][name] = project_rank(run, ranks, res["total_layers"][name])
    (out / "decode_layer_rank.json").write_text(json.dumps(res, indent=1))
    write_rank_markdown(res, out / "decode_layer_rank.md")
    print((out / "decode_layer_rank.md").read_text())


def main_rank(layout: str, configs: dict, out: Path, commit: str | None, settings: dict) -> None:
    """Each config's two engines as rank 0 of `layout`, in this process (one GPU)."""
    res: dict = {
        "versions": {**_versions(commit), "settings": settings},
        "rank_layout": layout,
        "allreduce_2gpu_us": ALLREDUCE_2GPU_US,
        "allreduce_8gpu_us_one_token": ALLREDUCE_8GPU_US_ONE_TOKEN,
        "total_layers": {},
        "moeserve": {},
    }
    for name, path in configs.items():
        res["total_layers"][name] = int(_text_config(path)["num_hidden_layers"])
        res["moeserve"][name] = bench_moeserve(name, path, simulate_rank=layout, **settings)
        (out / "decode_layer_rank.json").write_text(json.dumps(res, indent=1))
    finish_rank(res, out)


def _setting(kv: str) -> tuple[str, object]:
    """KEY=VALUE -> (key, bool, int or str value)."""
    key, _, value = kv.partition("=")
    if value.lower() in ("true", "false"):
        return key, value.lower() == "true"
    return key, int(value) if value.lstrip("-").isdigit() else value


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--deepseek", action="store_true", help="also the DeepSeek-V3 FP8 config")
    ap.add_argument("--only", default=None, help="run this one config (a name of CONFIGS)")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an engine setting for the moeserve engines (e.g. page_size=64, "
        "mla_decode_kernel=triton); repeatable; recorded in the JSON",
    )
    ap.add_argument(
        "--parallel",
        default=None,
        help="Kimi only, these layouts in one run (e.g. tp1,tp2,tp2-ep): "
        "decode_layer_parallel.{json,md} with the projection to 61 layers on 8 GPUs",
    )
    ap.add_argument(
        "--rank",
        default=None,
        metavar="tpN[-ep]",
        help="one GPU as rank 0 of this layout (--simulate-rank, e.g. tp8-ep): "
        "decode_layer_rank.{json,md} with the projection of the whole model on N GPUs",
    )
    ap.add_argument("--engine", default=None, help=argparse.SUPPRESS)  # NAME:LAYOUT:LAYERS
    ap.add_argument(
        "--summarize",
        default=None,
        help="recompute decode_layer_parallel.{json,md} (or decode_layer_rank.{json,md}) in "
        "--out from this recorded JSON",
    )
    args = ap.parse_args()
    if args.summarize:
        recorded = json.loads(Path(args.summarize).read_text())
        finish = finish_rank if "rank_layout" in recorded else finish_parallel
        finish(recorded, Path(args.out))
        return
    if args.engine:  # one engine for a parent run: its row as JSON at --out
        name, layout, layers = args.engine.split(":")
        tp, ep = _layout(layout)
        row = bench_engine(f"{name} {layout}", {**CONFIGS, **OPTIONAL}[name], int(layers), tp, ep)
        Path(args.out).write_text(json.dumps(row))
        return
    os.makedirs(args.out, exist_ok=True)
    if args.parallel:
        main_parallel(args.parallel.split(","), Path(args.out), args.commit)
        return
    configs = dict(CONFIGS, **(OPTIONAL if args.deepseek or args.only else {}))
    if args.only:
        configs = {args.only: {**CONFIGS, **OPTIONAL}[args.only]}
    settings = dict(_setting(kv) for kv in args.set)
    if args.rank:
        _layout(args.rank, "--rank")
        main_rank(args.rank, configs, Path(args.out), args.commit, settings)
        return
    res: dict = {"versions": _versions(args.commit), "moeserve": {}, "hf": {}}
    res["versions"]["settings"] = settings
    for name, path in configs.items():
        res["moeserve"][name] = bench_moeserve(name, path, **settings)
        json_path = Path(args.out) / "decode_layer.json"
        json_path.write_text(json.dumps(res, indent=1))
    if not args.no_hf:
        res["hf"]["kimi-k2.5-nvfp4"] = bench_hf(CONFIGS["kimi-k2.5-nvfp4"])
    Path(args.out, "decode_layer.json").write_text(json.dumps(res, indent=1))
    write_markdown(res, Path(args.out) / "decode_layer.md")
    print((Path(args.out) / "decode_layer.md").read_text())


if __name__ == "__main__":
    main()
