"""Against a server that streams at a known pace, the measured figures match the pace.

Pace: TTFT 80 ms, one token every 20 ms, 10 tokens per request; 8 requests at
concurrency 4 = two waves of 80 + 9 * 20 = 260 ms. Tolerances are generous for a loaded
2-core CI box: timers and the event loop add a few ms, never less than the pace.
"""

from __future__ import annotations

import asyncio
import json
import math

import pytest
from bench_pace_server import MODEL_ID, Pace, PaceServer

from moeserve.bench import metrics, serving
from moeserve.bench.__main__ import main
from moeserve.bench.datasets import Sample

PACE = Pace(ttft_s=0.08, itl_s=0.02)
TOKENS = 10
PROMPTS = 8
CONCURRENCY = 4
ABS_TOL_S = 0.015  # per-token timing slack
TTFT_SLACK_S = 0.06  # first-token slack (connection set-up, scheduling)


@pytest.fixture(scope="module")
def server():
    with PaceServer(PACE) as srv:
        yield srv


def run(server, samples, load, warmup=(), endpoint="chat"):
    cfg = serving.ClientConfig(server.base_url, endpoint, MODEL_ID)

    async def go():
        async with serving.new_session() as session:
            return await serving.run_point(
                session, cfg, load, samples, list(warmup), server.base_url + "/metrics"
            )

    return asyncio.run(go())


def test_measured_figures_match_the_pace(server):
    samples = [Sample("go", 1, TOKENS)] * PROMPTS
    point = run(
        server,
        samples,
        serving.LoadConfig(math.inf, 1.0, CONCURRENCY),
        warmup=[Sample("warm", 1, 2)],
    )
    s = metrics.summarize(point.measured.records, point.measured.duration_s, (50, 99))
    assert s["completed"] == PROMPTS and s["failed"] == 0
    assert s["total_output_tokens"] == PROMPTS * TOKENS
    assert PACE.ttft_s <= s["median_ttft_ms"] / 1000 <= PACE.ttft_s + TTFT_SLACK_S
    assert s["median_itl_ms"] / 1000 == pytest.approx(PACE.itl_s, abs=ABS_TOL_S)
    assert s["mean_tpot_ms"] / 1000 == pytest.approx(PACE.itl_s, abs=ABS_TOL_S)
    expect_e2e = PACE.ttft_s + (TOKENS - 1) * PACE.itl_s
    assert s["median_e2el_ms"] / 1000 == pytest.approx(expect_e2e, abs=TTFT_SLACK_S)
    waves = PROMPTS / CONCURRENCY
    expect_tput = PROMPTS * TOKENS / (waves * expect_e2e)
    # The pace caps throughput; a busy box can only lower it.
    assert 0.6 * expect_tput <= s["output_throughput"] <= 1.1 * expect_tput
    assert s["max_concurrent_requests"] == CONCURRENCY
    # The role-only first chunk is not a token; usage agrees with one token per chunk.
    assert s["usage_warnings"] == {"missing": 0, "fewer_than_chunks": 0, "more_than_chunks": 0}
    # The warm-up ran, is kept apart, and the counter delta covers only the measured phase.
    assert point.warmup is not None and point.warmup.records[0].warmup
    assert point.server_tokens_delta == PROMPTS * TOKENS


def test_bad_responses_are_counted_not_fatal(server):
    prompts = ["ok", "FAIL400", "BADCHUNK", "CUTOFF", "ERRCHUNK", "NOUSAGE"]
    samples = [Sample(p, 1, 4) for p in prompts]
    point = run(server, samples, serving.LoadConfig(math.inf, 1.0, None), endpoint="completions")
    s = metrics.summarize(point.measured.records, point.measured.duration_s)
    assert s["completed"] == 2 and s["failed"] == 4
    errors = dict(zip(prompts, s["errors"], strict=True))
    assert errors["ok"] == "" and errors["NOUSAGE"] == ""
    assert errors["FAIL400"] == "HTTP 400: bad request on purpose"
    assert errors["BADCHUNK"].startswith("malformed stream chunk")
    assert errors["CUTOFF"] == "stream ended before data: [DONE]"
    assert "engine failed on purpose" in errors["ERRCHUNK"]
    assert s["usage_warnings"]["missing"] == 1


