"""HTTP-level Prometheus counters (the engine exports its own; /metrics shows both)."""

from __future__ import annotations

import threading
from collections import Counter


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class HttpMetrics:
    """Request counts and latency sums per (method, route, status). Routes are the app's
    path templates (unmatched paths share one label) so label cardinality stays bounded."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count: Counter[tuple[str, str, int]] = Counter()
        self._seconds: Counter[tuple[str, str, int]] = Counter()

    def observe(self, method: str, route: str, status: int, seconds: float) -> None:
        key = (method, route, status)
        with self._lock:
            self._count[key] += 1
            self._seconds[key] += seconds

    def render(self) -> str:
        with self._lock:
            items = sorted(self._count.items())
            seconds = dict(self._seconds)
        lines = [
            "# HELP moeserve_http_requests_total HTTP requests by method, route and status.",
            "# TYPE moeserve_http_requests_total counter",
        ]
        for (method, route, status), n in items:
            labels = f'method="{method}",route="{_escape(route)}",status="{status}"'
            lines.append(f"moeserve_http_requests_total{{{labels}}} {n}")
        lines += [
            "# HELP moeserve_http_request_duration_seconds_sum Time spent answering requests.",
            "# TYPE moeserve_http_request_duration_seconds_sum counter",
        ]
        for (method, route, status), _ in items:
            labels = f'method="{method}",route="{_escape(route)}",status="{status}"'
            total = seconds[(method, route, status)]
            lines.append(f"moeserve_http_request_duration_seconds_sum{{{labels}}} {total:.6f}")
        return "\n".join(lines) + "\n"
