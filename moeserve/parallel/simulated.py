"""Rank simulation: one device holds exactly rank 0's share of a tensor-parallel layout.

`--simulate-rank tpN` (or `tpN-ep`, with expert parallelism) builds the model with a
`SimulatedGroup`: a `TPGroup` of size N and rank 0 whose collectives do nothing. Every layer
then takes its rank-0 share exactly as a real N-rank deployment shapes it (heads / N, dense and
shared-expert intermediate / N, vocabulary / N, and E / N whole experts under EP, or every
expert's intermediate / N without), so the per-rank decode step of an N-GPU deployment can be
timed on one GPU; the benchmark adds the collectives' cost from their own measurement.

Collectives (`SimulatedCommunicator`): the all-reduce returns its input; the fused all-reduce
+ residual add + RMSNorm adds and norms locally (one launch on GPUs, the kernel every
communicator uses after its reduction) inside a profiler scope named like the decode
profiler's all-reduce row, so a benchmark can take that stand-in out and put the measured
all-reduce in; the all-gather returns the input repeated N times along the dimension (the LM
head's logits keep the full vocabulary width); the start-up minimum returns the value.

Routing under EP (`SimulatedRouting`). With random dummy weights the router spreads every
token's k slots uniformly over the E experts, so a rank receives k / N slots per token on
average; but a decode step lasts as long as its busiest rank (the all-reduce waits for it),
and a real rank 0 is the busiest only sometimes. So the simulated rank is given the busiest
rank's expected load instead of its own random one. The rule:

1. Sample the router's choice for a batch of T tokens: k distinct experts per token, chosen as
   the router chooses them on i.i.d. random scores (with DeepSeek's group limit where the
   config has one), Monte Carlo with a fixed seed, 2^15 token draws per T (at least 16
   batches).
2. In each sampled batch take the busiest rank: most (token, expert) slots, ties broken by
   more distinct experts touched. S*(T) = the mean of its slot count, D*(T) = the mean of its
   distinct experts. Slots set the activation traffic and the blocks the fused MoE schedules;
   distinct experts set the weight bytes read, the larger part of a decode step.
3. Every MoE layer routes each token to m_t of rank 0's experts and to k - m_t experts of other
   ranks (which the fused kernel skips, as it skips them on a real rank). The m_t add up to
   the layer's slot count S_j and differ by at most one between tokens; the slots walk
   cyclically over D_j experts spread evenly over rank 0's E / N, so a token's experts are
   distinct and different tokens touch different experts, each expert receiving S_j / D_j
   slots to within one. The router still runs (its cost is real); only its ids are replaced,
   by a table built once per token count (no kernel added to the step).
4. S* and D* are not integers. The j-th MoE layer built gets S_j = [(j+1) S*] - [j S*] slots
   ([x]: x rounded to the nearest integer), and D_j likewise from D*, clamped to what S_j
   slots over T tokens allow, so any run of consecutive layers averages S* and D* to within
   one slot per run (the step's total follows the expectation, which one rounded count per
   layer would miss by up to half a slot in every layer).

Kimi-K2.5 (E = 384, k = 8, N = 8: 48 experts per rank; a rank's mean load is T slots):
  T = 1:  S* = 2.58, D* = 2.58   (exactly 2.575; layers get 3, 2, 3, 2, 3, 2, 3, 3, ... slots)
  T = 8:  S* = 12.2, D* = 11.1
  T = 64: S* = 75.7, D* = 38.5   (an average rank touches 35.5 of its 48 experts)
`busiest_rank` computes them (the tests pin these figures). Without EP every rank holds a slice
of every expert and its load is the whole batch's: the router's own ids are kept.

Nothing here runs unless `--simulate-rank` is given: the MoE layer holds no routing override
otherwise (the simulated group installs it on each MoE layer built with it).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from functools import lru_cache

import torch
from torch.profiler import record_function

from moeserve.config import parse_rank_layout
from moeserve.parallel.groups import TPGroup

# The decode profiler's scope for the all-reduce row (engine/profile.py: its LABEL prefix and
# the component name): the local add + RMSNorm standing in for the fused all-reduce is
# reported there.
ALL_REDUCE_SCOPE = "moeserve::all-reduce"
ROUTING_SEED = 0
# Monte Carlo effort per token count: token draws in all, and the fewest sampled batches
DRAWS = 1 << 15
MIN_BATCHES = 16
_CHUNK_SCORES = 1 << 22  # random scores held at once


class SimulatedCommunicator:
    """The collectives of rank 0 of `size` ranks with no other rank: each returns what rank 0
    would hold afterwards in shape (not in value)."""

    name = "simulated"

    def __init__(self, size: int, device: torch.device | str = "cpu") -> None:
        # imported here: the communicators' module loads the device kernels
        from moeserve.parallel.comm import local_add_rmsnorm

        self.size = size
        self._add_rmsnorm, self._norm_name = local_add_rmsnorm(torch.device(device))

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_reduce_add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with record_function(ALL_REDUCE_SCOPE):
            return self._add_rmsnorm(x, residual, weight, eps)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat([x] * self.size, dim=dim)

    def describe(self) -> str:
        return (
            f"communicator: simulated ({self.size} ranks, no collectives; add + RMSNorm: "
            f"{self._norm_name})"
        )

    def check(self) -> None:
        pass


@dataclass(frozen=True)
class SimulatedGroup(TPGroup):
    """Rank 0 of `size` ranks alone (`comm`: a `SimulatedCommunicator`). `moe_layers` numbers
    the MoE layers built with this group, in build order (`SimulatedRouting.layer`)."""

    moe_layers: itertools.count = field(default_factory=itertools.count, compare=False)

    def min_int(self, value: int) -> int:
        return value

    def install_on_moe_layer(self, moe: object) -> None:
        """Under EP, give the MoE layer built next its routing override (`SimulatedRouting`,
        its place in the dithering sequence the build order); without EP the router's own
        ids stand. (`moeserve.layers.contract.MoELayerHook`: the layer calls this.)"""
        if not self.expert_parallel:
            return
        c = moe.cfg
        moe.routing_override = SimulatedRouting(
            c.n_routed_experts,
            c.num_experts_per_tok,
            self.size,
            next(self.moe_layers),
            c.n_group if c.grouped else 1,
            c.topk_group,
        )

    def describe(self) -> str:
        ep = " + EP" if self.expert_parallel else ""
        return (
            f"simulating rank 0 of {self.size} (TP{self.size}{ep}) on one device: rank 0's "
            "share of every layer, collectives skipped (benchmarks; outputs are not the model's)"
        )


def simulated_group(layout: str, device: torch.device | str = "cpu") -> SimulatedGroup:
    """The group of `--simulate-rank layout` (tpN or tpN-ep) on `device`."""
    size, ep = parse_rank_layout(layout)
    return SimulatedGroup(
        rank=0, size=size, expert_parallel=ep, comm=SimulatedCommunicator(size, device)
    )


# ---- routing ------------------------------------------------------------------------------
@dataclass(frozen=True)
class BusiestRank:
    """Expected load of the busiest of N ranks for one batch (see the module docstring)."""

    slots: float  # S*: (token, expert) slots on it
    distinct: float  # D*: distinct experts of it touched
    mean_slots: float  # a rank's mean: T k / N
    batches: int  # batches sampled


@lru_cache(maxsize=256)
def busiest_rank(
    num_experts: int,
    top_k: int,
    ranks: int,
    tokens: int,
    n_group: int = 1,
    topk_group: int = 1,
) -> BusiestRank:
    """S*(T) and D*(T) by Monte Carlo with a fixed seed: `tokens` tokens each choose `top_k`
    of `num_experts` experts as the router does on i.i.d. random scores (the best `topk_group`
    of `n_group` groups by their top-2 score sum, then the top k inside them); rank r holds
    experts [r E/N, (r+1) E/N)."""
    per_rank = num_experts // ranks
    batches = max(MIN_BATCHES, DRAWS // tokens)
    per_chunk = max(1, _CHUNK_SCORES // (tokens * num_experts))
    gen = torch.Generator().manual_seed(ROUTING_SEED)
    slots, distinct = [], []
    done = 0
    while done < batches:
        n = min(per_chunk, batches - done)
        scores = torch.rand(n, tokens, num_experts, generator=gen)
        if n_group > 1 and topk_group < n_group:
            grouped = scores.view(n, tokens, n_group, num_experts // n_group)
            keep = grouped.topk(2, dim=-1).values.sum(-1).topk(topk_group, dim=-1).indices
            mask = torch.zeros(n, tokens, n_group, dtype=torch.bool).scatter_(-1, keep, True)
            scores = scores.masked_fill(~mask.repeat_interleave(num_experts // n_group, -1), -1)
        ids = scores.topk(top_k, dim=-1).indices.view(n, -1)  # [n, T k]
        load = torch.zeros(n, ranks).scatter_add_(1, ids // per_rank, torch.ones(ids.shape))
        hit = torch.zeros(n, num_experts).scatter_(1, ids, 1.0)
        touched = hit.view(n, ranks, per_rank).sum(-1)
        busiest = (load * (per_rank + 1) + touched).argmax(1, keepdim=True)
        slots.append(load.gather(1, busiest))
        distinct.append(touched.gather(1, busiest))
        done += n
    return BusiestRank(
        slots=torch.cat(slots).mean().item(),
        distinct=torch.cat(distinct).mean().item(),
        mean_slots=tokens * top_k / ranks,
        batches=batches,
    )


def _nearest(x: float) -> int:
    return math.floor(x + 0.5)


def dithered(expected: float, layer: int) -> int:
    """Layer `layer`'s whole share of a per-layer expectation: consecutive layers add up to
    the expectation's running total, rounded."""
    return _nearest((layer + 1) * expected) - _nearest(layer * expected)


