"""GGUF checkpoints (llama.cpp): Llama architecture, dequantized through `gguf` on load.

Tensor names are mapped to the HF names the model's `load_weights` knows; llama.cpp's
row permutation of q/k (for its RoPE pairing) is undone, as transformers' GGUF loader does.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from moeserve.config import ModelConfig
from moeserve.loader.base import LoadedModel, LoadError

log = logging.getLogger(__name__)

_LLAMA_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LLAMA_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_SUPPORTED = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q6_K", "Q4_K", "Q5_K"}


def read_metadata(reader: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = field.contents()
    return meta


def hf_name(gguf_name: str) -> str | None:
    """The HF Llama parameter name for a GGUF tensor name (None: not a model weight)."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _LLAMA_NAMES:
        return f"{_LLAMA_NAMES[base]}.{suffix}"
    m = _BLOCK_RE.match(gguf_name)
    if m and m.group(2) in _LLAMA_BLOCK:
        return f"model.layers.{m.group(1)}.{_LLAMA_BLOCK[m.group(2)]}.{m.group(3)}"
    return None


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of each head's rotary halves (rows of q/k)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def dequantize(t: Any) -> torch.Tensor:
    """A GGUF tensor as float32 in PyTorch's [out, in] order."""
    from gguf import GGMLQuantizationType, quants

    kind = GGMLQuantizationType(t.tensor_type)
    if kind.name not in _SUPPORTED:
        raise LoadError(f"GGUF tensor {t.name} uses {kind.name}, which is not supported")
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    if kind.name in ("F32", "F16"):
        arr = np.asarray(t.data, dtype=np.float32)
    else:
        arr = quants.dequantize(t.data, kind)
    # a writable copy: the reader maps the file read-only
    return torch.from_numpy(np.array(arr.reshape(shape), dtype=np.float32))


def iter_llama_weights(reader: Any, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    for t in tqdm(reader.tensors, desc="Loading GGUF", unit="tensor", leave=False):
        name = hf_name(t.name)
        if name is None:
            log.info("GGUF tensor %s skipped (not used by this model)", t.name)
            continue
        w = dequantize(t)
        if name.endswith("q_proj.weight"):
            w = unpermute_qk(w, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            w = unpermute_qk(w, cfg.num_key_value_heads)
        yield name, w


def load_gguf_model(
    path: str, dtype: torch.dtype, device: str = "cpu", quantize: str = "auto"
) -> LoadedModel:
    from gguf import GGUFReader

    from moeserve.layers.quant.cpu import cpu_quant_config
    from moeserve.models.registry import model_class
    from moeserve.tokenizer.gguf_vocab import build_gguf_tokenizer

    try:
        reader = GGUFReader(path)
    except (OSError, ValueError) as e:
        raise LoadError(f"cannot read GGUF file {path}: {e}") from None
    meta = read_metadata(reader)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise LoadError(f"GGUF architecture {arch!r} is not supported yet (llama only)")
    prefix = f"{arch}."
    arch_meta = {k[len(prefix) :]: v for k, v in meta.items() if k.startswith(prefix)}
    names = {t.name for t in reader.tensors}
    arch_meta.setdefault("vocab_size", len(meta["tokenizer.ggml.tokens"]))
    arch_meta["tie_word_embeddings"] = "output.weight" not in names
    cfg = ModelConfig.from_gguf_llama(arch_meta)
    tokenizer = build_gguf_tokenizer(meta)
    cfg = _with_special_ids(cfg, tokenizer)
    quant = cpu_quant_config(_resolve_quantization(quantize, reader, dtype, device))
    model = model_class(cfg.architecture)(cfg, quant=quant, dtype=dtype)
    model.load_weights(iter_llama_weights(reader, cfg))
    model.to(device)
    kinds = sorted({t.tensor_type.name for t in reader.tensors})
    desc = f"GGUF {meta.get('general.name', '')} ({'/'.join(kinds)}), weights {quant.name}"
    # CPU: an fp32 cache (attention over it is faster in fp32 than bf16 on CPUs; small models)
    kv_dtype = torch.float32 if device == "cpu" else dtype
    return LoadedModel(model, tokenizer, cfg, kv_dtype, desc)


_Q4 = {"Q4_0", "Q4_1", "Q4_K"}


def _resolve_quantization(name: str, reader: Any, dtype: torch.dtype, device: str) -> str:
    """`auto`: on a CPU with bf16 activations, keep a 4-bit file in 4 bits (int4, groups of
    32) and anything else in int8; fp32 activations or a GPU: plain weights."""
    if name != "auto":
        return name
    if device != "cpu" or dtype != torch.bfloat16:
        return "none"
    kinds = [t.tensor_type.name for t in reader.tensors if t.name.startswith("blk.")]
    quantized_4bit = sum(k in _Q4 for k in kinds) * 2 > len(kinds)
    return "int4" if quantized_4bit else "int8"


def _with_special_ids(cfg: ModelConfig, tok: Any) -> ModelConfig:
    from dataclasses import replace

    eos = () if tok.eos_token_id is None else (tok.eos_token_id,)
    return replace(cfg, bos_token_id=tok.bos_token_id, eos_token_ids=eos)
