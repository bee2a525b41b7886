"""Prometheus metrics, read from the guard's own counters at scrape time (no hot-path cost)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from spanguard.alerting.service import PagingService
from spanguard.detection.guard import Guard
from spanguard.detection.pipeline import SpanPipeline
from spanguard.goal.verifier import GoalVerifier

__all__ = ["WorkerMetrics"]


class WorkerMetrics(Collector):
    def __init__(
        self,
        guard: Guard,
        pipeline: SpanPipeline,
        active_traces: Callable[[], int],
        paging: PagingService | None = None,
        verifier: GoalVerifier | None = None,
    ) -> None:
        self.verifier = verifier
        self.guard = guard
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
        undeliverable = paging.get("rejected", 0) + paging.get("failed", 0)
        yield counter(
            "dead_letters",
            "messages sent to the dead-letter topic (bad input and undeliverable pages)",
            pipeline.dead_letters + undeliverable,
        )
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
        decisions = CounterMetricFamily(
            "spanguard_decisions", "decisions taken", labels=["rule", "action"]
        )
        for (rule, action), count in sorted(stats.decisions.items()):
            decisions.add_metric([rule, action], count)
        yield decisions
        yield GaugeMetricFamily(
            "spanguard_active_traces",
            "traces with state on this worker",
            value=self.active_traces(),
        )
