"""What the runner's start-up and capture parts (memory_profile, warm_up, graph_capture) use
of the `ModelRunner` they serve: a Protocol, so that they depend on it and not on runner.py,
which builds them."""

from __future__ import annotations

from typing import Protocol

import torch

from moeserve.config import EngineConfig
from moeserve.engine.images import ImageEncoding
from moeserve.engine.memory import MemoryPlan
from moeserve.engine.page_table import PageTable
from moeserve.engine.step import StepInput
from moeserve.loader.base import LoadedModel
from moeserve.parallel.groups import TPGroup
from moeserve.sampling import DeviceTokens, Sampler


class RunnerView(Protocol):
    config: EngineConfig
    loaded: LoadedModel
    model: torch.nn.Module
    draft: torch.nn.Module | None  # an EAGLE-3 head
    drafter: torch.nn.Module  # the head, or the target model (its MTP module)
    keep_hidden: bool
    device: torch.device
    tp: TPGroup
    page_size: int
    vocab_size: int
    vocab_limit: int
    max_rows: int
    max_model_len: int
    num_pages: int
    memory: MemoryPlan | None
    pages: PageTable
    images: ImageEncoding
    tokens: DeviceTokens
    sampler: Sampler

    def execute_model(self, step: StepInput) -> torch.Tensor | None: ...

    def kv_bytes_per_token(self) -> int: ...

    def bind_cache(self, num_pages: int) -> None: ...

    def cache_tensors(self) -> list[torch.Tensor]: ...
