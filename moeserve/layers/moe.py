"""Mixture-of-experts block of DeepSeek-V3 / Kimi: router, routed experts, shared experts.

Routed experts live in two stacked banks, `w13` (gate rows then up rows) and `w2` (down),
each [E_local + S, out, in] in whatever format the checkpoint uses (a `WeightScheme` from
`layers/quant`): the layout the fused GPU kernel reads, loaded in place. Checkpoint tensors
`...experts.{e}.{gate,up,down}_proj.{suffix}` load into their expert's rows through shard ids
(expert, part); transformers-5 stacked tensors (`experts.gate_up_proj` [E, 2I, H], gate rows
first, and `experts.down_proj` [E, H, I]) load with expert None.

Shared experts as slots (`shared_expert_slots`): where the S = n_shared_experts shared
experts have a routed expert's shape and stored format (DeepSeek-V3 block-FP8, Kimi-K2.5
NVFP4), they are experts E .. E+S-1 of the banks (local slots E_local .. E_local+S-1) and
every token's routing gets S more columns (id E + j, weight 1.0): the fused kernel runs them
with the routed experts, no separate MLP. Elsewhere (a shared expert stored unquantized
beside quantized routed ones; expert parallelism) they stay a separate `DeepseekMLP` whose
output the kernel adds.

Tensor parallelism splits every expert's intermediate dimension (gate/up rows, down
columns); expert parallelism (`TPGroup.expert_parallel`) gives each rank E/N whole experts
and maps the router's global ids to local ones (others' are skipped). Either way the block
returns this rank's partial sum, which the decoder all-reduces together with the residual
add and the next norm (no extra collective for EP).

What serves the routed experts and the router is the kernel plan's choice
(`moe_backends.py`): the fused Triton MoE over the stored banks, or a loop over the experts
the batch hit, each dequantized on the fly (memory holds only the stored format).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.config import ModelConfig, MoEConfig
from moeserve.kernels import cpu as cpu_kernels
from moeserve.kernels.elementwise.activation import silu_mul
from moeserve.kernels.gemm import nvfp4_gate_up as gate_up_kernels
from moeserve.layers.contract import MoELayerHook, RoutingOverride
from moeserve.layers.expert_banks import ExpertBank, ExpertLayout
from moeserve.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from moeserve.layers.moe_backends import ExpertsBackend, LoopExperts, RouterBackend, TorchRouter
from moeserve.layers.quant.base import (
    NoQuant,
    QuantConfig,
    UnquantizedLinearMethod,
    copy_loader,
    make_param,
)
from moeserve.layers.quant.scheme import WeightScheme, splitk_fits
from moeserve.parallel.groups import SINGLE, TPGroup

if TYPE_CHECKING:
    from moeserve.layers.kernel_plan import KernelPlan

log = logging.getLogger(__name__)


# ---- dense MLP (leading dense layers, shared experts) ---------------------------------------
def mergeable_gate_up(quant: QuantConfig | None, prefix: str, local_inter: int) -> bool:
    """Whether `prefix`.gate_proj and .up_proj can be one column-parallel GEMM: both plain
    weights, or the same weight scheme without per-tensor scalars whose blocks the rank's
    `local_inter` gate rows fill whole (block-FP8: 128-row scale blocks then concatenate;
    NVFP4's per-tensor global scales would not, nor the CPU's repacked formats)."""
    gate = _linear_scheme(quant, f"{prefix}.gate_proj")
    if gate is None or not _same_scheme(_linear_scheme(quant, f"{prefix}.up_proj"), gate):
        return False
    specs = gate.specs(local_inter, local_inter, torch.float32)
    return all(s.out_dim is not None and local_inter % s.out_block == 0 for s in specs)


class DeepseekMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate/up column-parallel, down row-parallel. Gate and up
    are one GEMM (`gate_up_proj`, shard ids 0 / 1 from the checkpoint's gate_proj / up_proj)
    where `mergeable_gate_up` allows, followed on GPUs by one SiLU*up launch."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        prefix: str,
        quant: QuantConfig | None,
        tp: TPGroup = SINGLE,
        dtype: torch.dtype = torch.float32,
        reduce_output: bool = True,
    ) -> None:
        super().__init__()
        kw = dict(quant=quant, tp=tp, dtype=dtype)
        self.gate_up_proj: MergedColumnParallelLinear | None = None
        if mergeable_gate_up(quant, prefix, tp.shard(intermediate)):
            # the method is chosen by gate_proj's name (up_proj's was checked to match)
            self.gate_up_proj = MergedColumnParallelLinear(
                hidden, [intermediate, intermediate], prefix=f"{prefix}.gate_proj", **kw
            )
        else:
            self.gate_proj = ColumnParallelLinear(
                hidden, intermediate, prefix=f"{prefix}.gate_proj", **kw
            )
            self.up_proj = ColumnParallelLinear(
                hidden, intermediate, prefix=f"{prefix}.up_proj", **kw
            )
        self.down_proj = RowParallelLinear(
            intermediate,
            hidden,
            prefix=f"{prefix}.down_proj",
            reduce_results=reduce_output,
            **kw,
        )
        self.native = False  # SiLU * up by the native CPU kernel (the kernel plan)
        self.silu_kernel = False  # ... by the Triton kernel

    def use_kernel_plan(self, plan: KernelPlan) -> None:
        self.native = plan.cpu_native
        self.silu_kernel = plan.triton

    def _fused_nvfp4_gate_up(self, x: torch.Tensor) -> torch.Tensor | None:
        """SiLU(gate) * up in one launch where gate and up are separate NVFP4 weights served
        by the GPU kernels and x is a few rows (kernels/gemm/nvfp4_gate_up.py); else None."""
        gate, up = self.gate_proj.nvfp4_kernel_args, self.up_proj.nvfp4_kernel_args
        if gate is None or up is None or not x.is_cuda or self.gate_proj.batch_invariant:
            return None
        gu = gate_up_kernels
        x2 = x.reshape(-1, x.shape[-1])
        n, k = gate[0].shape[0], x2.shape[-1]
        if x2.shape[0] > gu.gate_up_max_rows(n, k) or gate[0].shape != up[0].shape:
            return None
        ws = self.gate_proj.splitk_workspace
        if ws is not None and not splitk_fits(ws, x2.shape[0], 2 * n):
            ws = None  # a bigger (eager) batch: the kernel allocates its own
        h = gu.nvfp4_gate_up_silu(
            x2.to(torch.bfloat16).contiguous(),
            gate[:3],
            up[:3],
            ws,
            decode=gate[3].decode,
            pdl=self.gate_proj.pdl,
        )
        return h.to(x.dtype).reshape(*x.shape[:-1], n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        native = self.native and x.dtype == torch.bfloat16
        if self.gate_up_proj is None:
            fused = self._fused_nvfp4_gate_up(x) if self.silu_kernel else None
            if fused is not None:
                return self.down_proj(fused)
            gate, up = self.gate_proj(x), self.up_proj(x)
            if native:
                return self.down_proj(cpu_kernels.silu_mul(gate, up))
            return self.down_proj(F.silu(gate) * up)
        gu = self.gate_up_proj(x)
        if native:
            return self.down_proj(cpu_kernels.silu_mul(gu))
        if self.silu_kernel and gu.is_cuda and gu.dim() == 2:
            return self.down_proj(silu_mul(gu))
        gate, up = gu.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


# ---- routed experts -------------------------------------------------------------------------
class RoutedExperts(nn.Module):
    """This rank's routed experts, and `num_shared` shared experts as slots after them:
    `w13` (gate+up) and `w2` (down) banks, served by the kernel plan's backend
    (`moe_backends.py`: the fused Triton MoE or the per-expert loop)."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        scheme: WeightScheme,
        tp: TPGroup,
        dtype: torch.dtype,
        num_shared: int = 0,
        slots_per_token: int = 0,
    ) -> None:
        """`slots_per_token`: routed experts per token plus the shared slots (sizes the fused
        kernels' split-K counters; 0 leaves those kernels to allocate their own)."""
        super().__init__()
        self.layout = ExpertLayout.of(num_experts, tp, num_shared)
        self.num_experts = num_experts
        self.w13 = ExpertBank(scheme, self.layout, 2, intermediate, hidden, "out", dtype)
        self.w2 = ExpertBank(scheme, self.layout, 1, hidden, intermediate, "in", dtype)
        self.hidden = hidden
        self.intermediate = intermediate
        self.slots_per_token = slots_per_token
        # --deterministic: the fused kernels' tensor-core schedule at every token count
        self.batch_invariant = False
        self.pdl = False  # the GEMV path launches with programmatic dependent launch
        self.backend: ExpertsBackend = LoopExperts(self)  # the plan's (use_kernel_plan)

    def use_kernel_plan(self, plan: KernelPlan) -> None:
        self.batch_invariant = plan.invariant
        self.pdl = plan.pdl
        self.backend = plan.experts(self)

    def process_weights_after_loading(self) -> None:
        """The backend's kernel arguments, once (the fused kernels' views of the banks)."""
        self.backend.process_weights()

    def to_local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids -> this rank's slots (out of [0, slots) for other ranks'
        experts). Shared slot ids E + j need no shift: they exist only without EP (first 0)."""
        return ids - self.layout.first if self.layout.first else ids

    def runs_shared_slots(self, x: torch.Tensor) -> bool:
        """Whether this batch routes to the shared slots (else `shared_dense` serves them):
        always in the loop; in the fused kernels where slots measured faster."""
        return self.backend.runs_shared_slots(x)

    def shared_dense(self, x: torch.Tensor) -> torch.Tensor:
        """sum_j shared_j(x) [T, H] by dense GPU GEMMs on the shared slots' bank rows (the
        fused kernels' argument views: one merged gate+up GEMM, SiLU*up, down per slot)."""
        return self.backend.shared_dense(x)

    @property
    def supports_cuda_graph(self) -> bool:
        """The fused kernels are capturable; the expert loop reads ids on the host."""
        return self.backend.capturable

    def forward(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        add_to: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [T, H], weights/ids [T, k] (global ids; shared slots included as ids E + j) ->
        sum over this rank's experts of w * expert(x) [T, H] (this rank's partial), plus
        `add_to` (a separate shared expert's output, added in the kernel's combine step on
        GPUs; `add_to` may be overwritten)."""
        return self.backend.forward(x, weights, self.to_local_ids(ids), add_to)


class Router(nn.Module):
    """`mlp.gate`: weight [E, H] in the model dtype (the checkpoint stores it in bf16) and
    (noaux_tc) `e_score_correction_bias` [E] in fp32. Logits are fp32: on GPUs one bf16 GEMM
    with fp32 output (bf16 products are exact in fp32; only the summation order differs
    from an fp32 GEMM), elsewhere an fp32 matmul; the kernel plan's backend
    (`moe_backends.py`) computes them and routes."""

    def __init__(self, num_experts: int, hidden: int, with_bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = make_param(torch.zeros(num_experts, hidden, dtype=dtype), None, None)
        self.weight.weight_loader = copy_loader
        if with_bias:
            self.e_score_correction_bias = make_param(torch.zeros(num_experts), None, None)
            self.e_score_correction_bias.weight_loader = copy_loader
        else:
            self.e_score_correction_bias = None
        self.batch_invariant = False  # --deterministic: the batch-invariant GEMM on GPUs
        self.backend: RouterBackend = TorchRouter(self)  # the plan's (use_kernel_plan)

    def use_kernel_plan(self, plan: KernelPlan) -> None:
        self.batch_invariant = plan.invariant
        self.backend = plan.router(self)

    def process_weights_after_loading(self) -> None:
        self.backend.process_weights()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 logits [T, E]."""
        return self.backend.logits(x)

    def route(
        self, x: torch.Tensor, cfg: MoEConfig, slots: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp32 routing weights, global expert ids) [T, k + slots] under `cfg`'s rule."""
        return self.backend.route(x, cfg, slots)


