"""CPU benchmark of speculative decoding (ngram, suffix) against plain decoding, batch 1.

Default model (SmolLM2-135M-Instruct GGUF) on the CPU, greedy, chat template applied, one
request at a time. Workloads (benchmarks/spec_tasks.py): input-grounded edits of a given text
or code (the answer copies the prompt), ShareGPT first turns, and count-to-50. Per task the
methods run interleaved (plain, ngram, suffix, plain, ...) after a warm-up of every engine,
because this machine's speed drifts by tens of percent over minutes.

Figures, per workload and method:
- tok/s: output tokens after the first one / time from the end of the step that emitted the
  first token to the end of the last step (end-to-end generation time minus the time to the
  first token, so prefill is excluded), summed over the workload's tasks and the repeats.
- speedup: that rate over plain decoding's on the same tasks.
- acceptance length: 1 + accepted / drafts from the engine's speculative counters
  (`engine.metrics.spec`, deltas per request), vLLM's definition; null where the engine has
  no such counters.
- same text: whether every speculative run produced exactly the plain run's token ids (greedy
  decoding must not change with speculation); each mismatch is listed.

The suffix method also drafts from recently finished requests; a fresh suffix engine per
repeat keeps a task's own earlier answer out of its cache.

    PYTHONPATH=$PWD python benchmarks/spec_decode_cpu.py [--tokens 256]
        [--num-speculative-tokens 4] [--tasks 12] [--repeats 2] [--methods ngram,suffix]
        [--threads 2] [--quick] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from common import git_commit
from spec_tasks import (
    COUNT_TO_50,
    INPUT_GROUNDED,
    SHAREGPT,
    SHAREGPT_MAX_PROMPT_TOKENS,
    WORKLOADS,
    Task,
    build_tasks,
    task_set_hash,
)

from moeserve.engine.offline import LLM
from moeserve.sampling import SamplingParams

RESULTS = Path(__file__).parent / "results"
PLAIN = "plain"
SPEC_METHODS = ("ngram", "suffix")
# Speedup targets over plain decoding (None: no target, the figure is reported only).
TARGETS: dict[str, float | None] = {INPUT_GROUNDED: 1.6, SHAREGPT: 0.97, COUNT_TO_50: None}
QUICK_TASKS = 2
WARMUP_PROMPT = "Write one sentence about the sea."
WARMUP_TOKENS = 16
# Room for the chat template around the longest prompt the task sets admit.
TEMPLATE_MARGIN_TOKENS = 64
SNIPPET_TOKENS = 24
SPEC_COUNTERS = ("drafts", "draft_tokens", "accepted_tokens")


@dataclass
class Run:
    """One task under one method."""

    token_ids: list[int]
    decode_tokens: int  # output tokens after the first one
    decode_s: float  # end of the first token's step to the end of the last step
    ttft_s: float
    spec: dict[str, Any] | None  # speculative counter deltas; None without counters


@dataclass
class Mismatch:
    workload: str
    task: str
    method: str
    repeat: int
    first_diff: int  # index of the first differing output token
    plain_len: int
    spec_len: int
    plain_text: str  # decoded tokens from the first difference on
    spec_text: str


@dataclass
class Totals:
    decode_tokens: int = 0
    decode_s: float = 0.0
    runs_tok_s: list[float] = field(default_factory=list)  # per repeat, all tasks together
    # per task and repeat: this method's rate over plain's run right beside it (a
    # burst of load from other processes skews one task's ratio, not the workload's median)
    task_speedups: list[float] = field(default_factory=list)
    spec: dict[str, Any] | None = None
    same: int = 0
    compared: int = 0


def chat_ids(llm: LLM, text: str) -> list[int]:
    """Prompt ids as LLM.chat builds them (one user message, generation prompt added)."""
    tok = llm.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": text}])
    return tok.encode(prompt, add_special_tokens=False)


def spec_counters(llm: LLM) -> dict[str, Any] | None:
    """The engine's cumulative speculative counters, or None where it keeps none."""
    spec = getattr(getattr(llm.engine, "metrics", None), "spec", None)
    if spec is None or not all(hasattr(spec, k) for k in SPEC_COUNTERS):
        return None
    out: dict[str, Any] = {k: int(getattr(spec, k)) for k in SPEC_COUNTERS}
    out["accepted_per_position"] = [int(x) for x in getattr(spec, "accepted_per_position", [])]
    return out


def counter_delta(before: dict[str, Any] | None, after: dict[str, Any] | None) -> dict | None:
    if before is None or after is None:
        return None
    out: dict[str, Any] = {k: after[k] - before[k] for k in SPEC_COUNTERS}
    a, b = after["accepted_per_position"], before["accepted_per_position"]
    out["accepted_per_position"] = [x - (b[i] if i < len(b) else 0) for i, x in enumerate(a)]
    return out


