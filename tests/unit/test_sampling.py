import math

import pytest
import torch

from moeserve.sampling import Sampler, SamplingError, SamplingParams, truncated_probs


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
