"""Typed, frozen configuration objects.

Model code never reads raw HF dicts: the architecture table (moeserve/models/registry.py) picks
one of the parsers below (`llama_config`, `deepseek_config`, ...), which turns a checkpoint's
description into one `ModelConfig`, once.
"""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Any, get_args, get_type_hints

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


DEFAULT_MAX_POSITIONS = 4096  # a config.json or GGUF file that does not say


def served_context_len(requested: int | None, model_positions: int) -> int:
    """The served context: `requested` (--max-model-len), else the model's positions. Longer
    than the model's positions is refused: its RoPE table ends there (and a rank past it
    would fail mid-step, taking every rank with it)."""
    if requested is None:
        return model_positions
    if requested > model_positions:
        raise ConfigError(
            f"--max-model-len {requested} exceeds the model's context of "
            f"{model_positions} tokens (max_position_embeddings)."
        )
    return requested


@dataclass(frozen=True)
class VisionConfig:
    """Kimi-K2.5's MoonViT tower and patch-merger projector (config.json `vision_config`,
    with the published `vt_*` names; transformers' names are read where those are absent),
    and the token that stands for one merged patch in the prompt."""

    hidden_size: int = 1152
    num_hidden_layers: int = 27
    num_attention_heads: int = 16
    intermediate_size: int = 4304
    patch_size: int = 14
    pos_emb_height: int = 64
    pos_emb_width: int = 64
    pos_emb_time: int = 4
    merge_kernel_size: tuple[int, int] = (2, 2)
    projector_ln_eps: float = 1e-5
    text_hidden_size: int = 7168
    media_placeholder_token_id: int = 163605

    @staticmethod
    def from_hf(v: dict[str, Any], text_hidden: int, placeholder: int | None) -> VisionConfig:
        d = VisionConfig()

        def pick(*names: str, default: Any) -> Any:
            return next((v[n] for n in names if v.get(n) is not None), default)

        kernel = pick("merge_kernel_size", default=d.merge_kernel_size)
        if isinstance(kernel, int):
            kernel = (kernel, kernel)
        if v.get("merge_type", "sd2_tpool") != "sd2_tpool" or v.get(
            "mm_projector_type", "patchmerger"
        ) not in ("patchmerger",):
            raise ConfigError(
                "vision_config: only MoonViT's sd2_tpool merge with the patchmerger projector "
                "is supported"
            )
        return VisionConfig(
            hidden_size=int(pick("vt_hidden_size", "hidden_size", default=d.hidden_size)),
            num_hidden_layers=int(
                pick("vt_num_hidden_layers", "num_hidden_layers", default=d.num_hidden_layers)
            ),
            num_attention_heads=int(
                pick("vt_num_attention_heads", "num_attention_heads", default=d.num_attention_heads)
            ),
            intermediate_size=int(
                pick("vt_intermediate_size", "intermediate_size", default=d.intermediate_size)
            ),
            patch_size=int(pick("patch_size", default=d.patch_size)),
            pos_emb_height=int(pick("init_pos_emb_height", "pos_emb_height", default=64)),
            pos_emb_width=int(pick("init_pos_emb_width", "pos_emb_width", default=64)),
            pos_emb_time=int(pick("init_pos_emb_time", "pos_emb_time", default=4)),
            merge_kernel_size=(int(kernel[0]), int(kernel[1])),
            projector_ln_eps=float(pick("projector_ln_eps", default=d.projector_ln_eps)),
            text_hidden_size=int(text_hidden),
            media_placeholder_token_id=int(
                placeholder if placeholder is not None else d.media_placeholder_token_id
            ),
        )

    @property
    def merge_size(self) -> int:
        """Patches merged into one token (2 x 2)."""
        return self.merge_kernel_size[0] * self.merge_kernel_size[1]


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head Latent Attention (DeepSeek-V2/V3, Kimi): queries through a low-rank `q_lora_rank`
    bottleneck (None: one q_proj), keys and values from one cached latent of `kv_lora_rank`
    plus a shared RoPE key of `qk_rope_head_dim`."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """The width of one cached row: [latent | roped k_pe]."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    """Routed and shared experts (DeepSeek-V3 / Kimi) and how tokens are routed to them."""

    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    n_group: int = 1
    topk_group: int = 1
    topk_method: str = "greedy"
    scoring_func: str = "softmax"
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = False
    # serving layout, not architecture: shared experts run as extra slots of the routed
    # experts' fused kernel where their format allows (layers/moe.py shared_expert_slots);
    # False keeps them a separate MLP (tests compare the two)
    shared_experts_as_slots: bool = True

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    @property
    def grouped(self) -> bool:
        """Whether routing is limited to the best `topk_group` of `n_group` expert groups."""
        return self.topk_method in ("noaux_tc", "group_limited_greedy")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only model: the fields every architecture has, and a section
    per family of layers it uses (`mla`, `moe`, `vision`; None where it has none)."""

    architecture: str  # a key of the architecture table (moeserve/models/registry.py)
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
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None
    # Kimi-K2.5's vision tower and projector (None: a text-only model)
    vision: VisionConfig | None = None
    num_nextn_predict_layers: int = 0
    # the checkpoint layer index of the MTP module built and served as a draft model
    # (speculative decoding, method mtp); -1: none (MTP layers are skipped on load)
    mtp_index: int = -1
    # where the text model's weights live inside the checkpoint ("" or "language_model.")
    weight_prefix: str = ""

    # ---- derived -------------------------------------------------------------------------
    @property
    def is_mla(self) -> bool:
        return self.mla is not None

    def is_moe_layer(self, i: int) -> bool:
        return self.moe is not None and self.moe.is_moe_layer(i)

    def context_len(self, requested: int | None) -> int:
        """The served context: `requested` (--max-model-len), else the model's; see
        served_context_len."""
        return served_context_len(requested, self.max_position_embeddings)

    def with_mtp(self) -> ModelConfig:
        """The same model with its first MTP layer built as a draft model (before
        `with_layers`: the MTP layer keeps its checkpoint index)."""
        if self.num_nextn_predict_layers < 1:
            raise ConfigError(
                "--speculative-config method mtp: the checkpoint has no MTP layers "
                "(num_nextn_predict_layers is 0)"
            )
        return replace(self, mtp_index=self.num_hidden_layers)

    def with_layers(self, n: int) -> ModelConfig:
        """The same model cut to `n` layers (benchmarks on real shapes, fewer layers)."""
        return replace(self, num_hidden_layers=n)


