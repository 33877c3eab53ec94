"""One DeepSeek-V3 block-FP8 MoE layer (published shapes, dummy weights) on one GPU: the shared
expert as a slot of the fused kernel (layers/moe.py `shared_expert_slots`; at the batch sizes
outside SLOTS_MAX_GEMV_TOKENS / SLOTS_MIN_MMA_TOKENS the slot runs as dense GEMMs on its bank
rows) against a separate shared MLP, the same weights and inputs; us per layer call from a
CUDA graph of REPS calls on rotating inputs. Writes moe_shared_slots.{json,md} to --out-dir.

  PYTHONPATH=$PWD python benchmarks/moe_shared_slots.py --out-dir benchmarks/results [--commit SHA]
"""

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # the sibling benchmark modules
from common import gpu_meta  # noqa: E402
from kernels_gemm_moe import graph_time_us  # noqa: E402

from moeserve.layers.moe import DeepseekMoE
from moeserve.layers.quant.fp8_block import Fp8BlockConfig
from moeserve.loader.safetensors import _dummy_fill
from moeserve.models.registry import config_from_hf

REPS = 20
raw = json.load(open("benchmarks/configs/deepseek-v3-fp8/config.json"))
cfg = config_from_hf(raw)
quant = Fp8BlockConfig((128, 128))


def build(slots: bool) -> DeepseekMoE:
    with torch.device("cuda"):
        m = DeepseekMoE(
            dataclasses.replace(
                cfg, moe=dataclasses.replace(cfg.moe, shared_experts_as_slots=slots)
            ),
            "model.layers.3.mlp",
            quant,
            dtype=torch.bfloat16,
        )
    _dummy_fill(m, 0)
    for mod in m.modules():
        hook = getattr(mod, "process_weights_after_loading", None)
        if hook is not None and mod is not m:
            hook()
    shared: dict = {}
    for mod in m.modules():
        hook = getattr(mod, "prepare_cuda_graph", None)
        if hook is not None:
            hook(64, 256, shared)
    return m


@torch.inference_mode()
def time_layer(m: DeepseekMoE, rows: int) -> float:
    torch.manual_seed(rows)  # the same inputs for both layouts
    xs = [
        torch.randn(rows, cfg.hidden_size, device="cuda", dtype=torch.bfloat16) for _ in range(REPS)
    ]
    # one graph of REPS layer calls, one per input (graph_time_us warms each up first)
    return graph_time_us([lambda x=x: m(x) for x in xs], calls=REPS, reps=30)["us"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--commit", default=None)
    args = ap.parse_args()

    slot, sep = build(True), build(False)
    assert slot.shared_slots == 1 and sep.shared_slots == 0
    # the same weights in both layouts: router, routed experts, and slot E = the shared MLP
    with torch.no_grad():
        sep.gate.weight.copy_(slot.gate.weight)
        sep.gate.e_score_correction_bias.copy_(slot.gate.e_score_correction_bias)
        e = cfg.moe.n_routed_experts
        for suffix in ("weight", "weight_scale_inv"):
            w13, w2 = getattr(slot.experts.w13, suffix), getattr(slot.experts.w2, suffix)
            getattr(sep.experts.w13, suffix).copy_(w13[:e])
            getattr(sep.experts.w2, suffix).copy_(w2[:e])
            # the separate MLP's merged gate_up_proj holds [gate; up] rows like a w13 slot
            getattr(sep.shared_experts.gate_up_proj, suffix).copy_(w13[e])
            getattr(sep.shared_experts.down_proj, suffix).copy_(w2[e])
    records = []
    for rows in (1, 2, 3, 4, 8, 16, 32, 64, 128):
        x = torch.randn(rows, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            a, b = slot(x).float(), sep(x).float()
        err = ((a - b).norm() / b.norm()).item()
        t_slot, t_sep = time_layer(slot, rows), time_layer(sep, rows)
        records.append(
            dict(tokens=rows, slot_us=t_slot, separate_us=t_sep, saved_us=t_sep - t_slot,
                 slots_in_kernel=slot.experts.runs_shared_slots(x), rel_diff=err)
        )  # fmt: skip
        print(records[-1], flush=True)
    meta = gpu_meta(args.commit)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe_shared_slots.json").write_text(
        json.dumps({"meta": meta, "records": records}, indent=1)
    )
    lines = [
        "# DeepSeek-V3 FP8 MoE layer: shared expert as a slot vs a separate MLP (one GPU)",
        "",
        f"GPU {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, commit "
        f"{meta['commit']}. benchmarks/moe_shared_slots.py: us per layer call (router, routed "
        "and shared experts) from a CUDA graph; `in kernel`: the slot runs inside the fused "
        "MoE, else as dense GEMMs on its bank rows.",
        "",
        "| tokens | slot layout us | separate MLP us | saved us | in kernel | rel. diff |",
        "|---|---|---|---|---|---|",
    ]
    for r in records:
        lines.append(
            f"| {r['tokens']} | {r['slot_us']:.1f} | {r['separate_us']:.1f} | "
            f"{r['saved_us']:.1f} | {'yes' if r['slots_in_kernel'] else 'no'} | "
            f"{r['rel_diff']:.1e} |"
        )
    (out / "moe_shared_slots.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
