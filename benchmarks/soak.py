"""Soak test of the real server on the CPU default model (SmolLM2-135M): mixed traffic, no
5xx, pages and memory back to baseline, and the latency of small requests while a 4k-token
prompt prefills.

Starts `moeserve serve` as a child process, then sends N requests (default 2,000) from an
async client at a fixed concurrency: chat and completion streams, streams the client drops
after a few events (aborts), n > 1, prompt lists, bad requests (they must get a 4xx), the
requests that once killed the engine, long prompts. Then a phase with one 4,096-token
prompt prefilling while small requests keep arriving (their p50/p99 latency is reported).
Writes benchmarks/results/soak.json and soak.md (soak_TAG.* with --tag; --model and
--serve-args serve another checkpoint or layout, e.g. a tiny Kimi checkpoint with "-tp 2").

    python3 benchmarks/soak.py [--requests 2000] [--concurrency 16] [--port 8765]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import re
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
from common import git_commit

RESULTS = Path(__file__).parent / "results"
WORDS = (
    "river mountain cloud harbor lantern orchard meadow canyon glacier prairie volcano "
    "library theorem violin compass garden bridge castle desert forest island ocean"
).split()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


# RSS is read this long after the server went idle: the engine returns freed heap memory to
# the system after 1 s of idleness (moeserve.engine.async_engine.trim_host_heap)
IDLE_SETTLE_S = 2.5
OK_KINDS = ("chat-stream", "chat", "completion-n", "prompt-list", "long-prompt", "penalties")


def make_request(rng: random.Random, i: int) -> tuple[str, str, dict, str]:
    """(kind, path, body, expectation) of request i; expectation: ok | 4xx | abort."""
    r = rng.random()
    chat = {"messages": [{"role": "user", "content": f"{words(rng, 6)} #{i}"}]}
    if r < 0.25:
        return (
            "chat-stream",
            "/v1/chat/completions",
            {
                **chat,
                "stream": True,
                "max_tokens": rng.randint(1, 16),
                "stream_options": {"include_usage": True},
            },
            "ok",
        )
    if r < 0.40:
        return (
            "chat",
            "/v1/chat/completions",
            {
                **chat,
                "max_tokens": rng.randint(1, 12),
                "temperature": rng.choice([0, 0.7, 1.0]),
                "seed": rng.randint(0, 2**63),
            },
            "ok",
        )
    if r < 0.52:
        return (
            "completion-n",
            "/v1/completions",
            {
                "prompt": words(rng, 8),
                "n": rng.randint(2, 4),
                "max_tokens": rng.randint(1, 8),
                "temperature": 0.8,
            },
            "ok",
        )
    if r < 0.60:
        return (
            "prompt-list",
            "/v1/completions",
            {
                "prompt": [words(rng, 5) for _ in range(rng.randint(2, 4))],
                "max_tokens": 4,
            },
            "ok",
        )
    if r < 0.72:
        return (
            "abort",
            "/v1/chat/completions",
            {
                **chat,
                "stream": True,
                "max_tokens": 200,
                "ignore_eos": True,
            },
            "abort",
        )
    if r < 0.76:
        return (
            "long-prompt",
            "/v1/completions",
            {
                "prompt": words(rng, rng.randint(600, 1500)),
                "max_tokens": 2,
            },
            "ok",
        )
    if r < 0.82:
        return (
            "penalties",
            "/v1/completions",
            {
                "prompt": "Hi Hi Hi",
                "max_tokens": 4,
                "temperature": 1,
                "repetition_penalty": rng.choice([1e-38, 0.5, 2.0]),
                "frequency_penalty": rng.choice([0, 1.5]),
                "logit_bias": {str(rng.randint(0, 49151)): rng.uniform(-100, 100)},
            },
            "ok",
        )
    bad = [
        {"prompt": "Hi", "max_tokens": 2, "seed": 2**64},
        {"prompt": "Hi", "max_tokens": 4, "min_tokens": 2, "stop_token_ids": [49153]},
        {"prompt": "Hi", "min_tokens": 1, "stop_token_ids": list(range(49152))},
        {"prompt": "Hi", "max_tokens": -1},
        {"prompt": [], "max_tokens": 2},
        {"prompt": "Hi", "temperature": "hot"},
        {"prompt": "Hi", "logit_bias": {"x": 1}},
        {"prompt": "Hi", "max_tokens": 10**9},
        {"prompt": "a\ud800b"},
    ]
    return "bad", "/v1/completions", rng.choice(bad), "4xx"


async def send(
    client: httpx.AsyncClient, rng: random.Random, kind: str, path: str, body: dict, expect: str
) -> tuple[str, int, float, str]:
    t0 = time.perf_counter()
    if body.get("stream"):
        async with client.stream("POST", path, json=body) as r:
            status, seen, error = r.status_code, 0, ""
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"error"' in line[:20]:
                    error = line
                seen += 1
                if expect == "abort" and seen >= rng.randint(2, 6):
                    break  # the client goes away: the server must abort and free pages
            if error and '"code": 5' in error:
                status = 500  # an error event inside the stream counts as a 5xx
    else:
        # ensure_ascii: a lone surrogate travels as the JSON escape a hostile client sends
        raw = json.dumps(body).encode()
        r = await client.post(path, content=raw, headers={"content-type": "application/json"})
        status = r.status_code
    return kind, status, time.perf_counter() - t0, expect


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else float("nan")


def rss_mb(pid: int) -> float:
    import psutil

    return psutil.Process(pid).memory_info().rss / 2**20


async def wait_idle(client: httpx.AsyncClient, timeout: float = 120.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        text = (await client.get("/metrics")).text
        running = metric(text, "moeserve_num_requests_running")
        waiting = metric(text, "moeserve_num_requests_waiting")
        usage = metric(text, "moeserve_kv_cache_usage_ratio")
        if (running == 0 and waiting == 0 and usage == 0) or time.monotonic() > deadline:
            return {"running": running, "waiting": waiting, "kv_usage": usage}
        await asyncio.sleep(0.2)


async def prefill_phase(
    client: httpx.AsyncClient, rng: random.Random, small: int, tokens: int = 4096
) -> dict:
    """One `tokens`-token prompt prefilling while small requests keep arriving."""
    tok = await client.post("/tokenize", json={"prompt": words(rng, tokens + 1000)})
    ids = tok.json()["tokens"][:tokens]
    t0 = time.perf_counter()
    big = asyncio.create_task(client.post("/v1/completions", json={"prompt": ids, "max_tokens": 1}))
    lat: list[float] = []
    while not big.done() and len(lat) < small:
        ts = time.perf_counter()
        r = await client.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 4})
        assert r.status_code == 200, r.text
        lat.append(time.perf_counter() - ts)
    resp = await big
    big_s = time.perf_counter() - t0
    lat.sort()
    return {
        "prompt_tokens": len(ids),
        "prefill_request_s": big_s,
        "prefill_tok_s": len(ids) / big_s,
        "prefill_status": resp.status_code,
        "small_requests_during_prefill": len(lat),
        "small_p50_s": statistics.median(lat) if lat else None,
        "small_p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else None,
        "small_max_s": lat[-1] if lat else None,
    }


async def run(args: argparse.Namespace, pid: int) -> dict:
    rng = random.Random(args.seed)
    base = f"http://127.0.0.1:{args.port}"
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(base_url=base, timeout=600, limits=limits) as client:
        # warm-up until every kind of request that succeeds has run once (the long prompts
        # set the allocator's high-water mark of activations), then the baseline: memory
        # that grows beyond it is held by requests that are gone
        seen: set[str] = set()
        i = 0
        while len(seen) < len(OK_KINDS):
            kind, path, body, expect = make_request(rng, -1 - i)
            i += 1
            if expect == "ok" and kind not in seen:
                seen.add(kind)
                if kind == "long-prompt":  # the longest the mix sends
                    body = {**body, "prompt": words(rng, 1500)}
                await send(client, rng, kind, path, body, expect)
        await wait_idle(client)
        await asyncio.sleep(IDLE_SETTLE_S)
        base_rss = rss_mb(pid)
        queue: asyncio.Queue = asyncio.Queue()
        results: list[tuple[str, int, float, str]] = []

        async def worker() -> None:
            while not queue.empty():
                kind, path, body, expect = queue.get_nowait()
                try:
                    results.append(await send(client, rng, kind, path, body, expect))
                except httpx.HTTPError as e:
                    results.append((kind, -1, 0.0, f"{expect}: {type(e).__name__}"))

        # two halves, RSS after each: a leak grows with the requests, an allocator's
        # high-water mark does not
        t0 = time.perf_counter()
        half_rss = []
        for lo, hi in ((0, args.requests // 2), (args.requests // 2, args.requests)):
            for i in range(lo, hi):
                queue.put_nowait(make_request(rng, i))
            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
            idle = await wait_idle(client)
            await asyncio.sleep(IDLE_SETTLE_S)
            half_rss.append(rss_mb(pid))
        wall = time.perf_counter() - t0
        end_rss = half_rss[-1]
        phase = await prefill_phase(client, rng, args.small_requests, args.prefill_tokens)
        idle2 = await wait_idle(client)
        health = (await client.get("/health")).status_code
    statuses = Counter(s for _, s, _, _ in results)
    by_kind: dict[str, Counter] = {}
    for kind, s, _, _ in results:
        by_kind.setdefault(kind, Counter())[str(s)] += 1
    wrong = [
        (k, s, e)
        for k, s, _, e in results
        if (e == "ok" and s != 200) or (e == "4xx" and not 400 <= s < 500) or s < 0
    ]
    return {
        "requests": len(results),
        "wall_s": wall,
        "statuses": {str(k): v for k, v in sorted(statuses.items())},
        "by_kind": {k: dict(v) for k, v in sorted(by_kind.items())},
        "server_errors_5xx": sum(v for k, v in statuses.items() if k >= 500),
        "unexpected": [list(w) for w in wrong[:20]],
        "unexpected_count": len(wrong),
        "after_soak": idle,
        "rss_baseline_mb": base_rss,
        "rss_after_mb": end_rss,
        "rss_after_each_half_mb": half_rss,
        "prefill_phase": phase,
        "after_prefill_phase": idle2,
        "health_at_end": health,
    }


def env_info() -> dict:
    import torch

    commit = git_commit(mark_dirty=True)
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in open("/proc/cpuinfo")
            if ln.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "commit": commit,
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--small-requests", type=int, default=200)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="checkpoint to serve (default: the CPU default)")
    ap.add_argument("--serve-args", default="", help='more serve flags, e.g. "-tp 2"')
    ap.add_argument("--tag", default="", help="results go to soak_TAG.{json,md}")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--prefill-tokens", type=int, default=4096, help="the long prompt's length")
    args = ap.parse_args()
    cmd = [sys.executable, "-m", "moeserve.cli", "serve", *([args.model] if args.model else [])]
    cmd += ["--port", str(args.port), "--max-model-len", str(args.max_model_len)]
    cmd += ["--log-level", "warning"]
    cmd += args.serve_args.split()
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{args.port}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start: {server.stderr.read()}")
            time.sleep(0.5)
        try:
            out = asyncio.run(run(args, server.pid))
        except Exception:
            if server.poll() is not None:  # the server died: its last words say why
                sys.stderr.write(server.stderr.read()[-4000:])
            raise
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    model = args.model or "SmolLM2-135M-Instruct Q4_1 (CPU default)"
    out = {"benchmark": "soak", "model": model, "serve_args": args.serve_args, **out}
    out["env"] = env_info()
    out["server_exit_code_after_sigterm"] = server.returncode
    RESULTS.mkdir(exist_ok=True)
    name = f"soak_{args.tag}" if args.tag else "soak"
    (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=2))
    p = out["prefill_phase"]
    e = out["env"]
    lines = [
        f"# Soak: the CPU server under mixed traffic ({model}"
        + (f", {args.serve_args})" if args.serve_args else ")"),
        "",
        f"commit {e['commit']}, {e['cpu']} ({e['cores']} cores), torch {e['torch']}, "
        f"{e['date']}. `python3 benchmarks/soak.py --requests {args.requests} --concurrency "
        f"{args.concurrency}"
        + (f" --model {args.model}" if args.model else "")
        + (f' --serve-args "{args.serve_args}"' if args.serve_args else "")
        + (f" --max-model-len {args.max_model_len}" if args.max_model_len != 8192 else "")
        + (f" --prefill-tokens {args.prefill_tokens}" if args.prefill_tokens != 4096 else "")
        + "`.",
        "",
        "| figure | value |",
        "|---|---|",
        f"| requests (mixed) | {out['requests']} in {out['wall_s']:.0f} s |",
        f"| HTTP statuses | {out['statuses']} |",
        f"| 5xx | {out['server_errors_5xx']} |",
        f"| unexpected outcomes (ok not 200, bad not 4xx, transport errors) | "
        f"{out['unexpected_count']} |",
        f"| after the soak: running / waiting / KV usage | {out['after_soak']['running']:.0f} / "
        f"{out['after_soak']['waiting']:.0f} / {out['after_soak']['kv_usage']:.3f} |",
        f"| server RSS baseline -> after half / all the requests | "
        f"{out['rss_baseline_mb']:.0f} MB -> {out['rss_after_each_half_mb'][0]:.0f} MB -> "
        f"{out['rss_after_mb']:.0f} MB |",
        f"| {p['prompt_tokens']:,}-token prompt: prefill request | {p['prefill_request_s']:.1f} s "
        f"({p['prefill_tok_s']:.0f} tok/s) |",
        f"| small requests served during that prefill | {p['small_requests_during_prefill']} |",
        f"| their latency p50 / p99 / max | {p['small_p50_s']:.2f} s / {p['small_p99_s']:.2f} s / "
        f"{p['small_max_s']:.2f} s |",
        f"| /health at the end | {out['health_at_end']} |",
        "",
        "Per kind: " + json.dumps(out["by_kind"]),
    ]
    (RESULTS / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
