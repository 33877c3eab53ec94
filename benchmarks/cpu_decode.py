"""CPU benchmark: moeserve vs HF transformers on the same GGUF and cores, one run.

Decode: single-stream tok/s (128 greedy tokens, EOS ignored, prefill excluded) and throughput
at concurrency 8, for moeserve's configurations and HF transformers (fp32, bf16).
Prefill: tok/s of one prompt of 512 / 2k / 4k / 8k tokens (moeserve default config with its
chunked prefill, prefix cache off; HF bf16 forward with logits_to_keep=1 as generate() does),
interleaved, best of the repeats. Deterministic mode: decode at concurrency 16 with the
batch-invariant attention on and off, and whether 16 batched greedy requests equal their solo
runs. Writes benchmarks/results/cpu_decode.json and .md.

    python3 benchmarks/cpu_decode.py [--tokens 128] [--skip-hf] [--skip-decode]
        [--prefill-lengths 512,2048,4096,8192]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch
from common import git_commit

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a refrigerator works.",
    "What are the main causes of the French Revolution?",
    "Describe the water cycle.",
    "Give advice to a new programmer.",
    "Why is the sky blue?",
    "Summarize the rules of chess.",
    "What makes a good cup of coffee?",
]
RESULTS = Path(__file__).parent / "results"


def _chat_ids(tok, text: str) -> list[int]:
    return tok.encode(
        tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False
    )


def bench_moeserve(label: str, n_tokens: int, repeats: int, **engine_kw) -> dict:
    from moeserve.engine.engine import LLM
    from moeserve.sampling import SamplingParams

    llm = LLM(None, **engine_kw)
    ids = [_chat_ids(llm.tokenizer, p) for p in PROMPTS]
    eng = llm.engine

    def decode_rate(batch: list[list[int]]) -> float:
        """Output tok/s after every request finished its prefill (decode-only steps)."""
        params = SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=True)
        for i, p in enumerate(batch):
            eng.add_request(f"{label}-{time.monotonic_ns()}-{i}", p, params)
        produced, t0 = 0, None
        while eng.has_unfinished():
            outs = eng.step()
            if (
                t0 is None
                and all(r.num_computed >= len(r.prompt_ids) for r in eng.scheduler.running)
                and not eng.scheduler.waiting
            ):
                t0, produced = time.perf_counter(), 0
                continue
            produced += sum(len(o.token_ids) for o in outs)
        return produced / (time.perf_counter() - t0)

    decode_rate(ids[:1])  # warm-up
    single = [decode_rate(ids[:1]) for _ in range(repeats)]
    conc8 = [decode_rate(ids) for _ in range(repeats)]
    return {
        "system": "moeserve",
        "config": label,
        "engine_kwargs": engine_kw,
        "single_stream_tok_s": statistics.median(single),
        "single_runs": single,
        "concurrency8_tok_s": statistics.median(conc8),
        "conc8_runs": conc8,
    }


def bench_hf(dtype: torch.dtype, n_tokens: int, repeats: int) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    from moeserve.loader import default_model_path
    from moeserve.tokenizer.gguf_vocab import build_gguf_tokenizer

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype
    )
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 2
    import gguf

    from moeserve.loader.gguf import read_metadata

    tok = build_gguf_tokenizer(read_metadata(gguf.GGUFReader(path)))
    ids = [_chat_ids(tok, p) for p in PROMPTS]

    def rate(batch: list[list[int]]) -> float:
        width = max(map(len, batch))
        inp = torch.tensor([[2] * (width - len(b)) + b for b in batch])
        mask = torch.tensor([[0] * (width - len(b)) + [1] * len(b) for b in batch])
        with torch.inference_mode():
            t = time.perf_counter()
            model.generate(inp, attention_mask=mask, max_new_tokens=1, do_sample=False)
            prefill = time.perf_counter() - t
            t = time.perf_counter()
            model.generate(inp, attention_mask=mask, max_new_tokens=n_tokens, do_sample=False)
            total = time.perf_counter() - t
        return len(batch) * (n_tokens - 1) / (total - prefill)

    rate(ids[:1])
    single = [rate(ids[:1]) for _ in range(repeats)]
    conc8 = [rate(ids) for _ in range(repeats)]
    return {
        "system": "hf-transformers",
        "config": str(dtype)[6:],
        "single_stream_tok_s": statistics.median(single),
        "single_runs": single,
        "concurrency8_tok_s": statistics.median(conc8),
        "conc8_runs": conc8,
    }


def _random_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


def bench_prefill(lengths: list[int], repeats: int, with_hf: bool) -> list[dict]:
    """Prefill tok/s per prompt length, moeserve (default config) and HF bf16, interleaved."""
    from moeserve.engine.engine import LLM
    from moeserve.sampling import SamplingParams

    llm = LLM(None, max_model_len=max(lengths) + 16, enable_prefix_caching=False)
    hf = _hf_model(torch.bfloat16) if with_hf else None
    one = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([_random_ids(64, 0)], one)  # warm-up
    rows = []
    for n in lengths:
        ours, theirs = [], []
        for r in range(repeats):
            ids = _random_ids(n, 1 + r)
            t = time.perf_counter()
            llm.generate([ids], one)
            ours.append(n / (time.perf_counter() - t))
            if hf is not None:
                with torch.inference_mode():
                    t = time.perf_counter()
                    hf(torch.tensor([ids]), logits_to_keep=1)
                    theirs.append(n / (time.perf_counter() - t))
        row = {"tokens": n, "moeserve_tok_s": max(ours), "moeserve_runs": ours}
        if theirs:
            row.update(hf_bf16_tok_s=max(theirs), hf_runs=theirs)
            row["ratio"] = row["moeserve_tok_s"] / row["hf_bf16_tok_s"]
        print("prefill", row, flush=True)
        rows.append(row)
    return rows


def bench_deterministic(n_tokens: int, repeats: int) -> dict:
    """Decode tok/s at concurrency 16, batch-invariant attention on vs off, and solo-vs-batch
    equality of 16 greedy requests in each mode (default dtype)."""
    from moeserve.engine.engine import LLM
    from moeserve.loader import set_batch_invariant
    from moeserve.sampling import SamplingParams

    llm = LLM(None, max_model_len=2048, max_num_seqs=16)
    prompts = [f"{p} (part {i})" for i, p in enumerate(PROMPTS * 2)]
    ids = [_chat_ids(llm.tokenizer, p) for p in prompts]
    params = SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=True)
    model = llm.engine.loaded.model
    rates: dict[bool, list[float]] = {True: [], False: []}
    batched: dict[bool, list[list[int]]] = {}
    for _ in range(repeats):
        for on in (True, False):
            set_batch_invariant(model, on)
            t = time.perf_counter()
            batched[on] = [c.token_ids for c in llm.generate(ids, params)]
            rates[on].append(len(ids) * n_tokens / (time.perf_counter() - t))
    differ = {}
    for on in (True, False):
        set_batch_invariant(model, on)
        solo = [llm.generate([i], params)[0].token_ids for i in ids]
        differ[on] = sum(a != b for a, b in zip(solo, batched[on], strict=True))
    on, off = statistics.median(rates[True]), statistics.median(rates[False])
    out = {
        "concurrency": len(ids),
        "tokens": n_tokens,
        "deterministic_tok_s": on,
        "default_batched_tok_s": off,
        "cost_pct": 100 * (off - on) / off,
        "differ_from_solo_deterministic": differ[True],
        "differ_from_solo_batched": differ[False],
    }
    print("deterministic", out, flush=True)
    return out


def _hf_model(dtype: torch.dtype):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    from moeserve.loader import default_model_path

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype
    ).eval()


def _env() -> dict:
    import transformers

    commit = git_commit()
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
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--prefill-lengths", default="512,2048,4096,8192")
    ap.add_argument("--prefill-repeats", type=int, default=2)
    args = ap.parse_args()
    lengths = [int(x) for x in args.prefill_lengths.split(",") if x]
    prefill = bench_prefill(lengths, args.prefill_repeats, not args.skip_hf) if lengths else []
    determinism = bench_deterministic(64, 2)
    if args.skip_decode:  # keep the decode rows of the last full run
        last = RESULTS / "cpu_decode.json"
        rows = json.loads(last.read_text()).get("rows", []) if last.exists() else []
        for r in rows:
            r.setdefault("note", "decode row from the previous full run")
        _write(args, rows, prefill, determinism)
        return
    rows = []
    configs = {
        "fp32": dict(dtype="float32", quantization="none"),
        "bf16+int8": dict(dtype="bfloat16", quantization="int8"),
        "bf16+int4 (default)": dict(dtype="auto", quantization="auto"),
    }
    for label, kw in configs.items():
        rows.append(bench_moeserve(label, args.tokens, args.repeats, **kw))
        print(rows[-1]["config"], rows[-1]["single_stream_tok_s"], rows[-1]["concurrency8_tok_s"])
    if not args.skip_hf:
        for dt in (torch.float32, torch.bfloat16):
            rows.append(bench_hf(dt, args.tokens, args.repeats))
            print("hf", dt, rows[-1]["single_stream_tok_s"], rows[-1]["concurrency8_tok_s"])
    _write(args, rows, prefill, determinism)


def _write(args: argparse.Namespace, rows: list[dict], prefill: list[dict], det: dict) -> None:
    env = _env()
    hf32 = next((r["single_stream_tok_s"] for r in rows if r["config"] == "float32"), None)
    out = {
        "benchmark": "cpu_decode",
        "model": "SmolLM2-135M-Instruct Q4_1 GGUF",
        "tokens": args.tokens,
        "env": env,
        "rows": rows,
        "prefill": prefill,
        "deterministic": det,
        "target": "single-stream >= 3x HF transformers (fp32) on the same GGUF; prefill >= 2x "
        "HF bf16 at 4k tokens",
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cpu_decode.json").write_text(json.dumps(out, indent=2))
    lines = [
        "# CPU decode: SmolLM2-135M-Instruct (Q4_1 GGUF)",
        "",
        f"commit {env['commit']}, {env['cpu']} ({env['cores']} cores), torch {env['torch']}, "
        f"transformers {env['transformers']}, {env['date']}. {args.tokens} greedy tokens, EOS "
        "ignored, prefill excluded; median of "
        f"{args.repeats} runs. Target: single-stream >= 3x HF fp32.",
        "",
        "| system | config | single stream tok/s | x HF fp32 | concurrency 8 tok/s |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = f"{r['single_stream_tok_s'] / hf32:.2f}" if hf32 else "-"
        lines.append(
            f"| {r['system']} | {r['config']} | {r['single_stream_tok_s']:.1f} | "
            f"{ratio} | {r['concurrency8_tok_s']:.1f} |"
        )
    lines += [
        "",
        "## Prefill (one prompt, default config: bf16 + int4, chunked at 2,048 tokens)",
        "",
        "Best of the repeats, moeserve and HF interleaved on the same cores. Target: >= 2x HF "
        "bf16 at 4k.",
        "",
        "| prompt tokens | moeserve tok/s | HF bf16 tok/s | x HF |",
        "|---|---|---|---|",
    ]
    for r in prefill:
        hf = r.get("hf_bf16_tok_s")
        ratio = f"{r['ratio']:.2f}" if hf else "-"
        lines.append(
            f"| {r['tokens']} | {r['moeserve_tok_s']:.0f} | {hf:.0f} | {ratio} |"
            if hf
            else f"| {r['tokens']} | {r['moeserve_tok_s']:.0f} | - | - |"
        )
    if det:
        lines += [
            "",
            "## Deterministic mode (batch-invariant attention)",
            "",
            f"{det['concurrency']} concurrent greedy requests, {det['tokens']} tokens each, "
            "default dtype: decode "
            f"{det['deterministic_tok_s']:.1f} tok/s deterministic vs "
            f"{det['default_batched_tok_s']:.1f} tok/s padded-batch attention (cost "
            f"{det['cost_pct']:.1f}%); requests whose batched tokens differ from their solo run: "
            f"{det['differ_from_solo_deterministic']} deterministic, "
            f"{det['differ_from_solo_batched']} without.",
        ]
    (RESULTS / "cpu_decode.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
