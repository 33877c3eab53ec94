"""q_a_proj + kv_a_proj_with_mqa merged into one GEMM at load time: BF16, block-FP8 and NVFP4
checkpoints give the same logits and greedy tokens as the same checkpoint loaded unmerged
(two layers, the path tests/models checks against HF transformers); misaligned FP8 blocks
keep two GEMMs, and NVFP4 shards with different global scales scale their output columns."""

from __future__ import annotations

import glob
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import moeserve.layers.attention.mla as mla_mod
from moeserve.layers.linear import MergedReplicatedLinear, ReplicatedLinear
from moeserve.layers.quant.fp8_block import Fp8BlockConfig
from moeserve.layers.quant.nvfp4 import CompressedTensorsNvfp4Config, ModelOptNvfp4Config
from moeserve.layers.quant.parse import quant_config_from_checkpoint
from moeserve.models.deepseek_v3 import DeepseekV3ForCausalLM
from moeserve.models.registry import config_from_hf
from moeserve.testing.checkpoints import (
    TinyShape,
    _modelopt_global,
    quantize_nvfp4_with_global,
    write_checkpoint,
)
from tests.models.helpers import PagedRunner

PROMPT = [5, 6, 7, 8, 9, 10, 11, 40, 41]
A_PROJS = ("q_a_proj", "kv_a_proj_with_mqa")


def _tensors(path: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(f, "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def _load(path: str, merge: bool, monkeypatch) -> DeepseekV3ForCausalLM:
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    cfg, quant = config_from_hf(raw), quant_config_from_checkpoint(path, raw)
    with monkeypatch.context() as m:
        if not merge:
            m.setattr(mla_mod, "mergeable", lambda *a: False)
        model = DeepseekV3ForCausalLM(cfg, quant)
    loaded = model.load_weights(_tensors(path).items())
    required = {n for n, p in model.named_parameters() if not getattr(p, "optional", False)}
    assert required <= loaded, required - loaded
    return model.eval()


def _run(model) -> tuple[torch.Tensor, list[int]]:
    """Prefill logits, then 6 greedy decode steps."""
    runner = PagedRunner(model, page_size=4)
    s = runner.add_sequence()
    first = logits = runner.step({s: PROMPT})[0]
    tokens = []
    for _ in range(6):
        tokens.append(int(logits.argmax()))
        logits = runner.step({s: [tokens[-1]]})[0]
    return first, tokens


def _compare(path: str, monkeypatch, merged_expected: bool) -> DeepseekV3ForCausalLM:
    merged, plain = _load(path, True, monkeypatch), _load(path, False, monkeypatch)
    for layer in merged.attention_layers():
        assert (layer.fused_qkv_a_proj is not None) == merged_expected
    assert all(layer.fused_qkv_a_proj is None for layer in plain.attention_layers())
    (lm, tm), (lp, tp) = _run(merged), _run(plain)
    assert lp.abs().max() > 0.1
    torch.testing.assert_close(lm, lp, rtol=1e-5, atol=1e-5)
    assert tm == tp and len(set(tm)) > 1
    return merged


@pytest.mark.parametrize(
    ("like", "fmt", "shape", "merged"),
    [
        ("kimi-k2.5", "bf16", TinyShape(), True),
        # q_lora 128: the q_a rows end on a 128-row FP8 block, so the scale rows line up
        ("deepseek-v3", "fp8-block", TinyShape(q_lora=128), True),
        # q_lora 32: q_a and kv_a would share a scale block: kept as two GEMMs
        ("deepseek-v3", "fp8-block", TinyShape(), False),
    ],
)
def test_merged_checkpoint_logits_equal_unmerged(tmp_path, monkeypatch, like, fmt, shape, merged):
    path = str(tmp_path / f"{like}-{fmt}")
    write_checkpoint(path, like, fmt, shape=shape, seed=3)
    model = _compare(path, monkeypatch, merged)
    if fmt == "fp8-block" and merged:
        fused = model.attention_layers()[0].fused_qkv_a_proj
        assert fused.weight.dtype == torch.float8_e4m3fn
        # 128 q_a rows = 1 scale row, then the 40 kv_a rows' own scale row
        truth = _tensors(path)
        sc = [truth[f"model.layers.0.self_attn.{p}.weight_scale_inv"] for p in A_PROJS]
        assert torch.equal(fused.weight_scale_inv, torch.cat(sc))


def _nvfp4_attention(path: str, shared_global: bool) -> None:
    """Rewrite a tiny DeepSeek NVFP4 checkpoint so q_a_proj and kv_a_proj_with_mqa are NVFP4
    too (ModelOpt layout), with one global scale for both or each its own."""
    tensors = _tensors(path)
    with open(os.path.join(path, "config.json")) as f:
        layers = json.load(f)["num_hidden_layers"]
    for i in range(layers):
        names = [f"model.layers.{i}.self_attn.{p}" for p in A_PROJS]
        ws = [tensors.pop(f"{n}.weight").float() for n in names]
        amax = [w.abs().amax() for w in ws]
        for n, w, a in zip(names, ws, amax, strict=True):
            gs = _modelopt_global(torch.stack(amax).amax() if shared_global else a)
            packed, scale = quantize_nvfp4_with_global(w, gs)
            tensors[f"{n}.weight"], tensors[f"{n}.weight_scale"] = packed, scale
            tensors[f"{n}.weight_scale_2"] = gs.reshape(()).clone()
            tensors[f"{n}.input_scale"] = torch.tensor(0.01)
    for f in glob.glob(os.path.join(path, "*.safetensors*")):
        os.remove(f)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "m.safetensors"))
    qpath = os.path.join(path, "hf_quant_config.json")
    with open(qpath) as f:
        q = json.load(f)
    excl = [p for p in q["quantization"]["exclude_modules"] if "self_attn" not in p]
    for i in range(layers):
        excl += [f"model.layers.{i}.self_attn.{p}" for p in ("q_b_proj", "kv_b_proj", "o_proj")]
    q["quantization"]["exclude_modules"] = excl
    with open(qpath, "w") as f:
        json.dump(q, f)


