"""CPU benchmark: moeserve vs llama.cpp and HF transformers on the same GGUF and cores, one run.

Decode: single-stream tok/s (128 greedy tokens, EOS ignored, prefill excluded) and throughput
at concurrency 8 and 32, for moeserve's configurations, llama.cpp's single stream (its runs
interleaved with moeserve's, so their ratio comes from one run) and HF transformers (fp32,
bf16). llama.cpp is llama-cpp-python when it is importable (skipped with a note when not):
the same GGUF file and thread count (every core), greedy (top_k 1); build it with
`CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" pip install
llama-cpp-python`. Each moeserve engine runs with the torch threads it sets up for itself
(1 where the native kernels serve, which have their own pool of every core; every core for
torch's kernels).
Prefill: tok/s of one prompt of 512 / 2k / 4k / 8k tokens (moeserve's default with the native
CPU kernels and with torch's, chunked prefill, prefix cache off; HF bf16 forward with
logits_to_keep=1 as generate() does), interleaved, best of the repeats. Batch invariance:
decode at concurrency 16 and whether 16 batched greedy requests equal their solo runs, for
the default (native kernels) and torch's kernels with and without --deterministic.
Writes benchmarks/results/cpu_decode.json and .md (with the CPU model and its SIMD flags).

    PYTHONPATH=$PWD python3 benchmarks/cpu_decode.py [--tokens 128] [--skip-hf] [--skip-decode]
        [--prefill-lengths 512,2048,4096,8000]
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
CONCURRENCY = (8, 32)
# /proc/cpuinfo flags that decide which kernels run (recorded with the results)
SIMD_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
              "amx_bf16", "amx_int8")  # fmt: skip


def _cores() -> int:
    return os.cpu_count() or 1


def _torch_threads_of(llm) -> None:
    """The torch threads an engine set up for itself (runner._native_threads): engines built
    earlier in this process may have changed the count since."""
    native = llm.engine.loaded.kernel_plan.cpu_native
    torch.set_num_threads(1 if native else _cores())


def _batch(ids: list[list[int]], n: int) -> list[list[int]]:
    """n prompts from the list, in turn (each request its own, even when prompts repeat)."""
    return [ids[i % len(ids)] for i in range(n)]


def _chat_ids(tok, text: str) -> list[int]:
    return tok.encode(
        tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False
    )


def bench_moeserve(configs: dict[str, dict], n_tokens: int, repeats: int) -> list[dict]:
    """Decode tok/s of moeserve's configurations and llama.cpp's single stream, their runs
    interleaved (this machine's speed drifts by tens of percent over minutes; back-to-back
    blocks would measure that)."""
    from moeserve.engine.offline import LLM
    from moeserve.sampling import SamplingParams

    engines = {label: LLM(None, max_model_len=1024, **kw) for label, kw in configs.items()}
    ids = [_chat_ids(next(iter(engines.values())).tokenizer, p) for p in PROMPTS]
    lcpp = _llama_cpp(n_tokens)

    def decode_rate(llm: LLM, batch: list[list[int]]) -> float:
        """Output tok/s after every request finished its prefill (decode-only steps)."""
        _torch_threads_of(llm)
        eng = llm.engine
        params = SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=True)
        for i, p in enumerate(batch):
            eng.add_request(f"bench-{time.monotonic_ns()}-{i}", p, params)
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

    runs: dict[str, dict[str, list[float]]] = {
        label: {k: [] for k in ("single", *map(str, CONCURRENCY))} for label in engines
    }
    lcpp_runs: list[float] = []
    for llm in engines.values():
        decode_rate(llm, ids[:1])  # warm-up
    if lcpp is not None:
        lcpp(ids[0])
    for _ in range(repeats):
        for label, llm in engines.items():
            runs[label]["single"].append(decode_rate(llm, ids[:1]))
            for c in CONCURRENCY:
                runs[label][str(c)].append(decode_rate(llm, _batch(ids, c)))
            if lcpp is not None:
                lcpp_runs.append(lcpp(ids[0]))
    rows = []
    for label in engines:
        row = {
            "system": "moeserve",
            "config": label,
            "engine_kwargs": configs[label],
            "single_stream_tok_s": statistics.median(runs[label]["single"]),
            "single_runs": runs[label]["single"],
        }
        for c in CONCURRENCY:
            row[f"concurrency{c}_tok_s"] = statistics.median(runs[label][str(c)])
            row[f"conc{c}_runs"] = runs[label][str(c)]
        rows.append(row)
    if lcpp is not None:
        rows.append(
            {
                "system": "llama.cpp",
                "config": "llama-cpp-python, same GGUF",
                "threads": _cores(),
                "single_stream_tok_s": statistics.median(lcpp_runs),
                "single_runs": lcpp_runs,
            }
        )
    return rows


def _llama_cpp(n_tokens: int):
    """A function: prompt ids -> llama.cpp's greedy decode tok/s after its first token (the
    same count as moeserve's), or None when llama-cpp-python is not importable."""
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    from moeserve.loader import default_model_path

    llm = Llama(model_path=default_model_path(), n_threads=_cores(), n_ctx=1024, verbose=False)

    def rate(ids: list[int]) -> float:
        t0, n = None, 0
        for _ in llm.generate(ids, top_k=1, temp=0.0, reset=True):
            n += 1
            if t0 is None:
                t0 = time.perf_counter()
            if n == n_tokens:
                break
        return (n - 1) / (time.perf_counter() - t0)

    return rate


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
        torch.set_num_threads(_cores())
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
    """Prefill tok/s per prompt length: moeserve's default (native CPU kernels), the same with
    torch's CPU kernels, and HF bf16, interleaved."""
    from moeserve.engine.offline import LLM
    from moeserve.sampling import SamplingParams

    engines = {
        kernels: LLM(
            None, max_model_len=max(lengths) + 16, enable_prefix_caching=False, cpu_kernels=kernels
        )
        for kernels in ("native", "torch")
    }
    hf = _hf_model(torch.bfloat16) if with_hf else None
    one = SamplingParams(max_tokens=1, temperature=0)
    for llm in engines.values():
        llm.generate([_random_ids(64, 0)], one)  # warm-up
    rows = []
    for n in lengths:
        runs: dict[str, list[float]] = {k: [] for k in (*engines, "hf")}
        for r in range(repeats):
            ids = _random_ids(n, 1 + r)
            for kernels, llm in engines.items():
                _torch_threads_of(llm)
                t = time.perf_counter()
                llm.generate([ids], one)
                runs[kernels].append(n / (time.perf_counter() - t))
            if hf is not None:
                torch.set_num_threads(_cores())
                with torch.inference_mode():
                    t = time.perf_counter()
                    hf(torch.tensor([ids]), logits_to_keep=1)
                    runs["hf"].append(n / (time.perf_counter() - t))
        row = {
            "tokens": n,
            "moeserve_tok_s": max(runs["native"]),
            "moeserve_runs": runs["native"],
            "torch_kernels_tok_s": max(runs["torch"]),
            "torch_kernels_runs": runs["torch"],
        }
        row["native_vs_torch"] = row["moeserve_tok_s"] / row["torch_kernels_tok_s"]
        if runs["hf"]:
            row.update(hf_bf16_tok_s=max(runs["hf"]), hf_runs=runs["hf"])
            row["ratio"] = row["moeserve_tok_s"] / row["hf_bf16_tok_s"]
        print("prefill", row, flush=True)
        rows.append(row)
    return rows


