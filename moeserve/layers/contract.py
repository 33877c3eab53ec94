"""The contracts between the layers, the models and the engine, as runtime-checkable protocols.

The loader, the runner and the CUDA-graph code talk to a model and its modules only through
these: a module that implements a protocol's methods is an instance of it (`isinstance(m,
ProcessesWeights)`), so no caller asks for a hook by name.

- `UsesKernelPlan`: takes the kernel plan once, before any weight is read (defined beside the
  plan, `moeserve.layers.kernel_plan`, and `apply_kernel_plan` that hands it out);
- `ProcessesWeights`: prepares what its kernels need once every tensor is in
  (`moeserve.models.weights.finish_loading`);
- `GraphCapturable` / `PreparesCudaGraph`: whether decode through it can be captured in a CUDA
  graph, and the static scratch it allocates before capture (engine/cuda_graphs.py);
- `KVCacheLayer`: the per-layer paged-cache contract the runner sizes and binds;
- `CausalLM`: the model surface the runner uses; `DraftModel`: a draft model's (DeepSeek's MTP
  module through its target, an EAGLE-3 head); `VisionLanguageModel`: a model that may hold a
  vision encoder (`vision` is None where it holds none);
- `MoELayerHook`: a tensor-parallel group that installs something on each MoE layer built
  with it (the rank simulation of benchmarks, `moeserve.parallel.simulated`);
- `RoutingOverride`: what such a hook installs: the router's expert ids replaced.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

from moeserve.layers.kernel_plan import UsesKernelPlan

if TYPE_CHECKING:
    from moeserve.config import ModelConfig
    from moeserve.layers.attention.metadata import ForwardContext

__all__ = [
    "CausalLM",
    "DraftModel",
    "GraphCapturable",
    "KVCacheLayer",
    "MoELayerHook",
    "PreparesCudaGraph",
    "ProcessesWeights",
    "RoutingOverride",
    "UsesKernelPlan",
    "VisionLanguageModel",
]


@runtime_checkable
class ProcessesWeights(Protocol):
    def process_weights_after_loading(self) -> None:
        """Repack or probe the loaded weights for the kernels the plan chose."""


@runtime_checkable
class GraphCapturable(Protocol):
    supports_cuda_graph: bool  # decode through this module can be captured


@runtime_checkable
class PreparesCudaGraph(Protocol):
    def prepare_cuda_graph(self, max_batch: int, max_context: int, shared: dict) -> None:
        """Allocate the static scratch of graph capture (buffers layers of a kind share go
        into `shared`)."""


@runtime_checkable
class KVCacheLayer(Protocol):
    def kv_cache_bytes_per_token(self, dtype: torch.dtype) -> int: ...

    def bind_kv_cache(
        self, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device | str
    ) -> None: ...

    def cache_tensors(self) -> list[torch.Tensor]:
        """The cache tensors bound (empty before `bind_kv_cache`)."""


@runtime_checkable
class CausalLM(Protocol):
    config: ModelConfig

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """input ids [T], positions [T] -> hidden states [T, H]."""

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """[N, H] -> fp32 logits [N, vocab] (into `out` when given)."""

    def attention_layers(self) -> Sequence[KVCacheLayer]: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Route (checkpoint name, tensor) pairs to their parameters; the names loaded."""


@runtime_checkable
class DraftModel(Protocol):
    def forward_draft(
        self, ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden for the LM head, hidden for the next draft step)."""


@runtime_checkable
class VisionLanguageModel(Protocol):
    vision: torch.nn.Module | None


@runtime_checkable
class RoutingOverride(Protocol):
    def ids(self, router_ids: torch.Tensor) -> torch.Tensor:
        """The expert ids the layer's experts receive instead of the router's."""


@runtime_checkable
class MoELayerHook(Protocol):
    def install_on_moe_layer(self, moe: torch.nn.Module) -> None:
        """Called once by every MoE layer built with this group, in build order."""