# ---- parsers: a checkpoint's description -> ModelConfig (chosen by the architecture table,
# moeserve/models/registry.py, which passes the table name the config is recorded under) ------
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
        max_position_embeddings=c.get("max_position_embeddings", DEFAULT_MAX_POSITIONS),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        bos_token_id=c.get("bos_token_id"),
        eos_token_ids=eos_ids,
        dtype=_parse_dtype(c.get("torch_dtype") or c.get("dtype") or "bfloat16"),
    )


def llama_config(c: dict[str, Any], architecture: str) -> ModelConfig:
    """A Llama-family config.json (GQA attention, RoPE, SwiGLU)."""
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return ModelConfig(
        architecture=architecture,
        head_dim=head_dim,
        attention_bias=bool(c.get("attention_bias", False)),
        **_common(c),
    )


def deepseek_config(c: dict[str, Any], architecture: str) -> ModelConfig:
    """A DeepSeek-V2/V3-family config.json (MLA attention, routed experts): DeepSeek-V3/R1,
    Kimi-K2, Moonlight."""
    # fields a producer omits take that producer's defaults: transformers' DeepseekV3Config
    # writes no topk_method / scoring_func (noaux_tc + sigmoid are implied) and has its own
    # group-routing defaults; DeepSeek-V2 keeps V2's greedy softmax routing
    c = {**_deepseek_defaults(c), **c}
    nextn = int(c.get("num_nextn_predict_layers") or 0)
    if nextn:
        log.info("MTP: %d next-token-prediction layer(s) skipped on load", nextn)
    experts = c.get("n_routed_experts") or 0
    moe = None
    if experts:
        moe = MoEConfig(
            n_routed_experts=experts,
            num_experts_per_tok=c.get("num_experts_per_tok") or 0,
            moe_intermediate_size=c.get("moe_intermediate_size") or 0,
            n_shared_experts=c.get("n_shared_experts") or 0,
            first_k_dense_replace=c.get("first_k_dense_replace") or 0,
            moe_layer_freq=c.get("moe_layer_freq") or 1,
            n_group=c.get("n_group") or 1,
            topk_group=c.get("topk_group") or 1,
            topk_method=c["topk_method"],
            scoring_func=c["scoring_func"],
            routed_scaling_factor=float(c["routed_scaling_factor"]),
            norm_topk_prob=bool(c["norm_topk_prob"]),
        )
    mla = MLAConfig(
        kv_lora_rank=c["kv_lora_rank"],
        qk_nope_head_dim=c["qk_nope_head_dim"],
        qk_rope_head_dim=c["qk_rope_head_dim"],
        v_head_dim=c["v_head_dim"],
        q_lora_rank=c.get("q_lora_rank"),
    )
    return ModelConfig(
        architecture=architecture,
        head_dim=mla.qk_head_dim,
        mla=mla,
        moe=moe,
        num_nextn_predict_layers=nextn,
        attention_bias=bool(c.get("attention_bias", False)),
        **_common(c),
    )


