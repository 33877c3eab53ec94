"""Encoder outputs by image content: an image whose prompt is prefilled in several chunks,
or sent again, is encoded once while its output stays here."""

from __future__ import annotations

from collections import OrderedDict

import torch

# what the cache may hold, on the device beside the KV cache (inside the memory budget's
# headroom): at Kimi-K2.5's width (7168, bf16) a 1024 x 1024 image is 1,369 tokens, ~19 MiB,
# so this keeps ~13 such images, enough for the images of the prompts in prefill at once
DEFAULT_ENCODER_CACHE_BYTES = 256 << 20


class EncoderCache:
    """Least recently used first out, bounded in bytes."""

    def __init__(self, max_bytes: int = DEFAULT_ENCODER_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._items: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: bytes) -> torch.Tensor | None:
        out = self._items.get(key)
        if out is None:
            self.misses += 1
            return None
        self.hits += 1
        self._items.move_to_end(key)
        return out

    def put(self, key: bytes, value: torch.Tensor) -> None:
        if key in self._items:
            return
        size = value.numel() * value.element_size()
        while self._items and self.bytes + size > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.bytes -= old.numel() * old.element_size()
        self._items[key] = value
        self.bytes += size

    def __len__(self) -> int:
        return len(self._items)
