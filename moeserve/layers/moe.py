"""Mixture-of-experts block of DeepSeek-V3 / Kimi: router, routed experts, shared experts.

Routed experts live in two stacked banks, `w13` (gate rows then up rows) and `w2` (down),
each [E_local, out, in] in whatever format the checkpoint uses (a `WeightScheme` from
`layers/quant`): the layout the fused GPU kernel reads, loaded in place. Checkpoint tensors
`...experts.{e}.{gate,up,down}_proj.{suffix}` load into their expert's rows through shard ids
(expert, part); transformers-5 stacked tensors (`experts.gate_up_proj` [E, 2I, H], gate rows
first, and `experts.down_proj` [E, H, I]) load with expert None.

Tensor parallelism splits every expert's intermediate dimension (gate/up rows, down
columns); expert parallelism (`TPGroup.expert_parallel`) gives each rank E/N whole experts
and maps the router's global ids to local ones (others' are skipped). Either way the block
returns this rank's partial sum, which the decoder all-reduces together with the residual
add and the next norm (no extra collective for EP).

CPU path: loop over the experts the batch hit; each is dequantized on the fly, so memory
holds only the stored format.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.config import ModelConfig
from moeserve.dist.parallel import SINGLE, TPGroup
from moeserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from moeserve.layers.quant.base import (
    QuantConfig,
    check_block_split,
    copy_loader,
    make_param,
    materialize,
)
from moeserve.layers.quant.scheme import WeightScheme, gpu_kernels_enabled

log = logging.getLogger(__name__)

# group score of noaux_tc routing = sum of the best this many biased scores in the group
_NOAUX_GROUP_TOP = 2


# ---- routing --------------------------------------------------------------------------------
def select_experts(
    logits: torch.Tensor,
    top_k: int,
    *,
    scoring_func: str = "sigmoid",
    topk_method: str = "noaux_tc",
    correction_bias: torch.Tensor | None = None,
    n_group: int = 1,
    topk_group: int = 1,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] fp32, expert ids [T, k] int64).

    noaux_tc (DeepSeek-V3, Kimi): choose on sigmoid scores + correction bias, limited to the
    `topk_group` groups whose best-2 biased scores sum highest; weigh by the *unbiased*
    scores, renormalised (norm_topk_prob), times routed_scaling_factor.
    greedy / group_limited_greedy (DeepSeek-V2 softmax routing): choose on the scores (group
    score = the group's max); renormalise if norm_topk_prob, else scale by
    routed_scaling_factor (the V2 reference applies one or the other).
    """
    logits = logits.float()
    if scoring_func == "sigmoid":
        scores = logits.sigmoid()
    elif scoring_func == "softmax":
        scores = logits.softmax(dim=-1)
    else:
        raise ValueError(f"unsupported scoring_func {scoring_func!r}")
    choice = scores if correction_bias is None else scores + correction_bias.float()
    num_tokens, num_experts = choice.shape
    if n_group > 1 and topk_method in ("noaux_tc", "group_limited_greedy"):
        grouped = choice.view(num_tokens, n_group, num_experts // n_group)
        if topk_method == "noaux_tc":
            group_scores = grouped.topk(_NOAUX_GROUP_TOP, dim=-1).values.sum(-1)
        else:
            group_scores = grouped.amax(dim=-1)
        keep = group_scores.topk(topk_group, dim=-1).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, -1)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if topk_method == "noaux_tc":
        if norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        weights = weights * routed_scaling_factor
    elif top_k > 1 and norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    else:
        weights = weights * routed_scaling_factor
    return weights, ids


