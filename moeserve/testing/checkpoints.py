"""`moeserve make-checkpoint`: tiny random checkpoints in the exact published layouts.

Layouts (see shared/SPECS.md):
- bf16: BF16 tensors (the router's `e_score_correction_bias` in fp32, as DeepSeek ships it);
- fp8-block: DeepSeek-V3 FP8: every linear weight of the decoder layers in e4m3 with a fp32
  `weight_scale_inv` per 128x128 block; config.json `quantization_config` quant_method fp8;
- nvfp4-modelopt: ModelOpt NVFP4 (`weight` uint8, `weight_scale` e4m3, `weight_scale_2`,
  `input_scale` for W4A4), hf_quant_config.json + config.json `quantization_config`;
  gate/up of one expert or MLP share one global scale, as ModelOpt exports them;
- nvfp4-ct: compressed-tensors `nvfp4-pack-quantized` (`weight_packed`, `weight_scale`,
  `weight_global_scale` = the reciprocal global, `input_global_scale`).
What is quantized follows the public exports: Kimi-K2.5 NVFP4 quantizes the routed experts
only; DeepSeek-R1-FP4 style (deepseek-v3, moonlight) quantizes every MLP and leaves
attention, the router, lm_head and the MTP layer in BF16.

`--like kimi-k2.5` writes a KimiK25ForConditionalGeneration folder (text_config, a tiny
vision tower and projector that text serving skips; NVFP4 exports use the
`language_model.layers.N` names without `.model.`, as NVIDIA's), a tiktoken.model and its
tokenizer_config.json. Tokenizer choice: the BPE ranks are learned here from a small
multilingual sample (all 256 bytes + merges); the 256 Kimi special tokens follow at
`len(ranks) + k`, i.e. the published ids 163584 + k shifted down to the tiny vocabulary
(relative order and offsets kept). `--like deepseek-v3|moonlight` writes a tokenizer.json
(byte-level BPE via `tokenizers`) and a tokenizer_config.json with a chat template.
deepseek-v3 also writes one MTP layer (num_nextn_predict_layers 1) that loaders skip.
"""

from __future__ import annotations

import argparse
import base64
import collections
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import save_file

from moeserve.kernels.gemm.fp8_block_gemm import dequantize_fp8_block, quantize_fp8_block
from moeserve.kernels.gemm.nvfp4_format import (
    E2M1_MAX,
    E4M3_MAX,
    NVFP4_BLOCK,
    dequantize_nvfp4,
    nvfp4_global_scale,
    quantize_nvfp4_with_global,
)
from moeserve.models.registry import BUILTIN

# the layouts the architecture table names as written by this module
LIKES = tuple(like for arch in BUILTIN for like in arch.checkpoint_likes)
FORMATS = ("bf16", "fp8-block", "nvfp4-modelopt", "nvfp4-ct")
FP8_WEIGHT_BLOCK = 128
MODELOPT_VERSION = "0.47.0"
KIMI_SPECIAL_BASE_PUBLISHED = 163584
VISION_PATCH = 14  # MoonViT's patch side, in pixels
VISION_MERGE = 4  # patches merged into one token (2 x 2)
KIMI_NUM_SPECIAL = 256
KIMI_PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
# offset from the first special id -> token (published Kimi-K2/K2.5 tokenizer_config.json)
KIMI_SPECIALS = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|im_end|>",
    3: "<|im_user|>",
    4: "<|im_assistant|>",
    6: "<|start_header_id|>",
    7: "<|end_header_id|>",
    9: "[EOT]",
    10: "<|im_system|>",
    11: "<|tool_calls_section_begin|>",
    12: "<|tool_calls_section_end|>",
    13: "<|tool_call_begin|>",
    14: "<|tool_call_argument_begin|>",
    15: "<|tool_call_end|>",
    17: "<|im_middle|>",
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    22: "<think>",
    23: "</think>",
    254: "[UNK]",
    255: "[PAD]",
}
DEEPSEEK_SPECIALS = [
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜▁pad▁｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
    "<｜tool▁outputs▁begin｜>",
    "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>",
    "<｜tool▁output▁end｜>",
]
# DeepSeek-V3's template, reduced to system/user/assistant/tool turns (same token layout)
DEEPSEEK_CHAT_TEMPLATE = (
    "{% set ns = namespace(system='') %}"
    "{% for m in messages %}{% if m['role'] == 'system' %}"
    "{% set ns.system = ns.system + m['content'] %}{% endif %}{% endfor %}"
    "{{ bos_token }}{{ ns.system }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{{ '<｜Assistant｜>' + (m['content'] or '') }}"
    "{% if m.get('tool_calls') %}{{ '<｜tool▁calls▁begin｜>' }}{% for tc in m['tool_calls'] %}"
    "{{ '<｜tool▁call▁begin｜>function<｜tool▁sep｜>' + tc['function']['name'] + '\\n```json\\n'"
    " + (tc['function']['arguments'] if tc['function']['arguments'] is string"
    " else tc['function']['arguments'] | tojson) + '\\n```<｜tool▁call▁end｜>' }}{% endfor %}"
    "{{ '<｜tool▁calls▁end｜>' }}{% endif %}{{ '<｜end▁of▁sentence｜>' }}"
    "{% elif m['role'] == 'tool' %}"
    "{{ '<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + m['content']"
    " + '<｜tool▁output▁end｜><｜tool▁outputs▁end｜>' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}"
)
# a Jinja rendition of the Kimi format, shipped for clients that read it; the server renders
# Kimi chats with KimiTokenizer.apply_chat_template (moeserve/tokenizer/kimi.py)
KIMI_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}<|im_user|>user<|im_middle|>"
    "{% elif m['role'] == 'assistant' %}<|im_assistant|>assistant<|im_middle|>"
    "{% else %}<|im_system|>{{ m['role'] }}<|im_middle|>{% endif %}"
    "{{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}"
)
SAMPLE_TEXT = (
    "The quick brown fox jumps over the lazy dog. Hello, world! How are you today? "
    "I'm fine, thanks; we'll see what they've done. Numbers: 12345 67890 3.14159. "
    "def main():\n    print('hello')\n    return 0\n\n"
    "for i in range(10):\n    x = i * 2 + 1\n"
    "人工智能正在改变世界。我们今天去北京。你好，世界！机器学习和深度学习。"
    "こんにちは世界。 Ünïcödé façade naïve café. Привет мир. 🙂🚀 emoji ok. "
    "The model answers questions, writes code and reasons step by step. "
    "User: what is the capital of France? Assistant: Paris is the capital of France.\n"
) * 3


