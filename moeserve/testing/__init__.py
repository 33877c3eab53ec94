"""Tiny checkpoints in the published layouts, for tests and demos."""