def test_unreachable_server_is_one_line_exit_1(capsys):
    assert main(["--base-url", "http://127.0.0.1:9", "--num-prompts", "1", "--no-progress"]) == 1
    assert capsys.readouterr().err.count("\n") == 1


def test_cli_sweep_writes_json_table_and_png(server, tmp_path, capsys):
    data = tmp_path / "w.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"p{i}", "max_tokens": 4}) for i in range(4)))
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(
        [
            "--base-url",
            server.base_url + "/v1",
            "--dataset",
            str(data),
            "--warmup",
            "1",
            "--sweep",
            "concurrency=1,4",
            "--slo",
            "ttft=1000,tpot=500",
            "--no-progress",
            "--save-result",
            str(out_json),
            "--plot",
            str(out_png),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "Mean TTFT (ms):" in out
    assert "Server-counted generated tokens:" in out
    doc = json.loads(out_json.read_text())
    assert doc["sweep"] == {"parameter": "concurrency", "values": [1, 4]}
    r1, r4 = doc["runs"]
    for r in (r1, r4):
        assert r["model_id"] == MODEL_ID and r["completed"] == 4 and r["failed"] == 0
        assert r["total_output_tokens"] == 16 and r["server_generation_tokens_delta"] == 16
        assert r["request_goodput"] == pytest.approx(r["request_throughput"])
        assert len(r["ttfts"]) == len(r["itls"]) == len(r["output_lens"]) == 4
        for key in (
            "request_throughput",
            "output_throughput",
            "total_token_throughput",
            "mean_ttft_ms",
            "median_ttft_ms",
            "p99_ttft_ms",
            "mean_tpot_ms",
            "mean_itl_ms",
            "mean_e2el_ms",
            "input_lens",
            "generated_texts",
            "errors",
            "duration",
            "total_input_tokens",
            "max_concurrency",
        ):
            assert key in r, key
    assert (r1["max_concurrency"], r4["max_concurrency"]) == (1, 4)
    assert r1["max_concurrent_requests"] == 1
    assert r1["output_throughput"] < r4["output_throughput"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_count_to_50_scenario(tmp_path, capsys):
    # A model that stops (EOS) after 40 tokens, decoding at 100 tok/s.
    pace = Pace(ttft_s=0.02, itl_s=0.01, stop_after=40)
    out_json = tmp_path / "s.json"
    with PaceServer(pace) as srv:
        rc = main(
            [
                "--base-url",
                srv.base_url,
                "--scenario",
                "count-to-50",
                "--num-prompts",
                "2",
                "--no-progress",
                "--save-result",
                str(out_json),
                "--metrics-url",
                "off",
            ]
        )
        assert srv.requests == 3  # one warm-up + two measured
    assert rc == 0
    r = json.loads(out_json.read_text())
    assert r["scenario"] == "count-to-50" and r["num_warmups"] == 1 and r["max_concurrency"] == 1
    assert r["output_lens"] == [40, 40] and r["max_concurrent_requests"] == 1
    assert r["median_output_throughput_per_user"] == pytest.approx(1 / pace.itl_s, rel=0.3)
    assert "Steady-state decode" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["--sweep", "concurrency=1,x"],
        ["--sweep", "batch=1"],
        ["--num-prompts", "0"],
        ["--slo", "ttft"],
        ["--dataset", "nope.jsonl"],
        ["--scenario", "count-to-50", "--endpoint", "completions"],
        ["--num-prompts", "many"],
        ["--range-ratio", "1.5"],
        ["--save-result", "/no/such/folder/r.json"],
    ],
)
def test_bad_cli_input_is_one_line_exit_2(argv, capsys):
    try:
        rc = main(["--base-url", "http://127.0.0.1:9", "--no-progress", *argv])
    except SystemExit as exc:  # argparse's own type errors
        rc = exc.code
    assert rc == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error" in err
