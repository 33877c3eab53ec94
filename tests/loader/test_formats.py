"""Every make-checkpoint format loads; dequantized weights equal the writer's ground truth;
the quantized model generates what a BF16 model of the dequantized weights generates."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import pytest
import torch

from moeserve.layers.moe import DeepseekMoE
from moeserve.layers.quant.base import UnquantizedLinearMethod
from moeserve.layers.quant.scheme import SchemeLinearMethod, dense_weight
from moeserve.loader import load_model
from moeserve.models.deepseek_v3 import DeepseekV3ForCausalLM
from moeserve.testing.checkpoints import (
    FORMATS,
    LIKES,
    add_make_checkpoint_arguments,
    run_make_checkpoint,
    write_checkpoint,
)
from tests.models.helpers import PagedRunner

BANK_PARTS = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", 0)}


def model_weight(model, name: str) -> torch.Tensor:
    """The dense fp32 value of a model-space weight name, whatever its stored format."""
    parts = name.split(".")
    if ".mlp.experts." in name:  # model.layers.i.mlp.experts.e.proj.weight
        moe = model.model.layers[int(parts[2])].mlp
        bank, part = BANK_PARTS[parts[6]]
        b = getattr(moe.experts, bank)
        return b.scheme.dequantize(b.part_tensors(int(parts[5]), part), torch.float32)
    moe = model.model.layers[int(parts[2])].mlp if ".mlp.shared_experts." in name else None
    if getattr(moe, "shared_slots", 0):  # bank slots E.. : the shared MLP is their concatenation
        bank, part = BANK_PARTS[parts[5]]
        b = getattr(moe.experts, bank)
        routed = moe.experts.layout.num_local
        pieces = [
            b.scheme.dequantize(b.part_tensors(routed + j, part), torch.float32)
            for j in range(moe.shared_slots)
        ]
        return torch.cat(pieces, 0 if bank == "w13" else 1)
    if parts[-2] in ("q_a_proj", "kv_a_proj_with_mqa"):  # merged at load: rows [q_a; kv_a]
        attn = model.model.layers[int(parts[2])].self_attn
        if attn.fused_qkv_a_proj is not None:
            w = dense_weight(attn.fused_qkv_a_proj, torch.float32)
            return w[: attn.q_lora] if parts[-2] == "q_a_proj" else w[attn.q_lora :]
    mod = model
    for p in parts[:-2]:
        mod = mod[int(p)] if p.isdigit() else getattr(mod, p)
    merged = getattr(mod, "gate_up_proj", None)
    if parts[-2] in ("gate_proj", "up_proj") and merged is not None:  # merged: [gate; up]
        w = dense_weight(merged, torch.float32)
        half = w.shape[0] // 2
        return w[:half] if parts[-2] == "gate_proj" else w[half:]
    mod = mod[int(parts[-2])] if parts[-2].isdigit() else getattr(mod, parts[-2])
    if parts[-1] == "weight" and getattr(mod, "method", None) is not None:
        return dense_weight(mod, torch.float32)
    return getattr(mod, parts[-1]).float()


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpts")


@pytest.mark.parametrize("like", LIKES)
@pytest.mark.parametrize("fmt", FORMATS)
def test_format_loads_with_exact_dequantized_weights(root, like, fmt):
    wc = write_checkpoint(str(root / f"{like}-{fmt}"), like, fmt)
    lm = load_model(wc.path, torch.float32)
    assert lm.tokenizer.chat_template
    for name, truth in wc.ground_truth.items():
        got = model_weight(lm.model, name)
        assert torch.equal(got, truth), name
    # what the writer quantized is stored quantized, everything else stays unquantized
    for layer_idx, layer in enumerate(lm.model.model.layers):
        for mname, mod in layer.named_modules():
            # a merged gate_up_proj stands for the checkpoint's gate_proj (and up_proj)
            full = f"model.layers.{layer_idx}.{mname}".replace("gate_up_proj", "gate_proj")
            if isinstance(getattr(mod, "method", None), SchemeLinearMethod):
                assert full in wc.quantized, full
            elif isinstance(getattr(mod, "method", None), UnquantizedLinearMethod):
                assert full not in wc.quantized, full
        if isinstance(layer.mlp, DeepseekMoE):
            quantized = f"model.layers.{layer_idx}.mlp.experts.0.gate_proj" in wc.quantized
            assert (layer.mlp.experts.w13.scheme.name != "bf16") == quantized


def _bf16_reference(lm, ground_truth):
    """The same architecture, unquantized, holding the dequantized weights."""
    cfg = dataclasses.replace(lm.config, weight_prefix="")
    ref = DeepseekV3ForCausalLM(cfg)
    loaded = ref.load_weights(ground_truth.items())
    assert {n for n, p in ref.named_parameters() if not getattr(p, "optional", False)} <= loaded
    return ref


@pytest.mark.parametrize(
    "like,fmt",
    [
        ("kimi-k2.5", "nvfp4-modelopt"),
        ("deepseek-v3", "nvfp4-ct"),
        ("moonlight", "nvfp4-modelopt"),
        ("deepseek-v3", "fp8-block"),
    ],
)
def test_quantized_model_generates_like_bf16_of_dequantized(root, like, fmt):
    wc = write_checkpoint(str(root / f"gen-{like}-{fmt}"), like, fmt, seed=5)
    lm = load_model(wc.path, torch.float32)
    ref = _bf16_reference(lm, wc.ground_truth)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    ours = PagedRunner(lm.model).greedy(prompt, 16)
    assert ours == PagedRunner(ref).greedy(prompt, 16)
    assert len(set(ours)) > 1  # not a degenerate constant stream


def test_exclude_modules_stay_bf16(root):
    wc = write_checkpoint(str(root / "kimi-excl"), "kimi-k2.5", "nvfp4-modelopt")
    with open(os.path.join(wc.path, "hf_quant_config.json")) as f:
        q = json.load(f)["quantization"]
    assert "language_model.layers.0.mlp*" in q["exclude_modules"]
    m = load_model(wc.path, torch.float32).model
    dense0 = m.model.layers[0].mlp  # excluded: bf16, so gate and up are one merged GEMM
    assert isinstance(dense0.gate_up_proj.method, UnquantizedLinearMethod)
    assert dense0.gate_up_proj.weight.dtype == torch.float32
    moe = m.model.layers[1].mlp
    assert isinstance(moe.shared_experts.down_proj.method, UnquantizedLinearMethod)
    assert isinstance(m.model.layers[1].self_attn.kv_b_proj.method, UnquantizedLinearMethod)
    assert moe.experts.w2.weight.dtype == torch.uint8
    assert moe.experts.w2.weight_scale.dtype == torch.float8_e4m3fn


def test_weight_only_and_fp8_kv_cache(root):
    wc = write_checkpoint(
        str(root / "w4a16"), "deepseek-v3", "nvfp4-modelopt", w4a4=False, kv_fp8=True
    )
    lm = load_model(wc.path, torch.float32)
    assert lm.kv_cache_dtype == torch.float8_e4m3fn  # auto follows kv_cache_quant_algo
    attn = lm.model.attention_layers()
    assert float(attn[0].kv_scale) == pytest.approx(0.01)  # max(k_scale, v_scale)
    assert float(attn[1].kv_scale) == pytest.approx(0.02)
    assert not hasattr(lm.model.model.layers[1].mlp.experts.w13, "input_scale")
    assert (
        load_model(wc.path, torch.float32, kv_cache_dtype="bf16").kv_cache_dtype == torch.bfloat16
    )
    runner = PagedRunner(lm.model, kv_dtype=lm.kv_cache_dtype)
    assert len(runner.greedy([1, 2, 3], 4)) == 4


def test_single_file_dummy_and_cut_layers(root):
    wc = write_checkpoint(str(root / "single"), "moonlight", "bf16", shards=1)
    assert os.path.exists(os.path.join(wc.path, "model.safetensors"))
    assert not os.path.exists(os.path.join(wc.path, "model.safetensors.index.json"))
    lm = load_model(wc.path, torch.float32, num_layers=1)
    assert len(lm.model.model.layers) == 1
    nv = write_checkpoint(str(root / "dummy-src"), "kimi-k2.5", "nvfp4-modelopt")
    os.remove(os.path.join(nv.path, "model-00001-of-00003.safetensors"))  # dummy needs no weights
    dummy = load_model(nv.path, torch.float32, load_format="dummy")
    assert dummy.model.model.layers[1].mlp.experts.w13.weight.dtype == torch.uint8
    runner = PagedRunner(dummy.model)
    logits = runner.step({runner.add_sequence(): [1, 2, 3]})
    assert torch.isfinite(logits).all()


def test_make_checkpoint_cli(tmp_path):
    parser = argparse.ArgumentParser()
    add_make_checkpoint_arguments(parser)
    args = parser.parse_args(
        [
            str(tmp_path / "c"),
            "--like",
            "deepseek-v3",
            "--format",
            "nvfp4-ct",
            "--layers",
            "3",
            "--experts",
            "4",
        ]
    )
    assert run_make_checkpoint(args) == 0
    with open(tmp_path / "c" / "config.json") as f:
        cfg = json.load(f)
    assert cfg["num_hidden_layers"] == 3 and cfg["n_routed_experts"] == 4
    assert cfg["quantization_config"]["format"] == "nvfp4-pack-quantized"
    with open(tmp_path / "c" / "model.safetensors.index.json") as f:
        assert len(set(json.load(f)["weight_map"].values())) == 3
    lm = load_model(str(tmp_path / "c"), torch.float32)
    assert len(lm.model.model.layers) == 3
