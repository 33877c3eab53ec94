"""Vocab-parallel embedding and LM head."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from moeserve.kernels import cpu as cpu_kernels
from moeserve.kernels.gemm import invariant as invariant_kernels
from moeserve.layers.quant.base import LinearMethod, make_param, materialize
from moeserve.parallel.groups import SINGLE, TPGroup

if TYPE_CHECKING:
    from moeserve.layers.kernel_plan import KernelPlan


class VocabParallelEmbedding(nn.Module):
    """Rows of the vocabulary split over ranks; out-of-range ids contribute zeros."""

    def __init__(
        self, vocab_size: int, hidden: int, tp: TPGroup = SINGLE, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // tp.size)
        self.start = tp.rank * self.per_rank
        self.weight = make_param(torch.empty(self.per_rank, hidden, dtype=dtype), 0, None)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, w: torch.Tensor, shard_id: object = None) -> None:
        rows = materialize(w[self.start : self.start + self.per_rank])
        param.data[: rows.shape[0]].copy_(rows)
        param.data[rows.shape[0] :].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        valid = (local >= 0) & (local < self.per_rank)
        out = F.embedding(local.clamp(0, self.per_rank - 1), self.weight)
        out = out * valid.unsqueeze(-1).to(out.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """logits = h W^T over this rank's vocab slice, gathered to the full vocabulary (fp32).

    `method`: an optional weight-only quant method for the head's matmul (the head is the
    largest single matrix of small models; a tied embedding keeps its float rows for lookup).
    """

    native_weight = None  # the head packed for the native CPU kernels (a plain bf16 head)

    def __init__(self, *args, method: LinearMethod | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.method = method
        self.native_cpu = False  # the native CPU kernels (the kernel plan)
        self.batch_invariant = False  # --deterministic: the batch-invariant GEMM on GPUs

    def use_kernel_plan(self, plan: KernelPlan) -> None:
        self.native_cpu = plan.cpu_native
        self.batch_invariant = plan.invariant

    def process_weights_after_loading(self) -> None:
        """A weight-only method repacks itself (for the native CPU kernels where they serve);
        a plain bf16 head gets a packed copy for them (a tied embedding keeps its rows for
        lookups)."""
        if self.method is not None:
            self.method.process_weights_after_loading(self)
            return
        w = self.weight
        if self.native_cpu and w.dtype == torch.bfloat16 and w.shape[1] % 2 == 0:
            self.native_weight = cpu_kernels.pack_bf16(w.data)

    def compute_logits(self, h: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits [T, vocab_size] (the head's methods take an output dtype). `out`: a
        preallocated fp32 [T, vocab_size] to write them into (a CUDA graph's static buffer):
        on one rank the matmul's result is converted straight into it, no extra copy."""
        if self.method is not None:
            logits = self.method.apply(self, h, out_dtype=torch.float32)
        elif self.native_weight is not None:
            logits = cpu_kernels.linear(h, self.native_weight, torch.float32)
        elif self.batch_invariant and h.is_cuda:
            logits = invariant_kernels.gemm16(h, self.weight, torch.float32)
        else:
            logits = F.linear(h, self.weight)
            if out is None or self.tp.size > 1:
                logits = logits.float()
        logits = self.tp.all_gather(logits, dim=-1)[..., : self.vocab_size]
        if out is None:
            return logits
        return out.copy_(logits)
