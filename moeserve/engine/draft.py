"""Drafts from a draft model that reads the target's hidden states: DeepSeek's MTP module, or
an EAGLE-3 head (moeserve/models/eagle3.py; the runner hands it the hidden states three target
layers copied for it, fused by its `fc`, instead of the final ones).

After every target step the draft model catches up on the positions whose next token is now
known: a prompt chunk's positions, a decode row's, and a verified draft's accepted ones (the
rejected positions are left for later steps to overwrite). At position i it reads the target's
hidden state h_i and token i + 1, and writes its own cache on the sequence's pages; its
output at the last position predicts the first draft token (a target id: an EAGLE-3 head maps
its draft vocabulary in its logits). Further draft tokens
come from running it again, one position at a time, on its own output (its cache rows there
are overwritten by the next catch-up). Draft steps are `StepInput`s with `draft` set, so the
other ranks of a tensor-parallel group run them too. Drafts are greedy, argmaxed on the device:
a draft step reads the previous one's tokens there, and the host reads all of them at once.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from moeserve.engine.executor import Executor
from moeserve.engine.request import Request
from moeserve.engine.scheduler import ScheduledBatch, Scheduler
from moeserve.engine.step import DRAFT_ON_DRAFT, DRAFT_ON_TARGET, RowAllocator, StepInput
from moeserve.sampling import Sampler
from moeserve.spec.policy import DraftPolicy


class EngineParts(Protocol):
    """What drafting needs of the engine (its core implements it)."""

    live: dict[str, Any]
    rows: RowAllocator
    executor: Executor
    scheduler: Scheduler
    policy: DraftPolicy | None
    max_model_len: int
    sampler: Sampler  # rank 0's: draft steps leave their greedy tokens in it


class DraftModelProposer:
    """The `Proposer` of a draft model: `after_step` computes the drafts, `propose` hands
    them out. The draft length is decided in `after_step`, before the draft model runs (its
    steps cost time)."""

    def __init__(self, engine: EngineParts, num_tokens: int) -> None:
        self.engine = engine
        self.num_tokens = num_tokens
        self.drafts: dict[str, list[int]] = {}

    # ---- the Proposer protocol -------------------------------------------------------------
    def start(self, request_id: str, prompt_ids: Sequence[int]) -> None:
        pass

    def extend(self, request_id: str, new_ids: Sequence[int]) -> None:
        pass

    def propose(self, request_id: str, max_tokens: int) -> list[int]:
        return self.drafts.pop(request_id, [])[:max_tokens]

    def finish(self, request_id: str) -> None:
        self.drafts.pop(request_id, None)

    # ---- after a target step ---------------------------------------------------------------
    def after_step(
        self,
        batch: ScheduledBatch,
        spans: dict[int, tuple[int, int, int]],
        emitted: dict[int, list[int]],
    ) -> None:
        """Catch the draft model up on the step's positions whose next token is known, then
        draft for the requests that decode next. `spans`: batch index -> (its first row in
        the step, its first position, its token count); `emitted`: the tokens each verifying
        request emitted."""
        eng = self.engine
        t_start = time.perf_counter()
        catch_up: list[tuple[Request, int, int, int]] = []  # request, t0, start, m
        want: dict[str, int] = {}  # request -> draft tokens to compute
        for i, (t0, start, n) in spans.items():
            req = batch.requests[i]
            if req.finished or req.request_id not in eng.live:
                continue
            m = len(emitted[i]) if i in emitted else n
            if len(req.token_slice(start + 1, start + m + 1)) == m:
                catch_up.append((req, t0, start, m))
        if not catch_up:
            return
        catch_up.sort(key=lambda c: c[3] != 1)  # one-token sequences first
        # draft steps leave their greedy tokens on the device, and the next draft step reads
        # them through placeholder ids: one host sync for all K draft tokens
        step = StepInput([], [], [], [], [], draft=DRAFT_ON_TARGET, greedy=True)
        last_row: dict[str, int] = {}  # request -> its logit row
        token_row: dict[str, int] = {}  # request -> its last token's row (its hidden state)
        for req, t0, start, m in catch_up:
            step.ids.extend(req.token_slice(start + 1, start + m + 1))
            step.positions.extend(range(start, start + m))
            step.hidden_rows.extend(range(t0, t0 + m))
            step.rows.append(eng.rows.row(req.request_id))
            step.seq_lens.append(start + m)
            step.query_lens.append(m)
            k = self._length(req, len(catch_up))
            if k > 0:
                want[req.request_id] = k
                last_row[req.request_id] = len(step.logit_rows)
                token_row[req.request_id] = len(step.ids) - 1
                step.logit_rows.append(len(step.ids) - 1)
        if not last_row:
            eng.executor.execute(step)  # the cache only
            return
        drafting = [r for r, *_ in catch_up if r.request_id in last_row]
        self._execute(step)
        # per draft step: its device tokens, and each request's row in them
        steps = [(eng.sampler.tokens.latest, dict(last_row))]
        # the row of the latest draft step's output each request's next draft step reads
        rows_of = {r.request_id: token_row[r.request_id] for r in drafting}
        for j in range(1, self.num_tokens):
            going = [r for r in drafting if want[r.request_id] > j and self._reserve(r, j)]
            if not going:
                break
            step = StepInput([], [], [], [], [], draft=DRAFT_ON_DRAFT, greedy=True)
            fed = steps[-1][1]
            for k, r in enumerate(going):
                pos = r.num_computed + j - 1  # the position after the previous draft token
                row = eng.rows.row(r.request_id)
                eng.rows.updates(row, r.pages, step.page_updates)
                step.ids.append(-1 - fed[r.request_id])  # the previous draft token
                step.positions.append(pos)
                step.hidden_rows.append(rows_of[r.request_id])
                step.rows.append(row)
                step.seq_lens.append(pos + 1)
                step.query_lens.append(1)
                step.logit_rows.append(k)
                rows_of[r.request_id] = k
            self._execute(step)
            steps.append(
                (eng.sampler.tokens.latest, {r.request_id: k for k, r in enumerate(going)})
            )
            drafting = going
        host = torch.cat([t for t, _ in steps]).tolist()  # the one sync
        base = 0
        drafts: dict[str, list[int]] = {}
        for tokens, where in steps:
            for rid, k in where.items():
                drafts.setdefault(rid, []).append(host[base + k])
            base += tokens.numel()
        self.drafts.update(drafts)
        if eng.policy is not None:
            longest = max(len(d) for d in drafts.values())
            eng.policy.observe_draft(time.perf_counter() - t_start, longest)

    def _length(self, req: Request, batch: int) -> int:
        """Draft tokens to compute for `req` (0: it does not decode next, or drafting does
        not pay: the engine's policy, with the draft model's own cost counted)."""
        if req.num_computed != req.num_tokens - 1:
            return 0
        room = self._room(req)
        policy = self.engine.policy
        return policy.length(req.request_id, batch, room) if policy is not None else room

    def _room(self, req: Request) -> int:
        """Draft tokens the request can still use (its max_tokens and the context)."""
        eng = self.engine
        return min(
            req.max_tokens - len(req.output_ids) - 1,
            eng.max_model_len - req.num_tokens - 1,
            self.num_tokens,
        )

    def _reserve(self, req: Request, j: int) -> bool:
        """Pages for draft position num_computed + j - 1 (the next target step needs them
        too); False when none are free."""
        return self.engine.scheduler.reserve(req, req.num_computed + j)

    def _execute(self, step: StepInput) -> None:
        """Run a draft step whose greedy tokens stay in the engine's sampler."""
        logits = self.engine.executor.execute(step)
        assert logits is not None