def kimi_k25_config(c: dict[str, Any], architecture: str) -> ModelConfig:
    """Kimi-K2.5's config.json: a DeepSeek-V3 text model under `text_config` (its weights under
    `language_model.`) and the MoonViT vision tower."""
    cfg = deepseek_config(dict(c["text_config"]), architecture)
    vision = None
    if c.get("vision_config"):
        vision = VisionConfig.from_hf(
            c["vision_config"],
            cfg.hidden_size,
            c.get("media_placeholder_token_id", c.get("image_token_id")),
        )
    return replace(cfg, weight_prefix="language_model.", vision=vision)


def llama_config_from_gguf(meta: dict[str, Any], architecture: str) -> ModelConfig:
    """From GGUF key/values of a `llama` architecture file (keys without the prefix)."""
    heads = int(meta["attention.head_count"])
    hidden = int(meta["embedding_length"])
    head_dim = int(meta.get("attention.key_length") or hidden // heads)
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(meta["vocab_size"]),
        hidden_size=hidden,
        num_hidden_layers=int(meta["block_count"]),
        num_attention_heads=heads,
        num_key_value_heads=int(meta.get("attention.head_count_kv") or heads),
        head_dim=head_dim,
        intermediate_size=int(meta["feed_forward_length"]),
        rms_norm_eps=float(meta.get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta.get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(meta.get("context_length", DEFAULT_MAX_POSITIONS)),
        tie_word_embeddings=bool(meta.get("tie_word_embeddings", False)),
        dtype=torch.float32,
    )


# transformers' DeepseekV3Config defaults (v5 writes neither topk_method nor scoring_func:
# its routing is always noaux_tc with sigmoid scores and a correction bias)
DEEPSEEK_V3_DEFAULTS: dict[str, Any] = dict(
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    num_attention_heads=128,
    num_key_value_heads=128,
    n_shared_experts=1,
    n_routed_experts=256,
    routed_scaling_factor=2.5,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_rope_head_dim=64,
    v_head_dim=128,
    qk_nope_head_dim=128,
    n_group=8,
    topk_group=4,
    num_experts_per_tok=8,
    first_k_dense_replace=3,
    norm_topk_prob=True,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    moe_layer_freq=1,
)
# DeepSeek-V2's own routing defaults (greedy top-k over softmax scores, no renormalising)
DEEPSEEK_V2_DEFAULTS: dict[str, Any] = dict(
    topk_method="greedy",
    scoring_func="softmax",
    routed_scaling_factor=1.0,
    norm_topk_prob=False,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=0,
    moe_layer_freq=1,
)


def _deepseek_defaults(c: dict[str, Any]) -> dict[str, Any]:
    """The producer's defaults for a DeepSeek-family config dict: V2's for model_type
    deepseek_v2, else transformers' DeepseekV3Config (deepseek_v3, kimi_k2, Moonlight)."""
    kind = c.get("model_type")
    if kind is None:
        archs = c.get("architectures") or [""]
        kind = "deepseek_v2" if archs[0].startswith("DeepseekV2") else "deepseek_v3"
    return DEEPSEEK_V2_DEFAULTS if kind == "deepseek_v2" else DEEPSEEK_V3_DEFAULTS


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


# ---- engine and server settings ------------------------------------------------------------
# Each setting is declared once, here, with its default and help text; CLI flags
# (`add_config_arguments`) and `build_engine(**settings)` (`EngineConfig.from_settings`) derive
# from these declarations.


def setting(
    default: Any,
    help: str,
    *,
    flag: str | None = None,
    short: str | None = None,
    choices: tuple[Any, ...] | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
    negate: str | None = None,
    cli: bool = True,
) -> Any:
    """A config field that is also a command-line flag.

    `flag`: the option name (default `--field-name`); `short`: an extra alias (e.g. `-tp`);
    `minimum`/`maximum`: inclusive bounds checked for the CLI and for programmatic use;
    `negate`: for a boolean that defaults to True, the flag that turns it off;
    `cli=False`: a setting the CLI does not expose (filled by the program).
    """
    meta = dict(
        help=help,
        flag=flag,
        short=short,
        choices=choices,
        minimum=minimum,
        maximum=maximum,
        negate=negate,
        cli=cli,
    )
    return field(default=default, metadata=meta)


def _check_settings(obj: Any) -> None:
    """Bounds and choices of every `setting` field (one sentence per violation)."""
    for f in fields(obj):
        meta = f.metadata
        if "help" not in meta:
            continue
        v = getattr(obj, f.name)
        if v is None or isinstance(v, bool):
            continue
        name = _flag_name(f)
        if meta["choices"] is not None and v not in meta["choices"]:
            choices = ", ".join(str(c) for c in meta["choices"])
            raise ConfigError(f"{name} must be one of {choices}, got {v!r}")
        if meta["minimum"] is not None and v < meta["minimum"]:
            raise ConfigError(f"{name} must be at least {meta['minimum']}, got {v!r}")
        if meta["maximum"] is not None and v > meta["maximum"]:
            raise ConfigError(f"{name} must be at most {meta['maximum']}, got {v!r}")


def _flag_name(f: Any) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


class _Settings:
    """Base of the settings dataclasses: checks bounds on construction."""

    def __post_init__(self) -> None:
        _check_settings(self)


@dataclass(frozen=True)
class LoadConfig(_Settings):
    """What to load and how: the model path is given separately (positional on the CLI)."""

    dtype: str = setting(
        "auto",
        "activation dtype (auto: bfloat16 on GPUs and on CPUs with bf16 instructions, "
        "else float32)",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    quantization: str = setting(
        "auto",
        "CPU weight-only kernels for GGUF models (auto: int4 for 4-bit files, int8 otherwise, "
        "when activations are bf16)",
        choices=("auto", "none", "int4", "int8"),
    )
    load_format: str = setting(
        "auto",
        "dummy: random weights in the serving format, from config.json alone",
        choices=("auto", "dummy"),
    )
    num_layers: int | None = setting(
        None, "use only the first N layers (benchmarks with --load-format dummy)", minimum=1
    )
    device: str | None = setting(None, "cpu or cuda[:N] (default: cuda if present)")
    seed: int = setting(0, "seed of the default random generators and of dummy weights")
    threads: int | None = setting(
        None,
        "CPU threads for torch's kernels (default: torch's; `serve` leaves one core to the HTTP "
        "front end; where the native CPU kernels serve, torch only glues them and runs on one)",
        minimum=1,
    )
    prefill_threads: int | None = setting(
        None,
        "CPU threads for steps of many tokens (prefill chunks), which gain more from every "
        "core than they lose to the front end, and for the native CPU kernels at every step "
        "(their pool shares cores without waiting on them) (default: the rank's share of all "
        "cores)",
        minimum=1,
    )
    cpu_kernels: str = setting(
        "auto",
        "CPU kernels: native (compiled for this CPU at first use; every logit independent of "
        "how its sequence is split into steps or batched), torch, or auto (native where they "
        "build and activations are bf16)",
        choices=("auto", "native", "torch"),
    )
    deterministic: bool = setting(
        False,
        "batch-invariant results where the default kernels are not (the native CPU kernels "
        "always are): on CPUs with torch's kernels, batch-invariant attention at a cost in "
        "speed (see benchmarks/results/cpu_decode.md)",
    )


@dataclass(frozen=True)
class CacheConfig(_Settings):
    page_size: int = setting(16, "tokens per KV page", minimum=1)
    num_pages: int | None = setting(
        None, "KV cache pages (default: sized from the memory left after weights)", minimum=1
    )
    kv_cache_dtype: str = setting(
        "auto",
        "MLA latent cache dtype (auto follows the checkpoint)",
        choices=("auto", "bf16", "fp8"),
    )
    mla_decode_kernel: str = setting(
        "auto",
        "MLA decode attention kernel on GPUs in CUDA graphs: triton, or gluon (Hopper: TMA + "
        "wgmma; BF16 cache, --page-size a multiple of 64); auto takes gluon where it can "
        "serve and measured faster (cache capacity >= 4096 tokens, or > 16 heads per GPU at "
        "batch >= 8)",
        choices=("auto", "triton", "gluon"),
    )
    enable_prefix_caching: bool = setting(
        True, "disable the prefix cache", negate="--no-prefix-caching"
    )
    gpu_memory_utilization: float = setting(
        0.90,
        "GPU: share of the GPU's memory that weights, activations, CUDA graphs and the KV cache "
        "may take together",
        minimum=0.05,
        maximum=1.0,
    )
    cpu_memory_fraction: float = setting(
        0.25, "CPU: share of available RAM the KV cache may take", minimum=0.01, maximum=1.0
    )
    cpu_max_kv_gib: float = setting(2.0, "CPU: and at most this many GiB", minimum=0.001)


@dataclass(frozen=True)
class SchedulerConfig(_Settings):
    max_num_seqs: int = setting(64, "most sequences in one batch", minimum=1)
    max_num_batched_tokens: int = setting(
        2048, "token budget of one step (prefill chunk size)", minimum=1
    )
    max_model_len: int | None = setting(
        None, "context length (default: the model's, capped by what the KV cache holds)", minimum=1
    )
    long_prefill_token_threshold: int | None = setting(
        None,
        "most prompt tokens one request prefills in a step, so that requests arriving behind "
        "a long prompt are admitted beside its chunks instead of after all of them; 0 = no "
        "limit (default: 1024 on CPUs, where a chunk of the full budget takes seconds; none "
        "on GPUs)",
        minimum=0,
    )


@dataclass(frozen=True)
class ParallelConfig(_Settings):
    tensor_parallel_size: int = setting(
        1,
        "GPUs (ranks) one model is split over: attention heads, dense/shared-expert "
        "intermediate dims and the vocabulary are sharded",
        short="-tp",
        minimum=1,
    )
    enable_expert_parallel: bool = setting(
        False,
        "routed experts whole per rank (E / tp each) instead of split along their "
        "intermediate dim; combined in the same all-reduce",
    )
    distributed_executor: str = setting(
        "mp",
        "mp: one process per GPU of this host (spawned); torchrun: launched by torchrun "
        "(several hosts: torchrun --nnodes H --nproc-per-node G -m moeserve.cli serve ...)",
        choices=("mp", "torchrun"),
    )
    all_reduce: str = setting(
        "auto",
        "all-reduce implementation (auto: one-shot over peer memory for small messages where "
        "GPUs reach each other, NCCL otherwise)",
        choices=("auto", "nccl", "one-shot"),
    )
    dist_timeout_s: float = setting(
        300.0,
        "seconds a start-up collective may wait before the server exits with one line",
        minimum=1.0,
    )
    simulate_rank: str | None = setting(
        None,
        "benchmarks: one process on one device holds exactly rank 0's share of a tensor-"
        "parallel layout, tpN or tpN-ep (with expert parallelism), and skips the collectives; "
        "routed experts get the busiest rank's expected share of the slots; outputs are not "
        "the model's",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.simulate_rank is None:
            return
        parse_rank_layout(self.simulate_rank)
        if (
            self.tensor_parallel_size != 1
            or self.enable_expert_parallel
            or self.distributed_executor != "mp"
        ):
            raise ConfigError(
                "--simulate-rank runs one process and names its own layout: leave "
                "--tensor-parallel-size, --enable-expert-parallel and --distributed-executor "
                "unset"
            )

    @property
    def tp_size(self) -> int:
        return self.tensor_parallel_size


def parse_rank_layout(value: str) -> tuple[int, bool]:
    """`tpN` / `tpN-ep` -> (N, expert parallel), N >= 2 (the `--simulate-rank` format)."""
    tp, _, ep = value.partition("-")
    size = tp[2:]
    if not (tp.startswith("tp") and size.isdigit() and int(size) >= 2 and ep in ("", "ep")):
        raise ConfigError(
            f"--simulate-rank must be tpN or tpN-ep with N >= 2 (e.g. tp8-ep), got {value!r}"
        )
    return int(size), ep == "ep"


# ---- speculative decoding --------------------------------------------------------------------
SPECULATIVE_METHODS = ("ngram", "suffix", "eagle3", "mtp")
# vLLM's spellings of the same methods, so launch scripts carry over
_METHOD_ALIASES = {"[ngram]": "ngram", "deepseek_mtp": "mtp", "eagle-3": "eagle3"}
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """`--speculative-config '{"method": ..., "num_speculative_tokens": K, ...}'` (vLLM's keys).

    `ngram`: prompt lookup over the request's prompt and output, n-grams of
    `prompt_lookup_min`..`prompt_lookup_max` tokens. `suffix`: a suffix tree over this request
    and recently finished ones; the draft ends where the tree's continuation frequency falls
    below `suffix_decoding_min_token_prob`, and is at most `suffix_decoding_max_spec_factor`
    times the matched length. `eagle3` / `mtp`: a draft model (`model`: an EAGLE-3 head's
    folder; MTP reads the target checkpoint's own MTP layers). `adaptive`: draft fewer tokens,
    or none, where the measured verify cost and the request's running acceptance say it does
    not pay.
    """

    method: str
    num_speculative_tokens: int = 3
    model: str | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    suffix_decoding_max_tree_depth: int = 64
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    adaptive: bool = True

    def __post_init__(self) -> None:
        method = _METHOD_ALIASES.get(self.method, self.method)
        object.__setattr__(self, "method", method)
        if method not in SPECULATIVE_METHODS:
            raise ConfigError(
                f"--speculative-config: method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                f"got {self.method!r}"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(
                "--speculative-config: num_speculative_tokens must be an integer in "
                f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}"
            )
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ConfigError(
                "--speculative-config: prompt_lookup_min and prompt_lookup_max must be integers "
                f"with 1 <= min <= max, got {lo!r} and {hi!r}"
            )
        if self.suffix_decoding_max_tree_depth < 1 or self.suffix_decoding_max_cached_requests < 0:
            raise ConfigError(
                "--speculative-config: suffix_decoding_max_tree_depth must be at least 1 and "
                "suffix_decoding_max_cached_requests at least 0"
            )
        if self.suffix_decoding_max_spec_factor <= 0:
            raise ConfigError("--speculative-config: suffix_decoding_max_spec_factor must be > 0")
        if not 0.0 <= self.suffix_decoding_min_token_prob <= 1.0:
            raise ConfigError(
                "--speculative-config: suffix_decoding_min_token_prob must be in [0, 1]"
            )
        if method == "eagle3" and not (isinstance(self.model, str) and self.model):
            raise ConfigError(
                '--speculative-config: method eagle3 needs "model", the EAGLE-3 draft '
                "head's folder"
            )

    @classmethod
    def parse(cls, value: str | dict | SpeculativeConfig) -> SpeculativeConfig:
        """From the flag's JSON text, a dict (Python callers) or an instance."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--speculative-config is not valid JSON ({e.msg})") from None
        if not isinstance(value, dict):
            raise ConfigError("--speculative-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(
                f"--speculative-config: unknown key(s) {', '.join(unknown)}; known: "
                f"{', '.join(sorted(known))}"
            )
        if "method" not in value:
            raise ConfigError('--speculative-config needs "method"')
        return cls(**value)


@dataclass(frozen=True)
class EngineConfig(_Settings):
    """Every engine setting, grouped; `from_settings` builds it from flat keyword arguments."""

    model: str | None = setting(None, "model path", cli=False)
    load: LoadConfig = field(default_factory=LoadConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # GPU decode: replay captured CUDA graphs for decode-only batches of up to this many
    # sequences (capped by scheduler.max_num_seqs); enforce_eager never captures
    enforce_eager: bool = setting(
        False, "GPU: run every step eagerly (no CUDA-graph capture of decode steps)"
    )
    pdl: str = setting(
        "off",
        "GPU: programmatic dependent launch between the decode step's Triton kernels (sm_90+): "
        "each launches while the previous one drains and reads its weights before waiting for "
        "that kernel's output (measured no faster on a Kimi-K2.5 TP8-EP rank's layer, so off "
        "by default)",
        choices=("off", "on"),
    )
    cuda_graph_max_bs: int = setting(
        256,
        "GPU: largest decode batch replayed from a CUDA graph (capped by --max-num-seqs); "
        "bigger batches run eagerly",
        minimum=1,
    )

    overlap_schedule: bool | None = setting(
        None,
        "overlap scheduling, on by default on GPUs (this flag turns it off): while the GPU runs "
        "step N, the host queues step N+1 and then processes step N's outputs (batches of "
        "plain greedy requests, whose next input token stays on the GPU)",
        negate="--no-overlap-schedule",
    )
    profile_decode: int = setting(
        0,
        "profile N decode steps once decoding runs, print where the step time goes by "
        "component (attention, MLA decode, router, experts, norms, all-reduce, GPU idle) and "
        "export it on /metrics",
        minimum=0,
    )
    speculative_config: SpeculativeConfig | None = setting(
        None,
        "speculative decoding, as a JSON object with vLLM's keys: "
        '{"method": "ngram" | "suffix" | "eagle3" | "mtp", "num_speculative_tokens": K, '
        '"model": PATH, "prompt_lookup_min": N, "prompt_lookup_max": M}; eagle3 loads the '
        "EAGLE-3 draft head in the folder PATH (Llama-style or MLA), mtp the checkpoint's own "
        "MTP layer; drafts are verified in one step, so greedy output is exactly that of plain "
        "decoding and sampled output follows the same distribution",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        spec = self.speculative_config
        if spec is not None and not isinstance(spec, SpeculativeConfig):
            object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(spec))

    def graph_max_batch(self, device: str) -> int:
        """Largest decode batch (one-token rows) replayed from a CUDA graph on `device` (0:
        graphs off). A sequence verifying a draft of K tokens takes K + 1 rows."""
        if self.enforce_eager or not device.startswith("cuda"):
            return 0
        rows = self.scheduler.max_num_seqs * (1 + self.num_speculative_tokens)
        return max(0, min(self.cuda_graph_max_bs, rows))

    @property
    def num_speculative_tokens(self) -> int:
        """Most draft tokens a sequence verifies in a step (0: no speculative decoding)."""
        spec = self.speculative_config
        return spec.num_speculative_tokens if spec is not None else 0

    @classmethod
    def from_settings(cls, model: str | None = None, **settings: Any) -> EngineConfig:
        """From flat keyword settings (`max_num_seqs=8, tensor_parallel_size=2, ...`), each
        routed to the group that declares it; an unknown name is a TypeError."""
        return config_from_flat(cls, dict(settings, model=model))


@dataclass(frozen=True)
class ServerConfig(_Settings):
    host: str = setting("127.0.0.1", "bind address (default: loopback)")
    port: int = setting(8000, "TCP port", minimum=0, maximum=65535)
    api_key: str | None = setting(None, "require 'Authorization: Bearer KEY'")
    served_model_name: str = setting(
        "default", "model name in the API (default: the model file or folder name)", cli=False
    )
    reasoning_parser: str | None = setting(
        None, "split reasoning from content", choices=("none", "kimi_k2", "deepseek_r1")
    )
    tool_call_parser: str | None = setting(
        None, "parse tool calls from the output", choices=("none", "kimi_k2")
    )
    log_level: str = setting(
        "info", "logging level", choices=("debug", "info", "warning", "error", "critical")
    )
    max_request_body: int = setting(
        4 << 20, "largest request body in bytes, checked before parsing (413 beyond it)", minimum=1
    )
    max_queue_len: int = setting(
        256,
        "engine requests that may wait for a batch slot; beyond it new requests get 429 with "
        "Retry-After",
        minimum=1,
    )
    max_choices_per_request: int = setting(
        256, "most engine requests one HTTP request may start (prompts x n)", minimum=1
    )
    request_timeout: float | None = setting(
        None,
        "seconds a generation request may run; past it it is aborted (408, or an error event "
        "in a stream)",
        minimum=0.001,
    )
    shutdown_timeout: float = setting(
        30.0,
        "seconds SIGTERM waits for running requests to finish before exiting (a second SIGTERM "
        "exits at once)",
        minimum=0.0,
    )
    allowed_media_domains: str | None = setting(
        None,
        "comma-separated hosts whose http(s) image URLs the server may fetch (default: none; "
        "data: URLs are always accepted)",
    )
    max_images_per_request: int = setting(
        8, "most images one chat request may hold (vision models)", minimum=0
    )
    max_image_bytes: int = setting(
        10 << 20, "largest image file in bytes, decoded from a data: URL or fetched", minimum=1
    )
    max_image_pixels: int = setting(
        40_000_000,
        "largest image in pixels (width x height), checked before it is decoded",
        minimum=1,
    )
    media_fetch_timeout: float = setting(10.0, "seconds an image URL fetch may take", minimum=0.001)


# ---- settings <-> flags ---------------------------------------------------------------------
def _is_group(tp: Any) -> bool:
    return isinstance(tp, type) and is_dataclass(tp)


def _scalar_type(tp: Any) -> type:
    """int / float / str / bool of an annotation like `int | None`."""
    args = [a for a in get_args(tp) if a is not type(None)] or [tp]
    return args[0]


def _parse(kind: type, f: Any) -> Any:
    name = _flag_name(f)

    def parse(s: str) -> Any:
        if kind is SpeculativeConfig:
            try:
                return SpeculativeConfig.parse(s)
            except ConfigError as e:
                raise argparse.ArgumentTypeError(str(e).removeprefix(name + ": ")) from None
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{name} expects a {kind.__name__}, got {s!r}"
            ) from None
        lo, hi = f.metadata["minimum"], f.metadata["maximum"]
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            bounds = (
                f"at least {lo}"
                if hi is None
                else f"at most {hi}"
                if lo is None
                else f"in [{lo}, {hi}]"
            )
            raise argparse.ArgumentTypeError(f"{name} must be {bounds}, got {s!r}")
        return v

    return parse


def add_config_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """One flag per `setting` field of `cls` (and of its nested groups)."""
    hints = get_type_hints(cls)
    for f in fields(cls):
        tp = hints[f.name]
        if _is_group(tp):
            add_config_arguments(parser, tp)
            continue
        meta = f.metadata
        if not meta.get("cli", False):
            continue
        names = [_flag_name(f)] + ([meta["short"]] if meta["short"] else [])
        kind = _scalar_type(tp)
        if kind is bool:
            if meta["negate"]:
                parser.add_argument(
                    meta["negate"], dest=f.name, action="store_false", help=meta["help"]
                )
            else:
                parser.add_argument(*names, dest=f.name, action="store_true", help=meta["help"])
            parser.set_defaults(**{f.name: f.default})
            continue
        default = f.default
        shown = "" if default is None else f" (default: {default})"
        parser.add_argument(
            *names,
            dest=f.name,
            type=_parse(kind, f),
            default=default,
            choices=meta["choices"],
            help=meta["help"] + shown,
        )


def config_from_args(cls: type, args: argparse.Namespace, **extra: Any) -> Any:
    """The config `cls` from parsed flags (settings the CLI does not expose keep their
    defaults unless given in `extra`)."""
    flat = {k: v for k, v in vars(args).items() if k in setting_names(cls)}
    flat.update(extra)
    return config_from_flat(cls, flat)


def setting_names(cls: type) -> set[str]:
    hints = get_type_hints(cls)
    out: set[str] = set()
    for f in fields(cls):
        out |= setting_names(hints[f.name]) if _is_group(hints[f.name]) else {f.name}
    return out


def config_from_flat(cls: type, flat: dict[str, Any]) -> Any:
    """Build `cls` from flat setting names, routing each to the nested group declaring it."""
    unknown = set(flat) - setting_names(cls)
    if unknown:
        raise TypeError(f"unknown setting(s) for {cls.__name__}: {', '.join(sorted(unknown))}")

    def build(c: type) -> Any:
        hints = get_type_hints(c)
        kw = {}
        for f in fields(c):
            if _is_group(hints[f.name]):
                kw[f.name] = build(hints[f.name])
            elif f.name in flat:
                kw[f.name] = flat[f.name]
        return c(**kw)

    return build(cls)
