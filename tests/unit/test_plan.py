"""`moeserve plan`: bytes per GPU against values computed by hand from the published
Kimi-K2.5-NVFP4 / DeepSeek-V3 configs (benchmarks/configs), the kernel and fallback choices,
and the printed plan."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from moeserve import plan
from moeserve.cli import main
from moeserve.config import EngineConfig, MLAConfig, ModelConfig, MoEConfig
from moeserve.hardware import GPUS, MIB
from moeserve.layers.kernel_plan import (
    Hardware,
    KernelChoice,
    PlanSettings,
    effective_kv_cache_dtype,
    resolve_kernel_plan,
)
from moeserve.layers.quant.base import NoQuant
from moeserve.loader.source import describe_source

ROOT = Path(__file__).resolve().parents[2]
KIMI = str(ROOT / "benchmarks/configs/kimi-k2.5-nvfp4")
DSV3 = str(ROOT / "benchmarks/configs/deepseek-v3-fp8")
GIB = 1 << 30

# ---- Kimi-K2.5 text config (published), written out by hand --------------------------------
H, HEADS, Q_LORA, KV_LORA, ROPE, NOPE, V_DIM = 7168, 64, 1536, 512, 64, 128, 128
I_DENSE, I_MOE, EXPERTS, VOCAB, LAYERS, MOE_LAYERS = 18432, 2048, 384, 163840, 61, 60
ROPE_TABLE = 4096 * 64  # YaRN: original positions x factor = max_position_embeddings
BF16, FP32 = 2, 4
TP = 8
# each NVFP4 weight of a W4A4 export carries two fp32 scalars: weight_scale_2 (global) and
# input_scale; a layout may share one of them between fused weights (gate/up), so parts with
# NVFP4 weights may hold up to one scalar per weight less
W4A4_SCALARS = 2 * FP32


def nvfp4_bytes(n: int, k: int) -> int:
    """Packed E2M1 codes (n*k/2 B) + e4m3 block scales (one per 16: n*k/16 B) = 0.5625 B/param,
    + the two fp32 scalars."""
    return n * k // 2 + n * k // 16 + W4A4_SCALARS


def close(actual: int, expected: int, nvfp4_weights: int) -> bool:
    return expected - nvfp4_weights * FP32 <= actual <= expected


ATTN_LINEARS = (
    Q_LORA * H  # q_a_proj, replicated
    + (HEADS // TP) * (NOPE + ROPE) * Q_LORA  # q_b_proj, column-parallel
    + (KV_LORA + ROPE) * H  # kv_a_proj_with_mqa, replicated
    + (HEADS // TP) * (NOPE + V_DIM) * KV_LORA  # kv_b_proj, column-parallel
    + H * (HEADS // TP) * V_DIM  # o_proj, row-parallel
)
# + q_a / kv_a layernorms (bf16) and the fp32 kv_scale; the published export keeps
# attention in BF16
ATTENTION_PER_LAYER = ATTN_LINEARS * BF16 + (Q_LORA + KV_LORA) * BF16 + FP32
# the published config.json quantization_config ignores only lm_head, self_attn and the
# vision tower: layer 0's dense MLP and the shared experts are NVFP4
DENSE_MLP = 3 * nvfp4_bytes(I_DENSE // TP, H)
SHARED_PER_LAYER = 3 * nvfp4_bytes(I_MOE // TP, H)
# gate weight in the model dtype (bf16), correction bias in fp32
ROUTER_PER_LAYER = EXPERTS * H * BF16 + EXPERTS * FP32
EXPERTS_PER_LAYER_TP = EXPERTS * 3 * nvfp4_bytes(I_MOE // TP, H)
EXPERTS_PER_LAYER_EP = (EXPERTS // TP) * 3 * nvfp4_bytes(I_MOE, H)
NVFP4_WEIGHTS_TP = MOE_LAYERS * EXPERTS * 3  # routed expert weights per rank without EP
EMBED_LM_HEAD = 2 * (VOCAB // TP) * H * BF16  # vocab-parallel, both
NORMS_BUFFERS = LAYERS * 2 * H * BF16 + H * BF16 + 2 * ROPE_TABLE * (ROPE // 2) * FP32
# the vision tower and projector as published (all BF16), held by rank 0
VT, VT_MLP, VT_BLOCKS, PATCH, MERGED = 1152, 4304, 27, 14, 4 * 1152
VISION_BLOCK = 3 * VT * (VT + 1) + (VT + 1) * VT + 2 * VT * VT_MLP + VT_MLP + VT + 4 * VT
VISION_ENCODER = BF16 * (
    VT * 3 * PATCH * PATCH + VT  # patch_embed.proj
    + 64 * 64 * VT  # patch_embed.pos_emb
    + VT_BLOCKS * VISION_BLOCK
    + 2 * VT  # final_layernorm
    + 2 * VT + (MERGED + 1) * MERGED + (MERGED + 1) * H  # pre_norm, proj.0, proj.2
)  # fmt: skip
KIMI_TP8_TOTAL = (
    VISION_ENCODER
    + LAYERS * ATTENTION_PER_LAYER
    + DENSE_MLP
    + MOE_LAYERS * (ROUTER_PER_LAYER + SHARED_PER_LAYER + EXPERTS_PER_LAYER_TP)
    + EMBED_LM_HEAD
    + NORMS_BUFFERS
)
KV_BF16 = LAYERS * (KV_LORA + ROPE) * 2  # 70,272 B/token
KV_FP8 = LAYERS * (KV_LORA + ROPE) * 1  # 35,136 B/token


def _engine(**settings) -> EngineConfig:
    return EngineConfig.from_settings(**settings)


@pytest.fixture(scope="module")
def kimi_tp8() -> plan.Plan:
    return plan.plan_deployment(KIMI, GPUS["h200"], 8, _engine(tensor_parallel_size=TP))


def test_hand_values_are_the_published_ones():
    assert KV_BF16 == 70_272 and KV_FP8 == 35_136
    assert nvfp4_bytes(2048, 7168) - W4A4_SCALARS == 2048 * 7168 * 0.5625
    cfg = json.loads((Path(KIMI) / "config.json").read_text())["text_config"]
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["n_routed_experts"]) == (
        H,
        HEADS,
        EXPERTS,
    )
    assert (cfg["vocab_size"], cfg["num_hidden_layers"], cfg["first_k_dense_replace"]) == (
        VOCAB,
        LAYERS,
        1,
    )


def test_kimi_tp8_weights_per_gpu_by_part(kimi_tp8):
    parts = kimi_tp8.weights.by_part
    assert parts["attention"] == LAYERS * ATTENTION_PER_LAYER
    assert parts["embedding + lm_head"] == EMBED_LM_HEAD
    assert parts["router"] == MOE_LAYERS * ROUTER_PER_LAYER
    assert parts["norms + buffers"] == NORMS_BUFFERS
    assert parts["vision encoder"] == VISION_ENCODER
    assert close(parts["dense MLP"], DENSE_MLP, 3)
    assert close(parts["shared experts"], MOE_LAYERS * SHARED_PER_LAYER, MOE_LAYERS * 3)
    assert close(parts["routed experts"], MOE_LAYERS * EXPERTS_PER_LAYER_TP, NVFP4_WEIGHTS_TP)
    assert close(kimi_tp8.weights.total, KIMI_TP8_TOTAL, 3 + MOE_LAYERS * 3 + NVFP4_WEIGHTS_TP)
    assert kimi_tp8.weights.experts_per_rank == EXPERTS  # split along the intermediate dim


def test_kimi_tp8_expert_parallel_holds_whole_experts():
    p = plan.plan_deployment(
        KIMI, GPUS["h200"], 8, _engine(tensor_parallel_size=TP, enable_expert_parallel=True)
    )
    assert p.weights.experts_per_rank == EXPERTS // TP == 48
    experts = p.weights.by_part["routed experts"]
    assert close(experts, MOE_LAYERS * EXPERTS_PER_LAYER_EP, MOE_LAYERS * (EXPERTS // TP) * 3)
    # everything but the experts is laid out as without EP
    assert p.weights.by_part["attention"] == LAYERS * ATTENTION_PER_LAYER
    assert p.weights.by_part["embedding + lm_head"] == EMBED_LM_HEAD


def test_kv_bytes_per_token(kimi_tp8):
    # the checkpoint asks for an FP8 cache (kv_cache_scheme float 8): auto follows it on sm_90
    assert kimi_tp8.kv_dtype == torch.float8_e4m3fn
    assert kimi_tp8.memory.kv_bytes_per_token == KV_FP8
    bf16 = plan.plan_deployment(
        KIMI, GPUS["h200"], 8, _engine(tensor_parallel_size=TP, kv_cache_dtype="bf16")
    )
    assert bf16.memory.kv_bytes_per_token == KV_BF16
    # FP8 asked for on sm_80: Triton has no e4m3 conversions there -> a BF16 cache
    a100 = plan.plan_deployment(KIMI, GPUS["a100-80gb"], 8, _engine(tensor_parallel_size=TP))
    assert a100.memory.kv_bytes_per_token == KV_BF16


def test_memory_arithmetic_of_the_plan(kimi_tp8):
    m = kimi_tp8.memory
    total = 143771 * MIB  # H200 as nvidia-smi reports it
    assert m.total_bytes == total
    budget = int(total * 0.90) - m.other_bytes - m.weights_bytes - m.activation_bytes
    budget -= m.graph_bytes
    assert m.budget_bytes == budget
    assert m.kv_pages == budget // (16 * KV_FP8)  # fewer than 64 full 256k contexts
    assert kimi_tp8.max_model_len == 262_144


def _run(capsys, *args: str) -> tuple[int, str]:
    rc = main(["plan", *args])
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_cli_rtx_pro_6000_x8(capsys):
    rc, out = _run(capsys, KIMI, "--gpu", "rtx-pro-6000", "--num-gpus", "8")
    assert rc == 0, out
    assert f"weights per GPU: {KIMI_TP8_TOTAL / GIB:.2f} GiB" in out
    assert f"{KV_FP8:,} B/token" in out
    assert "max context: 262,144 tokens" in out
    assert re.search(r"device memory\s+95\.59 GiB", out)  # 97887 MiB
    # sm_120: NVFP4 runs the W4A16 Triton kernels, PCIe: NCCL, both flagged
    assert "NVFP4 linears" in out and "Triton W4A16 (fallback: native FP4" in out
    assert "all-reduce" in out and "NCCL (fallback: the GPUs cannot read each other" in out
    assert re.search(r"KV cache\s+fp8 e4m3", out)


def test_cli_h200_x8(capsys):
    rc, out = _run(capsys, KIMI, "--gpu", "h200", "--num-gpus", "8")
    assert rc == 0, out
    assert f"weights per GPU: {KIMI_TP8_TOTAL / GIB:.2f} GiB" in out
    assert f"{KV_FP8:,} B/token" in out
    assert "max context: 262,144 tokens" in out
    assert "one-shot over peer memory" in out
    assert "Triton W4A16 (packed codes" in out
    assert "fallbacks: 1" in out  # W4A4 runs weight-only


def test_cli_model_that_does_not_fit(capsys):
    # DeepSeek-V3 FP8 on 8 A100-80GB: the routed experts alone, 58 MoE layers x 256 experts
    # x 3 x 2048 x 7168 FP8 bytes / 8 GPUs, exceed 90% of 80 GiB
    experts_only = 58 * 256 * 3 * 2048 * 7168 // 8
    assert experts_only > 0.9 * 81920 * MIB
    rc, out = _run(capsys, DSV3, "--gpu", "a100-80gb", "--num-gpus", "8")
    assert rc == 1, out
    assert "does not fit" in out
    assert "smallest that fits: -tp 16 --num-gpus 16, 2 hosts of 8" in out
    # and sm_80 has no e4m3 conversions in Triton
    assert re.search(r"block-FP8 linears\s+torch \(dequantize \+ cuBLAS\) \(fallback", out)


def test_deepseek_fp8_experts_fused_and_captured(capsys):
    rc, out = _run(capsys, DSV3, "--gpu", "h200", "--num-gpus", "8")
    assert rc == 0, out
    assert re.search(r"routed experts\s+fused Triton block-FP8 MoE", out)
    assert re.search(r"CUDA graphs\s+decode replayed", out)
    assert "fallbacks: 0" in out


def test_deepseek_fp8_shared_expert_slot_counted_as_shared_expert():
    """DeepSeek-V3 FP8 runs its shared expert as expert 256 of each MoE layer's banks; the
    plan still counts it as the shared expert, by hand and as the separate-MLP layout does."""
    p = plan.plan_deployment(DSV3, GPUS["h200"], 8, _engine(tensor_parallel_size=TP))
    moe_layers, inter = 61 - 3, 2048 // TP
    e4m3 = 3 * inter * 7168  # gate, up, down of one expert on one rank, 1 B each
    scales = 3 * (inter // 128) * (7168 // 128) * FP32  # one fp32 per 128x128 block
    assert p.weights.experts_per_rank == 256
    assert p.weights.by_part["shared experts"] == moe_layers * (e4m3 + scales)
    assert p.weights.by_part["routed experts"] == moe_layers * 256 * (e4m3 + scales)
    src = describe_source(DSV3)
    cfg, quant = src.config, src.quant
    slots = plan.meta_model(cfg, quant, torch.bfloat16, 0, TP)
    assert slots.model.layers[3].mlp.shared_slots == 1
    separate = plan.meta_model(
        dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, shared_experts_as_slots=False)),
        quant,
        torch.bfloat16,
        0,
        TP,
    )
    assert separate.model.layers[3].mlp.shared_slots == 0
    assert plan.rank_weights(slots) == plan.rank_weights(separate)


def test_cli_usage_errors(capsys):
    rc, out = _run(capsys, KIMI, "--gpu", "h200", "--num-gpus", "4", "-tp", "8")
    assert rc == 2 and "needs 8 GPUs" in out
    with pytest.raises(SystemExit) as e:
        main(["plan", KIMI, "--gpu", "tpu-v5"])
    assert e.value.code == 2


def test_index_total_is_shown(tmp_path, capsys):
    from moeserve.testing.checkpoints import write_checkpoint

    write_checkpoint(str(tmp_path / "ck"), "deepseek-v3", "fp8-block")
    index = json.loads((tmp_path / "ck/model.safetensors.index.json").read_text())
    rc, out = _run(capsys, str(tmp_path / "ck"), "--gpu", "l40s")
    assert rc == 0, out
    assert f"safetensors index: {index['metadata']['total_size'] / GIB:.2f} GiB" in out


# ---- kernel choices -------------------------------------------------------------------------
def _kimi() -> tuple[ModelConfig, object]:
    src = describe_source(KIMI)
    cfg, quant = src.config, src.quant
    return cfg, quant


def _by_what(choices) -> dict[str, KernelChoice]:
    return {c.what: c for c in choices}


def _choices(cfg, quant, cap, kv, interconnect, **settings) -> list[KernelChoice]:
    """The kernel plan's lines for a GPU of capability `cap` (None: a CPU with torch's
    kernels) and these settings."""
    if cap is None:
        hw = Hardware()
        settings.setdefault("cpu_kernels", "torch")
    else:
        hw = Hardware.planned_gpu(cap)
    ps = PlanSettings(kv_cache_dtype=kv, interconnect=interconnect, **settings)
    return list(resolve_kernel_plan(cfg, quant, hw, ps).choices)


def test_choices_hopper_nvlink():
    cfg, quant = _kimi()
    c = _by_what(_choices(cfg, quant, (9, 0), torch.float8_e4m3fn, "nvlink", tp_size=8))
    assert c["NVFP4 linears"].choice == "Triton W4A16" and not c["NVFP4 linears"].fallback
    assert c["routed experts"].choice == "fused Triton NVFP4 MoE"
    assert c["MLA decode"].choice.startswith("Triton MLA decode")
    assert c["KV cache"].choice == "fp8 e4m3" and not c["KV cache"].fallback
    assert c["all-reduce"].choice.startswith("one-shot") and not c["all-reduce"].fallback
    assert c["CUDA graphs"].choice == "decode replayed"
    assert [x.what for x in c.values() if x.fallback] == ["NVFP4 activations"]


def test_choices_blackwell_and_pcie():
    cfg, quant = _kimi()
    for cap in ((10, 0), (12, 0)):
        c = _by_what(_choices(cfg, quant, cap, torch.float8_e4m3fn, "pcie", tp_size=8))
        assert c["NVFP4 linears"].fallback and "native FP4" in c["NVFP4 linears"].reason
        assert c["all-reduce"].choice == "NCCL" and c["all-reduce"].fallback
        assert "PCIe without peer access" in c["all-reduce"].reason
    c = _by_what(_choices(cfg, quant, (12, 0), torch.bfloat16, "pcie-p2p", tp_size=2))
    assert c["all-reduce"].choice.startswith("one-shot")
    c = _by_what(_choices(cfg, quant, (9, 0), torch.bfloat16, "nvlink", tp_size=16, hosts=2))
    assert c["all-reduce"].choice == "NCCL" and "2 hosts" in c["all-reduce"].reason


def test_choices_ampere_falls_back_from_fp8():
    cfg, quant = _kimi()
    c = _by_what(_choices(cfg, quant, (8, 0), torch.float8_e4m3fn, "nvlink"))
    assert c["KV cache"].choice == "bfloat16" and c["KV cache"].fallback
    assert "sm_89" in c["KV cache"].reason and "sm_80" in c["KV cache"].reason
    assert c["NVFP4 linears"].choice.startswith("torch") and c["NVFP4 linears"].fallback
    assert c["routed experts"].fallback
    assert c["CUDA graphs"].fallback  # the per-expert loop cannot be captured
    assert "all-reduce" not in c  # one GPU
    assert effective_kv_cache_dtype(torch.float8_e4m3fn, (8, 9))[0] == torch.float8_e4m3fn


def test_choices_small_mla_layout_and_bf16_experts_and_cpu():
    cfg = ModelConfig(
        architecture="deepseek_v3", vocab_size=64, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=128, rms_norm_eps=1e-6, rope_theta=1e4,
        max_position_embeddings=128,
        mla=MLAConfig(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
        moe=MoEConfig(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32),
    )  # fmt: skip
    c = _by_what(_choices(cfg, NoQuant(), (9, 0), torch.bfloat16, "nvlink"))
    assert c["MLA decode"].choice.startswith("torch") and "512+64" in c["MLA decode"].reason
    assert c["routed experts"].choice == "fused Triton BF16 MoE"
    assert not c["routed experts"].fallback
    assert (
        "MLA decode" in c["CUDA graphs"].reason and "routed experts" not in c["CUDA graphs"].reason
    )
    cpu = _choices(cfg, NoQuant(), None, torch.float8_e4m3fn, None, tp_size=2)
    assert not any(x.fallback for x in cpu)
    assert _by_what(cpu)["all-reduce"].choice == "gloo"
    assert _by_what(cpu)["KV cache"].choice == "fp8 e4m3"


def test_gpu_table_has_the_planned_kinds():
    for key in ("h100", "h200", "b200", "rtx-pro-6000", "a100-80gb", "l40s"):
        g = GPUS[key]
        assert g.memory_bytes > 40 * GIB and g.capability >= (8, 0) and g.hbm_tb_s > 0
    assert GPUS["rtx-pro-6000"].capability == (12, 0)
    assert GPUS["rtx-pro-6000"].interconnect == "pcie"


def test_choices_follow_what_the_checkpoint_quantizes(tmp_path):
    from moeserve.testing.checkpoints import write_checkpoint

    # the writer's Kimi NVFP4 layout quantizes the routed experts only: no NVFP4 linears
    write_checkpoint(str(tmp_path / "k"), "kimi-k2.5", "nvfp4-modelopt")
    src = describe_source(str(tmp_path / "k"))
    cfg, quant = src.config, src.quant
    c = _by_what(_choices(cfg, quant, (9, 0), torch.bfloat16, "nvlink"))
    assert "NVFP4 linears" not in c
    assert c["routed experts"].choice == "fused Triton NVFP4 MoE"
    assert c["NVFP4 activations"].fallback  # W4A4 experts still run weight-only


def test_plan_says_where_the_shared_experts_run(capsys):
    # DeepSeek-V3 FP8 and Kimi-K2.5 NVFP4 store their shared expert like the routed ones:
    # slots of the fused MoE; expert parallelism keeps them a separate MLP
    for path in (DSV3, KIMI):
        rc, out = _run(capsys, path, "--gpu", "h200", "--num-gpus", "8")
        assert rc == 0, out
        assert "shared experts: 1 per MoE layer, slots of the fused MoE" in out
    rc, out = _run(capsys, KIMI, "--gpu", "h200", "--num-gpus", "8", "--enable-expert-parallel")
    assert rc == 0, out
    assert "shared experts: 1 per MoE layer, a separate MLP" in out


def test_mla_decode_kernel_choice_follows_cache_page_size_and_setting():
    # Gluon (Hopper, BF16 cache, pages of a multiple of 64) where it measured faster;
    # otherwise the Triton kernel, with the reason
    src = describe_source(DSV3)
    cfg, quant = src.config, src.quant

    def mla(cap, kv, **kw):
        return _by_what(_choices(cfg, quant, cap, kv, "nvlink", **kw))["MLA decode"]

    auto = mla((9, 0), torch.bfloat16, page_size=64)
    assert auto.choice.startswith("Gluon") and "measured faster" in auto.reason
    assert mla((9, 0), torch.bfloat16, page_size=64, mla_decode_kernel="gluon").choice == (
        "Gluon MLA decode (TMA + wgmma)"
    )
    for cap, kv, kw, why in (
        ((9, 0), torch.bfloat16, {"page_size": 16}, "page size 16"),
        ((9, 0), torch.float8_e4m3fn, {"page_size": 64}, "BF16 cache"),
        ((10, 0), torch.bfloat16, {"page_size": 64}, "sm_90"),
        ((9, 0), torch.bfloat16, {"page_size": 64, "mla_decode_kernel": "triton"}, "triton"),
    ):
        c = mla(cap, kv, **kw)
        assert c.choice.startswith("Triton") and why in c.reason, (c, why)


def test_mtp_draft_layer_is_counted():
    """With the MTP draft model, each GPU holds one more MoE layer (the MTP block: the bytes
    one more layer adds to the cut model) plus eh_proj and three norms (BF16), and its
    latent cache is one more layer's."""
    ds = str(Path(__file__).resolve().parents[2] / "benchmarks/configs/deepseek-v3-fp8")
    cfg = describe_source(ds).config
    n, h = cfg.num_hidden_layers, cfg.hidden_size

    def deploy(**kw):
        return plan.plan_deployment(ds, GPUS["h200"], 8, _engine(tensor_parallel_size=8, **kw))

    base, mtp = deploy(), deploy(speculative_config={"method": "mtp"})
    one_layer = deploy(num_layers=n).weights.total - deploy(num_layers=n - 1).weights.total
    extra = 2 * h * h * 2 + 3 * h * 2  # eh_proj and enorm / hnorm / shared_head.norm, BF16
    assert mtp.weights.by_part["MTP draft layer"] == one_layer + extra
    assert mtp.weights.total == base.weights.total + one_layer + extra
    assert mtp.memory.kv_bytes_per_token * n == base.memory.kv_bytes_per_token * (n + 1)
