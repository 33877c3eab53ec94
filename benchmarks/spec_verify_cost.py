"""What verifying a draft costs: step time for q = 1, 2, 4, 8 query tokens per sequence
(q - 1 draft tokens), at batch 1 and 8, per full-size Kimi-K2.5 NVFP4 MoE layer and per MoE
layer of one TP8+EP rank's share, against a batch of q one-token sequences; then the
projected batch-1 speed-up of speculative decoding at TP8 for acceptance lengths 1.5, 2.0
and 2.9.

Run on the GPU machine from the repository root:
  PYTHONPATH=$PWD python benchmarks/spec_verify_cost.py --out benchmarks/results [--commit SHA]

Method. Engines with dummy weights in the serving format (`--load-format dummy`) at L = 2
and 6 layers (one dense layer first): the slope (t6 - t2) / 4 is one MoE layer. B requests
(64-token prompts) are prefilled; then every decode step verifies q - 1 draft tokens per
sequence from a proposer that always drafts that many (a benchmark mode: with random weights
the drafts are rejected, so each step emits one token per sequence; the step's cost is what is
measured, not acceptance). The engine enters a sequence's q tokens as q one-token rows
sharing its page-table row, so the step is a decode step of B*q rows, replayed from a CUDA
graph. Reported per MoE layer: kernel time (the decode profiler's kernel time per step;
the 2-layer step is host-bound, so its wall time hides GPU work) and wall time.
Rank share: one GPU holds exactly rank 0's share of a TP8 + EP deployment
(`--simulate-rank tp8-ep`, moeserve/parallel/simulated.py): 64 / 8 heads, 384 / 8 whole
routed experts, the dense and shared-expert intermediate / 8, the vocabulary / 8. Each MoE
layer gives rank 0's experts the busiest rank's expected share of a step's rows' slots
under uniform routing (2.58 slots for one row, 7.0 for 4, 12.2 for 8: the rule in
simulated.py), and the collectives are skipped: their local stand-in (the add + RMSNorm of
the fused all-reduce, in the profiler's all-reduce row) is taken out of the kernel time,
and the projection adds the all-reduce.
Projection: a 61-layer TP8 step at q tokens costs 61 x (rank MoE layer kernel time at q +
2 all-reduces); with acceptance length a (tokens per verify step, draft of q - 1 = 3) the
speed-up over plain decoding is a x t(1) / t(q). All-reduce: 4.7 us one-shot on 2 H200s
(benchmarks/results/allreduce.md); 8 GPUs are estimated at 8 us (stated, not measured).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from common import gpu_meta

HERE = Path(__file__).resolve().parent
KIMI = HERE / "configs/kimi-k2.5-nvfp4"
QUERY_TOKENS = (1, 2, 4, 8)
BATCHES = (1, 8)
PROMPT = 64
WARMUP_STEPS = 6
TIMED_STEPS = 24
LAYERS = (2, 6)
MOE_LAYERS_APART = 4
TOTAL_LAYERS = 61
ALLREDUCE_US_8GPU = 8.0  # estimate; 4.7 us measured on 2 GPUs
ACCEPTANCE_LENGTHS = (1.5, 2.0, 2.9)
TP = 8


class FixedDraft:
    """Benchmark proposer: always `k` draft tokens (fixed ids), whatever the sequence."""

    def __init__(self, k: int) -> None:
        self.k = k

    def start(self, request_id, prompt_ids) -> None:
        pass

    def extend(self, request_id, new_ids) -> None:
        pass

    def propose(self, request_id, max_tokens: int) -> list[int]:
        return [11 + i for i in range(min(self.k, max_tokens))]

    def finish(self, request_id) -> None:
        pass


def _engine(path: Path, layers: int, q: int, simulate_rank: str | None = None):
    """`simulate_rank`: rank 0's share of that layout on this GPU (None: the whole model)."""
    from moeserve.engine.core import build_engine

    eng = build_engine(
        str(path),
        load_format="dummy",
        num_layers=layers,
        max_model_len=1024,
        max_num_seqs=64,
        max_num_batched_tokens=max(BATCHES) * PROMPT,
        cuda_graph_max_bs=64,
        speculative_config={"method": "ngram", "num_speculative_tokens": 7, "adaptive": False},
        simulate_rank=simulate_rank,
    )
    return eng


