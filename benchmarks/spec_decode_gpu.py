"""Speculative decoding on the H200 in one table: the verify cost curve, the draft step of each
draft model, and the projected batch-1 speed-up at TP8 with both counted.

Reads the GPU measurements (run them on the GPU machine first; each records its commit):
  benchmarks/results/spec_verify_cost.json            (benchmarks/spec_verify_cost.py)
  benchmarks/results/spec_draft_cost.json             (benchmarks/spec_draft_cost.py --draft mtp)
  benchmarks/results/spec_draft_cost_eagle3_mla.json  (... --draft eagle3-mla)
and writes benchmarks/results/spec_decode_gpu.{json,md}:
  python benchmarks/spec_decode_gpu.py [--results benchmarks/results]

Projection. One TP8+EP rank's MoE layer kernel time at q query tokens of one sequence
(`t_rank(q)`, rank simulation) plus two all-reduces, times 61 layers, is the target step
`T(q)`. A draft model runs once per draft token: the first pass (catching up on the verified
positions) costs `first`, each chained one `next`, both as shares of a 61-layer target step
at full size, batch 1 (first = the K = 1 draft time, next = (K = 3 time - K = 1 time) / 2);
those shares are taken to hold at TP8 (the draft's layer is sharded like the target's: an
assumption, stated). With a
per-token acceptance probability p (each draft token accepted if the ones before it were), a
draft of K tokens yields 1 + p + ... + p^K tokens per step; p is set so that K = 3 gives the
acceptance length a in the table (1.5, 2.0, 2.9). Speed-up over plain decoding:
  E_K(p) x T(1) / (T(K + 1) + (first + (K - 1) x next) x T(1)),
for K = 3 (a fixed draft length) and for the best K of 1, 3, 7 (what the adaptive draft
length picks). Host proposers (n-gram, suffix) cost no GPU time. The target is
Kimi-K2.5's rank; the MTP row applies DeepSeek-V3's measured MTP share to it (both models
have DeepSeek-V3's layer dimensions).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from spec_verify_cost import ACCEPTANCE_LENGTHS, ALLREDUCE_US_8GPU, TOTAL_LAYERS

HERE = Path(__file__).resolve().parent
DRAFT_FILES = {"mtp": "spec_draft_cost.json", "eagle3-mla": "spec_draft_cost_eagle3_mla.json"}
DRAFT_LENGTHS = (1, 3, 7)  # verify steps of 2, 4 and 8 tokens: the measured curve
FIT_LENGTH = 3  # the draft length the acceptance lengths are stated for
TARGET_SPEEDUP, TARGET_DRAFT_SHARE = 1.6, 0.10
SLOPE_NOISE = 0.02  # run-to-run spread of a per-layer slope: "no more than" within it


def expected_tokens(p: float, k: int) -> float:
    """Tokens one verify step yields for a draft of k with per-token acceptance p."""
    return sum(p**i for i in range(k + 1))


def acceptance_for(length: float, k: int = FIT_LENGTH) -> float:
    """The per-token acceptance p with expected_tokens(p, k) == length (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens(mid, k) < length else (lo, mid)
    return (lo + hi) / 2


def draft_shares(rows: dict) -> tuple[float, float]:
    """(first, next): a draft model's first and each chained pass as shares of a target step
    (batch 1), from its K = 1 and K = 3 rows."""
    target = rows["1x1"]["target_ms_61_layers"]
    first = rows["1x1"]["draft_ms"]
    chained = (rows["1x3"]["draft_ms"] - first) / (FIT_LENGTH - 1)
    return first / target, chained / target


def project(rank: dict, shares: dict[str, tuple[float, float]]) -> dict:
    step = {
        q: TOTAL_LAYERS * (rank[f"1x{q}"]["kernel_us_per_moe_layer"] + 2 * ALLREDUCE_US_8GPU)
        for q in (1, *(k + 1 for k in DRAFT_LENGTHS))
    }
    out = {"step_us": {str(q): t for q, t in step.items()}, "plain_tok_s": 1e6 / step[1]}
    for method, (first, chained) in shares.items():
        rows = {}
        for a in ACCEPTANCE_LENGTHS:
            p = acceptance_for(a)
            speed = {
                k: expected_tokens(p, k)
                * step[1]
                / (step[k + 1] + (first + (k - 1) * chained) * step[1])
                for k in DRAFT_LENGTHS
            }
            best = max(speed, key=speed.get)
            rows[str(a)] = {
                "acceptance_per_token": p,
                "speedup_k3": speed[FIT_LENGTH],
                "tok_s_k3": speed[FIT_LENGTH] * 1e6 / step[1],
                "best_k": best,
                "speedup_best": speed[best],
                "tok_s_best": speed[best] * 1e6 / step[1],
            }
        out[method] = {
            "draft_share_first": first,
            "draft_share_chained": chained,
            "draft_share_k3": (first + (FIT_LENGTH - 1) * chained) / FIT_LENGTH,
            "by_acceptance_length": rows,
        }
    return out


def write_markdown(res: dict, path: Path) -> None:
    v, lines = res["verify_versions"], []
    lines += [
        "# Speculative decoding on the H200: verify cost, draft cost, projected TP8 speed-up",
        "",
        f"Inputs: spec_verify_cost.json (commit {v['commit']}, {v['gpu']}, torch {v['torch']}, "
        f"triton {v['triton']})"
        + "".join(
            f", {DRAFT_FILES[m]} (commit {d['commit']})" for m, d in res["draft_versions"].items()
        )
        + ". Method: benchmarks/spec_decode_gpu.py (docstring); dummy weights, kernel time per "
        "MoE layer from the slope of 6 vs 2 layers.",
        "",
        "## Verify cost: q tokens of one sequence vs a batch of q one-token sequences",
        "",
        "| layers | q | verify q tokens (us per MoE layer) | batch of q (us) | ratio "
        "| target <= 1 |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in res["verify"].items():
        for q, (verify, batch) in row.items():
            ok = "met" if verify <= batch * (1 + SLOPE_NOISE) else "missed"
            ratio = verify / batch
            lines.append(f"| {name} | {q} | {verify:.1f} | {batch:.1f} | {ratio:.2f} | {ok} |")
    lines += [
        "",
        f"(met: within {SLOPE_NOISE:.0%}, the spread of a per-layer slope.)",
        "",
        "## Draft step next to a target step (batch 1, published dimensions)",
        "",
        "| draft model | first pass / target step | each chained pass | mean per draft token, "
        "K = 3 |",
        "|---|---|---|---|",
    ]
    proj = res["projection"]

    def judged(share: float) -> str:
        return f"{share:.1%} ({'met' if share <= TARGET_DRAFT_SHARE else 'over'})"

    for method in DRAFT_FILES:
        if method in proj:
            d = proj[method]
            cells = [d["draft_share_first"], d["draft_share_chained"], d["draft_share_k3"]]
            lines.append(f"| {method} | " + " | ".join(judged(c) for c in cells) + " |")
    lines += [
        "",
        f"Target: a draft step <= {TARGET_DRAFT_SHARE:.0%} of a target step. The first pass "
        "also fuses the target's hidden states (EAGLE-3: fc over three layers') and waits "
        "once for all K draft tokens.",
    ]
    lines += [
        "",
        "## Projected batch-1 decode at TP8 (61 layers, 8 GPUs)",
        "",
        f"Plain: {proj['step_us']['1']:.0f} us per step, {proj['plain_tok_s']:.0f} tok/s "
        f"(all-reduce {ALLREDUCE_US_8GPU} us per call: 8-GPU estimate, stated).",
        "",
        "| draft | acceptance length (K = 3) | tok/s, K = 3 | speed-up, K = 3 | best K "
        "| tok/s, best K | speed-up, best K |",
        "|---|---|---|---|---|---|---|",
    ]
    for method in ("host", *DRAFT_FILES):
        if method not in proj:
            continue
        for a, r in proj[method]["by_acceptance_length"].items():
            lines.append(
                f"| {method} | {a} | {r['tok_s_k3']:.0f} | {r['speedup_k3']:.2f}x | {r['best_k']} "
                f"| {r['tok_s_best']:.0f} | {r['speedup_best']:.2f}x |"
            )
    lines += ["", f"Target: >= {TARGET_SPEEDUP}x at acceptance length 2.9."]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", default=str(HERE / "results"))
    args = ap.parse_args()
    root = Path(args.results)
    verify = json.loads((root / "spec_verify_cost.json").read_text())
    shares, draft_versions = {"host": (0.0, 0.0)}, {}
    for method, name in DRAFT_FILES.items():
        f = root / name
        if f.is_file():
            d = json.loads(f.read_text())
            shares[method] = draft_shares(d["rows"])
            draft_versions[method] = d["versions"]
    layers = verify["layers"]
    res = {
        "verify_versions": verify["versions"],
        "draft_versions": draft_versions,
        "verify": {
            name: {
                str(q): (
                    r[f"1x{q}"]["kernel_us_per_moe_layer"],
                    r[f"{q}x1"]["kernel_us_per_moe_layer"],
                )
                for q in (2, 4, 8)
            }
            for name, r in layers.items()
        },
        "projection": project(layers["tp8-ep rank"], shares),
    }
    (root / "spec_decode_gpu.json").write_text(json.dumps(res, indent=1))
    write_markdown(res, root / "spec_decode_gpu.md")
    print((root / "spec_decode_gpu.md").read_text())


if __name__ == "__main__":
    main()
