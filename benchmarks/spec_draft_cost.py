"""What drafting with DeepSeek-V3's MTP layer costs next to the target step, at published
dimensions (DeepSeek-V3 block-FP8, dummy weights), batch 1 and 8.

Run on the GPU machine from the repository root:
  PYTHONPATH=$PWD python benchmarks/spec_draft_cost.py --out benchmarks/results [--commit SHA]

Method. An engine with `--load-format dummy --num-layers 2` (one dense layer, one MoE layer)
plus the checkpoint's MTP layer, `--speculative-config '{"method": "mtp",
"num_speculative_tokens": K}'` for K = 1 and 3. B requests (64-token prompts) decode; each
step's draft work (the MTP layer catching up on the step's positions, then K - 1 chained
draft steps; eager, one host sync per draft step for its greedy tokens) is timed on the host
around `DraftModelProposer.after_step`, and the target step's wall time beside it. The
target step of the whole model is projected as 61 x the measured MoE-layer time of
benchmarks/results/decode_layer_deepseek_fp8.json plus the 2-layer step's non-layer part.
Target: one draft step <= 10% of a target step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from common import gpu_meta

HERE = Path(__file__).resolve().parent
MODEL = HERE / "configs/deepseek-v3-fp8"
LAYER_RESULT = HERE / "results/decode_layer_deepseek_fp8.json"
BATCHES = (1, 8)
DRAFT_TOKENS = (1, 3)
PROMPT = 64
WARMUP, TIMED = 6, 24
TOTAL_LAYERS = 61


def _layer_ms(batch: int) -> float | None:
    """The measured ms per full-size DeepSeek-V3 FP8 MoE layer at `batch` (decode_layer)."""
    try:
        res = json.loads(LAYER_RESULT.read_text())
        return float(res["moeserve"]["deepseek-v3-fp8"]["per_layer"][str(batch)]["ms"])
    except (OSError, KeyError, ValueError, TypeError):
        return None


def measure(batch: int, k: int) -> dict:
    from moeserve.engine.core import build_engine
    from moeserve.engine.draft import DraftModelProposer
    from moeserve.sampling import SamplingParams

    eng = build_engine(
        str(MODEL),
        load_format="dummy",
        num_layers=2,
        max_model_len=1024,
        max_num_seqs=16,
        speculative_config={"method": "mtp", "num_speculative_tokens": k, "adaptive": False},
    )
    prop = eng.proposer
    assert isinstance(prop, DraftModelProposer)
    inner, spent = prop.after_step, []

    def timed(*args):
        t0 = time.perf_counter()
        inner(*args)
        torch.cuda.synchronize()
        spent.append(time.perf_counter() - t0)

    prop.after_step = timed
    params = SamplingParams(max_tokens=WARMUP + TIMED + 8, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(batch)
    for i in range(batch):
        eng.add_request(f"r{i}", torch.randint(10, 500, (PROMPT,), generator=gen).tolist(), params)
    while eng.scheduler.waiting or any(
        r.num_computed < r.num_tokens - 1 for r in eng.scheduler.running
    ):
        eng.step()
    for _ in range(WARMUP):
        eng.step()
    spent.clear()
    steps = []
    for _ in range(TIMED):
        t0 = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - t0)
    draft_ms = statistics.median(spent) * 1000
    step_ms = statistics.median(steps) * 1000
    eng.shutdown()
    return {
        "draft_ms": draft_ms,
        "step_ms_2_layers": step_ms,
        "target_ms_2_layers": step_ms - draft_ms,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    rows = {}
    for b in BATCHES:
        for k in DRAFT_TOKENS:
            r = measure(b, k)
            layer = _layer_ms(b)
            if layer is not None:
                r["target_ms_61_layers"] = TOTAL_LAYERS * layer + max(
                    0.0, r["target_ms_2_layers"] - 2 * layer
                )
                r["draft_share"] = r["draft_ms"] / k / r["target_ms_61_layers"]
            rows[f"{b}x{k}"] = r
    res = {
        "versions": gpu_meta(args.commit),
        "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec_draft_cost.json").write_text(json.dumps(res, indent=1))
    v = res["versions"]
    lines = [
        "# Drafting with DeepSeek-V3's MTP layer: cost next to the target step",
        "",
        f"commit {v['commit']}, {v['gpu']}, torch {v['torch']}, triton {v['triton']}. Method: "
        "benchmarks/spec_draft_cost.py (docstring): DeepSeek-V3 block-FP8 at published "
        "dimensions, dummy weights, 2 layers + the MTP layer; draft work timed per step; the "
        "61-layer target step projected from decode_layer_deepseek_fp8.json. Target: one draft "
        "step <= 10% of a target step.",
        "",
        "| batch | draft tokens K | draft ms per step (all K) | per draft token "
        "| target step ms (61 layers, projected) | one draft step / target step |",
        "|---|---|---|---|---|---|",
    ]
    for key, r in rows.items():
        b, k = key.split("x")
        tgt = r.get("target_ms_61_layers")
        share = r.get("draft_share")
        lines.append(
            f"| {b} | {k} | {r['draft_ms']:.2f} | {r['draft_ms'] / int(k):.2f} | "
            f"{tgt:.2f} | {share:.1%} |"
            if tgt is not None
            else f"| {b} | {k} | {r['draft_ms']:.2f} | {r['draft_ms'] / int(k):.2f} | - | - |"
        )
    (out / "spec_draft_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
