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
# relative cost of one more token in a step before two token counts were timed
PRIOR_COST_SLOPE = 0.05
# weight an older step time keeps per newer one: the machine's speed drifts, and a count
# the policy stopped choosing must not keep its old figure forever
STEP_COST_DECAY = 0.98
MIN_WEIGHT = 1e-3
MIN_STEP_SECONDS = 1e-6  # a fitted line never promises a free step
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
        # tokens in a decode step -> (weight, mean seconds), older steps weighted less
        self.step_seconds: dict[int, tuple[float, float]] = {}
        # a draft model's seconds per draft token (moving average; 0 for host proposers)
        self.draft_seconds = 0.0
        self._acc: dict[str, _Acceptance] = {}

    # ---- measurements ----------------------------------------------------------------------
    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A step of decode and verify rows only took `seconds` for `num_tokens` tokens."""
        aged = {}
        for n, (w, mean) in self.step_seconds.items():
            if w * STEP_COST_DECAY >= MIN_WEIGHT:
                aged[n] = (w * STEP_COST_DECAY, mean)
        w, mean = aged.get(num_tokens, (0.0, 0.0))
        aged[num_tokens] = (w + 1.0, mean + (seconds - mean) / (w + 1.0))
        self.step_seconds = aged

    def observe_draft(self, seconds: float, tokens: int) -> None:
        """A draft model took `seconds` to draft `tokens` tokens per sequence (its steps run
        after the target's, so their time adds to what a draft costs)."""
        if tokens > 0:
            per = seconds / tokens
            old = self.draft_seconds
            self.draft_seconds = per if old == 0.0 else 0.8 * old + 0.2 * per

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
        """Step time for `num_tokens` tokens: a weighted straight line through the timed
        steps (step time grows about linearly with the tokens at these sizes), or the
        prior slope from the one count timed so far."""
        pts = self.step_seconds
        if not pts:
            return 1.0 + PRIOR_COST_SLOPE * (num_tokens - 1)
        wsum = sum(w for w, _ in pts.values())
        nbar = sum(w * n for n, (w, _) in pts.items()) / wsum
        tbar = sum(w * t for w, t in pts.values()) / wsum
        var = sum(w * (n - nbar) ** 2 for n, (w, _) in pts.items())
        if len(pts) < 2 or var <= 0.0:
            return (
                tbar
                * (1.0 + PRIOR_COST_SLOPE * (num_tokens - 1))
                / (1.0 + PRIOR_COST_SLOPE * (nbar - 1))
            )
        slope = sum(w * (n - nbar) * (t - tbar) for n, (w, t) in pts.items()) / var
        slope = max(slope, 0.0)
        return max(tbar + slope * (num_tokens - nbar), MIN_STEP_SECONDS)

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
            gain = expected * base / (self.cost(step_tokens + k) + k * self.draft_seconds)
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
