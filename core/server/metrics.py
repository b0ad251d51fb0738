"""Prometheus metrics for ``GET /metrics``, in a registry of the app's own (several apps can share a process).

Gauges and token counters are read from the engine snapshot at scrape time; latency histograms are fed by
the engine thread as each request finishes (``MetricsListener.request_finished``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pegainfer.engine.async_engine import EngineSnapshot, FinishedRequest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "pegainfer"

_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1,
    2.5,
    5,
    7.5,
    10,
    20,
    40,
    80,
)
_TPOT_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1,
    2.5,
    5,
)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 300, 600)


class _EngineCollector(Collector):
    """Engine gauges and token counters, read from the snapshot on every scrape."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._snapshot()
        gauges = {
            "num_requests_running": ("Sequences in the running batch.", s.num_running),
            "num_requests_waiting": ("Sequences waiting to be scheduled.", s.num_waiting),
            "kv_cache_usage_perc": ("Fraction of KV-cache pages in use (1 = full).", s.kv_cache_usage),
            "engine_alive": ("1 while the engine loop runs, 0 once it has died.", float(s.alive)),
            "prefix_cache_hit_rate": (
                "Prompt tokens found in the prefix cache over prompt tokens admitted, since start.",
                s.prefix_cache_hit_rate,
            ),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)
        counters = {
            "prompt_tokens": ("Prompt tokens admitted.", s.prompt_tokens),
            "generation_tokens": ("Tokens generated.", s.generation_tokens),
            "engine_steps": ("Engine steps run.", s.steps),
            # vLLM's pair: the hit rate over any window is the ratio of their increases.
            "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
            "prefix_cache_hits": ("Prompt tokens found in the prefix cache.", s.prefix_cache_hits),
        }
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)


class MetricsListener:
    """Owns the registry; the async engine calls ``request_finished`` on its thread."""

    def __init__(self, snapshot: Callable[[], EngineSnapshot]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(snapshot))
        r = self.registry
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "Time to first token.", buckets=_TTFT_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            f"{PREFIX}_time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds",
            "Arrival to last token, per request.",
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.finished = Counter(
            f"{PREFIX}_request_success",
            "Requests finished, by finish reason.",
            ["finished_reason"],
            registry=r,
        )
        self.http_errors = Counter(
            f"{PREFIX}_http_errors", "Error responses sent, by status code.", ["status"], registry=r
        )

    def request_finished(self, info: FinishedRequest) -> None:
        reasons = {reason or "abort" for reason in info.finish_reasons}
        for reason in reasons:
            self.finished.labels(finished_reason=reason).inc()
        if info.first_token_time is None or reasons & {"abort", "error"}:
            return
        self.ttft.observe(max(info.first_token_time - info.arrival_time, 0.0))
        self.e2e.observe(max(info.finished_time - info.arrival_time, 0.0))
        per_sequence = info.num_output_tokens / max(info.n, 1)
        if per_sequence > 1:
            self.tpot.observe(max(info.finished_time - info.first_token_time, 0.0) / (per_sequence - 1))

    def error_sent(self, status: int) -> None:
        self.http_errors.labels(status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
