"""Multi-head (GQA) attention over a paged KV cache.

Cache contract: `k_cache`, `v_cache` each [num_pages, page_size, num_kv_heads, head_dim];
token t of a sequence lives at page block_table[t // page_size], offset t % page_size.

The layer stores the step's K and V rows; its backend (`mha_backends.py`, chosen by the
kernel plan: the native CPU kernel, torch's SDPA, or torch's batch-invariant form) attends.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from moeserve.layers.attention.metadata import ForwardContext
from moeserve.layers.attention.mha_backends import InvariantTorchMHA, MHABackend, TorchMHA

if TYPE_CHECKING:
    from moeserve.layers.kernel_plan import KernelPlan


class PagedAttention(nn.Module):
    # decode slices the cache by host-side sequence lengths: not capturable in a CUDA graph
    supports_cuda_graph = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # the plan's backend, and the one serving the bound cache (`MHABackend.for_cache`)
        self.planned: MHABackend = TorchMHA(self)
        self.backend: MHABackend = self.planned

    def use_kernel_plan(self, plan: KernelPlan) -> None:
        self.use_backend(plan.mha)

    def use_backend(self, cls: type[MHABackend]) -> None:
        """Attend through `cls` (the kernel plan's choice, or a test's)."""
        self.planned = cls(self)
        bound = self.k_cache.numel() > 0
        self.backend = self.planned.for_cache(self.k_cache.dtype) if bound else self.planned

    @property
    def batch_invariant(self) -> bool:
        """Each query row gets the same arithmetic alone or in any batch, chunk or
        prefix-cache split (torch's batch-invariant form)."""
        return isinstance(self.backend, InvariantTorchMHA)

    @batch_invariant.setter
    def batch_invariant(self, on: bool) -> None:
        self.use_backend(InvariantTorchMHA if on else TorchMHA)

    # ---- cache contract used by the runner ------------------------------------------------
    def kv_cache_bytes_per_token(self, dtype: torch.dtype) -> int:
        return 2 * self.num_kv_heads * self.head_dim * dtype.itemsize

    def bind_kv_cache(
        self, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        shape = (num_pages, page_size, self.num_kv_heads, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.backend = self.planned.for_cache(dtype)

    def cache_tensors(self) -> list[torch.Tensor]:
        return [self.k_cache, self.v_cache] if self.k_cache.numel() else []

    # ---- compute ---------------------------------------------------------------------------
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] (new tokens) -> [T, H, D]. The step's rows are stored,
        then the backend attends."""
        md = ctx.attn
        kf = self.k_cache.view(-1, self.num_kv_heads, self.head_dim)
        vf = self.v_cache.view(-1, self.num_kv_heads, self.head_dim)
        kf.index_copy_(0, md.slot_mapping, k if k.dtype == kf.dtype else k.to(kf.dtype))
        vf.index_copy_(0, md.slot_mapping, v if v.dtype == vf.dtype else v.to(vf.dtype))
        return self.backend.attend(q, k, v, md)