@dataclass(frozen=True)
class TinyShape:
    layers: int = 2
    experts: int = 8
    hidden: int = 64
    heads: int = 4
    q_lora: int = 32
    kv_lora: int = 32
    nope: int = 16
    rope: int = 8
    v_dim: int = 16
    intermediate: int = 128
    moe_intermediate: int = 32
    top_k: int = 2
    merges: int = 300  # BPE merges learned for the tiny tokenizer


# the smallest shape with the published 512 + 64 MLA latent layout, so the Triton MLA
# kernels (and with them CUDA graphs) apply: GPU tests and the GPU serving smoke test
KERNEL_SHAPE = TinyShape(
    layers=3,
    experts=16,
    hidden=256,
    heads=8,
    q_lora=64,
    kv_lora=512,
    nope=64,
    rope=64,
    v_dim=64,
    intermediate=512,
    moe_intermediate=128,
    top_k=4,
)


@dataclass
class WrittenCheckpoint:
    path: str
    config: dict[str, Any]
    # model-space name ("model.layers.0.mlp.gate_proj.weight", "lm_head.weight") -> the fp32
    # values a correct loader reconstructs (dequantized where the file is quantized)
    ground_truth: dict[str, torch.Tensor] = field(default_factory=dict)
    quantized: set[str] = field(default_factory=set)  # model-space module names stored quantized


# ---- tokenizers --------------------------------------------------------------------------
# the published Kimi-K2.5 MLA EAGLE-3 head's config.json (Eagle3DeepseekV2ForCausalLM)
KIMI_K25_EAGLE3_MLA_CONFIG = {
    "architectures": ["Eagle3DeepseekV2ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 163584,
    "draft_vocab_size": 163840,
    "dtype": "bfloat16",
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 30, 58], "use_aux_hidden_state": True},
    "eos_token_id": 163585,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "max_position_embeddings": 262144,
    "mlp_bias": False,
    "model_type": "kimi_k2",
    "num_attention_heads": 64,
    "num_hidden_layers": 1,
    "num_key_value_heads": 64,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 64.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 50000.0,
    "tie_word_embeddings": False,
    "use_cache": True,
    "vocab_size": 163840,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "v_head_dim": 128,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
}


def learn_bpe_ranks(text: str, merges: int, pat_str: str = KIMI_PAT_STR) -> dict[bytes, int]:
    """Byte-level BPE ranks: the 256 bytes, then `merges` merges learned greedily."""
    import regex

    words = collections.Counter(
        tuple(bytes([b]) for b in w.encode()) for w in regex.findall(pat_str, text, flags=regex.V1)
    )
    ranks = {bytes([b]): b for b in range(256)}
    for _ in range(merges):
        pairs: collections.Counter = collections.Counter()
        for w, n in words.items():
            for a, b in zip(w, w[1:], strict=False):
                pairs[a, b] += n
        if not pairs:
            break
        (a, b), _count = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        merged = a + b
        if merged in ranks:
            break
        ranks[merged] = len(ranks)
        new_words: collections.Counter = collections.Counter()
        for w, n in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(merged)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new_words[tuple(out)] += n
        words = new_words
    return ranks


def kimi_special_tokens(base: int) -> dict[str, int]:
    return {
        KIMI_SPECIALS.get(k, f"<|reserved_token_{k}|>"): base + k for k in range(KIMI_NUM_SPECIAL)
    }


def write_kimi_tokenizer(out: str, merges: int) -> int:
    """tiktoken.model + tokenizer_config.json; returns the vocabulary size."""
    ranks = learn_bpe_ranks(SAMPLE_TEXT, merges)
    with open(os.path.join(out, "tiktoken.model"), "w") as f:
        for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(tok).decode()} {rank}\n")
    specials = kimi_special_tokens(len(ranks))
    cfg = {
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for t, i in specials.items()
        },
        "bos_token": "[BOS]",
        "eos_token": "<|im_end|>",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "model_max_length": 1048576,
        "tokenizer_class": "TikTokenTokenizer",
        "chat_template": KIMI_CHAT_TEMPLATE,
        "moeserve_note": (
            f"tiny vocabulary: special ids are the published {KIMI_SPECIAL_BASE_PUBLISHED}+k "
            f"shifted to {len(ranks)}+k"
        ),
    }
    _dump(out, "tokenizer_config.json", cfg)
    return len(ranks) + KIMI_NUM_SPECIAL


