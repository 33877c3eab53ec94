"""How many draft tokens a request verifies in a step (no torch).

A step that verifies k draft tokens of a sequence computes k more rows; on a GPU at small
batches that costs little (weight reads dominate), on a CPU or for an MoE model whose draft
tokens route to their own experts it costs more. With a request's per-token acceptance
probability a (estimated from its own verifications), a draft of k tokens yields
1 + a + ... + a^k tokens per step in expectation; the policy picks the k with the most
tokens per unit of step time, using step times measured by token count in this process.
Where no k > 0 pays, the request drafts nothing, except for an occasional one-token probe
that keeps its estimate current, so text the proposer cannot predict costs little.
"""

from __future__ import annotations

from dataclasses import dataclass

# prior of a request's per-token acceptance, weighted as this many verified positions
ACCEPT_PRIOR = 0.6
ACCEPT_PRIOR_WEIGHT = 2.0
# older verifications count less: the text a request writes changes character
ACCEPT_DECAY = 0.9
# relative cost of one more token in a step before any such step was timed
PRIOR_COST_SLOPE = 0.05
STEP_COST_DECAY = 0.8  # moving average of step times
# a draft must promise this much more output per second than none
MIN_GAIN = 1.02
PROBE_EVERY = 8  # a request drafting nothing verifies one token every this many steps


@dataclass
class _Acceptance:
    accepted: float = ACCEPT_PRIOR * ACCEPT_PRIOR_WEIGHT
    trials: float = ACCEPT_PRIOR_WEIGHT
    idle: int = 0  # steps since it last drafted

    @property
    def rate(self) -> float:
        return self.accepted / self.trials


class DraftPolicy:
    """Draft length per request and step; `adaptive=False` always allows `max_tokens`."""

    def __init__(self, max_tokens: int, adaptive: bool = True) -> None:
        self.max_tokens = max_tokens
        self.adaptive = adaptive
        self.step_seconds: dict[int, float] = {}  # tokens in a decode step -> seconds
        self._acc: dict[str, _Acceptance] = {}

    # ---- measurements ----------------------------------------------------------------------
    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A step of decode and verify rows only took `seconds` for `num_tokens` tokens."""
        old = self.step_seconds.get(num_tokens)
        if old is None:
            self.step_seconds[num_tokens] = seconds
        else:
            self.step_seconds[num_tokens] = STEP_COST_DECAY * old + (1 - STEP_COST_DECAY) * seconds

    def observe(self, request_id: str, drafted: int, accepted: int) -> None:
        """A verification of `drafted` tokens accepted the first `accepted`."""
        a = self._acc.setdefault(request_id, _Acceptance())
        rejected = 1 if accepted < drafted else 0
        a.accepted = ACCEPT_DECAY * a.accepted + accepted
        a.trials = ACCEPT_DECAY * a.trials + accepted + rejected

    def forget(self, request_id: str) -> None:
        self._acc.pop(request_id, None)

    # ---- the decision ----------------------------------------------------------------------
    def cost(self, num_tokens: int) -> float:
        """Step time for `num_tokens` tokens: measured, interpolated between measured
        counts, or scaled from the nearest one by the prior slope."""
        known = self.step_seconds
        if num_tokens in known:
            return known[num_tokens]
        below = max((n for n in known if n < num_tokens), default=None)
        above = min((n for n in known if n > num_tokens), default=None)
        if below is not None and above is not None:
            w = (num_tokens - below) / (above - below)
            return (1 - w) * known[below] + w * known[above]
        base = below if below is not None else above
        if base is None:
            return 1.0 + PRIOR_COST_SLOPE * (num_tokens - 1)
        scale = (1.0 + PRIOR_COST_SLOPE * (num_tokens - 1)) / (1.0 + PRIOR_COST_SLOPE * (base - 1))
        return known[base] * scale

    def length(self, request_id: str, step_tokens: int, limit: int) -> int:
        """Draft tokens `request_id` may verify in a step that computes `step_tokens` tokens
        without them, at most `limit`."""
        limit = min(limit, self.max_tokens)
        if limit <= 0 or not self.adaptive:
            return max(0, limit)
        a = self._acc.setdefault(request_id, _Acceptance())
        rate = a.rate
        base = self.cost(step_tokens)
        best_k, best_gain = 0, 1.0
        expected = 1.0
        for k in range(1, limit + 1):
            expected += rate**k
            gain = expected * base / self.cost(step_tokens + k)
            if gain > best_gain:
                best_k, best_gain = k, gain
        if best_gain < MIN_GAIN:
            best_k = 0
        if best_k == 0:
            a.idle += 1
            if a.idle >= PROBE_EVERY:
                best_k = 1
        if best_k:
            a.idle = 0
        return best_k