def _routed_scheme(quant: QuantConfig | None, prefix: str) -> WeightScheme:
    """The stored format of the routed experts of the MoE layer `prefix` (plain: the model
    dtype)."""
    scheme = quant.moe_method(f"{prefix}.experts") if quant is not None else None
    return scheme if isinstance(scheme, WeightScheme) else WeightScheme()


def _linear_scheme(quant: QuantConfig | None, name: str) -> WeightScheme | None:
    """The stored format of the linear `name` as a weight scheme, None where its method is
    not scheme-based (CPU weight-only repacking): such a weight has no place in a bank."""
    method = (quant or NoQuant()).linear_method(name)
    if isinstance(method, UnquantizedLinearMethod):
        return WeightScheme()
    scheme = getattr(method, "scheme", None)
    return scheme if isinstance(scheme, WeightScheme) else None


def _same_scheme(a: WeightScheme | None, b: WeightScheme) -> bool:
    return a is not None and type(a) is type(b) and vars(a) == vars(b)


def shared_expert_slots(
    cfg: ModelConfig, prefix: str, quant: QuantConfig | None, tp: TPGroup = SINGLE
) -> int:
    """How many slots of the routed-expert banks the shared experts of the MoE layer `prefix`
    take: `cfg.moe.n_shared_experts`, or 0 where they stay a separate `DeepseekMLP`.

    A shared MLP of intermediate n * I is the sum of n experts of I (its gate/up rows and down
    columns split alike), so each can be one more expert of the fused kernel, weighted 1 for
    every token: one kernel reads it with the routed experts instead of ~5 launches. Needs
    - `cfg.moe.shared_experts_as_slots` (the switch) and shared experts at all;
    - the routed experts' stored format for gate, up and down (same `WeightScheme` type and
      settings; plain weights match plain weights): Kimi-K2.5 NVFP4's BF16 shared expert
      beside NVFP4 routed experts stays separate;
    - with n > 1, whole quantization blocks per expert along the intermediate dim, so each
      expert's slice of the stored tensors (scales included) is whole rows/columns;
    - no expert parallelism (its ranks hold whole routed experts; the shared one is split).
    Decided from the config, the quant config and the TP group only, never from the device:
    every rank and device (and the planner's meta model) builds the same layout.
    """
    moe = cfg.moe
    n = moe.n_shared_experts
    if not (moe.shared_experts_as_slots and n) or (tp.expert_parallel and tp.size > 1):
        return 0
    routed = _routed_scheme(quant, prefix)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        if not _same_scheme(_linear_scheme(quant, f"{prefix}.shared_experts.{proj}"), routed):
            return 0
    if n > 1:
        inter, hidden = moe.moe_intermediate_size, cfg.hidden_size
        gate_up = routed.specs(inter, hidden, cfg.dtype)
        down = routed.specs(hidden, inter, cfg.dtype)
        if any(s.out_dim is not None and inter % s.out_block for s in gate_up) or any(
            s.in_dim is not None and inter % s.in_block for s in down
        ):
            return 0
    return n


