"""The stacked expert banks of a MoE layer in the checkpoint's format, and which experts a rank
holds (`ExpertLayout`).

Routed experts live in two banks, `w13` (gate rows then up rows) and `w2` (down), each
[E_local + S, out, in] in whatever format the checkpoint uses (a `WeightScheme` from
`layers/quant`): the layout the fused GPU kernel reads, loaded in place. Checkpoint tensors
`...experts.{e}.{gate,up,down}_proj.{suffix}` load into their expert's rows through shard ids
(expert, part); transformers-5 stacked tensors load with expert None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from moeserve.layers.quant.base import check_block_split, make_param, materialize
from moeserve.layers.quant.scheme import WeightScheme
from moeserve.parallel.groups import SINGLE, TPGroup

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
