"""`moeserve bench`: arguments, validation, and the run (workload -> load -> report).

The lead's moeserve/cli.py wires the subcommand to `add_bench_arguments` and `run_bench`;
`python3 -m moeserve.bench` runs it standalone. Bad input gives one line on stderr and exit
code 2; a server that cannot be reached gives one line and exit code 1.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn

from moeserve.bench import datasets, metrics, report, serving
from moeserve.bench.datasets import DatasetError, Sample
from moeserve.bench.metrics import RequestRecord
from moeserve.bench.serving import BenchError, ClientConfig, LoadConfig

DEFAULT_NUM_PROMPTS = 100
DEFAULT_INPUT_LEN = 1024
DEFAULT_OUTPUT_LEN = 128
DEFAULT_TIMEOUT_S = 1800.0
DEFAULT_PERCENTILES = "90,99"
# The count-to-50 scenario measures one user's steady decode speed: a few sequential
# requests after one warm-up request (the first request pays compilation/allocation).
SCENARIO_NUM_PROMPTS = 3
SCENARIO_WARMUP = 1
SCENARIO_CONCURRENCY = 1
SWEEP_PARAMS = ("concurrency", "rate")
EXIT_USAGE = 2
EXIT_RUN_FAILED = 1
EXIT_INTERRUPTED = 130  # the shell's code for SIGINT


class UsageError(ValueError):
    """Bad command-line input (one line, exit code 2)."""


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line (no usage dump), exit code 2."""

    def error(self, message: str) -> NoReturn:
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """The `moeserve bench` options (defaults None where the workload decides)."""
    g = parser.add_argument_group("server")
    g.add_argument(
        "--base-url",
        required=True,
        help="server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted)",
    )
    g.add_argument(
        "--model", help="model name sent in requests (default: the first of GET /v1/models)"
    )
    g.add_argument(
        "--endpoint",
        choices=sorted(serving.ENDPOINT_PATHS),
        default="chat",
        help="chat: /v1/chat/completions (default); completions: /v1/completions",
    )
    g.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="bearer token (default: $OPENAI_API_KEY)",
    )
    g.add_argument(
        "--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="per-request timeout, seconds"
    )
    g.add_argument(
        "--metrics-url",
        default=None,
        help="Prometheus endpoint scraped before/after the measured phase for "
        f"{serving.GENERATION_TOKENS_COUNTER} (default: BASE/metrics; 'off' disables)",
    )

    g = parser.add_argument_group("workload")
    g.add_argument(
        "--dataset",
        default="random",
        help="random (default) | sharegpt | PATH.jsonl (one prompt or message list per line)",
    )
    g.add_argument(
        "--scenario",
        choices=["count-to-50"],
        help="count-to-50: the reference request ('Count from 1 to 50.', max_tokens 512, "
        "temperature 0), 1 warm-up + 3 sequential requests unless set otherwise",
    )
    g.add_argument(
        "--input-len",
        type=int,
        default=None,
        help=f"random: prompt tokens (default {DEFAULT_INPUT_LEN})",
    )
    g.add_argument(
        "--output-len",
        type=int,
        default=None,
        help=f"max_tokens per request (random default {DEFAULT_OUTPUT_LEN}; sharegpt: the "
        "recorded reply's length; jsonl: per line)",
    )
    g.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="random: lengths uniform in [N*(1-r), N*(1+r)], 0 <= r < 1",
    )
    g.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer.json: exact prompt token counts (default: ~1 token per random word)",
    )
    g.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help=f"measured requests (default {DEFAULT_NUM_PROMPTS}; jsonl: every line)",
    )
    g.add_argument(
        "--ignore-eos", action="store_true", help="ask the server to ignore EOS (vLLM extension)"
    )
    g.add_argument(
        "--temperature", type=float, default=0.0, help="sampling temperature (default 0, greedy)"
    )
    g.add_argument("--seed", type=int, default=0, help="seeds prompts, lengths and arrivals")

    g = parser.add_argument_group("load")
    g.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second (default inf: all at once)",
    )
    g.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the gaps: 1 Poisson (default), <1 burstier, inf constant spacing",
    )
    g.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    g.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="requests sent first (before every sweep point) and excluded from the figures",
    )
    g.add_argument(
        "--sweep",
        default=None,
        help="concurrency=1,2,4,8 or rate=1,2,inf: one measured run per value",
    )

    g = parser.add_argument_group("results")
    g.add_argument("--slo", default=None, help="goodput SLOs in ms, e.g. ttft=500,tpot=50,e2e=5000")
    g.add_argument(
        "--percentiles", default=DEFAULT_PERCENTILES, help="percentiles to report (default 90,99)"
    )
    g.add_argument(
        "--save-result",
        metavar="FILE.json",
        default=None,
        help="write results with vLLM `bench serve` field names plus per-request arrays",
    )
    g.add_argument(
        "--plot",
        metavar="FILE.png",
        default=None,
        help="latency vs throughput over the sweep, TTFT and ITL distributions",
    )
    g.add_argument("--label", default=None, help="free-form label stored in the result")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


