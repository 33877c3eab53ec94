"""Load generator: sends a workload to any OpenAI-compatible server and records events.

Each request streams (SSE) with `stream_options.include_usage`; the client timestamps
every chunk that carries content and keeps the `usage` chunk. Arrivals follow
`--request-rate` (all at once for inf, otherwise gamma-distributed gaps: Poisson for
burstiness 1, evenly spaced for burstiness inf), capped by `--max-concurrency`. A bad
response never stops the run: it becomes a RequestRecord with its error.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from moeserve.bench.datasets import Sample
from moeserve.bench.metrics import RequestRecord

ENDPOINT_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
GENERATION_TOKENS_COUNTER = "moeserve_generation_tokens_total"
# prompt tokens served from the server's prefix cache (moeserve's name, then vLLM's): prompts
# the server has seen before skip their prefill, so a rising count means the run measured
# the cache rather than prefill
PREFIX_CACHE_HITS_COUNTERS = ("moeserve_prefix_cache_hits_total", "vllm:prefix_cache_hits_total")
# speculative decoding counters under vLLM's names (moeserve exports them too), so the
# acceptance length is read the same way from either server
SPEC_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total",
}
# Longest server error text kept per failed request (the reasons table stays readable).
MAX_ERROR_CHARS = 200


class BenchError(RuntimeError):
    """The benchmark cannot run (server unreachable, no model): one-line message."""


@dataclass(frozen=True)
class ClientConfig:
    base_url: str  # server root, e.g. http://127.0.0.1:8000 (no /v1)
    endpoint: str  # "chat" | "completions"
    model: str
    api_key: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = False
    timeout_s: float = 1800.0

    @property
    def url(self) -> str:
        return self.base_url + ENDPOINT_PATHS[self.endpoint]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass(frozen=True)
class LoadConfig:
    request_rate: float = math.inf  # requests per second
    burstiness: float = 1.0  # gamma shape: 1 Poisson, inf constant spacing
    max_concurrency: int | None = None
    seed: int = 0


@dataclass(frozen=True)
class PhaseResult:
    records: list[RequestRecord]
    duration_s: float  # first send -> last response


@dataclass(frozen=True)
class PointResult:
    """One measured run (one sweep point): warm-up and measured records, counters."""

    warmup: PhaseResult | None
    measured: PhaseResult
    server_tokens_before: float | None
    server_tokens_after: float | None
    # speculative decoding counters over the measured phase (SPEC_COUNTERS' keys), or None
    # when the server does not speculate
    spec_delta: dict[str, float] | None = None
    # the prefix-cache hits counter (tokens) around the measured phase, None when not exposed
    prefix_cache_hits_before: float | None = None
    prefix_cache_hits_after: float | None = None

    @property
    def server_tokens_delta(self) -> float | None:
        if self.server_tokens_before is None or self.server_tokens_after is None:
            return None
        return self.server_tokens_after - self.server_tokens_before

    @property
    def prefix_cache_hits_delta(self) -> float | None:
        if self.prefix_cache_hits_before is None or self.prefix_cache_hits_after is None:
            return None
        return self.prefix_cache_hits_after - self.prefix_cache_hits_before


def normalize_base_url(url: str) -> str:
    """Server root without trailing '/' or '/v1' (both spellings are common)."""
    root = url.strip().rstrip("/")
    if root.endswith("/v1"):
        root = root[: -len("/v1")]
    if not re.match(r"^https?://[^/\s]+", root):
        raise ValueError(f"--base-url {url!r} is not an http(s) URL")
    return root


def arrival_times(
    n: int, request_rate: float, burstiness: float, rng: random.Random
) -> list[float]:
    """Send offsets (s) of n requests from the phase start; the first goes at 0.

    Gaps are gamma-distributed with mean 1/rate and shape `burstiness` (coefficient of
    variation 1/sqrt(burstiness)): 1 is a Poisson process, <1 burstier, inf evenly spaced.
    """
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("request rate and burstiness must be positive")
    if math.isinf(request_rate):
        return [0.0] * n
    times, t = [], 0.0
    for i in range(n):
        if i:
            if math.isinf(burstiness):
                t += 1.0 / request_rate
            else:
                t += rng.gammavariate(burstiness, 1.0 / (request_rate * burstiness))
        times.append(t)
    return times


def build_payload(cfg: ClientConfig, sample: Sample) -> dict[str, Any]:
    """The OpenAI request body for one sample (streaming, usage requested)."""
    body: dict[str, Any] = {
        "model": cfg.model,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.endpoint == "chat":
        body["messages"] = (
            sample.prompt
            if isinstance(sample.prompt, list)
            else [{"role": "user", "content": sample.prompt}]
        )
    else:
        if not isinstance(sample.prompt, str):
            raise ValueError("the completions endpoint needs plain-text prompts, not chat messages")
        body["prompt"] = sample.prompt
    if sample.output_len is not None:
        body["max_tokens"] = sample.output_len
    body["temperature"] = sample.temperature if sample.temperature is not None else cfg.temperature
    if cfg.ignore_eos:
        body["ignore_eos"] = True  # vLLM/SGLang extension; keeps outputs at max_tokens
    return body


def chunk_content(obj: dict[str, Any], endpoint: str) -> str:
    """The generated text a stream chunk carries ('' for role-only or usage chunks).

    Reasoning text and tool-call arguments count: they are generated tokens too.
    """
    choices = obj.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return ""
    choice = choices[0]
    if endpoint != "chat":
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    parts = [
        delta.get("reasoning_content") or delta.get("reasoning") or "",
        delta.get("content") or "",
    ]
    for call in delta.get("tool_calls") or []:
        fn = (call or {}).get("function") or {}
        parts.append((fn.get("name") or "") + (fn.get("arguments") or ""))
    return "".join(p for p in parts if isinstance(p, str))


def _error_text(body: str) -> str:
    """The message of an OpenAI error body, or the body itself, shortened."""
    try:
        err = json.loads(body).get("error")
        msg = err.get("message") if isinstance(err, dict) else err
        if msg:
            body = str(msg)
    except (ValueError, AttributeError):
        pass
    body = " ".join(body.split())
    return body[:MAX_ERROR_CHARS] or "(empty body)"


async def stream_request(
    session: aiohttp.ClientSession,
    cfg: ClientConfig,
    sample: Sample,
    index: int,
    warmup: bool = False,
) -> RequestRecord:
    """Send one request and record its events; every failure becomes record.error."""
    chunk_times: list[float] = []
    pieces: list[str] = []
    usage: dict[str, Any] = {}
    error: str | None = None
    start = time.perf_counter()
    try:
        payload = build_payload(cfg, sample)
        timeout = aiohttp.ClientTimeout(total=cfg.timeout_s)
        async with session.post(
            cfg.url, json=payload, headers=cfg.headers, timeout=timeout
        ) as resp:
            if resp.status != 200:
                error = f"HTTP {resp.status}: {_error_text(await resp.text(errors='replace'))}"
            else:
                done = False
                async for raw in resp.content:
                    now = time.perf_counter()
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue  # blank separators, comments (':'), event:/id: fields
                    data = line[len(b"data:") :].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    try:
                        obj = json.loads(data)
                    except ValueError:
                        error = f"malformed stream chunk: {data[:60].decode(errors='replace')!r}"
                        break
                    if not isinstance(obj, dict):
                        error = "malformed stream chunk: not a JSON object"
                        break
                    if obj.get("error"):
                        error = f"error in stream: {_error_text(json.dumps(obj))}"
                        break
                    piece = chunk_content(obj, cfg.endpoint)
                    if piece:
                        chunk_times.append(now)
                        pieces.append(piece)
                    if isinstance(obj.get("usage"), dict):
                        usage = obj["usage"]
                if error is None and not done:
                    error = "stream ended before data: [DONE]"
    except TimeoutError:
        error = f"timed out after {cfg.timeout_s:g} s"
    except aiohttp.ClientError as exc:
        error = f"connection error: {type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
    except Exception as exc:  # noqa: BLE001 - a bad response must never stop the run
        error = f"client error: {type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
    end = time.perf_counter()
    return RequestRecord(
        index=index,
        start=start,
        end=end,
        chunk_times=tuple(chunk_times),
        prompt_len=sample.prompt_len,
        usage_prompt_tokens=_int_or_none(usage.get("prompt_tokens")),
        usage_completion_tokens=_int_or_none(usage.get("completion_tokens")),
        text="".join(pieces),
        error=error,
        warmup=warmup,
    )


def _int_or_none(v: Any) -> int | None:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


async def run_phase(
    session: aiohttp.ClientSession,
    cfg: ClientConfig,
    load: LoadConfig,
    samples: Sequence[Sample],
    warmup: bool = False,
    on_done: Callable[[RequestRecord], None] | None = None,
) -> PhaseResult:
    """Send `samples` at the configured arrival process, wait for all, time the phase."""
    times = arrival_times(
        len(samples), load.request_rate, load.burstiness, random.Random(load.seed)
    )
    sem = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None

    async def one(i: int, s: Sample) -> RequestRecord:
        if sem is None:
            rec = await stream_request(session, cfg, s, i, warmup)
        else:
            async with sem:  # the send time is taken after the slot is free
                rec = await stream_request(session, cfg, s, i, warmup)
        if on_done is not None:
            on_done(rec)
        return rec

    t0 = time.perf_counter()
    tasks = []
    for i, (s, at) in enumerate(zip(samples, times, strict=True)):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i, s)))
    records = list(await asyncio.gather(*tasks))
    return PhaseResult(records, time.perf_counter() - t0)


def parse_prometheus_counter(text: str, name: str) -> float | None:
    """Sum of all samples of metric `name` (any labels) in Prometheus text format."""
    total, found = 0.0, False
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})?\s+(\S+)", line)
        if m and m.group(1) == name:
            try:
                total += float(m.group(3))
                found = True
            except ValueError:
                continue
    return total if found else None


async def scrape_metrics(
    session: aiohttp.ClientSession, url: str | None, headers: dict[str, str] | None = None
) -> str | None:
    """The Prometheus text at `url`, or None when there is none (no URL, an error, not 200)."""
    if not url:
        return None
    try:
        async with session.get(
            url, headers=headers or {}, timeout=aiohttp.ClientTimeout(total=30)
        ) as resp:
            if resp.status != 200:
                return None
            return await resp.text(errors="replace")
    except (TimeoutError, aiohttp.ClientError, ValueError):
        return None


def parse_counters(text: str | None, names: dict[str, str]) -> dict[str, float] | None:
    """Several counters (key -> value) of one scrape, or None when any is missing."""
    if text is None:
        return None
    out = {key: parse_prometheus_counter(text, name) for key, name in names.items()}
    if any(v is None for v in out.values()):
        return None
    return out  # type: ignore[return-value]


def parse_first_counter(text: str | None, names: Sequence[str]) -> float | None:
    """The first of `names` (one counter under each server's name) the scrape holds."""
    for name in names if text is not None else ():
        value = parse_prometheus_counter(text, name)
        if value is not None:
            return value
    return None


def spec_summary(delta: dict[str, float] | None) -> dict[str, float | None]:
    """Mean acceptance length (1 + accepted / drafts, vLLM's definition) and the share of
    draft tokens accepted, from the counters' change over the measured phase."""
    if not delta or not delta.get("drafts"):
        return {"spec_decode_acceptance_length": None, "spec_decode_draft_acceptance_rate": None}
    rate = delta["accepted_tokens"] / delta["draft_tokens"] if delta["draft_tokens"] else None
    return {
        "spec_decode_acceptance_length": 1.0 + delta["accepted_tokens"] / delta["drafts"],
        "spec_decode_draft_acceptance_rate": rate,
    }


async def discover_model(
    session: aiohttp.ClientSession, base_url: str, headers: dict[str, str]
) -> str:
    """The first model id that GET /v1/models lists."""
    url = base_url + "/v1/models"
    try:
        async with session.get(
            url, headers=headers, timeout=aiohttp.ClientTimeout(total=30)
        ) as resp:
            if resp.status != 200:
                raise BenchError(f"GET {url} answered HTTP {resp.status}; pass --model")
            data = await resp.json(content_type=None)
    except (TimeoutError, aiohttp.ClientError) as exc:
        raise BenchError(f"cannot reach {url}: {type(exc).__name__}: {exc}") from None
    except ValueError:
        raise BenchError(f"GET {url} did not return JSON; pass --model") from None
    models = data.get("data") if isinstance(data, dict) else None
    if not models or not isinstance(models[0], dict) or "id" not in models[0]:
        raise BenchError(f"GET {url} lists no model; pass --model")
    return str(models[0]["id"])


def new_session() -> aiohttp.ClientSession:
    # No connection cap beyond the benchmark's own semaphore: aiohttp's default of 100
    # would queue requests inside the client and inflate TTFT at high request rates.
    connector = aiohttp.TCPConnector(limit=0)
    return aiohttp.ClientSession(connector=connector)


async def run_point(
    session: aiohttp.ClientSession,
    cfg: ClientConfig,
    load: LoadConfig,
    samples: Sequence[Sample],
    warmup_samples: Sequence[Sample],
    metrics_url: str | None,
    progress: Callable[[int, str], Callable[[RequestRecord], None]] | None = None,
) -> PointResult:
    """Warm-up (excluded), counter scrape, measured phase, counter scrape."""

    def hook(n: int, label: str) -> Callable[[RequestRecord], None] | None:
        return progress(n, label) if progress else None

    warm = None
    if warmup_samples:
        # Warm-up keeps the concurrency cap but sends at once: it only has to wake the
        # server (compile, allocate, fill caches), not model the arrival process.
        warm_load = LoadConfig(math.inf, 1.0, load.max_concurrency, load.seed)
        warm = await run_phase(
            session, cfg, warm_load, warmup_samples, True, hook(len(warmup_samples), "warm-up")
        )
    text = await scrape_metrics(session, metrics_url, cfg.headers)
    before = parse_first_counter(text, [GENERATION_TOKENS_COUNTER])
    spec_before = parse_counters(text, SPEC_COUNTERS)
    hits_before = parse_first_counter(text, PREFIX_CACHE_HITS_COUNTERS)
    measured = await run_phase(session, cfg, load, samples, False, hook(len(samples), "benchmark"))
    text = await scrape_metrics(session, metrics_url, cfg.headers)
    after = parse_first_counter(text, [GENERATION_TOKENS_COUNTER]) if before is not None else None
    spec_after = parse_counters(text, SPEC_COUNTERS)
    hits_after = (
        parse_first_counter(text, PREFIX_CACHE_HITS_COUNTERS) if hits_before is not None else None
    )
    spec_delta = None
    if spec_after is not None:  # counters that appear with the first draft start at 0
        start = spec_before or dict.fromkeys(SPEC_COUNTERS, 0.0)
        spec_delta = {k: spec_after[k] - start[k] for k in SPEC_COUNTERS}
    return PointResult(warm, measured, before, after, spec_delta, hits_before, hits_after)
