"""Tensor/expert-parallel group as an explicit object handed to layers (no process-wide globals)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in its tensor-parallel group and the collectives over it.

    `group`: the torch.distributed group of the ranks (None when size 1); `comm`: the
    communicator chosen at start-up for device collectives (`moeserve.parallel.comm`; None: plain
    torch.distributed on `group`); `cpu_group`: a gloo group for host-side start-up
    collectives (None: `group`). `expert_parallel`: routed experts are whole per rank
    instead of split along their intermediate dimension.
    """

    rank: int = 0
    size: int = 1
    group: Any = None
    expert_parallel: bool = False
    comm: Any = None
    cpu_group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        if self.comm is not None:
            return self.comm.all_reduce(x)
        dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rmsnorm(sum_ranks(x) + residual) * weight, sum_ranks(x) + residual): the sum of
        this rank's partial output, the residual add and the next norm, in one fused
        collective where the communicator has one."""
        if self.comm is not None and self.size > 1:
            return self.comm.all_reduce_add_rmsnorm(x, residual, weight, eps)
        r = self.all_reduce(x) + residual
        return F.rms_norm(r, (r.shape[-1],), weight, eps), r

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.size == 1:
            return x
        if self.comm is not None:
            return self.comm.all_gather(x, dim)
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def min_int(self, value: int) -> int:
        """The smallest `value` over the group (a host-side start-up collective)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group or self.group)
        return int(t.item())

    def shard(self, n: int) -> int:
        """Size of this rank's slice of a dimension of `n` (must divide evenly)."""
        if n % self.size:
            raise ValueError(f"dimension {n} does not split over {self.size} ranks")
        return n // self.size

    def shard_experts(self, num_experts: int) -> int:
        """Experts per rank under expert parallelism (must divide evenly)."""
        if num_experts % self.size:
            raise ValueError(
                f"{num_experts} routed experts do not split over {self.size} expert-parallel ranks"
            )
        return num_experts // self.size


SINGLE = TPGroup()
