import math

import pytest
import torch

from moeserve.sampling import Sampler, SamplingError, SamplingParams, truncate, truncated_probs
from moeserve.sampling.rows import RowStates


def test_validation_messages():
    with pytest.raises(SamplingError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(SamplingError, match="max_tokens"):
        SamplingParams(max_tokens=-1)
    with pytest.raises(SamplingError, match="logprobs"):
        SamplingParams(logprobs=21)


def test_truncation_by_hand():
    logits = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))
    assert torch.allclose(truncated_probs(logits, 2, 1.0, 0.0), torch.tensor([2 / 3, 1 / 3, 0, 0]))
    # top_p 0.7: 0.5 then 0.25 reaches it
    assert torch.allclose(truncated_probs(logits, 0, 0.7, 0.0), torch.tensor([2 / 3, 1 / 3, 0, 0]))
    # min_p 0.3: keep p >= 0.15
    p = truncated_probs(logits, 0, 1.0, 0.3)
    assert torch.allclose(p, torch.tensor([0.5, 0.25, 0.15, 0]) / 0.9)


def test_penalties_by_hand():
    s = Sampler()
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.4]])
    p = SamplingParams(temperature=0, repetition_penalty=2.0)
    # token 0 seen: 2.0 -> 1.0 ; token 1 seen: -1 -> -2; argmax becomes 0 still (1.0 > 0.5)
    assert s(logits, [p], ["r"], [[0]], [[1]]).token_ids == [0]
    p = SamplingParams(temperature=0, frequency_penalty=1.0, presence_penalty=0.5)
    # token 0 generated twice: 2.0 - 2*1.0 - 0.5 = -0.5 -> argmax is token 2
    assert s(logits, [p], ["r"], [[]], [[0, 0]]).token_ids == [2]


def test_logprobs_are_of_the_raw_distribution():
    s = Sampler()
    logits = torch.tensor([[1.0, 2.0, 3.0]])
    res = s(logits, [SamplingParams(temperature=0.5, top_k=1, logprobs=2)], ["r"], [[]], [[]])
    lz = math.log(sum(math.exp(x) for x in (1.0, 2.0, 3.0)))
    assert res.token_ids == [2]
    chosen, top = res.logprobs[0]
    assert chosen == pytest.approx(3.0 - lz, abs=1e-6)
    assert [t for t, _ in top] == [2, 1] and top[1][1] == pytest.approx(2.0 - lz, abs=1e-6)


def test_seeded_sampling_is_reproducible_and_independent_of_batch():
    logits = torch.randn(1, 50)
    p = SamplingParams(temperature=1.0, seed=123)
    a = [Sampler()(logits, [p], ["x"], [[]], [[]]).token_ids[0] for _ in range(1)]
    other = SamplingParams(temperature=1.0)
    s = Sampler()
    b = s(torch.cat([torch.randn(1, 50), logits]), [other, p], ["y", "x"], [[], []], [[], []])
    assert b.token_ids[1] == a[0]


def test_min_tokens_blocks_eos():
    s = Sampler()
    logits = torch.tensor([[0.0, 5.0, 1.0]])
    p = SamplingParams(temperature=0, min_tokens=2)
    assert s(logits, [p], ["r"], [[]], [[]], eos_ids=(1,)).token_ids == [2]


# ---- parameters that once killed the engine, checked at the door or survived per row -------


def test_seed_range_names_the_field():
    with pytest.raises(SamplingError, match=r"^seed"):
        SamplingParams(seed=2**64)
    with pytest.raises(SamplingError, match=r"^seed"):
        SamplingParams(seed=-(2**63) - 1)
    s = Sampler()
    logits = torch.randn(1, 20)
    for seed in (2**64 - 1, -(2**63), 0):
        res = s(logits, [SamplingParams(seed=seed)], [f"r{seed}"], [[]], [[]])
        assert res.errors == {} and 0 <= res.token_ids[0] < 20


