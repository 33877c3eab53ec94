"""The engine's synchronous core: requests in, token streams out.

`LLMEngine` schedules each step, has it executed (on one rank or a tensor-parallel group),
samples, detokenizes incrementally and checks stops. `AsyncEngine` (async_engine.py) runs it
for the HTTP front end, `LLM` (offline.py) for batch generation.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from moeserve.config import EngineConfig, SchedulerConfig
from moeserve.engine.detokenizer import IncrementalDetokenizer
from moeserve.engine.draft import DraftModelProposer
from moeserve.engine.errors import EngineInputError
from moeserve.engine.executor import Executor
from moeserve.engine.kv_blocks import PageAllocator
from moeserve.engine.metrics import EngineMetrics
from moeserve.engine.outputs import RequestOutput, TokenLogprob
from moeserve.engine.profile import DecodeProfiler
from moeserve.engine.request import Request, validate_images, validate_request
from moeserve.engine.scheduler import ScheduledBatch, Scheduler
from moeserve.engine.step import RowAllocator, StepInput
from moeserve.engine.worker import build_executor
from moeserve.multimodal.kimi import PAD_TOKEN, KimiImageProcessor, MediaProcessorConfig
from moeserve.sampling import SamplingParams, is_device_error
from moeserve.spec import make_proposer
from moeserve.spec.base import Proposer
from moeserve.spec.policy import DraftPolicy

# CPU default of --long-prefill-token-threshold: requests behind a long prompt wait for one
# chunk of it, not all of it. Measured on 2 cores (SmolLM2, 4k-token prompt): 1,024-token
# chunks prefill as fast as 2,048 (504 vs 501 tok/s), 512 costs 12% (443 tok/s)
CPU_LONG_PREFILL_TOKENS = 1024

log = logging.getLogger(__name__)


@dataclass
class _Live:
    """Per-request state kept next to the scheduler's `Request`."""

    req: Request
    detok: IncrementalDetokenizer
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    sent_prompt_logprobs: bool = False


@dataclass
class _StepPlan:
    """Where a step's logits rows go: batch index -> its sampling row, and its prompt-logprob
    rows (first row, the prompt positions they score)."""

    sample: dict[int, int] = field(default_factory=dict)
    prompt: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # i -> (row, start, n)
    # i -> its draft (verified on rows sample[i] .. sample[i] + len(draft))
    verify: dict[int, list[int]] = field(default_factory=dict)
    # i -> (its first token's row in the step, its first position, its token count)
    spans: dict[int, tuple[int, int, int]] = field(default_factory=dict)


@dataclass
class _Inflight:
    """An overlapped step: launched, its greedy tokens on their way to `host`."""

    batch: ScheduledBatch
    plan: _StepPlan
    host: torch.Tensor  # int64 [len(plan.sample)] pinned, filled when `event` completes
    event: torch.cuda.Event | None
    slot_of: dict[str, int]  # request id -> its row in the step's sampled tokens


