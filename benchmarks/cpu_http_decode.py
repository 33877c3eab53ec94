"""CPU, the default model, count-to-50 at batch 1: the same decode over HTTP, offline, and in
llama.cpp, in one run.

- offline: `LLM(None)` in this process with its default threads (the native kernels' pool on
  every core, torch on one), greedy, 256 tokens, EOS ignored; decode tok/s = tokens after the
  first / (time after the first token).
- HTTP: `moeserve serve` with its defaults in a subprocess, then `moeserve bench --scenario
  count-to-50` (streaming, its own process, as a user would measure it); its "steady-state
  decode, median" tok/s.
- llama.cpp: llama-cpp-python when it is installed (build it with
  `CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" pip install
  llama-cpp-python`), the same GGUF file, the same thread count, greedy, 256 tokens; decode
  tok/s after the first token. Skipped with a note when absent.

The three run in turn, pass after pass (this machine's speed drifts by tens of percent
over minutes); medians of the passes. Writes benchmarks/results/cpu_http_decode.{json,md}.
Targets: HTTP within 10% of offline; offline >= 0.9x llama.cpp.

    PYTHONPATH=$PWD python benchmarks/cpu_http_decode.py [--passes 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch
from common import git_commit

RESULTS = Path(__file__).parent / "results"
PROMPT = "Count from 1 to 50."
TOKENS = 256


def offline_rate(llm) -> float:
    from moeserve.sampling import SamplingParams

    eng = llm.engine
    ids = llm.tokenizer.encode(
        llm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}]),
        add_special_tokens=False,
    )
    eng.add_request(
        f"o{time.monotonic_ns()}",
        ids,
        SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True),
    )
    first = None
    n = 0
    while eng.has_unfinished():
        for out in eng.step():
            n += len(out.token_ids)
            if first is None and n:
                first, n0 = time.perf_counter(), n
    return (n - n0) / (time.perf_counter() - first)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def http_rate(port: int) -> tuple[float, int]:
    """(steady-state decode tok/s, tokens the server generated: the scenario's requests and its
    warm-up request, the same greedy request each)."""
    out = subprocess.run(
        [sys.executable, "-m", "moeserve.cli", "bench", "--base-url", f"http://127.0.0.1:{port}",
         "--scenario", "count-to-50"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    m = re.search(r"Steady-state decode, median \(tok/s\):\s+([\d.]+)", out.stdout)
    if m is None:
        raise RuntimeError(f"moeserve bench printed no steady-state rate:\n{out.stdout[-2000:]}")
    n = re.search(r"Total generated tokens:\s+(\d+)", out.stdout)
    done = re.search(r"Successful requests:\s+(\d+)", out.stdout)
    warm = re.search(r"Warm-up requests \(excluded\):\s+(\d+)", out.stdout)
    tokens = int(n.group(1)) if n else 0
    if done and warm and int(done.group(1)):
        tokens = tokens * (int(done.group(1)) + int(warm.group(1))) // int(done.group(1))
    return float(m.group(1)), tokens


def llama_cpp_model(path: str, threads: int):
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    return Llama(model_path=path, n_threads=threads, n_ctx=1024, verbose=False)


def llama_cpp_rate(llm) -> float:
    msgs = [{"role": "user", "content": PROMPT}]
    stream = llm.create_chat_completion(
        msgs, max_tokens=TOKENS, temperature=0.0, top_k=1, stream=True
    )
    first = None
    n = 0
    for chunk in stream:
        if chunk["choices"][0]["delta"].get("content"):
            n += 1
            if first is None:
                first, n0 = time.perf_counter(), n
    return (n - n0) / (time.perf_counter() - first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--passes", type=int, default=3)
    args = ap.parse_args()
    from moeserve.engine.offline import LLM
    from moeserve.loader import default_model_path

    threads = torch.get_num_threads()
    gguf = default_model_path()
    llm = LLM(None, max_model_len=1024)
    offline_rate(llm)  # warm-up
    port = _free_port()
    log_path = Path(tempfile.mkdtemp()) / "serve.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "moeserve.cli", "serve", "--port", str(port)],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not _healthy(port):
            time.sleep(0.5)
        http_rate(port)  # warm-up
        lcpp = llama_cpp_model(gguf, threads)
        passes = []
        for _ in range(args.passes):
            c0 = cpu_seconds(os.getpid())
            r = {"offline": offline_rate(llm)}
            r["offline_cpu_ms_per_token"] = 1e3 * (cpu_seconds(os.getpid()) - c0) / TOKENS
            c0 = cpu_seconds(server.pid)
            r["http"], tokens = http_rate(port)
            if tokens:
                r["server_cpu_ms_per_token"] = 1e3 * (cpu_seconds(server.pid) - c0) / tokens
            if lcpp is not None:
                r["llama_cpp"] = llama_cpp_rate(lcpp)
            passes.append(r)
            print(r, flush=True)
    finally:
        server.terminate()
        server.wait(timeout=30)
    med = {k: statistics.median(r[k] for r in passes) for k in passes[0]}
    banner = log_path.read_text()
    threads_line = next((ln for ln in banner.splitlines() if "torch threads" in ln), "")
    env = {
        "commit": git_commit(mark_dirty=True),
        "cpu": next(
            (
                ln.split(":", 1)[1].strip()
                for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")
            ),
            platform.processor(),
        ),
        "cores": os.cpu_count(),
        "offline_threads": threads,
        "server_threads": (re.findall(r"torch threads (\d+)", threads_line) or ["?"])[0],
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    out = {"env": env, "passes": passes, "median": med, "gguf": os.path.basename(gguf)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cpu_http_decode.json").write_text(json.dumps(out, indent=2))
    http_ratio = med["http"] / med["offline"]
    lines = [
        "# CPU count-to-50 at batch 1: HTTP, offline and llama.cpp (SmolLM2-135M Q4_1 GGUF)",
        "",
        f"commit {env['commit']}, {env['cpu']} ({env['cores']} cores), torch {env['torch']}, "
        f"{env['date']}. benchmarks/cpu_http_decode.py (docstring): {TOKENS} greedy tokens, "
        f"decode tok/s after the first token, medians of {args.passes} interleaved passes. "
        f"Offline and the server with their defaults (the native kernels' pool on all "
        f"{env['cores']} cores, torch on {env['server_threads']} in the server); llama.cpp on "
        f"{threads} threads; the bench client in its own process.",
        "",
        "| path | decode tok/s (median) | passes | vs offline |",
        "|---|---|---|---|",
    ]
    for k, label in (
        ("offline", "moeserve offline `LLM`"),
        ("http", "moeserve over HTTP (`moeserve bench --scenario count-to-50`)"),
        ("llama_cpp", "llama.cpp (llama-cpp-python)"),
    ):
        if k in med:
            vals = ", ".join(f"{r[k]:.1f}" for r in passes)
            lines.append(f"| {label} | {med[k]:.1f} | {vals} | {med[k] / med['offline']:.2f} |")
    if "server_cpu_ms_per_token" in med:
        lines += [
            "",
            f"CPU time per generated token: offline process {med['offline_cpu_ms_per_token']:.2f} "
            f"ms, server process {med['server_cpu_ms_per_token']:.2f} ms (engine, event loop and "
            "HTTP; the bench client not counted).",
        ]
    lines += ["", f"HTTP / offline: {http_ratio:.2f} (target >= 0.90)."]
    if "llama_cpp" in med:
        lines.append(
            f"offline / llama.cpp: {med['offline'] / med['llama_cpp']:.2f} (target >= 0.90)."
        )
    else:
        lines.append("llama.cpp: not installed here, skipped (see the docstring to build it).")
    (RESULTS / "cpu_http_decode.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