# ---- dense MLP (leading dense layers, shared experts) ---------------------------------------
class DeepseekMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate/up column-parallel, down row-parallel."""

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
        self.gate_proj = ColumnParallelLinear(
            hidden, intermediate, prefix=f"{prefix}.gate_proj", **kw
        )
        self.up_proj = ColumnParallelLinear(hidden, intermediate, prefix=f"{prefix}.up_proj", **kw)
        self.down_proj = RowParallelLinear(
            intermediate,
            hidden,
            prefix=f"{prefix}.down_proj",
            reduce_results=reduce_output,
            **kw,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# ---- routed experts -------------------------------------------------------------------------
ExpertShard = tuple[int | None, int]  # (expert, or None for a tensor stacking all; part)


class ExpertBank(nn.Module):
    """One stacked projection of this rank's experts, in the checkpoint's format: `w13` (gate
    rows then up rows: parts 0 and 1) or `w2` (down: one part).

    Storage per tensor of the weight scheme, for parts of [out, in] each: a tensor split
    along outputs is stacked as [E_local, parts * rows, ...] (each part's rows contiguous);
    a per-weight scalar (a global scale) as [E_local, parts, ...]. The checkpoint's
    per-expert tensors load straight into their rows (`weight_loader` with shard id
    (expert, part)); nothing is concatenated or copied after loading.
    """

    def __init__(
        self,
        scheme: WeightScheme,
        layout: ExpertLayout,
        parts: int,
        out_features: int,
        in_features: int,
        split: str,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.scheme = scheme
        self.layout = layout
        self.parts = parts
        self.split = split  # "out" (w13) or "in" (w2): the intermediate dimension
        tp = layout.split
        self.local_out = tp.shard(out_features) if split == "out" else out_features
        self.local_in = tp.shard(in_features) if split == "in" else in_features
        self.specs = scheme.specs(self.local_out, self.local_in, dtype)
        for s in self.specs:
            if split == "out" and s.out_dim is not None:
                check_block_split("routed experts", self.local_out, s.out_block, tp.size)
            if split == "in" and s.in_dim is not None:
                check_block_split("routed experts", self.local_in, s.in_block, tp.size)
            if s.out_dim is None:
                shape = (layout.num_local, parts, *s.shape)
            else:
                shape = (layout.num_local, parts * s.shape[0], *s.shape[1:])
            p = make_param(torch.zeros(shape, dtype=s.dtype), None, None)
            p.optional = s.optional
            p.weight_loader = self.weight_loader
            p.spec = s
            setattr(self, s.suffix, p)

    def weight_loader(
        self, param: nn.Parameter, w: torch.Tensor, shard: ExpertShard = (None, 0)
    ) -> None:
        """Expert `shard[0]`'s part `shard[1]` from a per-expert checkpoint tensor, or, with
        expert None, that part of every expert from a stacked [E, ...] one. Experts this rank
        does not hold are skipped without reading the tensor."""
        expert, part = shard
        if expert is None:
            first, count = self.layout.first, self.layout.num_local
            for e in range(count):
                self._load_one(param, _select(w, first + e), e, part)
            return
        local = self.layout.local_index(expert)
        if local is not None:
            self._load_one(param, w, local, part)

    def _load_one(self, param: nn.Parameter, w: torch.Tensor, local: int, part: int) -> None:
        s = param.spec
        tp = self.layout.split
        axis = s.out_dim if self.split == "out" else s.in_dim
        if axis is not None and tp.size > 1:
            n = w.shape[axis] // tp.size
            w = w.narrow(axis, tp.rank * n, n)
        if s.out_dim is None:
            dst = param.data[local, part]
        else:
            rows = s.shape[0]
            dst = param.data[local].narrow(0, part * rows, rows)
        w = materialize(w)
        if dst.numel() == w.numel() and dst.dim() <= 1:
            w = w.reshape(dst.shape)  # scalars stored as [] or [1]
        if dst.shape != w.shape:
            raise ValueError(f"expert tensor {tuple(w.shape)} does not fit {tuple(dst.shape)}")
        dst.copy_(w)

    def part_tensors(self, expert: int, part: int) -> dict[str, torch.Tensor]:
        """The scheme's tensors of one part of one local expert (views)."""
        out = {}
        for s in self.specs:
            t = getattr(self, s.suffix)[expert]
            out[s.suffix] = (
                t[part] if s.out_dim is None else t.narrow(0, part * s.shape[0], s.shape[0])
            )
        return out

    def view(self) -> dict[str, torch.Tensor]:
        """Every tensor of the scheme, stacked over this rank's experts."""
        return {s.suffix: getattr(self, s.suffix) for s in self.specs}

    def dense(self, expert: int, dtype: torch.dtype) -> torch.Tensor:
        """[parts * out, in] dense weight of one local expert (CPU path)."""
        parts = [
            self.scheme.dequantize(self.part_tensors(expert, p), dtype) for p in range(self.parts)
        ]
        return parts[0] if self.parts == 1 else torch.cat(parts, 0)


def _select(w: torch.Tensor, index: int) -> torch.Tensor:
    return w.select(0, index) if isinstance(w, torch.Tensor) else w[index]


@dataclass(frozen=True)
class ExpertLayout:
    """Which experts this rank holds and how each is sliced.

    Tensor parallel (default): every rank holds all experts, each split along its
    intermediate dim (`split` = the TP group). Expert parallel: rank r holds experts
    [r*E/N, (r+1)*E/N) whole (`split` = no split)."""

    num_experts: int
    first: int
    num_local: int
    split: TPGroup

    @staticmethod
    def of(num_experts: int, tp: TPGroup) -> ExpertLayout:
        if tp.expert_parallel and tp.size > 1:
            per = tp.shard_experts(num_experts)
            return ExpertLayout(num_experts, tp.rank * per, per, SINGLE)
        return ExpertLayout(num_experts, 0, num_experts, tp)

    def local_index(self, expert: int) -> int | None:
        i = expert - self.first
        return i if 0 <= i < self.num_local else None


class RoutedExperts(nn.Module):
    """This rank's routed experts: `w13` (gate+up) and `w2` (down) banks."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        intermediate: int,
        scheme: WeightScheme,
        tp: TPGroup,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.layout = ExpertLayout.of(num_experts, tp)
        self.num_experts = num_experts
        self.w13 = ExpertBank(scheme, self.layout, 2, intermediate, hidden, "out", dtype)
        self.w2 = ExpertBank(scheme, self.layout, 1, hidden, intermediate, "in", dtype)
        self._dtype = dtype  # activations
        self._nvfp4_args: tuple[torch.Tensor, ...] | None = None
        self._elementwise_args: tuple[torch.Tensor | None, ...] | None = None

    def process_weights_after_loading(self) -> None:
        """Choose the GPU kernel once: the fused NVFP4 MoE (`_nvfp4_args`) or the fused
        block-FP8 / 16-bit MoE (`_elementwise_args`); neither on CPUs (the expert loop)."""
        self._nvfp4_args = self._elementwise_args = None
        w13 = self.w13.view()
        first = next(iter(w13.values()))
        if first.device.type != "cuda" or not gpu_kernels_enabled(first.device):
            return
        e13 = self.w13.scheme.elementwise_view(w13)
        e2 = self.w2.scheme.elementwise_view(self.w2.view())
        if e13 is not None and e2 is not None:
            from moeserve.kernels.moe_fp8 import check_fp8_moe_shapes

            try:
                check_fp8_moe_shapes(*e13, *e2)
            except ValueError as e:
                log.warning("MoE: the per-expert loop serves these experts (%s)", e)
                return
            self._elementwise_args = (*e13, *e2)
            return
        self._nvfp4_args = self._nvfp4_kernel_args()

    def _nvfp4_kernel_args(self) -> tuple[torch.Tensor, ...] | None:
        """NVFP4: one global scale per expert for gate+up (the fused kernel's contract),
        folded in place into the block scales, and the kernel's argument views."""
        v13 = self.w13.scheme.nvfp4_view(self.w13.view())
        v2 = self.w2.scheme.nvfp4_view(self.w2.view())
        if v13 is None or v2 is None:
            return None
        (p13, s13, g13), (p2, s2, g2) = v13, v2
        g13 = g13.float().reshape(self.layout.num_local, 2)
        gs = g13.amax(dim=1)
        if not torch.equal(g13[:, 0], g13[:, 1]):
            log.info("MoE: gate/up global scales differ; block scales rescaled to one global")
            rows = s13.shape[1] // 2
            for part in range(2):
                half = s13[:, part * rows : (part + 1) * rows]
                ratio = (g13[:, part] / gs)[:, None, None]
                half.copy_((half.float() * ratio).to(half.dtype))
        return (p13, s13, gs.contiguous(), p2, s2, g2.float().reshape(-1).contiguous())

    def to_local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Global expert ids -> this rank's (out of [0, E_local) for other ranks' experts)."""
        return ids - self.layout.first if self.layout.first else ids

    @property
    def supports_cuda_graph(self) -> bool:
        """The fused kernels (bf16 activations) are capturable; the expert loop reads ids on
        the host."""
        fused = self._nvfp4_args is not None or self._elementwise_args is not None
        return fused and self._dtype == torch.bfloat16

    def forward(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        add_to: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [T, H], weights/ids [T, k] (global ids) -> sum over this rank's experts of
        w * expert(x) [T, H] (this rank's partial), plus `add_to` (the shared expert's output,
        added in the kernel's combine step on GPUs; `add_to` may be overwritten)."""
        local = self.to_local_ids(ids)
        fused = x.is_cuda and x.dtype == torch.bfloat16
        if fused and self._nvfp4_args is not None:
            from moeserve.kernels.moe import fused_moe_nvfp4

            return fused_moe_nvfp4(
                x.contiguous(),
                local,
                weights.float(),
                *self._nvfp4_args,
                out=add_to,
                accumulate=add_to is not None,
            )
        if fused and self._elementwise_args is not None:
            from moeserve.kernels.moe_fp8 import fused_moe_fp8

            return fused_moe_fp8(
                x.contiguous(),
                local,
                weights,
                *self._elementwise_args,
                out=add_to,
                accumulate=add_to is not None,
            )
        out = torch.zeros_like(x) if add_to is None else add_to.clone()
        inter = self.w13.local_out
        for e in torch.unique(local).tolist():
            if not 0 <= e < self.layout.num_local:
                continue
            tok, slot = torch.where(local == e)
            xe = x[tok]
            gu = xe @ self.w13.dense(e, x.dtype).t()
            h = F.silu(gu[:, :inter]) * gu[:, inter:]
            y = h @ self.w2.dense(e, x.dtype).t()
            out.index_add_(0, tok, y * weights[tok, slot, None].to(x.dtype))
        return out


class Router(nn.Module):
    """`mlp.gate`: weight [E, H] in the model dtype (the checkpoint stores it in bf16) and
    (noaux_tc) `e_score_correction_bias` [E] in fp32. Logits are fp32: on GPUs one bf16 GEMM
    with fp32 output (bf16 products are exact in fp32; only the summation order differs
    from an fp32 GEMM), elsewhere an fp32 matmul."""

    def __init__(self, num_experts: int, hidden: int, with_bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = make_param(torch.zeros(num_experts, hidden, dtype=dtype), None, None)
        self.weight.weight_loader = copy_loader
        if with_bias:
            self.e_score_correction_bias = make_param(torch.zeros(num_experts), None, None)
            self.e_score_correction_bias.weight_loader = copy_loader
        else:
            self.e_score_correction_bias = None
        self._fp32_out = False

    def process_weights_after_loading(self) -> None:
        """Whether this torch has the bf16 GEMM with fp32 output (mm.dtype, CUDA only)."""
        w = self.weight
        self._fp32_out = False
        if w.is_cuda and w.dtype == torch.bfloat16:
            try:
                torch.mm(w[:1], w[:1].t(), out_dtype=torch.float32)
                self._fp32_out = True
            except (TypeError, RuntimeError):
                log.info("router: no bf16 GEMM with fp32 output in this torch; fp32 matmul")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._fp32_out and x.dtype == torch.bfloat16:
            return torch.mm(x, self.weight.t(), out_dtype=torch.float32)
        return F.linear(x.float(), self.weight.float())


class DeepseekMoE(nn.Module):
    """Router + routed experts + shared experts of one MoE layer."""

    def __init__(
        self,
        cfg: ModelConfig,
        prefix: str,
        quant: QuantConfig | None,
        tp: TPGroup = SINGLE,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.gate = Router(
            cfg.n_routed_experts, cfg.hidden_size, cfg.topk_method == "noaux_tc", dtype
        )
        scheme = quant.moe_method(f"{prefix}.experts") if quant is not None else None
        self.experts = RoutedExperts(
            cfg.n_routed_experts,
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            scheme if isinstance(scheme, WeightScheme) else WeightScheme(),
            tp,
            dtype,
        )
        if cfg.n_shared_experts:
            self.shared_experts = DeepseekMLP(
                cfg.hidden_size,
                cfg.moe_intermediate_size * cfg.n_shared_experts,
                f"{prefix}.shared_experts",
                quant,
                tp,
                dtype,
                reduce_output=False,  # summed with the routed experts, reduced once
            )
        else:
            self.shared_experts = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(routing weights fp32 [T, k], global expert ids [T, k]): one Triton kernel after
        the gate GEMM on GPUs (kernels/router.py), the torch reference elsewhere."""
        c = self.cfg
        kw = dict(
            scoring_func=c.scoring_func,
            topk_method=c.topk_method,
            n_group=c.n_group,
            topk_group=c.topk_group,
            norm_topk_prob=c.norm_topk_prob,
            routed_scaling_factor=c.routed_scaling_factor,
        )
        logits = self.gate(x)
        bias = self.gate.e_score_correction_bias
        if x.is_cuda and gpu_kernels_enabled(x.device):
            from moeserve.kernels.router import route

            return route(logits, bias, c.num_experts_per_tok, **kw)
        return select_experts(logits, c.num_experts_per_tok, correction_bias=bias, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        # this rank's partial sum: the decoder all-reduces it with the residual
        return self.experts(x, weights, ids, add_to=shared)
