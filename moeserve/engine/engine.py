"""The engine: requests in, token streams out.

`LLMEngine` is the synchronous core (scheduler + runner + incremental detokenizing + stop
checks). `AsyncEngine` runs it on its own thread and talks to the asyncio front end through
queues, so neither blocks the other. `LLM` is the offline API.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import gc
import json
import logging
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from moeserve.config import (
    DEFAULT_MAX_POSITIONS,
    ConfigError,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    parse_dtype,
    served_context_len,
)
from moeserve.engine.detokenizer import IncrementalDetokenizer
from moeserve.engine.errors import EngineDead, EngineInputError, RequestFailed
from moeserve.engine.executor import DistributedExecutor, Executor, start_watchdog
from moeserve.engine.kv_blocks import PageAllocator
from moeserve.engine.metrics import EngineMetrics
from moeserve.engine.outputs import RequestOutput, TokenLogprob
from moeserve.engine.profile import DecodeProfiler
from moeserve.engine.request import Request
from moeserve.engine.runner import ModelRunner
from moeserve.engine.scheduler import ScheduledBatch, Scheduler
from moeserve.engine.step import RowAllocator, StepInput
from moeserve.engine.worker import (
    Rendezvous,
    apply_safe_env,
    init_distributed,
    open_channel,
    rank_device,
    run_worker,
)
from moeserve.layers.kernel_plan import PlanSettings
from moeserve.loader import load_model, resolve_model_path
from moeserve.loader.base import Planning
from moeserve.parallel.groups import SINGLE, TPGroup
from moeserve.sampling import Sampler, SamplingError, SamplingParams, is_device_error

# CPU default of --long-prefill-token-threshold: requests behind a long prompt wait for one
# chunk of it, not all of it. Measured on 2 cores (SmolLM2, 4k-token prompt): 1,024-token
# chunks prefill as fast as 2,048 (504 vs 501 tok/s), 512 costs 12% (443 tok/s)
CPU_LONG_PREFILL_TOKENS = 1024

log = logging.getLogger(__name__)


# the engine's failure outcomes (re-exported: EngineInputError has always lived here)
__all__ = ["EngineDead", "EngineInputError", "RequestFailed"]


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
        self.sampler = Sampler(self.vocab_limit, tuple(sorted(self.eos_ids)))
        self.metrics = EngineMetrics()
        self.live: dict[str, _Live] = {}
        # requests that failed alone in the last steps: (request id, error); the caller takes
        # them (`take_failures`) and fails those requests' streams
        self.failures: list[tuple[str, Exception]] = []
        overlap = config.overlap_schedule
        self.overlap = self.runner.device.type == "cuda" if overlap is None else overlap
        self._inflight: _Inflight | None = None
        # two buffers: a step's tokens land in one while the host still reads the other's
        self._host_ids = torch.empty(
            2,
            config.scheduler.max_num_seqs,
            dtype=torch.int64,
            pin_memory=self.runner.device.type == "cuda",
        )
        self._host_turn = 0

    def _scheduler_config(self, config: EngineConfig) -> SchedulerConfig:
        """The scheduler's settings with the device's defaults filled in."""
        sched = config.scheduler
        if sched.long_prefill_token_threshold is None:
            limit = CPU_LONG_PREFILL_TOKENS if self.runner.device.type == "cpu" else 0
            sched = replace(sched, long_prefill_token_threshold=limit)
        return sched

    # ---- requests ----------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Check a request; return its resolved max_tokens."""
        n = len(prompt_ids)
        if n == 0:
            raise EngineInputError("the prompt is empty.")
        vocab = self.vocab_limit
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise EngineInputError(f"prompt token ids must be in [0, {vocab}).")
        try:
            params.check_vocab(vocab, tuple(sorted(self.eos_ids)))
        except SamplingError as e:
            raise EngineInputError(str(e)) from None
        limit = self.max_model_len
        if params.max_tokens is None:
            if n >= limit:
                raise EngineInputError(
                    f"This model's maximum context length is {limit} tokens. However, your "
                    f"prompt has {n} tokens, which leaves no room for a completion."
                )
            return limit - n
        if n + params.max_tokens > limit:
            raise EngineInputError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} in the "
                "completion). Please reduce the length of the prompt or the completion."
            )
        return params.max_tokens

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.live:
            raise EngineInputError(f"request id {request_id!r} is already in use.")
        max_tokens = self.validate(prompt_ids, params)
        req = Request(request_id, list(prompt_ids), params, max_tokens)
        self.live[request_id] = _Live(
            req, IncrementalDetokenizer(self.tokenizer, req.prompt_ids, params)
        )
        self.metrics.on_arrival(len(prompt_ids))
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

    def shutdown(self) -> None:
        self.executor.shutdown()

    # ---- one step ------------------------------------------------------------------------------
    def _build_step(
        self, batch: ScheduledBatch, prev: _Inflight | None = None
    ) -> tuple[StepInput, _StepPlan]:
        """The step's inputs, single-token sequences first (the attention backends' order),
        and where each sequence's logits rows are. Host work grows with the step's new
        tokens and pages, not with the sequences' lengths."""
        step = StepInput([], [], [], [], [])
        plan = _StepPlan()
        order = [i for i, n in enumerate(batch.num_tokens) if n == 1]
        order += [i for i, n in enumerate(batch.num_tokens) if n != 1]
        for i in order:
            req, n = batch.requests[i], batch.num_tokens[i]
            start = req.num_computed
            t0 = len(step.ids)
            known = req.token_slice(start, min(start + n, req.num_tokens))
            step.ids.extend(known)
            if len(known) < n:  # its last token is still on the GPU: a placeholder
                step.ids.append(-1 - prev.slot_of[req.request_id])
            step.positions.extend(range(start, start + n))
            row = self.rows.row(req.request_id)
            self.rows.updates(row, req.pages, step.page_updates)
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
        # max_tokens == 0 (prompt logprobs only) still needs its prefill; others finish here
        batch = self.scheduler.schedule()
        for req in batch.preempted:
            self.rows.release(req.request_id)
        self.metrics.on_preempt(len(batch.preempted))
        if batch.empty:
            return self._complete(prev) if prev is not None else outputs
        t0 = time.perf_counter()
        step, plan = self._build_step(batch, prev)
        step.greedy = self.overlap and self._overlappable(batch)
        t_exec = time.perf_counter()
        logits = self.executor.execute(step)
        t_exec = time.perf_counter() - t_exec
        if step.greedy:  # step N+1 is queued: now the host handles step N's outputs
            self._inflight = self._launch_copy(batch, plan, t0)
            if prev is not None:
                outputs = self._complete(prev)
            if self.profiler is not None and self.profiler.active and step.is_decode_only:
                self._profile_step(step, time.perf_counter() - t_entry, t_exec)
            return outputs
        if prev is not None:  # its tokens are this step's history (penalties, stop checks)
            outputs = self._complete(prev)
        failed: dict[int, Exception] = {}
        tokens, lps = self._sample(batch, plan, logits, failed)
        prompt_lps = self._prompt_logprobs(batch, plan, logits, failed)
        self.scheduler.after_step(batch)
        self.metrics.on_step(time.perf_counter() - t0, sum(batch.num_tokens))
        for i, req in enumerate(batch.requests):
            live = self.live.get(req.request_id)
            if live is None or req.finished:
                continue  # it ended with the previous (overlapped) step's token
            if i in failed:
                self._fail(live, failed[i])
                continue
            out = self._own_work(live, self._emit, live, i, tokens, lps, prompt_lps)
            if out is not None:
                outputs.append(out)
        if self.profiler is not None and self.profiler.active and step.is_decode_only:
            self._profile_step(step, time.perf_counter() - t_entry, t_exec)
        return outputs

    # ---- overlap scheduling ------------------------------------------------------------------
    def _overlappable(self, batch: ScheduledBatch) -> bool:
        """Whether the batch's tokens may stay on the GPU until the next step is queued: every
        request greedy with no per-token host work before its next step (logprobs,
        penalties, bias, min_tokens), and room for two more tokens (a request that ends
        with this step's token may compute one more, which is dropped)."""
        for req in batch.requests:
            p = req.params
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
        host.copy_(self.runner.last_sampled[:k], non_blocking=True)
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

    def _profile_step(self, step: StepInput, seconds: float, forward_seconds: float) -> None:
        """--profile-decode: count this served decode step; after N, the labelled eager
        rerun of this step (idempotent: same cache rows) and the table."""
        prof = self.profiler
        prof.record(len(step.rows), seconds, forward_seconds)
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
            tuple(self.eos_ids),
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
        k = req.params.prompt_logprobs
        entries: list[TokenLogprob | None] = [None] if start == 0 else []
        if count > 0 and logits is not None:
            rows = logits[row : row + count, : self.vocab_limit].float()
            logp = torch.log_softmax(rows, dim=-1)
            targets = torch.tensor(
                req.prompt_ids[start + 1 : start + count + 1], device=logp.device
            )
            chosen = logp.gather(1, targets[:, None]).squeeze(1).tolist()
            if k:
                tv, ti = logp.topk(k, dim=-1)
                tops = [
                    list(zip(a, b, strict=True))
                    for a, b in zip(ti.tolist(), tv.tolist(), strict=True)
                ]
            else:
                tops = [[] for _ in chosen]
            for tok, lp, top in zip(targets.tolist(), chosen, tops, strict=True):
                entries.append(TokenLogprob(tok, lp, top))
        return entries

    def _append_token(self, live: _Live, token: int, lp: TokenLogprob | None) -> RequestOutput:
        req = live.req
        req.output_ids.append(token)
        self.metrics.on_token()
        if lp is not None:
            live.pending_logprobs.append(lp)
        p = req.params
        stop_token = (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids
        if len(req.output_ids) <= p.min_tokens:
            stop_token = False
        text, stop_str = live.detok.add(token, final=stop_token)
        if stop_str is not None:
            req.finish("stop", stop_str)
        elif stop_token:
            req.finish("stop", None if token in self.eos_ids and not p.ignore_eos else token)
        elif len(req.output_ids) >= req.max_tokens or req.num_tokens >= self.max_model_len:
            req.finish("length")
            text += live.detok.flush()
        if req.finished:
            return self._finish(live, text, [token])
        return self._output(live, text, [token], finished=False)

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


# ---- construction -----------------------------------------------------------------------------
def resolve_device(cfg: EngineConfig) -> str:
    return cfg.load.device or ("cuda" if torch.cuda.is_available() else "cpu")


def build_rank(cfg: EngineConfig, tp: TPGroup, device: str) -> ModelRunner:
    """This rank's model slice and runner (every rank, rank 0 included)."""
    if cfg.load.threads:
        torch.set_num_threads(cfg.load.threads)
    torch.manual_seed(cfg.load.seed)
    dtype = parse_dtype(cfg.load.dtype, torch.float32, device)
    if tp.size > 1:
        tp = _with_communicator(cfg, tp, device, dtype)
    t0 = time.perf_counter()
    loaded = load_model(
        cfg.model,
        dtype,
        device,
        quantize=cfg.load.quantization,
        kv_cache_dtype=cfg.cache.kv_cache_dtype,
        num_layers=cfg.load.num_layers,
        load_format=cfg.load.load_format,
        tp=tp,
        seed=cfg.load.seed,
        planning=Planning(settings=plan_settings(cfg, tp.size)),
    )
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    loaded = replace(loaded, load_seconds=time.perf_counter() - t0)
    return ModelRunner(cfg, loaded, device, tp)


def plan_settings(cfg: EngineConfig, tp_size: int) -> PlanSettings:
    """The engine settings the kernel plan depends on (the loader adds the dtypes)."""
    return PlanSettings(
        page_size=cfg.cache.page_size,
        mla_decode_kernel=cfg.cache.mla_decode_kernel,
        enforce_eager=cfg.enforce_eager,
        deterministic=cfg.load.deterministic,
        cpu_kernels=cfg.load.cpu_kernels,
        tp_size=tp_size,
    )


def _with_communicator(cfg: EngineConfig, tp: TPGroup, device: str, dtype: torch.dtype) -> TPGroup:
    """The group's all-reduce implementation, chosen collectively before the model is built
    (the layers keep the group they are built with)."""
    from moeserve.parallel.comm import create_communicator

    comm = create_communicator(
        tp.group,
        tp.rank,
        tp.size,
        torch.device(device),
        max_tokens=cfg.scheduler.max_num_batched_tokens,
        hidden=model_hidden_size(cfg.model),
        dtype=dtype,
        prefer=cfg.parallel.all_reduce,
        cpu_group=tp.cpu_group,
    )
    return replace(tp, comm=comm)


def model_hidden_size(model: str | None) -> int:
    return model_limits(model)[0]


def model_limits(model: str | None) -> tuple[int, int]:
    """(hidden size, positions) from a checkpoint's description, before loading it."""
    path = resolve_model_path(model)
    if path.endswith(".gguf"):
        from gguf import GGUFReader

        meta = GGUFReader(path).fields
        arch = meta["general.architecture"].contents()
        ctx = meta.get(f"{arch}.context_length")
        positions = int(ctx.contents()) if ctx is not None else DEFAULT_MAX_POSITIONS
        return int(meta[f"{arch}.embedding_length"].contents()), positions
    with open(os.path.join(path, "config.json")) as f:
        mc = ModelConfig.from_hf(json.load(f))
    return mc.hidden_size, mc.max_position_embeddings


def _start_spawned_ranks(cfg: EngineConfig, device: str) -> Executor:
    """Rank 0 here; ranks 1..N-1 spawned on the next devices of this host."""
    world = cfg.parallel.tensor_parallel_size
    if device.startswith("cuda"):
        first = int(device.split(":")[1]) if ":" in device else 0
        have = torch.cuda.device_count()
        if first + world > have:
            raise ConfigError(
                f"--tensor-parallel-size {world} needs {world} GPUs from {device}; "
                f"this host has {have}."
            )
    # refuse a bad --max-model-len here, once, rather than from every rank
    served_context_len(cfg.scheduler.max_model_len, model_limits(cfg.model)[1])
    apply_safe_env()  # inherited by the spawned ranks
    store = tempfile.TemporaryDirectory(prefix="moeserve-dist-")
    init = f"file://{os.path.join(store.name, 'store')}"
    ctx = mp.get_context("spawn")
    procs = []
    for r in range(1, world):
        rdv = Rendezvous(r, world, init, rank_device(device, r))
        p = ctx.Process(target=run_worker, args=(cfg, rdv), name=f"moeserve-rank{r}", daemon=True)
        p.start()
        procs.append(p)
    stop = start_watchdog(procs)  # a rank that dies while loading stops us too
    tp = init_distributed(cfg, Rendezvous(0, world, init, rank_device(device, 0)))
    runner = build_rank(cfg, tp, rank_device(device, 0))
    channel = open_channel(tp, rank_device(device, 0))
    dist.barrier(group=tp.cpu_group)
    return DistributedExecutor(runner, channel, procs, store, stop)


def _join_torchrun(cfg: EngineConfig, device: str) -> Executor:
    """Rank 0 of a torchrun launch (the other ranks run `run_worker`)."""
    rdv = torchrun_rendezvous(device)
    tp = init_distributed(cfg, rdv)
    runner = build_rank(cfg, tp, rdv.device)
    channel = open_channel(tp, rdv.device)
    dist.barrier(group=tp.cpu_group)
    return DistributedExecutor(runner, channel)


def torchrun_rendezvous(device: str) -> Rendezvous:
    """This process's rank under torchrun (RANK, WORLD_SIZE, LOCAL_RANK from its env)."""
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", "0"))
    except (KeyError, ValueError):
        raise ConfigError(
            "--distributed-executor torchrun needs RANK and WORLD_SIZE: start it with torchrun."
        ) from None
    return Rendezvous(rank, world, "env://", rank_device(device, local))


def build_engine(
    model: str | None = None, *, config: EngineConfig | None = None, **settings
) -> LLMEngine:
    """An engine for `model` from `config`, or from keyword settings (any setting of the
    `EngineConfig` groups: `max_num_seqs=8`, `tensor_parallel_size=2`, `device="cpu"`...)."""
    cfg = config or EngineConfig.from_settings(model, **settings)
    device = resolve_device(cfg)
    par = cfg.parallel
    if par.distributed_executor == "torchrun":
        executor = _join_torchrun(cfg, device)
    elif par.tensor_parallel_size > 1:
        executor = _start_spawned_ranks(cfg, device)
    else:
        executor = Executor(build_rank(cfg, SINGLE, device))
    return LLMEngine(cfg, executor)


def served_name(model: str | None) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    base = os.path.basename(os.path.normpath(model))
    return base[: -len(".gguf")] if base.endswith(".gguf") else base


def exit_process(error: BaseException) -> None:
    """What a poisoned engine does by default: one line on stderr, then the process exits so
    that a supervisor restarts it (a live process that answers 500 forever helps no one)."""
    first = (str(error).strip().splitlines() or [""])[0][:300]
    print(
        f"moeserve: fatal: the engine failed ({type(error).__name__}: {first}); exiting",
        file=sys.stderr,
        flush=True,
    )
    os._exit(EXIT_ENGINE_FAILED)


EXIT_ENGINE_FAILED = 70  # EX_SOFTWARE
_POISON_GRACE_S = 0.5  # time for the front end to send the failed streams their error
# the engine trims the host heap once it has been idle this long (a full collection takes
# milliseconds to tens of them: only when no request is waiting for the engine)
_IDLE_TRIM_AFTER_S = 1.0


class AsyncEngine:
    """Runs an `LLMEngine` on a background thread; `generate` is an async generator.

    A request that fails alone (sampling, detokenizing, stop checks) gets `RequestFailed`
    while the others go on. An error outside per-request code (a CUDA error, a dead worker,
    a bug in the step) poisons the engine: every stream gets `EngineDead`, `is_healthy`
    turns false and `on_poison` runs (default: exit the process with one line).
    """

    def __init__(
        self,
        engine: LLMEngine,
        model_name: str,
        on_poison: Callable[[BaseException], None] | None = exit_process,
    ) -> None:
        self.engine = engine
        self._on_poison = on_poison
        self.model_name = model_name
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="moeserve-engine", daemon=True)
        self._thread.start()

    # ---- front end side --------------------------------------------------------------------
    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        if self._error is not None:
            raise EngineDead(f"The engine stopped after an error ({type(self._error).__name__}).")
        self.engine.validate(prompt_token_ids, params)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise EngineInputError(f"request id {request_id!r} is already in use.")
            self._streams[request_id] = (loop, q)
        self._inbox.put(("add", request_id, list(prompt_token_ids), params))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self._inbox.put(("abort", request_id))
            with self._lock:
                self._streams.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def metrics_text(self) -> str:
        return self.engine.metrics_text()

    def is_healthy(self) -> bool:
        return self._error is None and self._thread.is_alive()

    def shutdown(self) -> None:
        self._inbox.put(("stop",))
        self._thread.join(timeout=10)
        self.engine.shutdown()

    # ---- engine thread ---------------------------------------------------------------------
    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            target = self._streams.get(request_id)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _handle(self, msg: tuple) -> bool:
        kind = msg[0]
        if kind == "stop":
            return False
        if kind == "add":
            _, rid, ids, params = msg
            try:
                self.engine.add_request(rid, ids, params)
            except ValueError as e:
                self._deliver(rid, EngineInputError(str(e)))
            except Exception as e:  # this request's own set-up: it fails alone
                if is_device_error(e):
                    raise
                log.error("request %s could not start: %s: %s", rid, type(e).__name__, e)
                self.engine.abort(rid)
                self._deliver(rid, RequestFailed(_failure_message(e)))
        elif kind == "abort":
            self.engine.abort(msg[1])
        return True

    def _loop(self) -> None:
        worked = False  # since the last heap trim
        try:
            while True:
                block = not self.engine.has_unfinished()
                worked = worked or not block
                try:
                    if block and worked:  # idle: trim once nothing arrives for a moment
                        try:
                            msg = self._inbox.get(timeout=_IDLE_TRIM_AFTER_S)
                        except queue.Empty:
                            trim_host_heap()
                            worked = False
                            continue
                    else:
                        msg = self._inbox.get(block=block, timeout=None if block else 0)
                    if not self._handle(msg):
                        return
                    while True:  # drain everything that arrived
                        if not self._handle(self._inbox.get_nowait()):
                            return
                except queue.Empty:
                    pass
                for out in self.engine.step():
                    self._deliver(out.request_id, out)
                for rid, e in self.engine.take_failures():
                    self._deliver(rid, RequestFailed(_failure_message(e)))
        except BaseException as e:  # a device failure or a bug outside one request: poison
            log.debug("engine loop failed", exc_info=True)
            self._error = e
            with self._lock:
                ids = list(self._streams)
            dead = EngineDead(f"The engine failed ({type(e).__name__}); the server is restarting.")
            for rid in ids:
                self._deliver(rid, dead)
            if self._on_poison is not None:
                time.sleep(_POISON_GRACE_S if ids else 0.0)
                self._on_poison(e)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def trim_host_heap() -> None:
    """Collect cyclic garbage (it can hold native buffers until a full collection) and
    return the C heap's free memory to the system (glibc keeps what requests freed).
    Measured on the CPU server: ~150 MB per 200 requests of varied lengths retained, nearly
    all of it given back by the two together, none by malloc_trim alone."""
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _failure_message(e: Exception) -> str:
    """The 500 a request that failed alone gets: what failed, not a traceback."""
    first = (str(e).strip().splitlines() or [""])[0][:200]
    detail = f"{type(e).__name__}: {first}" if first else type(e).__name__
    return f"Internal error while generating this request ({detail}); other requests go on."


