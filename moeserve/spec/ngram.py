"""Prompt lookup ("ngram"): draft what followed an earlier occurrence of the sequence's tail.

The tail of the sequence (prompt + accepted output) is looked up as an n-gram, longest n first
in `prompt_lookup_max`..`prompt_lookup_min`; the draft is the tokens that followed the MOST
RECENT earlier occurrence of that n-gram. Recent text is the better predictor in the repetitive
workloads this method is for (edits of code or documents the prompt quotes, where later copies
carry the latest changes), and keeping only the latest position makes the index an overwrite.

The index is kept incrementally, so a decode step costs the same at 100 tokens as at 100k: for
each n, a dict from an n-gram to the start of its latest occurrence that has a token after it.
Appending a token gives exactly one n-gram per n a follower (the one ending just before it), so
`extend` updates one entry per n per token, and `propose` does one lookup per n and copies the
draft. Memory is one entry per n per token of the request, freed by `finish`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # moeserve.config imports torch; proposers stay importable without it
    from moeserve.config import SpeculativeConfig


class _Request:
    __slots__ = ("tokens", "index")

    def __init__(self, num_sizes: int) -> None:
        self.tokens: list[int] = []
        # index[j]: n-gram of size prompt_lookup_min + j -> start of its latest occurrence
        # that is followed by at least one token (so a hit always yields a non-empty draft).
        self.index: list[dict[tuple[int, ...], int]] = [{} for _ in range(num_sizes)]


class NgramProposer:
    """Prompt-lookup drafts for running requests (see the module docstring for the rules)."""

    def __init__(
        self,
        prompt_lookup_min: int = 2,
        prompt_lookup_max: int = 5,
        num_speculative_tokens: int = 3,
    ) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                "prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max, "
                f"got {prompt_lookup_min} and {prompt_lookup_max}"
            )
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self.num_speculative_tokens = num_speculative_tokens
        self._sizes = tuple(range(prompt_lookup_min, prompt_lookup_max + 1))
        self._requests: dict[str, _Request] = {}

    @classmethod
    def from_config(cls, cfg: SpeculativeConfig) -> NgramProposer:
        return cls(
            prompt_lookup_min=cfg.prompt_lookup_min,
            prompt_lookup_max=cfg.prompt_lookup_max,
            num_speculative_tokens=cfg.num_speculative_tokens,
        )

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        """Index the prompt (the only call whose work grows with a length: the prompt's)."""
        req = _Request(len(self._sizes))
        self._requests[request_id] = req
        self._append(req, prompt_ids)

    def extend(self, request_id: str, new_ids: Sequence[int]) -> None:
        self._append(self._requests[request_id], new_ids)

    def propose(self, request_id: str, max_tokens: int) -> list[int]:
        """Up to min(`max_tokens`, num_speculative_tokens) tokens; [] when no n-gram recurs.

        The draft stops at the end of the known sequence: an occurrence that overlaps the tail
        proposes fewer tokens rather than guessing past what was seen.
        """
        req = self._requests[request_id]
        limit = min(max_tokens, self.num_speculative_tokens)
        if limit <= 0:
            return []
        tokens = req.tokens
        end = len(tokens)
        for n, table in zip(reversed(self._sizes), reversed(req.index), strict=True):
            # The tail itself is never in the table (nothing follows it yet), so a hit is a
            # strictly earlier occurrence; at least one token must precede the tail for that.
            if end <= n:
                continue
            start = table.get(tuple(tokens[end - n :]))
            if start is not None:
                follow = start + n
                return tokens[follow : min(follow + limit, end)]
        return []

    def finish(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def _append(self, req: _Request, new_ids: Sequence[int]) -> None:
        tokens = req.tokens
        sizes = self._sizes
        index = req.index
        for tok in new_ids:
            p = len(tokens)
            tokens.append(int(tok))
            # The n-gram ending just before position p now has a follower; a later occurrence
            # overwrites an earlier one, which is what keeps the most recent.
            for n, table in zip(sizes, index, strict=True):
                start = p - n
                if start < 0:
                    break  # sizes ascend, so the larger ones do not fit either
                table[tuple(tokens[start:p])] = start
