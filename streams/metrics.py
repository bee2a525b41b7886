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
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
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
from spanguard.alerting.incident_reader import IncidentSkip
from spanguard.alerting.service import PageOutcome
from spanguard.alerting.webhook import WebhookOutcome
from spanguard.connectors.releases import ReleaseCount, ReleaseSkip
from spanguard.detection.guard import Guard, GuardCount
from spanguard.detection.pipeline import PipelineCount
from spanguard.detection.pricing import MICRO_USD_PER_USD
from spanguard.detection.rules import RULES
from spanguard.detection.rules.base import GuardObserver
from spanguard.detection.trace_state import TraceState
from spanguard.goal.verifier import GoalOutcome
from spanguard.outcomes import Counted, CountedOutcome
from spanguard.schemas.decision import Decision
from spanguard.streams.agent_windows import AgentWindowCount
from spanguard.streams.agents.guard_spans import SpanCount
from spanguard.streams.conversations import ConversationCount
from spanguard.streams.faust_internals import store_databases
from spanguard.streams.fetch_watch import FetchCount
from spanguard.streams.flow_resume import ResumeCount
from spanguard.streams.health import Health, HealthCount
from spanguard.streams.tool_scope import ToolScopeCount

__all__ = [
    "EXPORTED",
    "LATENCY_BUCKETS",
    "ConsumerLag",
    "DecisionCounts",
    "DecisionsSent",
    "DetectionLatency",
    "FailingTools",
    "LastBatch",
    "Series",
    "TableMemory",
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


class DecisionsSent(Collector):
    """Every decision the outbox sends, of every scope (the guard's observer hears the trace
    scope's only): spanguard_decisions_sent_total{rule,action,scope}, and
    spanguard_decided_cost_usd_total{rule,action,scope}, the spend the decisions carry (a
    priced budget's: what the trace, conversation or agent had spent when decided), summed.
    Labels are bounded: the rules, the actions and three scopes."""

    def __init__(self) -> None:
        self.sent: dict[tuple[str, str, str], int] = {}
        self.micro_usd: dict[tuple[str, str, str], int] = {}

    def on_decision(self, decision: Decision) -> None:
        key = (decision.rule, decision.action, decision.scope_kind or "trace")
        self.sent[key] = self.sent.get(key, 0) + 1
        cost = decision.spend.cost_micro_usd
        if cost is not None:  # None: usage not priced, or not a budget's
            self.micro_usd[key] = self.micro_usd.get(key, 0) + cost

    def collect(self) -> Iterator[CounterMetricFamily]:
        labels = ["rule", "action", "scope"]
        sent = CounterMetricFamily(
            "spanguard_decisions_sent",
            "decisions sent to the detections topic, of every scope (trace, conversation, agent)",
            labels=labels,
        )
        for key, count in sorted(self.sent.items()):
            sent.add_metric(list(key), count)
        yield sent
        spend = CounterMetricFamily(
            "spanguard_decided_cost_usd",
            "US dollars the decided traces, conversations and agents had spent when decided"
            " (decisions of priced budgets), by rule, action and scope",
            labels=labels,
        )
        for key, micro in sorted(self.micro_usd.items()):
            spend.add_metric(list(key), micro / MICRO_USD_PER_USD)
        yield spend


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


# What RocksDB holds in memory per table, by kind: the memtables being filled and those
# waiting to be flushed, the block cache (states read back from disk), and the table readers'
# index and filter blocks (which grow with the data on disk).
ROCKSDB_MEMORY = {
    "memtables": "rocksdb.size-all-mem-tables",
    "block_cache": "rocksdb.block-cache-usage",
    "table_readers": "rocksdb.estimate-table-readers-mem",
}


class TableMemory(Collector):
    """spanguard_table_memory_bytes{table,kind}: RocksDB's memory for each table, summed over
    the partitions this worker has open (each partition is its own database with its own
    cache), read at scrape time. The part of the worker's RSS that the settings
    SPANGUARD_ROCKSDB_WRITE_BUFFER_MB and SPANGUARD_ROCKSDB_BLOCK_CACHE_MB bound."""

    def __init__(self, tables: Callable[[], Iterable[Any]]) -> None:
        self.tables = tables

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "spanguard_table_memory_bytes",
            "RocksDB memory of a table on this worker: memtables, block cache, table readers",
            labels=["table", "kind"],
        )
        for table in self.tables():
            databases = store_databases(table.data)
            if not databases:
                continue
            for kind, prop in ROCKSDB_MEMORY.items():
                total = 0
                for database in databases:
                    try:
                        total += database.property_int_value(prop) or 0
                    except Exception:  # closed by a rebalance since the listing  # noqa: BLE001
                        continue
                family.add_metric([table.name, kind], total)
        yield family


