"""The latest greedy step's tokens on the device (overlap scheduling, draft steps, CUDA
graphs): the next step's placeholder ids (-1 - j: row j's token) name them, so that step is
queued before the host has seen them."""

from __future__ import annotations

import torch


class DeviceTokens:
    """Where the latest greedy step's tokens are, and what each reader of them last read.

    `latest`: the tokens of the latest greedy step (the sampler's argmax, or a graph replay's
    own). `graph`: the fixed buffer a captured decode step reads placeholder tokens from and
    writes its greedy tokens to (a graph reads one address); `graph_holds`: the tokens it holds
    a copy of (None: a replay's own, or none). `graph_fed`: a replay's copy of `graph` as the
    replay found it (its own tokens then replace them). `fed`: the tokens the latest step's
    placeholders were resolved from, which an eager rerun of that step (profiling) resolves
    them from again."""

    def __init__(self, device: torch.device | str = "cpu", graph_rows: int = 1) -> None:
        self.latest = torch.zeros(1, dtype=torch.int64, device=device)
        self.graph = torch.zeros(graph_rows, dtype=torch.int64, device=device)
        self.graph_holds: torch.Tensor | None = None
        self.graph_fed = torch.zeros_like(self.graph)
        self.fed = self.latest

    def source(self, eager: bool) -> torch.Tensor:
        """The tokens a step's placeholders name: the latest greedy step's, or for an eager
        rerun of the latest step the ones that step was fed."""
        return self.fed if eager else self.latest

    def hold_in_graph(self, tokens: torch.Tensor) -> bool:
        """Make `graph` hold `tokens` (copied unless it already does); False when they do
        not fit."""
        if tokens is self.graph_holds:
            return True
        n = tokens.numel()
        if n > self.graph.numel():
            return False
        self.graph[:n].copy_(tokens)
        self.graph_holds = tokens
        return True

    def fed_to_step(self, tokens: torch.Tensor, in_graph: bool) -> None:
        """Keep what the latest step's placeholders were resolved from, for an eager rerun,
        where nothing rewrites it: a replay's own copy (`in_graph`), or a copy of tokens that
        live in the buffer replays rewrite."""
        if in_graph:
            self.fed = self.graph_fed
        else:
            self.fed = tokens.clone() if tokens._base is self.graph else tokens

    def feed_graph(self) -> torch.Tensor:
        """Inside a captured decode step: `graph` copied as the replay finds it, the tokens
        its placeholders name."""
        self.graph_fed.copy_(self.graph)
        return self.graph_fed

    def replayed(self) -> None:
        """A replay wrote its own greedy tokens over `graph`."""
        self.graph_holds = None

    def adopt_replay(self, rows: int) -> torch.Tensor:
        """The latest replay's greedy tokens of its first `rows` rows (in `graph`) become the
        latest greedy step's."""
        tokens = self.graph[:rows]
        self.latest = tokens
        self.graph_holds = tokens
        return tokens
