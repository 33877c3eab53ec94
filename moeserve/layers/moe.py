"""Mixture-of-experts block of DeepSeek-V3 / Kimi: router, routed experts, shared experts.

Routed experts live in three stacked banks (`gate_proj`, `up_proj`, `down_proj`), each a
[E, out, in] weight in whatever format the checkpoint uses (a `WeightScheme` from
`layers/quant`). Checkpoint tensors `...experts.{e}.{proj}.{suffix}` load into row `e` of
`experts.{proj}.{suffix}`; transformers-5 stacked tensors (`experts.gate_up_proj`
[E, 2I, H], gate rows first, and `experts.down_proj` [E, H, I]) load whole.

Tensor parallelism splits every expert's intermediate dimension (gate/up rows, down
columns); the block all-reduces its output once.

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
from moeserve.layers.quant.base import QuantConfig, copy_loader, make_param
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
        down_tp = tp if reduce_output else _NoReduce(tp.rank, tp.size, tp.group)
        self.down_proj = RowParallelLinear(
            intermediate, hidden, prefix=f"{prefix}.down_proj", quant=quant, tp=down_tp, dtype=dtype
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@dataclass(frozen=True)
class _NoReduce(TPGroup):
    """This rank's slicing without the all-reduce (the caller reduces a sum once)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


# ---- routed experts -------------------------------------------------------------------------
class ExpertBank(nn.Module):
    """One projection of all experts: parameters [E, ...] per tensor of the weight scheme."""

    def __init__(
        self,
        scheme: WeightScheme,
        num_experts: int,
        out_features: int,
        in_features: int,
        split: str,
        tp: TPGroup,
        dtype: torch.dtype,
    ) -> None:
        super().__init__()
        self.scheme = scheme
        self.split = split  # "out" (gate/up) or "in" (down): the intermediate dimension
        self.tp = tp
        local_out = tp.shard(out_features) if split == "out" else out_features
        local_in = tp.shard(in_features) if split == "in" else in_features
        self.specs = scheme.specs(local_out, local_in, dtype)
        for s in self.specs:
            p = make_param(torch.zeros((num_experts, *s.shape), dtype=s.dtype), None, None)
            p.optional = s.optional
            p.weight_loader = self.weight_loader
            p.spec = s
            setattr(self, s.suffix, p)

    def weight_loader(
        self, param: nn.Parameter, w: torch.Tensor, expert: int | None = None
    ) -> None:
        """Row `expert` from a per-expert tensor, or all rows from a stacked [E, ...] one."""
        if expert is None:
            for e in range(w.shape[0]):
                self.weight_loader(param, w[e], e)
            return
        s: object = param.spec
        axis = s.out_dim if self.split == "out" else s.in_dim
        if axis is not None and self.tp.size > 1:
            n = w.shape[axis] // self.tp.size
            w = w.narrow(axis, self.tp.rank * n, n)
        dst = param.data[expert]
        if dst.numel() == w.numel() and dst.dim() <= 1:
            w = w.reshape(dst.shape)  # scalars stored as [] or [1]
        if dst.shape != w.shape:
            raise ValueError(f"expert tensor {tuple(w.shape)} does not fit {tuple(dst.shape)}")
        dst.copy_(w)

    def dense(self, expert: int, dtype: torch.dtype) -> torch.Tensor:
        return self.scheme.dequantize(
            {s.suffix: getattr(self, s.suffix)[expert] for s in self.specs}, dtype
        )


