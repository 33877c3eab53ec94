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
from moeserve.kernels import cpu as cpu_kernels
from moeserve.layers.kernel_plan import KernelPlan
from moeserve.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from moeserve.layers.quant.base import (
    NoQuant,
    QuantConfig,
    UnquantizedLinearMethod,
    check_block_split,
    copy_loader,
    make_param,
    materialize,
)
from moeserve.layers.quant.scheme import WeightScheme
from moeserve.parallel.groups import SINGLE, TPGroup
from moeserve.parallel.simulated import simulated_routing

log = logging.getLogger(__name__)

# group score of noaux_tc routing = sum of the best this many biased scores in the group
_NOAUX_GROUP_TOP = 2
# Batches in which the fused GPU kernels run shared slots with the routed experts (else the
# shared experts are dense GEMMs on their bank rows, added in the combine). The MoE GEMV
# schedules serve a few slots of one expert per weight pass, so a shared expert, which every
# token hits, is re-read ~T/2 times: slots saved 2-14 us per DeepSeek-V3 FP8 layer at 1-4
# tokens, lost 15-141 us at 8-32, were even at 64 and saved 155 us at 128 (tensor-core
# schedule) on an H200 (benchmarks/results/moe_shared_slots.md).
SLOTS_MAX_GEMV_TOKENS = 4
SLOTS_MIN_MMA_TOKENS = 64


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
    native: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] fp32, expert ids [T, k] int64).

    Every token's result depends on its own logits only (`native`: the sigmoid by the native
    CPU kernel, whose result does not depend on where an element sits in the tensor; the
    renormalising sums run over the k columns in order).

    noaux_tc (DeepSeek-V3, Kimi): choose on sigmoid scores + correction bias, limited to the
    `topk_group` groups whose best-2 biased scores sum highest; weigh by the *unbiased*
    scores, renormalised (norm_topk_prob), times routed_scaling_factor.
    greedy / group_limited_greedy (DeepSeek-V2 softmax routing): choose on the scores (group
    score = the group's max); renormalise if norm_topk_prob, else scale by
    routed_scaling_factor (the V2 reference applies one or the other).
    """
    logits = logits.float()
    if scoring_func == "sigmoid":
        scores = cpu_kernels.sigmoid_(logits.clone()) if native else logits.sigmoid()
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
            weights = weights / (_row_sums(weights) + 1e-20)
        weights = weights * routed_scaling_factor
    elif top_k > 1 and norm_topk_prob:
        weights = weights / (_row_sums(weights) + 1e-20)
    else:
        weights = weights * routed_scaling_factor
    return weights, ids


def _row_sums(w: torch.Tensor) -> torch.Tensor:
    """[T, k] -> [T, 1]: the columns added left to right (a fixed order for every row)."""
    total = w[:, :1]
    for j in range(1, w.shape[1]):
        total = total + w[:, j : j + 1]
    return total


def append_shared_slots(
    weights: torch.Tensor, ids: torch.Tensor, first_id: int, slots: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], ids [T, k]) -> [T, k + slots]: every token also goes to experts
    first_id .. first_id + slots - 1 with weight 1 (shared experts as slots; CPU path, the GPU
    route kernel writes these columns itself)."""
    t = weights.shape[0]
    shared_ids = torch.arange(first_id, first_id + slots, dtype=ids.dtype, device=ids.device)
    return (
        torch.cat([weights, weights.new_ones(t, slots)], 1),
        torch.cat([ids, shared_ids.expand(t, slots)], 1),
    )


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
        gate = getattr(self.gate_proj, "nvfp4_kernel_args", None)
        up = getattr(self.up_proj, "nvfp4_kernel_args", None)
        if gate is None or up is None or not x.is_cuda or self.gate_proj.batch_invariant:
            return None
        from moeserve.kernels.gemm import nvfp4_gate_up as gu
        from moeserve.layers.quant.scheme import splitk_fits

        x2 = x.reshape(-1, x.shape[-1])
        n, k = gate[0].shape[0], x2.shape[-1]
        if x2.shape[0] > gu.gate_up_max_rows(n, k) or gate[0].shape != up[0].shape:
            return None
        ws = getattr(self.gate_proj, "splitk_workspace", None)
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
            from moeserve.kernels.elementwise.activation import silu_mul

            return self.down_proj(silu_mul(gu))
        gate, up = gu.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


# ---- routed experts -------------------------------------------------------------------------
ExpertShard = tuple[int | None, int]  # (expert, or None for a tensor stacking all; part)


class ExpertBank(nn.Module):
    """One stacked projection of this rank's experts, in the checkpoint's format: `w13` (gate
    rows then up rows: parts 0 and 1) or `w2` (down: one part).

    Storage per tensor of the weight scheme, for parts of [out, in] each: a tensor split
    along outputs is stacked as [slots, parts * rows, ...] (each part's rows contiguous);
    a per-weight scalar (a global scale) as [slots, parts, ...], slots = E_local routed
    experts then the shared-expert slots (`ExpertLayout.num_slots`). The checkpoint's
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
                shape = (layout.num_slots, parts, *s.shape)
            else:
                shape = (layout.num_slots, parts * s.shape[0], *s.shape[1:])
            p = make_param(torch.zeros(shape, dtype=s.dtype), None, None)
            p.optional = s.optional
            p.weight_loader = self.weight_loader
            p.spec = s
            setattr(self, s.suffix, p)

    def weight_loader(
        self, param: nn.Parameter, w: torch.Tensor, shard: ExpertShard = (None, 0)
    ) -> None:
        """Expert `shard[0]`'s part `shard[1]` from a per-expert checkpoint tensor (a global
        id; E + j: shared slot j), or, with expert None, that part of every routed expert from
        a stacked [E, ...] one. Experts this rank does not hold are skipped without reading
        the tensor."""
        expert, part = shard
        if expert is None:
            first, count = self.layout.first, self.layout.num_local
            for e in range(count):
                self._load_one(param, _select(w, first + e), e, part)
            return
        local = self.layout.local_index(expert)
        if local is not None:
            self._load_one(param, w, local, part)

    def split_shared(self, suffix: str, w: torch.Tensor, n: int) -> list[torch.Tensor]:
        """A shared-experts checkpoint tensor covering all `n` shared experts (intermediate
        n * I) -> expert j's piece for each j: its rows (w13) / columns (w2) of the
        intermediate dim in stored rows/columns (whole scale blocks: `shared_expert_slots`
        asks for I to hold whole blocks when n > 1), before this bank's own TP slice. Tensors
        not split along the intermediate dim (global scales) go to every expert as they are."""
        p = getattr(self, suffix, None)
        spec = getattr(p, "spec", None)
        axis = None if spec is None else spec.out_dim if self.split == "out" else spec.in_dim
        if n == 1 or axis is None:
            return [w] * n
        if w.shape[axis] % n:
            raise ValueError(
                f"shared experts' {suffix} {tuple(w.shape)} does not split into {n} experts"
            )
        size = w.shape[axis] // n
        return [w.narrow(axis, j * size, size) for j in range(n)]

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
    [r*E/N, (r+1)*E/N) whole (`split` = no split). `num_shared` shared-expert slots follow
    the routed experts (ids E + j, local slots num_local + j), split like them; tensor
    parallel only (under EP a shared expert would be split while routed ones are whole)."""

    num_experts: int  # routed experts: the router's ids 0 .. E-1
    first: int
    num_local: int  # routed experts on this rank
    split: TPGroup
    num_shared: int = 0

    @staticmethod
    def of(num_experts: int, tp: TPGroup, num_shared: int = 0) -> ExpertLayout:
        if tp.expert_parallel and tp.size > 1:
            if num_shared:
                raise ValueError("shared-expert slots are not laid out for expert parallelism")
            per = tp.shard_experts(num_experts)
            return ExpertLayout(num_experts, tp.rank * per, per, SINGLE)
        return ExpertLayout(num_experts, 0, num_experts, tp, num_shared)

    @property
    def num_slots(self) -> int:
        """Experts the banks hold on this rank: routed, then shared."""
        return self.num_local + self.num_shared

    def local_index(self, expert: int) -> int | None:
        """A global expert id -> its local slot (None: another rank's). Ids past the routed
        experts are the shared slots, which every rank holds."""
        if expert >= self.num_experts:
            j = expert - self.num_experts
            return self.num_local + j if j < self.num_shared else None
        i = expert - self.first
        return i if 0 <= i < self.num_local else None


