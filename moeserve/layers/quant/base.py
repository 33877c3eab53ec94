"""Quantization methods: how a layer's weights are created, loaded and applied.

Adding a checkpoint format = a `QuantConfig` (which method for which layer, from the
checkpoint's own description) + a `LinearMethod`/`MoEMethod`; model code never changes.

Parameter contract: every parameter a method creates carries
  - `weight_loader(param, tensor, shard_id=None)` (set by the owning layer), and
  - `output_dim` / `input_dim`: which axes are split by tensor parallelism (None: replicated),
  - `output_block` / `input_block`: how many logical rows/cols one stored row/col covers
    (1 for plain weights and per-16 FP4 scales along K use `input_block=16`; packed FP4
    codes use `input_block=2`; block-FP8 scales use 128 on both).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from moeserve.config import ConfigError
from moeserve.kernels import cpu as cpu_kernels
from moeserve.kernels.gemm import invariant as invariant_kernels
from moeserve.kernels.gemm import w16_gemv as w16_kernels


def make_param(
    data: torch.Tensor,
    output_dim: int | None = 0,
    input_dim: int | None = 1,
    output_block: int = 1,
    input_block: int = 1,
) -> nn.Parameter:
    """A frozen parameter annotated with how tensor parallelism and shards slice it."""
    p = nn.Parameter(data, requires_grad=False)
    p.output_dim = output_dim
    p.input_dim = input_dim
    p.output_block = output_block
    p.input_block = input_block
    return p


def check_block_split(what: str, local: int, block: int, ranks: int) -> None:
    """A tensor-parallel slice must hold whole quantization blocks (block-FP8: 128), or two
    ranks would share a block's scale; say so in one sentence."""
    if ranks > 1 and block > 1 and local % block:
        raise ConfigError(
            f"{what}: {local} features per rank over {ranks} ranks is not a multiple of the "
            f"checkpoint's {block}-wide quantization blocks; use a tensor-parallel size that "
            "keeps blocks whole"
        )


def materialize(w: torch.Tensor) -> torch.Tensor:
    """A checkpoint tensor as data. Loaders may hand weight loaders lazy slices (objects with
    `shape`, `narrow`, `select`, `[...]` and `materialize()`) so that each rank reads only
    its part of a tensor from disk; slicing stays lazy until the copy."""
    m = getattr(w, "materialize", None)
    return m() if m is not None else w


def copy_loader(param: nn.Parameter, w: torch.Tensor, shard_id: object = None) -> None:
    """`weight_loader` of a replicated parameter: the checkpoint tensor as it is."""
    param.data.copy_(materialize(w).reshape(param.shape))


class LinearMethod(ABC):
    """Creates and applies the weights of one linear layer y = x W^T (+ b)."""

    @abstractmethod
    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype
    ) -> None:
        """Register parameters on `layer` for this rank's [output_size, input_size] slice."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x [T, input_size] -> [T, output_size] (no bias)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Repack loaded weights for the kernels of this device (optional)."""
        return None

    def prepare_cuda_graph(self, layer: nn.Module, max_tokens: int, shared: dict) -> None:
        """Allocate static scratch for CUDA-graph capture of up to `max_tokens` rows; buffers
        that every layer can share go into `shared` (optional)."""
        return None


class UnquantizedLinearMethod(LinearMethod):
    """Dense weights in the model dtype."""

    def create_weights(
        self, layer: nn.Module, input_size: int, output_size: int, dtype: torch.dtype
    ) -> None:
        layer.weight = make_param(torch.empty(output_size, input_size, dtype=dtype))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = layer.weight
        if (
            getattr(layer, "native_cpu", False)
            and w.dtype == torch.bfloat16
            and w.shape[1] % 2 == 0
        ):
            # the packed copy serves the matmul; `weight` stays for readers of the dense matrix
            layer.native_weight = cpu_kernels.pack_bf16(w.data)

    def apply(self, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        packed = getattr(layer, "native_weight", None)
        if packed is not None:
            return cpu_kernels.linear(x, packed)
        if x.is_cuda and layer.batch_invariant:
            return invariant_kernels.gemm16(x.reshape(-1, x.shape[-1]), layer.weight).view(
                *x.shape[:-1], -1
            )
        if x.is_cuda and getattr(layer, "dense_gemv", False):
            rows = x.reshape(-1, x.shape[-1])
            if w16_kernels.w16_gemv_supported(rows, layer.weight):  # decode rows: split-K GEMV
                ws = getattr(layer, "w16_workspace", None)
                y = w16_kernels.w16_gemv(rows, layer.weight, workspace=ws)
                return y.view(*x.shape[:-1], -1)
        return torch.nn.functional.linear(x, layer.weight)

    def prepare_cuda_graph(self, layer: nn.Module, max_tokens: int, shared: dict) -> None:
        """The decode GEMV's split-K workspace, one per weight shape (the layers' calls run
        one after another on one stream, so they share it)."""
        w = layer.weight
        if getattr(layer, "dense_gemv", False) and w.is_cuda:
            if not w16_kernels.w16_gemv_rows(*w.shape):
                return  # cuBLAS serves this shape
            key = ("w16_gemv", *w.shape)
            if key not in shared:
                shared[key] = w16_kernels.W16Workspace.for_shape(w.shape[0], w.shape[1], w.device)
            layer.w16_workspace = shared[key]


class QuantConfig(ABC):
    """A checkpoint's quantization scheme: picks a method for each layer by its name."""

    name: str = "none"

    @abstractmethod
    def linear_method(self, prefix: str) -> LinearMethod:
        """The method for the linear layer called `prefix` in the checkpoint."""

    def lm_head_method(self) -> LinearMethod | None:
        """A method for the LM head's matmul (None: plain matmul in the model dtype); its
        `apply` takes `out_dtype` (the head asks for fp32 logits)."""
        return None

    def moe_method(self, prefix: str) -> object | None:
        """The method for the routed experts under `prefix` (None: unquantized)."""
        return None


class NoQuant(QuantConfig):
    name = "none"

    def linear_method(self, prefix: str) -> LinearMethod:
        return UnquantizedLinearMethod()