def write_deepseek_tokenizer(out: str, merges: int) -> int:
    """tokenizer.json (byte-level BPE, specials first) + tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=256 + len(DEEPSEEK_SPECIALS) + merges,
        special_tokens=DEEPSEEK_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([SAMPLE_TEXT], trainer)
    bos = DEEPSEEK_SPECIALS[0]
    # as DeepSeek-V3's tokenizer.json: the post-processor prepends BOS
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))]
    )
    tok.save(os.path.join(out, "tokenizer.json"))
    cfg = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": DEEPSEEK_SPECIALS[0],
        "eos_token": DEEPSEEK_SPECIALS[1],
        "pad_token": DEEPSEEK_SPECIALS[1],
        "model_max_length": 16384,
        "tokenizer_class": "LlamaTokenizerFast",
        "legacy": True,
        "clean_up_tokenization_spaces": False,
        "chat_template": DEEPSEEK_CHAT_TEMPLATE,
    }
    _dump(out, "tokenizer_config.json", cfg)
    return tok.get_vocab_size()


# ---- configs -------------------------------------------------------------------------------
def text_config(like: str, s: TinyShape, vocab: int, bos: int, eos: int) -> dict[str, Any]:
    yarn = {
        "type": "yarn",
        "factor": 40.0 if like == "deepseek-v3" else 64.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }
    kimi = like == "kimi-k2.5"
    c: dict[str, Any] = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": vocab,
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "moe_intermediate_size": s.moe_intermediate,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.heads,
        "q_lora_rank": None if like == "moonlight" else s.q_lora,
        "kv_lora_rank": s.kv_lora,
        "qk_nope_head_dim": s.nope,
        "qk_rope_head_dim": s.rope,
        "v_head_dim": s.v_dim,
        "n_routed_experts": s.experts,
        "n_shared_experts": 1 if kimi else 2 if like == "moonlight" else 1,
        "num_experts_per_tok": s.top_k,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "n_group": 1 if like != "deepseek-v3" else 4,
        "topk_group": 1 if like != "deepseek-v3" else 2,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "routed_scaling_factor": 2.827 if kimi else 2.446 if like == "moonlight" else 2.5,
        "norm_topk_prob": True,
        "num_nextn_predict_layers": 1 if like == "deepseek-v3" else 0,
        "rms_norm_eps": 1e-5 if like != "deepseek-v3" else 1e-6,
        "rope_theta": 50000.0 if like != "deepseek-v3" else 10000.0,
        "rope_scaling": None if like == "moonlight" else yarn,
        "max_position_embeddings": 64 * int(yarn["factor"]) if like != "moonlight" else 8192,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "bfloat16",
        "initializer_range": 0.02,
        "use_cache": True,
    }
    return c


@dataclass(frozen=True)
class TinyVision:
    """A tiny MoonViT tower + projector (the published one: 27 layers, width 1152, 16 heads,
    MLP 4304, a 64 x 64 position table); the 8 x 8 table here is resized for most images."""

    layers: int = 2
    hidden: int = 32
    heads: int = 2
    intermediate: int = 64
    pos_emb: int = 8


def vision_config(v: TinyVision, text_hidden: int) -> dict[str, Any]:
    """`vision_config` with the published field names and values other than the sizes."""
    return {
        "init_pos_emb_height": v.pos_emb,
        "init_pos_emb_time": 4,
        "init_pos_emb_width": v.pos_emb,
        "merge_kernel_size": [2, 2],
        "merge_type": "sd2_tpool",
        "mm_hidden_size": v.hidden,
        "mm_projector_type": "patchmerger",
        "model_type": "",
        "patch_size": VISION_PATCH,
        "pos_emb_type": "divided_fixed",
        "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-05,
        "text_hidden_size": text_hidden,
        "video_attn_type": "spatial_temporal",
        "vt_hidden_size": v.hidden,
        "vt_intermediate_size": v.intermediate,
        "vt_num_attention_heads": v.heads,
        "vt_num_hidden_layers": v.layers,
    }


def vision_tensors(
    gen: torch.Generator, v: TinyVision, text_hidden: int
) -> dict[str, torch.Tensor]:
    """`vision_tower.*` and `mm_projector.*` as the published checkpoints name and shape
    them (BF16)."""
    d, m = v.hidden, v.hidden * VISION_MERGE
    t: dict[str, torch.Tensor] = {
        "vision_tower.patch_embed.proj.weight": _rand(gen, d, 3, VISION_PATCH, VISION_PATCH),
        "vision_tower.patch_embed.proj.bias": _rand(gen, d),
        "vision_tower.patch_embed.pos_emb.weight": _rand(gen, v.pos_emb, v.pos_emb, d, std=0.5),
        "vision_tower.encoder.final_layernorm.weight": _norm(gen, d),
        "vision_tower.encoder.final_layernorm.bias": _rand(gen, d),
        "mm_projector.pre_norm.weight": _norm(gen, d),
        "mm_projector.pre_norm.bias": _rand(gen, d),
        "mm_projector.proj.0.weight": _rand(gen, m, m, std=0.1),
        "mm_projector.proj.0.bias": _rand(gen, m),
        "mm_projector.proj.2.weight": _rand(gen, text_hidden, m, std=0.5),
        "mm_projector.proj.2.bias": _rand(gen, text_hidden),
    }
    for i in range(v.layers):
        p = f"vision_tower.encoder.blocks.{i}"
        t[f"{p}.norm0.weight"], t[f"{p}.norm0.bias"] = _norm(gen, d), _rand(gen, d)
        t[f"{p}.norm1.weight"], t[f"{p}.norm1.bias"] = _norm(gen, d), _rand(gen, d)
        t[f"{p}.wqkv.weight"], t[f"{p}.wqkv.bias"] = (
            _rand(gen, 3 * d, d, std=0.2),
            _rand(gen, 3 * d),
        )
        t[f"{p}.wo.weight"], t[f"{p}.wo.bias"] = _rand(gen, d, d, std=0.2), _rand(gen, d)
        t[f"{p}.mlp.fc0.weight"] = _rand(gen, v.intermediate, d, std=0.2)
        t[f"{p}.mlp.fc0.bias"] = _rand(gen, v.intermediate)
        t[f"{p}.mlp.fc1.weight"] = _rand(gen, d, v.intermediate, std=0.2)
        t[f"{p}.mlp.fc1.bias"] = _rand(gen, d)
    return t


def full_config(
    like: str, text: dict[str, Any], vision: TinyVision | None = None
) -> dict[str, Any]:
    if like != "kimi-k2.5":
        return dict(text)
    specials = kimi_special_tokens(text["vocab_size"] - KIMI_NUM_SPECIAL)
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text,
        "vision_config": vision_config(vision or TinyVision(), text["hidden_size"]),
        "media_placeholder_token_id": specials["<|media_pad|>"],
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }


# ---- weights ---------------------------------------------------------------------------------
def _linear_shapes(text: dict[str, Any], layer: int) -> dict[str, tuple[int, int]]:
    """Module name (model space) -> [out, in] of every linear layer of one decoder layer."""
    h = text["hidden_size"]
    heads = text["num_attention_heads"]
    qk = text["qk_nope_head_dim"] + text["qk_rope_head_dim"]
    p = f"model.layers.{layer}"
    out: dict[str, tuple[int, int]] = {}
    if text["q_lora_rank"]:
        out[f"{p}.self_attn.q_a_proj"] = (text["q_lora_rank"], h)
        out[f"{p}.self_attn.q_b_proj"] = (heads * qk, text["q_lora_rank"])
    else:
        out[f"{p}.self_attn.q_proj"] = (heads * qk, h)
    out[f"{p}.self_attn.kv_a_proj_with_mqa"] = (text["kv_lora_rank"] + text["qk_rope_head_dim"], h)
    out[f"{p}.self_attn.kv_b_proj"] = (
        heads * (text["qk_nope_head_dim"] + text["v_head_dim"]),
        text["kv_lora_rank"],
    )
    out[f"{p}.self_attn.o_proj"] = (h, heads * text["v_head_dim"])
    if layer < text["first_k_dense_replace"]:
        mlps = {f"{p}.mlp": text["intermediate_size"]}
    else:
        mlps = {
            f"{p}.mlp.experts.{e}": text["moe_intermediate_size"]
            for e in range(text["n_routed_experts"])
        }
        mlps[f"{p}.mlp.shared_experts"] = text["moe_intermediate_size"] * text["n_shared_experts"]
    for m, inter in mlps.items():
        out[f"{m}.gate_proj"] = (inter, h)
        out[f"{m}.up_proj"] = (inter, h)
        out[f"{m}.down_proj"] = (h, inter)
    return out


def _quantized_modules(like: str, fmt: str, text: dict[str, Any], name: str) -> bool:
    if fmt == "bf16":
        return False
    layer = int(name.split(".")[2])
    if layer >= text["num_hidden_layers"]:  # MTP layer: BF16 in the FP4 exports
        return fmt == "fp8-block"
    if fmt == "fp8-block":
        return True
    if ".self_attn." in name:
        return False
    if like == "kimi-k2.5":
        return ".mlp.experts." in name
    return True


_modelopt_global = nvfp4_global_scale  # the name tests/models/test_merged_qkv_a.py imports


def _quantize_group(
    fmt: str, ws: dict[str, torch.Tensor], w4a4: bool, gen: torch.Generator
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Quantize linears that share a global scale; returns (stored tensors, dequantized)."""
    stored: dict[str, torch.Tensor] = {}
    truth: dict[str, torch.Tensor] = {}
    if fmt == "fp8-block":
        for n, w in ws.items():
            q, s = quantize_fp8_block(w, FP8_WEIGHT_BLOCK)
            stored[f"{n}.weight"], stored[f"{n}.weight_scale_inv"] = q, s
            truth[n] = dequantize_fp8_block(q, s, torch.float32, FP8_WEIGHT_BLOCK)
        return stored, truth
    gs = nvfp4_global_scale(torch.stack([w.float().abs().amax() for w in ws.values()]).amax())
    act = (0.5 + torch.rand((), generator=gen)) / (E2M1_MAX * E4M3_MAX)  # activation global
    for n, w in ws.items():
        packed, scale = quantize_nvfp4_with_global(w, gs)
        if fmt == "nvfp4-modelopt":
            truth[n] = dequantize_nvfp4(packed, scale, gs, torch.float32)
        else:  # compressed-tensors stores 1/global and dequantization divides by it
            truth[n] = dequantize_nvfp4(packed, scale, 1.0, torch.float32) / (1.0 / gs)
        if fmt == "nvfp4-modelopt":
            stored[f"{n}.weight"] = packed
            stored[f"{n}.weight_scale"] = scale
            stored[f"{n}.weight_scale_2"] = gs.reshape(()).clone()
            if w4a4:
                stored[f"{n}.input_scale"] = act.float().reshape(()).clone()
        else:
            stored[f"{n}.weight_packed"] = packed
            stored[f"{n}.weight_scale"] = scale
            stored[f"{n}.weight_global_scale"] = (1.0 / gs).reshape(1)
            if w4a4:
                stored[f"{n}.input_global_scale"] = (1.0 / act).float().reshape(1)
    return stored, truth


