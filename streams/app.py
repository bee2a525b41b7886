"""The Faust app, wiring only: topics, tables, the guard, and the agents that connect them.

No rule logic lives here (spanguard/detection/), no sending logic (streams/delivery.py), no
agent body (streams/agents/): this module builds the parts into a typed `Worker`
(streams/wiring.py) and attaches each agent and service (streams/services.py) to the app,
each by its own methods.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import faust
from faust.types import TableT
from prometheus_client import CollectorRegistry

from spanguard.alerting.incident_reader import IncidentReader, IncidentSkip
from spanguard.alerting.incidents import OpenIncidents
from spanguard.alerting.pagerduty import Pager
from spanguard.alerting.service import PageOutcome, PagingService
from spanguard.alerting.webhook import Webhook, WebhookOutcome, WebhookService
from spanguard.config.policy_file import load_policy
from spanguard.config.settings import WorkerSettings
from spanguard.connectors.kafka_clients import faust_credentials
from spanguard.connectors.releases import ReleaseCount, ReleaseReader, ReleaseSkip
from spanguard.detection.fleet_signals import containment_signals
from spanguard.detection.guard import Guard, GuardCount
from spanguard.detection.pipeline import PipelineCount, SpanPipeline
from spanguard.goal.verifier import GoalOutcome, GoalVerifier
from spanguard.outcomes import Counted, CountedOutcome, Tally
from spanguard.schemas.decision import Decision
from spanguard.schemas.policy import FleetPolicy, Policy
from spanguard.streams.agent_windows import (
    AgentUsageRecorder,
    AgentWindowCount,
    agent_window_view,
    agent_windows_wanted,
)
from spanguard.streams.agents import notify_webhook, page_on_call, verify_goals
from spanguard.streams.agents.guard_agent_windows import AgentWindowsAgent
from spanguard.streams.agents.guard_conversations import ConversationAgent
from spanguard.streams.agents.guard_spans import SpanAgent
from spanguard.streams.agents.guard_tools import ToolScopeAgent
from spanguard.streams.conversations import (
    ConversationCount,
    ConversationRecorder,
    conversation_view,
    conversations_wanted,
)
from spanguard.streams.decoded_states import DecodedStates
from spanguard.streams.delivery import Outbox
from spanguard.streams.faust_internals import set_fetch_max_wait
from spanguard.streams.fetch_watch import FetchWatch
from spanguard.streams.flow_resume import KeepCurrentOnResume, ResumeCount
from spanguard.streams.health import Health, HealthCount
from spanguard.streams.metrics import (
    ConsumerLag,
    DecisionsSent,
    DetectionLatency,
    FailingTools,
    LastBatch,
    TableMemory,
    WorkerMetrics,
    worker_registry,
)
from spanguard.streams.partitioner import collector_partition
from spanguard.streams.services import LagMeter, MetricsServer, StartupTasks
from spanguard.streams.state_table import StateTable
from spanguard.streams.tool_scope import (
    ToolCallRecorder,
    ToolScopeCount,
    tool_scope_wanted,
    tool_window_view,
)
from spanguard.streams.wiring import Worker

__all__ = ["create_app"]

log = logging.getLogger("spanguard.worker")

# Every topic is bytes in, bytes out: the pipeline decodes, and bad bytes are its business.
RAW: dict[str, Any] = {
    "key_type": bytes,
    "value_type": bytes,
    "key_serializer": "raw",
    "value_serializer": "raw",
}


def create_app(
    settings: WorkerSettings,
    policy: Policy | None = None,
    pager: Pager | None = None,
    verifier: GoalVerifier | None = None,
    webhook: Webhook | None = None,
) -> faust.App:
    policy = policy or (load_policy(settings.policy) if settings.policy else Policy())
    set_fetch_max_wait(settings.fetch_max_wait)
    app = faust_app(settings)
    worker = build_worker(app, settings, policy, pager, verifier, webhook)
    spans = SpanAgent(worker)
    spans.attach(app)
    if worker.conversations_out is not None:
        conversations = conversation_states(app, settings)
        # One consumer, one lease: the span agent keeps it, every agent acts under it.
        ConversationAgent(worker, worker.conversations_out, conversations, spans.lease).attach(app)
    if worker.agent_usage_out is not None:
        windows = agent_window_states(app, settings)
        AgentWindowsAgent(worker, worker.agent_usage_out, windows, spans.lease).attach(app)
    if worker.tool_calls_out is not None:
        tools = scope_states(
            app, settings, settings.tool_window_table_name, tool_window_view(policy.fleet)
        )
        ToolScopeAgent(worker, worker.tool_calls_out, tools, spans.lease).attach(app)
    page_on_call.register(worker)
    verify_goals.register(worker)
    notify_webhook.register(worker)
    LagMeter(worker).attach(app)
    FetchWatch(worker).attach(app)
    # Faust's resume at the end of a rebalance would drop records fetched for this generation.
    keeper = KeepCurrentOnResume(app)
    worker.counted[ResumeCount] = keeper.outcomes
    keeper.attach()
    StartupTasks(worker).attach(app)
    MetricsServer(worker).attach(app)
    app.spanguard = worker  # type: ignore[attr-defined]
    return app


def faust_app(settings: WorkerSettings) -> faust.App:
    return faust.App(
        settings.app_id,
        broker=f"kafka://{settings.bootstrap}",
        broker_credentials=faust_credentials(settings.kafka),
        store=settings.store_url,
        datadir=settings.data_dir,
        web_enabled=False,  # /metrics, /livez and /readyz are served by streams/health.py
        stream_recovery_delay=settings.recovery_delay,
        table_standby_replicas=settings.standby_replicas,
        broker_commit_interval=settings.commit_interval,
        processing_guarantee=settings.processing_guarantee,
        broker_session_timeout=settings.session_timeout,
        broker_heartbeat_interval=min(3.0, settings.session_timeout / 3),
        consumer_auto_offset_reset="earliest",
        topic_partitions=settings.partitions,
        # 0 (chosen for the cluster) is resolved by run_worker; an app built directly (benches,
        # tests on one broker) gets one copy.
        topic_replication_factor=settings.replication_factor or 1,
        producer_acks=-1,
    )


def state_table(
    app: faust.App, settings: WorkerSettings, name: str, partitions: int | None = None
) -> StateTable:
    """A state table of raw bytes whose changelog follows the partition each record arrives
    on: the trace, conversation and agent window tables are all made so (`partitions`: its
    source topic's, the scopes' `scope_partitions`)."""
    # (Faust types tables.add() as returning its CollectionT interface; it returns the table.)
    return app.tables.add(  # type: ignore[return-value]
        StateTable(
            app,
            name=name,
            default=None,
            beacon=app.tables.beacon,
            partitions=partitions or settings.partitions,
            use_partitioner=False,
            key_type=bytes,  # bytes types make Faust use the raw codec for the changelog
            value_type=bytes,
            options=settings.store_options,  # RocksDB's memory per partition
        )
    )


def trace_states(app: faust.App, settings: WorkerSettings) -> tuple[StateTable, DecodedStates]:
    """The state table and the guard's view of it (decoded states, the expiry index)."""
    # No use_partitioner: each changelog record goes to the partition of the message that
    # changed it, where the trace's messages arrive whatever partitioner their producer used
    # (the Collector's FNV-1a, librdkafka's CRC32, Java's murmur2). See docs/design.md.
    table = state_table(app, settings, settings.table_name)
    # Idle traces are evicted at most a 60th of the TTL late (the index's time buckets).
    states = DecodedStates(
        table, bucket_seconds=settings.state_ttl / 60, cache_size=settings.state_cache
    )
    table.states = states  # its rebalance hooks keep the expiry index right
    return table, states


