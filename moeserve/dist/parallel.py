"""Tensor-parallel group as an explicit object handed to layers (no process-wide globals)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in its tensor-parallel group and the collectives over it."""

    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup when size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def shard(self, n: int) -> int:
        """Size of this rank's slice of a dimension of `n` (must divide evenly)."""
        if n % self.size:
            raise ValueError(f"dimension {n} does not split over {self.size} ranks")
        return n // self.size


SINGLE = TPGroup()