class DeepseekMoE(nn.Module):
    """Router + routed experts + shared experts of one MoE layer; the shared experts are
    slots of the routed banks where `shared_expert_slots` allows (`shared_slots` > 0,
    `shared_experts` None), else a separate MLP."""

    # the router's ids replaced, by whatever the layer's tensor-parallel group installs on it
    # (`MoELayerHook`: the benchmarks' rank simulation); None when serving
    routing_override: RoutingOverride | None = None

    def __init__(
        self,
        cfg: ModelConfig,
        prefix: str,
        quant: QuantConfig | None,
        tp: TPGroup = SINGLE,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        moe = cfg.moe
        self.cfg = moe  # the routing settings
        self.tp = tp
        self.gate = Router(
            moe.n_routed_experts, cfg.hidden_size, moe.topk_method == "noaux_tc", dtype
        )
        # decided before any weight exists: it changes the banks' shapes and the loading
        self.shared_slots = shared_expert_slots(cfg, prefix, quant, tp)
        self.experts = RoutedExperts(
            moe.n_routed_experts,
            cfg.hidden_size,
            moe.moe_intermediate_size,
            _routed_scheme(quant, prefix),
            tp,
            dtype,
            num_shared=self.shared_slots,
            slots_per_token=moe.num_experts_per_tok + self.shared_slots,
        )
        self.shared_experts: DeepseekMLP | None = None
        if moe.n_shared_experts and not self.shared_slots:
            self.shared_experts = DeepseekMLP(
                cfg.hidden_size,
                moe.moe_intermediate_size * moe.n_shared_experts,
                f"{prefix}.shared_experts",
                quant,
                tp,
                dtype,
                reduce_output=False,  # summed with the routed experts, reduced once
            )
        if isinstance(tp, MoELayerHook):
            tp.install_on_moe_layer(self)

    def route(
        self, x: torch.Tensor, shared_slots: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(routing weights fp32 [T, k + S], global expert ids [T, k + S]) by the router's
        backend: one Triton kernel after the gate GEMM on GPUs (kernels/routing/router.py),
        the GEMV and the routing in one launch where that measured faster (one token,
        kernels/routing/router_fused.py), the torch reference elsewhere. The S last columns
        (S = `shared_slots`, default the layer's own) are the shared experts (ids E + j,
        weight 1.0, not scaled by routed_scaling_factor: a separate shared MLP is added with
        weight 1 too)."""
        slots = self.shared_slots if shared_slots is None else shared_slots
        return self.gate.route(x, self.cfg, slots)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = None
        slots = self.shared_slots
        if slots and not self.experts.runs_shared_slots(x):
            slots, shared = 0, self.experts.shared_dense(x)  # batch sizes where slots lose
        elif self.shared_experts is not None:
            shared = self.shared_experts(x)
        weights, ids = self.route(x, slots)
        if self.routing_override is not None:
            ids = self.routing_override.ids(ids)
        # this rank's partial sum: the decoder all-reduces it with the residual
        return self.experts(x, weights, ids, add_to=shared)