def _rand(gen: torch.Generator, *shape: int, std: float = 0.05) -> torch.Tensor:
    # round through bf16: the checkpoint is BF16, so ground truth is what BF16 holds
    return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)


def _norm(gen: torch.Generator, n: int) -> torch.Tensor:
    return (1.0 + 0.1 * torch.randn(n, generator=gen)).to(torch.bfloat16)


def build_tensors(
    like: str, fmt: str, text: dict[str, Any], seed: int, w4a4: bool, kv_fp8: bool
) -> tuple[dict[str, torch.Tensor], WrittenCheckpoint]:
    """All text-model tensors under model-space names, and the ground truth."""
    gen = torch.Generator().manual_seed(seed)
    h, v = text["hidden_size"], text["vocab_size"]
    t: dict[str, torch.Tensor] = {}
    wc = WrittenCheckpoint("", {})
    plain: dict[str, torch.Tensor] = {}
    plain["model.embed_tokens.weight"] = _rand(gen, v, h, std=1.0)
    n_total = text["num_hidden_layers"] + int(text.get("num_nextn_predict_layers") or 0)
    for i in range(n_total):
        p = f"model.layers.{i}"
        plain[f"{p}.input_layernorm.weight"] = _norm(gen, h)
        plain[f"{p}.post_attention_layernorm.weight"] = _norm(gen, h)
        if text["q_lora_rank"]:
            plain[f"{p}.self_attn.q_a_layernorm.weight"] = _norm(gen, text["q_lora_rank"])
        plain[f"{p}.self_attn.kv_a_layernorm.weight"] = _norm(gen, text["kv_lora_rank"])
        if i >= text["first_k_dense_replace"]:
            plain[f"{p}.mlp.gate.weight"] = _rand(gen, text["n_routed_experts"], h, std=0.3)
            t[f"{p}.mlp.gate.e_score_correction_bias"] = 0.1 * torch.randn(
                text["n_routed_experts"], generator=gen
            )
        if i >= text["num_hidden_layers"]:  # MTP extras
            plain[f"{p}.enorm.weight"] = _norm(gen, h)
            plain[f"{p}.hnorm.weight"] = _norm(gen, h)
            plain[f"{p}.eh_proj.weight"] = _rand(gen, h, 2 * h)
            plain[f"{p}.shared_head.norm.weight"] = _norm(gen, h)
        if kv_fp8 and fmt == "nvfp4-modelopt" and i < text["num_hidden_layers"]:
            t[f"{p}.self_attn.k_proj.k_scale"] = torch.tensor(0.01 + 0.01 * i)
            t[f"{p}.self_attn.v_proj.v_scale"] = torch.tensor(0.005)
        shapes = _linear_shapes(text, i)
        groups: dict[str, dict[str, torch.Tensor]] = {}
        for name, (o, k) in shapes.items():
            w = _rand(gen, o, k)
            if not _quantized_modules(like, fmt, text, name):
                plain[f"{name}.weight"] = w
                continue
            # gate and up of one MLP share a global scale in ModelOpt exports
            key = name.rsplit(".", 1)[0] + (
                ".gu" if name.endswith(("gate_proj", "up_proj")) else name
            )
            groups.setdefault(key, {})[name] = w
        for ws in groups.values():
            stored, truth = _quantize_group(fmt, ws, w4a4, gen)
            t.update(stored)
            if i < text["num_hidden_layers"]:
                wc.ground_truth.update({f"{n}.weight": x for n, x in truth.items()})
                wc.quantized.update(ws)
    plain["model.norm.weight"] = _norm(gen, h)
    plain["lm_head.weight"] = _rand(gen, v, h)
    t.update(plain)
    for name, x in list(plain.items()) + [(n, x) for n, x in t.items() if n.endswith("_bias")]:
        m = name.split(".")
        if len(m) > 2 and m[1] == "layers" and int(m[2]) >= text["num_hidden_layers"]:
            continue
        wc.ground_truth[name] = x.float()
    return t, wc