def bench_deterministic(n_tokens: int, repeats: int) -> dict:
    """Decode tok/s at concurrency 16 and how many of 16 batched greedy requests differ from
    their solo runs (which hit the prefix cache the batch filled): the default (native CPU
    kernels, batch-invariant by construction), torch's kernels with --deterministic (their
    batch-invariant attention) and without."""
    from moeserve.engine.offline import LLM
    from moeserve.sampling import SamplingParams

    modes = {  # label: engine settings
        "native": dict(cpu_kernels="native"),
        "torch --deterministic": dict(cpu_kernels="torch", deterministic=True),
        "torch": dict(cpu_kernels="torch"),
    }
    engines = {m: LLM(None, max_model_len=2048, max_num_seqs=16, **kw) for m, kw in modes.items()}
    prompts = [f"{p} (part {i})" for i, p in enumerate(PROMPTS * 2)]
    ids = [_chat_ids(engines["native"].tokenizer, p) for p in prompts]
    params = SamplingParams(max_tokens=n_tokens, temperature=0, ignore_eos=True)
    rates: dict[str, list[float]] = {m: [] for m in modes}
    batched: dict[str, list[list[int]]] = {}
    for _ in range(repeats):
        for mode, llm in engines.items():
            _torch_threads_of(llm)
            t = time.perf_counter()
            batched[mode] = [c.token_ids for c in llm.generate(ids, params)]
            rates[mode].append(len(ids) * n_tokens / (time.perf_counter() - t))
    out: dict = {"concurrency": len(ids), "tokens": n_tokens, "modes": {}}
    for mode, llm in engines.items():
        _torch_threads_of(llm)
        solo = [llm.generate([i], params)[0].token_ids for i in ids]
        out["modes"][mode] = {
            "tok_s": statistics.median(rates[mode]),
            "runs": rates[mode],
            "differ_from_solo": sum(a != b for a, b in zip(solo, batched[mode], strict=True)),
        }
    print("batch invariance", out, flush=True)
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

    commit = git_commit(mark_dirty=True)
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read().splitlines()
    except OSError:
        info = []
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")),
        platform.processor(),
    )
    flags = next((ln.split(":", 1)[1].split() for ln in info if ln.startswith("flags")), [])
    from moeserve.kernels.cpu import native_status

    return {
        "commit": commit,
        "cpu": cpu,
        "cpu_flags": [f for f in SIMD_FLAGS if f in flags],
        "native_kernels": native_status(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--prefill-lengths", default="512,2048,4096,8000")
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
        "bf16+int4, torch kernels": dict(dtype="auto", quantization="auto", cpu_kernels="torch"),
        "bf16+int4 (default)": dict(dtype="auto", quantization="auto"),
    }
    rows = bench_moeserve(configs, args.tokens, args.repeats)
    for r in rows:
        print(r["config"], r["single_stream_tok_s"], r.get("concurrency8_tok_s"), flush=True)
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
        "target": "single-stream >= 3x HF transformers (fp32) and >= 0.9x llama.cpp on the same "
        "GGUF and cores; prefill >= 2x HF bf16 at 4k tokens",
    }
    default = next((r for r in rows if r["config"] == "bf16+int4 (default)"), None)
    lcpp = next((r for r in rows if r["system"] == "llama.cpp"), None)
    if default and lcpp:
        out["default_vs_llama_cpp"] = default["single_stream_tok_s"] / lcpp["single_stream_tok_s"]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cpu_decode.json").write_text(json.dumps(out, indent=2))
    lines = [
        "# CPU decode: SmolLM2-135M-Instruct (Q4_1 GGUF)",
        "",
        f"commit {env['commit']}, {env['cpu']} ({env['cores']} cores), torch {env['torch']}, "
        f"transformers {env['transformers']}, {env['date']}. CPU flags: "
        f"{' '.join(env['cpu_flags'])}; kernels: {env['native_kernels']}. {args.tokens} greedy "
        f"tokens, EOS ignored, prefill excluded; median of {args.repeats} runs, moeserve's "
        "configurations and llama.cpp interleaved. Targets: single-stream >= 3x HF fp32 and "
        ">= 0.9x llama.cpp.",
        "",
        "| system | config | single stream tok/s | x HF fp32 | "
        + " | ".join(f"concurrency {c} tok/s" for c in CONCURRENCY)
        + " |",
        "|---|---|---|---|" + "---|" * len(CONCURRENCY),
    ]
    for r in rows:
        ratio = f"{r['single_stream_tok_s'] / hf32:.2f}" if hf32 else "-"
        conc = " | ".join(
            f"{r[f'concurrency{c}_tok_s']:.1f}" if f"concurrency{c}_tok_s" in r else "-"
            for c in CONCURRENCY
        )
        lines.append(
            f"| {r['system']} | {r['config']} | {r['single_stream_tok_s']:.1f} | {ratio} | {conc} |"
        )
    if "default_vs_llama_cpp" in out:
        lines += ["", f"Default / llama.cpp single stream: {out['default_vs_llama_cpp']:.2f}."]
    elif not lcpp:
        lines += ["", "llama.cpp: llama-cpp-python is not installed here, skipped (docstring)."]
    lines += [
        "",
        "## Prefill (one prompt, default config: bf16 + int4, chunked prefill)",
        "",
        "Best of the repeats; moeserve (native CPU kernels, the default), moeserve with torch's "
        "CPU kernels and HF interleaved on the same cores. Targets: native >= 0.95x torch's "
        "kernels; >= 2x HF bf16 at 4k.",
        "",
        "| prompt tokens | moeserve tok/s | torch kernels tok/s | native / torch | HF bf16 tok/s "
        "| x HF |",
        "|---|---|---|---|---|---|",
    ]
    for r in prefill:
        hf = f"{r['hf_bf16_tok_s']:.0f}" if "hf_bf16_tok_s" in r else "-"
        ratio = f"{r['ratio']:.2f}" if "ratio" in r else "-"
        lines.append(
            f"| {r['tokens']} | {r['moeserve_tok_s']:.0f} | {r['torch_kernels_tok_s']:.0f} | "
            f"{r['native_vs_torch']:.2f} | {hf} | {ratio} |"
        )
    if det:
        lines += [
            "",
            "## Batch invariance",
            "",
            f"{det['concurrency']} concurrent greedy requests, {det['tokens']} tokens each, "
            "default dtype; each then run alone (its prompt's pages from the prefix cache).",
            "",
            "| kernels | decode tok/s at concurrency 16 | batched requests that differ from "
            "their solo run |",
            "|---|---|---|",
        ]
        for mode, m in det["modes"].items():
            lines.append(f"| {mode} | {m['tok_s']:.1f} | {m['differ_from_solo']} |")
    (RESULTS / "cpu_decode.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