def conversation_states(app: faust.App, settings: WorkerSettings) -> DecodedStates:
    """The conversation table (conversation id -> ConversationState bytes) and its view."""
    return scope_states(app, settings, settings.conversation_table_name, conversation_view)


def agent_window_states(app: faust.App, settings: WorkerSettings) -> DecodedStates:
    """The agent window table (agent identity -> AgentWindow bytes) and its view."""
    return scope_states(app, settings, settings.agent_window_table_name, agent_window_view)


def scope_states(
    app: faust.App,
    settings: WorkerSettings,
    name: str,
    view: Callable[[StateTable, float, int], DecodedStates],
) -> DecodedStates:
    """A scope's table and its view: like the trace table, its changelog follows the partition
    each record arrives on."""
    table = state_table(app, settings, name, settings.scope_partitions)
    states = view(table, settings.state_ttl / 60, settings.state_cache)
    table.states = states
    return states


def delivered_table(app: faust.App, settings: WorkerSettings, name: str) -> TableT:
    """What was delivered (paged, sent to the webhook), per trace: keyed by trace id like the
    detections topic it follows. Its changelog topic is created on start."""
    return app.Table(
        name,
        default=None,
        partitions=settings.partitions,
        use_partitioner=True,
        key_type=bytes,
        value_type=bytes,
        options=settings.store_options,
    )


