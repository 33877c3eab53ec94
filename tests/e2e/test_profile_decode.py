"""`moeserve serve --profile-decode N` prints where a decode step's time goes by component;
the rows add up to the step time, that step time agrees with the engine's own step counters,
the profiled run generates what an unprofiled one does, and /metrics has it."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from moeserve.testing.checkpoints import write_checkpoint

STEPS = 24
TOKENS = 3 * STEPS
ROW = re.compile(r"^\s{2}(\S.*?)\s{2,}(-?[\d.]+) us\s+(-?[\d.]+)%$")


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    return write_checkpoint(
        str(tmp_path_factory.mktemp("prof") / "kimi"), "kimi-k2.5", "nvfp4-modelopt", seed=2
    ).path


def _stream(base_url: str) -> tuple[str, list[float]]:
    body = {
        "prompt": [5, 6, 7, 8],
        "max_tokens": TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    text, times = "", []
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    times.append(time.perf_counter())
                    text += chunk["choices"][0]["text"]
    return text, times


def _metric(text: str, name: str) -> float:
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def _table(log: str) -> tuple[float, dict[str, float]]:
    lines = log.splitlines()
    start = next(i for i, ln in enumerate(lines) if "decode profile:" in ln)
    step_ms = float(re.search(r"([\d.]+) ms/step", lines[start]).group(1))
    rows = {}
    for ln in lines[start + 1 :]:
        m = ROW.match(ln)
        if not m:
            break
        rows[m.group(1).strip()] = float(m.group(2)) / 1000
    return step_ms, rows


def test_profile_decode_table(cli_server, kimi):
    common = ("--device", "cpu", "--dtype", "float32", "--max-model-len", "256")
    plain = cli_server(kimi, *common)
    want, _ = _stream(plain.base_url)
    plain.close()

    server = cli_server(kimi, *common, "--profile-decode", str(STEPS))
    got, _ = _stream(server.base_url)
    assert got == want  # the profiling window (and its eager rerun) changes nothing
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    log = server.close()
    step_ms, rows = _table(log)
    assert {"attention GEMMs", "router", "MoE experts", "shared expert", "norms"} <= set(rows)
    assert rows["MoE experts"] > 0 and rows["attention GEMMs"] > 0
    assert abs(sum(rows.values()) - step_ms) <= 0.1 * step_ms
    # the profiled steps are the served ones: the engine's own step counters (another code
    # path) give the same mean step time (the one prefill step is a few % of 70 steps)
    steps = _metric(metrics, "moeserve_engine_steps_total")
    seconds = _metric(metrics, "moeserve_engine_step_seconds_total")
    mean_ms = 1000 * seconds / steps
    assert mean_ms / 2 <= step_ms <= 2 * mean_ms, (step_ms, mean_ms)
    assert 'moeserve_decode_profile_seconds{component="MoE experts"}' in metrics