def build_async_engine(
    model: str | None = None,
    *,
    config: EngineConfig | None = None,
    served_model_name: str | None = None,
    **settings,
) -> AsyncEngine:
    engine = build_engine(model, config=config, **settings)
    return AsyncEngine(engine, served_model_name or served_name(engine.config.model))


# ---- offline API ----------------------------------------------------------------------------
@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


class LLM:
    """Offline batch generation: `LLM(model).generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.engine = build_engine(model, **kwargs)
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def generate(
        self, prompts: list[str] | list[list[int]] | str, params: SamplingParams | None = None
    ) -> list[Completion]:
        params = params or SamplingParams()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        ids_list = [
            p if isinstance(p, list) else self.tokenizer.encode(p)
            for p in prompts  # type: ignore[arg-type]
        ]
        rids = []
        for ids in ids_list:
            rid = f"offline-{self._counter}"
            self._counter += 1
            self.engine.add_request(rid, ids, params)
            rids.append(rid)
        acc = {
            r: Completion("", [], None, [] if params.logprobs is not None else None) for r in rids
        }
        while self.engine.has_unfinished():
            outs = self.engine.step()
            for rid, e in self.engine.take_failures():
                raise RequestFailed(f"request {rid} failed: {_failure_message(e)}") from e
            for out in outs:
                c = acc[out.request_id]
                c.text += out.text
                c.token_ids += out.token_ids
                if out.logprobs is not None and c.logprobs is not None:
                    c.logprobs += out.logprobs
                if out.prompt_logprobs is not None:
                    c.prompt_logprobs = out.prompt_logprobs
                if out.finished:
                    c.finish_reason = out.finish_reason
        return [acc[r] for r in rids]

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> Completion:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate([self.tokenizer.encode(prompt, add_special_tokens=False)], params)[0]
