"""Engine counters, rendered as Prometheus text exposition (no client library needed)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from moeserve.engine.kv_blocks import PrefixCacheStats


@dataclass
class SpecStats:
    """Speculative decoding counters (vLLM's definitions: the mean acceptance length is
    1 + accepted_tokens / drafts)."""

    drafts: int = 0  # sequence-steps that verified at least one draft token
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def on_verify(self, drafted: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        if len(self.accepted_per_position) < drafted:
            self.accepted_per_position += [0] * (drafted - len(self.accepted_per_position))
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_length(self) -> float:
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else 1.0


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
    spec: SpecStats = field(default_factory=SpecStats)

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
        self._render_spec(lines)
        return "\n".join(lines) + "\n"

    def _render_spec(self, lines: list[str]) -> None:
        """The speculative decoding counters under moeserve's names and vLLM's, so existing
        dashboards read them."""
        spec = self.spec
        if not spec.drafts:
            return
        counters = (
            ("num_drafts", "Sequence-steps that verified draft tokens.", spec.drafts),
            ("num_draft_tokens", "Draft tokens proposed and verified.", spec.draft_tokens),
            ("num_accepted_tokens", "Draft tokens accepted.", spec.accepted_tokens),
        )
        for prefix in ("moeserve_", "vllm:"):
            for name, help_, value in counters:
                full = f"{prefix}spec_decode_{name}_total"
                lines += [f"# HELP {full} {help_}", f"# TYPE {full} counter", f"{full} {value}"]
            full = f"{prefix}spec_decode_num_accepted_tokens_per_pos_total"
            lines += [f"# HELP {full} Draft tokens accepted, by position in the draft."]
            lines += [f"# TYPE {full} counter"]
            for pos, value in enumerate(spec.accepted_per_position):
                lines.append(f'{full}{{position="{pos}"}} {value}')