class LLMEngine:
    """Scheduler, page allocator and sampler (rank 0) over an `Executor` that runs steps on
    one or more ranks."""

    def __init__(self, config: EngineConfig, executor: Executor) -> None:
        self.config = config
        self.executor = executor
        self.runner = executor.runner
        self.loaded = self.runner.loaded
        self.tokenizer = self.loaded.tokenizer
        cache = config.cache
        self.num_pages = self.runner.num_pages
        self.max_model_len = self.runner.max_model_len
        self.allocator = PageAllocator(self.num_pages, cache.page_size, cache.enable_prefix_caching)
        self.scheduler = Scheduler(self._scheduler_config(config), self.allocator)
        self.rows = RowAllocator(config.scheduler.max_num_seqs)
        self.eos_ids = set(self.loaded.config.eos_token_ids)
        self.profiler = (
            DecodeProfiler(config.profile_decode, self.runner.device)
            if config.profile_decode
            else None
        )
        # ids a request may name or receive: the tokenizer's (the LM head may be padded)
        self.vocab_limit = self.runner.vocab_limit
        # the rank's one sampler: the runner's `greedy` steps leave their tokens in it
        self.sampler = self.runner.sampler
        self.metrics = EngineMetrics()
        self.live: dict[str, _Live] = {}
        # requests that failed alone in the last steps: (request id, error); the caller takes
        # them (`take_failures`) and fails those requests' streams
        self.failures: list[tuple[str, Exception]] = []
        spec = config.speculative_config
        self.proposer: Proposer | None = None
        if spec is not None and spec.method in ("mtp", "eagle3"):  # a draft model
            self.proposer = DraftModelProposer(self, spec.num_speculative_tokens)
        elif spec is not None:
            self.proposer = make_proposer(spec)
        self.policy = (
            DraftPolicy(spec.num_speculative_tokens, spec.adaptive) if spec is not None else None
        )
        overlap = config.overlap_schedule
        # a draft model drafts from every step's outputs on the host, so it never overlaps;
        # host proposers overlap the steps that verify nothing (see `_propose`)
        self.overlap = (
            self.runner.device.type == "cuda" if overlap is None else overlap
        ) and not isinstance(self.proposer, DraftModelProposer)
        self._inflight: _Inflight | None = None
        # two buffers: a step's tokens land in one while the host still reads the other's
        self._host_ids = torch.empty(
            2,
            config.scheduler.max_num_seqs,
            dtype=torch.int64,
            pin_memory=self.runner.device.type == "cuda",
        )
        self._host_turn = 0
        # images: the model's encoder (rank 0 holds it), its placeholder id and preprocessing
        vision = self.loaded.config.vision
        if getattr(self.runner.model, "vision", None) is None:
            vision = None
        self.image_token_id = None
        self.image_processor = None
        if vision is not None:
            # the tokenizer's own <|media_pad|> id (the published checkpoints' config names
            # the same one; test tokenizers shift it with their other special tokens)
            pad = self.tokenizer.encode(PAD_TOKEN)
            self.image_token_id = pad[0] if len(pad) == 1 else vision.media_placeholder_token_id
            media = MediaProcessorConfig.for_model(vision, config.model)
            self.image_processor = KimiImageProcessor(media, self.image_token_id)

    def _scheduler_config(self, config: EngineConfig) -> SchedulerConfig:
        """The scheduler's settings with the device's defaults filled in."""
        sched = config.scheduler
        if sched.long_prefill_token_threshold is None:
            limit = CPU_LONG_PREFILL_TOKENS if self.runner.device.type == "cpu" else 0
            sched = replace(sched, long_prefill_token_threshold=limit)
        return sched

    # ---- requests ----------------------------------------------------------------------------
    def validate(
        self, prompt_ids: list[int], params: SamplingParams, images: list | None = None
    ) -> int:
        """Check a request (`validate_request`, `validate_images`); return its resolved
        max_tokens."""
        validate_images(prompt_ids, images or [], self.image_token_id)
        return validate_request(
            prompt_ids, params, self.vocab_limit, tuple(sorted(self.eos_ids)), self.max_model_len
        )

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        images: list | None = None,
    ) -> None:
        """`images`: `ImageInput`s whose embeddings replace their placeholder tokens."""
        if request_id in self.live:
            raise EngineInputError(f"request id {request_id!r} is already in use.")
        max_tokens = self.validate(prompt_ids, params, images)
        req = Request(request_id, list(prompt_ids), params, max_tokens, images=list(images or []))
        self.live[request_id] = _Live(
            req, IncrementalDetokenizer(self.tokenizer, req.prompt_ids, params)
        )
        self.metrics.on_arrival(len(prompt_ids))
        if self.proposer is not None:
            self.proposer.start(request_id, req.prompt_ids)
        self.scheduler.add(req)

    def abort(self, request_id: str) -> RequestOutput | None:
        live = self.live.pop(request_id, None)
        if live is None:
            return None
        live.req.finish("abort")
        self.scheduler.finish(live.req)
        self._forget(request_id)
        self.metrics.on_finish("abort")
        return self._output(live, "", [], finished=True)

    def has_unfinished(self) -> bool:
        return bool(self.live)

    def _forget(self, request_id: str) -> None:
        self.sampler.forget(request_id)
        self.rows.release(request_id)
        if self.proposer is not None and self.policy is not None:
            self.proposer.finish(request_id)
            self.policy.forget(request_id)

    # ---- speculative decoding ------------------------------------------------------------------
    def _propose(self, prev: _Inflight | None) -> tuple[_Inflight | None, list[RequestOutput]]:
        """Drafts for the running requests that decode next step, as long as the policy
        finds worth verifying and as their max_tokens and the context leave room for.

        A request whose last token is still on the GPU (an overlapped step, `prev`) cannot
        be drafted for: if the policy wants a draft for one, `prev` is completed first (its
        outputs returned), so overlapping costs nothing while the policy drafts nothing and
        one wait whenever it drafts again. Returns what is left in flight and the outputs."""
        assert self.proposer is not None and self.policy is not None
        running = self.scheduler.running
        decoding = [r for r in running if r.num_to_compute == 1]
        if isinstance(self.proposer, DraftModelProposer):  # it asked the policy already
            wanted = {r.request_id: self._draft_room(r) for r in decoding}
        else:
            wanted = {
                r.request_id: self.policy.length(r.request_id, len(running), self._draft_room(r))
                for r in decoding
            }
        outputs: list[RequestOutput] = []
        if prev is not None and any(r.pending and wanted[r.request_id] > 0 for r in decoding):
            outputs, prev = self._complete(prev), None
        for req in decoding:
            k = min(wanted[req.request_id], self._draft_room(req))
            if k <= 0 or req.pending or req.finished:
                req.draft = []
                continue
            req.draft = self.proposer.propose(req.request_id, k)[:k]
        return prev, outputs

    def _draft_room(self, req: Request) -> int:
        """Draft tokens `req` has room for: its max_tokens and the context less one token."""
        return min(
            req.max_tokens - len(req.output_ids) - 1 - req.pending,
            self.max_model_len - req.num_tokens - 1 - req.pending,
        )

    def _verify(
        self,
        batch: ScheduledBatch,
        plan: _StepPlan,
        logits: torch.Tensor | None,
        failed: dict[int, Exception],
    ) -> tuple[dict[int, list[int]], dict[int, list[TokenLogprob]]]:
        """Accept or reject the step's drafts (`Sampler.verify`): per batch index, the tokens
        it emits and, if asked, their logprobs. Rows that fail alone go to `failed`."""
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
            assert self.policy is not None
            self.policy.observe(reqs[j].request_id, drafted, accepted)
        return tokens, lps

    def _settle_drafts(
        self, batch: ScheduledBatch, plan: _StepPlan, emitted: dict[int, list[int]]
    ) -> None:
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

    def shutdown(self) -> None:
        self.executor.shutdown()

    # ---- one step ------------------------------------------------------------------------------
    def _build_step(
        self, batch: ScheduledBatch, prev: _Inflight | None = None
    ) -> tuple[StepInput, _StepPlan]:
        """The step's inputs, single-token sequences first (the attention backends' order),
        and where each sequence's logits rows are. Host work grows with the step's new
        tokens and pages, not with the sequences' lengths.

        A request verifying a draft of k tokens enters as k + 1 one-token rows that share its
        page-table row, row j seeing the cache up to its own position: the decode kernels
        (and CUDA graphs) compute them, causal among themselves, exactly as decoding them
        one per step would."""
        step = StepInput([], [], [], [], [])
        plan = _StepPlan()
        reqs, counts = batch.requests, batch.num_tokens
        order = [i for i, n in enumerate(counts) if n == 1]
        order += [i for i, n in enumerate(counts) if n != 1 and reqs[i].draft]
        order += [i for i, n in enumerate(counts) if n != 1 and not reqs[i].draft]
        for i in order:
            req, n = reqs[i], counts[i]
            start = req.num_computed
            t0 = len(step.ids)
            known = req.token_slice(start, min(start + n, req.num_tokens))
            step.ids.extend(known)
            row = self.rows.row(req.request_id)
            self.rows.updates(row, req.pages, step.page_updates)
            step.positions.extend(range(start, start + n))
            plan.spans[i] = (t0, start, n)
            for im in req.images:  # image tokens of this chunk (a chunk may cut an image)
                a, b = max(start, im.offset), min(start + n, im.end)
                if a < b:
                    step.embed_rows.extend(range(t0 + a - start, t0 + b - start))
                    step.images.append((im, a - im.offset, b - a))
            if req.draft:  # the last token, then the draft to verify, one row each
                step.ids.extend(req.draft)
                step.rows.extend([row] * n)
                step.seq_lens.extend(range(start + 1, start + n + 1))
                step.query_lens.extend([1] * n)
                plan.sample[i] = len(step.logit_rows)
                plan.verify[i] = list(req.draft)
                step.logit_rows.extend(range(t0, t0 + n))
                continue
            if len(known) < n:  # its last token is still on the GPU: a placeholder
                step.ids.append(-1 - prev.slot_of[req.request_id])
            step.rows.append(row)
            step.seq_lens.append(start + n)
            step.query_lens.append(n)
            if req.params.prompt_logprobs is not None and start < len(req.prompt_ids):
                # row j predicts token start+j+1; stay within the prompt
                count = min(start + n, len(req.prompt_ids) - 1) - start
                plan.prompt[i] = (len(step.logit_rows), start, max(0, count))
                step.logit_rows.extend(range(t0, t0 + max(0, count)))
            if batch.samples(i) and len(req.output_ids) + req.pending < req.max_tokens:
                plan.sample[i] = len(step.logit_rows)
                step.logit_rows.append(t0 + n - 1)
        return step, plan

    def step(self) -> list[RequestOutput]:
        t_entry = time.perf_counter()
        outputs: list[RequestOutput] = []
        prev, self._inflight = self._inflight, None
        t_draft = time.perf_counter()
        if self.proposer is not None:
            prev, outputs = self._propose(prev)
        t_draft = time.perf_counter() - t_draft
        # max_tokens == 0 (prompt logprobs only) still needs its prefill; others finish here
        batch = self.scheduler.schedule()
        for req in batch.preempted:
            self.rows.release(req.request_id)
        self.metrics.on_preempt(len(batch.preempted))
        if batch.empty:
            return outputs + self._complete(prev) if prev is not None else outputs
        t0 = time.perf_counter()
        step, plan = self._build_step(batch, prev)
        step.greedy = self.overlap and self._overlappable(batch)
        t_exec_start = time.perf_counter()
        logits = self.executor.execute(step)
        t_exec = time.perf_counter() - t_exec_start
        if step.greedy:  # step N+1 is queued: now the host handles step N's outputs
            self._inflight = self._launch_copy(batch, plan, t0)
            if prev is not None:
                outputs += self._complete(prev)
            if self.profiler is not None and self.profiler.active and step.is_decode_only:
                self._profile_step(step, time.perf_counter() - t_entry, t_exec, len(batch.requests))
            return outputs
        if prev is not None:  # its tokens are this step's history (penalties, stop checks)
            outputs += self._complete(prev)
        failed: dict[int, Exception] = {}
        tokens, lps = self._sample(batch, plan, logits, failed)
        t_accept = time.perf_counter()
        emitted, emitted_lps = self._verify(batch, plan, logits, failed)
        t_accept = time.perf_counter() - t_accept
        prompt_lps = self._prompt_logprobs(batch, plan, logits, failed)
        if self.policy is not None and all(
            n == 1 + len(plan.verify.get(i, ())) for i, n in enumerate(batch.num_tokens)
        ):  # a decode / verify step: its time is what drafting costs
            self.policy.observe_step(sum(batch.num_tokens), time.perf_counter() - t_exec_start)
        self.scheduler.after_step(batch)
        self._settle_drafts(batch, plan, emitted)
        self.metrics.on_step(time.perf_counter() - t0, sum(batch.num_tokens))
        for i, req in enumerate(batch.requests):
            live = self.live.get(req.request_id)
            if live is None or req.finished:
                continue  # it ended with the previous (overlapped) step's token
            if i in failed:
                self._fail(live, failed[i])
                continue
            if i in emitted:
                out = self._own_work(
                    live, self._append_tokens, live, emitted[i], emitted_lps.get(i)
                )
            else:
                out = self._own_work(live, self._emit, live, i, tokens, lps, prompt_lps)
            if out is not None:
                outputs.append(out)
        if isinstance(self.proposer, DraftModelProposer):  # its drafting is the step's
            t_model = time.perf_counter()
            self.proposer.after_step(batch, plan.spans, emitted)
            t_draft += time.perf_counter() - t_model
        if self.profiler is not None and self.profiler.active and step.is_decode_only:
            if self.proposer is not None:
                drafted = sum(len(d) for d in plan.verify.values())
                emitted_n = sum(len(t) for t in emitted.values()) + len(tokens)
                self.profiler.record_spec(t_draft, t_accept, drafted, emitted_n)
            self._profile_step(step, time.perf_counter() - t_entry, t_exec, len(batch.requests))
        return outputs

    # ---- overlap scheduling ------------------------------------------------------------------
    def _overlappable(self, batch: ScheduledBatch) -> bool:
        """Whether the batch's tokens may stay on the GPU until the next step is queued: every
        request greedy with no per-token host work before its next step (logprobs,
        penalties, bias, min_tokens), and room for two more tokens (a request that ends
        with this step's token may compute one more, which is dropped)."""
        for req in batch.requests:
            p = req.params
            if req.draft:  # its accepted tokens decide what the next step computes
                return False
            if not p.greedy or p.logprobs is not None or p.prompt_logprobs is not None:
                return False
            if p.needs_penalties or getattr(p, "logit_bias", None) or p.min_tokens:
                return False
            ahead = req.pending + 2
            if req.num_tokens + ahead > self.max_model_len:
                return False
            if len(req.output_ids) + ahead > req.max_tokens:
                return False
        return True

    def _launch_copy(self, batch: ScheduledBatch, plan: _StepPlan, t0: float) -> _Inflight:
        """Account the launched step (its sampled tokens are pending) and queue the copy of
        those tokens to the host."""
        self.scheduler.after_step(batch)
        slot_of = {}
        for i, j in plan.sample.items():
            req = batch.requests[i]
            req.pending += 1
            slot_of[req.request_id] = j
        k = len(plan.sample)
        self._host_turn ^= 1
        host = self._host_ids[self._host_turn, :k]
        host.copy_(self.sampler.device_tokens()[:k], non_blocking=True)
        event = None
        if self.runner.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self.metrics.on_step(time.perf_counter() - t0, sum(batch.num_tokens))
        return _Inflight(batch, plan, host, event, slot_of)

    def _complete(self, done: _Inflight) -> list[RequestOutput]:
        """The outputs of an overlapped step, once its tokens reached the host."""
        if done.event is not None:
            done.event.synchronize()
        tokens = done.host.tolist()
        outputs = []
        for i, j in done.plan.sample.items():
            req = done.batch.requests[i]
            req.pending -= 1
            live = self.live.get(req.request_id)
            if live is None or req.finished:
                continue  # aborted, or ended with an earlier token: this one is dropped
            # (a request preempted since gets its token too: it is recomputed later)
            out = self._own_work(live, self._append_token, live, tokens[j], None)
            if out is not None:
                outputs.append(out)
        return outputs

    def _own_work(
        self, live: _Live, work: Callable[..., RequestOutput | None], *args: object
    ) -> RequestOutput | None:
        """One request's own work (sampling bookkeeping, detokenizing, stop checks): an error
        there fails that request alone; a device error poisons the step and propagates."""
        try:
            return work(*args)
        except Exception as e:
            if is_device_error(e):
                raise
            self._fail(live, e)
            return None

    def _profile_step(
        self, step: StepInput, seconds: float, forward_seconds: float, batch: int
    ) -> None:
        """--profile-decode: count this served decode step of `batch` sequences; after N,
        the labelled eager rerun of this step (idempotent: same cache rows) and the
        table."""
        prof = self.profiler
        prof.record(batch, seconds, forward_seconds)
        if prof.done_timing():
            rerun = replace(step, eager=True, greedy=False)  # leaves the sampled tokens be
            result = prof.finish(self.runner.model, lambda: self.executor.execute(rerun))
            log.warning("%s", result.table())

    def _emit(
        self,
        live: _Live,
        i: int,
        tokens: dict[int, int],
        lps: dict[int, TokenLogprob],
        prompt_lps: dict[int, list[TokenLogprob | None]],
    ) -> RequestOutput | None:
        """What batch row i's request gets from this step (None: a prompt chunk)."""
        req = live.req
        plp = prompt_lps.get(i)
        if plp is not None:
            live.prompt_logprobs = (live.prompt_logprobs or []) + plp
        if req.num_computed < req.num_tokens:
            return None  # prompt chunk: nothing to emit yet
        token = tokens.get(i)
        if token is None:  # max_tokens reached without sampling (max_tokens == 0)
            req.finish("length")
            return self._finish(live, "", [])
        return self._append_token(live, token, lps.get(i))

    def _fail(self, live: _Live, error: Exception) -> None:
        """Fail one request alone: free its pages and state, report it (`take_failures`)."""
        req = live.req
        log.error(
            "request %s failed (the engine goes on): %s: %s",
            req.request_id,
            type(error).__name__,
            str(error).splitlines()[0] if str(error) else "",
        )
        log.debug("request %s failure", req.request_id, exc_info=error)
        req.finish("error")
        self.scheduler.finish(req)
        self._forget(req.request_id)
        self.live.pop(req.request_id, None)
        self.metrics.on_finish("error")
        self.failures.append((req.request_id, error))

    def take_failures(self) -> list[tuple[str, Exception]]:
        """Requests that failed alone since the last call (already released)."""
        out, self.failures = self.failures, []
        return out

    def _sample(
        self,
        batch: ScheduledBatch,
        plan: _StepPlan,
        logits: torch.Tensor | None,
        failed: dict[int, Exception],
    ) -> tuple[dict[int, int], dict[int, TokenLogprob]]:
        """One batched sampler pass; rows that fail alone go to `failed`."""
        if not plan.sample or logits is None:
            return {}, {}
        idx = list(plan.sample)
        reqs = [batch.requests[i] for i in idx]
        res = self.sampler(
            logits[list(plan.sample.values())],
            [r.params for r in reqs],
            [r.request_id for r in reqs],
            [r.prompt_ids for r in reqs],
            [r.output_ids for r in reqs],
        )
        tokens: dict[int, int] = {}
        lps: dict[int, TokenLogprob] = {}
        for j, i in enumerate(idx):
            token = res.token_ids[j]
            if j in res.errors or token is None:
                failed[i] = res.errors.get(j) or RuntimeError("sampling failed")
                continue
            tokens[i] = token
            if res.logprobs[j] is not None:
                lp, top = res.logprobs[j]
                lps[i] = TokenLogprob(token, lp, top)
        return tokens, lps

    def _prompt_logprobs(
        self,
        batch: ScheduledBatch,
        plan: _StepPlan,
        logits: torch.Tensor | None,
        failed: dict[int, Exception],
    ) -> dict[int, list[TokenLogprob | None]]:
        """Logprob of each prompt token given what precedes it (None for the first), over
        the tokenizer's vocabulary; a request whose computation fails goes to `failed`."""
        out: dict[int, list[TokenLogprob | None]] = {}
        for i, span in plan.prompt.items():
            try:
                out[i] = self._prompt_logprobs_of(batch.requests[i], span, logits)
            except Exception as e:
                if is_device_error(e):
                    raise
                failed[i] = e
        return out

    def _prompt_logprobs_of(
        self, req: Request, span: tuple[int, int, int], logits: torch.Tensor | None
    ) -> list[TokenLogprob | None]:
        row, start, count = span
        entries: list[TokenLogprob | None] = [None] if start == 0 else []
        if count > 0 and logits is not None:
            targets = req.prompt_ids[start + 1 : start + count + 1]
            scored = self.sampler.logprobs_of(
                logits[row : row + count], targets, req.params.prompt_logprobs or 0
            )
            for tok, (lp, top) in zip(targets, scored, strict=True):
                entries.append(TokenLogprob(tok, lp, top))
        return entries

    def _append_token(self, live: _Live, token: int, lp: TokenLogprob | None) -> RequestOutput:
        return self._append_tokens(live, [token], [lp] if lp is not None else None)

    def _append_tokens(
        self, live: _Live, tokens: list[int], lps: list[TokenLogprob] | None
    ) -> RequestOutput:
        """Append a step's tokens to the request in order, as decoding them one by one
        would: the first stop (EOS, stop id, stop string, max_tokens, the context) ends the
        request there and the tokens after it are dropped."""
        req = live.req
        p = req.params
        text = ""
        appended: list[int] = []
        for n, token in enumerate(tokens):
            req.output_ids.append(token)
            appended.append(token)
            self.metrics.on_token()
            if lps is not None:
                live.pending_logprobs.append(lps[n])
            stop_token = (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids
            if len(req.output_ids) <= p.min_tokens:
                stop_token = False
            piece, stop_str = live.detok.add(token, final=stop_token)
            text += piece
            if stop_str is not None:
                req.finish("stop", stop_str)
            elif stop_token:
                req.finish("stop", None if token in self.eos_ids and not p.ignore_eos else token)
            elif len(req.output_ids) >= req.max_tokens or req.num_tokens >= self.max_model_len:
                req.finish("length")
                text += live.detok.flush()
            if req.finished:
                break
        if self.proposer is not None:  # before `_finish`: a finished output feeds the suffix cache
            self.proposer.extend(req.request_id, appended)
        if req.finished:
            return self._finish(live, text, appended)
        return self._output(live, text, appended, finished=False)

    def _finish(self, live: _Live, text: str, tokens: list[int]) -> RequestOutput:
        req = live.req
        self.scheduler.finish(req)
        self._forget(req.request_id)
        self.live.pop(req.request_id, None)
        self.metrics.on_finish(req.finish_reason or "stop")
        return self._output(live, text, tokens, finished=True)

    def _output(self, live: _Live, text: str, tokens: list[int], finished: bool) -> RequestOutput:
        req = live.req
        lps = None
        if req.params.logprobs is not None:
            lps, live.pending_logprobs = live.pending_logprobs, []
        plps = None
        if req.params.prompt_logprobs is not None and not live.sent_prompt_logprobs:
            plps, live.sent_prompt_logprobs = live.prompt_logprobs or [], True
        return RequestOutput(
            request_id=req.request_id,
            text=text,
            token_ids=tokens,
            logprobs=lps,
            finished=finished,
            finish_reason=req.finish_reason if finished else None,
            num_prompt_tokens=len(req.prompt_ids),
            num_output_tokens=len(req.output_ids),
            num_cached_tokens=req.num_cached_tokens,
            stop_reason=req.stop_reason if finished else None,
            prompt_logprobs=plps,
        )

    def metrics_text(self) -> str:
        text = self.metrics.render(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            pages_used=self.num_pages - self.allocator.num_free,
            pages_total=self.num_pages,
            prefix=self.allocator.stats,
        )
        if self.profiler is not None and self.profiler.result is not None:
            text += self.profiler.result.prometheus()
        return text


def build_engine(
    model: str | None = None, *, config: EngineConfig | None = None, **settings
) -> LLMEngine:
    """An engine for `model` from `config`, or from keyword settings (any setting of the
    `EngineConfig` groups: `max_num_seqs=8`, `tensor_parallel_size=2`, `device="cpu"`...)."""
    cfg = config or EngineConfig.from_settings(model, **settings)
    return LLMEngine(cfg, build_executor(cfg))
