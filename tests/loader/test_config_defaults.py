"""Configs as their producers mean them: a DeepseekV3 config saved by transformers 5 (which
writes no topk_method / scoring_func) describes the same routing as DeepSeek's own published
config.json, which spells everything out."""

from __future__ import annotations

import json

import pytest

from moeserve.models.registry import config_from_hf

# deepseek-ai/DeepSeek-V3 config.json as published (architecture fields; quantization and
# auto_map left out)
PUBLISHED_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "ep_size": 1,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc",
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
}

ROUTING = (
    "topk_method",
    "scoring_func",
    "n_group",
    "topk_group",
    "first_k_dense_replace",
    "moe_layer_freq",
    "routed_scaling_factor",
    "norm_topk_prob",
    "n_routed_experts",
    "num_experts_per_tok",
)


def _saved_by_transformers(tmp_path, **kw) -> dict:
    from transformers import DeepseekV3Config

    DeepseekV3Config(**kw).save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


def test_transformers_5_config_routes_like_the_published_one(tmp_path):
    saved = _saved_by_transformers(
        tmp_path,
        max_position_embeddings=163840,
        rope_scaling=PUBLISHED_V3["rope_scaling"],
    )
    assert not {"topk_method", "scoring_func", "moe_layer_freq"} & set(saved)
    ours, ref = config_from_hf(saved), config_from_hf(PUBLISHED_V3)
    for name in ROUTING:
        assert getattr(ours.moe, name) == getattr(ref.moe, name), name
    assert ours.rope_scaling == ref.rope_scaling
    assert [ours.is_moe_layer(i) for i in range(61)] == [ref.is_moe_layer(i) for i in range(61)]


@pytest.mark.parametrize("drop", ["topk_method", "scoring_func", "n_group", "norm_topk_prob"])
def test_an_omitted_v3_field_takes_transformers_default(drop):
    ref = config_from_hf(PUBLISHED_V3)
    partial = {k: v for k, v in PUBLISHED_V3.items() if k != drop}
    assert getattr(config_from_hf(partial).moe, drop) == getattr(ref.moe, drop)


def test_deepseek_v2_keeps_its_own_defaults():
    v2 = {
        k: v
        for k, v in PUBLISHED_V3.items()
        if k not in ROUTING and k not in ("architectures", "rope_scaling")
    }
    v2.update(model_type="deepseek_v2", architectures=["DeepseekV2ForCausalLM"])
    v2.update(n_routed_experts=64, num_experts_per_tok=6)
    cfg = config_from_hf(v2)
    assert (cfg.moe.topk_method, cfg.moe.scoring_func, cfg.moe.n_group) == ("greedy", "softmax", 1)
    assert (cfg.moe.routed_scaling_factor, cfg.moe.norm_topk_prob) == (1.0, False)
