"""Overlap scheduling: a step whose sampled tokens stay on the GPU (every request greedy with
no per-token host work) lets the engine queue the next step before the host has seen them;
the tokens come to the host behind it, in one of two pinned buffers used in turn."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moeserve.engine.scheduler import ScheduledBatch
from moeserve.engine.step_builder import StepPlan

# tokens a request may still compute beyond those it has while a step is in flight: the
# in-flight step's, and one more that a request ending with it computes and drops
TOKENS_AHEAD = 2


@dataclass
class Inflight:
    """An overlapped step: launched, its greedy tokens on their way to `host`."""

    batch: ScheduledBatch
    plan: StepPlan
    host: torch.Tensor  # int64 [len(plan.sample)] pinned, filled when `event` completes
    event: torch.cuda.Event | None
    slot_of: dict[str, int]  # request id -> its row in the step's sampled tokens

    def tokens(self) -> list[int]:
        """The step's sampled tokens, once they reached the host."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


def overlappable(batch: ScheduledBatch, max_model_len: int) -> bool:
    """Whether the batch's tokens may stay on the GPU until the next step is queued: every
    request greedy with no per-token host work before its next step (logprobs, penalties,
    bias, min_tokens), and room for two more tokens."""
    for req in batch.requests:
        p = req.params
        if req.draft:  # its accepted tokens decide what the next step computes
            return False
        if not p.greedy or p.logprobs is not None or p.prompt_logprobs is not None:
            return False
        if p.needs_penalties or getattr(p, "logit_bias", None) or p.min_tokens:
            return False
        ahead = req.pending + TOKENS_AHEAD
        if req.num_tokens + ahead > max_model_len or len(req.output_ids) + ahead > req.max_tokens:
            return False
    return True


class HostTokens:
    """Two pinned buffers of sampled tokens: a step's land in one while the host still reads
    the other's."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.bufs = torch.empty(2, rows, dtype=torch.int64, pin_memory=self.cuda)
        self.turn = 0

    def launch(self, batch: ScheduledBatch, plan: StepPlan, latest: torch.Tensor) -> Inflight:
        """Mark the launched step's sampled tokens pending and queue their copy from
        `latest` (the device's tokens of the step) to the host."""
        slot_of = {}
        for i, j in plan.sample.items():
            req = batch.requests[i]
            req.pending += 1
            slot_of[req.request_id] = j
        k = len(plan.sample)
        self.turn ^= 1
        host = self.bufs[self.turn, :k]
        host.copy_(latest[:k], non_blocking=True)
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
        return Inflight(batch, plan, host, event, slot_of)
