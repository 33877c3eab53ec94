"""Every metric from synthetic event traces, against answers computed by hand.

The trace (times in seconds, measured phase 2.0 s):
  A  sent 0.0, content chunks 0.5 0.6 0.8 1.1, done 1.2, usage 7 in / 4 out
  B  sent 0.2, content chunk 0.5, done 0.6, usage 5 in / 1 out    (one output token)
  C  sent 0.4, HTTP 500 at 0.45                                    (failed)
  D  sent 1.0, content chunks 1.2 1.4, done 1.5, usage 3 in / 4 out (2 tokens per chunk)
  W  warm-up, sent -5.0, chunk -1.0, done 0.0                       (excluded)
"""

from __future__ import annotations

import math

import pytest

from moeserve.bench.metrics import (
    NO_CONTENT_ERROR,
    RequestRecord,
    meets_slo,
    parse_slo,
    peak_concurrency,
    peak_output_rate,
    percentile,
    request_metrics,
    summarize,
)

A = RequestRecord(0, 0.0, 1.2, (0.5, 0.6, 0.8, 1.1), 6, 7, 4, "abcd")
B = RequestRecord(1, 0.2, 0.6, (0.5,), 5, 5, 1, "x")
C = RequestRecord(2, 0.4, 0.45, (), 9, None, None, "", "HTTP 500: boom")
D = RequestRecord(3, 1.0, 1.5, (1.2, 1.4), 3, 3, 4, "yz")
W = RequestRecord(4, -5.0, 0.0, (-1.0,), 100, 100, 1, "w", None, warmup=True)
TRACE = [A, B, C, D, W]
DURATION = 2.0
approx = pytest.approx


def test_per_request_metrics():
    m = request_metrics(A)
    assert m.success and m.input_tokens == 7 and m.output_tokens == 4
    assert m.ttft == approx(0.5)
    assert m.itls == approx((0.1, 0.2, 0.3))
    assert m.e2el == approx(1.2)
    assert m.tpot == approx((1.2 - 0.5) / 3)


def test_one_output_token_has_no_tpot_and_no_itl():
    m = request_metrics(B)
    assert m.success and m.output_tokens == 1
    assert m.ttft == approx(0.3) and m.e2el == approx(0.4)
    assert m.tpot is None and m.itls == ()


def test_bundled_chunks_use_usage_for_tpot():
    m = request_metrics(D)
    assert m.output_tokens == 4 and m.itls == approx((0.2,))
    assert m.tpot == approx((0.5 - 0.2) / 3)
    assert m.usage_vs_chunks == 2


def test_failed_and_empty_requests():
    m = request_metrics(C)
    assert not m.success and m.error == "HTTP 500: boom" and m.ttft is None
    empty = RequestRecord(9, 0.0, 1.0, (), 4, 4, 0)
    assert request_metrics(empty).error == NO_CONTENT_ERROR


def test_eos_counted_in_usage_is_not_a_usage_warning():
    eos = RequestRecord(0, 0.0, 1.0, (0.2, 0.4), 3, 3, 3)  # 2 text chunks + EOS
    bundled = RequestRecord(1, 0.0, 1.0, (0.2, 0.4), 3, 3, 4)
    s = summarize([eos, bundled], 1.0)
    assert s["usage_warnings"]["more_than_chunks"] == 1


def test_missing_usage_falls_back_to_chunk_count():
    rec = RequestRecord(0, 0.0, 1.0, (0.2, 0.4, 0.6), 11)
    m = request_metrics(rec)
    assert m.usage_missing and m.output_tokens == 3 and m.input_tokens == 11
    assert m.tpot == approx(0.8 / 2)


def test_percentile_linear_interpolation():
    assert percentile([0.5, 0.3, 0.2], 50) == approx(0.3)
    assert percentile([0.5, 0.3, 0.2], 90) == approx(0.46)  # rank 1.8: .3 + .8 * .2
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == approx(2.5)
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)


def test_summary_counts_and_throughputs():
    s = summarize(TRACE, DURATION, (90, 99))
    assert s["completed"] == 3 and s["failed"] == 1
    assert s["total_input_tokens"] == 7 + 5 + 3
    assert s["total_output_tokens"] == 4 + 1 + 4
    assert s["request_throughput"] == approx(3 / 2.0)
    assert s["output_throughput"] == approx(9 / 2.0)
    assert s["total_token_throughput"] == approx(24 / 2.0)
    assert s["duration"] == 2.0
    assert s["request_goodput"] is None
    assert s["failure_reasons"] == {"HTTP 500: boom": 1}


