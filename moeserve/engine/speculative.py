"""Speculative steps: drafts proposed for the requests that decode next step (as long as the
draft policy finds worth verifying), verified in the step (`Sampler.verify`: exactly the
target's own tokens), and each verifying request's rejected KV rows rolled back after."""

from __future__ import annotations

from collections.abc import Callable

import torch

from moeserve.engine.draft import DraftModelProposer
from moeserve.engine.metrics import EngineMetrics
from moeserve.engine.outputs import RequestOutput, TokenLogprob
from moeserve.engine.overlap import Inflight
from moeserve.engine.request import Request
from moeserve.engine.scheduler import ScheduledBatch, Scheduler
from moeserve.engine.step import RowAllocator
from moeserve.engine.step_builder import StepPlan
from moeserve.sampling import Sampler
from moeserve.spec.base import Proposer
from moeserve.spec.policy import DraftPolicy


class SpeculativeSteps:
    """The engine's proposer and draft policy over its scheduler, rows and sampler."""

    def __init__(
        self,
        proposer: Proposer,
        policy: DraftPolicy,
        scheduler: Scheduler,
        rows: RowAllocator,
        sampler: Sampler,
        metrics: EngineMetrics,
        max_model_len: int,
    ) -> None:
        self.proposer, self.policy = proposer, policy
        self.scheduler, self.rows, self.sampler = scheduler, rows, sampler
        self.metrics = metrics
        self.max_model_len = max_model_len

    def propose(
        self, prev: Inflight | None, complete: Callable[[Inflight], list[RequestOutput]]
    ) -> tuple[Inflight | None, list[RequestOutput]]:
        """Drafts for the running requests that decode next step, as long as the policy
        finds worth verifying and as their max_tokens and the context leave room for.

        A request whose last token is still on the GPU (an overlapped step, `prev`) cannot
        be drafted for: if the policy wants a draft for one, `prev` is completed first (its
        outputs returned), so overlapping costs nothing while the policy drafts nothing and
        one wait whenever it drafts again. Returns what is left in flight and the outputs."""
        running = self.scheduler.running
        decoding = [r for r in running if r.num_to_compute == 1]
        if isinstance(self.proposer, DraftModelProposer):  # it asked the policy already
            wanted = {r.request_id: self.draft_room(r) for r in decoding}
        else:
            wanted = {
                r.request_id: self.policy.length(r.request_id, len(running), self.draft_room(r))
                for r in decoding
            }
        outputs: list[RequestOutput] = []
        if prev is not None and any(r.pending and wanted[r.request_id] > 0 for r in decoding):
            outputs, prev = complete(prev), None
        for req in decoding:
            k = min(wanted[req.request_id], self.draft_room(req))
            if k <= 0 or req.pending or req.finished:
                req.draft = []
                continue
            req.draft = self.proposer.propose(req.request_id, k)[:k]
        return prev, outputs

    def draft_room(self, req: Request) -> int:
        """Draft tokens `req` has room for: its max_tokens and the context less one token."""
        return min(
            req.max_tokens - len(req.output_ids) - 1 - req.pending,
            self.max_model_len - req.num_tokens - 1 - req.pending,
        )

    def verify(
        self,
        batch: ScheduledBatch,
        plan: StepPlan,
        logits: torch.Tensor | None,
        failed: dict[int, Exception],
    ) -> tuple[dict[int, list[int]], dict[int, list[TokenLogprob]]]:
        """Accept or reject the step's drafts: per batch index, the tokens it emits and, if
        asked, their logprobs. Rows that fail alone go to `failed`."""
        if not plan.verify or logits is None:
            return {}, {}
        idx = list(plan.verify)
        reqs = [batch.requests[i] for i in idx]
        rows = [
            r for i in idx for r in range(plan.sample[i], plan.sample[i] + len(plan.verify[i]) + 1)
        ]
        res = self.sampler.verify(
            logits[rows],
            [r.params for r in reqs],
            [r.request_id for r in reqs],
            [r.prompt_ids for r in reqs],
            [r.output_ids for r in reqs],
            [plan.verify[i] for i in idx],
        )
        tokens: dict[int, list[int]] = {}
        lps: dict[int, list[TokenLogprob]] = {}
        for j, i in enumerate(idx):
            got = res.tokens[j]
            if j in res.errors or not got:
                failed[i] = res.errors.get(j) or RuntimeError("sampling failed")
                continue
            tokens[i] = got
            entries = res.logprobs[j]
            if entries is not None:
                lps[i] = [
                    TokenLogprob(t, lp, top) for t, (lp, top) in zip(got, entries, strict=True)
                ]
            drafted, accepted = len(plan.verify[i]), len(got) - 1
            self.metrics.spec.on_verify(drafted, accepted)
            self.policy.observe(reqs[j].request_id, drafted, accepted)
        return tokens, lps

    def settle(self, batch: ScheduledBatch, plan: StepPlan, emitted: dict[int, list[int]]) -> None:
        """After the step: each verifying request keeps the KV rows of its accepted tokens
        only, and its draft is spent."""
        for i, draft in plan.verify.items():
            req = batch.requests[i]
            req.draft = []
            got = emitted.get(i)
            rejected = len(draft) + 1 - len(got) if got else len(draft)
            if rejected:
                self.scheduler.rollback(req, rejected)
                self.rows.truncate(req.request_id, len(req.pages))
