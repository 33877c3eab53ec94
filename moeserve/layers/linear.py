"""Linear layers with tensor-parallel slicing and per-parameter weight loaders.

The quant method creates a layer's parameters; the layer attaches `weight_loader`, which
knows this rank's slice and, for fused layers (q/k/v, gate/up), where each checkpoint shard
goes. The loader only maps checkpoint names to (parameter, shard id).
"""

from __future__ import annotations

import torch
from torch import nn

from moeserve.layers.kernel_plan import KernelPlan, LinearKernels
from moeserve.layers.quant.base import (
    NoQuant,
    QuantConfig,
    check_block_split,
    make_param,
    materialize,
)
from moeserve.parallel.groups import SINGLE, TPGroup

ShardId = str | int | None


class LinearBase(nn.Module):
    """y = x W^T (+ b), W's logical shape [output_size, input_size] (full, unsharded)."""

    split_output = False
    split_input = False
    # what the quant methods attach for their kernels (None until they do)
    native_weight = None  # the weight packed for the native CPU kernels
    w16_workspace = None  # the 16-bit split-K GEMV's static workspace (CUDA graphs)
    splitk_workspace = None  # the quantized GEMMs' shared split-K workspace (CUDA graphs)
    nvfp4_kernel_args = None  # (packed, scale, global [1], plan) of the NVFP4 kernels

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        *,
        bias: bool = False,
        quant: QuantConfig | None = None,
        prefix: str = "",
        tp: TPGroup = SINGLE,
        dtype: torch.dtype = torch.float32,
        reduce_results: bool = True,
    ) -> None:
        """`reduce_results=False` (row-parallel): return this rank's partial sum; the caller
        all-reduces (fused with the residual add and the next norm)."""
        super().__init__()
        self.tp = tp
        self.reduce_results = reduce_results
        self.prefix = prefix
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.output_size = sum(output_sizes)
        self.local_input = tp.shard(input_size) if self.split_input else input_size
        self.local_outputs = self._local_output_sizes()
        self.local_output = sum(self.local_outputs)
        self.method = (quant or NoQuant()).linear_method(prefix)
        self.kernels = LinearKernels()  # the kernel plan's (use_kernel_plan, before loading)
        self.method.create_weights(self, self.local_input, self.local_output, dtype)
        if bias:
            self.bias = make_param(torch.zeros(self.local_output, dtype=dtype), 0, None)
        else:
            self.bias = None
        for p in self.parameters(recurse=False):
            p.weight_loader = self.weight_loader
            if self.split_output and p.output_dim is not None:
                for n in self.local_outputs:
                    check_block_split(prefix, n, p.output_block, tp.size)
            if self.split_input and p.input_dim is not None:
                check_block_split(prefix, self.local_input, p.input_block, tp.size)

    # ---- sharding ------------------------------------------------------------------------
    def _local_output_sizes(self) -> list[int]:
        if not self.split_output:
            return self.output_sizes
        return [self.tp.shard(n) for n in self.output_sizes]

    def _shard_index(self, shard_id: ShardId) -> int:
        if shard_id is None:
            return 0
        return int(shard_id)

    def _source_chunk(self, shard_id: ShardId) -> tuple[int, int]:
        """Which of how many equal chunks of the checkpoint tensor (along outputs) is ours."""
        return (self.tp.rank, self.tp.size) if self.split_output else (0, 1)

    def weight_loader(self, param: nn.Parameter, w: torch.Tensor, shard_id: ShardId = None) -> None:
        i = self._shard_index(shard_id)
        if getattr(param, "per_shard", False):  # one value per fused shard (e.g. FP4 global)
            param.data[i].copy_(materialize(w).reshape(()))
            return
        if param.output_dim is None and param.input_dim is None:
            param.data.copy_(materialize(w).reshape(param.shape))
            return
        if param.output_dim is not None:
            d = param.output_dim
            idx, cnt = self._source_chunk(shard_id)
            n = w.shape[d] // cnt
            w = w.narrow(d, idx * n, n)
            offset = sum(self.local_outputs[:i]) // param.output_block
            dst = param.data.narrow(d, offset, w.shape[d])
        else:
            dst = param.data
        if self.split_input and param.input_dim is not None:
            d = param.input_dim
            n = w.shape[d] // self.tp.size
            w = w.narrow(d, self.tp.rank * n, n)
        w = materialize(w)
        if dst.shape != w.shape:
            raise ValueError(
                f"{self.prefix}: checkpoint tensor {tuple(w.shape)} does not fit {tuple(dst.shape)}"
            )
        dst.copy_(w)

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    def use_kernel_plan(self, plan: KernelPlan) -> None:
        self.kernels = plan.linears

    # the plan's switches, as the quant methods read them
    @property
    def gpu_kernels(self) -> bool:
        """Triton kernels on the stored (quantized) format."""
        return self.kernels.stored_format

    @property
    def native_cpu(self) -> bool:
        return self.kernels.native_cpu

    @property
    def batch_invariant(self) -> bool:
        """--deterministic schedules."""
        return self.kernels.invariant

    @property
    def pdl(self) -> bool:
        """GEMV kernels launch with programmatic dependent launch."""
        return self.kernels.pdl

    @property
    def dense_gemv(self) -> bool:
        """16-bit weights: decode rows by the split-K GEMV."""
        return self.kernels.dense_gemv

    def prepare_cuda_graph(self, max_tokens: int, max_context: int, shared: dict) -> None:
        self.method.prepare_cuda_graph(self, max_tokens, shared)

    # ---- compute -------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x)
        if self.split_input and self.reduce_results:
            y = self.tp.all_reduce(y)
        if self.bias is not None and (
            self.reduce_results or not self.split_input or self.tp.rank == 0
        ):
            y = y + self.bias  # a partial sum carries the bias on one rank only
        return y


