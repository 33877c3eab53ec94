"""Speculative verification: each request's draft accepted or rejected against the target's
logits, one virtual row per (request, draft position), in one batched pass.

Request j owns len(drafts[j]) + 1 consecutive rows of the logits: row i is the target's
distribution after the sequence and the draft's first i tokens, processed exactly as a plain
pass processes a row whose history holds those tokens (penalties, bias, min_tokens,
temperature, truncation). Greedy: the draft's longest prefix equal to the rows' argmax, then
the argmax after it. Sampled: draft token d at row i is accepted with probability p_i(d); at
the first rejection the token is drawn from p_i with d removed (renormalised), and after a
fully accepted draft from the last row. With a draft that is one fixed guess (a point mass),
this is the rejection rule of speculative sampling and every emitted token follows the
target's distribution. Seeded requests draw from their own generator, so they repeat.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from moeserve.sampling.errors import nothing_to_sample
from moeserve.sampling.logits import TINY, adjust, mask_padded, tempered_probs
from moeserve.sampling.logprobs import ScoredToken, scored
from moeserve.sampling.params import SamplingParams
from moeserve.sampling.rows import RowState, TokenCounts

# (logits, states, greedy, guess, target) -> (accepted, drawn) per virtual row
DrawRule = Callable[
    [torch.Tensor, list[RowState], list[bool], list[int], torch.Tensor],
    tuple[torch.Tensor, torch.Tensor],
]


@dataclass
class VerifyResult:
    # per request: the tokens it emits (the accepted draft prefix, then one more), or None
    # where it failed (see `errors`)
    tokens: list[list[int] | None]
    # per request that asked for logprobs: (logprob, top-k) of each emitted token
    logprobs: list[list[ScoredToken] | None]
    errors: dict[int, Exception] = field(default_factory=dict)


@dataclass
class VirtualRows:
    """One row per (request, draft position): its row of the logits, its request's state,
    the request's batch index, the position in its draft, its output length and the draft
    tokens before it, and the draft token it checks (-1 at a request's last row)."""

    src: list[int] = field(default_factory=list)
    states: list[RowState] = field(default_factory=list)
    owner: list[int] = field(default_factory=list)
    out_lens: list[int] = field(default_factory=list)
    extra: list[list[int]] = field(default_factory=list)
    guess: list[int] = field(default_factory=list)

    @classmethod
    def of(
        cls, states: dict[int, RowState], drafts: list[list[int]], output_ids: list[list[int]]
    ) -> VirtualRows:
        out = cls()
        starts, at = [], 0
        for d in drafts:
            starts.append(at)
            at += len(d) + 1
        for j in sorted(states):
            d = drafts[j]
            for i in range(len(d) + 1):
                out.src.append(starts[j] + i)
                out.states.append(states[j])
                out.owner.append(j)
                out.out_lens.append(len(output_ids[j]) + i)
                out.extra.append(d[:i])
                out.guess.append(d[i] if i < len(d) else -1)
        return out


def verify_drafts(
    logits: torch.Tensor,
    states: dict[int, RowState],
    errors: dict[int, Exception],
    params: list[SamplingParams],
    drafts: list[list[int]],
    output_ids: list[list[int]],
    vocab_limit: int | None,
    counts: TokenCounts | None,
    rule: DrawRule,
) -> VerifyResult:
    """The tokens each request with a state emits (see the module's rule); `errors` holds
    the requests that already failed and gets those that fail here."""
    n = len(params)
    tokens: list[list[int] | None] = [None] * n
    logprobs: list[list[ScoredToken] | None] = [None] * n
    ok = sorted(states)
    if not ok:
        return VerifyResult(tokens, logprobs, errors)
    v = VirtualRows.of(states, drafts, output_ids)
    dev = logits.device
    x = logits[torch.tensor(v.src, dtype=torch.long, device=dev)].float()
    mask_padded(x, vocab_limit)
    want = [params[j].logprobs is not None for j in v.owner]
    raw_lp = torch.log_softmax(x, dim=-1) if any(want) else None
    x = adjust(x, v.states, v.out_lens, counts, v.extra)
    dead = ~(x > float("-inf")).any(dim=-1)
    greedy = [r.params.greedy for r in v.states]
    target = x.argmax(dim=-1)
    if all(greedy):
        accept = target == torch.tensor(v.guess, device=dev)
        drawn = target
    else:
        accept, drawn = rule(x, v.states, greedy, v.guess, target)
    host = torch.stack([accept.long(), drawn, dead.long()]).tolist()  # the one copy
    emitted_rows = _emitted(host, ok, drafts, tokens, errors)
    if raw_lp is not None:
        _verify_logprobs(raw_lp, params, tokens, emitted_rows, logprobs)
    return VerifyResult(tokens, logprobs, errors)


def _emitted(
    host: list[list[int]],
    ok: list[int],
    drafts: list[list[int]],
    tokens: list[list[int] | None],
    errors: dict[int, Exception],
) -> dict[int, list[int]]:
    """Each request's emitted tokens into `tokens` (the accepted prefix, then the drawn
    token), from the host copy of (accepted, drawn, dead) per virtual row; per request the
    virtual rows its tokens came from."""
    accepted, drawn, dead = host
    emitted_rows: dict[int, list[int]] = {}
    v = 0
    for j in ok:
        k = len(drafts[j])
        got: list[int] | None = []
        used: list[int] = []
        for i in range(k + 1):
            u = v + i
            if dead[u]:
                errors[j] = nothing_to_sample()
                got = None
                break
            used.append(u)
            if i < k and accepted[u]:
                got.append(drafts[j][i])
                continue
            got.append(int(drawn[u]))
            break
        v += k + 1
        tokens[j] = got
        if got:
            emitted_rows[j] = used
    return emitted_rows


def verify_draws(
    x: torch.Tensor,
    rows: list[RowState],
    greedy: list[bool],
    guess: list[int],
    target: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per virtual row: whether its draft token is accepted, and the token drawn where
    it is not (from the distribution with the draft token removed; from the whole
    distribution at a request's last row)."""
    dev = x.device
    probs = tempered_probs(x, [r.params for r in rows], greedy)
    probs = probs / probs.sum(dim=-1, keepdim=True).clamp_(min=TINY)
    has_guess = torch.tensor([g >= 0 for g in guess], device=dev)
    g = torch.tensor([max(0, t) for t in guess], dtype=torch.long, device=dev)
    p_guess = probs.gather(1, g[:, None]).squeeze(1)
    uniform = torch.rand(len(rows), device=dev)
    noise = torch.empty_like(probs).exponential_()
    for v, r in enumerate(rows):
        if r.generator is not None and not greedy[v]:
            uniform[v] = torch.rand(1, device=dev, generator=r.generator)[0]
            noise[v].exponential_(generator=r.generator)
    residual = probs.scatter(1, g[:, None], torch.where(has_guess, 0.0, p_guess)[:, None])
    drawn = (residual / noise.clamp_(min=TINY)).nan_to_num_(nan=0.0).argmax(dim=-1)
    is_greedy = torch.tensor(greedy, device=dev)
    accept = torch.where(is_greedy, target == g, uniform < p_guess) & has_guess
    return accept, torch.where(is_greedy, target, drawn)


def _verify_logprobs(
    raw: torch.Tensor,
    params: list[SamplingParams],
    tokens: list[list[int] | None],
    emitted_rows: dict[int, list[int]],
    out: list[list[ScoredToken] | None],
) -> None:
    """Each emitted token's logprob under its row's raw distribution, and the row's
    top-k, for the requests that asked."""
    asked = [
        j
        for j, p in enumerate(params)
        if p.logprobs is not None and tokens[j] is not None and j in emitted_rows
    ]
    if not asked:
        return
    vs = [v for j in asked for v in emitted_rows[j]]
    ts = [t for j in asked for t in tokens[j]]  # type: ignore[union-attr]
    ks = [params[j].logprobs or 0 for j in asked for _ in emitted_rows[j]]
    found = iter(scored(raw, vs, ts, ks))
    for j in asked:
        out[j] = [next(found) for _ in emitted_rows[j]]
