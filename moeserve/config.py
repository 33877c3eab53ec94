"""Typed, frozen configuration objects.

Model code never reads raw HF dicts: `ModelConfig.from_hf` / `ModelConfig.from_gguf` turn a
checkpoint's description into one `ModelConfig`, once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

import torch

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A user-facing configuration problem (one clear sentence)."""


@dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling parameters (YaRN for DeepSeek/Kimi, llama3 / linear for Llama)."""

    type: str  # "yarn" | "llama3" | "linear" | "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0

    @staticmethod
    def from_hf(d: dict[str, Any] | None) -> RopeScaling | None:
        if not d:
            return None
        kind = d.get("rope_type", d.get("type", "default"))
        if kind in (None, "default"):
            return None
        known = {f for f in RopeScaling.__dataclass_fields__ if f != "type"}
        return RopeScaling(
            type=kind, **{k: v for k, v in d.items() if k in known and v is not None}
        )


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only model: dense Llama or DeepSeek-V3 (MLA + MoE)."""

    architecture: str  # "llama" | "deepseek_v3"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    num_key_value_heads: int = 0
    head_dim: int = 0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: torch.dtype = torch.bfloat16  # the checkpoint's own dtype
    # MLA (DeepSeek-V3 / Kimi)
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # MoE
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    n_group: int = 1
    topk_group: int = 1
    topk_method: str = "greedy"
    scoring_func: str = "softmax"
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False
    num_nextn_predict_layers: int = 0
    # where the text model's weights live inside the checkpoint ("" or "language_model.")
    weight_prefix: str = ""

    # ---- derived -------------------------------------------------------------------------
    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def is_moe_layer(self, i: int) -> bool:
        return (
            self.n_routed_experts > 0
            and i >= self.first_k_dense_replace
            and i % self.moe_layer_freq == 0
        )

    def with_layers(self, n: int) -> ModelConfig:
        """The same model cut to `n` layers (benchmarks on real shapes, fewer layers)."""
        return replace(self, num_hidden_layers=n)

    # ---- constructors --------------------------------------------------------------------
    @staticmethod
    def from_hf(config: dict[str, Any]) -> ModelConfig:
        archs = config.get("architectures") or []
        arch = archs[0] if archs else config.get("model_type", "")
        if arch == "KimiK25ForConditionalGeneration" or config.get("model_type") == "kimi_k25":
            text = dict(config["text_config"])
            if "vision_config" in config:
                log.info("Kimi-K2.5: vision tower skipped (text-only serving)")
            cfg = ModelConfig._deepseek_from_hf(text)
            return replace(cfg, weight_prefix="language_model.")
        if arch in ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM", "deepseek_v3", "deepseek_v2"):
            return ModelConfig._deepseek_from_hf(config)
        if arch in ("LlamaForCausalLM", "llama", "MistralForCausalLM", "mistral"):
            return ModelConfig._llama_from_hf(config)
        raise ConfigError(f"unsupported model architecture {arch!r}")

    @staticmethod
    def _common(c: dict[str, Any]) -> dict[str, Any]:
        eos = c.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        rope = c.get("rope_scaling") or c.get("rope_parameters")
        theta = c.get("rope_theta")
        if theta is None and isinstance(rope, dict):
            theta = rope.get("rope_theta")
        return dict(
            vocab_size=c["vocab_size"],
            hidden_size=c["hidden_size"],
            num_hidden_layers=c["num_hidden_layers"],
            num_attention_heads=c["num_attention_heads"],
            num_key_value_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
            intermediate_size=c["intermediate_size"],
            rms_norm_eps=c.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta if theta is not None else 10000.0),
            rope_scaling=RopeScaling.from_hf(rope),
            max_position_embeddings=c.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            bos_token_id=c.get("bos_token_id"),
            eos_token_ids=eos_ids,
            dtype=_parse_dtype(c.get("torch_dtype") or c.get("dtype") or "bfloat16"),
        )

    @staticmethod
    def _llama_from_hf(c: dict[str, Any]) -> ModelConfig:
        common = ModelConfig._common(c)
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        return ModelConfig(
            architecture="llama",
            head_dim=head_dim,
            attention_bias=bool(c.get("attention_bias", False)),
            **common,
        )

    @staticmethod
    def _deepseek_from_hf(c: dict[str, Any]) -> ModelConfig:
        common = ModelConfig._common(c)
        nextn = int(c.get("num_nextn_predict_layers") or 0)
        if nextn:
            log.info("MTP: %d next-token-prediction layer(s) skipped on load", nextn)
        return ModelConfig(
            architecture="deepseek_v3",
            head_dim=c["qk_nope_head_dim"] + c["qk_rope_head_dim"],
            q_lora_rank=c.get("q_lora_rank"),
            kv_lora_rank=c["kv_lora_rank"],
            qk_nope_head_dim=c["qk_nope_head_dim"],
            qk_rope_head_dim=c["qk_rope_head_dim"],
            v_head_dim=c["v_head_dim"],
            n_routed_experts=c.get("n_routed_experts") or 0,
            n_shared_experts=c.get("n_shared_experts") or 0,
            num_experts_per_tok=c.get("num_experts_per_tok") or 0,
            moe_intermediate_size=c.get("moe_intermediate_size") or 0,
            first_k_dense_replace=c.get("first_k_dense_replace", 0),
            moe_layer_freq=c.get("moe_layer_freq", 1),
            n_group=c.get("n_group") or 1,
            topk_group=c.get("topk_group") or 1,
            topk_method=c.get("topk_method", "greedy"),
            scoring_func=c.get("scoring_func", "softmax"),
            routed_scaling_factor=float(c.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(c.get("norm_topk_prob", False)),
            num_nextn_predict_layers=nextn,
            attention_bias=bool(c.get("attention_bias", False)),
            **common,
        )

    @staticmethod
    def from_gguf_llama(meta: dict[str, Any]) -> ModelConfig:
        """From GGUF key/values of a `llama` architecture file (keys without the prefix)."""
        heads = int(meta["attention.head_count"])
        hidden = int(meta["embedding_length"])
        head_dim = int(meta.get("attention.key_length") or hidden // heads)
        return ModelConfig(
            architecture="llama",
            vocab_size=int(meta["vocab_size"]),
            hidden_size=hidden,
            num_hidden_layers=int(meta["block_count"]),
            num_attention_heads=heads,
            num_key_value_heads=int(meta.get("attention.head_count_kv") or heads),
            head_dim=head_dim,
            intermediate_size=int(meta["feed_forward_length"]),
            rms_norm_eps=float(meta.get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(meta.get("rope.freq_base", 10000.0)),
            max_position_embeddings=int(meta.get("context_length", 4096)),
            tie_word_embeddings=bool(meta.get("tie_word_embeddings", False)),
            dtype=torch.float32,
        )


_DTYPES = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
}


def _parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[str(name).replace("torch.", "")]
    except KeyError:
        raise ConfigError(f"unknown dtype {name!r}; use one of {sorted(_DTYPES)}") from None


def parse_dtype(name: str, model_dtype: torch.dtype, device: str) -> torch.dtype:
    """Resolve `--dtype auto|bf16|fp16|fp32` for a device (auto: bf16 on GPUs, and on CPUs
    with bf16 instructions (AVX512-BF16 or AMX), where torch's weight-only kernels are fast;
    fp32 on other CPUs)."""
    if name == "auto":
        if device != "cpu" or cpu_has_bf16():
            return torch.bfloat16
        return torch.float32
    return _parse_dtype(name)


def cpu_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((ln for ln in f if ln.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


@dataclass(frozen=True)
class CacheConfig:
    page_size: int = 16
    num_pages: int | None = None  # None: sized from free memory
    kv_cache_dtype: str = "auto"  # auto | bf16 | fp8 (MLA) ; auto follows the checkpoint
    enable_prefix_caching: bool = True
    memory_fraction: float = 0.9  # GPU: share of free memory the KV cache may take
    cpu_memory_fraction: float = 0.25  # CPU: share of available RAM the KV cache may take
    cpu_max_kv_gib: float = 2.0  # CPU: and at most this much


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # per step: decode tokens + one prefill chunk
    max_model_len: int = 4096


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    rank: int = 0

    @property
    def tp_size(self) -> int:
        return self.tensor_parallel_size


@dataclass(frozen=True)
class EngineConfig:
    model: str
    model_config: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    seed: int = 0
    # GPU decode: replay captured CUDA graphs for decode-only batches of up to this many
    # sequences (capped by scheduler.max_num_seqs); enforce_eager never captures
    enforce_eager: bool = False
    cuda_graph_max_bs: int = 256

    @property
    def graph_max_batch(self) -> int:
        """Largest decode batch replayed from a CUDA graph (0: graphs off)."""
        if self.enforce_eager or not self.device.startswith("cuda"):
            return 0
        return max(0, min(self.cuda_graph_max_bs, self.scheduler.max_num_seqs))


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str = "default"
