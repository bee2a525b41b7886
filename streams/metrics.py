"""Prometheus metrics, read from the guard's own counters at scrape time (no hot-path cost).

Besides the guard's counters: the detection latency (a histogram observed when a kill signal's
send is acked), consumer lag per partition (refreshed by a timer, read at scrape time), the
process and platform collectors and a build-info gauge. The Grafana dashboard and the alert
rules of the helm chart use these names; tests/streams/test_metrics_kafka.py scrapes a real
worker and fails when one they use is missing.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from datetime import datetime
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from spanguard import __version__
from spanguard.alerting.service import PagingService
from spanguard.alerting.webhook import WebhookService
from spanguard.detection.guard import Guard, GuardObserver, TraceState
from spanguard.detection.pipeline import SpanPipeline
from spanguard.detection.rules import RULES
from spanguard.goal.verifier import GoalVerifier
from spanguard.schemas.decision import Decision

__all__ = [
    "LATENCY_BUCKETS",
    "ConsumerLag",
    "DecisionCounts",
    "DetectionLatency",
    "WorkerMetrics",
    "worker_registry",
]

# Seconds from a span's end to its kill signal acked by the broker: tens of milliseconds when
# the pipeline keeps up, seconds to minutes when the Collector batches or the worker lags.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)


class DetectionLatency:
    """spanguard_detection_latency_seconds{rule}: span end to kill signal sent (acked)."""

    def __init__(self, registry: CollectorRegistry, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.histogram = Histogram(
            "spanguard_detection_latency_seconds",
            "seconds from the end of the span that tripped a rule to its kill signal acked",
            labelnames=["rule"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        for rule in RULES:  # a series per rule from the start, at zero
            self.histogram.labels(rule.name)

    def signal_sent(self, decision: Decision) -> float | None:
        """Observe one acked signal; return the latency, or None if the span had no end time."""
        if decision.span_ended_at is None:
            return None
        ended = datetime.fromisoformat(decision.span_ended_at).timestamp()
        # An agent's clock ahead of ours would make it negative: that is no latency at all.
        latency = max(self.clock() - ended, 0.0)
        self.histogram.labels(decision.rule).observe(latency)
        return latency


class DecisionCounts(GuardObserver):
    """The guard's decisions by (rule, action, service), heard through the guard's observer
    hook: every rule of the registry is counted, whatever rules are added later."""

    def __init__(self) -> None:
        self.counts: dict[tuple[str, str, str], int] = {}

    def on_decision(self, decision: Decision, state: TraceState) -> None:
        key = (decision.rule, decision.action, state.service)
        self.counts[key] = self.counts.get(key, 0) + 1


class ConsumerLag(Collector):
    """spanguard_consumer_lag{topic,partition}: highwater minus fetch position, per partition.

    A timer in the worker refreshes it (streams/app.py); a scrape only reads the last values.
    """

    def __init__(self) -> None:
        self.lags: dict[tuple[str, int], int] = {}

    def update(self, lags: Mapping[tuple[str, int], int]) -> None:
        self.lags = dict(lags)  # partitions no longer assigned disappear with the new map

    async def refresh(self, consumer: Any, topics: Collection[str]) -> None:
        """Read highwater and position of `consumer`'s assigned partitions of `topics`.

        Faust's consumer (any with assignment(), highwater(tp) and async position(tp)):
        the highwater comes from the last fetch response, so this costs no broker request.
        """
        lags = {}
        for tp in consumer.assignment():
            if tp.topic not in topics:
                continue  # changelog partitions are recovery's business, not lag
            highwater = consumer.highwater(tp)
            position = await consumer.position(tp)
            if highwater is None or position is None:
                continue  # nothing fetched yet: unknown is not zero
            lags[(tp.topic, tp.partition)] = max(highwater - position, 0)
        self.update(lags)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "spanguard_consumer_lag",
            "messages between a partition's highwater and this worker's fetch position",
            labels=["topic", "partition"],
        )
        for (topic, partition), lag in sorted(self.lags.items()):
            family.add_metric([topic, str(partition)], lag)
        yield family


def worker_registry() -> CollectorRegistry:
    """A registry with the process and platform metrics and the build info."""
    registry = CollectorRegistry()
    # Our own instances: the worker's registry is not prometheus_client's global one.
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    Info("spanguard_build", "the running spanguard release", registry=registry).info(
        {"version": __version__, "python": platform.python_version()}
    )
    return registry


class WorkerMetrics(Collector):
    def __init__(
        self,
        guard: Guard,
        pipeline: SpanPipeline,
        active_traces: Callable[[], int],
        paging: PagingService | None = None,
        verifier: GoalVerifier | None = None,
        webhook: WebhookService | None = None,
        releases_read: Callable[[], int] = lambda: 0,
    ) -> None:
        self.releases_read = releases_read
        self.verifier = verifier
        self.webhook = webhook
        self.guard = guard
        self.decisions = DecisionCounts()
        guard.add_observer(self.decisions)
        self.pipeline = pipeline
        self.active_traces = active_traces
        self.paging = paging

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        stats = self.guard.stats
        pipeline = self.pipeline

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(f"spanguard_{name}", doc, value=value)

        yield counter("messages", "Kafka messages consumed", pipeline.messages)
        yield counter(
            "messages_repartitioned",
            "messages split and re-keyed by trace id",
            pipeline.repartitioned,
        )
        paging = self.paging.outcomes if self.paging is not None else {}
        webhooks = self.webhook.outcomes if self.webhook is not None else {}
        undeliverable = sum(
            outcomes.get("rejected", 0) + outcomes.get("failed", 0)
            for outcomes in (paging, webhooks)
        )
        yield counter(
            "dead_letters",
            "messages sent to the dead-letter topic (bad input, undeliverable pages and"
            " webhook notifications)",
            pipeline.dead_letters + undeliverable,
        )
        sent = CounterMetricFamily(
            "spanguard_webhooks", "webhook notifications by outcome", labels=["outcome"]
        )
        for outcome in ("delivered", "rejected", "failed", "already_sent"):
            sent.add_metric([outcome], webhooks.get(outcome, 0))
        yield sent
        pages = CounterMetricFamily(
            "spanguard_pages", "PagerDuty pages by outcome", labels=["outcome"]
        )
        for outcome in ("accepted", "rejected", "failed", "already_paged", "not_configured"):
            pages.add_metric([outcome], paging.get(outcome, 0))
        yield pages
        goals = CounterMetricFamily(
            "spanguard_goal_checks",
            "ended agent invocations by verifier outcome",
            labels=["outcome"],
        )
        outcomes = self.verifier.outcomes if self.verifier is not None else {}
        for outcome in (
            "met",
            "unmet",
            "low_confidence",
            "no_content",
            "not_sampled",
            "disabled",
            "judge_error",
        ):
            goals.add_metric([outcome], outcomes.get(outcome, 0))
        yield goals
        yield counter("spans", "spans received", stats.spans)
        yield counter("tool_calls_observed", "tool calls counted by tool_loop", stats.tool_calls)
        yield counter(
            "tool_spans_without_arguments",
            "tool spans skipped because their arguments were not recorded (missing_args: skip)",
            stats.missing_arguments,
        )
        repeats = CounterMetricFamily(
            "spanguard_repeats_ignored", "spans not recounted", labels=["why"]
        )
        repeats.add_metric(["same_span_id"], stats.duplicate_spans)
        repeats.add_metric(["same_call_id"], stats.repeated_call_ids)
        yield repeats
        yield counter("malformed_spans", "spans with invalid ids, skipped", stats.malformed_spans)
        priced = CounterMetricFamily(
            "spanguard_usage_spans_priced",
            "usage spans priced for a usd budget, by outcome (unpriced: no price for the model"
            " they name; their tokens are counted as unpriced, never as free)",
            labels=["outcome"],
        )
        priced.add_metric(["priced"], stats.priced_usage)
        priced.add_metric(["unpriced"], stats.unpriced_usage)
        yield priced
        decisions = CounterMetricFamily(
            "spanguard_decisions", "decisions taken", labels=["rule", "action", "service"]
        )
        for (rule, action, service), count in sorted(self.decisions.counts.items()):
            decisions.add_metric([rule, action, service], count)
        yield decisions
        yield counter(
            "releases_read", "operators' releases read from the kill topic", self.releases_read()
        )
        yield counter(
            "releases_applied",
            "killed traces whose loop rules an operator's release re-armed",
            stats.releases_applied,
        )
        yield GaugeMetricFamily(
            "spanguard_active_traces",
            "traces with state on this worker",
            value=self.active_traces(),
        )
