"""The Faust app, wiring only: topics, tables, the guard, and the agents that connect them.

No rule logic lives here (spanguard/detection/), no sending logic (streams/delivery.py), no
agent body (streams/agents/): this module builds the parts and hands them to each agent.
"""

from __future__ import annotations

import logging

import faust

from spanguard.alerting.pagerduty import Pager
from spanguard.alerting.service import PageOutcome, PagingService
from spanguard.alerting.webhook import Webhook, WebhookOutcome, WebhookService
from spanguard.detection.guard import Guard, GuardCount
from spanguard.detection.pipeline import PipelineCount, SpanPipeline
from spanguard.goal.verifier import GoalOutcome, GoalVerifier
from spanguard.kafka_clients import faust_credentials
from spanguard.outcomes import Counted, CountedOutcome
from spanguard.schemas.policy import Policy
from spanguard.settings import WorkerSettings
from spanguard.streams.agents import notify_webhook, page_on_call, verify_goals
from spanguard.streams.agents.guard_spans import SpanAgent, SpanCount
from spanguard.streams.delivery import Outbox
from spanguard.streams.faust_tuning import set_fetch_max_wait
from spanguard.streams.health import Health
from spanguard.streams.metrics import (
    ConsumerLag,
    DetectionLatency,
    WorkerMetrics,
    worker_registry,
)
from spanguard.streams.partitioner import collector_partition
from spanguard.streams.releases import ReleaseCount, ReleaseReader
from spanguard.streams.services import LagMeter, MetricsServer, StartupTasks
from spanguard.streams.state import SerializedStates, TraceTable
from spanguard.streams.wiring import Worker

__all__ = ["create_app"]

log = logging.getLogger("spanguard.worker")

# Every topic is bytes in, bytes out: the pipeline decodes, and bad bytes are its business.
RAW = {"key_type": bytes, "value_type": bytes, "key_serializer": "raw", "value_serializer": "raw"}


def create_app(
    settings: WorkerSettings,
    policy: Policy | None = None,
    pager: Pager | None = None,
    verifier: GoalVerifier | None = None,
    webhook: Webhook | None = None,
) -> faust.App:
    policy = policy or (Policy.load(settings.policy) if settings.policy else Policy())
    set_fetch_max_wait(settings.fetch_max_wait)
    app = faust_app(settings)
    worker = build_worker(app, settings, policy, pager, verifier, webhook)
    agent = SpanAgent(worker)
    agent.attach(app)
    page_on_call.register(worker)
    verify_goals.register(worker)
    notify_webhook.register(worker)
    LagMeter(worker).attach(app)
    StartupTasks(worker).attach(app)
    MetricsServer(worker).attach(app)
    worker.registry.register(outcome_metrics(worker, agent))
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


def trace_table(app: faust.App, settings: WorkerSettings) -> TraceTable:
    # No use_partitioner: each changelog record goes to the partition of the message that
    # changed it, where the trace's messages arrive whatever partitioner their producer used
    # (the Collector's FNV-1a, librdkafka's CRC32, Java's murmur2). See docs/design.md.
    return app.tables.add(
        TraceTable(
            app,
            name=settings.table_name,
            default=None,
            beacon=app.tables.beacon,
            partitions=settings.partitions,
            use_partitioner=False,
            key_type=bytes,  # bytes types make Faust use the raw codec for the changelog
            value_type=bytes,
        )
    )


def delivered_table(app: faust.App, settings: WorkerSettings, name: str) -> faust.Table:
    """What was delivered (paged, sent to the webhook), per trace: keyed by trace id like the
    detections topic it follows. Its changelog topic is created on start."""
    return app.Table(
        name,
        default=None,
        partitions=settings.partitions,
        use_partitioner=True,
        key_type=bytes,
        value_type=bytes,
    )


def build_worker(
    app: faust.App,
    settings: WorkerSettings,
    policy: Policy,
    pager: Pager | None,
    verifier: GoalVerifier | None,
    webhook: Webhook | None,
) -> Worker:
    table = trace_table(app, settings)
    paged = delivered_table(app, settings, "paged")
    # Only with a webhook: a table's changelog topic is created on start.
    notified = delivered_table(app, settings, "notified") if webhook is not None else None
    # Idle traces are evicted at most a 60th of the TTL late (the index's time buckets).
    states = SerializedStates(
        table, bucket_seconds=settings.state_ttl / 60, cache_size=settings.state_cache
    )
    table.states = states  # its rebalance hooks keep the expiry index right
    signing_key = kill_signing_key(settings)
    # Operators' releases (signed with the same key) re-arm a killed trace's loop rules.
    releases = ReleaseReader(settings, signing_key)
    guard = Guard(policy, states=states, released=releases.released)
    registry = worker_registry()
    lag = ConsumerLag()
    registry.register(lag)
    return Worker(
        app=app,
        settings=settings,
        # The Collector's topic and the repartition topic in one stream: both are keyed by
        # trace id with the same partition count, so a trace's state lives in one partition.
        spans_in=app.topic(settings.input_topic, settings.repartition_topic, **RAW),
        goal_checks=app.topic(settings.goal_topic, **RAW),
        detections_in=app.topic(settings.detections_topic, **RAW),
        table=table,
        paged=paged,
        notified=notified,
        states=states,
        guard=guard,
        # A packed record of the repartition topic holds traces of the partition it is on.
        pipeline=SpanPipeline(
            guard, home=lambda trace_id: collector_partition(trace_id.encode(), settings.partitions)
        ),
        outbox=outbox(app, settings, signing_key),
        health=Health(dead_after=settings.dead_after),
        paging=PagingService(pager),
        webhook=WebhookService(webhook),
        verifier=verifier,
        releases=releases,
        registry=registry,
        latency=DetectionLatency(registry),
        lag=lag,
    )


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


def outbox(app: faust.App, settings: WorkerSettings, signing_key: bytes | None) -> Outbox:
    return Outbox(
        repartition=app.topic(settings.repartition_topic, **RAW),
        detections=app.topic(settings.detections_topic, **RAW),
        kill_signals=app.topic(settings.kill_topic, **RAW),
        dead_letters=app.topic(settings.dead_letter_topic, **RAW),
        partitions=settings.partitions,
        signing_key=signing_key,
    )


def outcome_metrics(worker: Worker, agent: SpanAgent) -> WorkerMetrics:
    """The counters on /metrics, each outcome enum read from the part that counts it."""
    counts: dict[type[CountedOutcome], Counted] = {
        GuardCount: worker.guard.stats,
        PipelineCount: worker.pipeline,
        SpanCount: agent.outcomes,
        PageOutcome: worker.paging.outcomes,
        WebhookOutcome: worker.webhook.outcomes,
        ReleaseCount: worker.releases,
    }
    if worker.verifier is not None:
        counts[GoalOutcome] = worker.verifier.outcomes
    # The expiry index's count, not len(table): a RocksDB table's len() reads every key.
    return WorkerMetrics(worker.guard, counts, active_traces=worker.states.indexed)
