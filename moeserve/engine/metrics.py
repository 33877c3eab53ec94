"""Engine counters, rendered as Prometheus text exposition (no client library needed)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from moeserve.engine.kv_blocks import PrefixCacheStats


@dataclass
class EngineMetrics:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests: int = 0
    preemptions: int = 0
    steps: int = 0
    step_seconds: float = 0.0
    batched_tokens: int = 0
    finished: Counter = field(default_factory=Counter)

    def on_arrival(self, prompt_tokens: int) -> None:
        self.requests += 1
        self.prompt_tokens += prompt_tokens

    def on_token(self) -> None:
        self.generation_tokens += 1

    def on_preempt(self, n: int) -> None:
        self.preemptions += n

    def on_step(self, seconds: float, tokens: int) -> None:
        self.steps += 1
        self.step_seconds += seconds
        self.batched_tokens += tokens

    def on_finish(self, reason: str) -> None:
        self.finished[reason] += 1

    def render(
        self,
        running: int,
        waiting: int,
        pages_used: int,
        pages_total: int,
        prefix: PrefixCacheStats,
    ) -> str:
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, value: float, labels: str = "") -> None:
            if not any(line.startswith(f"# TYPE moeserve_{name} ") for line in lines):
                lines.append(f"# HELP moeserve_{name} {help_}")
                lines.append(f"# TYPE moeserve_{name} {kind}")
            lines.append(f"moeserve_{name}{labels} {value}")

        metric("prompt_tokens_total", "counter", "Prompt tokens received.", self.prompt_tokens)
        metric("generation_tokens_total", "counter", "Tokens generated.", self.generation_tokens)
        metric("requests_total", "counter", "Requests accepted by the engine.", self.requests)
        for reason in ("stop", "length", "abort", "error"):
            metric(
                "requests_finished_total",
                "counter",
                "Requests finished, by reason.",
                self.finished[reason],
                f'{{finish_reason="{reason}"}}',
            )
        metric(
            "num_preemptions_total",
            "counter",
            "Requests preempted (recomputed later).",
            self.preemptions,
        )
        metric(
            "prefix_cache_queries_total",
            "counter",
            "Prompt tokens looked up in the prefix cache.",
            prefix.queries,
        )
        metric(
            "prefix_cache_hits_total",
            "counter",
            "Prompt tokens served from the prefix cache.",
            prefix.hits,
        )
        metric("num_requests_running", "gauge", "Requests in the running batch.", running)
        metric("num_requests_waiting", "gauge", "Requests waiting to be scheduled.", waiting)
        metric(
            "kv_cache_usage_ratio",
            "gauge",
            "Share of KV cache pages in use.",
            pages_used / max(1, pages_total),
        )
        metric("engine_steps_total", "counter", "Engine steps run.", self.steps)
        metric(
            "engine_step_seconds_total", "counter", "Time spent in model steps.", self.step_seconds
        )
        metric(
            "batched_tokens_total",
            "counter",
            "Tokens computed in model steps.",
            self.batched_tokens,
        )
        return "\n".join(lines) + "\n"
