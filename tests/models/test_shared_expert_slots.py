"""Shared experts as slots of the routed-expert banks (layers/moe.py `shared_expert_slots`):
a block-FP8 DeepSeek-V3 checkpoint loads with its shared expert(s) as experts E.. of the banks
and matches HF transformers' DeepseekV3 holding the dequantized weights; the layout is really
in use (and off where the formats differ, as in Kimi-K2.5 NVFP4, or under expert
parallelism); switching it off gives the same logits; dummy weights fill the slots."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moeserve.config import ModelConfig
from moeserve.kernels.gemm.fp8_block_gemm import FP8_BLOCK, dequantize_fp8_block, quantize_fp8_block
from moeserve.layers.moe import DeepseekMLP, DeepseekMoE, shared_expert_slots
from moeserve.layers.quant.base import NoQuant
from moeserve.layers.quant.fp8_block import Fp8BlockConfig
from moeserve.loader import load_model
from moeserve.models.deepseek_v3 import DeepseekV3ForCausalLM
from moeserve.models.registry import config_from_hf
from moeserve.parallel.groups import TPGroup
from moeserve.testing.checkpoints import write_checkpoint
from tests.models.helpers import PagedRunner, build_hf_model, tiny_hf_config

TOL = 1e-3
PROMPT = [5, 17, 3, 99, 42, 7, 8, 200, 31, 64, 12]
DECODE = [3, 250, 17, 90]
FP8 = Fp8BlockConfig((FP8_BLOCK, FP8_BLOCK))

CONFIGS = {
    # DeepSeek-V3's case: one shared expert of a routed expert's shape (I < one FP8 block)
    "v3_one_shared": tiny_hf_config(),
    # two shared experts, each a whole 128-row block: the stored tensors (scales included)
    # are cut per expert before loading
    "two_shared_block_aligned": tiny_hf_config(n_shared_experts=2, moe_intermediate_size=FP8_BLOCK),
}
# two shared experts of 32 rows would share one 128-row scale block: a separate MLP
UNALIGNED = tiny_hf_config(n_shared_experts=2)


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, s = quantize_fp8_block(w, FP8_BLOCK)
    return q, s, dequantize_fp8_block(q, s, torch.float32, FP8_BLOCK)


@torch.no_grad()
def fp8_checkpoint(hf) -> dict[str, torch.Tensor]:
    """DeepSeek's published block-FP8 layout of an HF model (every linear but the LM head and
    the router as e4m3 + weight_scale_inv, routed experts one tensor per expert); the HF
    model's weights are replaced by their dequantized values, so it is the oracle of exactly
    the weights the checkpoint holds."""
    out: dict[str, torch.Tensor] = {}
    params = dict(hf.named_parameters())
    for name, t in hf.state_dict().items():
        if name.endswith(".mlp.experts.gate_up_proj"):  # [E, 2I, H], gate rows first
            base, inter = name.removesuffix("gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                for proj, rows in (("gate_proj", slice(0, inter)), ("up_proj", slice(inter, None))):
                    q, s, deq = _quantize(t[e, rows])
                    out[f"{base}{e}.{proj}.weight"], out[f"{base}{e}.{proj}.weight_scale_inv"] = (
                        q,
                        s,
                    )
                    params[name][e, rows] = deq
        elif name.endswith(".mlp.experts.down_proj"):  # [E, H, I]
            base = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                q, s, deq = _quantize(t[e])
                out[f"{base}{e}.down_proj.weight"], out[f"{base}{e}.down_proj.weight_scale_inv"] = (
                    q,
                    s,
                )
                params[name][e] = deq
        elif name.endswith(("_proj.weight", "_proj_with_mqa.weight")):
            q, s, deq = _quantize(t)
            out[name], out[name.replace(".weight", ".weight_scale_inv")] = q, s
            params[name].copy_(deq)
        else:
            out[name] = t.clone()
    return out


def _moe(cfg: ModelConfig, **changes) -> ModelConfig:
    """`cfg` with its MoE section changed."""
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, **changes))


def _load(cfgd: dict, ckpt: dict, quant=FP8, **moe_changes) -> DeepseekV3ForCausalLM:
    cfg = _moe(config_from_hf(cfgd), **moe_changes)
    model = DeepseekV3ForCausalLM(cfg, quant)
    loaded = model.load_weights(ckpt.items())
    params = {n for n, p in model.named_parameters() if not getattr(p, "optional", False)}
    assert params <= loaded, params - loaded
    return model


def _moe_layers(model) -> list[DeepseekMoE]:
    return [la.mlp for la in model.model.layers if isinstance(la.mlp, DeepseekMoE)]


@torch.no_grad()
def _logits(model, hf=None) -> list[torch.Tensor]:
    """Prefill then absorbed decode steps over a paged cache; with `hf`, each step is
    checked against HF's full forward."""
    runner = PagedRunner(model, page_size=4)
    seq = runner.add_sequence()
    tokens, out = list(PROMPT), [runner.step({seq: PROMPT})[0]]
    for t in DECODE:
        tokens.append(t)
        out.append(runner.step({seq: [t]})[0])
    if hf is not None:
        for i, ours in enumerate(out):
            ref = hf(torch.tensor([tokens[: len(PROMPT) + i]])).logits[0, -1]
            assert ref.abs().max() > 0.1  # not trivially small
            assert (ours - ref).abs().max() < TOL, i
    return out