def add_counters(total: dict[str, Any] | None, d: dict[str, Any] | None) -> dict | None:
    if d is None:
        return total
    if total is None:
        return {**d, "accepted_per_position": list(d["accepted_per_position"])}
    for k in SPEC_COUNTERS:
        total[k] += d[k]
    pos = total["accepted_per_position"]
    pos.extend([0] * (len(d["accepted_per_position"]) - len(pos)))
    for i, x in enumerate(d["accepted_per_position"]):
        pos[i] += x
    return total


def acceptance_length(c: dict[str, Any] | None) -> float | None:
    """1 + accepted tokens per drafting sequence-step (vLLM's mean acceptance length)."""
    if c is None or c["drafts"] == 0:
        return None
    return 1 + c["accepted_tokens"] / c["drafts"]


def run_task(llm: LLM, ids: list[int], max_tokens: int) -> Run:
    """Generate one request alone, timing the steps after its first token (decode only)."""
    eng = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    before = spec_counters(llm)
    eng.add_request(f"spec-bench-{time.monotonic_ns()}", ids, params)
    tokens: list[int] = []
    start = time.perf_counter()
    t_first: float | None = None
    decode_tokens = 0
    while eng.has_unfinished():
        outs = eng.step()
        for rid, e in eng.take_failures():
            raise RuntimeError(f"request {rid} failed: {e}")
        new = [t for o in outs for t in o.token_ids]
        tokens += new
        if t_first is None:
            if new:
                t_first = time.perf_counter()
        else:
            decode_tokens += len(new)
    end = time.perf_counter()
    t_first = end if t_first is None else t_first
    return Run(
        tokens,
        decode_tokens,
        end - t_first,
        t_first - start,
        counter_delta(before, spec_counters(llm)),
    )


def build_engine(method: str, k: int, threads: int, max_model_len: int) -> LLM:
    """One engine per method, same settings but for speculative_config; warmed up."""
    kw: dict[str, Any] = dict(max_model_len=max_model_len, threads=threads, prefill_threads=threads)
    if method != PLAIN:
        kw["speculative_config"] = {"method": method, "num_speculative_tokens": k}
    llm = LLM(None, **kw)
    run_task(llm, chat_ids(llm, WARMUP_PROMPT), WARMUP_TOKENS)
    return llm


