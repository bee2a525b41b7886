"""The Faust app: topics, the per-trace state table, and the agent that wires them to the core.

No rule logic lives here: each message goes through streams/pipeline.py (routing) and
streams/core.py (rules); this module only reads topics, keeps the table and sends results.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

import faust
from prometheus_client import CollectorRegistry

from spanguard.alerting.pagerduty import Pager
from spanguard.alerting.service import PagingService, paged_rules, with_rule
from spanguard.schemas.decision import Decision, KillSignal, sign
from spanguard.schemas.policy import Policy
from spanguard.streams.core import Guard
from spanguard.streams.faust_tuning import set_fetch_max_wait
from spanguard.streams.health import Health, serve_http
from spanguard.streams.metrics import WorkerMetrics
from spanguard.streams.partitioner import collector_partition
from spanguard.streams.pipeline import MAX_RECORD_BYTES, Outcome, SpanPipeline
from spanguard.streams.settings import WorkerSettings
from spanguard.streams.state import SerializedStates, TraceTable, event_context
from spanguard.streams.verifier import GoalVerifier

__all__ = ["create_app"]

log = logging.getLogger("spanguard.worker")

# Dead letters carry where they came from, so an operator can find and replay them.
HEADER_REASON = "spanguard.reason"
HEADER_TOPIC = "spanguard.source.topic"
HEADER_PARTITION = "spanguard.source.partition"
HEADER_OFFSET = "spanguard.source.offset"


# A dead letter must fit the topic's default max.message.bytes (1 MiB) with its headers.
MAX_DEAD_LETTER_BYTES = MAX_RECORD_BYTES
SEND_ATTEMPTS = 4
# Idle traces deleted per batch at most: eviction never stalls the event loop.
EVICT_PER_BATCH = 256


@dataclass
class Send:
    """One record to send; a kill signal remembers its decision, to retract it if not sent,
    other records their source message, to dead-letter a pointer to it if not sent."""

    topic: Any
    kwargs: dict[str, Any]
    decision: Decision | None = None
    source: Any = None


def create_app(
    settings: WorkerSettings,
    policy: Policy | None = None,
    pager: Pager | None = None,
    verifier: GoalVerifier | None = None,
) -> faust.App:
    policy = policy or (Policy.load(settings.policy) if settings.policy else Policy())
    set_fetch_max_wait(settings.fetch_max_wait)
    app = faust.App(
        settings.app_id,
        broker=f"kafka://{settings.bootstrap}",
        store=settings.store_url,
        datadir=settings.data_dir,
        web_enabled=False,  # /metrics is served by prometheus_client
        stream_recovery_delay=settings.recovery_delay,
        broker_commit_interval=settings.commit_interval,
        broker_session_timeout=settings.session_timeout,
        broker_heartbeat_interval=min(3.0, settings.session_timeout / 3),
        consumer_auto_offset_reset="earliest",
        topic_partitions=settings.partitions,
        topic_replication_factor=settings.replication_factor,
        producer_acks=-1,
    )
    raw = {
        "key_type": bytes,
        "value_type": bytes,
        "key_serializer": "raw",
        "value_serializer": "raw",
    }
    # One agent reads the Collector's topic and the repartition topic: both are keyed by trace
    # id and have the same partition count, so a trace's state lives in one partition.
    spans_in = app.topic(settings.input_topic, settings.repartition_topic, **raw)
    repartition_out = app.topic(settings.repartition_topic, **raw)
    kill_signals = app.topic(settings.kill_topic, **raw)
    detections = app.topic(settings.detections_topic, **raw)
    dead_letters = app.topic(settings.dead_letter_topic, **raw)

    # No use_partitioner: each changelog record goes to the partition of the message that
    # changed it, where the trace's messages arrive whatever partitioner their producer used
    # (the Collector's FNV-1a, librdkafka's CRC32, Java's murmur2). See docs/design.md.
    table = app.tables.add(
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
    # Idle traces are evicted at most a 60th of the TTL late (the index's time buckets).
    states = SerializedStates(table, bucket_seconds=settings.state_ttl / 60)
    table.states = states  # its rebalance hooks keep the expiry index right
    guard = Guard(policy, states=states)
    signing_key = settings.signing_key_bytes()
    pipeline = SpanPipeline(guard)
    health = Health(dead_after=settings.dead_after)
    app.spanguard = {"guard": guard, "pipeline": pipeline, "table": table, "health": health}  # type: ignore[attr-defined]

    def dead_letter_headers(message: Any, reason: str) -> list[tuple[str, bytes]]:
        return [
            (HEADER_REASON, reason.encode()),
            (HEADER_TOPIC, message.topic.encode()),
            (HEADER_PARTITION, str(message.partition).encode()),
            (HEADER_OFFSET, str(message.offset).encode()),
        ]

    def dead_letter_value(value: bytes | None) -> bytes | None:
        # Too large for the topic: the headers point at the source offset instead.
        return value if value is None or len(value) <= MAX_DEAD_LETTER_BYTES else b""

    async def send_all(sends: list[Send]) -> list[Send]:
        """Send, then wait for the broker's acks=all; return the sends that failed for good."""
        # A record over the limit would be refused on every attempt: it fails at once.
        too_large = [s for s in sends if len(s.kwargs.get("value") or b"") > MAX_RECORD_BYTES]
        pending = [s for s in sends if s not in too_large] if too_large else sends
        for send in too_large:
            log.warning(
                "record too large to send",
                extra={"topic": send.topic.get_topic_name(), "bytes": len(send.kwargs["value"])},
            )
        for attempt in range(SEND_ATTEMPTS):
            futures = []
            for send in pending:
                try:
                    futures.append(await send.topic.send(**send.kwargs))
                except Exception as exc:  # the producer refused it: counts as a failed send
                    futures.append(exc)
            failed = []
            for send, future in zip(pending, futures, strict=True):
                error = future
                if not isinstance(future, Exception):
                    try:
                        await future
                        continue
                    except Exception as exc:
                        error = exc
                log.warning(
                    "send failed",
                    extra={
                        "topic": send.topic.get_topic_name(),
                        "attempt": attempt + 1,
                        "error": repr(error),
                    },
                )
                failed.append(send)
            pending = failed
            if not pending or attempt == SEND_ATTEMPTS - 1:
                break
            await asyncio.sleep(0.2 * 2**attempt)
        return too_large + pending

    def outcome_sends(outcome: Outcome, message: Any) -> list[Send]:
        sends: list[Send] = []
        for trace_id, part in outcome.repartition:
            key = trace_id.encode()
            partition = collector_partition(key, settings.partitions)
            kwargs = {"key": key, "value": part, "partition": partition}
            sends.append(Send(repartition_out, kwargs, source=message))
        for decision in outcome.decisions:
            key = decision.trace_id.encode()
            sends.append(Send(detections, {"key": key, "value": decision.to_json().encode()}))
            if decision.action in ("kill", "downgrade"):  # a flag is for people, not agents
                record = KillSignal.from_decision(decision).to_dict()
                if signing_key is not None:
                    record = sign(record, signing_key)
                value = json.dumps(record, sort_keys=True).encode()
                sends.append(Send(kill_signals, {"key": key, "value": value}, decision))
            log.warning(
                "decision",
                extra={
                    "trace_id": decision.trace_id,
                    "rule": decision.rule,
                    "action": decision.action,
                    "reason": decision.reason,
                    "service": decision.agent.service,
                },
            )
        if outcome.dead_letter is not None:
            log.warning(
                "dead letter",
                extra={
                    "reason": outcome.dead_letter,
                    "topic": message.topic,
                    "partition": message.partition,
                    "offset": message.offset,
                },
            )
            value = outcome.dead_value if outcome.dead_value is not None else message.value
            sends.append(Send(dead_letters, {
                "key": message.key,
                "value": dead_letter_value(value),
                "headers": dead_letter_headers(message, outcome.dead_letter),
            }))  # fmt: skip
        return sends

    async def dead_letter_unsent(failed: list[Send]) -> None:
        """A record that could not be written (too large, say) leaves a pointer to its source."""
        pointers = []
        for send in failed:
            if send.source is None:
                continue
            topic = send.topic.get_topic_name()
            reason = f"could not be written to {topic} after {SEND_ATTEMPTS} attempts"
            pipeline.dead_letters += 1
            pointers.append(Send(dead_letters, {
                "key": send.kwargs.get("key"),
                "value": dead_letter_value(send.kwargs.get("value")),
                "headers": dead_letter_headers(send.source, reason),
            }))  # fmt: skip
        for send in await send_all(pointers):
            log.error("dead letter not written", extra={"key": repr(send.kwargs.get("key"))})

    async def publish(outcome: Outcome, message: Any) -> None:
        await send_all(outcome_sends(outcome, message))

    # Paging reads the detections topic in its own stream: PagerDuty's latency and faults
    # delay pages, never kill signals. The table is keyed by trace id, like the topic.
    paged = app.Table(
        "paged",
        default=None,
        partitions=settings.partitions,
        use_partitioner=True,
        key_type=bytes,
        value_type=bytes,
    )
    paging = PagingService(pager)
    app.spanguard["paging"] = paging  # type: ignore[attr-defined]
    detections_in = app.topic(settings.detections_topic, **raw)

    @app.agent(detections_in, name="page-on-call")
    async def page_on_call(stream: faust.StreamT) -> None:
        loop = asyncio.get_running_loop()
        async for event in stream.events():
            message = event.message
            trace_key = message.key or b""
            stored = paged.get(trace_key)  # one agent, one event at a time: still current below
            detection = paging.detection_to_page(message.value, paged_rules(stored))
            if detection is None:
                continue
            result = await loop.run_in_executor(None, paging.page, detection)
            # Delivered or not, never again for this trace and rule: a failure goes to the
            # dead letters with its reason, for a person to look at.
            paged[trace_key] = with_rule(stored, detection["rule"])
            if not result.delivered:
                await dead_letters.send(
                    key=message.key,
                    value=dead_letter_value(message.value),
                    headers=dead_letter_headers(message, f"page {result.status}: {result.error}"),
                )

    # The goal verifier reads messages that hold a root span from a topic of its own: a slow
    # judge delays verdicts, never loop or budget decisions.
    goal_checks = app.topic(settings.goal_topic, **raw)
    verify_goals = verifier is not None and verifier.wanted
    app.spanguard["verifier"] = verifier  # type: ignore[attr-defined]

    @app.agent(goal_checks, name="verify-goals", concurrency=4)
    async def check_goals(stream: faust.StreamT) -> None:
        async for event in stream.events():
            message = event.message
            if verifier is None:
                continue
            try:
                decisions, errors = await verifier.check(message.value)
            except Exception as exc:  # one bad message must never stop the agent
                log.exception("goal verifier failed on a message")
                decisions, errors = [], [f"internal error in the goal verifier: {exc!r}"]
            await publish(Outcome(decisions=decisions), message)
            for error in errors:
                await publish(Outcome(dead_letter=error), message)

    @app.agent(spans_in, name="guard-spans")
    async def guard_spans(stream: faust.StreamT) -> None:
        # Messages come in small batches: each trace's state is written once per batch, and
        # the batch's events are acknowledged (and later committed) only after its signals are
        # acked by the broker and its state is written.
        try:
            async for events in stream.take_events(settings.batch_size, within=0.002):
                await guard_batch(events)
                health.progressed()
        except BaseException as exc:
            if not isinstance(exc, asyncio.CancelledError):
                health.crashed(exc)
            raise

    # Where the span agent got to in each source partition: the offset after the last message
    # of a completed batch, or the first one of a batch still running. Records between it and
    # the partition's highwater are waiting on the agent.
    reached: dict[Any, int] = {}

    @app.on_partitions_revoked.connect
    async def forget_positions(_: Any, revoked: set[Any], **__: Any) -> None:
        reached.clear()  # a partition that comes back may have moved on elsewhere

    def pending_records() -> int:
        pending = 0
        for tp in app.consumer.assignment():
            if tp in reached:
                highwater = app.consumer.highwater(tp)
                if highwater is not None:
                    pending += max(0, highwater - reached[tp])
        return pending

    @app.timer(interval=1.0)
    async def watch_progress() -> None:
        try:
            pending = pending_records()
        except Exception:  # no consumer yet (starting, rebalancing): nothing to say this tick
            return
        health.observe_pending(pending)

    async def guard_batch(events: list[Any]) -> None:
        for event in events:
            reached.setdefault(event.message.tp, event.message.offset)
        states.begin_batch()
        sends: list[Send] = []
        goal_sends: list[Send] = []
        for event in events:
            message = event.message
            with event_context(event):
                outcome = pipeline.handle(message.key, message.value)  # never raises
            sends.extend(outcome_sends(outcome, message))
            if verify_goals and outcome.has_root_span:
                goal = {"key": message.key, "value": message.value}
                goal_sends.append(Send(goal_checks, goal, source=message))
        failed = await send_all(sends)
        for send in failed:
            if send.decision is not None:
                # Not sent is not decided: the trace can trip again on its next call.
                guard.retract(send.decision)
                health.lost_signals += 1
                log.error(
                    "kill signal not sent; the trace can trip again",
                    extra={"trace_id": send.decision.trace_id},
                )
        await dead_letter_unsent(failed)
        states.flush()
        evicted = states.evict_idle(events, guard.clock() - settings.state_ttl, EVICT_PER_BATCH)
        if evicted:
            log.info("evicted idle traces", extra={"evicted": evicted, "ttl": settings.state_ttl})
        if goal_sends:
            await dead_letter_unsent(await send_all(goal_sends))
        for event in events:
            reached[event.message.tp] = event.message.offset + 1

    @app.task
    async def serve_metrics() -> None:
        registry = CollectorRegistry()
        registry.register(WorkerMetrics(guard, pipeline, lambda: len(table), paging, verifier))
        app.spanguard["http"] = await serve_http(  # type: ignore[attr-defined]
            health, registry, settings.metrics_host, settings.metrics_port
        )
        log.info(
            "metrics",
            extra={"url": f"http://{settings.metrics_host}:{settings.metrics_port}/metrics"},
        )

    return app
