"""Prometheus metrics: every counted outcome, read from its owner at scrape time.

Each module that counts names its outcomes with an enum (spanguard/outcomes.py); `EXPORTED`
says where each member appears on /metrics, and `WorkerMetrics` reads them by member from
the objects the worker wired in (no hot-path cost, no outcome spelled out twice).

Besides: the decisions by rule, action and service (heard through the guard's observer hook),
the detection latency (a histogram observed when a kill signal's send is acked), consumer lag
per partition (refreshed by a timer, read at scrape time), the process and platform
collectors and a build-info gauge. The Grafana dashboard and the alert
rules of the helm chart use these names; tests/streams/test_metrics_kafka.py scrapes a real
worker and fails when one they use is missing.
"""

from __future__ import annotations

import platform
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
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
from spanguard.alerting.service import PageOutcome
from spanguard.alerting.webhook import WebhookOutcome
from spanguard.connectors.releases import ReleaseCount, ReleaseSkip
from spanguard.detection.guard import Guard, GuardCount
from spanguard.detection.pipeline import PipelineCount
from spanguard.detection.rules import RULES
from spanguard.detection.rules.base import GuardObserver
from spanguard.detection.trace_state import TraceState
from spanguard.goal.verifier import GoalOutcome
from spanguard.outcomes import Counted, CountedOutcome
from spanguard.schemas.decision import Decision
from spanguard.streams.agents.guard_spans import SpanCount
from spanguard.streams.conversations import ConversationCount
from spanguard.streams.fetch_watch import FetchCount
from spanguard.streams.flow_resume import ResumeCount
from spanguard.streams.health import HealthCount