@pytest.fixture(scope="module", params=list(CONFIGS))
def fp8(request):
    cfgd = CONFIGS[request.param]
    hf = build_hf_model(cfgd, seed=2)
    return cfgd, hf, fp8_checkpoint(hf)


def test_fp8_checkpoint_runs_shared_experts_as_slots_and_matches_hf(fp8):
    cfgd, hf, ckpt = fp8
    model = _load(cfgd, ckpt)
    n, experts = cfgd["n_shared_experts"], cfgd["n_routed_experts"]
    moes = _moe_layers(model)
    assert moes
    for moe in moes:
        assert moe.shared_slots == n and moe.shared_experts is None
        for bank in (moe.experts.w13, moe.experts.w2):
            assert bank.weight.dtype == torch.float8_e4m3fn
            assert bank.weight.shape[0] == bank.weight_scale_inv.shape[0] == experts + n
        # every token is routed to the shared slots with weight 1 besides its top-k
        w, ids = moe.route(torch.randn(3, cfgd["hidden_size"]))
        k = cfgd["num_experts_per_tok"]
        assert ids.shape == w.shape == (3, k + n)
        assert ids[:, k:].tolist() == [list(range(experts, experts + n))] * 3
        assert (w[:, k:] == 1).all() and (ids[:, :k] < experts).all()
    assert not any("shared_experts" in name for name, _ in model.named_modules())
    # the slots hold the checkpoint's shared-expert tensors, expert j's rows / columns
    moe, layer = moes[0], cfgd["first_k_dense_replace"]
    inter = cfgd["moe_intermediate_size"]
    down = ckpt[f"model.layers.{layer}.mlp.shared_experts.down_proj.weight"]
    for j in range(n):
        got = moe.experts.w2.weight[experts + j].view(torch.uint8)
        assert torch.equal(got, down[:, j * inter : (j + 1) * inter].view(torch.uint8))
    _logits(model, hf)