class RoutedExperts(nn.Module):
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
        self.num_experts = num_experts
        self.gate_proj = ExpertBank(scheme, num_experts, intermediate, hidden, "out", tp, dtype)
        self.up_proj = ExpertBank(scheme, num_experts, intermediate, hidden, "out", tp, dtype)
        self.down_proj = ExpertBank(scheme, num_experts, hidden, intermediate, "in", tp, dtype)
        self._fused: tuple[torch.Tensor, ...] | None = None

    def _fused_nvfp4(self) -> tuple[torch.Tensor, ...] | None:
        """Stacked [E, 2I, ...] gate+up and [E, H, ...] down in the fused kernel's layout,
        built once on first GPU use; None when the experts are not NVFP4."""
        if self._fused is None:
            views = []
            for bank in (self.gate_proj, self.up_proj, self.down_proj):
                view = bank.scheme.nvfp4_view(
                    {s.suffix: getattr(bank, s.suffix) for s in bank.specs}
                )
                if view is None:
                    self._fused = ()
                    return None
                views.append(view)
            (pg, sg, gg), (pu, su, gu), (pd, sd, gd) = views
            gs13 = torch.maximum(gg.reshape(-1), gu.reshape(-1)).float()
            if not (torch.equal(gg.reshape(-1), gs13) and torch.equal(gu.reshape(-1), gs13)):
                # one global per expert for gate+up: fold the ratio into the block scales
                log.info("MoE: gate/up global scales differ; block scales rescaled to one global")
                sg = (sg.float() * (gg.reshape(-1) / gs13)[:, None, None]).to(sg.dtype)
                su = (su.float() * (gu.reshape(-1) / gs13)[:, None, None]).to(su.dtype)
            self._fused = (
                torch.cat([pg, pu], 1).contiguous(),
                torch.cat([sg, su], 1).contiguous(),
                gs13,
                pd.contiguous(),
                sd.contiguous(),
                gd.reshape(-1).float().contiguous(),
            )
        return self._fused or None

    @property
    def supports_cuda_graph(self) -> bool:
        """Only the fused NVFP4 kernel is capturable: the expert loop reads ids on the host.
        (Asking builds the fused weights, which the first GPU forward would do anyway.)"""
        dev = getattr(self.gate_proj, self.gate_proj.specs[0].suffix).device
        return dev.type == "cuda" and gpu_kernels_enabled(dev) and self._fused_nvfp4() is not None

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], weights/ids [T, k] -> sum_k w * expert(x) [T, H] (this rank's partial)."""
        if x.is_cuda and gpu_kernels_enabled(x.device) and self._fused_nvfp4() is not None:
            from moeserve.kernels.moe import fused_moe_nvfp4

            y = fused_moe_nvfp4(
                x.to(torch.bfloat16).contiguous(),
                ids.to(torch.int32).contiguous(),
                weights.float().contiguous(),
                *self._fused,
            )
            return y.to(x.dtype)
        out = torch.zeros_like(x)
        for e in torch.unique(ids).tolist():
            tok, slot = torch.where(ids == e)
            xe = x[tok]
            h = F.silu(xe @ self.gate_proj.dense(e, x.dtype).t()) * (
                xe @ self.up_proj.dense(e, x.dtype).t()
            )
            y = h @ self.down_proj.dense(e, x.dtype).t()
            out.index_add_(0, tok, y * weights[tok, slot, None].to(x.dtype))
        return out


class Router(nn.Module):
    """`mlp.gate`: weight [E, H] and (noaux_tc) `e_score_correction_bias` [E], kept in fp32."""

    def __init__(self, num_experts: int, hidden: int, with_bias: bool) -> None:
        super().__init__()
        self.weight = make_param(torch.zeros(num_experts, hidden), None, None)
        self.weight.weight_loader = copy_loader
        if with_bias:
            self.e_score_correction_bias = make_param(torch.zeros(num_experts), None, None)
            self.e_score_correction_bias.weight_loader = copy_loader
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


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
        self.gate = Router(cfg.n_routed_experts, cfg.hidden_size, cfg.topk_method == "noaux_tc")
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
                reduce_output=False,
            )
        else:
            self.shared_experts = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        weights, ids = select_experts(
            self.gate(x),
            c.num_experts_per_tok,
            scoring_func=c.scoring_func,
            topk_method=c.topk_method,
            correction_bias=self.gate.e_score_correction_bias,
            n_group=c.n_group,
            topk_group=c.topk_group,
            norm_topk_prob=c.norm_topk_prob,
            routed_scaling_factor=c.routed_scaling_factor,
        )
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return self.tp.all_reduce(out)