def _step_ms(eng, batch: int, q: int) -> tuple[float, float]:
    """(median wall ms, kernel ms) per step of `batch` sequences verifying q - 1 drafts; the
    kernel time without a simulated rank's all-reduce stand-in (0 for the whole model)."""
    from moeserve.engine.profile import DecodeProfiler
    from moeserve.sampling import SamplingParams

    eng.proposer = FixedDraft(q - 1)
    steps = WARMUP_STEPS + TIMED_STEPS + 2
    params = SamplingParams(max_tokens=steps * 8 + 8, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(batch)
    for i in range(batch):
        ids = torch.randint(10, 500, (PROMPT,), generator=gen).tolist()
        eng.add_request(f"q{q}-b{batch}-{i}", ids, params)
    while eng.scheduler.waiting or any(
        r.num_computed < r.num_tokens - 1 for r in eng.scheduler.running
    ):
        eng.step()
    for _ in range(WARMUP_STEPS):
        eng.step()
    eng.profiler = DecodeProfiler(TIMED_STEPS, eng.runner.device)
    times = []
    for _ in range(TIMED_STEPS + 1):
        t0 = time.perf_counter()
        eng.step()
        times.append((time.perf_counter() - t0) * 1000)
    prof = eng.profiler.result
    eng.profiler = None
    for rid in list(eng.live):
        eng.abort(rid)
    assert prof is not None, "the profiler did not finish (steps were not decode-only?)"
    stand_in = prof.components_ms.get("all-reduce", 0.0)
    return statistics.median(times[1:]), prof.kernel_ms - stand_in


def measure(path: Path, simulate_rank: str | None = None) -> dict:
    per_layers: dict[int, dict] = {}
    for layers in LAYERS:
        eng = _engine(path, layers, max(QUERY_TOKENS), simulate_rank)
        res = {}
        for b in BATCHES:
            for q in QUERY_TOKENS:
                res[f"{b}x{q}"] = _step_ms(eng, b, q)
        for b in QUERY_TOKENS[1:-1]:  # batches of one-token sequences: what q is held against
            res[f"{b}x1"] = _step_ms(eng, b, 1)
        per_layers[layers] = res
        eng.shutdown()
        del eng
        torch.cuda.empty_cache()
    out = {}
    for key in per_layers[LAYERS[0]]:
        (w2, k2), (w6, k6) = per_layers[LAYERS[0]][key], per_layers[LAYERS[1]][key]
        out[key] = {
            "wall_us_per_moe_layer": (w6 - w2) / MOE_LAYERS_APART * 1000,
            "kernel_us_per_moe_layer": (k6 - k2) / MOE_LAYERS_APART * 1000,
            "step_ms": {str(layers): per_layers[layers][key] for layers in LAYERS},
        }
    return out


def project(rank: dict) -> dict:
    """Batch-1 TP8 speed-up for each acceptance length, drafts of 3 (q = 4)."""
    t1 = TOTAL_LAYERS * (rank["1x1"]["kernel_us_per_moe_layer"] + 2 * ALLREDUCE_US_8GPU)
    t4 = TOTAL_LAYERS * (rank["1x4"]["kernel_us_per_moe_layer"] + 2 * ALLREDUCE_US_8GPU)
    return {
        "step_us_q1": t1,
        "step_us_q4": t4,
        "verify_cost_ratio_q4": t4 / t1,
        "plain_tok_s": 1e6 / t1,
        "speedup": {str(a): a * t1 / t4 for a in ACCEPTANCE_LENGTHS},
        "tok_s": {str(a): a * 1e6 / t4 for a in ACCEPTANCE_LENGTHS},
    }


def write_markdown(res: dict, path: Path) -> None:
    v = res["versions"]
    lines = [
        "# Verify cost of speculative decoding (Kimi-K2.5 NVFP4, dummy weights)",
        "",
        f"commit {v['commit']}, {v['gpu']}, torch {v['torch']}, triton {v['triton']}. "
        "Method: benchmarks/spec_verify_cost.py (docstring). Kernel time per MoE layer (slope of "
        "6 vs 2 layers); a step of B sequences with q tokens each is a decode step of B x q "
        "one-token rows sharing page-table rows, replayed from a CUDA graph. Target: verifying "
        "q tokens of one sequence costs no more than a batch of q one-token sequences.",
        "",
    ]
    for name in ("full-size", "tp8-ep rank"):
        r = res["layers"][name]
        lines += [f"## {name}: us per MoE layer (kernel / wall)", ""]
        lines += ["| batch | q=1 | q=2 | q=4 | q=8 |", "|---|---|---|---|---|"]
        for b in BATCHES:
            cells = [
                f"{r[f'{b}x{q}']['kernel_us_per_moe_layer']:.1f} / "
                f"{r[f'{b}x{q}']['wall_us_per_moe_layer']:.1f}"
                for q in QUERY_TOKENS
            ]
            lines.append(f"| {b} | " + " | ".join(cells) + " |")
        lines.append("")
        ref = [f"{q}: {r[f'{q}x1']['kernel_us_per_moe_layer']:.1f}" for q in QUERY_TOKENS[1:]]
        lines += [
            "Batches of q one-token sequences, kernel us per MoE layer (what batch-1 verifying "
            f"of q tokens is held against): {', '.join(ref)}.",
            "",
        ]
    p = res["projection"]
    lines += [
        "## Projected batch-1 speed-up at TP8 (61 layers, draft of 3: q = 4)",
        "",
        f"Step: {p['step_us_q1']:.0f} us at q = 1 ({p['plain_tok_s']:.0f} tok/s), "
        f"{p['step_us_q4']:.0f} us at q = 4 ({p['verify_cost_ratio_q4']:.2f}x); all-reduce "
        f"{ALLREDUCE_US_8GPU} us per call on 8 GPUs (estimate). Target >= 1.6x at 2.9.",
        "",
        "| acceptance length | tok/s | speed-up |",
        "|---|---|---|",
    ]
    for a in ACCEPTANCE_LENGTHS:
        lines.append(f"| {a} | {p['tok_s'][str(a)]:.0f} | {p['speedup'][str(a)]:.2f}x |")
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    layers = {"full-size": measure(KIMI), "tp8-ep rank": measure(KIMI, f"tp{TP}-ep")}
    res = {
        "versions": gpu_meta(args.commit),
        "layers": layers,
        "projection": project(layers["tp8-ep rank"]),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec_verify_cost.json").write_text(json.dumps(res, indent=1))
    write_markdown(res, out / "spec_verify_cost.md")
    print((out / "spec_verify_cost.md").read_text())


if __name__ == "__main__":
    main()
