"""A checkpoint written by NVIDIA's own exporter (nvidia-modelopt, a producer that is not
ours) loads, keeps its excluded modules in BF16, and generates what HF transformers
generates from its dequantized weights."""

from __future__ import annotations

import glob
import json
import os
import warnings

import pytest
import torch
from safetensors import safe_open

from moeserve.kernels.gemm.nvfp4_format import dequantize_nvfp4
from moeserve.layers.quant.base import UnquantizedLinearMethod
from moeserve.layers.quant.scheme import SchemeLinearMethod
from moeserve.loader import load_model
from tests.models.helpers import YARN, PagedRunner, build_hf_model, hf_greedy, tiny_hf_config

mtq = pytest.importorskip("modelopt.torch.quantization")
export = pytest.importorskip("modelopt.torch.export")


def _dequantized_state(folder: str) -> dict[str, torch.Tensor]:
    """The exported tensors, NVFP4 ones dequantized (fp32), experts stacked the HF-5 way."""
    raw: dict[str, torch.Tensor] = {}
    for path in glob.glob(os.path.join(folder, "*.safetensors")):
        with safe_open(path, "pt") as f:
            for k in f.keys():
                raw[k] = f.get_tensor(k)
    out: dict[str, torch.Tensor] = {}
    for k, t in raw.items():
        if k.endswith((".weight_scale", ".weight_scale_2", ".input_scale")):
            continue
        if t.dtype == torch.uint8:
            base = k[: -len(".weight")]
            t = dequantize_nvfp4(
                t, raw[f"{base}.weight_scale"], raw[f"{base}.weight_scale_2"], torch.float32
            )
        out[k] = t.float()
    stacked: dict[str, torch.Tensor] = {}
    layers = {k.split(".experts.")[0] for k in out if ".experts." in k}
    for prefix in layers:
        n = 1 + max(
            int(k.split(".experts.")[1].split(".")[0])
            for k in out
            if k.startswith(prefix + ".experts.")
        )
        g = [out.pop(f"{prefix}.experts.{e}.gate_proj.weight") for e in range(n)]
        u = [out.pop(f"{prefix}.experts.{e}.up_proj.weight") for e in range(n)]
        d = [out.pop(f"{prefix}.experts.{e}.down_proj.weight") for e in range(n)]
        stacked[f"{prefix}.experts.gate_up_proj"] = torch.stack(
            [torch.cat([a, b]) for a, b in zip(g, u, strict=True)]
        )
        stacked[f"{prefix}.experts.down_proj"] = torch.stack(d)
    out.update(stacked)
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("modelopt"))
    from transformers import DeepseekV3Config

    # only DeepseekV3Config's own fields: the config.json is then exactly what transformers 5
    # writes (no topk_method, scoring_func or moe_layer_freq; noaux_tc + sigmoid implied)
    own = set(DeepseekV3Config().to_dict())
    cfgd = {
        k: v
        for k, v in tiny_hf_config(rope_scaling=YARN, max_position_embeddings=64 * 40).items()
        if k in own
    }
    hf = build_hf_model(cfgd, seed=2).to(torch.bfloat16)
    hf.config.architectures = ["DeepseekV3ForCausalLM"]
    gen = torch.Generator().manual_seed(0)

    def calibrate(m):
        for _ in range(2):
            m(torch.randint(0, cfgd["vocab_size"], (1, 16), generator=gen))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mtq.quantize(hf, mtq.NVFP4_DEFAULT_CFG, calibrate)
        export.export_hf_checkpoint(hf, export_dir=folder)
    # the tiny tokenizer of a deepseek-v3 make-checkpoint folder (modelopt writes none)
    from moeserve.testing.checkpoints import write_deepseek_tokenizer

    write_deepseek_tokenizer(folder, 50)
    return folder, cfgd


def test_modelopt_export_layout(exported):
    folder, _ = exported
    with open(os.path.join(folder, "config.json")) as f:
        written = json.load(f)
    # what transformers 5 writes for a DeepseekV3 model: routing fields left to its defaults
    assert written["model_type"] == "deepseek_v3"
    assert not {"topk_method", "scoring_func", "moe_layer_freq"} & set(written)
    with open(os.path.join(folder, "hf_quant_config.json")) as f:
        q = json.load(f)["quantization"]
    assert q["quant_algo"] == "NVFP4"
    assert "lm_head" in q["exclude_modules"]
    assert any(p.endswith("mlp.gate") for p in q["exclude_modules"])


def test_modelopt_export_generates_like_hf(exported):
    folder, cfgd = exported
    lm = load_model(folder, torch.float32)
    layer1 = lm.model.model.layers[1]
    assert layer1.mlp.experts.w13.weight.dtype == torch.uint8  # stays NVFP4 in memory
    assert layer1.self_attn.kv_b_proj.weight.dtype == torch.uint8  # attention quantized too
    assert (
        isinstance(lm.model.lm_head, torch.nn.Module)
        and lm.model.lm_head.weight.dtype == torch.float32
    )

    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    hf_cfg = DeepseekV3Config(
        **{k: v for k, v in cfgd.items() if k not in ("architectures", "model_type", "torch_dtype")}
    )
    hf_cfg._attn_implementation = "eager"
    hf = DeepseekV3ForCausalLM(hf_cfg).float().eval()
    missing, unexpected = hf.load_state_dict(_dequantized_state(folder), strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    prompt = [9, 8, 7, 6, 5, 4, 3]
    runner = PagedRunner(lm.model)
    seq = runner.add_sequence()
    ours = runner.step({seq: prompt})[0]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1]
    assert (ours - ref).abs().max() < 1e-3
    assert PagedRunner(lm.model).greedy(prompt, 24) == hf_greedy(hf, prompt, 24)


def test_excluded_router_and_lm_head_stay_unquantized(exported):
    folder, _ = exported
    lm = load_model(folder, torch.float32)
    assert lm.model.model.layers[1].mlp.gate.weight.dtype == torch.float32
    # modelopt quantizes the dense layer's MLP (not in exclude_modules)
    assert isinstance(lm.model.model.layers[0].mlp.gate_proj.method, SchemeLinearMethod)
    assert not isinstance(lm.model.model.layers[0].mlp.gate_proj.method, UnquantizedLinearMethod)