@dataclass(frozen=True)
class Plan:
    """Validated settings of one invocation."""

    client: ClientConfig  # model may still be "" (discovered from /v1/models)
    loads: list[LoadConfig]  # one per sweep point
    sweep_param: str | None
    sweep_values: list[float]
    samples: list[Sample]
    warmup_samples: list[Sample]
    dataset_name: str
    scenario: str | None
    percentiles: list[float]
    slo: dict[str, float] | None
    metrics_url: str | None
    save_result: str | None
    plot: str | None
    label: str | None
    tokenizer: str | None
    show_progress: bool


def _positive_int(name: str, v: int | None) -> None:
    if v is not None and v < 1:
        raise UsageError(f"{name} must be at least 1")


def parse_sweep(spec: str) -> tuple[str, list[float]]:
    """'concurrency=1,2,4' -> ('concurrency', [1, 2, 4]); 'rate=1,inf' -> ('rate', [1, inf])."""
    param, sep, values = spec.partition("=")
    param = param.strip().lower()
    if not sep or param not in SWEEP_PARAMS:
        raise UsageError(f"--sweep {spec!r}: expected concurrency=V1,V2,... or rate=V1,V2,...")
    out: list[float] = []
    for v in values.split(","):
        try:
            x = float(v)
        except ValueError:
            raise UsageError(f"--sweep value {v!r} is not a number") from None
        if not x > 0 or math.isnan(x):
            raise UsageError(f"--sweep value {v!r} must be positive")
        if param == "concurrency" and (math.isinf(x) or not x.is_integer()):
            raise UsageError(f"--sweep concurrency value {v!r} must be a whole number")
        out.append(x)
    return param, out


def _parse_percentiles(spec: str) -> list[float]:
    try:
        ps = [float(p) for p in spec.split(",") if p.strip()]
    except ValueError:
        raise UsageError(f"--percentiles {spec!r}: expected numbers such as 90,99") from None
    if not ps or any(not 0 < p < 100 for p in ps):
        raise UsageError("--percentiles must lie strictly between 0 and 100")
    return ps


def make_plan(args: argparse.Namespace, log: Callable[[str], None] = print) -> Plan:
    """Validate the arguments and build the workload (no network yet)."""
    try:
        base_url = serving.normalize_base_url(args.base_url)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    for name in ("num_prompts", "max_concurrency", "input_len", "output_len"):
        _positive_int("--" + name.replace("_", "-"), getattr(args, name))
    if args.warmup is not None and args.warmup < 0:
        raise UsageError("--warmup must be 0 or more")
    if not args.request_rate > 0:
        raise UsageError("--request-rate must be positive (inf for all at once)")
    if not args.burstiness > 0:
        raise UsageError("--burstiness must be positive (inf for constant spacing)")
    if not args.timeout > 0:
        raise UsageError("--timeout must be positive")
    if args.temperature < 0:
        raise UsageError("--temperature must be 0 or more")
    if args.tokenizer is not None and not Path(args.tokenizer).is_file():
        raise UsageError(f"--tokenizer {args.tokenizer}: no such file")
    for opt, out in (("--save-result", args.save_result), ("--plot", args.plot)):
        if out is not None and not Path(out).resolve().parent.is_dir():
            raise UsageError(f"{opt} {out}: the folder does not exist")
    percentiles = _parse_percentiles(args.percentiles)
    try:
        slo = metrics.parse_slo(args.slo) if args.slo else None
    except ValueError as exc:
        raise UsageError(str(exc)) from None

    scenario = args.scenario
    num = args.num_prompts
    warmup = args.warmup if args.warmup is not None else 0
    max_conc = args.max_concurrency
    if scenario == "count-to-50":
        if args.endpoint != "chat":
            raise UsageError(
                "--scenario count-to-50 sends the reference chat request: use --endpoint chat"
            )
        if args.dataset != "random":
            raise UsageError("--scenario and --dataset exclude each other")
        num = num or SCENARIO_NUM_PROMPTS
        warmup = args.warmup if args.warmup is not None else SCENARIO_WARMUP
        if max_conc is None and not args.sweep:
            max_conc = SCENARIO_CONCURRENCY

    sweep_param, sweep_values = (None, [])
    if args.sweep:
        sweep_param, sweep_values = parse_sweep(args.sweep)
        if sweep_param == "concurrency" and args.max_concurrency is not None:
            raise UsageError("--sweep concurrency=... replaces --max-concurrency: give one of them")
        if sweep_param == "rate" and args.request_rate != math.inf:
            raise UsageError("--sweep rate=... replaces --request-rate: give one of them")
    base_load = LoadConfig(args.request_rate, args.burstiness, max_conc, args.seed)
    if sweep_param == "concurrency":
        loads = [replace(base_load, max_concurrency=int(v)) for v in sweep_values]
    elif sweep_param == "rate":
        loads = [replace(base_load, request_rate=v) for v in sweep_values]
    else:
        loads = [base_load]

    samples, warm, dataset_name = _build_workload(args, scenario, num, warmup, log)
    if args.endpoint == "completions" and any(
        not isinstance(s.prompt, str) for s in samples + warm
    ):
        raise UsageError(
            "--endpoint completions needs plain-text prompts; the dataset holds chat messages"
        )

    metrics_url = args.metrics_url
    if metrics_url is None:
        metrics_url = base_url + "/metrics"
    elif metrics_url.lower() in ("off", "none", ""):
        metrics_url = None
    client = ClientConfig(
        base_url,
        args.endpoint,
        args.model or "",
        args.api_key,
        args.temperature,
        args.ignore_eos,
        args.timeout,
    )
    return Plan(
        client,
        loads,
        sweep_param,
        sweep_values,
        samples,
        warm,
        dataset_name,
        scenario,
        percentiles,
        slo,
        metrics_url,
        args.save_result,
        args.plot,
        args.label,
        args.tokenizer,
        not args.no_progress,
    )


