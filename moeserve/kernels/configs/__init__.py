"""Tile configurations chosen offline (benchmarks/kernels_gemm_moe.py on an H200), read at import.

`tiles.json` maps kernel -> shape key ("NxK", or "E:NxK" for MoE) -> a list of entries
`{"max_m": int, ...tile params}` sorted by max_m; the first entry with m <= max_m wins, else the
last one. A missing shape uses the kernel's "default" list. No autotuning happens at serve time.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import MappingProxyType
from typing import Any

_TILES_PATH = Path(__file__).with_name("tiles.json")


def _freeze(obj: Any) -> Any:
    if isinstance(obj, dict):
        return MappingProxyType({k: _freeze(v) for k, v in obj.items()})
    if isinstance(obj, list):
        return tuple(_freeze(v) for v in obj)
    return obj


TILE_CONFIGS = _freeze(json.loads(_TILES_PATH.read_text()))


def tile_config(kernel: str, m: int, shape_key: str) -> dict[str, int]:
    """The tile parameters for `kernel` at row count m and weight shape `shape_key` (a copy)."""
    table = TILE_CONFIGS[kernel]
    entries = table.get(shape_key, table["default"])
    for entry in entries:
        if m <= entry["max_m"]:
            return {k: v for k, v in entry.items() if k != "max_m"}
    return {k: v for k, v in entries[-1].items() if k != "max_m"}


def max_rows(kernel: str, shape_key: str) -> int:
    """The largest row count that `kernel`'s table covers for this shape (its last max_m)."""
    table = TILE_CONFIGS[kernel]
    return max(e["max_m"] for e in table.get(shape_key, table["default"]))


def min_rows(kernel: str, shape_key: str) -> int:
    """The smallest row count from which `kernel` is used (its table's min_m)."""
    table = TILE_CONFIGS[kernel]
    return min(e["min_m"] for e in table.get(shape_key, table["default"]))