# ---- files -----------------------------------------------------------------------------------
def _dump(out: str, name: str, obj: Any) -> None:
    with open(os.path.join(out, name), "w") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)


def save_sharded(out: str, tensors: dict[str, torch.Tensor], shards: int) -> None:
    """model-0000k-of-0000N.safetensors + model.safetensors.index.json (or one file)."""
    names = list(tensors)
    if shards <= 1:
        save_file(
            {n: tensors[n].contiguous() for n in names},
            os.path.join(out, "model.safetensors"),
            metadata={"format": "pt"},
        )
        return
    per = -(-len(names) // shards)
    weight_map, total = {}, 0
    for k in range(shards):
        part = names[k * per : (k + 1) * per]
        fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_file(
            {n: tensors[n].contiguous() for n in part},
            os.path.join(out, fname),
            metadata={"format": "pt"},
        )
        for n in part:
            weight_map[n] = fname
            total += tensors[n].numel() * tensors[n].element_size()
    _dump(
        out,
        "model.safetensors.index.json",
        {"metadata": {"total_size": total}, "weight_map": weight_map},
    )


def _exclude_list(like: str, text: dict[str, Any], prefix: str) -> list[str]:
    n = text["num_hidden_layers"]
    if like == "kimi-k2.5":
        return [
            f"{prefix}lm_head",
            f"{prefix}layers.0.mlp*",
            f"{prefix}layers.*.self_attn*",
            "*.shared_experts*",
            "*mlp.gate",
            "vision_tower*",
            "mm_projector*",
        ]
    ex = ["lm_head"] + [f"model.layers.{i}.self_attn*" for i in range(n)]
    ex += [f"model.layers.{i}.mlp.gate" for i in range(text["first_k_dense_replace"], n)]
    if text.get("num_nextn_predict_layers"):
        ex.append(f"model.layers.{n}*")
    return ex


def _ct_ignore(like: str, prefix: str) -> list[str]:
    ig = [
        f"{prefix}lm_head",
        r"re:.*self_attn.*",
        r"re:.*mlp\.gate$",
        r"re:.*layers\.\d+\.(enorm|hnorm|eh_proj).*",
    ]
    if like == "kimi-k2.5":
        ig += [
            r"re:.*shared_experts.*",
            r"re:.*layers\.0\.mlp\..*",
            "re:vision_tower.*",
            "re:mm_projector.*",
        ]
    return ig


def write_checkpoint(
    out: str,
    like: str,
    fmt: str,
    shape: TinyShape = TinyShape(),
    seed: int = 0,
    w4a4: bool = True,
    kv_fp8: bool = False,
    shards: int = 3,
    vision: TinyVision = TinyVision(),
) -> WrittenCheckpoint:
    """Write a tiny checkpoint; returns its config and ground-truth (dequantized) weights."""
    if like not in LIKES or fmt not in FORMATS:
        raise ValueError(f"--like must be one of {LIKES} and --format one of {FORMATS}")
    os.makedirs(out, exist_ok=True)
    if like == "kimi-k2.5":
        vocab = write_kimi_tokenizer(out, shape.merges)
        specials = kimi_special_tokens(vocab - KIMI_NUM_SPECIAL)
        bos, eos = specials["[BOS]"], specials["<|im_end|>"]
    else:
        vocab = write_deepseek_tokenizer(out, shape.merges)
        bos, eos = 0, 1
    text = text_config(like, shape, vocab, bos, eos)
    config = full_config(like, text, vision)
    tensors, wc = build_tensors(like, fmt, text, seed, w4a4, kv_fp8)
    kimi = like == "kimi-k2.5"
    # Kimi: text weights under language_model.; NVIDIA's NVFP4 export drops `.model.`
    prefix = "language_model." if kimi else ""
    drop_model = kimi and fmt == "nvfp4-modelopt"

    def ckpt_name(n: str) -> str:
        if drop_model and n.startswith("model."):
            n = n[len("model.") :]
        return prefix + n

    stored = {ckpt_name(n): x for n, x in tensors.items()}
    if kimi:
        gen = torch.Generator().manual_seed(seed + 1)
        stored.update(vision_tensors(gen, vision, text["hidden_size"]))
    name_prefix = prefix + ("" if drop_model else "")
    if fmt == "fp8-block":
        config["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [FP8_WEIGHT_BLOCK, FP8_WEIGHT_BLOCK],
        }
    elif fmt == "nvfp4-modelopt":
        algo = "NVFP4" if w4a4 else "W4A16_NVFP4"
        exclude = _exclude_list(like, text, name_prefix)
        q = {
            "quant_algo": algo,
            "kv_cache_quant_algo": "FP8" if kv_fp8 else None,
            "group_size": NVFP4_BLOCK,
            "exclude_modules": exclude,
        }
        _dump(
            out,
            "hf_quant_config.json",
            {
                "producer": {"name": "modelopt", "version": MODELOPT_VERSION},
                "quantization": q,
            },
        )
        config["quantization_config"] = {
            "quant_method": "modelopt",
            "quant_algo": algo,
            "group_size": NVFP4_BLOCK,
            "ignore": exclude,
            "producer": {"name": "modelopt", "version": MODELOPT_VERSION},
            "kv_cache_scheme": {"num_bits": 8, "type": "float", "dynamic": False}
            if kv_fp8
            else None,
        }
    elif fmt == "nvfp4-ct":
        group: dict[str, Any] = {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "float",
                "strategy": "tensor_group",
                "group_size": NVFP4_BLOCK,
                "symmetric": True,
                "dynamic": False,
                "observer": "minmax",
            },
        }
        if w4a4:
            group["input_activations"] = {
                "num_bits": 4,
                "type": "float",
                "strategy": "tensor_group",
                "group_size": NVFP4_BLOCK,
                "symmetric": True,
                "dynamic": "local",
                "observer": "minmax",
            }
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "nvfp4-pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": group},
            "ignore": _ct_ignore(like, "language_model.model." if kimi else ""),
            "kv_cache_scheme": None,
        }
    _dump(out, "config.json", config)
    _dump(
        out,
        "generation_config.json",
        {"bos_token_id": bos, "eos_token_id": eos, "do_sample": False},
    )
    save_sharded(out, stored, shards)
    wc.path, wc.config = out, config
    return wc