def paging_parts(
    settings: WorkerSettings, pager: Pager | None, webhook: Webhook | None
) -> tuple[PagingService, WebhookService, IncidentReader]:
    """The paging and webhook services, and the reader that tells the paging service of the
    open fleet incidents on every partition of the detections topic: whichever worker holds a
    trace decided on an incident's tool folds its page."""
    incidents = OpenIncidents()
    reader = IncidentReader(settings, incidents)
    return PagingService(pager, incidents), WebhookService(webhook), reader


def build_worker(
    app: faust.App,
    settings: WorkerSettings,
    policy: Policy,
    pager: Pager | None,
    verifier: GoalVerifier | None,
    webhook: Webhook | None,
) -> Worker:
    table, states = trace_states(app, settings)
    # Only with a webhook: a table's changelog topic is created on start.
    notified = delivered_table(app, settings, "notified") if webhook is not None else None
    signing_key = kill_signing_key(settings)
    # Operators' releases (signed with the same key) re-arm a killed trace's loop rules.
    releases = ReleaseReader(settings, signing_key)
    # The conversation scope only where a policy entry turns it on: off, nothing is read or sent.
    recorder = ConversationRecorder(policy) if conversations_wanted(policy) else None
    # Agent budgets likewise: the span agent records usage, the agent-windows agent decides.
    agent_tally = Tally()
    usage_recorder = (
        AgentUsageRecorder(policy, agent_tally) if agent_windows_wanted(policy) else None
    )
    # The fleet rules likewise: the span agent records tool calls, the tool scope agent decides.
    tool_recorder = ToolCallRecorder() if tool_scope_wanted(policy) else None
    guard = Guard(
        policy,
        states=states,
        released=releases.released,
        conversations=recorder,
        agent_budgets=usage_recorder,
        tools=tool_recorder,
    )
    pipeline = SpanPipeline(
        # A packed record of the repartition topic holds traces of the partition it is on.
        guard,
        home=lambda trace_id: collector_partition(trace_id.encode(), settings.partitions),
    )
    paging, notifying, incident_reader = paging_parts(settings, pager, webhook)
    health = Health(dead_after=settings.dead_after)
    counted = counting_parts(guard, pipeline, health, paging, notifying, verifier, releases)
    counted[AgentWindowCount] = agent_tally  # zeros while no agent budget is set
    counted[ToolScopeCount] = Tally()  # zeros while the fleet rules are off
    counted[IncidentSkip] = incident_reader.skipped
    registry, lag, sent = metrics_registry(guard, counted, states, health)
    registry.register(TableMemory(lambda: app.tables.values()))
    registry.register(FailingTools(paging.incidents.failing_traces))
    return Worker(
        app=app,
        settings=settings,
        # The Collector's topic and the repartition topic in one stream: both are keyed by
        # trace id with the same partition count, so a trace's state lives in one partition.
        spans_in=app.topic(settings.input_topic, settings.repartition_topic, **RAW),
        goal_checks=app.topic(settings.goal_topic, **RAW),
        detections_in=app.topic(settings.detections_topic, **RAW),
        table=table,
        paged=delivered_table(app, settings, "paged"),
        notified=notified,
        states=states,
        guard=guard,
        pipeline=pipeline,
        outbox=outbox(
            app,
            settings,
            signing_key,
            on_decision=sent.on_decision,
            fleet=policy.fleet
            if policy.fleet.enabled and policy.fleet.action == "contain"
            else None,
        ),
        health=health,
        paging=paging,
        webhook=notifying,
        verifier=verifier,
        releases=releases,
        incident_reader=incident_reader,
        counted=counted,
        registry=registry,
        latency=DetectionLatency(registry),
        lag=lag,
        **scope_parts(app, settings, recorder, usage_recorder, tool_recorder),
    )


