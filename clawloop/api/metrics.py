"""Serving metrics in the Prometheus text format (version 0.0.4), kept by hand: no client library needed.

Counters and a latency histogram are updated on the request path (plain dict increments on the event loop,
no locks needed); gauges that describe the run (live sessions, turns by state, samples by state, policy version)
are read when ``/metrics`` is scraped. Routes are labelled by their template (``/v1/chat/completions``), never
by the raw path, so label sets stay bounded; unmatched paths share the label ``unmatched``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

Labels = tuple[tuple[str, str], ...]


def _labels(labels: dict[str, str] | Labels) -> Labels:
    items = labels.items() if isinstance(labels, dict) else labels
    return tuple(sorted((str(k), str(v)) for k, v in items))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt_labels(labels: Labels, extra: Labels = ()) -> str:
    items = labels + extra
    if not items:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in items) + "}"


def _fmt_value(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    if float(v).is_integer():
        return str(int(v))
    return repr(float(v))


class Histogram:
    def __init__(self, buckets: Iterable[float] = LATENCY_BUCKETS_S):
        self.buckets = tuple(sorted(buckets))
        self.counts: dict[Labels, list[int]] = defaultdict(lambda: [0] * (len(self.buckets) + 1))
        self.sums: dict[Labels, float] = defaultdict(float)

    def observe(self, value: float, labels: dict[str, str] | Labels = ()) -> None:
        key = _labels(labels)
        counts = self.counts[key]
        for i, upper in enumerate(self.buckets):
            if value <= upper:
                counts[i] += 1
        counts[-1] += 1
        self.sums[key] += value


class ServingMetrics:
    """Everything /metrics reports that the API itself counts."""

    def __init__(self) -> None:
        self.requests: dict[Labels, float] = defaultdict(float)
        self.prompt_tokens: dict[Labels, float] = defaultdict(float)
        self.completion_tokens: dict[Labels, float] = defaultdict(float)
        self.turns: dict[Labels, float] = defaultdict(float)
        self.latency = Histogram()

    def record_request(self, route: str, method: str, status: int, latency_s: float) -> None:
        self.requests[_labels({"route": route, "method": method, "status": str(status)})] += 1
        self.latency.observe(latency_s, {"route": route})

    def record_turn(self, turn_type: str, prompt_tokens: int, completion_tokens: int, stored: bool) -> None:
        key = _labels({"turn_type": turn_type})
        self.prompt_tokens[key] += prompt_tokens
        self.completion_tokens[key] += completion_tokens
        self.turns[_labels({"turn_type": turn_type, "stored": "true" if stored else "false"})] += 1

    def render(self, gauges: dict[str, tuple[str, dict[Labels, float]]],
               counters: dict[str, tuple[str, dict[Labels, float]]] | None = None) -> str:
        """The exposition text: own counters + the histogram + caller-provided gauges and counters."""
        lines: list[str] = []

        def family(name: str, kind: str, help_: str, samples: dict[Labels, float]) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            for labels, value in sorted(samples.items()):
                lines.append(f"{name}{_fmt_labels(labels)} {_fmt_value(value)}")

        family("clawloop_http_requests_total", "counter", "HTTP requests by route, method and status.",
               self.requests)
        family("clawloop_prompt_tokens_total", "counter", "Prompt tokens of served completions.",
               self.prompt_tokens)
        family("clawloop_completion_tokens_total", "counter", "Generated tokens of served completions.",
               self.completion_tokens)
        family("clawloop_served_turns_total", "counter", "Completions served, by turn type and whether stored.",
               self.turns)
        name = "clawloop_request_latency_seconds"
        lines.append(f"# HELP {name} Time from request arrival to the last byte of the answer.")
        lines.append(f"# TYPE {name} histogram")
        for labels in sorted(self.latency.counts):
            counts = self.latency.counts[labels]
            for upper, count in zip(self.latency.buckets, counts):
                lines.append(f"{name}_bucket{_fmt_labels(labels, (('le', _fmt_value(upper)),))} {count}")
            lines.append(f"{name}_bucket{_fmt_labels(labels, (('le', '+Inf'),))} {counts[-1]}")
            lines.append(f"{name}_sum{_fmt_labels(labels)} {_fmt_value(self.latency.sums[labels])}")
            lines.append(f"{name}_count{_fmt_labels(labels)} {counts[-1]}")
        for fam_name, (help_, samples) in (counters or {}).items():
            family(fam_name, "counter", help_, samples)
        for fam_name, (help_, samples) in gauges.items():
            family(fam_name, "gauge", help_, samples)
        return "\n".join(lines) + "\n"


def labelled(values: dict[str, float], label: str) -> dict[Labels, float]:
    """{"ready": 3} -> {(("state", "ready"),): 3} for a gauge family."""
    return {((label, str(k)),): float(v) for k, v in values.items()}
