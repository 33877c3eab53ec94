"""The memory plan of one GPU (or the CPU): weights, activations, CUDA graphs, KV cache, and the
context that fits. Pure arithmetic (no torch): the engine fills it from measurements at
start-up, `moeserve plan` from a checkpoint's shapes with no GPU present; both print it with
`format_memory_table`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

GIB = 1 << 30


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device. `total_bytes` 0: a CPU plan (a KV budget from RAM, nothing else)."""

    kv_pages: int
    page_size: int
    kv_bytes_per_token: int
    total_bytes: int = 0
    utilization: float = 1.0
    weights_bytes: int = 0
    activation_bytes: int = 0  # peak of the largest eager step
    graph_bytes: int = 0  # CUDA-graph pool (estimated before capture, measured after)
    graph_measured: bool = False
    other_bytes: int = 0  # CUDA context, communication buffers, other processes
    budget_bytes: int = 0  # what the KV cache was allowed

    @property
    def kv_bytes(self) -> int:
        return self.kv_pages * self.page_size * self.kv_bytes_per_token

    @property
    def kv_tokens(self) -> int:
        return self.kv_pages * self.page_size

    def with_pages(self, pages: int) -> MemoryPlan:
        return replace(self, kv_pages=pages)

    def with_graph_measured(self, graph_bytes: int) -> MemoryPlan:
        return replace(self, graph_bytes=graph_bytes, graph_measured=True)


def plan_kv_pages(
    *,
    budget_bytes: int,
    kv_bytes_per_token: int,
    page_size: int,
    want_tokens: int,
    num_pages: int | None = None,
    **measured: int | float,
) -> MemoryPlan:
    """Pages for `want_tokens` (max_num_seqs full contexts), capped by what `budget_bytes`
    holds; `num_pages` (the user's) overrides both. At least one page."""
    page_bytes = max(1, kv_bytes_per_token * page_size)
    if num_pages is None:
        fits = max(0, budget_bytes) // page_bytes
        num_pages = max(1, min(-(-want_tokens // page_size), fits))
    return MemoryPlan(
        kv_pages=num_pages,
        page_size=page_size,
        kv_bytes_per_token=kv_bytes_per_token,
        budget_bytes=max(0, budget_bytes),
        **measured,  # type: ignore[arg-type]
    )


def _gib(n: int) -> str:
    return f"{n / GIB:8.2f} GiB"


def format_memory_table(plan: MemoryPlan, max_model_len: int, title: str = "memory plan") -> str:
    """The plan as a few aligned lines (printed at start-up and by `moeserve plan`)."""
    rows: list[tuple[str, str]] = []
    if plan.total_bytes:
        rows += [
            ("device memory", _gib(plan.total_bytes)),
            (f"budget ({plan.utilization:.0%})", _gib(int(plan.total_bytes * plan.utilization))),
            ("weights", _gib(plan.weights_bytes)),
            ("activations (peak step)", _gib(plan.activation_bytes)),
            (
                "CUDA graphs" + (" (measured)" if plan.graph_measured else " (reserved)"),
                _gib(plan.graph_bytes),
            ),
            ("other (context, comms)", _gib(plan.other_bytes)),
        ]
    rows += [
        (
            "KV cache",
            f"{_gib(plan.kv_bytes)}  {plan.kv_pages} pages x {plan.page_size} tokens, "
            f"{plan.kv_bytes_per_token} B/token",
        ),
        ("KV tokens", f"{plan.kv_tokens:>12,}"),
        ("max context", f"{max_model_len:>12,} tokens"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [title] + [f"  {k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)
