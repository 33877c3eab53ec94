"""Load-generator pieces: arrivals, payloads, chunk parsing, Prometheus counters."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from moeserve.bench.datasets import Sample
from moeserve.bench.serving import (
    ClientConfig,
    arrival_times,
    build_payload,
    chunk_content,
    normalize_base_url,
    parse_prometheus_counter,
)


def gaps(times):
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def test_infinite_rate_sends_everything_at_once():
    assert arrival_times(4, math.inf, 1.0, random.Random(0)) == [0.0] * 4


def test_constant_rate_is_evenly_spaced():
    t = arrival_times(5, 4.0, math.inf, random.Random(0))
    assert t == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])


@pytest.mark.parametrize("burstiness, cv", [(1.0, 1.0), (4.0, 0.5), (0.25, 2.0)])
def test_gamma_gaps_have_the_right_mean_and_spread(burstiness, cv):
    g = gaps(arrival_times(20001, 5.0, burstiness, random.Random(1)))
    mean = statistics.fmean(g)
    assert mean == pytest.approx(0.2, rel=0.05)
    assert statistics.pstdev(g) / mean == pytest.approx(cv, rel=0.1)


def test_arrivals_are_seeded():
    assert arrival_times(10, 3.0, 1.0, random.Random(7)) == arrival_times(
        10, 3.0, 1.0, random.Random(7)
    )


def test_payloads():
    chat = ClientConfig("http://h:1", "chat", "m", temperature=0.7, ignore_eos=True)
    body = build_payload(chat, Sample("hello", 1, 16))
    assert body["messages"] == [{"role": "user", "content": "hello"}]
    assert body["max_tokens"] == 16 and body["temperature"] == 0.7 and body["ignore_eos"]
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert chat.url == "http://h:1/v1/chat/completions"
    # The scenario's own temperature wins over the run's.
    assert (
        build_payload(chat, Sample([{"role": "user", "content": "x"}], 1, None, 0.0))["temperature"]
        == 0.0
    )
    comp = ClientConfig("http://h:1", "completions", "m", api_key="k")
    body = build_payload(comp, Sample("p", 1, None))
    assert body["prompt"] == "p" and "max_tokens" not in body and "ignore_eos" not in body
    assert comp.headers == {"Authorization": "Bearer k"}
    with pytest.raises(ValueError):
        build_payload(comp, Sample([{"role": "user", "content": "x"}], 1, 4))


def test_chunk_content():
    role_only = {"choices": [{"delta": {"role": "assistant"}}]}
    assert chunk_content(role_only, "chat") == ""
    assert chunk_content({"choices": [], "usage": {"completion_tokens": 3}}, "chat") == ""
    assert chunk_content({"choices": [{"delta": {"content": "hi"}}]}, "chat") == "hi"
    assert chunk_content({"choices": [{"delta": {"reasoning_content": "hm"}}]}, "chat") == "hm"
    tool = {"choices": [{"delta": {"tool_calls": [{"function": {"arguments": '{"a"'}}]}}]}
    assert chunk_content(tool, "chat") == '{"a"'
    assert chunk_content({"choices": [{"text": "t"}]}, "completions") == "t"


def test_prometheus_counter():
    text = (
        "# HELP moeserve_generation_tokens_total Tokens.\n"
        "# TYPE moeserve_generation_tokens_total counter\n"
        'moeserve_generation_tokens_total{model="a"} 10.0\n'
        'moeserve_generation_tokens_total{model="b",x="y z"} 5\n'
        "moeserve_generation_tokens_created 1.7e9\n"
        "other_total 99\n"
    )
    assert parse_prometheus_counter(text, "moeserve_generation_tokens_total") == 15.0
    assert parse_prometheus_counter("other_total 1\n", "moeserve_generation_tokens_total") is None


def test_base_url_forms():
    assert normalize_base_url("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"
    assert normalize_base_url("https://h") == "https://h"
    with pytest.raises(ValueError):
        normalize_base_url("127.0.0.1:8000")
