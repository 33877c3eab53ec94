"""The engine: requests in, token streams out.

`LLMEngine` is the synchronous core (scheduler + runner + incremental detokenizing + stop
checks). `AsyncEngine` runs it on its own thread and talks to the asyncio front end through
queues, so neither blocks the other. `LLM` is the offline API.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch

from moeserve.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    parse_dtype,
)
from moeserve.engine.detokenizer import IncrementalDetokenizer
from moeserve.engine.kv_blocks import PageAllocator
from moeserve.engine.metrics import EngineMetrics
from moeserve.engine.outputs import RequestOutput, TokenLogprob
from moeserve.engine.request import Request
from moeserve.engine.runner import ModelRunner
from moeserve.engine.scheduler import Scheduler
from moeserve.loader import load_model
from moeserve.loader.base import LoadedModel
from moeserve.sampling import SamplingParams

log = logging.getLogger(__name__)


class EngineInputError(ValueError):
    """A request the engine cannot take (one clear sentence for the user)."""


@dataclass
class _Live:
    """Per-request state kept next to the scheduler's `Request`."""

    req: Request
    detok: IncrementalDetokenizer
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    sent_prompt_logprobs: bool = False


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel) -> None:
        self.config = config
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        cache = config.cache
        per_token = ModelRunner.kv_bytes_per_token(loaded)
        self.num_pages = cache.num_pages or _auto_num_pages(config, per_token)
        self.max_model_len = min(config.scheduler.max_model_len, self.num_pages * cache.page_size)
        self.allocator = PageAllocator(self.num_pages, cache.page_size, cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.allocator)
        self.runner = ModelRunner(
            loaded,
            config.device,
            self.num_pages,
            cache.page_size,
            max_model_len=self.max_model_len,
            graph_max_batch=config.graph_max_batch,
        )
        self.metrics = EngineMetrics()
        self.live: dict[str, _Live] = {}
        self.eos_ids = set(loaded.config.eos_token_ids)

    # ---- requests ----------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """Check a request; return its resolved max_tokens."""
        n = len(prompt_ids)
        if n == 0:
            raise EngineInputError("the prompt is empty.")
        vocab = self.loaded.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise EngineInputError(f"prompt token ids must be in [0, {vocab}).")
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
        self.runner.forget(request_id)
        self.metrics.on_finish("abort")
        return self._output(live, "", [], finished=True)

    def has_unfinished(self) -> bool:
        return bool(self.live)

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        # max_tokens == 0 (prompt logprobs only) still needs its prefill; others finish here
        batch = self.scheduler.schedule()
        self.metrics.on_preempt(len(batch.preempted))
        if batch.empty:
            return outputs
        t0 = time.perf_counter()
        result = self.runner.execute(batch)
        self.scheduler.after_step(batch)
        self.metrics.on_step(time.perf_counter() - t0, sum(batch.num_tokens))
        for i, req in enumerate(batch.requests):
            live = self.live[req.request_id]
            plp = result.prompt_logprobs[i]
            if plp is not None:
                live.prompt_logprobs = (live.prompt_logprobs or []) + plp
            if req.num_computed < req.num_tokens:
                continue  # prompt chunk: nothing to emit yet
            token = result.tokens[i]
            if token is None:  # max_tokens reached without sampling (max_tokens == 0)
                req.finish("length")
                outputs.append(self._finish(live, "", []))
                continue
            outputs.append(self._append_token(live, token, result.logprobs[i]))
        return outputs

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
        self.runner.forget(req.request_id)
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
        return self.metrics.render(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            pages_used=self.num_pages - self.allocator.num_free,
            pages_total=self.num_pages,
            prefix=self.allocator.stats,
        )


def _auto_num_pages(config: EngineConfig, bytes_per_token: int) -> int:
    """Pages for max_num_seqs full contexts, capped by the memory that is really free."""
    page = config.cache.page_size
    want_tokens = config.scheduler.max_num_seqs * config.scheduler.max_model_len
    if config.device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(torch.device(config.device))
        budget = int(free * config.cache.memory_fraction)
    else:
        budget = int(
            min(
                _available_ram() * config.cache.cpu_memory_fraction,
                config.cache.cpu_max_kv_gib * (1 << 30),
            )
        )
    pages = min(-(-want_tokens // page), max(1, budget // max(1, bytes_per_token * page)))
    return max(pages, 1)


def _available_ram() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


# ---- construction -----------------------------------------------------------------------------
def build_engine(
    model: str | None = None,
    *,
    dtype: str = "auto",
    device: str | None = None,
    max_model_len: int | None = None,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
    page_size: int = 16,
    num_pages: int | None = None,
    enable_prefix_caching: bool = True,
    kv_cache_dtype: str = "auto",
    quantization: str = "auto",
    num_layers: int | None = None,
    load_format: str = "auto",
    seed: int = 0,
    threads: int | None = None,
    enforce_eager: bool = False,
    cuda_graph_max_bs: int = 256,
) -> LLMEngine:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(seed)
    torch_dtype = parse_dtype(dtype, torch.float32, device)
    loaded = load_model(
        model,
        torch_dtype,
        device,
        quantize=quantization,
        kv_cache_dtype=kv_cache_dtype,
        num_layers=num_layers,
        load_format=load_format,
    )
    mcfg: ModelConfig = loaded.config
    max_len = max_model_len or mcfg.max_position_embeddings
    config = EngineConfig(
        model=model or "default",
        model_config=mcfg,
        cache=CacheConfig(
            page_size=page_size,
            num_pages=num_pages,
            kv_cache_dtype=kv_cache_dtype,
            enable_prefix_caching=enable_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max(max_num_batched_tokens, 1),
            max_model_len=max_len,
        ),
        dtype=torch_dtype,
        device=device,
        seed=seed,
        enforce_eager=enforce_eager,
        cuda_graph_max_bs=cuda_graph_max_bs,
    )
    return LLMEngine(config, loaded)


def served_name(model: str | None) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    base = os.path.basename(os.path.normpath(model))
    return base[: -len(".gguf")] if base.endswith(".gguf") else base


class AsyncEngine:
    """Runs an `LLMEngine` on a background thread; `generate` is an async generator."""

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.engine = engine
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
            raise RuntimeError(f"the engine stopped: {self._error}")
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
        elif kind == "abort":
            self.engine.abort(msg[1])
        return True

    def _loop(self) -> None:
        try:
            while True:
                block = not self.engine.has_unfinished()
                try:
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
        except BaseException as e:  # a bug or device failure: fail every stream loudly
            log.exception("engine loop failed")
            self._error = e
            with self._lock:
                ids = list(self._streams)
            for rid in ids:
                self._deliver(rid, RuntimeError(f"the engine failed: {e}"))


def build_async_engine(model: str | None = None, **overrides) -> AsyncEngine:
    name = overrides.pop("served_model_name", None) or served_name(model)
    return AsyncEngine(build_engine(model, **overrides), name)


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
            for out in self.engine.step():
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
