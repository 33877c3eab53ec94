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
from moeserve.engine.overlap import HostTokens, Inflight, overlappable
from moeserve.engine.profile import DecodeProfiler
from moeserve.engine.request import Request, validate_images, validate_request
from moeserve.engine.scheduler import ScheduledBatch, Scheduler
from moeserve.engine.speculative import SpeculativeSteps
from moeserve.engine.step import RowAllocator, StepInput
from moeserve.engine.step_builder import StepPlan, build_step
from moeserve.engine.step_sampling import prompt_logprobs, sample_step
from moeserve.engine.worker import build_executor
from moeserve.loader.base import LoadedModel
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


class LLMEngine:
    """Scheduler, page allocator and sampler (rank 0) over an `Executor` that runs steps on
    one or more ranks."""

    def __init__(self, config: EngineConfig, executor: Executor) -> None:
        self.config, self.executor = config, executor
        self.runner = executor.runner
        self.loaded = self.runner.loaded
        self.tokenizer = self.loaded.tokenizer
        self.num_pages = self.runner.num_pages
        self.max_model_len = self.runner.max_model_len
        cache = config.cache
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
        self._build_speculation(config)
        overlap = config.overlap_schedule
        # a draft model drafts from every step's outputs on the host, so it never overlaps;
        # host proposers overlap the steps that verify nothing (see `SpeculativeSteps`)
        self.overlap = (
            self.runner.device.type == "cuda" if overlap is None else overlap
        ) and not isinstance(self.proposer, DraftModelProposer)
        self._inflight: Inflight | None = None
        self.host_tokens = HostTokens(config.scheduler.max_num_seqs, self.runner.device)
        self.image_token_id, self.image_processor = _image_inputs(
            self.loaded, self.runner.model, config.model
        )

    def _build_speculation(self, config: EngineConfig) -> None:
        """The proposer (a draft model's, or a host one's), its draft policy, and the
        speculative steps over them (all None without --speculative-config)."""
        spec = config.speculative_config
        self.proposer: Proposer | None = None
        self.policy: DraftPolicy | None = None
        self.spec: SpeculativeSteps | None = None
        if spec is None:
            return
        if spec.method in ("mtp", "eagle3"):  # a draft model
            self.proposer = DraftModelProposer(self, spec.num_speculative_tokens)
        else:
            self.proposer = make_proposer(spec)
        self.policy = DraftPolicy(spec.num_speculative_tokens, spec.adaptive)
        self.spec = SpeculativeSteps(
            self.proposer,
            self.policy,
            self.scheduler,
            self.rows,
            self.sampler,
            self.metrics,
            self.max_model_len,
        )

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

    def shutdown(self) -> None:
        self.executor.shutdown()

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t_entry = time.perf_counter()
        outputs: list[RequestOutput] = []
        prev, self._inflight = self._inflight, None
        t_draft = time.perf_counter()
        if self.spec is not None:
            prev, outputs = self.spec.propose(prev, self._complete)
        t_draft = time.perf_counter() - t_draft
        # max_tokens == 0 (prompt logprobs only) still needs its prefill; others finish here
        batch = self.scheduler.schedule()
        for req in batch.preempted:
            self.rows.release(req.request_id)
        self.metrics.on_preempt(len(batch.preempted))
        if batch.empty:
            return outputs + self._complete(prev) if prev is not None else outputs
        t0 = time.perf_counter()
        step, plan = build_step(batch, self.rows, prev.slot_of if prev is not None else None)
        step.greedy = self.overlap and overlappable(batch, self.max_model_len)
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
        tokens, lps = sample_step(self.sampler, batch, plan, logits, failed)
        t_accept = time.perf_counter()
        emitted, emitted_lps = (
            self.spec.verify(batch, plan, logits, failed) if self.spec is not None else ({}, {})
        )
        t_accept = time.perf_counter() - t_accept
        prompt_lps = prompt_logprobs(self.sampler, batch, plan, logits, failed)
        if self.policy is not None and all(
            n == 1 + len(plan.verify.get(i, ())) for i, n in enumerate(batch.num_tokens)
        ):  # a decode / verify step: its time is what drafting costs
            self.policy.observe_step(sum(batch.num_tokens), time.perf_counter() - t_exec_start)
        self.scheduler.after_step(batch)
        if self.spec is not None:
            self.spec.settle(batch, plan, emitted)
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
    def _launch_copy(self, batch: ScheduledBatch, plan: StepPlan, t0: float) -> Inflight:
        """Account the launched step (its sampled tokens are pending) and queue the copy of
        those tokens to the host."""
        self.scheduler.after_step(batch)
        inflight = self.host_tokens.launch(batch, plan, self.sampler.tokens.latest)
        self.metrics.on_step(time.perf_counter() - t0, sum(batch.num_tokens))
        return inflight

    def _complete(self, done: Inflight) -> list[RequestOutput]:
        """The outputs of an overlapped step, once its tokens reached the host."""
        tokens = done.tokens()
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


def _image_inputs(
    loaded: LoadedModel, model: torch.nn.Module, model_path: str | None
) -> tuple[int | None, KimiImageProcessor | None]:
    """The image placeholder id and the image processor of a model with a vision encoder
    (rank 0 holds it), else (None, None)."""
    vision = loaded.config.vision
    if vision is None or getattr(model, "vision", None) is None:
        return None, None
    # the tokenizer's own <|media_pad|> id (the published checkpoints' config names the same
    # one; test tokenizers shift it with their other special tokens)
    pad = loaded.tokenizer.encode(PAD_TOKEN)
    token_id = pad[0] if len(pad) == 1 else vision.media_placeholder_token_id
    media = MediaProcessorConfig.for_model(vision, model_path)
    return token_id, KimiImageProcessor(media, token_id)


def build_engine(
    model: str | None = None, *, config: EngineConfig | None = None, **settings
) -> LLMEngine:
    """An engine for `model` from `config`, or from keyword settings (any setting of the
    `EngineConfig` groups: `max_num_seqs=8`, `tensor_parallel_size=2`, `device="cpu"`...)."""
    cfg = config or EngineConfig.from_settings(model, **settings)
    return LLMEngine(cfg, build_executor(cfg))