def _build_workload(
    args: argparse.Namespace,
    scenario: str | None,
    num: int | None,
    warmup: int,
    log: Callable[[str], None],
) -> tuple[list[Sample], list[Sample], str]:
    """(measured samples, warm-up samples, dataset name). Warm-up prompts are drawn apart
    from the measured ones where the dataset allows, so prefix caching cannot flatter the run."""
    try:
        if scenario == "count-to-50":
            return (
                datasets.count_to_50_samples(num or 0),
                datasets.count_to_50_samples(warmup),
                scenario,
            )
        n = num or DEFAULT_NUM_PROMPTS
        if args.dataset == "random":
            drawn = datasets.random_samples(
                n + warmup,
                args.input_len or DEFAULT_INPUT_LEN,
                args.output_len or DEFAULT_OUTPUT_LEN,
                args.range_ratio,
                args.seed,
                args.tokenizer,
            )
            return drawn[warmup:], drawn[:warmup], "random"
        if args.dataset == "sharegpt":
            drawn = datasets.sharegpt_samples(
                n + warmup, args.seed, args.output_len, args.tokenizer, log=log
            )
            return drawn[warmup:], drawn[:warmup], "sharegpt"
        if args.dataset.endswith(".jsonl") or Path(args.dataset).is_file():
            measured = datasets.jsonl_samples(args.dataset, num, args.output_len, args.tokenizer)
            return measured, [measured[i % len(measured)] for i in range(warmup)], "jsonl"
    except DatasetError as exc:
        raise UsageError(str(exc)) from None
    raise UsageError(f"--dataset {args.dataset!r}: expected random, sharegpt or a .jsonl file")


def _progress_factory(
    enabled: bool,
) -> Callable[[int, str], Callable[[RequestRecord], None]] | None:
    """A live bar per phase (stderr); None when disabled."""
    if not enabled:
        return None
    from tqdm import tqdm

    def make(total: int, label: str) -> Callable[[RequestRecord], None]:
        bar = tqdm(total=total, desc=label, file=sys.stderr, leave=True, dynamic_ncols=True)
        state = {"done": 0, "failed": 0}

        def update(rec: RequestRecord) -> None:
            state["done"] += 1
            if metrics.failure_reason(rec) is not None:
                state["failed"] += 1
                bar.set_postfix(failed=state["failed"])
            bar.update(1)
            if state["done"] == total:
                bar.close()

        return update

    return make


