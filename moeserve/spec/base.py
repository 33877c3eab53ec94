"""The contract every host-side proposer keeps (no torch)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Proposer(Protocol):
    """Drafts for running requests, from their tokens alone.

    The engine calls `start` once when a request is admitted, `extend` with the tokens a step
    appended to its output (only accepted tokens ever reach a proposer), `propose` before a
    step in which the request decodes, and `finish` when it ends. Work per call grows with the
    new tokens and the draft, never with the sequence's length.
    """

    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None: ...

    def extend(self, request_id: str, new_ids: Sequence[int]) -> None: ...

    def propose(self, request_id: str, max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens continuing the request's sequence ([] for none)."""
        ...

    def finish(self, request_id: str) -> None: ...
