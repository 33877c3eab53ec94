"""`moeserve bench` notices when the server's prefix cache served the run's prompts.

The test double counts a prompt it has answered before as `prompt_tokens` prefix-cache hits.
A first run measures prefill: no hits, no warning. The same run again (same --seed, same
prompts) is served from the cache: the result JSON holds the hits of the measured phase and
the report says so in one line. Another seed, or no metrics, and there is nothing to say.
"""

from __future__ import annotations

import json

from bench_pace_server import Pace, PaceServer

from moeserve.bench.__main__ import main

PACE = Pace(ttft_s=0.01, itl_s=0.002, prompt_tokens=7)
PROMPTS = 4


def run(srv: PaceServer, out, capsys, *extra: str) -> tuple[dict, list[str]]:
    rc = main(
        [
            "--base-url",
            srv.base_url,
            "--dataset",
            "random",
            "--input-len",
            "12",
            "--output-len",
            "3",
            "--num-prompts",
            str(PROMPTS),
            "--warmup",
            "1",
            "--no-progress",
            "--save-result",
            str(out),
            *extra,
        ]
    )
    assert rc == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "prefix cache" in ln]
    return json.loads(out.read_text()), lines


def test_a_second_run_with_the_same_seed_is_flagged(tmp_path, capsys):
    with PaceServer(PACE) as srv:
        first, said_first = run(srv, tmp_path / "a.json", capsys)
        again, said_again = run(srv, tmp_path / "b.json", capsys)
        other, said_other = run(srv, tmp_path / "c.json", capsys, "--seed", "1")
        blind, said_blind = run(srv, tmp_path / "d.json", capsys, "--metrics-url", "off")
    assert first["server_prefix_cache_hits_delta"] == 0 and said_first == []
    # the warm-up prompt repeats too, but only the measured phase counts
    assert again["server_prefix_cache_hits_delta"] == PROMPTS * PACE.prompt_tokens
    assert (
        again["server_prefix_cache_hits_after"] - again["server_prefix_cache_hits_before"]
        == again["server_prefix_cache_hits_delta"]
    )
    (line,) = said_again
    assert line.startswith("warning: the server's prefix cache served 28 prompt tokens")
    assert "(100% of the input tokens)" in line and "--seed" in line
    assert other["server_prefix_cache_hits_delta"] == 0 and said_other == []
    assert blind["server_prefix_cache_hits_delta"] is None and said_blind == []
