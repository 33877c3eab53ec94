"""The implementations of a MoE layer's routed experts and of its router.

The kernel plan picks one class of `EXPERTS` and one of `ROUTERS` per model
(`KernelPlan.experts`, `KernelPlan.router`); each `RoutedExperts` / `Router` builds its own
instance, which holds what its kernels need (the fused kernels' argument views and counters,
the packed gate, the one-launch router's workspace).

Routed experts, given x [T, H], fp32 routing weights and this rank's slot ids [T, k + S]:
- `LoopExperts`: the experts the batch hit in id order, each dequantized on the fly (memory
  holds only the stored format); reads ids on the host, so it is not capturable;
- `NativeLoopExperts`: the same loop through the native CPU GEMMs;
- `FusedNvfp4Experts`, `FusedFp8Experts`, `Fused16BitExperts`: the fused Triton MoE over the
  stored banks (NVFP4; block-FP8 or 16-bit), one launch per projection for all experts,
  capturable. Batches on CPU tensors or other activation dtypes (tests) take the loop.

Routers, given x [T, H]: the fp32 logits (`logits`), and the routing (`route`: weights and
global ids [T, k + S], the S shared slots last):
- `TorchRouter`: an fp32 matmul (one bf16 GEMM with fp32 output where torch has it), the
  torch routing (`select_experts`);
- `NativeRouter`: the gate by the native CPU GEMM and the sigmoid by the native kernel;
- `TritonRouter`: the gate GEMM (the batch-invariant one under --deterministic), then one
  Triton routing launch;
- `FusedRouter`: the gate GEMV and the routing in one launch where that measured faster (one
  token), else the Triton router.

Kernels are looked up on their modules at each call (tests count and replace them there).
"""

from __future__ import annotations

import logging
from typing import ClassVar, Protocol

import torch
import torch.nn.functional as F

from moeserve.config import MoEConfig
from moeserve.kernels import cpu as cpu_kernels
from moeserve.kernels.configs import tile_config
from moeserve.kernels.elementwise.activation import silu_mul
from moeserve.kernels.gemm import fp8_block_gemm as fp8_gemm_kernels
from moeserve.kernels.gemm import invariant as invariant_kernels
from moeserve.kernels.gemm import nvfp4_gemm as nvfp4_gemm_kernels
from moeserve.kernels.moe import fp8 as moe_fp8
from moeserve.kernels.moe import nvfp4 as moe_nvfp4
from moeserve.kernels.routing import router as route_kernels
from moeserve.kernels.routing import router_fused as fused_route_kernels
from moeserve.layers.expert_banks import ExpertBank, ExpertLayout
from moeserve.layers.routing import append_shared_slots, select_experts

log = logging.getLogger(__name__)

# Batches in which the fused GPU kernels run shared slots with the routed experts (else the
# shared experts are dense GEMMs on their bank rows, added in the combine). The MoE GEMV
# schedules serve a few slots of one expert per weight pass, so a shared expert, which every
# token hits, is re-read ~T/2 times: slots saved 2-14 us per DeepSeek-V3 FP8 layer at 1-4
# tokens, lost 15-141 us at 8-32, were even at 64 and saved 155 us at 128 (tensor-core
# schedule) on an H200 (benchmarks/results/moe_shared_slots.md).
SLOTS_MAX_GEMV_TOKENS = 4
SLOTS_MIN_MMA_TOKENS = 64


# ---- routed experts -------------------------------------------------------------------------
class ExpertsLayer(Protocol):
    """What a backend reads of its experts (`RoutedExperts`' public attributes)."""

    layout: ExpertLayout
    w13: ExpertBank  # gate rows, then up rows
    w2: ExpertBank  # down
    hidden: int
    intermediate: int
    slots_per_token: int  # routed experts per token plus the shared slots
    batch_invariant: bool
    pdl: bool


