"""What a request carries to the engine for each image: its patches, their grid, where its
placeholder tokens sit in the prompt and a hash of its content (no model code here)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

HASH_BYTES = 16
# image positions enter the prefix-cache hash as negative values (token ids are >= 0), drawn
# from the image's content hash: two different images never share cache pages
_HASH_VALUE_BITS = 62


@dataclass(eq=False)
class ImageInput:
    pixels: torch.Tensor  # float32 [patches, 3, patch, patch], normalised
    grid: tuple[int, int, int]  # (frames, patch rows, patch columns)
    num_tokens: int  # placeholder tokens (one per merged block of patches)
    digest: bytes  # hash of the preprocessed content
    offset: int = -1  # prompt index of its first placeholder token (set by the expansion)

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens

    def hash_value(self, k: int) -> int:
        """The value its k-th placeholder position contributes to prefix-cache hashes."""
        h = int.from_bytes(self.digest[:8], "little") ^ k
        return -1 - (h & ((1 << _HASH_VALUE_BITS) - 1))


def content_digest(data: np.ndarray, grid: tuple[int, int, int]) -> bytes:
    """A hash naming an image's content: `data` holds what its patches are computed from."""
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    h.update(repr(grid).encode())
    h.update(memoryview(np.ascontiguousarray(data)).cast("B"))
    return h.digest()
