"""`moeserve bench` reads the acceptance length from the server's speculative decoding
counters (vLLM's names): the engine's /metrics text for known counts parses back to them,
and the summary is 1 + accepted / drafts over the measured phase."""

from __future__ import annotations

import pytest

from moeserve.bench import serving
from moeserve.engine.kv_blocks import PrefixCacheStats
from moeserve.engine.metrics import EngineMetrics


def _text(verifications: list[tuple[int, int]]) -> str:
    m = EngineMetrics()
    for drafted, accepted in verifications:
        m.spec.on_verify(drafted, accepted)
    return m.render(0, 0, 0, 1, PrefixCacheStats())


def test_counters_parse_back_to_the_counts():
    text = _text([(4, 4), (4, 1), (3, 0)])
    got = {k: serving.parse_prometheus_counter(text, n) for k, n in serving.SPEC_COUNTERS.items()}
    assert got == {"drafts": 3, "draft_tokens": 11, "accepted_tokens": 5}
    per_pos = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
    assert serving.parse_prometheus_counter(text, per_pos) == 5  # summed over positions
    assert 'position="0"} 2' in text and 'position="3"} 1' in text


def test_summary_over_the_measured_phase():
    s = serving.spec_summary({"drafts": 4.0, "draft_tokens": 16.0, "accepted_tokens": 6.0})
    assert s["spec_decode_acceptance_length"] == pytest.approx(2.5)
    assert s["spec_decode_draft_acceptance_rate"] == pytest.approx(6 / 16)
    assert serving.spec_summary(None)["spec_decode_acceptance_length"] is None


def test_no_counters_without_speculation():
    assert "spec_decode" not in _text([])