def first_diff(a: list[int], b: list[int]) -> int:
    """Index of the first differing token (the shorter length where one is a prefix)."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256, help="max_tokens of every request")
    ap.add_argument("--num-speculative-tokens", type=int, default=4, help="K, draft length")
    ap.add_argument("--tasks", type=int, default=12, help="input-grounded and ShareGPT tasks")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--methods", default=",".join(SPEC_METHODS), help="speculative methods")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_TASKS} tasks, 1 repeat")
    ap.add_argument("--out", type=Path, default=RESULTS, help="folder for the .json and .md")
    args = ap.parse_args()
    if args.quick:
        args.tasks, args.repeats = min(args.tasks, QUICK_TASKS), 1
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(SPEC_METHODS))
    if unknown:
        ap.error(f"--methods: unknown {', '.join(unknown)}; known: {', '.join(SPEC_METHODS)}")
    all_methods = [PLAIN, *methods]
    max_model_len = SHAREGPT_MAX_PROMPT_TOKENS + TEMPLATE_MARGIN_TOKENS + args.tokens
    k = args.num_speculative_tokens

    def fresh(method: str) -> LLM:
        return build_engine(method, k, args.threads, max_model_len)

    engines = {m: fresh(m) for m in all_methods}
    ref = engines[PLAIN]
    sets = build_tasks(args.tasks, args.tokens, lambda t: len(chat_ids(ref, t)))
    prompt_ids = {(t.workload, t.name): chat_ids(ref, t.prompt) for ts in sets.values() for t in ts}
    for ts in sets.values():
        for t in ts:
            n = len(prompt_ids[(t.workload, t.name)])
            print(f"{t.workload:15s} {t.name:45s} {n} prompt tokens")

    totals = {(w, m): Totals() for w in WORKLOADS for m in all_methods}
    records: list[dict[str, Any]] = []
    mismatches: list[Mismatch] = []
    for r in range(args.repeats):
        if r > 0 and "suffix" in engines:
            engines["suffix"] = fresh("suffix")  # keep this task's earlier answers out
        for workload, tasks in sets.items():
            per_pass = {m: [0, 0.0] for m in all_methods}
            for task in tasks:
                runs = {
                    m: run_task(engines[m], prompt_ids[(workload, task.name)], task.max_tokens)
                    for m in all_methods
                }
                plain = runs[PLAIN]
                for m, run in runs.items():
                    tot = totals[(workload, m)]
                    tot.decode_tokens += run.decode_tokens
                    tot.decode_s += run.decode_s
                    tot.spec = add_counters(tot.spec, run.spec)
                    per_pass[m][0] += run.decode_tokens
                    per_pass[m][1] += run.decode_s
                    same = run.token_ids == plain.token_ids
                    if m != PLAIN:
                        tot.compared += 1
                        tot.same += same
                        if run.decode_s and plain.decode_s and plain.decode_tokens:
                            tot.task_speedups.append(
                                (run.decode_tokens / run.decode_s)
                                / (plain.decode_tokens / plain.decode_s)
                            )
                        if not same:
                            mismatches.append(_mismatch(ref, task, m, r, plain, run))
                    records.append(_record(task, m, r, run, same))
                print(_progress(task, r, runs), flush=True)
            for m, (n, s) in per_pass.items():
                totals[(workload, m)].runs_tok_s.append(n / s if s else 0.0)
    rows = _rows(sets, all_methods, totals)
    _write(args, methods, sets, rows, records, mismatches)


def _mismatch(llm: LLM, task: Task, method: str, repeat: int, plain: Run, spec: Run) -> Mismatch:
    i = first_diff(plain.token_ids, spec.token_ids)
    tail = slice(i, i + SNIPPET_TOKENS)
    return Mismatch(
        task.workload,
        task.name,
        method,
        repeat,
        i,
        len(plain.token_ids),
        len(spec.token_ids),
        llm.tokenizer.decode(plain.token_ids[tail]),
        llm.tokenizer.decode(spec.token_ids[tail]),
    )


def _record(task: Task, method: str, repeat: int, run: Run, same: bool) -> dict[str, Any]:
    return {
        "workload": task.workload,
        "task": task.name,
        "method": method,
        "repeat": repeat,
        "output_tokens": len(run.token_ids),
        "decode_tokens": run.decode_tokens,
        "decode_s": run.decode_s,
        "decode_tok_s": run.decode_tokens / run.decode_s if run.decode_s else None,
        "ttft_s": run.ttft_s,
        "spec": run.spec,
        "acceptance_length": acceptance_length(run.spec),
        "same_as_plain": same,
    }


def _progress(task: Task, repeat: int, runs: dict[str, Run]) -> str:
    parts = []
    for m, run in runs.items():
        rate = run.decode_tokens / run.decode_s if run.decode_s else 0.0
        al = acceptance_length(run.spec)
        same = (
            "" if m == PLAIN else (" same" if run.token_ids == runs[PLAIN].token_ids else " DIFF")
        )
        parts.append(f"{m} {rate:.1f} tok/s" + (f" al {al:.2f}" if al is not None else "") + same)
    n = len(runs[PLAIN].token_ids)
    return f"[{repeat}] {task.name} ({n} tokens): " + ", ".join(parts)


def _rows(
    sets: dict[str, list[Task]], methods: list[str], totals: dict[tuple[str, str], Totals]
) -> list[dict[str, Any]]:
    rows = []
    for workload in sets:
        base = totals[(workload, PLAIN)]
        base_rate = base.decode_tokens / base.decode_s if base.decode_s else None
        for m in methods:
            tot = totals[(workload, m)]
            rate = tot.decode_tokens / tot.decode_s if tot.decode_s else None
            speedup = rate / base_rate if rate and base_rate else None
            target = TARGETS[workload] if m != PLAIN else None
            spec = tot.spec
            per_pos = (
                [x / spec["drafts"] for x in spec["accepted_per_position"]]
                if spec and spec["drafts"]
                else None
            )
            rows.append(
                {
                    "workload": workload,
                    "method": m,
                    "tasks": len(sets[workload]),
                    "decode_tokens": tot.decode_tokens,
                    "decode_s": tot.decode_s,
                    "tok_s": rate,
                    "tok_s_per_pass": tot.runs_tok_s,
                    "tok_s_median_of_passes": statistics.median(tot.runs_tok_s)
                    if tot.runs_tok_s
                    else None,
                    "speedup": speedup,
                    "speedup_median_of_tasks": statistics.median(tot.task_speedups)
                    if tot.task_speedups
                    else None,
                    "speedups_per_task": tot.task_speedups,
                    "target_speedup": target,
                    "target_met": None if target is None or speedup is None else speedup >= target,
                    "spec_counters": spec,
                    "acceptance_length": acceptance_length(spec),
                    "draft_acceptance_rate": spec["accepted_tokens"] / spec["draft_tokens"]
                    if spec and spec["draft_tokens"]
                    else None,
                    "acceptance_per_position": per_pos,
                    "same_text": None if m == PLAIN else tot.same == tot.compared,
                    "same_text_runs": None if m == PLAIN else f"{tot.same}/{tot.compared}",
                }
            )
    return rows


def _env(threads: int) -> dict[str, Any]:
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in open("/proc/cpuinfo")
            if ln.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "commit": git_commit(mark_dirty=True),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "threads": threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _cell(text: str) -> str:
    """Text as a markdown table cell: JSON-quoted (newlines visible), pipes escaped."""
    return json.dumps(text).replace("|", "\\|")


def _write(
    args: argparse.Namespace,
    methods: list[str],
    sets: dict[str, list[Task]],
    rows: list[dict[str, Any]],
    records: list[dict[str, Any]],
    mismatches: list[Mismatch],
) -> None:
    env = _env(args.threads)
    all_tasks = [t for ts in sets.values() for t in ts]
    has_counters = any(r["spec_counters"] is not None for r in rows if r["method"] != PLAIN)
    flags = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    out = {
        "benchmark": "spec_decode_cpu",
        "model": "SmolLM2-135M-Instruct GGUF (moeserve default)",
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "flags": flags,
        "env": env,
        "speculative_configs": {
            m: {"method": m, "num_speculative_tokens": args.num_speculative_tokens} for m in methods
        },
        "task_set_sha256": task_set_hash(all_tasks),
        "task_sets": {
            w: {"tasks": [t.name for t in ts], "sha256": task_set_hash(ts)}
            for w, ts in sets.items()
        },
        "measurement": "batch 1, greedy, chat template, EOS honoured; tok/s = output tokens "
        "after the first / (end-to-end generation time - time to first token), summed over "
        "tasks and repeats; methods interleaved per task; acceptance length = 1 + accepted / "
        "drafts from engine.metrics.spec deltas",
        "spec_counters_available": has_counters,
        "rows": rows,
        "mismatches": [asdict(m) for m in mismatches],
        "runs": records,
        "targets": {w: t for w, t in TARGETS.items() if t is not None},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "spec_decode_cpu.json").write_text(json.dumps(out, indent=2))
    lines = [
        "# CPU speculative decoding: SmolLM2-135M-Instruct (GGUF), batch 1",
        "",
        f"commit {env['commit']}, {env['cpu']} ({env['cores']} cores), {env['threads']} "
        f"threads, torch {env['torch']}, python {env['python']}, {env['date']}. "
        f"`{out['command']}`: K = {args.num_speculative_tokens}, max_tokens {args.tokens}, "
        f"{args.repeats} repeat(s), greedy, chat template, EOS honoured. tok/s = output tokens "
        "after the first / (generation time - time to first token), all tasks and repeats "
        "together; methods interleaved per task. Acceptance length = 1 + accepted / drafts. "
        f"Task set sha256 {out['task_set_sha256'][:16]}.",
        "",
        "| workload | tasks | method | tok/s | speedup vs plain | median task speedup | target "
        "| acceptance length | same text |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        target = (
            "-"
            if r["target_speedup"] is None
            else f">= {r['target_speedup']}x: {'met' if r['target_met'] else 'not met'}"
        )
        same = "-" if r["same_text"] is None else ("yes" if r["same_text"] else "no")
        if r["same_text"] is False:
            same += f" ({r['same_text_runs']})"
        lines.append(
            f"| {r['workload']} | {r['tasks']} | {r['method']} | {_fmt(r['tok_s'], '.1f')} | "
            f"{_fmt(r['speedup'], '.2f')} | {_fmt(r['speedup_median_of_tasks'], '.2f')} | "
            f"{target} | {_fmt(r['acceptance_length'], '.2f')} | "
            f"{same} |"
        )
    per_pos = [r for r in rows if r["acceptance_per_position"]]
    if per_pos:
        lines += ["", "Acceptance rate by draft position (accepted / drafts):", ""]
        for r in per_pos:
            rates = ", ".join(f"{x:.2f}" for x in r["acceptance_per_position"])
            lines.append(f"- {r['workload']}, {r['method']}: {rates}")
    if not has_counters:
        lines += [
            "",
            "The engine exposes no speculative counters (engine.metrics.spec): "
            "acceptance lengths are not available.",
        ]
    if mismatches:
        lines += [
            "",
            "## Speculative output differs from plain",
            "",
            "| workload | task | method | repeat | first differing token | plain | speculative |",
            "|---|---|---|---|---|---|---|",
        ]
        for m in mismatches:
            lines.append(
                f"| {m.workload} | {m.task} | {m.method} | {m.repeat} | {m.first_diff} | "
                f"{_cell(m.plain_text)} | {_cell(m.spec_text)} |"
            )
    (args.out / "spec_decode_cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
