"""What drafting costs next to the target step, at published dimensions (dummy weights), batch
1 and 8: DeepSeek-V3's MTP layer (DeepSeek-V3 block-FP8) and the MLA EAGLE-3 head of Kimi-K2.5
(Kimi-K2.5 NVFP4).

Run on the GPU machine from the repository root:
  PYTHONPATH=$PWD python benchmarks/spec_draft_cost.py --out benchmarks/results \
      [--draft mtp|eagle3-mla|all] [--commit SHA]

Method. An engine with `--load-format dummy --num-layers N` and its draft model:
- `mtp`: DeepSeek-V3, N = 2 (one dense layer, one MoE layer) plus the checkpoint's MTP layer,
  `{"method": "mtp"}`;
- `eagle3-mla`: Kimi-K2.5, N = 3, and an EAGLE-3 head whose config.json is the published
  Kimi-K2.5 MLA head's (`KIMI_K25_EAGLE3_MLA_CONFIG`: hidden 7168, 64 heads, q_lora 1536, kv_lora
  512, a dense 18432-wide MLP, a 163,840-token draft vocabulary) with its aux layers moved to
  the 3 built ones (which layers it reads does not change its cost); dummy weights use the
  target's embedding and LM head, the published head's own are the same size;
with `"num_speculative_tokens": K` for K = 1 and 3. B requests (64-token prompts) decode; each
step's draft work (the draft model catching up on the step's positions, then K - 1 chained
draft steps, each replayed from a CUDA graph where one serves, one host sync per draft step for
its greedy tokens) is timed on the host around `DraftModelProposer.after_step`, and the target
step's wall time beside it. The target step of the whole model is projected as 61 x the
measured per-layer time of the model's decode_layer result plus the N-layer step's non-layer
part. Target: one draft step <= 10% of a target step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from common import gpu_meta

from moeserve.testing.checkpoints import KIMI_K25_EAGLE3_MLA_CONFIG

HERE = Path(__file__).resolve().parent
BATCHES = (1, 8)
DRAFT_TOKENS = (1, 3)
PROMPT = 64
WARMUP, TIMED = 6, 24
TOTAL_LAYERS = 61  # DeepSeek-V3 and Kimi-K2.5 alike


@dataclass(frozen=True)
class Draft:
    name: str
    title: str
    model: Path  # the target's config folder
    layers: int  # built target layers
    layer_result: Path  # decode_layer result with the per-layer times
    layer_key: str  # the model's key in it
    out: str  # result file stem


DRAFTS = {
    "mtp": Draft(
        "mtp",
        "Drafting with DeepSeek-V3's MTP layer",
        HERE / "configs/deepseek-v3-fp8",
        2,
        HERE / "results/decode_layer_deepseek_fp8.json",
        "deepseek-v3-fp8",
        "spec_draft_cost",
    ),
    "eagle3-mla": Draft(
        "eagle3-mla",
        "Drafting with Kimi-K2.5's MLA EAGLE-3 head",
        HERE / "configs/kimi-k2.5-nvfp4",
        3,
        HERE / "results/decode_layer.json",
        "kimi-k2.5-nvfp4",
        "spec_draft_cost_eagle3_mla",
    ),
}


def _layer_ms(draft: Draft, batch: int) -> float | None:
    """The measured ms per full-size layer at `batch` (the decode_layer result)."""
    try:
        res = json.loads(draft.layer_result.read_text())
        return float(res["moeserve"][draft.layer_key]["per_layer"][str(batch)]["ms"])
    except (OSError, KeyError, ValueError, TypeError):
        return None


def _spec(draft: Draft, k: int, folder: str) -> dict:
    spec = {"method": "mtp", "num_speculative_tokens": k, "adaptive": False}
    if draft.name == "eagle3-mla":
        cfg = dict(KIMI_K25_EAGLE3_MLA_CONFIG)
        ids = list(range(draft.layers))  # the built layers (3 of them)
        cfg["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": ids,
            "use_aux_hidden_state": True,
        }
        (Path(folder) / "config.json").write_text(json.dumps(cfg, indent=1))
        spec.update(method="eagle3", model=folder)
    return spec


def measure(draft: Draft, batch: int, k: int) -> dict:
    from moeserve.engine.core import build_engine
    from moeserve.engine.draft import DraftModelProposer
    from moeserve.sampling import SamplingParams

    with tempfile.TemporaryDirectory() as folder:
        eng = build_engine(
            str(draft.model),
            load_format="dummy",
            num_layers=draft.layers,
            max_model_len=1024,
            max_num_seqs=16,
            speculative_config=_spec(draft, k, folder),
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
    graphs = eng.runner.draft_graphs is not None
    eng.shutdown()
    return {
        "draft_ms": draft_ms,
        f"step_ms_{draft.layers}_layers": step_ms,
        "target_ms_built_layers": step_ms - draft_ms,
        "draft_graphs": graphs,
    }


def run(draft: Draft, out: Path, commit: str | None) -> None:
    rows = {}
    for b in BATCHES:
        for k in DRAFT_TOKENS:
            r = measure(draft, b, k)
            layer = _layer_ms(draft, b)
            if layer is not None:
                r["target_ms_61_layers"] = TOTAL_LAYERS * layer + max(
                    0.0, r["target_ms_built_layers"] - draft.layers * layer
                )
                r["draft_share"] = r["draft_ms"] / k / r["target_ms_61_layers"]
            rows[f"{b}x{k}"] = r
    res = {"versions": gpu_meta(commit), "draft": draft.name, "rows": rows}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{draft.out}.json").write_text(json.dumps(res, indent=1))
    v = res["versions"]
    lines = [
        f"# {draft.title}: cost next to the target step",
        "",
        f"commit {v['commit']}, {v['gpu']}, torch {v['torch']}, triton {v['triton']}. Method: "
        f"benchmarks/spec_draft_cost.py --draft {draft.name} (docstring): published dimensions, "
        f"dummy weights, {draft.layers} target layers + the draft model; draft work timed per "
        f"step; the 61-layer target step projected from {draft.layer_result.name}. Target: one "
        "draft step <= 10% of a target step.",
        "",
        "| batch | draft tokens K | draft ms per step (all K) | per draft token "
        "| target step ms (61 layers, projected) | one draft step / target step | draft graphs |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, r in rows.items():
        b, k = key.split("x")
        tgt, share = r.get("target_ms_61_layers"), r.get("draft_share")
        cells = f"{tgt:.2f} | {share:.1%}" if tgt is not None else "- | -"
        lines.append(
            f"| {b} | {k} | {r['draft_ms']:.2f} | {r['draft_ms'] / int(k):.2f} | {cells} | "
            f"{'yes' if r['draft_graphs'] else 'no'} |"
        )
    (out / f"{draft.out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "results"))
    ap.add_argument("--draft", choices=[*DRAFTS, "all"], default="all")
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()
    for name in DRAFTS if args.draft == "all" else [args.draft]:
        run(DRAFTS[name], Path(args.out), args.commit)


if __name__ == "__main__":
    main()