class FailingTools(Collector):
    """spanguard_fleet_failing_traces{tool}: for each tool with an open fleet incident, the
    failing traces its incident counted, read at scrape time from the open incidents the
    paging agent keeps (alerting/incidents.py). Only open incidents, at most
    MAX_GAUGED_TOOLS tools and `(other)`, the sum of the rest (0 with none): a bounded series
    count whatever the fleet calls."""

    def __init__(self, failing: Callable[[], Mapping[str, int]]) -> None:
        self.failing = failing

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "spanguard_fleet_failing_traces",
            "Failing traces of each tool with an open fleet incident (at most 20 tools, the rest"
            " summed as (other))",
            labels=["tool"],
        )
        for tool, traces in self.failing().items():
            family.add_metric([tool], traces)
        yield family


class LastBatch(Collector):
    """spanguard_last_span_batch_timestamp_seconds: when the span agent last completed a batch
    (Unix time), absent until its first. With records waiting, a stale one is a stuck agent; a
    reader that scrapes seldom still learns when the last records were done."""

    def __init__(self, health: Health) -> None:
        self.health = health

    def collect(self) -> Iterator[GaugeMetricFamily]:
        if self.health.last_batch_at is not None:
            yield GaugeMetricFamily(
                "spanguard_last_span_batch_timestamp_seconds",
                "Unix time the span agent last completed a batch of messages",
                value=self.health.last_batch_at,
            )


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
    """One counter series on /metrics: `spanguard_<metric>_total{labels}`, the count times
    `scale` (an amount kept in whole small units, exported in the unit its name says)."""

    metric: str
    labels: tuple[tuple[str, str], ...] = ()
    scale: float = 1.0


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
    "packed_records": "records of the Collector's spanguard_pack exporter, by what was done"
    " (decided where read; repartitioned: not on the partition they named, or holding traces"
    " of another, as from a Collector that saw another partition count)",
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
    "tool_calls_reissued": "tool calls made again with the call id of an earlier call that had"
    " ended (counted as new executions)",
    "user_turns": "inference spans sent a new user message (the trace's loop count starts anew)",
    "malformed_spans": "spans with invalid ids, skipped",
    "releases_read": "operators' releases read from the kill topic",
    "releases_applied": "killed traces whose loop rules an operator's release re-armed",
    "usage_spans_priced": "usage spans priced for a usd budget, by outcome (unpriced: no price"
    " for the model they name; their tokens are counted as unpriced, never as free)",
    "usage_tokens": "tokens the traces spent, as their budgets count them (read only where a"
    " token or usd budget asks), by price: priced, unpriced (no price for the model they name:"
    " not in spanguard_usage_cost_usd_total), off (no usd budget asks for a price)",
    "usage_cost_usd": "US dollars the traces spent, their tokens priced by the model they name"
    " (only where a usd budget asks for prices; unpriced tokens add nothing here)",
    "conversation_id_conflicts": "spans naming a conversation other than their trace's first",
    "agent_runs_unplaced": "agent runs of traces whose agent tree was full (256 runs): counted"
    " for agent_fan_out, not placed in the tree",
    "agent_links_unkept": "spans of traces with agents whose parent span the agent tree could"
    " not keep (1024 a trace): a run above them is not seen as nesting the runs below",
    "uncarried_requests": "requests to agent services that started a trace of their own (an"
    " A2A server span without a parent): their callers' trace context did not come with them,"
    " so a loop between agents through such a service is not seen as one",
    "linked_runs": "agent runs that started a trace of their own linked to their caller's span"
    " (a span link, not a parent; VoltAgent's): the trace rules decide each run alone; only"
    " the conversation scope, where on, joins the runs of one caller",
    "conversation_records": "the conversation scope's call and usage records, by what became"
    " of them (sent by the span agent, read by the conversation agent, dropped as seen before)",
    "conversation_decisions": "decisions the conversation agent took",
    "conversations_evicted": "idle conversations whose state was deleted",
    "agent_usage_records": "usage records of agent budgets over a window, by what became of"
    " them (sent by the span agent, read by the agent-windows agent, dropped as seen before;"
    " not counted: no service name, or a new agent past the worker's cap of agents)",
    "agent_window_decisions": "decisions the agent-windows agent took (agent budgets crossed)",
    "agent_window_clock_skews": "usage spans whose end time did not fit the agent's window, by"
    " what was done (late: counted into the newest bucket; reset: the window started afresh)",
    "agent_windows_evicted": "idle agent windows whose state was deleted",
    "tool_call_records": "the tool scope's rows (a trace's calls of a tool in one span message,"
    " or a trace-level decision naming a tool), by what became of them (sent by the span"
    " agent, read by the tool scope agent, dropped as seen before; not counted: a new tool"
    " past the policy's fleet.max_tools on the worker)",
    "tool_scope_decisions": "fleet incidents' records the tool scope agent took (opened and"
    " recovered)",
    "tool_windows_evicted": "idle tool windows whose state was deleted",
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
    "fleet_incident_records_skipped": "records of the detections topic that looked like a fleet"
    " incident's and that the incident reader skipped, by why (not a decision)",
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
    GuardCount.REISSUED_CALL_IDS: (Series("tool_calls_reissued"),),
    GuardCount.USER_TURNS: (Series("user_turns"),),
    GuardCount.MISSING_ARGUMENTS: (Series("tool_spans_without_arguments"),),
    GuardCount.MALFORMED_SPANS: (Series("malformed_spans"),),
    GuardCount.RELEASES_APPLIED: (Series("releases_applied"),),
    GuardCount.PRICED_USAGE: (Series("usage_spans_priced", (("outcome", "priced"),)),),
    GuardCount.UNPRICED_USAGE: (Series("usage_spans_priced", (("outcome", "unpriced"),)),),
    GuardCount.CONVERSATION_CONFLICTS: (Series("conversation_id_conflicts"),),
    GuardCount.AGENT_RUNS_UNPLACED: (Series("agent_runs_unplaced"),),
    GuardCount.AGENT_LINKS_UNKEPT: (Series("agent_links_unkept"),),
    GuardCount.UNCARRIED_REQUESTS: (Series("uncarried_requests"),),
    GuardCount.LINKED_RUNS: (Series("linked_runs"),),
    # No model label: model names come from the spans, unbounded (a typo, a fine-tune per
    # customer); the decisions and `spanguard explain` name the model of a trace.
    GuardCount.TOKENS_PRICED: (Series("usage_tokens", (("price", "priced"),)),),
    GuardCount.TOKENS_UNPRICED: (Series("usage_tokens", (("price", "unpriced"),)),),
    GuardCount.TOKENS_NOT_PRICED: (Series("usage_tokens", (("price", "off"),)),),
    GuardCount.COST_PICO_USD: (Series("usage_cost_usd", scale=1e-12),),
    PipelineCount.MESSAGES: (Series("messages"),),
    PipelineCount.REPARTITIONED: (Series("messages_repartitioned"),),
    PipelineCount.DEAD_LETTERS: (DEAD_LETTERS,),
    SpanCount.DEAD_LETTERS: (DEAD_LETTERS,),
    SpanCount.PACKS_DECIDED: (Series("packed_records", (("what", "decided"),)),),
    SpanCount.PACKS_REPARTITIONED: (Series("packed_records", (("what", "repartitioned"),)),),
    ReleaseCount.READ: (Series("releases_read"),),
    ConversationCount.RECORDS_SENT: (Series("conversation_records", (("what", "sent"),)),),
    ConversationCount.RECORDS_READ: (Series("conversation_records", (("what", "read"),)),),
    ConversationCount.DUPLICATES: (Series("conversation_records", (("what", "duplicate"),)),),
    ConversationCount.DECISIONS: (Series("conversation_decisions"),),
    ConversationCount.EVICTED: (Series("conversations_evicted"),),
    AgentWindowCount.RECORDS_SENT: (Series("agent_usage_records", (("what", "sent"),)),),
    AgentWindowCount.RECORDS_READ: (Series("agent_usage_records", (("what", "read"),)),),
    AgentWindowCount.DUPLICATES: (Series("agent_usage_records", (("what", "duplicate"),)),),
    AgentWindowCount.NO_IDENTITY: (Series("agent_usage_records", (("what", "no_identity"),)),),
    AgentWindowCount.OVER_AGENT_CAP: (
        Series("agent_usage_records", (("what", "over_agent_cap"),)),
    ),
    AgentWindowCount.DECISIONS: (Series("agent_window_decisions"),),
    AgentWindowCount.LATE: (Series("agent_window_clock_skews", (("what", "late"),)),),
    AgentWindowCount.RESETS: (Series("agent_window_clock_skews", (("what", "reset"),)),),
    AgentWindowCount.EVICTED: (Series("agent_windows_evicted"),),
    ToolScopeCount.RECORDS_SENT: (Series("tool_call_records", (("what", "sent"),)),),
    ToolScopeCount.RECORDS_READ: (Series("tool_call_records", (("what", "read"),)),),
    ToolScopeCount.DUPLICATES: (Series("tool_call_records", (("what", "duplicate"),)),),
    ToolScopeCount.OVER_TOOL_CAP: (Series("tool_call_records", (("what", "over_tool_cap"),)),),
    ToolScopeCount.DECISIONS: (Series("tool_scope_decisions"),),
    ToolScopeCount.EVICTED: (Series("tool_windows_evicted"),),
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
    **by_outcome(IncidentSkip, "fleet_incident_records_skipped", label="why"),
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
        counts: Mapping[type[CountedOutcome], Counted[Any]],
        active_traces: Callable[[], int],
        cached_traces: Callable[[], int] = lambda: 0,
    ) -> None:
        self.counts = counts
        self.decisions = DecisionCounts()
        guard.add_observer(self.decisions)
        self.active_traces = active_traces
        self.cached_traces = cached_traces

    def series(self) -> dict[Series, float]:
        """Every exported series and its value now."""
        values: dict[Series, float] = {}
        for outcome, where in EXPORTED.items():
            source = self.counts.get(type(outcome))
            counted = source.count(outcome) if source is not None else 0
            for series in where:
                value = counted if series.scale == 1.0 else counted * series.scale
                values[series] = values.get(series, 0) + value
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
        yield GaugeMetricFamily(
            "spanguard_cached_traces",
            "traces whose decoded state this worker keeps in memory (at most SPANGUARD_STATE_CACHE)",
            value=self.cached_traces(),
        )