def scope_parts(
    app: faust.App,
    settings: WorkerSettings,
    recorder: ConversationRecorder | None,
    usage_recorder: AgentUsageRecorder | None,
    tool_recorder: ToolCallRecorder | None,
) -> dict[str, Any]:
    """The Worker's fields of the scopes beyond the trace: each recorder the span agent's guard
    hands records to, and the topic it sends them to (none where its scope is off)."""

    def topic(name: str, wanted: object) -> faust.TopicT | None:
        if wanted is None:
            return None
        return app.topic(name, partitions=settings.scope_partitions, **RAW)

    return {
        "recorder": recorder,
        "conversations_out": topic(settings.conversation_topic, recorder),
        "usage_recorder": usage_recorder,
        "agent_usage_out": topic(settings.agent_usage_topic, usage_recorder),
        "tool_recorder": tool_recorder,
        "tool_calls_out": topic(settings.tool_calls_topic, tool_recorder),
    }


def metrics_registry(
    guard: Guard,
    counted: dict[type[CountedOutcome], Counted[Any]],
    states: DecodedStates,
    health: Health,
) -> tuple[CollectorRegistry, ConsumerLag, DecisionsSent]:
    """What /metrics serves; the consumer lag is refreshed by LagMeter, the decisions sent
    told by the outbox."""
    registry = worker_registry()
    lag = ConsumerLag()
    registry.register(lag)
    sent = DecisionsSent()
    registry.register(sent)
    # The expiry index's count, not len(table): a RocksDB table's len() reads every key.
    registry.register(
        WorkerMetrics(
            guard, counted, active_traces=states.indexed, cached_traces=lambda: states.cached
        )
    )
    registry.register(LastBatch(health))
    return registry, lag, sent


def kill_signing_key(settings: WorkerSettings) -> bytes | None:
    """The key kill signals are signed with: None only with SPANGUARD_ALLOW_UNSIGNED, said
    loudly."""
    signing_key = settings.kill_signing_key()
    if signing_key is None:
        log.warning(
            "kill signals are UNSIGNED (SPANGUARD_ALLOW_UNSIGNED): anyone who can write to %s"
            " can stop or steer agents that obey unsigned signals",
            settings.kill_topic,
        )
    return signing_key


def outbox(
    app: faust.App,
    settings: WorkerSettings,
    signing_key: bytes | None,
    on_decision: Callable[[Decision], None] | None = None,
    fleet: FleetPolicy | None = None,
) -> Outbox:
    """`fleet`: the policy's fleet section, when its incidents contain their tool."""
    return Outbox(
        on_decision=on_decision,
        tool_signals=(
            None if fleet is None else lambda decision: containment_signals(decision, fleet)
        ),
        repartition=app.topic(settings.repartition_topic, **RAW),
        detections=app.topic(settings.detections_topic, **RAW),
        kill_signals=app.topic(settings.kill_topic, **RAW),
        dead_letters=app.topic(settings.dead_letter_topic, **RAW),
        partitions=settings.partitions,
        signing_key=signing_key,
    )


def counting_parts(
    guard: Guard,
    pipeline: SpanPipeline,
    health: Health,
    paging: PagingService,
    webhook: WebhookService,
    verifier: GoalVerifier | None,
    releases: ReleaseReader,
) -> dict[type[CountedOutcome], Counted[Any]]:
    """Which part counts each outcome enum (the streams parts add their own as they attach)."""
    counted: dict[type[CountedOutcome], Counted[Any]] = {
        GuardCount: guard.stats,
        PipelineCount: pipeline,
        HealthCount: health,
        PageOutcome: paging.outcomes,
        WebhookOutcome: webhook.outcomes,
        ReleaseCount: releases,
        ReleaseSkip: releases.ignored,
        # The span agent and the conversation agent count into it; zeros while it is off.
        ConversationCount: Tally(),
    }
    if verifier is not None:
        counted[GoalOutcome] = verifier.outcomes
    return counted
