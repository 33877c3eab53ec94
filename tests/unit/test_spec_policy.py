"""The draft-length policy: drafts as long as the measured step cost and the request's
acceptance make them pay, none where they do not (with a one-token probe now and then),
and old step times fade so a count it stopped choosing is judged by the current line."""

from __future__ import annotations

from moeserve.spec.policy import PROBE_EVERY, DraftPolicy


def _timed(policy: DraftPolicy, seconds_of, counts=range(1, 6), rounds: int = 20) -> None:
    for _ in range(rounds):
        for n in counts:
            policy.observe_step(n, seconds_of(n))


def test_cheap_verification_and_good_acceptance_draft_the_most():
    p = DraftPolicy(max_tokens=4)
    _timed(p, lambda n: 0.010 + 0.0002 * (n - 1))
    for _ in range(10):
        p.observe("r", 4, 4)
    assert p.length("r", step_tokens=1, limit=4) == 4
    assert p.length("r", step_tokens=1, limit=2) == 2  # max_tokens / context room


def test_expensive_verification_drafts_nothing_but_probes():
    p = DraftPolicy(max_tokens=4)
    _timed(p, lambda n: 0.010 * n)  # every token costs a full step
    for _ in range(10):
        p.observe("r", 4, 0)
    got = [p.length("r", step_tokens=1, limit=4) for _ in range(2 * PROBE_EVERY)]
    assert got.count(1) == 2 and set(got) == {0, 1}


def test_poor_acceptance_shortens_the_draft():
    p = DraftPolicy(max_tokens=4)
    _timed(p, lambda n: 0.010 + 0.002 * (n - 1))
    for _ in range(20):
        p.observe("good", 4, 4)
        p.observe("poor", 4, 0)
    assert p.length("good", 1, 4) > p.length("poor", 1, 4)


def test_old_step_times_fade():
    p = DraftPolicy(max_tokens=4)
    p.observe_step(5, 1.0)  # one slow step (the machine was busy)
    _timed(p, lambda n: 0.010 + 0.001 * (n - 1), counts=(1, 2), rounds=200)
    assert abs(p.cost(5) - 0.014) < 0.002


def test_fixed_length_when_not_adaptive():
    p = DraftPolicy(max_tokens=3, adaptive=False)
    assert p.length("r", 1, 10) == 3
    assert p.length("r", 1, 2) == 2
    assert p.length("r", 1, 0) == 0


def test_a_costly_draft_model_drafts_less():
    """A draft model's own time per draft token counts against the draft: cheap verify
    steps and good acceptance draft the most with a free proposer, nothing when each draft
    token costs as much as a step."""
    p = DraftPolicy(max_tokens=4)
    _timed(p, lambda n: 0.010 + 0.0002 * (n - 1))
    for _ in range(10):
        p.observe("r", 4, 3)
    assert p.length("r", 1, 4) == 4
    p.observe_draft(0.040, 4)  # 10 ms per draft token
    assert p.length("r", 1, 4) == 0