class ReplicatedLinear(LinearBase):
    """Full weight on every rank."""

    def __init__(self, input_size: int, output_size: int, **kw) -> None:
        super().__init__(input_size, [output_size], **kw)


class MergedReplicatedLinear(LinearBase):
    """Replicated layers over one input fused along outputs (MLA's q_a + kv_a): shard ids 0,
    1, ... Scalar parameters load one value per shard, then become the one scalar the kernels
    take: equal values as they are; NVFP4 weight globals that differ (separately quantized
    layers) as shard 0's, with shard i's output columns scaled by global_i / global_0 (exact
    to fp32 rounding); optional activation scales (weight-only kernels ignore them) as their
    maximum."""

    def __init__(self, input_size: int, output_sizes: list[int], **kw) -> None:
        super().__init__(input_size, output_sizes, **kw)
        for name, p in list(self.named_parameters(recurse=False)):
            if p.output_dim is None and p.input_dim is None and p.numel() == 1:
                q = make_param(p.data.new_zeros(len(output_sizes), *p.shape), None, None)
                q.per_shard, q.optional = True, getattr(p, "optional", False)
                q.weight_loader = self.weight_loader
                setattr(self, name, q)
        self.register_buffer("shard_scale", None, persistent=False)  # [out] fp32 or None

    def process_weights_after_loading(self) -> None:
        params = self.named_parameters(recurse=False)
        per_shard = [(n, p) for n, p in params if getattr(p, "per_shard", False)]
        for name, p in per_shard:
            value = p.data.amax(0) if p.optional else p.data[0]
            if not p.optional and not bool((p == p[:1]).all()):
                self.shard_scale = self._global_ratios(name, p.data)
            q = make_param(value.clone(), None, None)
            q.optional, q.weight_loader = p.optional, p.weight_loader
            setattr(self, name, q)
        super().process_weights_after_loading()

    def _global_ratios(self, name: str, values: torch.Tensor) -> torch.Tensor:
        scheme = getattr(self.method, "scheme", None)
        t = {s: getattr(self, s) for s in getattr(self, "scheme_suffixes", ())}
        if scheme is None or scheme.nvfp4_view(t) is None:
            raise ValueError(f"{self.prefix}: merged shards hold different {name}")
        g = [scheme.nvfp4_view({**t, name: v})[2].float().reshape(()) for v in values]
        sizes = self.local_outputs
        return torch.cat([(gi / g[0]).expand(n) for gi, n in zip(g, sizes, strict=True)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shard_scale is None:
            return super().forward(x)
        y = self.method.apply(self, x).mul_(self.shard_scale)
        return y if self.bias is None else y + self.bias


class ColumnParallelLinear(LinearBase):
    """Outputs split over ranks; no communication."""

    split_output = True

    def __init__(self, input_size: int, output_size: int, **kw) -> None:
        super().__init__(input_size, [output_size], **kw)


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel layers fused along outputs (gate+up): shard ids 0, 1, ..."""

    split_output = True


class RowParallelLinear(LinearBase):
    """Inputs split over ranks; outputs all-reduced."""

    split_input = True

    def __init__(self, input_size: int, output_size: int, **kw) -> None:
        super().__init__(input_size, [output_size], **kw)


class QKVParallelLinear(LinearBase):
    """q, k, v fused; shard ids "q", "k", "v". KV heads are replicated when tp > kv heads."""

    split_output = True
    _ORDER = {"q": 0, "k": 1, "v": 2}

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, **kw
    ) -> None:
        tp: TPGroup = kw.get("tp", SINGLE)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.kv_replicas = max(1, tp.size // num_kv_heads)
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        self.head_dim = head_dim
        super().__init__(hidden_size, sizes, **kw)

    def _local_output_sizes(self) -> list[int]:
        tp = self.tp
        local_kv = max(1, self.num_kv_heads // tp.size) * self.head_dim
        return [tp.shard(self.num_heads) * self.head_dim, local_kv, local_kv]

    def _shard_index(self, shard_id: ShardId) -> int:
        return self._ORDER[shard_id] if isinstance(shard_id, str) else int(shard_id or 0)

    def _source_chunk(self, shard_id: ShardId) -> tuple[int, int]:
        if self._shard_index(shard_id) == 0:
            return self.tp.rank, self.tp.size
        chunks = self.tp.size // self.kv_replicas
        return self.tp.rank // self.kv_replicas, chunks
