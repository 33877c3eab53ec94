"""GGUF checkpoints (llama.cpp): `llama` and `deepseek2` architectures, dequantized through
`gguf` on load, one tensor at a time.

Tensor names are mapped to the HF names the model's `load_weights` knows. Llama: llama.cpp's
row permutation of q/k (for its RoPE pairing) is undone, as transformers' GGUF loader does.
deepseek2 (DeepSeek-V2/V3/R1, Kimi-K2, Moonlight): see `gguf_deepseek`; sharded by tensor
parallelism through the model's own weight loaders.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from moeserve.config import ConfigError, ModelConfig, llama_config_from_gguf
from moeserve.errors import LoadError
from moeserve.loader.base import LoadedModel, LoadRequest, build_model

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
SUPPORTED_TYPES = {
    *("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"),
    *("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"),
}
_LOAD_FORMATS = ("auto", "gguf")


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


def dequantize(t: Any, index: int | None = None) -> torch.Tensor:
    """A GGUF tensor as float32 in PyTorch's [out, in] order; `index`: only that slice of the
    outermost dimension (one expert of a stacked [E, out, in] tensor: rows are quantized
    independently, so a slice of the blocks is that expert)."""
    from gguf import GGMLQuantizationType, quants

    kind = GGMLQuantizationType(t.tensor_type)
    if kind.name not in SUPPORTED_TYPES:
        raise LoadError(f"GGUF tensor {t.name} uses {kind.name}, which is not supported")
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    data = t.data
    if index is not None:
        shape, data = shape[1:], data[index]
    if kind.name in ("F32", "F16"):
        arr = np.asarray(data, dtype=np.float32)
    else:
        arr = quants.dequantize(data, kind)
    # a writable copy: the reader maps the file read-only
    return torch.from_numpy(np.array(arr.reshape(shape), dtype=np.float32))


def iter_llama_weights(reader: Any, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    for t in tqdm(reader.tensors, desc="Loading GGUF", unit="tensor", leave=False):
        name = hf_name(t.name)
        if name is None:
            log.info("GGUF tensor %s skipped (not used by this model)", t.name)
            continue
        m = _BLOCK_RE.match(t.name)
        if m and int(m.group(1)) >= cfg.num_hidden_layers:
            continue  # layers cut by num_layers
        w = dequantize(t)
        if name.endswith("q_proj.weight"):
            w = unpermute_qk(w, cfg.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            w = unpermute_qk(w, cfg.num_key_value_heads)
        yield name, w


@dataclass(frozen=True)
class _GGUFFile:
    reader: Any
    meta: dict[str, Any]  # every key/value of the file
    arch_meta: dict[str, Any]  # the architecture's keys, without the `{arch}.` prefix
    tokenizer: Any

    @property
    def tensor_names(self) -> set[str]:
        return {t.name for t in self.reader.tensors}

    def describe(self, what: str) -> str:
        kinds = "/".join(sorted({t.tensor_type.name for t in self.reader.tensors}))
        return f"GGUF {self.meta.get('general.name', '')} ({kinds}), {what}"


def load_gguf_model(request: LoadRequest) -> LoadedModel:
    """Build the model of a GGUF file and load its weights, by its architecture's loader.

    deepseek2 under tensor parallelism: every rank reads the whole file and its parameters'
    weight loaders keep its slice. `request.mtp`: also build the file's first MTP (nextn)
    block as a draft model.
    """
    from gguf import GGUFReader

    from moeserve.tokenizer.gguf_vocab import build_gguf_tokenizer

    path = request.path
    if request.load_format not in _LOAD_FORMATS:
        raise LoadError(
            f"load format {request.load_format!r} does not apply to GGUF files; use auto"
        )
    try:
        reader = GGUFReader(path)
    except (OSError, ValueError) as e:
        raise LoadError(f"cannot read GGUF file {path}: {e}") from None
    meta = read_metadata(reader)
    arch = str(meta.get("general.architecture"))
    load = _LOADERS.get(arch)
    if load is None:
        known = " and ".join(_LOADERS)
        raise LoadError(f"GGUF architecture {arch!r} is not supported ({known} are)")
    prefix = f"{arch}."
    arch_meta = {k[len(prefix) :]: v for k, v in meta.items() if k.startswith(prefix)}
    try:
        tokenizer = build_gguf_tokenizer(meta)
    except ValueError as e:
        raise LoadError(str(e)) from None
    return load(_GGUFFile(reader, meta, arch_meta, tokenizer), request)


def _load_llama(f: _GGUFFile, r: LoadRequest) -> LoadedModel:
    from moeserve.layers.quant.cpu import cpu_quant_config
    from moeserve.models.registry import ARCHITECTURES

    if r.mtp:
        raise LoadError("--speculative-config method mtp needs a deepseek2 GGUF file with MTP")
    if r.tp.size > 1:
        raise LoadError("tensor parallelism over a llama GGUF file is not supported")
    arch_meta = dict(f.arch_meta)
    arch_meta.setdefault("vocab_size", len(f.meta["tokenizer.ggml.tokens"]))
    arch_meta["tie_word_embeddings"] = "output.weight" not in f.tensor_names
    entry = ARCHITECTURES.lookup_gguf("llama")
    cfg = llama_config_from_gguf(arch_meta, entry.name)
    if r.num_layers is not None:
        cfg = cfg.with_layers(r.num_layers)
    cfg = _with_special_ids(cfg, f.tokenizer)
    quant = cpu_quant_config(_resolve_quantization(r.quantize, f.reader, r.dtype, r.device))
    model, plan = build_model(
        entry.model_class(), cfg, quant, r.dtype, r.device, r.dtype, r.planning
    )
    model.load_weights(iter_llama_weights(f.reader, cfg))
    return LoadedModel(
        model, f.tokenizer, cfg, plan.kv_cache_dtype, f.describe(f"weights {quant.name}"), plan
    )


def _load_deepseek2(f: _GGUFFile, r: LoadRequest) -> LoadedModel:
    from moeserve.layers.quant.base import NoQuant
    from moeserve.loader.base import resolve_kv_cache_dtype
    from moeserve.loader.gguf_deepseek import deepseek2_hf_config, iter_deepseek2_weights
    from moeserve.models.registry import config_from_hf, model_class

    dtype, tp = r.dtype, r.tp
    if r.quantize not in ("auto", "none"):
        # the CPU weight-only int4/int8 methods keep no dense weight, which MLA needs
        raise LoadError(f"quantization {r.quantize} applies to llama GGUF files; use none or auto")
    vocab = int(f.arch_meta.get("vocab_size") or len(f.meta["tokenizer.ggml.tokens"]))
    try:
        cfg = config_from_hf(deepseek2_hf_config(f.arch_meta, f.tensor_names, vocab))
    except (KeyError, ConfigError) as e:
        raise LoadError(f"GGUF deepseek2 metadata is incomplete or unsupported: {e}") from None
    if r.mtp:
        if cfg.num_nextn_predict_layers < 1:
            raise LoadError(
                "--speculative-config method mtp: this GGUF file has no MTP (nextn) block "
                "(llama.cpp's deepseek2 converter drops it); use the HF checkpoint folder"
            )
        cfg = cfg.with_mtp()
    if r.num_layers is not None:
        cfg = cfg.with_layers(r.num_layers)
    cfg = _with_special_ids(cfg, f.tokenizer)
    kv_dtype = resolve_kv_cache_dtype(r.kv_cache_dtype, None, dtype)
    model, plan = build_model(
        model_class(cfg.architecture), cfg, NoQuant(), dtype, r.device, kv_dtype, r.planning, tp
    )
    loaded = model.load_weights(iter_deepseek2_weights(f.reader, cfg, dequantize))
    missing = [
        n
        for n, p in model.named_parameters()
        if n not in loaded and not getattr(p, "optional", False)
    ]
    if missing:
        raise LoadError(f"GGUF file lacks {len(missing)} weights, e.g. {missing[0]!r}")
    model = model.eval()
    what = f"deepseek2 {cfg.num_hidden_layers} layers, weights dequantized to {dtype}"
    if tp.size > 1:
        what += f", tensor-parallel rank {tp.rank} of {tp.size}"
    return LoadedModel(model, f.tokenizer, cfg, plan.kv_cache_dtype, f.describe(what), plan)


# llama.cpp architecture -> its loader; each is served by the architecture-table entry whose
# gguf_arch it is (moeserve.models.registry)
_LOADERS = {"llama": _load_llama, "deepseek2": _load_deepseek2}

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
    eos = () if tok.eos_token_id is None else (tok.eos_token_id,)
    return replace(cfg, bos_token_id=tok.bos_token_id, eos_token_ids=eos)