def test_min_tokens_must_not_exceed_max_tokens():
    with pytest.raises(SamplingError, match=r"^min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=3)


def test_token_ids_are_checked_against_the_vocabulary():
    with pytest.raises(SamplingError, match=r"^stop_token_ids.*49153"):
        SamplingParams(stop_token_ids=(49153,)).check_vocab(49152)
    with pytest.raises(SamplingError, match=r"^logit_bias.*50000"):
        SamplingParams(logit_bias={50000: 1.0}).check_vocab(49152)
    with pytest.raises(SamplingError, match=r"^logit_bias"):
        SamplingParams(logit_bias={"x": 1.0})
    with pytest.raises(SamplingError, match=r"^logit_bias"):
        SamplingParams(logit_bias={3: 101.0})
    # min_tokens with every id a stop id: nothing could ever be sampled
    with pytest.raises(SamplingError, match=r"^min_tokens"):
        SamplingParams(min_tokens=1, stop_token_ids=tuple(range(1, 10))).check_vocab(10, (0,))
    SamplingParams(min_tokens=1, stop_token_ids=tuple(range(1, 10))).check_vocab(11, (0,))


def test_tiny_repetition_penalty_never_samples_from_inf_or_nan():
    # 10 / 1e-38 overflows to inf: the row is sanitised, not drawn from nan probabilities
    s = Sampler()
    logits = torch.tensor([[10.0, 9.0, -3.0, 0.5]])
    p = SamplingParams(temperature=1.0, repetition_penalty=1e-38, seed=1)
    for step in range(5):
        res = s(logits, [p], ["r"], [[0, 1, 0]], [[0] * step])
        assert res.errors == {} and res.token_ids[0] in (0, 1)


def test_a_row_with_nothing_to_sample_fails_alone():
    s = Sampler()
    logits = torch.tensor([[1.0, 2.0, 3.0], [float("nan")] * 3, [3.0, 2.0, 1.0]])
    ps = [SamplingParams(temperature=0), SamplingParams(temperature=1.0), SamplingParams()]
    res = s(logits, ps, ["a", "b", "c"], [[], [], []], [[], [], []])
    assert res.token_ids[0] == 2 and res.token_ids[1] is None and res.token_ids[2] is not None
    assert list(res.errors) == [1]


def test_a_row_whose_state_fails_fails_alone(monkeypatch):
    s = Sampler()
    real = RowStates.new_row

    def broken(self, p, *args):
        if p.seed == 666:
            raise RuntimeError("injected")
        return real(self, p, *args)

    monkeypatch.setattr(RowStates, "new_row", broken)
    logits = torch.tensor([[0.0, 5.0], [5.0, 0.0]])
    ps = [SamplingParams(temperature=0.5, seed=666), SamplingParams(temperature=0)]
    res = s(logits, ps, ["bad", "good"], [[], []], [[], []])
    assert res.token_ids == [None, 0] and isinstance(res.errors[0], RuntimeError)


def test_padded_lm_head_rows_are_never_sampled_nor_reported():
    # the LM head is 8 wide, the tokenizer knows 5 ids; the padded rows hold the largest logits
    logits = torch.tensor([[0.0, 1.0, 0.5, 0.2, 0.1, 50.0, 60.0, 70.0]])
    s = Sampler(vocab_limit=5)
    greedy = s(logits, [SamplingParams(temperature=0, logprobs=3)], ["g"], [[]], [[]])
    assert greedy.token_ids == [1]
    assert all(t < 5 for t, _ in greedy.logprobs[0][1])
    lz = math.log(sum(math.exp(x) for x in (0.0, 1.0, 0.5, 0.2, 0.1)))
    assert greedy.logprobs[0][0] == pytest.approx(1.0 - lz, abs=1e-6)
    for seed in range(20):
        res = s(logits, [SamplingParams(temperature=5.0, seed=seed)], [f"s{seed}"], [[]], [[]])
        assert res.token_ids[0] < 5


def test_logit_bias_by_hand():
    s = Sampler()
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    p = SamplingParams(temperature=0, logit_bias={2: 2.5, 0: -1.0})
    assert s(logits, [p], ["r"], [[]], [[]]).token_ids == [2]  # 2.5 > 1.0 > 1.0
    p = SamplingParams(temperature=0, logit_bias={2: -100.0})
    assert s(logits, [p], ["q"], [[]], [[]]).token_ids == [0]


def test_penalty_counts_kept_incrementally_match_a_fresh_count():
    """Steps with a growing output give what a new sampler computes from the whole history,
    and both equal the penalties applied by hand."""
    logits = torch.tensor([[3.0, 2.9, 2.8, 2.65, -1.0]])
    p = SamplingParams(
        temperature=0, repetition_penalty=1.5, frequency_penalty=0.2, presence_penalty=0.1
    )
    prompt = [4]
    output: list[int] = []
    s = Sampler()
    for _ in range(8):
        tok = s(logits, [p], ["r"], [prompt], [output]).token_ids[0]
        fresh = Sampler()(logits, [p], ["r"], [prompt], [list(output)]).token_ids[0]
        row = logits[0].tolist()
        for t in range(5):
            if t in prompt or t in output:
                row[t] = row[t] / 1.5 if row[t] > 0 else row[t] * 1.5
            c = output.count(t)
            row[t] -= 0.2 * c + (0.1 if c else 0.0)
        assert tok == fresh == max(range(5), key=lambda t: row[t])
        output.append(tok)
    assert len(set(output)) > 1  # the penalties really moved the argmax


def test_batched_draws_follow_the_distribution():
    """Frequencies of many seeded draws against the softmax computed by hand."""
    probs = [0.5, 0.3, 0.15, 0.05]
    logits = torch.log(torch.tensor(probs)).repeat(400, 1)
    s = Sampler()
    counts = [0] * 4
    for rep in range(5):
        ps = [SamplingParams(temperature=1.0, seed=rep * 1000 + i) for i in range(400)]
        rids = [f"{rep}-{i}" for i in range(400)]
        res = s(logits, ps, rids, [[]] * 400, [[]] * 400)
        for t in res.token_ids:
            counts[t] += 1
    for c, p in zip(counts, probs, strict=True):
        assert abs(c / 2000 - p) < 0.035, counts


def test_batched_truncation_matches_the_one_row_reference():
    torch.manual_seed(0)
    logits = torch.randn(5, 30)
    ks, tps, mps = [0, 3, 10, 0, 1], [1.0, 0.9, 0.5, 0.3, 1.0], [0.0, 0.0, 0.1, 0.0, 0.5]
    got = truncate(torch.softmax(logits, -1), ks, tps, mps)
    for i in range(5):
        ref = truncated_probs(logits[i], ks[i], tps[i], mps[i])
        assert torch.allclose(got[i] / got[i].sum(), ref, atol=1e-6)


def test_sampler_device_greedy_and_logprobs_against_torch():
    """The Sampler's device greedy path and its scoring of given tokens, against plain torch
    over the allowed vocabulary (the padded tail of the LM head is never chosen)."""
    gen = torch.Generator().manual_seed(0)
    vocab, padded = 50, 64
    sampler = Sampler(vocab_limit=vocab)
    steps = [torch.randn(3, padded, generator=gen) for _ in range(2)]
    for s in steps:
        s[:, vocab:] = 100.0  # padding that must never win
    first = sampler.greedy_on_device(steps[0])
    second = sampler.greedy_on_device(steps[1])
    assert first.tolist() == steps[0][:, :vocab].argmax(-1).tolist()
    assert second.tolist() == steps[1][:, :vocab].argmax(-1).tolist()
    assert sampler.tokens.latest is second

    targets = [3, 0, 49]
    scored = sampler.logprobs_of(steps[0], targets, k=2)
    ref = torch.log_softmax(steps[0][:, :vocab].double(), dim=-1)
    for row, (lp, top) in enumerate(scored):
        assert abs(lp - ref[row, targets[row]].item()) < 1e-5
        want = ref[row].topk(2)
        assert [t for t, _ in top] == want.indices.tolist()
        assert all(abs(v - w) < 1e-5 for (_, v), w in zip(top, want.values.tolist(), strict=True))