class ExpertsBackend(Protocol):
    name: ClassVar[str]  # the key in EXPERTS
    label: ClassVar[str]  # what the kernel plan prints for it
    capturable: ClassVar[bool]  # decode can be captured in a CUDA graph

    def process_weights(self) -> None: ...

    def runs_shared_slots(self, x: torch.Tensor) -> bool:
        """Whether this batch routes to the shared slots (else `shared_dense` serves them)."""

    def shared_dense(self, x: torch.Tensor) -> torch.Tensor:
        """sum_j shared_j(x) [T, H] by dense GEMMs on the shared slots' bank rows."""

    def forward(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        local: torch.Tensor,
        add_to: torch.Tensor | None,
    ) -> torch.Tensor:
        """sum over this rank's slots `local` [T, k] of w * expert(x), plus `add_to` (which
        may be overwritten)."""


class LoopExperts:
    name: ClassVar[str] = "loop"
    label: ClassVar[str] = "per-expert loop (dequantize + cuBLAS)"
    capturable: ClassVar[bool] = False

    def __init__(self, experts: ExpertsLayer) -> None:
        self.experts = experts

    def process_weights(self) -> None:
        return None

    def runs_shared_slots(self, x: torch.Tensor) -> bool:
        return True  # the loop runs them as experts

    def shared_dense(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{self.name}: the shared slots run in the loop")

    def expert(self, xe: torch.Tensor, e: int) -> torch.Tensor:
        """One local expert's MLP on its rows, its weights dequantized for the call."""
        m = self.experts
        gu = xe @ m.w13.dense(e, xe.dtype).t()
        inter = m.w13.local_out
        h = F.silu(gu[:, :inter]) * gu[:, inter:]
        return h @ m.w2.dense(e, xe.dtype).t()

    def forward(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        local: torch.Tensor,
        add_to: torch.Tensor | None,
    ) -> torch.Tensor:
        out = torch.zeros_like(x) if add_to is None else add_to.clone()
        slots = self.experts.layout.num_slots
        # experts in id order: each token's contributions are added in one fixed order
        for e in torch.unique(local).tolist():
            if not 0 <= e < slots:
                continue
            tok, slot = torch.where(local == e)
            y = self.expert(x[tok], e)
            out.index_add_(0, tok, y * weights[tok, slot, None].to(x.dtype))
        return out


class NativeLoopExperts(LoopExperts):
    """The loop with each expert's weights dequantized and packed per call for the native CPU
    GEMMs (the model holds no dense copy of itself); odd widths, which those kernels do not
    take, stay on torch's."""

    name = "native-loop"
    label = "per-expert loop, native GEMMs"

    def __init__(self, experts: ExpertsLayer) -> None:
        super().__init__(experts)
        self.native = experts.hidden % 2 == 0 and experts.w13.local_out % 2 == 0

    def expert(self, xe: torch.Tensor, e: int) -> torch.Tensor:
        if not (self.native and xe.dtype == torch.bfloat16):
            return super().expert(xe, e)
        m = self.experts
        gu = cpu_kernels.linear(xe, cpu_kernels.pack_bf16(m.w13.dense(e, xe.dtype)))
        h = cpu_kernels.silu_mul(gu)
        return cpu_kernels.linear(h, cpu_kernels.pack_bf16(m.w2.dense(e, xe.dtype)))


class FusedExperts(LoopExperts):
    """The fused Triton MoE: its arguments taken from the banks once after loading, its
    one-token combine and split-K counters (zeroed; the kernels re-zero them)."""

    capturable = True

    def __init__(self, experts: ExpertsLayer) -> None:
        super().__init__(experts)
        self.args: tuple[torch.Tensor | None, ...] = ()
        self.counters: torch.Tensor | None = None

    def process_weights(self) -> None:
        m = self.experts
        self.args = self.kernel_args()
        self.counters = torch.zeros(
            moe_nvfp4.combine_counters_needed(m.hidden, m.intermediate, m.slots_per_token),
            dtype=torch.int32,
            device=self.args[0].device,
        )

    def kernel_args(self) -> tuple[torch.Tensor | None, ...]:
        raise NotImplementedError

    def runs_shared_slots(self, x: torch.Tensor) -> bool:
        """Always where the fused kernel does not serve the batch; else where slots measured
        faster."""
        if not self.serves(x) or self.experts.batch_invariant:
            return True
        tokens = x.shape[0]
        return tokens <= SLOTS_MAX_GEMV_TOKENS or tokens >= SLOTS_MIN_MMA_TOKENS

    @staticmethod
    def serves(x: torch.Tensor) -> bool:
        return x.is_cuda and x.dtype == torch.bfloat16

    def shared_dense(self, x: torch.Tensor) -> torch.Tensor:
        out = None
        layout = self.experts.layout
        for j in range(layout.num_shared):
            y = self.slot_mlp(x, layout.num_local + j)
            out = y if out is None else out.add_(y)
        return out

    def slot_mlp(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """One bank slot's MLP by dense GPU GEMMs on its argument views (one merged gate+up
        GEMM, SiLU*up, down)."""
        raise NotImplementedError

    def forward(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        local: torch.Tensor,
        add_to: torch.Tensor | None,
    ) -> torch.Tensor:
        if not self.serves(x):
            return super().forward(x, weights, local, add_to)
        return self.fused(x.contiguous(), weights, local, add_to)

    def fused(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        local: torch.Tensor,
        add_to: torch.Tensor | None,
    ) -> torch.Tensor:
        raise NotImplementedError


class FusedNvfp4Experts(FusedExperts):
    name = "fused-nvfp4"
    label = "fused Triton NVFP4 MoE"

    def kernel_args(self) -> tuple[torch.Tensor, ...]:
        """NVFP4: one global scale per expert for gate+up (the fused kernel's contract),
        folded in place into the block scales, and the kernel's argument views."""
        m = self.experts
        v13 = m.w13.scheme.nvfp4_view(m.w13.view())
        v2 = m.w2.scheme.nvfp4_view(m.w2.view())
        if v13 is None or v2 is None:
            raise ValueError("the fused NVFP4 MoE needs NVFP4 expert banks")
        (p13, s13, g13), (p2, s2, g2) = v13, v2
        g13 = g13.float().reshape(m.layout.num_slots, 2)
        gs = g13.amax(dim=1)
        if not torch.equal(g13[:, 0], g13[:, 1]):
            log.info("MoE: gate/up global scales differ; block scales rescaled to one global")
            rows = s13.shape[1] // 2
            for part in range(2):
                half = s13[:, part * rows : (part + 1) * rows]
                ratio = (g13[:, part] / gs)[:, None, None]
                half.copy_((half.float() * ratio).to(half.dtype))
        return (p13, s13, gs.contiguous(), p2, s2, g2.float().reshape(-1).contiguous())

    def slot_mlp(self, x: torch.Tensor, e: int) -> torch.Tensor:
        p13, s13, g13, p2, s2, g2 = self.args
        h = silu_mul(nvfp4_gemm_kernels.nvfp4_gemm(x, p13[e], s13[e], g13[e]))
        return nvfp4_gemm_kernels.nvfp4_gemm(h, p2[e], s2[e], g2[e])

    def fused(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        local: torch.Tensor,
        add_to: torch.Tensor | None,
    ) -> torch.Tensor:
        schedule = {}
        if self.experts.batch_invariant:
            schedule = dict(
                kernel="mma",
                gate_up_config=invariant_kernels.MOE_NVFP4_GATE_UP,
                down_config=invariant_kernels.MOE_NVFP4_DOWN,
            )
        return moe_nvfp4.fused_moe_nvfp4(
            x,
            local,
            weights.float(),
            *self.args,
            out=add_to,
            accumulate=add_to is not None,
            combine_counters=self.counters,
            pdl=self.experts.pdl,
            **schedule,
        )


class FusedFp8Experts(FusedExperts):
    """Block-FP8 banks (128x128 block scales applied in-kernel); `Fused16BitExperts`: the same
    kernels on 16-bit banks."""

    name = "fused-fp8"
    label = "fused Triton block-FP8 MoE"

    def kernel_args(self) -> tuple[torch.Tensor | None, ...]:
        m = self.experts
        e13 = m.w13.scheme.elementwise_view(m.w13.view())
        e2 = m.w2.scheme.elementwise_view(m.w2.view())
        if e13 is None or e2 is None:
            raise ValueError(f"{self.label} cannot read these expert banks")
        moe_fp8.check_fp8_moe_shapes(*e13, *e2)
        return (*e13, *e2)

    def slot_mlp(self, x: torch.Tensor, e: int) -> torch.Tensor:
        w13, s13, w2, s2 = self.args
        if s13 is None:
            return F.linear(silu_mul(F.linear(x, w13[e])), w2[e])
        h = silu_mul(fp8_gemm_kernels.fp8_block_gemm(x, w13[e], s13[e]))
        return fp8_gemm_kernels.fp8_block_gemm(h, w2[e], s2[e])

    def invariant_schedule(self) -> dict:
        """--deterministic: the tensor-core schedule with the one-token config at every token
        count."""
        if not self.experts.batch_invariant:
            return {}
        w13, s13 = self.args[:2]
        key = f"{w13.shape[0]}:{w13.shape[1]}x{w13.shape[2]}"
        table = moe_fp8.tile_table(s13 is not None, "mma")
        return dict(kernel="mma", config=tile_config(table, 1, key))

    def fused(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        local: torch.Tensor,
        add_to: torch.Tensor | None,
    ) -> torch.Tensor:
        return moe_fp8.fused_moe_fp8(
            x,
            local,
            weights,
            *self.args,
            out=add_to,
            accumulate=add_to is not None,
            combine_counters=self.counters,
            **self.invariant_schedule(),
        )


class Fused16BitExperts(FusedFp8Experts):
    name = "fused-16bit"
    label = "fused Triton BF16 MoE"


_EXPERT_CLASSES = (
    LoopExperts,
    NativeLoopExperts,
    FusedNvfp4Experts,
    FusedFp8Experts,
    Fused16BitExperts,
)
EXPERTS: dict[str, type[LoopExperts]] = {cls.name: cls for cls in _EXPERT_CLASSES}


# ---- routers ---------------------------------------------------------------------------------
class RouterLayer(Protocol):
    """What a backend reads of its router (`Router`'s public attributes)."""

    weight: torch.Tensor  # [E, H]
    e_score_correction_bias: torch.Tensor | None
    batch_invariant: bool


class RouterBackend(Protocol):
    name: ClassVar[str]  # the key in ROUTERS
    label: ClassVar[str]

    def process_weights(self) -> None: ...

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 router logits [T, E]."""

    def route(
        self, x: torch.Tensor, cfg: MoEConfig, slots: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp32 weights, global expert ids) [T, k + slots]."""


class TorchRouter:
    name: ClassVar[str] = "torch"
    label: ClassVar[str] = "torch"

    def __init__(self, router: RouterLayer) -> None:
        self.router = router
        self.fp32_out = False  # this torch has the bf16 GEMM with fp32 output (mm.out_dtype)

    def process_weights(self) -> None:
        """On GPUs: whether this torch has the bf16 GEMM with fp32 output."""
        w = self.router.weight
        self.fp32_out = False
        if w.is_cuda and w.dtype == torch.bfloat16:
            try:
                torch.mm(w[:1], w[:1].t(), out_dtype=torch.float32)
                self.fp32_out = True
            except (TypeError, RuntimeError):
                log.info("router: no bf16 GEMM with fp32 output in this torch; fp32 matmul")

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        w = self.router.weight
        if self.fp32_out and x.dtype == torch.bfloat16:
            return torch.mm(x, w.t(), out_dtype=torch.float32)
        return F.linear(x.float(), w.float())

    def select(
        self, x: torch.Tensor, cfg: MoEConfig, slots: int, native: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch routing of this batch's logits, the shared slots appended."""
        weights, ids = select_experts(
            self.logits(x),
            cfg.num_experts_per_tok,
            correction_bias=self.router.e_score_correction_bias,
            native=native,
            **routing_kwargs(cfg),
        )
        if slots:
            return append_shared_slots(weights, ids, cfg.n_routed_experts, slots)
        return weights, ids

    def route(
        self, x: torch.Tensor, cfg: MoEConfig, slots: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.select(x, cfg, slots)


class NativeRouter(TorchRouter):
    """The gate packed for the native CPU kernels (fp32 logits from bf16 x and gate: products
    exact, one summation order) where it is bf16 of an even width; torch's matmul else."""

    name = "native"
    label = "native CPU GEMM"

    def __init__(self, router: RouterLayer) -> None:
        super().__init__(router)
        self.packed: cpu_kernels.PackedWeight | None = None

    def process_weights(self) -> None:
        super().process_weights()
        w = self.router.weight
        if w.dtype == torch.bfloat16 and w.shape[1] % 2 == 0:
            self.packed = cpu_kernels.pack_bf16(w.data)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and x.dtype == torch.bfloat16:
            return cpu_kernels.linear(x, self.packed, torch.float32)
        return super().logits(x)

    def route(
        self, x: torch.Tensor, cfg: MoEConfig, slots: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.select(x, cfg, slots, native=self.packed is not None)


class TritonRouter(TorchRouter):
    name = "triton"
    label = "gate GEMM + Triton routing"

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        w = self.router.weight
        if self.router.batch_invariant and x.is_cuda and w.dtype == torch.bfloat16:
            return invariant_kernels.gemm16(x.to(torch.bfloat16), w, torch.float32)
        return super().logits(x)

    def route(
        self, x: torch.Tensor, cfg: MoEConfig, slots: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not x.is_cuda:
            return self.select(x, cfg, slots)
        bias = self.router.e_score_correction_bias
        return route_kernels.route(
            self.logits(x),
            bias,
            cfg.num_experts_per_tok,
            shared_slots=slots,
            **routing_kwargs(cfg),
        )


class FusedRouter(TritonRouter):
    name = "fused"
    label = "gate GEMV + routing in one launch (one token), else gate GEMM + Triton routing"

    def __init__(self, router: RouterLayer) -> None:
        super().__init__(router)
        self.workspace: fused_route_kernels.RouterFusedWorkspace | None = None

    def process_weights(self) -> None:
        super().process_weights()
        w = self.router.weight
        self.workspace = None
        fr = fused_route_kernels
        if fr.fused_route_supported(w[:1], w):  # w[:1]: a one-token bf16 x of its width
            self.workspace = fr.RouterFusedWorkspace.create(
                w.shape[0], w.device, max_tokens=fr.FUSED_WINS_MAX_TOKENS
            )

    def route(
        self, x: torch.Tensor, cfg: MoEConfig, slots: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        r, fr = self.router, fused_route_kernels
        if self.workspace is not None and fr.prefer_fused_route(x, r.weight):
            return fr.route_fused(
                x,
                r.weight,
                r.e_score_correction_bias,
                cfg.num_experts_per_tok,
                shared_slots=slots,
                workspace=self.workspace,
                **routing_kwargs(cfg),
            )
        return super().route(x, cfg, slots)


ROUTERS: dict[str, type[TorchRouter]] = {
    cls.name: cls for cls in (TorchRouter, NativeRouter, TritonRouter, FusedRouter)
}


def routing_kwargs(cfg: MoEConfig) -> dict:
    """The routing rule's settings, as the routing functions take them."""
    return dict(
        scoring_func=cfg.scoring_func,
        topk_method=cfg.topk_method,
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        norm_topk_prob=cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor,
    )
