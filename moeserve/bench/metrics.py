"""Serving-benchmark metrics computed from per-request event traces.

Everything here is a pure function of `RequestRecord`s (what the client saw: when it sent
the request, when each content-carrying chunk arrived, when the stream ended, what
`usage` said). No I/O, no clocks, so every figure can be checked by hand
(tests/bench/test_metrics.py). Definitions and how vLLM, SGLang and AIPerf name them:
docs/benchmark-metrics.md.

Times are seconds (floats from one monotonic clock); aggregate latency fields are
milliseconds, named as `vllm bench serve` names them (mean_ttft_ms, p99_itl_ms, ...).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

MS_PER_S = 1000.0
# Width of the buckets used for the peak output-token rate (vLLM uses one second).
PEAK_RATE_BUCKET_S = 1.0
# SLO names accepted by goodput; "e2el" is vLLM's spelling of "e2e".
SLO_NAMES = ("ttft", "tpot", "e2e")
SLO_ALIASES = {"e2el": "e2e"}
NO_CONTENT_ERROR = "stream carried no content"
# usage.completion_tokens counts the final EOS (or stop-string) token, which streams no
# text: one token more than content chunks is the normal case, not bundling.
UNSTREAMED_FINAL_TOKENS = 1


@dataclass(frozen=True)
class RequestRecord:
    """What the client observed for one request.

    start: when the request was sent; chunk_times: arrival of each chunk that carried
    generated content (role-only, empty and usage-only chunks are not listed); end: when
    the response was complete (after `data: [DONE]`) or failed. error is None for a
    request the server answered completely.
    """

    index: int
    start: float
    end: float
    chunk_times: tuple[float, ...] = ()
    prompt_len: int = 0
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    text: str = ""
    error: str | None = None
    warmup: bool = False


@dataclass(frozen=True)
class RequestMetrics:
    """Per-request figures; None where the quantity is undefined for this request."""

    success: bool
    error: str | None
    input_tokens: int
    output_tokens: int
    ttft: float | None
    itls: tuple[float, ...]
    tpot: float | None
    e2el: float | None
    usage_missing: bool = False
    usage_vs_chunks: int = 0  # usage.completion_tokens - content chunks (0 when no usage)


def failure_reason(rec: RequestRecord) -> str | None:
    """Why a request counts as failed, or None when it succeeded."""
    if rec.error is not None:
        return rec.error
    if not rec.chunk_times:
        return NO_CONTENT_ERROR
    return None


def request_metrics(rec: RequestRecord) -> RequestMetrics:
    """TTFT, ITLs, TPOT and E2E latency of one request.

    TTFT = first content chunk - send time. ITL = gaps between consecutive content chunks
    (one value per gap, so a chunk that bundles several tokens gives one longer gap).
    TPOT = (E2E - TTFT) / (output tokens - 1), undefined for a single output token.
    Output tokens come from usage.completion_tokens; without usage, the number of
    content chunks stands in (flagged by usage_missing).
    """
    reason = failure_reason(rec)
    input_tokens = (
        rec.usage_prompt_tokens if rec.usage_prompt_tokens is not None else rec.prompt_len
    )
    usage_missing = rec.usage_completion_tokens is None
    output_tokens = len(rec.chunk_times) if usage_missing else int(rec.usage_completion_tokens)
    if reason is not None:
        return RequestMetrics(
            success=False,
            error=reason,
            input_tokens=input_tokens,
            output_tokens=0,
            ttft=None,
            itls=(),
            tpot=None,
            e2el=None,
            usage_missing=usage_missing,
        )
    ttft = rec.chunk_times[0] - rec.start
    e2el = rec.end - rec.start
    tpot = (e2el - ttft) / (output_tokens - 1) if output_tokens > 1 else None
    return RequestMetrics(
        success=True,
        error=None,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        ttft=ttft,
        itls=tuple(b - a for a, b in pairwise(rec.chunk_times)),
        tpot=tpot,
        e2el=e2el,
        usage_missing=usage_missing,
        usage_vs_chunks=0 if usage_missing else output_tokens - len(rec.chunk_times),
    )


def percentile(values: Sequence[float], p: float) -> float:
    """p-th percentile with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile {p} is outside 0..100")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def percentile_key(p: float) -> str:
    """'p99' for 99, 'p99.9' for 99.9: the suffix vLLM uses in its field names."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def describe_ms(
    name: str, values_s: Sequence[float], percentiles: Iterable[float]
) -> dict[str, float | None]:
    """mean/median/std/pXX of `values_s` (seconds) as `<stat>_<name>_ms` fields.

    std is the population standard deviation (numpy's np.std). An empty sample gives
    None for every field (vLLM writes 0, which reads like a real measurement).
    """
    out: dict[str, float | None] = {}
    keys = ["mean", "median", "std"] + [percentile_key(p) for p in percentiles]
    if not values_s:
        return {f"{k}_{name}_ms": None for k in keys}
    n = len(values_s)
    mean = math.fsum(values_s) / n
    out[f"mean_{name}_ms"] = mean * MS_PER_S
    out[f"median_{name}_ms"] = percentile(values_s, 50.0) * MS_PER_S
    out[f"std_{name}_ms"] = math.sqrt(math.fsum((v - mean) ** 2 for v in values_s) / n) * MS_PER_S
    for p in percentiles:
        out[f"{percentile_key(p)}_{name}_ms"] = percentile(values_s, p) * MS_PER_S
    return out


def peak_concurrency(records: Sequence[RequestRecord]) -> int:
    """Most requests in flight at one instant (send -> end), failed ones included.

    A request ending at the same instant another starts is not counted as overlapping.
    """
    events = [(r.start, 1) for r in records] + [(max(r.end, r.start), -1) for r in records]
    events.sort(key=lambda e: (e[0], e[1]))  # ends (-1) before starts (+1) at a tie
    peak = cur = 0
    for _, step in events:
        cur += step
        peak = max(peak, cur)
    return peak


def peak_output_rate(
    records: Sequence[RequestRecord], bucket_s: float = PEAK_RATE_BUCKET_S
) -> float:
    """Highest output tokens per second over fixed buckets from the first send.

    Each content chunk of a successful request carries output_tokens / chunks tokens, so
    the buckets add up to the total output even when a server bundles tokens.
    """
    ok = [(r, request_metrics(r)) for r in records]
    ok = [(r, m) for r, m in ok if m.success]
    if not ok:
        return 0.0
    origin = min(r.start for r, _ in ok)
    buckets: Counter[int] = Counter()
    for r, m in ok:
        weight = m.output_tokens / len(r.chunk_times)
        for t in r.chunk_times:
            buckets[int((t - origin) // bucket_s)] += weight
    return max(buckets.values()) / bucket_s


def parse_slo(spec: str) -> dict[str, float]:
    """'ttft=500,tpot=50,e2e=3000' (milliseconds) -> {'ttft': 500.0, ...}."""
    slo: dict[str, float] = {}
    for part in spec.split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        key = SLO_ALIASES.get(key.strip().lower(), key.strip().lower())
        if not sep or key not in SLO_NAMES:
            raise ValueError(
                f"bad --slo item {part!r}: expected NAME=MS with NAME one of {', '.join(SLO_NAMES)}"
            )
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(
                f"bad --slo value {value!r} for {key}: expected milliseconds"
            ) from None
        if not math.isfinite(ms) or ms < 0:
            raise ValueError(
                f"bad --slo value {value!r} for {key}: expected a non-negative number of ms"
            )
        slo[key] = ms
    if not slo:
        raise ValueError("--slo needs at least one NAME=MS item")
    return slo


def meets_slo(m: RequestMetrics, slo: Mapping[str, float]) -> bool:
    """A successful request meets every given SLO (ms). A single-token request has no
    TPOT and is taken to meet a TPOT SLO (as vLLM does)."""
    if not m.success:
        return False
    measured = {"ttft": m.ttft, "tpot": m.tpot or 0.0, "e2e": m.e2el}
    return all(measured[k] * MS_PER_S <= limit for k, limit in slo.items())


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    percentiles: Sequence[float] = (90.0, 99.0),
    slo: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """Aggregate figures of the measured (non-warm-up) requests, with vLLM field names.

    duration_s is the measured phase's wall time (first send to last response); every
    throughput divides by it. Per-request arrays follow the order of `records`.
    """
    if duration_s <= 0:
        raise ValueError("duration_s must be positive")
    measured = [r for r in records if not r.warmup]
    per = [request_metrics(r) for r in measured]
    ok = [m for m in per if m.success]
    total_in = sum(m.input_tokens for m in ok)
    total_out = sum(m.output_tokens for m in ok)
    ttfts = [m.ttft for m in ok if m.ttft is not None]
    tpots = [m.tpot for m in ok if m.tpot is not None]
    itls = [g for m in ok for g in m.itls]
    e2els = [m.e2el for m in ok if m.e2el is not None]
    # Per-user decode speed: tokens after the first over the time after the first
    # (1 / TPOT): AIPerf's output_token_throughput_per_user.
    per_user = [1.0 / m.tpot for m in ok if m.tpot]
    # Per-request rate including the wait for the first token.
    per_req_incl = [m.output_tokens / m.e2el for m in ok if m.e2el]

    result: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(per) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s,
        "request_goodput": (sum(meets_slo(m, slo) for m in per) / duration_s) if slo else None,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "max_output_tokens_per_s": peak_output_rate(measured),
        "max_concurrent_requests": peak_concurrency(measured),
        # Average number in flight (SGLang's "concurrency"): successful E2E time / duration.
        "mean_concurrency": math.fsum(e2els) / duration_s,
        "mean_output_throughput_per_user": (math.fsum(per_user) / len(per_user))
        if per_user
        else None,
        "median_output_throughput_per_user": percentile(per_user, 50.0) if per_user else None,
        "mean_request_output_rate_incl_ttft": (math.fsum(per_req_incl) / len(per_req_incl))
        if per_req_incl
        else None,
    }
    result.update(describe_ms("ttft", ttfts, percentiles))
    result.update(describe_ms("tpot", tpots, percentiles))
    result.update(describe_ms("itl", itls, percentiles))
    result.update(describe_ms("e2el", e2els, percentiles))
    result["failure_reasons"] = dict(Counter(m.error for m in per if not m.success))
    result["usage_warnings"] = {
        "missing": sum(m.usage_missing for m in ok),
        "fewer_than_chunks": sum(m.usage_vs_chunks < 0 for m in ok),
        "more_than_chunks": sum(m.usage_vs_chunks > UNSTREAMED_FINAL_TOKENS for m in ok),
    }
    # Per-request arrays (vLLM's names first, then ours); failed requests keep their slot.
    result["input_lens"] = [m.input_tokens for m in per]
    result["output_lens"] = [m.output_tokens for m in per]
    result["ttfts"] = [m.ttft for m in per]
    result["itls"] = [list(m.itls) for m in per]
    result["tpots"] = [m.tpot for m in per]
    result["e2els"] = [m.e2el for m in per]
    result["generated_texts"] = [r.text for r in measured]
    result["errors"] = [m.error or "" for m in per]
    origin = min((r.start for r in measured), default=0.0)
    result["start_times"] = [r.start - origin for r in measured]
    return result
