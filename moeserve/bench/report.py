"""Benchmark output: the terminal table, the result JSON and the PNG plots.

The JSON of one run is a flat object with the field names of `vllm bench serve` results
(so tools that read those read these), plus moeserve's extras and the per-request arrays.
A sweep writes {"sweep": {...}, "runs": [one such object per point]}.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

WIDTH = 50  # the table's width, as vLLM prints it
LABEL_WIDTH = 40
HIST_BINS = 40
PLOT_SIZE_IN = (12.0, 9.0)
PLOT_DPI = 100

LATENCY_SECTIONS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


def _fmt(v: Any) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return "inf" if math.isinf(v) else f"{v:.2f}"
    return str(v)


def _line(label: str, value: Any) -> str:
    return f"{label:<{LABEL_WIDTH}} {_fmt(value):<10}"


def _stat_keys(result: dict[str, Any], name: str) -> list[str]:
    """mean, median, then the pXX keys present for this metric, in order."""
    ps = sorted(
        (k for k in result if k.startswith("p") and k.endswith(f"_{name}_ms")),
        key=lambda k: float(k[1:].split("_")[0]),
    )
    return [f"mean_{name}_ms", f"median_{name}_ms", *ps]


def format_table(result: dict[str, Any]) -> str:
    """One run as the block `vllm bench serve` prints, plus moeserve's extra lines."""
    out = ["{:=^{w}}".format(" Serving Benchmark Result ", w=WIDTH)]
    if result.get("scenario"):
        out.append(_line("Scenario:", result["scenario"]))
    if result.get("sweep_point"):
        out.append(_line("Sweep point:", result["sweep_point"]))
    out.append(_line("Successful requests:", result["completed"]))
    out.append(_line("Failed requests:", result["failed"]))
    if result.get("num_warmups"):
        out.append(_line("Warm-up requests (excluded):", result["num_warmups"]))
    if result.get("max_concurrency") is not None:
        out.append(_line("Maximum request concurrency:", result["max_concurrency"]))
    if result.get("request_rate") not in (None, "inf"):
        out.append(_line("Request rate configured (RPS):", float(result["request_rate"])))
    out.append(_line("Benchmark duration (s):", result["duration"]))
    out.append(_line("Total input tokens:", result["total_input_tokens"]))
    out.append(_line("Total generated tokens:", result["total_output_tokens"]))
    out.append(_line("Request throughput (req/s):", result["request_throughput"]))
    if result.get("request_goodput") is not None:
        out.append(_line("Request goodput (req/s):", result["request_goodput"]))
    out.append(_line("Output token throughput (tok/s):", result["output_throughput"]))
    out.append(_line("Peak output token throughput (tok/s):", result["max_output_tokens_per_s"]))
    out.append(_line("Peak concurrent requests:", result["max_concurrent_requests"]))
    out.append(_line("Total Token throughput (tok/s):", result["total_token_throughput"]))
    out.append(
        _line("Per-user decode rate, mean (tok/s):", result.get("mean_output_throughput_per_user"))
    )
    if result.get("scenario"):
        out.append(
            _line(
                "Steady-state decode, median (tok/s):",
                result.get("median_output_throughput_per_user"),
            )
        )
        out.append(
            _line(
                "Per-request rate incl. TTFT (tok/s):",
                result.get("mean_request_output_rate_incl_ttft"),
            )
        )
    for name, short, header in LATENCY_SECTIONS:
        out.append("{:-^{w}}".format(header, w=WIDTH))
        for key in _stat_keys(result, name):
            stat = key.split("_")[0]
            label = {"mean": "Mean", "median": "Median"}.get(stat, stat.upper())
            out.append(_line(f"{label} {short} (ms):", result.get(key)))
    if result.get("server_generation_tokens_delta") is not None:
        out.append("{:-^{w}}".format("Server counter", w=WIDTH))
        out.append(
            _line("Server-counted generated tokens:", int(result["server_generation_tokens_delta"]))
        )
        out.append(_line("Client-counted generated tokens:", result["total_output_tokens"]))
    if result.get("spec_decode_acceptance_length") is not None:
        out.append("{:-^{w}}".format("Speculative decoding (server)", w=WIDTH))
        out.append(_line("Mean acceptance length:", result["spec_decode_acceptance_length"]))
        rate = result.get("spec_decode_draft_acceptance_rate")
        if rate is not None:
            out.append(_line("Draft acceptance rate (%):", 100 * rate))
    if result.get("failure_reasons"):
        out.append("{:-^{w}}".format("Failed requests by reason", w=WIDTH))
        for reason, n in sorted(result["failure_reasons"].items(), key=lambda kv: -kv[1]):
            out.append(f"{n:>6}  {reason}")
    out.append("=" * WIDTH)
    out.extend(usage_warnings(result))
    out.extend(prefix_cache_warning(result))
    return "\n".join(out)


def prefix_cache_warning(result: dict[str, Any]) -> list[str]:
    """One line when the server's prefix cache served prompt tokens during the measured
    phase: those prompts skipped prefill, so TTFT and throughput flatter the server (a
    repeated run with the same --seed sends the same prompts)."""
    hits = result.get("server_prefix_cache_hits_delta")
    if not hits or hits <= 0:
        return []
    total = result.get("total_input_tokens") or 0
    share = f" ({100 * hits / total:.0f}% of the input tokens)" if total else ""
    return [
        f"warning: the server's prefix cache served {int(hits)} prompt tokens during the "
        f"run{share}: those prompts skipped prefill; change --seed or restart the server "
        "to measure prefill"
    ]


