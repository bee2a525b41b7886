"""An operator's `spanguard kill` and `spanguard release` (and `contain` / `release --tool`):
one signed signal on the kill topic, one audit record (who, why) on the detections topic, both
keyed as the signal is (the trace id, or the scope's key) so they keep their order with the
worker's own signals for it."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from typing import Literal

from confluent_kafka import KafkaException, Producer

from spanguard.config.settings import WorkerSettings
from spanguard.connectors.kafka_clients import client_config
from spanguard.detection.conventions.values import bounded_text
from spanguard.detection.fleet import MAX_NAME_CHARS
from spanguard.schemas.decision import (
    NO_SPAN_ID,
    NO_TRACE_ID,
    AgentIdentity,
    Decision,
    DecisionScope,
    Evidence,
    KillSignal,
    sign,
)

__all__ = ["manual_decision", "manual_tool_decision", "publish_manual", "publish_signal"]

# A manual signal names no agent: the operator knows only the trace.
MANUAL_SERVICE = "(manual)"


def manual_decision(
    trace_id: str | None,
    action: Literal["kill", "release"],
    reason: str,
    operator: str,
    *,
    conversation_id: str | None = None,
    agent: AgentIdentity | None = None,
) -> Decision:
    """The audit record of an operator's kill or release of a trace, or (`conversation_id`,
    `agent`) of every trace of a conversation or of an agent. Its id is new on every issue: a
    second kill after a release is a new signal, not a duplicate of the first."""
    if sum(target is not None for target in (trace_id, conversation_id, agent)) != 1:
        raise ValueError("name one of a trace, a conversation or an agent")
    scope: DecisionScope | None = None
    if conversation_id is not None:
        scope = DecisionScope("conversation", conversation_id)
    elif agent is not None:
        scope = DecisionScope("agent")
    return Decision(
        trace_id=trace_id or NO_TRACE_ID,
        span_id=NO_SPAN_ID,
        rule="manual",
        action=action,
        reason=reason,
        agent=agent or AgentIdentity(MANUAL_SERVICE),
        detected_at=datetime.now(UTC).isoformat(timespec="milliseconds"),
        operator=operator,
        scope=scope,
        decision_id=uuid.uuid4().hex,
    )


def manual_tool_decision(signal: KillSignal, operator: str) -> Decision:
    """The audit record of an operator's contain (`signal` kind kill) or release of a tool:
    rule manual, scope tool, the signal's id, reason and time. It is no fleet incident: it
    pages nothing and folds nothing (alerting/incidents.py's `is_incident`)."""
    tool, server = (signal.tool.name, signal.tool.server) if signal.tool else ("", "")
    return Decision(
        trace_id=NO_TRACE_ID,
        span_id=NO_SPAN_ID,
        rule="manual",
        action="contain" if signal.kind == "kill" else "release",
        reason=signal.reason,
        agent=AgentIdentity(MANUAL_SERVICE),
        detected_at=signal.detected_at,
        evidence=Evidence(tool_name=tool),
        operator=operator,
        # The schema bounds a tool scope's names as the fleet's keys are; the full name is the
        # evidence's.
        scope=DecisionScope(
            "tool",
            tool=bounded_text(tool, MAX_NAME_CHARS),
            server=bounded_text(server, MAX_NAME_CHARS) if server else None,
        ),
        decision_id=signal.signal_id,
    )


def publish_manual(
    settings: WorkerSettings, decision: Decision, timeout: float = 30.0
) -> KillSignal:
    """Send the signal (signed with the worker's key) and its audit record, acks=all; raise
    KafkaException if either is not acknowledged within `timeout`."""
    signal = KillSignal.from_decision(decision, ttl_seconds=settings.signal_ttl)
    _publish(settings, signal, decision, timeout)
    return signal


def publish_signal(
    settings: WorkerSettings, signal: KillSignal, audit: Decision, timeout: float = 30.0
) -> KillSignal:
    """Send `signal` (signed with the worker's key) to the kill topic and its `audit` record
    to the detections topic, acks=all: an operator's contain or release of a tool. Returns
    `signal`, as publish_manual returns the one it sends."""
    _publish(settings, signal, audit, timeout)
    return signal


def _publish(
    settings: WorkerSettings, signal: KillSignal, decision: Decision | None, timeout: float
) -> None:
    record = signal.to_dict()
    key = settings.kill_signing_key()
    if key is not None:
        record = sign(record, key)
    producer = Producer(
        client_config(
            settings.bootstrap, settings.kafka, {"acks": "all", "enable.idempotence": True}
        )
    )
    errors: list[str] = []

    def delivered(error, message) -> None:
        if error is not None:
            errors.append(f"{message.topic()}: {error}")

    # A conversation's, an agent's or a tool's signals keep their order under their own key.
    trace_key = signal.topic_key()
    value = json.dumps(record, sort_keys=True).encode()
    producer.produce(settings.kill_topic, key=trace_key, value=value, on_delivery=delivered)
    if decision is not None:
        producer.produce(
            settings.detections_topic,
            key=trace_key,
            value=decision.to_json().encode(),
            on_delivery=delivered,
        )
    unsent = producer.flush(timeout)
    if unsent or errors:
        raise KafkaException(
            "; ".join(errors) or f"{unsent} records not acknowledged within {timeout}s"
        )
