"""Errors shared across layers (imported downward by the loaders and the tokenizers)."""

from __future__ import annotations


class LoadError(ValueError):
    """A model path or checkpoint that cannot be loaded (one clear sentence)."""