def test_summary_latency_statistics():
    s = summarize(TRACE, DURATION, (90, 99))
    # TTFT over A, B, D = 0.5, 0.3, 0.2 s
    assert s["mean_ttft_ms"] == approx(1000 / 3)
    assert s["median_ttft_ms"] == approx(300)
    assert s["p90_ttft_ms"] == approx(460)
    assert s["p99_ttft_ms"] == approx(496)
    assert s["std_ttft_ms"] == approx(1000 * math.sqrt(0.046666666 / 3), rel=1e-6)
    # ITL gaps: A 0.1 0.2 0.3, D 0.2 (B has none)
    assert s["mean_itl_ms"] == approx(200)
    assert s["median_itl_ms"] == approx(200)
    assert s["p90_itl_ms"] == approx(270)
    assert s["p99_itl_ms"] == approx(297)
    # TPOT: A 0.7/3, D 0.3/3 (B has one token: excluded)
    assert s["mean_tpot_ms"] == approx(1000 * (0.7 / 3 + 0.1) / 2)
    assert s["median_tpot_ms"] == approx(1000 * (0.7 / 3 + 0.1) / 2)
    # E2E: 1.2, 0.4, 0.5
    assert s["mean_e2el_ms"] == approx(700)
    assert s["median_e2el_ms"] == approx(500)
    # per-user decode rate = mean of 1/TPOT over A and D
    assert s["mean_output_throughput_per_user"] == approx((3 / 0.7 + 10) / 2)


def test_summary_peaks():
    s = summarize(TRACE, DURATION)
    # A [0,1.2], B [.2,.6], C [.4,.45] overlap at 0.4..0.45
    assert s["max_concurrent_requests"] == 3
    # second 0: A 3 chunks + B 1 = 4 tokens; second 1: A 1 + D 2 chunks x 2 tokens = 5
    assert s["max_output_tokens_per_s"] == approx(5)
    assert s["mean_concurrency"] == approx((1.2 + 0.4 + 0.5) / 2.0)
    assert peak_concurrency([A]) == 1
    back_to_back = [RequestRecord(0, 0.0, 1.0, (0.5,)), RequestRecord(1, 1.0, 2.0, (1.5,))]
    assert peak_concurrency(back_to_back) == 1
    assert peak_output_rate([C]) == 0.0


def test_warmup_is_excluded():
    with_w = summarize(TRACE, DURATION)
    without_w = summarize([A, B, C, D], DURATION)
    for key in (
        "completed",
        "total_input_tokens",
        "mean_ttft_ms",
        "p99_e2el_ms",
        "max_concurrent_requests",
        "max_output_tokens_per_s",
    ):
        assert with_w[key] == without_w[key], key
    assert len(with_w["ttfts"]) == 4


def test_per_request_arrays():
    s = summarize(TRACE, DURATION)
    assert s["input_lens"] == [7, 5, 9, 3]  # C: the client's estimate (no usage)
    assert s["output_lens"] == [4, 1, 0, 4]
    assert s["ttfts"][:2] == approx([0.5, 0.3]) and s["ttfts"][2] is None
    assert s["itls"][1] == [] and s["itls"][3] == approx([0.2])
    assert s["errors"] == ["", "", "HTTP 500: boom", ""]
    assert s["generated_texts"] == ["abcd", "x", "", "yz"]
    assert s["start_times"] == approx([0.0, 0.2, 0.4, 1.0])
    assert s["usage_warnings"] == {"missing": 0, "fewer_than_chunks": 0, "more_than_chunks": 1}


def test_goodput():
    s = summarize(TRACE, DURATION, slo={"ttft": 400, "tpot": 200})
    # A misses TTFT; B meets (no TPOT counts as meeting); D meets
    assert s["request_goodput"] == approx(2 / 2.0)
    s = summarize(TRACE, DURATION, slo={"ttft": 400, "tpot": 200, "e2e": 450})
    assert s["request_goodput"] == approx(1 / 2.0)  # D's 500 ms E2E misses
    assert not meets_slo(request_metrics(C), {"ttft": 1e9})


def test_all_failed_gives_none_latencies():
    s = summarize([C], 1.0)
    assert s["completed"] == 0 and s["mean_ttft_ms"] is None and s["p99_itl_ms"] is None
    assert s["output_throughput"] == 0


def test_parse_slo():
    assert parse_slo("ttft=500, tpot=50,e2el=3000") == {"ttft": 500, "tpot": 50, "e2e": 3000}
    for bad in ("ttft", "foo=1", "ttft=abc", "ttft=-1", ""):
        with pytest.raises(ValueError):
            parse_slo(bad)
