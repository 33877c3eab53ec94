"""llama.cpp `deepseek2` GGUF files (DeepSeek-V2/V3/R1, Kimi-K2, Moonlight) -> the config and
HF tensor names of `DeepseekV3ForCausalLM`.

Metadata. llama.cpp treats MLA as multi-query attention over the latent, so its converter
writes `head_count_kv = 1`, `key_length = kv_lora_rank + rope dims` and `value_length =
kv_lora_rank`, and the per-head sizes under `key_length_mla` (nope + rope) and
`value_length_mla` (v). Files from converters older than that split have no `*_mla` keys; there
`key_length` is nope + rope and `value_length` is v. `rope.scaling.yarn_log_multiplier` is
0.1 * mscale_all_dim (the converter's own factor, which llama.cpp divides out again).

MTP. llama.cpp's deepseek2 converter drops DeepSeek-V3's MTP layer; a file that keeps it has
`nextn_predict_layers` > 0, `block_count` counting it, and its block under the main layers'
names plus gguf-py's `nextn.*` names (eh_proj, enorm, hnorm, shared_head_norm/_head,
embed_tokens), the layout llama.cpp's own converter writes for DeepSeek-V3.2.

Tensors. Newer converters replace `attn_kv_b` [heads*(nope+v), kv_lora] by `attn_k_b`
[heads, kv_lora, nope] (each head's nope rows, transposed) and `attn_v_b` [heads, v, kv_lora];
kv_b_proj is rebuilt from the two. Routed experts are stacked [E, out, in] (`ffn_*_exps`) and
are fed one expert at a time (the converter's `--fuse-gate-up-exps` does not apply to
deepseek2, so no file has `ffn_gate_up_exps`).
No row permutation: the converter (`DeepseekV2Model.modify_tensors`) writes q and kv_a rows as
the HF checkpoint has them, and llama.cpp ropes adjacent pairs, DeepSeek's own layout.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from moeserve.config import ModelConfig
from moeserve.errors import LoadError

log = logging.getLogger(__name__)

# llama.cpp's `expert_gating_func` enum; files without the key are DeepSeek-V2 (softmax)
_GATING = {1: "softmax", 2: "sigmoid"}
_YARN_LOG_MUL_PER_MSCALE = 0.1  # yarn_log_multiplier = 0.1 * mscale_all_dim (converter)

_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "exp_probs_b.weight": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    # an MTP block's own tensors (gguf-py's NEXTN names; the decoder block's are as above)
    "nextn.eh_proj.weight": "eh_proj.weight",
    "nextn.enorm.weight": "enorm.weight",
    "nextn.hnorm.weight": "hnorm.weight",
    "nextn.shared_head_norm.weight": "shared_head.norm.weight",
    "nextn.shared_head_head.weight": "shared_head.head.weight",
    "nextn.embed_tokens.weight": "embed_tokens.weight",
}
# stacked [E, out, in] -> one `mlp.experts.{e}.{proj}.weight` per expert
_EXPERTS = {
    "ffn_gate_exps.weight": "gate_proj",
    "ffn_up_exps.weight": "up_proj",
    "ffn_down_exps.weight": "down_proj",
}
_K_B, _V_B = "attn_k_b.weight", "attn_v_b.weight"
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


def _f32(v: Any) -> float:
    """A float32 metadata value as the decimal it was written from (1e-6, not 9.99e-07)."""
    return float(str(np.float32(v)))


def _one(value: Any, what: str, layers: range) -> int:
    """A per-layer key stored either once or as an array: its one value over `layers` (0 when
    there are none)."""
    if not isinstance(value, list):
        return int(value)
    distinct = {int(value[i]) for i in layers}
    if not distinct:
        return 0
    if len(distinct) != 1:
        raise LoadError(f"GGUF {what} differs between layers ({sorted(distinct)}); not supported")
    return distinct.pop()


def _rope_scaling(m: dict[str, Any]) -> dict[str, Any] | None:
    kind = m.get("rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"type": "linear", "rope_type": "linear", "factor": _f32(m["rope.scaling.factor"])}
    if kind != "yarn":
        raise LoadError(f"GGUF rope scaling {kind!r} is not supported for deepseek2")
    if _f32(m.get("rope.scaling.yarn_attn_factor", 1.0)) != 1.0:
        raise LoadError("GGUF rope.scaling.yarn_attn_factor other than 1 is not supported")
    # llama.cpp scales the softmax by mscale(factor, mscale_all_dim)^2 and leaves cos/sin at
    # magnitude 1, which is HF's YaRN with mscale == mscale_all_dim (DeepSeek and Kimi: 1.0)
    mscale = _f32(m.get("rope.scaling.yarn_log_multiplier", 0.0)) / _YARN_LOG_MUL_PER_MSCALE
    mscale = round(mscale, 6)
    return {
        "type": "yarn",
        "rope_type": "yarn",
        "factor": _f32(m["rope.scaling.factor"]),
        "original_max_position_embeddings": int(m["rope.scaling.original_context_length"]),
        "beta_fast": _f32(m.get("rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": _f32(m.get("rope.scaling.yarn_beta_slow", 1.0)),
        "mscale": mscale,
        "mscale_all_dim": mscale,
    }


def deepseek2_hf_config(
    meta: dict[str, Any], tensor_names: set[str], vocab_size: int
) -> dict[str, Any]:
    """An HF DeepseekV3 config.json dict from a deepseek2 file's key/values (`meta`: keys
    without the `deepseek2.` prefix) and its tensor names."""
    m = meta
    nextn = int(m.get("nextn_predict_layers", 0))
    layers = int(m["block_count"]) - nextn
    rope = int(m["rope.dimension_count"])
    if "attention.key_length_mla" in m:
        qk_head, v_head = int(m["attention.key_length_mla"]), int(m["attention.value_length_mla"])
    else:
        qk_head, v_head = int(m["attention.key_length"]), int(m["attention.value_length"])
    experts = int(m.get("expert_count", 0))
    dense = int(m.get("leading_dense_block_count", 0 if experts else layers))
    moe_layers = range(min(dense, layers), layers)
    gating = int(m.get("expert_gating_func", 1))
    if gating not in _GATING:
        raise LoadError(f"GGUF expert_gating_func {gating} is not supported (softmax or sigmoid)")
    scoring = _GATING[gating]
    has_bias = any(n.startswith("blk.") and ".exp_probs_b." in n for n in tensor_names)
    if has_bias and scoring != "sigmoid":
        raise LoadError("GGUF router bias (exp_probs_b) with softmax gating is not supported")
    n_group = int(m.get("expert_group_count", 1))
    if scoring == "sigmoid":
        topk_method = "noaux_tc"  # without exp_probs_b: a zero bias (see iter_deepseek2_weights)
    else:
        topk_method = "group_limited_greedy" if n_group > 1 else "greedy"
    heads = _one(m["attention.head_count"], "attention.head_count", range(layers))
    q_lora = "blk.0.attn_q_a.weight" in tensor_names
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab_size,
        "hidden_size": int(m["embedding_length"]),
        "intermediate_size": _one(m["feed_forward_length"], "feed_forward_length", range(dense)),
        "moe_intermediate_size": (
            _one(m["expert_feed_forward_length"], "expert_feed_forward_length", moe_layers)
            if experts
            else 0
        ),
        "num_hidden_layers": layers,
        "num_nextn_predict_layers": nextn,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "q_lora_rank": int(m["attention.q_lora_rank"]) if q_lora else None,
        "kv_lora_rank": int(m["attention.kv_lora_rank"]),
        "qk_nope_head_dim": qk_head - rope,
        "qk_rope_head_dim": rope,
        "v_head_dim": v_head,
        "n_routed_experts": experts,
        "n_shared_experts": int(m.get("expert_shared_count", 0)),
        "num_experts_per_tok": int(m.get("expert_used_count", 0)),
        "first_k_dense_replace": dense,
        "moe_layer_freq": 1,
        "n_group": n_group,
        "topk_group": int(m.get("expert_group_used_count", 1)),
        "topk_method": topk_method,
        "scoring_func": scoring,
        "routed_scaling_factor": _f32(m.get("expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(m.get("expert_weights_norm", False)),
        "rms_norm_eps": _f32(m.get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(m.get("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(m),
        "max_position_embeddings": int(m.get("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": False,
        "torch_dtype": "float32",  # every GGUF tensor is dequantized to fp32 on load
    }


def hf_name(gguf_name: str) -> str | None:
    """The HF name of a deepseek2 tensor that maps one to one (None: handled otherwise)."""
    if gguf_name in _GLOBAL:
        return _GLOBAL[gguf_name]
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _BLOCK:
        return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}"
    return None


def kv_b_from_split(k_b: torch.Tensor, v_b: torch.Tensor) -> torch.Tensor:
    """kv_b_proj [heads*(nope+v), kv_lora] from attn_k_b [heads, kv_lora, nope] and attn_v_b
    [heads, v, kv_lora] (per head: its nope rows, then its v rows)."""
    heads, kv_lora, _ = k_b.shape
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, kv_lora).contiguous()


Dequantize = Callable[[Any, int | None], torch.Tensor]


def iter_deepseek2_weights(
    reader: Any, cfg: ModelConfig, dequantize: Dequantize
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, fp32 tensor) for every tensor of the file the model takes, one at a time
    (stacked experts one expert at a time)."""
    pending: dict[int, dict[str, torch.Tensor]] = {}
    for t in tqdm(reader.tensors, desc="Loading GGUF", unit="tensor", leave=False):
        m = _BLOCK_RE.match(t.name)
        layer, kind = (int(m.group(1)), m.group(2)) if m else (None, t.name)
        if layer is not None and layer >= cfg.num_hidden_layers and layer != cfg.mtp_index:
            continue  # MTP layers not drafted with, or layers cut by num_layers
        name = hf_name(t.name)
        if name is not None:
            yield name, dequantize(t, None)
        elif kind in _EXPERTS:
            for e in range(int(t.shape[-1])):
                yield (
                    f"model.layers.{layer}.mlp.experts.{e}.{_EXPERTS[kind]}.weight",
                    dequantize(t, e),
                )
        elif kind in (_K_B, _V_B):
            halves = pending.setdefault(layer, {})
            halves[kind] = dequantize(t, None)
            if len(halves) == 2:
                del pending[layer]
                kv_b = kv_b_from_split(halves[_K_B], halves[_V_B])
                yield f"model.layers.{layer}.self_attn.kv_b_proj.weight", kv_b
        else:
            log.info("GGUF tensor %s skipped (not used by this model)", t.name)
    if pending:
        raise LoadError(
            f"GGUF file has attn_k_b without attn_v_b (or back) in layer {min(pending)}"
        )
    moe = cfg.moe
    routed_bias = moe is not None and moe.topk_method == "noaux_tc"
    if routed_bias and not any(".exp_probs_b." in t.name for t in reader.tensors):
        # sigmoid routing without a correction bias: noaux_tc with a zero bias is that routing
        for i in range(cfg.num_hidden_layers):
            if cfg.is_moe_layer(i):
                bias = torch.zeros(moe.n_routed_experts)
                yield f"model.layers.{i}.mlp.gate.e_score_correction_bias", bias