async def execute(plan: Plan) -> tuple[ClientConfig, list[serving.PointResult]]:
    """Run every sweep point against the server (model discovered first if not given)."""
    async with serving.new_session() as session:
        client = plan.client
        if not client.model:
            client = replace(
                client, model=await serving.discover_model(session, client.base_url, client.headers)
            )
        progress = _progress_factory(plan.show_progress)
        points = []
        for load in plan.loads:
            points.append(
                await serving.run_point(
                    session,
                    client,
                    load,
                    plan.samples,
                    plan.warmup_samples,
                    plan.metrics_url,
                    progress,
                )
            )
        return client, points


def _sweep_value(param: str | None, v: float) -> Any:
    if param == "concurrency":
        return int(v)
    return "inf" if math.isinf(v) else v


def build_result(
    plan: Plan,
    client: ClientConfig,
    load: LoadConfig,
    point: serving.PointResult,
    sweep_value: float | None,
) -> dict[str, Any]:
    """The result object of one run: run settings, then metrics.summarize's fields."""
    backend = "openai-chat" if client.endpoint == "chat" else "openai"
    res: dict[str, Any] = {
        "date": datetime.now(UTC).strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": backend,
        "backend": backend,
        "label": plan.label,
        "model_id": client.model,
        "tokenizer_id": plan.tokenizer,
        "base_url": client.base_url,
        "endpoint": serving.ENDPOINT_PATHS[client.endpoint],
        "dataset_name": plan.dataset_name,
        "scenario": plan.scenario,
        "num_prompts": len(plan.samples),
        "num_warmups": len(plan.warmup_samples),
        "request_rate": "inf" if math.isinf(load.request_rate) else load.request_rate,
        "burstiness": load.burstiness,
        "max_concurrency": load.max_concurrency,
        "seed": load.seed,
        "temperature": client.temperature,
        "ignore_eos": client.ignore_eos,
        "slo": plan.slo,
        "percentiles": plan.percentiles,
    }
    if plan.sweep_param is not None and sweep_value is not None:
        res["sweep_point"] = f"{plan.sweep_param}={_sweep_value(plan.sweep_param, sweep_value)}"
        res["sweep_value"] = _sweep_value(plan.sweep_param, sweep_value)
    res.update(
        metrics.summarize(
            point.measured.records, point.measured.duration_s, plan.percentiles, plan.slo
        )
    )
    res["server_generation_tokens_before"] = point.server_tokens_before
    res["server_generation_tokens_after"] = point.server_tokens_after
    res["server_generation_tokens_delta"] = point.server_tokens_delta
    res["server_prefix_cache_hits_before"] = point.prefix_cache_hits_before
    res["server_prefix_cache_hits_after"] = point.prefix_cache_hits_after
    res["server_prefix_cache_hits_delta"] = point.prefix_cache_hits_delta
    res.update(serving.spec_summary(point.spec_delta))
    return res


def run_bench(args: argparse.Namespace) -> int:
    """Run `moeserve bench`; returns the exit code (0 ok, 1 run failed, 2 bad input)."""

    def err(msg: str) -> None:
        print(f"moeserve bench: error: {msg}", file=sys.stderr)

    try:
        plan = make_plan(args)
    except UsageError as exc:
        err(str(exc))
        return EXIT_USAGE
    try:
        client, points = asyncio.run(execute(plan))
    except BenchError as exc:
        err(str(exc))
        return EXIT_RUN_FAILED
    except KeyboardInterrupt:
        err("interrupted; no results written")
        return EXIT_INTERRUPTED
    values: list[float | None] = list(plan.sweep_values) or [None]
    runs = zip(plan.loads, points, values, strict=True)
    results = [build_result(plan, client, load, pt, v) for load, pt, v in runs]
    for r in results:
        print(report.format_table(r))
    if plan.sweep_param:
        print(report.format_sweep_table(plan.sweep_param, results))
    if plan.metrics_url and all(r["server_generation_tokens_delta"] is None for r in results):
        counter = serving.GENERATION_TOKENS_COUNTER
        print(f"note: {plan.metrics_url} has no {counter}; server-side token count skipped")
    try:
        if plan.save_result:
            sweep = (
                {
                    "parameter": plan.sweep_param,
                    "values": [_sweep_value(plan.sweep_param, v) for v in plan.sweep_values],
                }
                if plan.sweep_param
                else None
            )
            report.save_json(plan.save_result, results, sweep)
            print(f"results written to {plan.save_result}")
        if plan.plot:
            report.plot(plan.plot, results)
            print(f"plot written to {plan.plot}")
    except OSError as exc:
        err(f"cannot write results: {exc}")
        return EXIT_RUN_FAILED
    return 0 if all(r["completed"] > 0 for r in results) else EXIT_RUN_FAILED
