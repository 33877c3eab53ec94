"""Drafts from a draft model that reads the target's hidden states (DeepSeek's MTP module).

After every target step the draft model catches up on the positions whose next token is now
known: a prompt chunk's positions, a decode row's, and a verified draft's accepted ones (the
rejected positions are left for later steps to overwrite). At position i it reads the target's
final hidden state h_i and token i + 1, and writes its own latent cache on the sequence's
pages; its output at the last position predicts the first draft token. Further draft tokens
come from running it again, one position at a time, on its own output (its cache rows there
are overwritten by the next catch-up). Draft steps are `StepInput`s with `draft` set, so the
other ranks of a tensor-parallel group run them too. Drafts are greedy.
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
from moeserve.spec.policy import DraftPolicy


class EngineParts(Protocol):
    """What drafting needs of the engine (its core implements it)."""

    live: dict[str, Any]
    rows: RowAllocator
    executor: Executor
    scheduler: Scheduler
    policy: DraftPolicy | None
    max_model_len: int
    vocab_limit: int


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
        step = StepInput([], [], [], [], [], draft=DRAFT_ON_TARGET)
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
        tokens = self._greedy(eng.executor.execute(step))
        drafts = {r.request_id: [tokens[last_row[r.request_id]]] for r in drafting}
        # the row of the latest draft step's output each request's next draft step reads
        rows_of = {r.request_id: token_row[r.request_id] for r in drafting}
        for j in range(1, self.num_tokens):
            going = [r for r in drafting if want[r.request_id] > j and self._reserve(r, j)]
            if not going:
                break
            step = StepInput([], [], [], [], [], draft=DRAFT_ON_DRAFT)
            for k, r in enumerate(going):
                pos = r.num_computed + j - 1  # the position after the previous draft token
                row = eng.rows.row(r.request_id)
                eng.rows.updates(row, r.pages, step.page_updates)
                step.ids.append(drafts[r.request_id][-1])
                step.positions.append(pos)
                step.hidden_rows.append(rows_of[r.request_id])
                step.rows.append(row)
                step.seq_lens.append(pos + 1)
                step.query_lens.append(1)
                step.logit_rows.append(k)
                rows_of[r.request_id] = k
            tokens = self._greedy(eng.executor.execute(step))
            for k, r in enumerate(going):
                drafts[r.request_id].append(tokens[k])
            drafting = going
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

    def _greedy(self, logits: torch.Tensor | None) -> list[int]:
        assert logits is not None
        return logits[:, : self.engine.vocab_limit].argmax(dim=-1).tolist()
