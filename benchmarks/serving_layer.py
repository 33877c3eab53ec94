"""Prefill and loaded decode on full-size layers (one GPU): time to first token of an
8k-token prompt beside decode, and decode throughput at concurrency 64 with Poisson
arrivals beside the closed-loop figure.

Run on the GPU machine from the repository root:
  PYTHONPATH=$PWD python benchmarks/serving_layer.py --out benchmarks/results [--commit SHA]

Method. The engine is built from a published config (benchmarks/configs/) with
`--load-format dummy --num-layers 6` (one dense layer, five MoE layers), CUDA graphs on, and
driven step by step in this process (no HTTP: what is timed is the engine, host work
included). Random prompt ids, greedy, ignore_eos.
- TTFT: one prompt of N tokens alone (N = 1k, 8k), from add_request to the step that
  returns its first token; a same-length prompt first compiles the kernels for that shape.
  The prefill is chunked at the engine's token budget (--max-num-batched-tokens).
- Decode at concurrency 64: 192 requests of 512 prompt tokens and 128 output tokens.
  Closed loop: 64 in flight, a new one as soon as one ends. Poisson: arrivals at the rate the
  closed loop sustained (offered load = capacity), at most 64 running. Reported: output
  tokens/s over the run, median decode-only step time, and TTFT p50/p99.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch
from common import git_commit

HERE = Path(__file__).resolve().parent
LAYERS = 6
CONCURRENCY = 64
REQUESTS = 192
PROMPT = 512
OUTPUT = 128
TTFT_LENGTHS = (1024, 8192)


def _ids(n: int, rng: random.Random, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


def _params(max_tokens: int):
    from moeserve.sampling import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def ttft(engine, length: int, rng: random.Random, vocab: int) -> float:
    """Seconds from add_request to the first token of one `length`-token prompt alone."""
    for tag in ("warm", "timed"):
        t0 = time.perf_counter()
        engine.add_request(f"ttft-{tag}-{length}", _ids(length, rng, vocab), _params(2))
        first = None
        while engine.has_unfinished():
            outs = engine.step()
            if first is None and any(o.token_ids for o in outs):
                first = time.perf_counter() - t0
    return first


def loaded_decode(
    engine, poisson_rate: float | None, rng: random.Random, vocab: int, requests: int
) -> dict:
    """Run `requests` requests at CONCURRENCY; closed loop when `poisson_rate` is None."""
    prompts = [_ids(PROMPT, rng, vocab) for _ in range(requests)]
    arrivals, t = [], 0.0
    for _ in range(requests):
        t += rng.expovariate(poisson_rate) if poisson_rate else 0.0
        arrivals.append(t)
    start = time.perf_counter()
    added, running = 0, set()
    sent: dict[str, float] = {}
    first: dict[str, float] = {}
    decode_steps: list[float] = []
    tokens = 0
    while added < requests or engine.has_unfinished():
        now = time.perf_counter() - start
        while (
            added < requests
            and len(running) < CONCURRENCY
            and (poisson_rate is None or arrivals[added] <= now)
        ):
            rid = f"r{added}"
            engine.add_request(rid, prompts[added], _params(OUTPUT))
            sent[rid] = max(now, arrivals[added]) if poisson_rate else now
            running.add(rid)
            added += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[added] - now))
            continue
        prefilling = len(engine.scheduler.waiting) + sum(
            r.num_computed < r.num_tokens - 1 for r in engine.scheduler.running
        )
        t0 = time.perf_counter()
        outs = engine.step()
        if not prefilling:
            decode_steps.append(time.perf_counter() - t0)
        for o in outs:
            tokens += len(o.token_ids)
            if o.token_ids and o.request_id not in first:
                first[o.request_id] = time.perf_counter() - start - sent[o.request_id]
            if o.finished:
                running.discard(o.request_id)
    wall = time.perf_counter() - start
    ttfts = sorted(first.values())
    return {
        "output_tokens_per_s": tokens / wall,
        "wall_s": wall,
        "requests_per_s": requests / wall,
        "decode_step_ms_median": 1000 * statistics.median(decode_steps) if decode_steps else None,
        "decode_only_steps": len(decode_steps),
        "ttft_p50_s": ttfts[len(ttfts) // 2],
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
    }


def _versions(commit: str | None) -> dict:

    import triton

    return {
        "commit": git_commit(commit),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--commit", default=None)
    ap.add_argument("--config", default=str(HERE / "configs/kimi-k2.5-nvfp4"))
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--load-format", default="dummy", help="auto for a small real checkpoint")
    ap.add_argument("--ttft-lengths", default=",".join(map(str, TTFT_LENGTHS)))
    ap.add_argument("--requests", type=int, default=REQUESTS)
    args = ap.parse_args()
    lengths = [int(n) for n in args.ttft_lengths.split(",")]
    from moeserve.engine.core import build_engine

    engine = build_engine(
        args.config,
        load_format=args.load_format,
        num_layers=LAYERS if args.load_format == "dummy" else None,
        max_model_len=max(*lengths, PROMPT + OUTPUT) + 64,
        max_num_seqs=CONCURRENCY,
        max_num_batched_tokens=args.max_num_batched_tokens,
        cuda_graph_max_bs=CONCURRENCY,
    )
    rng = random.Random(0)
    vocab = engine.vocab_limit  # ids the tokenizer can decode
    res: dict = {
        "versions": _versions(args.commit),
        "config": Path(args.config).name,
        "layers": LAYERS,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "ttft_s": {},
    }
    for n in lengths:
        res["ttft_s"][str(n)] = ttft(engine, n, rng, vocab)
        print(f"TTFT {n} tokens: {res['ttft_s'][str(n)] * 1000:.1f} ms", flush=True)
    loaded_decode(engine, None, random.Random(1), vocab, CONCURRENCY)  # warm-up: compile, graphs
    closed = loaded_decode(engine, None, rng, vocab, args.requests)
    print("closed loop", closed, flush=True)
    poisson = loaded_decode(engine, closed["requests_per_s"], rng, vocab, args.requests)
    print("poisson", poisson, flush=True)
    res["closed_loop"], res["poisson"] = closed, poisson
    engine.shutdown()
    out = Path(args.out)
    (out / "serving_layer.json").write_text(json.dumps(res, indent=1) + "\n")
    v = res["versions"]
    lines = [
        "# Prefill and loaded decode on full-size layers (one GPU)",
        "",
        f"commit {v['commit']}, {v['gpu']}, torch {v['torch']}, triton {v['triton']}. "
        f"{res['config']}, dummy weights, {LAYERS} layers (1 dense + {LAYERS - 1} MoE), CUDA "
        f"graphs, token budget {args.max_num_batched_tokens}. Method: "
        "benchmarks/serving_layer.py docstring.",
        "",
        "| figure | value |",
        "|---|---|",
    ]
    for n, s in res["ttft_s"].items():
        lines.append(
            f"| TTFT, {n}-token prompt alone | {s * 1000:.0f} ms ({int(n) / s:.0f} tok/s) |"
        )
    for name, r in (("closed loop", closed), ("Poisson arrivals", poisson)):
        lines.append(
            f"| concurrency {CONCURRENCY}, {name}: output tok/s | "
            f"{r['output_tokens_per_s']:.0f} (decode step {r['decode_step_ms_median']:.2f} ms "
            f"median; TTFT p50 {r['ttft_p50_s'] * 1000:.0f} ms, p99 "
            f"{r['ttft_p99_s'] * 1000:.0f} ms) |"
        )
    (out / "serving_layer.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