def test_slots_and_separate_mlp_give_the_same_logits(fp8):
    cfgd, _, ckpt = fp8
    slots = _load(cfgd, ckpt)
    separate = _load(cfgd, ckpt, shared_experts_as_slots=False)
    for moe in _moe_layers(separate):
        assert moe.shared_slots == 0 and isinstance(moe.shared_experts, DeepseekMLP)
        assert moe.experts.w13.weight.shape[0] == cfgd["n_routed_experts"]
    for a, b in zip(_logits(slots), _logits(separate), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_unaligned_fp8_shared_experts_stay_a_separate_mlp():
    hf = build_hf_model(UNALIGNED, seed=4)
    model = _load(UNALIGNED, fp8_checkpoint(hf))
    for moe in _moe_layers(model):
        assert moe.shared_slots == 0 and isinstance(moe.shared_experts, DeepseekMLP)
    _logits(model, hf)


def test_unquantized_two_shared_experts_split_into_slots():
    """bf16/fp32 checkpoints: plain weights on both sides are the same format; the shared
    MLP of 2 * I rows goes to two slots of I."""
    cfgd = tiny_hf_config(n_shared_experts=2)
    hf = build_hf_model(cfgd, seed=6)
    model = _load(cfgd, hf.state_dict(), quant=None)
    for moe in _moe_layers(model):
        assert moe.shared_slots == 2 and moe.experts.w2.weight.shape[0] == 10
    _logits(model, hf)


def test_slots_decision():
    cfg = config_from_hf(tiny_hf_config())
    p = "model.layers.1.mlp"
    assert shared_expert_slots(cfg, p, None) == 1
    assert shared_expert_slots(cfg, p, NoQuant()) == 1
    assert shared_expert_slots(cfg, p, FP8) == 1
    # the shared expert kept unquantized beside FP8 routed experts: formats differ
    assert shared_expert_slots(cfg, p, Fp8BlockConfig((128, 128), ("shared_experts",))) == 0
    # only its down projection unquantized: still not the routed experts' format
    assert shared_expert_slots(cfg, p, Fp8BlockConfig((128, 128), ("down_proj",))) == 0
    assert shared_expert_slots(cfg, p, Fp8BlockConfig((64, 64))) == 1
    # expert parallelism holds whole routed experts per rank; plain TP splits like the MLP
    ep = TPGroup(rank=0, size=2, expert_parallel=True)
    assert shared_expert_slots(cfg, p, FP8, ep) == 0
    assert shared_expert_slots(cfg, p, FP8, TPGroup(rank=1, size=2)) == 1
    assert shared_expert_slots(_moe(cfg, n_shared_experts=0), p, FP8) == 0
    assert shared_expert_slots(_moe(cfg, shared_experts_as_slots=False), p, FP8) == 0
    # several shared experts: each must hold whole scale blocks
    two = _moe(cfg, n_shared_experts=2)
    assert shared_expert_slots(two, p, None) == 2
    assert shared_expert_slots(two, p, FP8) == 0  # 32 rows each: one block shared
    assert shared_expert_slots(_moe(two, moe_intermediate_size=128), p, FP8) == 2


@pytest.mark.parametrize(
    "like,fmt,slots",
    [
        # the mission model: BF16 shared expert beside NVFP4 routed experts
        ("kimi-k2.5", "nvfp4-modelopt", 0),
        # shared expert NVFP4 like the routed ones: slots
        ("deepseek-v3", "nvfp4-ct", 1),
        ("deepseek-v3", "fp8-block", 1),
    ],
)
def test_written_checkpoints_choose_by_format(tmp_path, like, fmt, slots):
    wc = write_checkpoint(str(tmp_path / "ck"), like, fmt)
    lm = load_model(wc.path, torch.float32)
    experts = lm.config.moe.n_routed_experts
    for moe in _moe_layers(lm.model):
        assert moe.shared_slots == slots
        for t in (*moe.experts.w13.view().values(), *moe.experts.w2.view().values()):
            assert t.shape[0] == experts + slots
        assert isinstance(moe.shared_experts, DeepseekMLP) == (slots == 0)
    # dummy weights (from config.json alone) fill the slots like any expert
    dummy = load_model(wc.path, torch.float32, load_format="dummy").model
    for moe in _moe_layers(dummy):
        for bank in (moe.experts.w13, moe.experts.w2):
            shared = bank.dense(bank.layout.num_local, torch.float32) if slots else None
            if shared is not None:
                assert shared.isfinite().all() and 0.005 < shared.std() < 0.08
    runner = PagedRunner(dummy)
    assert runner.step({runner.add_sequence(): [1, 2]}).isfinite().all()