def routing_table(
    tokens: int, top_k: int, local_experts: int, num_experts: int, slots: int, distinct: int
) -> torch.Tensor:
    """Global expert ids [tokens, top_k] (int64) giving experts 0 .. local_experts-1 (rank 0's)
    `slots` slots over `distinct` of them (clamped to what is possible), the rest of each row
    on other ranks' experts."""
    per_token = min(top_k, local_experts)
    slots = max(0, min(slots, tokens * per_token))
    base, extra = divmod(slots, tokens)
    counts = [base + (t < extra) for t in range(tokens)]
    distinct = max(min(distinct, slots, local_experts), max(counts))
    chosen = [i * local_experts // distinct for i in range(distinct)] if distinct else []
    others = num_experts - local_experts
    table = torch.empty(tokens, top_k, dtype=torch.int64)
    slot = 0
    for t, m in enumerate(counts):
        row = [chosen[(slot + j) % distinct] for j in range(m)]
        row += [local_experts + (t * top_k + j) % others for j in range(m, top_k)]
        table[t] = torch.tensor(row, dtype=torch.int64)
        slot += m
    return table


class SimulatedRouting:
    """The ids override of one MoE layer of a simulated EP rank (module docstring, steps 3-4):
    `ids(router_ids)` keeps the router's shape and dtype and replaces its values by the
    layer's table for that token count."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        ranks: int,
        layer: int,
        n_group: int = 1,
        topk_group: int = 1,
    ) -> None:
        self.num_experts = num_experts
        self.top_k = top_k
        self.ranks = ranks
        self.layer = layer
        self.n_group = n_group
        self.topk_group = topk_group
        self.local_experts = num_experts // ranks
        self._tables: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}

    def expected(self, tokens: int) -> BusiestRank:
        return busiest_rank(
            self.num_experts, self.top_k, self.ranks, tokens, self.n_group, self.topk_group
        )

    def counts(self, tokens: int) -> tuple[int, int]:
        """(slots, distinct experts) this layer gives rank 0 at `tokens` tokens."""
        e = self.expected(tokens)
        return dithered(e.slots, self.layer), dithered(e.distinct, self.layer)

    def table(self, tokens: int) -> torch.Tensor:
        slots, distinct = self.counts(tokens)
        return routing_table(
            tokens, self.top_k, self.local_experts, self.num_experts, slots, distinct
        )

    def ids(self, router_ids: torch.Tensor) -> torch.Tensor:
        tokens, width = router_ids.shape
        if tokens == 0:
            return router_ids
        if width != self.top_k:
            raise ValueError(f"simulated routing: {width} id columns, expected {self.top_k}")
        key = (tokens, router_ids.dtype, router_ids.device)
        table = self._tables.get(key)
        if table is None:
            # built on the eager warm-up forward of each size, before any graph is captured
            if router_ids.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    f"simulated routing: no table for {tokens} tokens before CUDA-graph capture"
                )
            table = self.table(tokens).to(router_ids.device, router_ids.dtype)
            self._tables[key] = table
        return table
