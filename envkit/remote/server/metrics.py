"""The server's counters and latency histograms (:class:`Metrics`), summed over worker processes and rendered in
the Prometheus text format for ``/metrics``."""

from __future__ import annotations

import bisect
import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _Histogram:
    def __init__(self) -> None:
        self.counts = [0] * (len(_LATENCY_BUCKETS) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.sum += seconds
        self.counts[bisect.bisect_left(_LATENCY_BUCKETS, seconds)] += 1  # the first bucket with seconds <= le


class Metrics:
    """Counters and latency histograms, rendered in the Prometheus text format."""

    def __init__(self) -> None:
        self.sessions_created = 0
        self.sessions_closed: Counter[str] = Counter()
        self.requests: Counter[tuple[str, str]] = Counter()
        self.errors: Counter[str] = Counter()
        self.latency: dict[tuple[str, str], _Histogram] = {}

    def observe(self, op: str, transport: str, seconds: float) -> None:
        self.requests[op, transport] += 1
        hist = self.latency.get((op, transport))
        if hist is None:
            hist = self.latency[op, transport] = _Histogram()
        hist.observe(seconds)

    def snapshot(self) -> dict[str, Any]:
        """These numbers as JSON (what a worker publishes for the others to sum)."""
        return {"sessions_created": self.sessions_created, "sessions_closed": dict(self.sessions_closed),
                "requests": [[op, t, n] for (op, t), n in self.requests.items()], "errors": dict(self.errors),
                "latency": [[op, t, h.counts, h.sum] for (op, t), h in self.latency.items()]}

    @classmethod
    def summed(cls, snapshots: Sequence[dict[str, Any]]) -> Metrics:
        """The metrics of several workers added up."""
        total = cls()
        for snap in snapshots:
            total.sessions_created += snap["sessions_created"]
            total.sessions_closed.update(snap["sessions_closed"])
            total.errors.update(snap["errors"])
            for op, t, n in snap["requests"]:
                total.requests[op, t] += n
            for op, t, counts, seconds in snap["latency"]:
                hist = total.latency.setdefault((op, t), _Histogram())
                hist.counts = [a + b for a, b in zip(hist.counts, counts, strict=True)]
                hist.sum += seconds
        return total

    def render(self, sessions: int, max_sessions: int, per_worker: dict[int, int] | None = None) -> str:
        """The Prometheus text; ``per_worker`` (sessions by worker pid) adds the workers' gauges."""
        lines = [
            "# HELP envkit_sessions Open sessions.", "# TYPE envkit_sessions gauge", f"envkit_sessions {sessions}",
            "# HELP envkit_sessions_max Session capacity.", "# TYPE envkit_sessions_max gauge",
            f"envkit_sessions_max {max_sessions}",
            "# HELP envkit_sessions_created_total Sessions created.", "# TYPE envkit_sessions_created_total counter",
            f"envkit_sessions_created_total {self.sessions_created}",
            "# HELP envkit_sessions_closed_total Sessions closed, by reason.",
            "# TYPE envkit_sessions_closed_total counter",
        ]
        if per_worker is not None:
            lines += ["# HELP envkit_workers Worker processes serving.", "# TYPE envkit_workers gauge",
                      f"envkit_workers {len(per_worker)}",
                      "# HELP envkit_worker_sessions Open sessions per worker process.",
                      "# TYPE envkit_worker_sessions gauge"]
            lines += [f'envkit_worker_sessions{{worker="{pid}"}} {n}' for pid, n in sorted(per_worker.items())]
        lines += [f'envkit_sessions_closed_total{{reason="{r}"}} {n}' for r, n in sorted(self.sessions_closed.items())]
        lines += ["# HELP envkit_requests_total Session operations served, by op and transport.",
                  "# TYPE envkit_requests_total counter"]
        lines += [f'envkit_requests_total{{op="{op}",transport="{t}"}} {n}'
                  for (op, t), n in sorted(self.requests.items())]
        lines += ["# HELP envkit_errors_total Error answers, by code.", "# TYPE envkit_errors_total counter"]
        lines += [f'envkit_errors_total{{code="{c}"}} {n}' for c, n in sorted(self.errors.items())]
        lines += ["# HELP envkit_op_seconds Latency of session operations (env time included).",
                  "# TYPE envkit_op_seconds histogram"]
        for (op, t), hist in sorted(self.latency.items()):
            labels = f'op="{op}",transport="{t}"'
            cumulative = 0
            for bound, count in zip((*_LATENCY_BUCKETS, math.inf), hist.counts, strict=True):
                cumulative += count
                le = "+Inf" if bound == math.inf else repr(bound)
                lines.append(f'envkit_op_seconds_bucket{{{labels},le="{le}"}} {cumulative}')
            lines.append(f"envkit_op_seconds_sum{{{labels}}} {hist.sum:.6f}")
            lines.append(f"envkit_op_seconds_count{{{labels}}} {cumulative}")
        return "\n".join(lines) + "\n"