@pytest.mark.parametrize("shared_global", [True, False])
def test_nvfp4_attention_merged(tmp_path, monkeypatch, shared_global):
    """One global scale for q_a and kv_a (what ModelOpt exports for layers sharing an input):
    one NVFP4 GEMM. Different globals: the same GEMM, each shard's columns rescaled."""
    path = str(tmp_path / "dsv3-nvfp4")
    write_checkpoint(path, "deepseek-v3", "nvfp4-modelopt", seed=4)
    _nvfp4_attention(path, shared_global)
    model = _compare(path, monkeypatch, merged_expected=True)
    fused = model.attention_layers()[0].fused_qkv_a_proj
    assert fused.weight.dtype == torch.uint8
    assert fused.weight_scale_2.shape == ()  # one scalar for the kernel
    assert (fused.shard_scale is None) == shared_global


def test_mergeable_rules():
    fp8 = Fp8BlockConfig((128, 128))
    a = ["model.layers.0.self_attn.q_a_proj", "model.layers.0.self_attn.kv_a_proj_with_mqa"]
    assert mla_mod.mergeable(fp8, a, [1536, 576], 7168)
    assert not mla_mod.mergeable(fp8, a, [96, 576], 7168)
    assert mla_mod.mergeable(None, a, [96, 576], 7168)
    nv = ModelOptNvfp4Config("NVFP4", ())
    assert mla_mod.mergeable(nv, a, [96, 576], 7168)
    # one of the two excluded from quantization: different methods, two GEMMs
    assert not mla_mod.mergeable(ModelOptNvfp4Config("NVFP4", (a[0],)), a, [96, 576], 7168)


@pytest.mark.parametrize("shared", [True, False])
@pytest.mark.parametrize("fmt", ["modelopt", "ct"])
def test_merged_layer_per_shard_globals(fmt, shared):
    """Per-shard scalar scales load one value per shard and become the scalar the kernels
    take; the merged output equals the two layers' outputs side by side."""
    gen = torch.Generator().manual_seed(0)
    quant = (
        ModelOptNvfp4Config("NVFP4", ())
        if fmt == "modelopt"
        else CompressedTensorsNvfp4Config(True, ())
    )
    sizes, k = [32, 24], 64
    merged = MergedReplicatedLinear(k, sizes, quant=quant, prefix="x")
    parts = [ReplicatedLinear(k, n, quant=quant, prefix="x") for n in sizes]
    ws = [torch.randn(n, k, generator=gen) * (1 + 3 * i) for i, n in enumerate(sizes)]
    one = _modelopt_global(torch.stack([w.abs().amax() for w in ws]).amax())
    for i, (w, part) in enumerate(zip(ws, parts, strict=True)):
        gs = one if shared else _modelopt_global(w.abs().amax())
        packed, scale = quantize_nvfp4_with_global(w, gs)
        if fmt == "modelopt":
            t = {"weight": packed, "weight_scale": scale, "weight_scale_2": gs.reshape(())}
            t["input_scale"] = torch.tensor(0.1 * (i + 1))
        else:
            t = {
                "weight_packed": packed,
                "weight_scale": scale,
                "weight_global_scale": 1 / gs[None],
            }
            t["input_global_scale"] = torch.tensor([10.0 * (i + 1)])
        for name, v in t.items():
            getattr(merged, name).weight_loader(getattr(merged, name), v, i)
            getattr(part, name).weight_loader(getattr(part, name), v)
    gname = "weight_scale_2" if fmt == "modelopt" else "weight_global_scale"
    aname = "input_scale" if fmt == "modelopt" else "input_global_scale"
    assert getattr(merged, gname).shape[0] == 2
    merged.process_weights_after_loading()
    assert getattr(merged, gname).shape == getattr(parts[0], gname).shape
    assert float(getattr(merged, aname).reshape(())) == float(getattr(parts[1], aname).reshape(()))
    assert (merged.shard_scale is None) == shared
    x = torch.randn(3, k, generator=gen)
    want = torch.cat([p(x) for p in parts], dim=-1)
    torch.testing.assert_close(merged(x), want, rtol=1e-5, atol=1e-6)