class RoutedExperts(nn.Module):
    """This rank's routed experts, and `num_shared` shared experts as slots after them:
    `w13` (gate+up) and `w2` (down) banks."""

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
        self._dtype = dtype  # activations
        self._nvfp4_args: tuple[torch.Tensor, ...] | None = None
        self._elementwise_args: tuple[torch.Tensor | None, ...] | None = None
        self._hidden = hidden
        self._intermediate = intermediate
        self._slots_per_token = slots_per_token
        # the fused kernels' one-token combine and split-K counters (zeroed; the kernels
        # re-zero them)
        self._combine_counters: torch.Tensor | None = None
        # the kernel plan's choices (use_kernel_plan, before loading)
        self.fused = False  # the fused Triton MoE (else the per-expert loop)
        # the expert loop through the native CPU kernels: each expert's weights dequantized
        # and packed per call (the model holds no dense copy of itself)
        self.native = False
        # --deterministic: the fused kernels' tensor-core schedule at every token count
        self.batch_invariant = False
        self.pdl = False  # the GEMV path launches with programmatic dependent launch

    def use_kernel_plan(self, plan: KernelPlan) -> None:
        self.fused = plan.moe == "fused"
        self.native = plan.cpu_native and self._hidden % 2 == 0 and self.w13.local_out % 2 == 0
        self.batch_invariant = plan.invariant
        self.pdl = plan.pdl

    def process_weights_after_loading(self) -> None:
        """The fused kernel's arguments, once: the fused NVFP4 MoE (`_nvfp4_args`) or the
        fused block-FP8 / 16-bit MoE (`_elementwise_args`); neither for the expert loop."""
        self._nvfp4_args = self._elementwise_args = None
        w13 = self.w13.view()
        first = next(iter(w13.values()))
        if not self.fused:
            return
        from moeserve.kernels.moe.nvfp4 import combine_counters_needed

        self._combine_counters = torch.zeros(
            combine_counters_needed(self._hidden, self._intermediate, self._slots_per_token),
            dtype=torch.int32,
            device=first.device,
        )
        e13 = self.w13.scheme.elementwise_view(w13)
        e2 = self.w2.scheme.elementwise_view(self.w2.view())
        if e13 is not None and e2 is not None:
            from moeserve.kernels.moe.fp8 import check_fp8_moe_shapes

            try:
                check_fp8_moe_shapes(*e13, *e2)
            except ValueError as e:
                log.warning("MoE: the per-expert loop serves these experts (%s)", e)
                return
            self._elementwise_args = (*e13, *e2)
            return
        self._nvfp4_args = self._nvfp4_kernel_args()

    def _invariant_fp8_schedule(self, x: torch.Tensor) -> dict:
        """--deterministic: the tensor-core schedule with the one-token config at every token
        count (block-FP8 or 16-bit weights)."""
        if not self.batch_invariant:
            return {}
        from moeserve.kernels.configs import tile_config
        from moeserve.kernels.moe.fp8 import tile_table

        w13, s13 = self._elementwise_args[:2]
        key = f"{w13.shape[0]}:{w13.shape[1]}x{w13.shape[2]}"
        table = tile_table(s13 is not None, "mma")
        return dict(kernel="mma", config=tile_config(table, 1, key))

    def _nvfp4_kernel_args(self) -> tuple[torch.Tensor, ...] | None:
        """NVFP4: one global scale per expert for gate+up (the fused kernel's contract),
        folded in place into the block scales, and the kernel's argument views."""
        v13 = self.w13.scheme.nvfp4_view(self.w13.view())
        v2 = self.w2.scheme.nvfp4_view(self.w2.view())
        if v13 is None or v2 is None:
            return None
        (p13, s13, g13), (p2, s2, g2) = v13, v2
        g13 = g13.float().reshape(self.layout.num_slots, 2)
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
        """Global expert ids -> this rank's slots (out of [0, slots) for other ranks'
        experts). Shared slot ids E + j need no shift: they exist only without EP (first 0)."""
        return ids - self.layout.first if self.layout.first else ids

    def runs_shared_slots(self, x: torch.Tensor) -> bool:
        """Whether this batch routes to the shared slots (else `shared_dense` serves them):
        always on the CPU loop; in the fused kernels where slots measured faster."""
        tokens = x.shape[0]
        fused = self._nvfp4_args is not None or self._elementwise_args is not None
        if not (fused and x.is_cuda and x.dtype == torch.bfloat16) or self.batch_invariant:
            return True
        return tokens <= SLOTS_MAX_GEMV_TOKENS or tokens >= SLOTS_MIN_MMA_TOKENS

    def shared_dense(self, x: torch.Tensor) -> torch.Tensor:
        """sum_j shared_j(x) [T, H] by dense GPU GEMMs on the shared slots' bank rows (the
        fused kernels' argument views: one merged gate+up GEMM, SiLU*up, down per slot)."""
        from moeserve.kernels.elementwise.activation import silu_mul

        out = None
        for j in range(self.layout.num_shared):
            e = self.layout.num_local + j
            if self._nvfp4_args is not None:
                from moeserve.kernels.gemm.nvfp4_gemm import nvfp4_gemm

                p13, s13, g13, p2, s2, g2 = self._nvfp4_args
                h = silu_mul(nvfp4_gemm(x, p13[e], s13[e], g13[e]))
                y = nvfp4_gemm(h, p2[e], s2[e], g2[e])
            else:
                w13, s13, w2, s2 = self._elementwise_args
                if s13 is None:
                    y = F.linear(silu_mul(F.linear(x, w13[e])), w2[e])
                else:
                    from moeserve.kernels.gemm.fp8_block_gemm import fp8_block_gemm

                    h = silu_mul(fp8_block_gemm(x, w13[e], s13[e]))
                    y = fp8_block_gemm(h, w2[e], s2[e])
            out = y if out is None else out.add_(y)
        return out

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
        """x [T, H], weights/ids [T, k] (global ids; shared slots included as ids E + j) ->
        sum over this rank's experts of w * expert(x) [T, H] (this rank's partial), plus
        `add_to` (a separate shared expert's output, added in the kernel's combine step on
        GPUs; `add_to` may be overwritten)."""
        local = self.to_local_ids(ids)
        fused = x.is_cuda and x.dtype == torch.bfloat16
        if fused and self._nvfp4_args is not None:
            from moeserve.kernels.moe.nvfp4 import fused_moe_nvfp4

            schedule = {}
            if self.batch_invariant:
                from moeserve.kernels.gemm import invariant

                schedule = dict(
                    kernel="mma",
                    gate_up_config=invariant.MOE_NVFP4_GATE_UP,
                    down_config=invariant.MOE_NVFP4_DOWN,
                )
            return fused_moe_nvfp4(
                x.contiguous(),
                local,
                weights.float(),
                *self._nvfp4_args,
                out=add_to,
                accumulate=add_to is not None,
                combine_counters=self._combine_counters,
                pdl=self.pdl,
                **schedule,
            )
        if fused and self._elementwise_args is not None:
            from moeserve.kernels.moe.fp8 import fused_moe_fp8

            return fused_moe_fp8(
                x.contiguous(),
                local,
                weights,
                *self._elementwise_args,
                out=add_to,
                accumulate=add_to is not None,
                combine_counters=self._combine_counters,
                **self._invariant_fp8_schedule(x),
            )
        out = torch.zeros_like(x) if add_to is None else add_to.clone()
        inter = self.w13.local_out
        native = self.native and x.dtype == torch.bfloat16
        # experts in id order: each token's contributions are added in one fixed order
        for e in torch.unique(local).tolist():
            if not 0 <= e < self.layout.num_slots:
                continue
            tok, slot = torch.where(local == e)
            xe = x[tok]
            if native:
                gu = cpu_kernels.linear(xe, cpu_kernels.pack_bf16(self.w13.dense(e, x.dtype)))
                h = cpu_kernels.silu_mul(gu)
                y = cpu_kernels.linear(h, cpu_kernels.pack_bf16(self.w2.dense(e, x.dtype)))
            else:
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
        # the one-launch gate GEMV + routing's scratch (GPU, where its kernel applies)
        self.fused_workspace = None
        self.native_weight = None  # the gate packed for the native CPU kernels
        # the kernel plan's choices (use_kernel_plan, before loading)
        self.triton = False  # the Triton routing kernels
        self.fused = False  # the one-launch gate GEMV + routing (its probe passed)
        self.native_cpu = False
        self.batch_invariant = False  # --deterministic: the batch-invariant GEMM on GPUs

    def use_kernel_plan(self, plan: KernelPlan) -> None:
        self.triton = plan.triton
        self.fused = plan.router_fused
        self.native_cpu = plan.cpu_native
        self.batch_invariant = plan.invariant

    def process_weights_after_loading(self) -> None:
        """The gate packed for the native CPU kernels (fp32 logits from bf16 x and gate:
        products exact, one summation order), or on GPUs: whether this torch has the bf16 GEMM
        with fp32 output (mm.dtype), and the fused router's workspace."""
        w = self.weight
        self._fp32_out = False
        self.fused_workspace = None
        if self.native_cpu and w.dtype == torch.bfloat16 and w.shape[1] % 2 == 0:
            self.native_weight = cpu_kernels.pack_bf16(w.data)
        if self.fused:
            from moeserve.kernels.routing.router_fused import (
                FUSED_WINS_MAX_TOKENS,
                RouterFusedWorkspace,
                fused_route_supported,
            )

            if fused_route_supported(w[:1], w):  # w[:1]: a one-token bf16 x of its width
                self.fused_workspace = RouterFusedWorkspace.create(
                    w.shape[0], w.device, max_tokens=FUSED_WINS_MAX_TOKENS
                )
        if w.is_cuda and w.dtype == torch.bfloat16:
            try:
                torch.mm(w[:1], w[:1].t(), out_dtype=torch.float32)
                self._fp32_out = True
            except (TypeError, RuntimeError):
                log.info("router: no bf16 GEMM with fp32 output in this torch; fp32 matmul")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native_weight is not None and x.dtype == torch.bfloat16:
            return cpu_kernels.linear(x, self.native_weight, torch.float32)
        if self.batch_invariant and x.is_cuda and self.weight.dtype == torch.bfloat16:
            from moeserve.kernels.gemm.invariant import gemm16

            return gemm16(x.to(torch.bfloat16), self.weight, torch.float32)
        if self._fp32_out and x.dtype == torch.bfloat16:
            return torch.mm(x, self.weight.t(), out_dtype=torch.float32)
        return F.linear(x.float(), self.weight.float())


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
        else:
            self.shared_experts = None
        # rank simulation only (benchmarks, parallel/simulated.py): the router's ids replaced
        # by the busiest rank's expected share; None when serving
        self.simulated_routing = simulated_routing(
            tp,
            moe.n_routed_experts,
            moe.num_experts_per_tok,
            moe.n_group if moe.grouped else 1,
            moe.topk_group,
        )

    def route(
        self, x: torch.Tensor, shared_slots: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(routing weights fp32 [T, k + S], global expert ids [T, k + S]): one Triton kernel
        after the gate GEMM on GPUs (kernels/routing/router.py), the GEMV and the routing in one
        launch where that measured faster (one token, kernels/routing/router_fused.py), the torch
        reference elsewhere. The
        S last columns (S = `shared_slots`, default the layer's own) are the shared experts
        (ids E + j, weight 1.0, not scaled by routed_scaling_factor: a separate shared MLP is
        added with weight 1 too)."""
        c = self.cfg
        slots = self.shared_slots if shared_slots is None else shared_slots
        kw = dict(
            scoring_func=c.scoring_func,
            topk_method=c.topk_method,
            n_group=c.n_group,
            topk_group=c.topk_group,
            norm_topk_prob=c.norm_topk_prob,
            routed_scaling_factor=c.routed_scaling_factor,
        )
        bias = self.gate.e_score_correction_bias
        if self.gate.fused_workspace is not None:
            from moeserve.kernels.routing.router_fused import prefer_fused_route, route_fused

            if prefer_fused_route(x, self.gate.weight):  # one launch for GEMV + routing
                return route_fused(
                    x,
                    self.gate.weight,
                    bias,
                    c.num_experts_per_tok,
                    shared_slots=slots,
                    workspace=self.gate.fused_workspace,
                    **kw,
                )
        logits = self.gate(x)
        if self.gate.triton and x.is_cuda:
            from moeserve.kernels.routing.router import route

            return route(logits, bias, c.num_experts_per_tok, shared_slots=slots, **kw)
        native = self.gate.native_weight is not None
        weights, ids = select_experts(
            logits, c.num_experts_per_tok, correction_bias=bias, native=native, **kw
        )
        if slots:
            return append_shared_slots(weights, ids, c.n_routed_experts, slots)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = None
        slots = self.shared_slots
        if slots and not self.experts.runs_shared_slots(x):
            slots, shared = 0, self.experts.shared_dense(x)  # batch sizes where slots lose
        elif self.shared_experts is not None:
            shared = self.shared_experts(x)
        weights, ids = self.route(x, slots)
        if self.simulated_routing is not None:
            ids = self.simulated_routing.ids(ids)
        # this rank's partial sum: the decoder all-reduces it with the residual
        return self.experts(x, weights, ids, add_to=shared)
