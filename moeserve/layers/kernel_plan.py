"""The kernel plan: for each part of a model, the implementation that serves it on a device, and
why; resolved once at load from the hardware, the activation dtype, the checkpoint's format and
the settings.

The plan holds, for each part of the model, the backend class that serves it (MLA or GQA
attention, routed experts, router, a whole fused decoder layer; each family's classes are
listed by name in its module's table, `BACKENDS` / `EXPERTS` / `ROUTERS`) and the switches of
the linears (`LinearKernels`); every printed line names what its backend is. The loader
resolves it before any weight is read, hands it to every layer (`apply_kernel_plan`: each
layer builds its backend from it and never asks again), and the start-up banner prints it;
`moeserve plan` resolves the same object for a GPU that is not there (`Hardware.gpu`).
Start-up probes that can turn a choice down on a real device (the Gluon MLA decode kernel,
the one-launch router) and every shape check a kernel makes of its weights run here, so the
printed plan is what runs, and `cuda_graphs` is exactly whether every part is capturable.

Capabilities: Triton's tensor-core kernels need sm_80 (bf16); e4m3 conversions (NVFP4 scales,
block-FP8 weights, an FP8 latent cache) need sm_89; the Gluon MLA decode kernel (TMA + wgmma)
needs sm_90 exactly, so Blackwell (sm_100, sm_120) runs the Triton MLA decode kernel and the plan
marks it; native FP4 tensor cores (sm_100, sm_120) are not written yet (`native_fp4_kernel`), so
Blackwell runs the W4A16 kernels (E2M1 codes dequantized to bf16 in registers, bf16 MMA) and the
plan says so.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from moeserve.config import ModelConfig
from moeserve.hardware import Interconnect
from moeserve.kernels import cpu as cpu_kernels
from moeserve.kernels.formats import MLA_LATENT_LAYOUT
from moeserve.kernels.gemm.fp8_block_gemm import FP8_BLOCK
from moeserve.layers.quant.base import NoQuant, QuantConfig, UnquantizedLinearMethod
from moeserve.layers.quant.fp8_block import Fp8BlockConfig
from moeserve.layers.quant.nvfp4 import CompressedTensorsNvfp4Config, ModelOptNvfp4Config

log = logging.getLogger(__name__)

TRITON_CAPABILITY = (8, 0)  # bf16 tensor cores
# Triton allows e4m3 conversions (`fp8e4nv`) from sm_89 (triton/backends/nvidia/compiler.py)
FP8_CONVERSION_CAPABILITY = (8, 9)
BLACKWELL_CAPABILITY = (10, 0)
PDL_CAPABILITY = (9, 0)  # griddepcontrol (programmatic dependent launch)
# the block-scaled FP4 MMA (E2M1 x E2M1 with e4m3 scales per 16) each Blackwell family has
NATIVE_FP4_MMA = {
    (10, 0): "tcgen05.mma kind::mxf4nvf4",
    (12, 0): "mma.sync kind::mxf4nvf4",
}
# where each family's backends are listed by name (imported when a plan needs them)
BACKEND_TABLES = {
    "mla": ("moeserve.layers.attention.mla_backends", "BACKENDS"),
    "mha": ("moeserve.layers.attention.mha_backends", "BACKENDS"),
    "experts": ("moeserve.layers.moe_backends", "EXPERTS"),
    "router": ("moeserve.layers.moe_backends", "ROUTERS"),
    "fused_layer": ("moeserve.layers.fused_layer", "BACKENDS"),
}


def backend(part: str, name: str) -> Any:
    """The backend class `name` of the family `part` (BACKEND_TABLES)."""
    module, table = BACKEND_TABLES[part]
    return getattr(importlib.import_module(module), table)[name]


@dataclass(frozen=True)
class Hardware:
    """What the plan is resolved for: a CPU (`native_cpu`: the native CPU kernels build on
    it), or a GPU of a compute capability; `probe`: a real device, where start-up probes may
    turn a choice down (False: planning for a GPU that is not there)."""

    capability: tuple[int, int] | None = None
    native_cpu: bool = False
    native_build: str = ""  # which build of the native CPU kernels loaded
    probe: bool = False
    device: str = "cpu"

    @property
    def gpu(self) -> bool:
        return self.capability is not None

    @property
    def name(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}" if self.gpu else "CPU"

    @staticmethod
    def of(device: torch.device | str) -> Hardware:
        dev = torch.device(device)
        if dev.type == "cuda":
            cap = torch.cuda.get_device_capability(dev)
            return Hardware(capability=tuple(cap), probe=True, device=str(dev))
        lib = cpu_kernels.native()
        build = lib.describe() if lib is not None else ""
        return Hardware(native_cpu=lib is not None, native_build=build, device="cpu")

    @staticmethod
    def planned_gpu(capability: tuple[int, int]) -> Hardware:
        return Hardware(capability=tuple(capability))


@dataclass(frozen=True)
class KernelChoice:
    """What runs for one part of the model, and why; `fallback`: not what the hardware would
    ideally run (the reason says what is missing)."""

    what: str
    choice: str
    reason: str
    fallback: bool = False

    def line(self, width: int = 24) -> str:
        mark = "fallback: " if self.fallback else ""
        return f"  {self.what:<{width}} {self.choice} ({mark}{self.reason})"


@dataclass(frozen=True)
class PlanSettings:
    """The settings a kernel choice depends on (EngineConfig's, resolved)."""

    act_dtype: torch.dtype = torch.bfloat16
    kv_cache_dtype: torch.dtype = torch.bfloat16  # asked for (before the hardware's fallback)
    page_size: int = 16
    mla_decode_kernel: str = "auto"
    enforce_eager: bool = False
    pdl: str = "off"
    deterministic: bool = False
    cpu_kernels: str = "auto"
    tp_size: int = 1
    hosts: int = 1
    all_reduce: str = "auto"
    interconnect: Interconnect | None = None


@dataclass(frozen=True)
class LinearKernels:
    """What serves the linear layers' matmuls (their quant methods read these switches)."""

    stored_format: bool = False  # NVFP4 / block-FP8 weights: Triton kernels on the stored bytes
    dense_gemv: bool = False  # 16-bit weights: decode rows by the split-K Triton GEMV
    native_cpu: bool = False  # the native CPU GEMMs (bf16 activations)
    invariant: bool = False  # batch-invariant schedules (--deterministic)
    pdl: bool = False  # GEMVs launch with programmatic dependent launch

    @property
    def name(self) -> str:
        if self.stored_format:
            return "triton"
        return "native" if self.native_cpu else "torch"


@dataclass(frozen=True)
class KernelPlan:
    """The decisions the layers read, and the lines the banner and `moeserve plan` print.
    The backend fields are classes of the families' tables (None: the model has no such
    part); each layer builds its own instance."""

    hardware: Hardware
    choices: tuple[KernelChoice, ...]
    triton: bool = False  # Triton kernels serve norms, SiLU*up (GPU, sm_80+)
    linears: LinearKernels = LinearKernels()
    mla: Any = None  # MLA attention (mla_backends.BACKENDS)
    mha: Any = None  # GQA attention (mha_backends.BACKENDS)
    experts: Any = None  # routed experts (moe_backends.EXPERTS)
    router: Any = None  # the MoE router (moe_backends.ROUTERS)
    fused_layer: Any = None  # a whole decoder layer as one call (fused_layer.BACKENDS)
    pdl: bool = False  # decode kernels launch with programmatic dependent launch (sm_90+)
    cpu_native: bool = False  # the native CPU kernels (bf16 activations)
    invariant: bool = False  # batch-invariant schedules (--deterministic)
    cuda_graphs: bool = False  # decode replayed: every part's backend is capturable
    kv_cache_dtype: torch.dtype = torch.bfloat16  # what the cache is allocated in
    notes: tuple[str, ...] = field(default_factory=tuple)

    def lines(self) -> list[str]:
        width = max((len(c.what) for c in self.choices), default=0)
        return [c.line(width) for c in self.choices]

    @property
    def fallbacks(self) -> int:
        return sum(c.fallback for c in self.choices)

    def backend_names(self) -> dict[str, str]:
        """Each part's backend by name (the parts the model has)."""
        parts = {p: getattr(self, p) for p in BACKEND_TABLES}
        out = {p: cls.name for p, cls in parts.items() if cls is not None}
        return {"linears": self.linears.name, **out}


@runtime_checkable
class UsesKernelPlan(Protocol):
    """A module that takes the plan (moeserve.layers.contract lists every such contract)."""

    def use_kernel_plan(self, plan: KernelPlan) -> None:
        """Keep what this module needs of the plan (its backends), before loading."""


def apply_kernel_plan(model: nn.Module, plan: KernelPlan) -> None:
    """Hand the plan to every layer that chooses a kernel (once, before its weights are read
    and processed: some repack for the kernels they will run)."""
    log.debug("kernel plan: %s", plan.backend_names())
    for layer in model.modules():
        if isinstance(layer, UsesKernelPlan):
            layer.use_kernel_plan(plan)


# ---- resolution -------------------------------------------------------------------------------
def _sm(cap: tuple[int, int]) -> str:
    return f"sm_{cap[0]}{cap[1]}"


def native_fp4_kernel(capability: tuple[int, int]) -> str | None:
    """The native FP4 tensor-core kernel for NVFP4 weights on this GPU, None where there is none
    (then the W4A16 kernels serve). This is where a kernel built on NATIVE_FP4_MMA would be
    chosen by capability; none is implemented, so it is None everywhere."""
    return None


def _fp4_fallback_reason(capability: tuple[int, int]) -> str:
    """Why NVFP4 runs weight-only on a GPU with native FP4 tensor cores (NATIVE_FP4_MMA)."""
    mma = NATIVE_FP4_MMA.get(capability, "block-scaled FP4 MMA")
    return (
        f"native FP4 tensor cores of {_sm(capability)} ({mma}) not implemented yet: weight-only "
        "W4A16, E2M1 codes dequantized to bf16 in registers, bf16 MMA"
    )


def quant_formats(quant: QuantConfig) -> tuple[str, bool]:
    """(stored weight format of the quantized layers: none | nvfp4 | fp8-block, W4A4)."""
    if isinstance(quant, ModelOptNvfp4Config | CompressedTensorsNvfp4Config):
        return "nvfp4", bool(getattr(quant.scheme, "activations", False))
    if isinstance(quant, Fp8BlockConfig):
        return "fp8-block", False
    return "none", False


def _linear_prefixes(cfg: ModelConfig) -> Iterator[str]:
    """The checkpoint-space names of the model's linears (what quant configs match)."""
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        if cfg.mla is not None:
            attn = ["q_a_proj", "q_b_proj"] if cfg.mla.q_lora_rank else ["q_proj"]
            attn += ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
        else:
            attn = ["q_proj", "k_proj", "v_proj", "o_proj"]
        yield from (f"{p}.self_attn.{a}" for a in attn)
        moe = cfg.is_moe_layer(i)
        if moe and not cfg.moe.n_shared_experts:
            continue
        mlp = f"{p}.mlp.shared_experts" if moe else f"{p}.mlp"
        yield from (f"{mlp}.{x}_proj" for x in ("gate", "up", "down"))


def effective_kv_cache_dtype(
    wanted: torch.dtype, capability: tuple[int, int] | None
) -> tuple[torch.dtype, KernelChoice]:
    """The latent-cache dtype that runs for `wanted` (resolved from --kv-cache-dtype and the
    checkpoint, `moeserve.loader.base.resolve_kv_cache_dtype`) on a GPU of
    `capability` (None: the CPU, whose torch path handles FP8 rows)."""
    name = str(wanted).replace("torch.", "")
    if wanted != torch.float8_e4m3fn:
        return wanted, KernelChoice("KV cache", name, "--kv-cache-dtype, or the model dtype")
    if capability is not None and capability < FP8_CONVERSION_CAPABILITY:
        return torch.bfloat16, KernelChoice(
            "KV cache",
            "bfloat16",
            f"an FP8 latent cache needs e4m3 conversions, which Triton allows from "
            f"{_sm(FP8_CONVERSION_CAPABILITY)}; this GPU is {_sm(capability)}",
            fallback=True,
        )
    return wanted, KernelChoice(
        "KV cache",
        "fp8 e4m3",
        "the checkpoint or --kv-cache-dtype asks for it; one scale per layer, half of bf16's bytes",
    )


def resolve_kernel_plan(
    model_cfg: ModelConfig,
    quant: QuantConfig | None,
    hardware: Hardware,
    settings: PlanSettings = PlanSettings(),
) -> KernelPlan:
    """The kernel plan of this model on `hardware` with `settings` (module docstring)."""
    quant = quant or NoQuant()
    if not hardware.gpu:
        return _cpu_plan(model_cfg, quant, hardware, settings)
    return _gpu_plan(model_cfg, quant, hardware, settings)


def _native_widths(cfg: ModelConfig) -> bool:
    """The widths the native CPU attention kernels take (pairs of bf16 values): MLA's nope,
    latent and rope dims, GQA's head dim."""
    if cfg.mla is not None:
        return all(d % 2 == 0 for d in (cfg.mla.qk_nope_head_dim, cfg.mla.kv_lora_rank,
                                        cfg.mla.qk_rope_head_dim))  # fmt: skip
    return cfg.head_dim % 2 == 0


def _cpu_plan(
    model_cfg: ModelConfig, quant: QuantConfig, hw: Hardware, s: PlanSettings
) -> KernelPlan:
    native = s.cpu_kernels != "torch" and s.act_dtype == torch.bfloat16 and hw.native_cpu
    kv, kv_choice = effective_kv_cache_dtype(s.kv_cache_dtype, None)
    if not native and not model_cfg.is_mla and kv != torch.float32:
        kv, kv_choice = (
            torch.float32,
            KernelChoice("KV cache", "float32", "torch's CPU attention is faster over fp32"),
        )
    family = "mla" if model_cfg.is_mla else "mha"
    out: list[KernelChoice] = []
    if native:
        why = (
            "one arithmetic order per output element, whatever the rows in the step: every "
            "logit independent of how its sequence is split into steps or batched"
        )
        out.append(KernelChoice("linears", f"native CPU GEMM ({hw.native_build})", why))
        attention = backend(family, "native")
        if kv != torch.bfloat16:
            why = f"the native kernel reads a bf16 cache, not {str(kv)[6:]}"
        elif not _native_widths(model_cfg):
            why = "the native kernel reads pairs of values: odd head widths"
        else:
            why = "absorbed MLA for every row" if model_cfg.is_mla else "GQA over the paged cache"
            out.append(KernelChoice("attention", attention.label, why))
            why = None
        if why is not None:
            attention = backend(family, "torch")
            out.append(KernelChoice("attention", "torch", why, fallback=True))
        experts = backend("experts", "native-loop")
        router = backend("router", "native")
        if model_cfg.moe is not None:
            out.append(KernelChoice("routed experts", experts.label, "dequantized per call"))
    else:
        if s.cpu_kernels == "torch":
            why = "--cpu-kernels torch"
        elif s.act_dtype != torch.bfloat16:
            why = f"{str(s.act_dtype)[6:]} activations; the native kernels take bf16"
        else:
            why = "the native CPU kernels did not build here (no C compiler?)"
        out.append(KernelChoice("linears", "torch", why, fallback=s.cpu_kernels != "torch"))
        invariant = s.deterministic and not model_cfg.is_mla
        attention = backend(family, "torch-invariant" if invariant else "torch")
        label = attention.label
        if s.deterministic and model_cfg.is_mla:
            label += ", batch-invariant"
        out.append(KernelChoice("attention", label, "CPU path"))
        experts, router = backend("experts", "loop"), backend("router", "torch")
        if model_cfg.moe is not None:
            out.append(KernelChoice("routed experts", "per-expert loop", "CPU path"))
    out.append(kv_choice)
    if s.tp_size > 1:
        out.append(KernelChoice("all-reduce", "gloo", "CPU processes"))
    fused = native and not model_cfg.is_mla and model_cfg.moe is None
    return KernelPlan(
        hardware=hw,
        choices=tuple(out),
        linears=LinearKernels(native_cpu=native, invariant=s.deterministic and not native),
        mla=attention if model_cfg.is_mla else None,
        mha=None if model_cfg.is_mla else attention,
        experts=experts if model_cfg.moe is not None else None,
        router=router if model_cfg.moe is not None else None,
        fused_layer=backend("fused_layer", "native") if fused else None,
        cpu_native=native,
        invariant=s.deterministic and not native,
        kv_cache_dtype=kv,
    )


def _gpu_plan(
    model_cfg: ModelConfig, quant: QuantConfig, hw: Hardware, s: PlanSettings
) -> KernelPlan:
    cap = hw.capability
    triton = cap >= TRITON_CAPABILITY
    fp8_ok = cap >= FP8_CONVERSION_CAPABILITY
    dense_gemv = triton and not s.deterministic
    if s.deterministic and triton:
        dense = "batch-invariant Triton GEMM"
    elif dense_gemv:
        dense = "split-K Triton GEMV (1-4 decode rows, shapes its tile table serves), else cuBLAS"
    else:
        dense = "cuBLAS"
    out = [
        KernelChoice(
            "BF16 linears",
            dense,
            "every linear the checkpoint keeps unquantized (MLA's q_a / kv_a GEMV also does "
            "both a-norms); the LM head by cuBLAS",
        )
    ]
    stored_format, choices = _linear_choices(model_cfg, quant, hw, s)
    out += choices
    graph_blockers: list[str] = []
    experts = router = None
    if model_cfg.moe is not None:
        fmt = quant_formats(quant)[0]
        # where native FP4 tensor cores go unused: why (None: no such hardware, or a kernel)
        fp4_gap = (
            _fp4_fallback_reason(cap)
            if cap >= BLACKWELL_CAPABILITY and native_fp4_kernel(cap) is None
            else None
        )
        experts, choice = _moe_choice(model_cfg, quant, fmt, triton, fp8_ok, fp4_gap, s)
        out.append(choice)
        if not experts.capturable:
            graph_blockers.append("routed experts")
        router_fused = (
            triton
            and not s.deterministic
            and s.act_dtype == torch.bfloat16
            and _router_fused_ok(model_cfg, hw)
        )
        router = backend("router", "fused" if router_fused else "triton" if triton else "torch")
        out.append(
            KernelChoice(
                "router",
                router.label,
                "the batch-invariant gate GEMM (--deterministic)"
                if s.deterministic and triton
                else "fp32 logits, top-k per token",
            )
        )
    kv, kv_choice = effective_kv_cache_dtype(s.kv_cache_dtype, cap)
    attention, choices = _attention_choices(model_cfg, hw, kv, s)
    out += choices
    if not attention.capturable:
        graph_blockers.append("MLA decode" if model_cfg.is_mla else "attention")
    out.append(kv_choice)
    if s.enforce_eager:
        out.append(KernelChoice("CUDA graphs", "off", "--enforce-eager"))
    elif graph_blockers:
        out.append(
            KernelChoice(
                "CUDA graphs",
                "off (decode runs eagerly)",
                f"{', '.join(graph_blockers)} cannot be captured",
                fallback=True,
            )
        )
    else:
        out.append(KernelChoice("CUDA graphs", "decode replayed", "every part is capturable"))
    if s.tp_size > 1 and s.interconnect is not None:  # the engine's banner states its own
        out.append(_all_reduce_choice(s))
    pdl = triton and cap >= PDL_CAPABILITY and s.pdl == "on"
    if triton and s.pdl == "on":
        out.append(
            KernelChoice(
                "kernel launches",
                "programmatic dependent launch" if pdl else "one after another",
                "--pdl on: the next Triton kernel of the step launches while the previous one "
                "drains"
                if pdl
                else f"--pdl on needs sm_{PDL_CAPABILITY[0]}{PDL_CAPABILITY[1]}",
                fallback=not pdl,
            )
        )
    invariant = s.deterministic and triton
    return KernelPlan(
        hardware=hw,
        choices=tuple(out),
        triton=triton,
        linears=LinearKernels(stored_format, dense_gemv, invariant=invariant, pdl=pdl),
        mla=attention if model_cfg.is_mla else None,
        mha=None if model_cfg.is_mla else attention,
        experts=experts,
        router=router,
        pdl=pdl,
        invariant=invariant,
        cuda_graphs=not s.enforce_eager and not graph_blockers,
        kv_cache_dtype=kv,
    )


def _linear_choices(
    cfg: ModelConfig, quant: QuantConfig, hw: Hardware, s: PlanSettings
) -> tuple[bool, list[KernelChoice]]:
    """(whether Triton kernels serve the quantized linears' stored format, their lines)."""
    fmt, w4a4 = quant_formats(quant)
    quantized = any(
        not isinstance(quant.linear_method(p), UnquantizedLinearMethod)
        for p in _linear_prefixes(cfg)
    )
    out: list[KernelChoice] = []
    if fmt == "nvfp4" and w4a4:
        out.append(
            KernelChoice(
                "NVFP4 activations",
                "bf16 (weight-only)",
                "the checkpoint is W4A4; its input scales are loaded but FP4 activation "
                "math is not implemented",
                fallback=True,
            )
        )
    if fmt == "none" or not quantized:
        return False, out
    what = "NVFP4 linears" if fmt == "nvfp4" else "block-FP8 linears"
    kernel = "Triton W4A16" if fmt == "nvfp4" else "Triton W8A16"
    need = (
        "the Triton NVFP4 kernels decode e4m3 scales"
        if fmt == "nvfp4"
        else "the Triton block-FP8 GEMM converts e4m3"
    )
    block = getattr(getattr(quant, "scheme", None), "block", FP8_BLOCK)
    if not (hw.capability >= TRITON_CAPABILITY and hw.capability >= FP8_CONVERSION_CAPABILITY):
        why = (
            f"{need}, which Triton allows from {_sm(FP8_CONVERSION_CAPABILITY)}; "
            f"this GPU is {hw.name}"
        )
    elif fmt == "fp8-block" and block != FP8_BLOCK:
        why = (
            f"the Triton kernel is written for {FP8_BLOCK}x{FP8_BLOCK} blocks, not {block}x{block}"
        )
    else:
        native_fp4 = (
            fmt == "nvfp4"
            and hw.capability >= BLACKWELL_CAPABILITY
            and native_fp4_kernel(hw.capability) is None
        )
        if native_fp4:
            reason = _fp4_fallback_reason(hw.capability)
        elif s.deterministic:
            reason = "one tensor-core tile config, no split-K (--deterministic)"
        elif fmt == "nvfp4":
            reason = "packed codes decoded in registers (GEMV/GEMM)"
        else:
            reason = "128x128 block scales applied in-kernel"
        out.insert(0, KernelChoice(what, kernel, reason, fallback=native_fp4))
        return True, out
    out.insert(0, KernelChoice(what, "torch (dequantize + cuBLAS)", why, fallback=True))
    return False, out


def _attention_choices(
    cfg: ModelConfig, hw: Hardware, kv: torch.dtype, s: PlanSettings
) -> tuple[Any, list[KernelChoice]]:
    """(the attention backend, its lines); Llama-style attention: torch SDPA."""
    if not cfg.is_mla:
        mha = backend("mha", "torch")
        return mha, [KernelChoice("attention", mha.label, "paged KV gathered per sequence")]
    layout = (cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim)
    if hw.capability >= TRITON_CAPABILITY and layout == MLA_LATENT_LAYOUT:
        mla, choice = _mla_decode_choice(cfg, hw, kv, s)
        prefill = KernelChoice(
            "MLA prefill",
            "Triton MLA prefill (absorbed, over the paged latent cache)",
            "every prefill chunk of a step in one launch"
            + ("" if s.deterministic else "; decode rows keep the decode kernel"),
        )
        return mla, [choice, prefill]
    why = (
        f"the Triton kernel is written for the {MLA_LATENT_LAYOUT[0]}+{MLA_LATENT_LAYOUT[1]} "
        f"layout, not {layout[0]}+{layout[1]}"
        if layout != MLA_LATENT_LAYOUT
        else f"no Triton kernels on {hw.name}"
    )
    mla = backend("mla", "torch")
    return mla, [
        KernelChoice("MLA decode", mla.label, why, fallback=True),
        KernelChoice(
            "MLA prefill",
            "torch SDPA, expanded form",
            "per sequence; the cached latent is expanded through kv_b_proj",
        ),
    ]


def _moe_choice(
    cfg: ModelConfig,
    quant: QuantConfig,
    fmt: str,
    triton: bool,
    fp8_ok: bool,
    fp4_gap: str | None,
    s: PlanSettings,
) -> tuple[Any, KernelChoice]:
    """(the routed experts' backend, its line)."""
    first_moe = f"model.layers.{cfg.moe.first_k_dense_replace}.mlp.experts"
    schedule = "; the tensor-core schedule at every token count (--deterministic)"
    loop = backend("experts", "loop")
    host_ids = "the loop reads expert ids on the host, so decode cannot be captured in a CUDA graph"
    if triton and s.act_dtype != torch.bfloat16:
        return loop, KernelChoice(
            "routed experts",
            loop.label,
            f"the fused MoE takes bf16 activations, not {str(s.act_dtype)[6:]}; {host_ids}",
            fallback=True,
        )
    if fmt == "nvfp4" and quant.moe_method(first_moe) is not None:
        if triton and fp8_ok:
            fused = backend("experts", "fused-nvfp4")
            reason = "one launch for all experts; capturable in CUDA graphs"
            if fp4_gap is not None:
                reason += f"; {fp4_gap}"
            if s.deterministic:
                reason += schedule
            return fused, KernelChoice(
                "routed experts", fused.label, reason, fallback=fp4_gap is not None
            )
        return loop, KernelChoice(
            "routed experts",
            loop.label,
            f"the fused NVFP4 MoE needs {_sm(FP8_CONVERSION_CAPABILITY)}+",
            fallback=True,
        )
    fp8 = fmt == "fp8-block" and quant.moe_method(first_moe) is not None
    block = getattr(getattr(quant, "scheme", None), "block", FP8_BLOCK) if fp8 else 0
    # the fused kernel reads whole scale blocks per expert along the intermediate dim
    whole = not fp8 or cfg.moe.moe_intermediate_size % FP8_BLOCK == 0
    if triton and (fp8_ok or not fp8) and block in (0, FP8_BLOCK) and whole:
        fused = backend("experts", "fused-fp8" if fp8 else "fused-16bit")
        return fused, KernelChoice(
            "routed experts",
            fused.label,
            "one launch per projection for all experts"
            + ("; 128x128 block scales applied in-kernel" if fp8 else "")
            + "; capturable in CUDA graphs"
            + (schedule if s.deterministic else ""),
        )
    if fp8 and triton and fp8_ok and block == FP8_BLOCK:
        why = (
            f"the fused block-FP8 MoE reads whole {FP8_BLOCK}-row scale blocks per expert, "
            f"not an intermediate size of {cfg.moe.moe_intermediate_size}"
        )
    elif fp8:
        why = f"the fused block-FP8 MoE needs {_sm(FP8_CONVERSION_CAPABILITY)}+ and 128x128 blocks"
    else:
        why = "the fused MoE needs the Triton kernels"
    return loop, KernelChoice("routed experts", loop.label, f"{why}; {host_ids}", fallback=True)


def _router_fused_ok(cfg: ModelConfig, hw: Hardware) -> bool:
    """The one-launch router serves this gate: its shapes, and on a real GPU its start-up
    probe (x @ W^T and the top experts against torch's, once per gate shape)."""
    from moeserve.kernels.routing.router_fused import FUSED_MAX_EXPERTS, probe_route_fused

    if cfg.moe.n_routed_experts > FUSED_MAX_EXPERTS:
        return False
    if not hw.probe:
        return True
    return probe_route_fused(torch.device(hw.device), cfg.moe.n_routed_experts, cfg.hidden_size)


def _mla_decode_choice(
    cfg: ModelConfig, hw: Hardware, kv: torch.dtype, s: PlanSettings
) -> tuple[Any, KernelChoice]:
    """MLA decode with the Triton kernels: the prefill kernel for every row under
    --deterministic; the Gluon kernel (Hopper) where the cache and --mla-decode-kernel allow
    it and its start-up probe passes; else the Triton one."""
    from moeserve.kernels.attention.mla_decode_gluon import (
        GLUON_CAPABILITY,
        GLUON_PAGE_MULTIPLE,
        probe_gluon_mla,
    )

    if s.deterministic:
        prefill = backend("mla", "triton-prefill")
        return prefill, KernelChoice(
            "MLA decode",
            prefill.label,
            "every row through one kernel, key tiles from position 0 (--deterministic)",
        )
    triton = backend("mla", "triton")
    blockers = []
    if s.mla_decode_kernel == "triton":
        blockers.append("--mla-decode-kernel triton")
    # Blackwell lacks wgmma: its tuned decode kernel (tcgen05) is not written, so the Triton
    # one serves there as a fallback; older GPUs have nothing faster than the Triton kernel
    blackwell = hw.capability >= BLACKWELL_CAPABILITY and s.mla_decode_kernel != "triton"
    if hw.capability != GLUON_CAPABILITY:
        blockers.append(
            f"the Gluon kernel (TMA + wgmma) is written for {_sm(GLUON_CAPABILITY)}"
            + (f"; {hw.name} has no wgmma" if blackwell else "")
        )
    if kv != torch.bfloat16:
        blockers.append("the Gluon kernel reads a BF16 cache")
    if s.page_size % GLUON_PAGE_MULTIPLE:
        blockers.append(
            f"page size {s.page_size}: the Gluon kernel needs a multiple of "
            f"{GLUON_PAGE_MULTIPLE} (--page-size {GLUON_PAGE_MULTIPLE})"
        )
    if s.enforce_eager:
        blockers.append("--enforce-eager (the Gluon kernel serves CUDA-graph decode)")
    if blockers:
        if s.mla_decode_kernel == "gluon":
            log.warning("--mla-decode-kernel gluon: %s; the Triton kernel serves", blockers[-1])
        if blackwell:
            log.info("MLA decode: the Triton kernel on %s (the Gluon kernel needs wgmma)", hw.name)
        why = "; ".join(blockers)
        return triton, KernelChoice("MLA decode", triton.label, why, fallback=blackwell)
    heads = max(1, cfg.num_attention_heads // s.tp_size)
    if hw.probe and not probe_gluon_mla(torch.device(hw.device), heads):
        return triton, KernelChoice(
            "MLA decode", triton.label, "the Gluon kernel's start-up probe failed", fallback=True
        )
    if s.mla_decode_kernel == "gluon":
        gluon = backend("mla", "gluon")
        return gluon, KernelChoice("MLA decode", gluon.label, "--mla-decode-kernel gluon")
    prefer = backend("mla", "gluon-prefer")
    return prefer, KernelChoice(
        "MLA decode",
        prefer.label,
        "Gluon where it measured faster (cache capacity >= 4096 tokens, or > 16 heads per "
        "GPU at batch >= 8), Triton elsewhere",
    )


def _all_reduce_choice(s: PlanSettings) -> KernelChoice:
    """What `moeserve.parallel.comm.choose_all_reduce` picks for the planned interconnect (the
    engine probes the real one at start-up and its banner says what it found)."""
    from moeserve.parallel.comm import choose_all_reduce, planned_topology

    topology = planned_topology(s.interconnect or "pcie", s.hosts)
    c = choose_all_reduce(s.tp_size, topology, s.all_reduce)
    if c.kind == "one-shot":
        return KernelChoice(
            "all-reduce",
            f"one-shot over peer memory up to {c.one_shot_max_bytes // 1024} KiB per rank, "
            "NCCL above",
            f"the GPUs read each other's memory ({s.interconnect})",
        )
    if s.hosts > 1:
        return KernelChoice("all-reduce", "NCCL", f"the ranks span {s.hosts} hosts")
    if s.all_reduce == "nccl":
        return KernelChoice("all-reduce", "NCCL", "--all-reduce nccl")
    env = " ".join(f"{k}={v}" for k, v in c.nccl_env.items())
    return KernelChoice(
        "all-reduce",
        "NCCL",
        "the GPUs cannot read each other's memory (PCIe without peer access), so no "
        f"one-shot all-reduce; {env} (LL for small messages)",
        fallback=True,
    )
