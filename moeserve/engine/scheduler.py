"""Continuous batching with chunked prefill and preemption by recompute (policy only).

Each step has a token budget. Running requests go first (one token each when decoding, the
next chunk when a prompt is still being prefilled), then waiting requests in arrival order,
their prompts cut into chunks to fit the budget. With `long_prefill_token_threshold` set, no
prompt takes more than that many tokens of a step, so a long prompt leaves room for the
requests that arrive behind it (vLLM's option of the same name). When pages run out, the
most recently arrived running request is preempted: its pages are released and it goes back
to the head of the waiting queue, to be recomputed (prompt + what it generated) later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from moeserve.config import SchedulerConfig
from moeserve.engine.kv_blocks import PageAllocator
from moeserve.engine.request import Request, Status


@dataclass
class ScheduledBatch:
    requests: list[Request] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # new tokens computed per request
    preempted: list[Request] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.requests

    def samples(self, i: int) -> bool:
        """Whether request i reaches the end of its known tokens (and of its draft) this
        step, so it samples."""
        r = self.requests[i]
        return r.num_computed + self.num_tokens[i] == r.num_tokens + r.pending + len(r.draft)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, allocator: PageAllocator) -> None:
        self.cfg = cfg
        self.alloc = allocator
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def finish(self, req: Request) -> None:
        """Release a finished or aborted request (call after req.finish())."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.alloc.release(req.pages)
        req.pages = []

    # ---- one step ---------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.cfg.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk(req, budget)
            while not self._grow(req, n):
                if req.draft:  # pages are short: verify no draft before preempting anyone
                    req.draft = []
                    n = 1
                    continue
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is req:
                    break
            else:
                batch.requests.append(req)
                batch.num_tokens.append(n)
                budget -= n
                i += 1
        if batch.preempted:  # pages are short: do not admit new work this step
            return batch
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            if req.num_computed == 0 and not req.pages:
                self._reuse_prefix(req)
            n = self._chunk(req, budget)
            if not self._grow(req, n):
                self.alloc.release(req.pages)  # retry the prefix match next time
                req.pages, req.num_computed, req.num_cached_tokens = [], 0, 0
                req.hashed_pages, req.last_hash = 0, None
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            batch.requests.append(req)
            batch.num_tokens.append(n)
            budget -= n
        return batch

    def _chunk(self, req: Request, budget: int) -> int:
        """Tokens `req` computes this step: all it has, within the budget and the
        long-prefill threshold (decode steps, one token, are never cut). A decoding request
        verifies its draft beside its last token; the draft is cut to fit the budget."""
        if req.draft:
            if req.num_to_compute != 1:  # drafts only follow a decoding sequence
                req.draft = []
            else:
                req.draft = req.draft[: max(0, budget - 1)]
                return 1 + len(req.draft)
        n = min(req.num_to_compute, budget)
        limit = self.cfg.long_prefill_token_threshold
        return min(n, limit) if limit else n

    def _reuse_prefix(self, req: Request) -> None:
        if req.params.prompt_logprobs is not None:
            return  # prompt logprobs need every prompt position computed
        pages = self.alloc.match_prefix(req.hash_ids())
        req.pages = pages
        req.num_computed = len(pages) * self.alloc.page_size
        req.num_cached_tokens = req.num_computed
        req.hashed_pages = len(pages)
        req.last_hash = self.alloc.hash_of.get(pages[-1]) if pages else None

    def _grow(self, req: Request, n: int) -> bool:
        need = self.alloc.pages_for(req.num_computed + n) - len(req.pages)
        if need <= 0:
            return True
        pages = self.alloc.allocate(need)
        if pages is None:
            return False
        req.pages.extend(pages)
        return True

    def _preempt(self, req: Request, batch: ScheduledBatch) -> None:
        self.running.remove(req)
        self.alloc.release(req.pages)
        req.pages = []
        req.num_computed = 0
        req.num_cached_tokens = 0
        req.hashed_pages, req.last_hash = 0, None
        req.num_preemptions += 1
        req.draft = []
        req.status = Status.WAITING
        self.waiting.appendleft(req)
        batch.preempted.append(req)

    def reserve(self, req: Request, num_tokens: int) -> bool:
        """Pages for the request's first `num_tokens` positions, taken now (a draft model
        writes there before the next step would allocate them); False, and nothing taken,
        when too few are free. Preempts no one."""
        return self._grow(req, num_tokens - req.num_computed)

    def rollback(self, req: Request, rejected: int) -> None:
        """Forget the KV rows of `rejected` draft tokens the last step computed for `req` and
        free the pages only they used. Their cache entries are overwritten when the sequence
        reaches those positions again; no hash was ever recorded for them (`after_step`
        hashes known tokens only)."""
        req.num_computed -= rejected
        keep = self.alloc.pages_for(req.num_computed)
        if len(req.pages) > keep:
            self.alloc.release(req.pages[keep:])
            del req.pages[keep:]

    def after_step(self, batch: ScheduledBatch) -> None:
        """Advance computed counts and publish newly full pages to the prefix cache (each
        page hashed once: host work per step follows the new tokens, not the context)."""
        for req, n in zip(batch.requests, batch.num_tokens, strict=True):
            req.num_computed += n
            known = min(req.num_computed, req.num_tokens)  # pending tokens are not known yet
            req.hashed_pages, req.last_hash = self.alloc.register_full_pages(
                req.pages, req.hash_slice, known, req.hashed_pages, req.last_hash
            )