def usage_warnings(result: dict[str, Any]) -> list[str]:
    """One line per kind of disagreement between usage and the streamed chunks."""
    w = result.get("usage_warnings") or {}
    lines = []
    if w.get("missing"):
        lines.append(
            f"warning: {w['missing']} responses carried no usage; their output tokens "
            "are the number of content chunks"
        )
    if w.get("fewer_than_chunks"):
        lines.append(
            f"warning: {w['fewer_than_chunks']} responses report fewer completion tokens "
            "in usage than content chunks streamed (each chunk holds at least one token)"
        )
    if w.get("more_than_chunks"):
        lines.append(
            f"warning: {w['more_than_chunks']} responses report more completion tokens than "
            "content chunks (chunks bundle tokens; ITL then spans several tokens)"
        )
    return lines


SWEEP_COLUMNS = (
    ("ok", "completed", "{:d}"),
    ("fail", "failed", "{:d}"),
    ("req/s", "request_throughput", "{:.2f}"),
    ("out tok/s", "output_throughput", "{:.1f}"),
    ("TTFT med", "median_ttft_ms", "{:.1f}"),
    ("TTFT p99", "p99_ttft_ms", "{:.1f}"),
    ("TPOT med", "median_tpot_ms", "{:.2f}"),
    ("ITL med", "median_itl_ms", "{:.2f}"),
    ("E2EL med", "median_e2el_ms", "{:.1f}"),
    ("peak conc", "max_concurrent_requests", "{:d}"),
)


def format_sweep_table(param: str, results: Sequence[dict[str, Any]]) -> str:
    """One row per sweep point (latencies in ms)."""
    head = [param] + [c[0] for c in SWEEP_COLUMNS]
    rows = []
    for r in results:
        row = [str(r.get("sweep_value"))]
        for _, key, fmt in SWEEP_COLUMNS:
            v = r.get(key)
            row.append("n/a" if v is None else fmt.format(v))
        rows.append(row)
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=True)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)


def _json_safe(obj: Any) -> Any:
    """inf/nan are not JSON: write them as strings, as vLLM writes request_rate 'inf'."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def save_json(
    path: str | Path, results: Sequence[dict[str, Any]], sweep: dict[str, Any] | None
) -> None:
    """One run: its flat vLLM-style object. A sweep: {"sweep": ..., "runs": [...]}."""
    doc: Any = results[0] if sweep is None else {"sweep": sweep, "runs": list(results)}
    Path(path).write_text(json.dumps(_json_safe(doc), indent=1) + "\n", encoding="utf-8")


def plot(
    path: str | Path, results: Sequence[dict[str, Any]], label_key: str = "sweep_value"
) -> None:
    """Latency vs throughput over the runs, and TTFT and ITL distributions, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers and CI
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=PLOT_SIZE_IN)
    (ax_tpot, ax_ttft), (ax_hist_ttft, ax_hist_itl) = axes
    xs = [r["output_throughput"] for r in results]
    labels = [str(r.get(label_key, "")) for r in results]
    legends = [r.get("sweep_point") or lab or None for r, lab in zip(results, labels, strict=True)]

    def curve(ax: Any, keys: Sequence[tuple[str, str]], ylabel: str, title: str) -> None:
        for key, name in keys:
            pairs = zip(xs, results, strict=True)
            pts = [(x, r[key]) for x, r in pairs if r.get(key) is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        for x, r, lab in zip(xs, results, labels, strict=True):
            if r.get(keys[0][0]) is not None and lab:
                ax.annotate(
                    lab, (x, r[keys[0][0]]), textcoords="offset points", xytext=(4, 4), fontsize=8
                )
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)

    curve(
        ax_tpot,
        [("median_tpot_ms", "median TPOT"), ("p99_tpot_ms", "p99 TPOT")],
        "ms",
        "TPOT vs throughput",
    )
    curve(
        ax_ttft,
        [("median_ttft_ms", "median TTFT"), ("p99_ttft_ms", "p99 TTFT")],
        "ms",
        "TTFT vs throughput",
    )
    ttfts = [[t * 1000.0 for t in r.get("ttfts", []) if t is not None] for r in results]
    itls = [[g * 1000.0 for gaps in r.get("itls", []) for g in gaps] for r in results]
    for ax, series in ((ax_hist_ttft, ttfts), (ax_hist_itl, itls)):
        everything = [v for s in series for v in s]
        if not everything:
            continue
        # One set of bins for all runs, so the distributions compare bar by bar.
        lo, hi = min(everything), max(everything)
        bins = (
            [lo + (hi - lo) * i / HIST_BINS for i in range(HIST_BINS + 1)] if hi > lo else HIST_BINS
        )
        for s, legend in zip(series, legends, strict=True):
            if s:
                ax.hist(s, bins=bins, histtype="step", label=legend)
    for ax, name in ((ax_hist_ttft, "TTFT"), (ax_hist_itl, "ITL")):
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("count")
        ax.set_title(f"{name} distribution")
        ax.grid(alpha=0.3)
        if any(legends) and ax.has_data():
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=PLOT_DPI)
    plt.close(fig)