# ---- EAGLE-3 draft heads -------------------------------------------------------------------
# `--like kimi-k2.5-eagle3`: the Llama-style head (LlamaForCausalLMEagle3, SpecForge's export:
# `midlayer.*`, no embedding: the target's is used); `--like kimi-k2.5-eagle3-mla`: the MLA head
# of the Kimi-K2.5 drafts (Eagle3DeepseekV2ForCausalLM, model_type kimi_k2, `layers.0.*`, its
# own embedding). Both: `fc`, `norm`, `lm_head` over the draft vocabulary, `d2t` (int64: target
# id - draft id) and `t2d` (bool over the target vocabulary), BF16, one safetensors file.
EAGLE_LIKES = ("kimi-k2.5-eagle3", "kimi-k2.5-eagle3-mla")
EAGLE_TRANSFORMERS_VERSION = "4.57.1"  # as the published Kimi-K2.5 EAGLE-3 configs
EAGLE_INTERMEDIATE = 2  # the tiny head's MLP width, times its hidden size


def eagle3_aux_layers(n_layers: int) -> list[int]:
    """Three distinct target layers for a tiny head: the published default (2, L // 2, L - 3)
    where it is three distinct layers, else the first, middle and last."""
    ids = [2, n_layers // 2, n_layers - 3]
    if len(set(ids)) == 3 and min(ids) >= 0:
        return ids
    if n_layers < 3:
        raise ValueError("an EAGLE-3 head reads three target layers: the target needs 3 or more")
    return [0, n_layers // 2, n_layers - 1]


def _smallest_factor(n: int) -> int:
    return next((p for p in range(2, n + 1) if n % p == 0), 1)


def eagle3_config(
    like: str, text: dict[str, Any], aux: list[int], draft_vocab: int
) -> dict[str, Any]:
    """config.json of a tiny head with the published fields, sized for the target `text`."""
    h, heads = text["hidden_size"], text["num_attention_heads"]
    common = {
        "bos_token_id": text["bos_token_id"],
        "eos_token_id": text["eos_token_id"],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True},
        "hidden_act": "silu",
        "hidden_size": h,
        "initializer_range": 0.02,
        "intermediate_size": EAGLE_INTERMEDIATE * h,
        "max_position_embeddings": text["max_position_embeddings"],
        "num_attention_heads": heads,
        "num_hidden_layers": 1,
        "rms_norm_eps": 1e-05,
        "rope_theta": text["rope_theta"],
        "tie_word_embeddings": False,
        "transformers_version": EAGLE_TRANSFORMERS_VERSION,
        "use_cache": True,
        "vocab_size": text["vocab_size"],
        "draft_vocab_size": draft_vocab,
    }
    if like == "kimi-k2.5-eagle3":
        return {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "num_key_value_heads": heads // _smallest_factor(heads),  # grouped-query
            "pad_token_id": 0,
            "torch_dtype": "bfloat16",
            **common,
        }
    return {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"],
        "model_type": "kimi_k2",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "dtype": "bfloat16",
        "head_dim": text["qk_nope_head_dim"],
        "max_window_layers": 1,
        "mlp_bias": False,
        "num_key_value_heads": heads,
        "pretraining_tp": 1,
        "rope_scaling": text["rope_scaling"],
        "sliding_window": None,
        "use_sliding_window": False,
        "qk_nope_head_dim": text["qk_nope_head_dim"],
        "qk_rope_head_dim": text["qk_rope_head_dim"],
        "q_lora_rank": text["q_lora_rank"],
        "kv_lora_rank": text["kv_lora_rank"],
        "v_head_dim": text["v_head_dim"],
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        **common,
    }


def eagle3_tensors(
    like: str, cfg: dict[str, Any], draft_tokens: list[int], gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """The head's tensors under the published names."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    mla = like == "kimi-k2.5-eagle3-mla"
    p = "layers.0" if mla else "midlayer"
    aux = len(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    inter = cfg["intermediate_size"]
    t = {
        "fc.weight": _rand(gen, h, aux * h),
        "norm.weight": _norm(gen, h),
        "lm_head.weight": _rand(gen, len(draft_tokens), h, std=0.5),
        f"{p}.input_layernorm.weight": _norm(gen, h),
        f"{p}.hidden_norm.weight": _norm(gen, h),
        f"{p}.post_attention_layernorm.weight": _norm(gen, h),
        f"{p}.mlp.gate_proj.weight": _rand(gen, inter, h),
        f"{p}.mlp.up_proj.weight": _rand(gen, inter, h),
        f"{p}.mlp.down_proj.weight": _rand(gen, h, inter),
    }
    heads = cfg["num_attention_heads"]
    if mla:
        qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
        kv_a = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
        kv_b = heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"])
        a = f"{p}.self_attn"
        t[f"{a}.q_a_proj.weight"] = _rand(gen, cfg["q_lora_rank"], 2 * h)
        t[f"{a}.q_a_layernorm.weight"] = _norm(gen, cfg["q_lora_rank"])
        t[f"{a}.q_b_proj.weight"] = _rand(gen, heads * qk, cfg["q_lora_rank"])
        t[f"{a}.kv_a_proj_with_mqa.weight"] = _rand(gen, kv_a, 2 * h)
        t[f"{a}.kv_a_layernorm.weight"] = _norm(gen, cfg["kv_lora_rank"])
        t[f"{a}.kv_b_proj.weight"] = _rand(gen, kv_b, cfg["kv_lora_rank"])
        t[f"{a}.o_proj.weight"] = _rand(gen, h, heads * cfg["v_head_dim"])
        t["embed_tokens.weight"] = _rand(gen, v, h, std=1.0)
    else:
        d, kvh = h // heads, cfg["num_key_value_heads"]
        t[f"{p}.self_attn.q_proj.weight"] = _rand(gen, heads * d, 2 * h)
        t[f"{p}.self_attn.k_proj.weight"] = _rand(gen, kvh * d, 2 * h)
        t[f"{p}.self_attn.v_proj.weight"] = _rand(gen, kvh * d, 2 * h)
        t[f"{p}.self_attn.o_proj.weight"] = _rand(gen, h, heads * d)
    ids = torch.tensor(draft_tokens, dtype=torch.long)
    t["d2t"] = ids - torch.arange(len(draft_tokens))
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[ids] = True
    t["t2d"] = t2d
    return t


def write_eagle3_checkpoint(
    out: str,
    like: str,
    target: str,
    seed: int = 0,
    draft_vocab: int | None = None,
    draft_tokens: list[int] | None = None,
    aux_layers: list[int] | None = None,
) -> WrittenCheckpoint:
    """A tiny EAGLE-3 head for the tiny target checkpoint `target`. Its draft vocabulary: the
    target ids `draft_tokens`, else `draft_vocab` ids spread over the target's vocabulary
    (default: half of it); `aux_layers`: the target layers it reads (eagle3_aux_layers)."""
    if like not in EAGLE_LIKES:
        raise ValueError(f"an EAGLE-3 --like must be one of {EAGLE_LIKES}")
    with open(os.path.join(target, "config.json")) as f:
        raw = json.load(f)
    text = dict(raw.get("text_config") or raw)
    vocab = text["vocab_size"]
    if draft_tokens is None:
        n = draft_vocab or vocab // 2
        draft_tokens = torch.linspace(0, vocab - 1, n).round().long().unique().tolist()
    aux = aux_layers or eagle3_aux_layers(text["num_hidden_layers"])
    os.makedirs(out, exist_ok=True)
    cfg = eagle3_config(like, text, aux, len(draft_tokens))
    tensors = eagle3_tensors(like, cfg, list(draft_tokens), torch.Generator().manual_seed(seed))
    _dump(out, "config.json", cfg)
    save_sharded(out, tensors, 1)
    wc = WrittenCheckpoint(out, cfg)
    wc.ground_truth = {n: x.float() if x.is_floating_point() else x for n, x in tensors.items()}
    return wc


# ---- CLI -------------------------------------------------------------------------------------
def add_make_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("out", help="output folder")
    parser.add_argument("--like", choices=LIKES + EAGLE_LIKES, default="kimi-k2.5")
    parser.add_argument("--format", choices=FORMATS, default="bf16", dest="fmt")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (first is dense)")
    parser.add_argument("--experts", type=int, default=8, help="routed experts per MoE layer")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (multiple of 16)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--top-k", type=int, default=2, dest="top_k")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shards", type=int, default=3, help="safetensors files (1: no index)")
    parser.add_argument(
        "--weight-only",
        action="store_true",
        help="NVFP4: W4A16 (no activation scales) instead of W4A4",
    )
    parser.add_argument(
        "--kv-cache-fp8",
        action="store_true",
        help="nvfp4-modelopt: kv_cache_quant_algo FP8 with k/v scales",
    )
    parser.add_argument(
        "--target",
        default=None,
        help="EAGLE-3 heads (--like kimi-k2.5-eagle3[-mla]): the tiny target checkpoint folder",
    )
    parser.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        dest="draft_vocab",
        help="EAGLE-3 heads: draft vocabulary size (default: half the target's)",
    )


def run_make_checkpoint(args: argparse.Namespace) -> int:
    if args.like in EAGLE_LIKES:
        return _run_make_eagle3(args)
    if args.hidden % NVFP4_BLOCK:
        print(f"error: --hidden must be a multiple of {NVFP4_BLOCK}")
        return 2
    shape = TinyShape(
        layers=args.layers,
        experts=args.experts,
        hidden=args.hidden,
        heads=args.heads,
        top_k=args.top_k,
    )
    wc = write_checkpoint(
        args.out,
        args.like,
        args.fmt,
        shape,
        seed=args.seed,
        w4a4=not args.weight_only,
        kv_fp8=args.kv_cache_fp8,
        shards=args.shards,
    )
    n = sum(x.numel() for x in wc.ground_truth.values())
    print(f"wrote {args.like} {args.fmt} checkpoint to {wc.path} ({n:,} parameters)")
    return 0


def _run_make_eagle3(args: argparse.Namespace) -> int:
    target = args.target
    if not target or not os.path.isfile(os.path.join(target, "config.json")):
        print(f"error: --like {args.like} needs --target, a checkpoint folder", file=sys.stderr)
        return 2
    try:
        wc = write_eagle3_checkpoint(
            args.out, args.like, target, seed=args.seed, draft_vocab=args.draft_vocab
        )
    except (ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n = sum(x.numel() for x in wc.ground_truth.values() if x.is_floating_point())
    print(f"wrote {args.like} draft head for {target} to {wc.path} ({n:,} parameters)")
    return 0
