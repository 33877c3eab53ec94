"""The serving engine: `LLMEngine` (core.py) schedules, executes and samples steps on one
rank or a tensor-parallel group (worker.py starts the ranks); `AsyncEngine`
(async_engine.py) serves it to an asyncio front end; `LLM` (offline.py) generates in batch.

The entry points below are imported on first use: the HTTP layer imports `errors` and
`outputs` from this package without loading torch and the model stack.
"""

from __future__ import annotations

import importlib
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moeserve.engine.async_engine import AsyncEngine, build_async_engine
    from moeserve.engine.core import LLMEngine, build_engine
    from moeserve.engine.offline import LLM, Completion

_HOMES = MappingProxyType(
    {
        "AsyncEngine": "moeserve.engine.async_engine",
        "build_async_engine": "moeserve.engine.async_engine",
        "LLMEngine": "moeserve.engine.core",
        "build_engine": "moeserve.engine.core",
        "LLM": "moeserve.engine.offline",
        "Completion": "moeserve.engine.offline",
    }
)


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


__all__ = ["LLM", "AsyncEngine", "Completion", "LLMEngine", "build_async_engine", "build_engine"]