__all__ = [
    "EXPORTED",
    "LATENCY_BUCKETS",
    "ConsumerLag",
    "DecisionCounts",
    "DetectionLatency",
    "Series",
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


@dataclass(frozen=True, slots=True)
class Series:
    """One counter series on /metrics: `spanguard_<metric>_total{labels}`."""

    metric: str
    labels: tuple[tuple[str, str], ...] = ()


def by_outcome(
    kind: type[CountedOutcome], metric: str, label: str = "outcome"
) -> dict[CountedOutcome, tuple[Series, ...]]:
    """Every member of `kind` as a series of one metric, labelled with its value."""
    return {member: (Series(metric, ((label, member.value),)),) for member in kind}


DEAD_LETTERS = Series("dead_letters")

# The help text of each counter (the Grafana dashboard and the helm chart's alert rules use
# these names).
COUNTER_HELP = {
    "messages": "Kafka messages consumed",
    "messages_repartitioned": "messages split and re-keyed by trace id",
    "dead_letters": "messages sent to the dead-letter topic (bad input, undeliverable pages and"
    " webhook notifications)",
    "webhooks": "webhook notifications by outcome",
    "pages": "PagerDuty pages by outcome",
    "goal_checks": "ended agent invocations by verifier outcome",
    "spans": "spans received",
    "tool_calls_observed": "tool calls counted by tool_loop",
    "token_events": "token usage events read for the token budget",
    "tool_spans_without_arguments": "tool spans skipped because their arguments were not"
    " recorded (missing_args: skip)",
    "repeats_ignored": "spans not recounted",
    "malformed_spans": "spans with invalid ids, skipped",
    "releases_read": "operators' releases read from the kill topic",
    "releases_applied": "killed traces whose loop rules an operator's release re-armed",
    "usage_spans_priced": "usage spans priced for a usd budget, by outcome (unpriced: no price"
    " for the model they name; their tokens are counted as unpriced, never as free)",
    "conversation_id_conflicts": "spans naming a conversation other than their trace's first",
    "conversation_records": "the conversation scope's call and usage records, by what became"
    " of them (sent by the span agent, read by the conversation agent, dropped as seen before)",
    "conversation_decisions": "decisions the conversation agent took",
    "conversations_evicted": "idle conversations whose state was deleted",
    "span_batches": "batches of messages the span agent completed",
    "span_agent_crashes": "times the span agent raised (Faust restarts it; /readyz is red)",
    "signals_lost": "kill signals the broker did not ack: not sent, the trace can trip again",
    "fetch_stalls": "what the fetch watch found standing still for 15 s: a partition with"
    " records waiting and its fetch position unmoved (what=partition), a table restore"
    " (what=table_restore), a span partition read past its committed offset with none of its"
    " messages in process (what=unprocessed)",
    "flow_control_records_kept": "records of the current generation that Faust's flow control"
    " resume at the end of a rebalance would have dropped from the agents' queues, kept",
    "fetch_stall_seeks": "partitions the fetch watch sought to be read again after it found"
    " them standing still",
    "kill_topic_records_skipped": "records of the kill topic the release reader skipped, by why"
    " (not a signal, or not one signed with the worker's key)",
}

# Where each counted outcome is exported: every member of every CountedOutcome enum has an
# entry (tests/streams/test_metrics.py fails on one without). A member in several series is
# added to each (an undeliverable page is a page outcome and a dead letter).
EXPORTED: dict[CountedOutcome, tuple[Series, ...]] = {
    GuardCount.SPANS: (Series("spans"),),
    GuardCount.TOOL_CALLS: (Series("tool_calls_observed"),),
    GuardCount.TOKEN_EVENTS: (Series("token_events"),),
    GuardCount.DUPLICATE_SPANS: (Series("repeats_ignored", (("why", "same_span_id"),)),),
    GuardCount.REPEATED_CALL_IDS: (Series("repeats_ignored", (("why", "same_call_id"),)),),
    GuardCount.MISSING_ARGUMENTS: (Series("tool_spans_without_arguments"),),
    GuardCount.MALFORMED_SPANS: (Series("malformed_spans"),),
    GuardCount.RELEASES_APPLIED: (Series("releases_applied"),),
    GuardCount.PRICED_USAGE: (Series("usage_spans_priced", (("outcome", "priced"),)),),
    GuardCount.UNPRICED_USAGE: (Series("usage_spans_priced", (("outcome", "unpriced"),)),),
    GuardCount.CONVERSATION_CONFLICTS: (Series("conversation_id_conflicts"),),
    PipelineCount.MESSAGES: (Series("messages"),),
    PipelineCount.REPARTITIONED: (Series("messages_repartitioned"),),
    PipelineCount.DEAD_LETTERS: (DEAD_LETTERS,),
    SpanCount.DEAD_LETTERS: (DEAD_LETTERS,),
    ReleaseCount.READ: (Series("releases_read"),),
    ConversationCount.RECORDS_SENT: (Series("conversation_records", (("what", "sent"),)),),
    ConversationCount.RECORDS_READ: (Series("conversation_records", (("what", "read"),)),),
    ConversationCount.DUPLICATES: (Series("conversation_records", (("what", "duplicate"),)),),
    ConversationCount.DECISIONS: (Series("conversation_decisions"),),
    ConversationCount.EVICTED: (Series("conversations_evicted"),),
    HealthCount.BATCHES: (Series("span_batches"),),
    HealthCount.CRASHES: (Series("span_agent_crashes"),),
    HealthCount.LOST_SIGNALS: (Series("signals_lost"),),
    ResumeCount.RECORDS_KEPT: (Series("flow_control_records_kept"),),
    FetchCount.STALLED: (Series("fetch_stalls", (("what", "partition"),)),),
    FetchCount.RESTORE_STALLED: (Series("fetch_stalls", (("what", "table_restore"),)),),
    FetchCount.UNPROCESSED: (Series("fetch_stalls", (("what", "unprocessed"),)),),
    FetchCount.SOUGHT: (Series("fetch_stall_seeks"),),
    **by_outcome(PageOutcome, "pages"),
    **by_outcome(WebhookOutcome, "webhooks"),
    **by_outcome(GoalOutcome, "goal_checks"),
    **by_outcome(ReleaseSkip, "kill_topic_records_skipped", label="why"),
}
for _undeliverable in (
    PageOutcome.REJECTED,
    PageOutcome.FAILED,
    WebhookOutcome.REJECTED,
    WebhookOutcome.FAILED,
):
    EXPORTED[_undeliverable] += (DEAD_LETTERS,)


class WorkerMetrics(Collector):
    """The counted outcomes, read from their owners at scrape time (no hot-path cost), the
    decisions by rule, action and service, and the traces held.

    `counts` names, per outcome enum, the object that counts it (the guard's stats, the
    pipeline, the paging service's tally...), read as it is at each scrape (parts that start
    later add theirs); an enum without one is exported at zero.
    """

    def __init__(
        self,
        guard: Guard,
        counts: Mapping[type[CountedOutcome], Counted],
        active_traces: Callable[[], int],
    ) -> None:
        self.counts = counts
        self.decisions = DecisionCounts()
        guard.add_observer(self.decisions)
        self.active_traces = active_traces

    def series(self) -> dict[Series, int]:
        """Every exported series and its value now."""
        values: dict[Series, int] = {}
        for outcome, where in EXPORTED.items():
            source = self.counts.get(type(outcome))
            counted = source.count(outcome) if source is not None else 0
            for series in where:
                values[series] = values.get(series, 0) + counted
        return values

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        families: dict[str, CounterMetricFamily] = {}
        for series, value in self.series().items():
            family = families.get(series.metric)
            if family is None:
                family = families[series.metric] = CounterMetricFamily(
                    f"spanguard_{series.metric}",
                    COUNTER_HELP[series.metric],
                    labels=[name for name, _ in series.labels],
                )
            family.add_metric([value for _, value in series.labels], value)
        yield from families.values()
        decisions = CounterMetricFamily(
            "spanguard_decisions", "decisions taken", labels=["rule", "action", "service"]
        )
        for (rule, action, service), count in sorted(self.decisions.counts.items()):
            decisions.add_metric([rule, action, service], count)
        yield decisions
        yield GaugeMetricFamily(
            "spanguard_active_traces",
            "traces with state on this worker",
            value=self.active_traces(),
        )
