"""Speculative sampling keeps the target's distribution.

The target is a tiny bigram model (a fixed random logit row per previous token, 8 tokens);
a draft guesses two tokens from another table. Plain sampling draws two tokens one step at a
time (`Sampler.__call__`); speculative sampling verifies the draft (`Sampler.verify`) and,
where only one token came out, draws the second with a plain step, as the engine does. A
two-sample chi-square test over the 64 token pairs, 20,000 sequences each, must not tell
them apart (p > 0.01), at temperature 1 and with top-p 0.9; the same test must reject a
sampler whose rejected positions draw from the whole distribution instead of the
distribution without the rejected draft token.
"""

from __future__ import annotations

import pytest
import torch

from moeserve.sampling import Sampler, SamplingParams

V = 8
N = 20_000
START = 3


def _tables() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    target = torch.randn(V, V, generator=g) * 1.5
    guess = torch.randn(V, V, generator=g) * 1.5
    return target, guess


def _plain(sampler: Sampler, params: SamplingParams, target: torch.Tensor) -> torch.Tensor:
    prev = torch.full((N,), START)
    out = []
    for _ in range(2):
        ids = [f"p{i}" for i in range(N)]
        res = sampler(target[prev], [params] * N, ids, [[START]] * N, [[]] * N)
        assert not res.errors
        prev = torch.tensor(res.token_ids)
        out.append(prev)
    return out[0] * V + out[1]


def _speculative(sampler: Sampler, params: SamplingParams, target, guess) -> torch.Tensor:
    d1 = int(guess[START].argmax())
    d2 = int(guess[d1].argmax())
    # every sequence has the same draft: rows after START, after d1, after d2
    logits = torch.cat([target[START], target[d1], target[d2]]).view(3, V).repeat(N, 1)
    ids = [f"s{i}" for i in range(N)]
    res = sampler.verify(logits, [params] * N, ids, [[START]] * N, [[]] * N, [[d1, d2]] * N)
    assert not res.errors
    first = torch.tensor([t[0] for t in res.tokens])
    second = torch.tensor([t[1] if len(t) > 1 else -1 for t in res.tokens])
    short = (second < 0).nonzero().flatten().tolist()
    if short:  # only one token came out: the next plain step draws the second
        more = sampler(
            target[first[short]],
            [params] * len(short),
            [f"t{i}" for i in short],
            [[START]] * len(short),
            [[int(first[i])] for i in short],
        )
        second[short] = torch.tensor(more.token_ids)
    return first * V + second


def _chi_square_p(a: torch.Tensor, b: torch.Tensor) -> float:
    """p-value of the two-sample chi-square test of homogeneity over the pair cells."""
    ca = torch.bincount(a, minlength=V * V).double()
    cb = torch.bincount(b, minlength=V * V).double()
    keep = (ca + cb) > 0
    ca, cb = ca[keep], cb[keep]
    total = ca + cb
    ea, eb = total * ca.sum() / total.sum(), total * cb.sum() / total.sum()
    stat = (((ca - ea) ** 2) / ea + ((cb - eb) ** 2) / eb).sum()
    df = keep.sum().item() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2.0))


class _WrongResidual(Sampler):
    """A rejected position draws from the whole distribution (the draft token included)."""

    def _verify_draws(self, x, rows, greedy, guess, target):
        accept, _ = super()._verify_draws(x, rows, greedy, guess, target)
        plain = super()._verify_draws(x, rows, greedy, [-1] * len(guess), target)[1]
        return accept, plain


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_speculative_sampling_keeps_the_distribution(top_p):
    torch.manual_seed(0)
    target, guess = _tables()
    params = SamplingParams(temperature=1.0, top_p=top_p, max_tokens=2)
    plain = _plain(Sampler(vocab_limit=V), params, target)
    spec = _speculative(Sampler(vocab_limit=V), params, target, guess)
    assert _chi_square_p(plain, spec) > 0.01


def test_the_test_rejects_a_wrong_acceptance_rule():
    torch.manual_seed(0)
    target, guess = _tables()
    params = SamplingParams(temperature=1.0, max_tokens=2)
    plain = _plain(Sampler(vocab_limit=V), params, target)
    wrong = _speculative(_WrongResidual(vocab_limit=V), params, target, guess)
    assert _chi_square_p(plain, wrong) < 0.01


def test_greedy_verify_takes_the_longest_agreeing_prefix_and_one_more():
    target, _ = _tables()
    a = int(target[START].argmax())
    b = int(target[a].argmax())
    c = int(target[b].argmax())
    wrong = (b + 1) % V
    params = SamplingParams(temperature=0.0, max_tokens=8)
    sampler = Sampler(vocab_limit=V)
    rows = torch.stack([target[START], target[a], target[b]])
    full = sampler.verify(rows, [params], ["r"], [[START]], [[]], [[a, b]])
    assert full.tokens == [[a, b, c]]
    rows = torch.stack([target[START], target[a], target[wrong]])
    cut = sampler.verify(rows, [params], ["r2"], [[START]], [[]], [[a, wrong]])
    assert cut.tokens == [[a, b]]


def test_verify_applies_penalties_to_the_draft_prefix():
    """Row i's history holds the draft's first i tokens: a frequency penalty against token t
    at row 1 counts a draft token t at row 0, as plain decoding would count it once emitted."""
    logits = torch.zeros(2, V)
    logits[:, 5] = 1.0  # token 5 wins unless penalised
    logits[:, 2] = 0.5
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0, max_tokens=8)
    res = Sampler(vocab_limit=V).verify(logits, [params], ["r"], [[0]], [[]], [[5]])
    # row 0 agrees with the draft (5); row 1 has seen 5 once: 1 - 2 < 0.5, so 2
    assert res.tokens == [[5, 2]]
