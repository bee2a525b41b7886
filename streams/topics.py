"""`spanguard topics create`: the topics the worker reads and writes, made with the admin API."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from spanguard.kafka_clients import ClientErrors, LibrdkafkaLog, wait_for_metadata
from spanguard.settings import WorkerSettings

__all__ = ["TopicSpec", "create_topics", "topic_specs"]

log = logging.getLogger("spanguard.topics")


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    config: dict[str, str]


def topic_specs(settings: WorkerSettings) -> list[TopicSpec]:
    """Input, repartition and the state changelog must share a partition count: a trace's
    messages and its state then live in the same partition number."""
    n = settings.partitions
    week = str(7 * 24 * 3600 * 1000)
    return [
        TopicSpec(settings.input_topic, n, {"retention.ms": str(24 * 3600 * 1000)}),
        TopicSpec(settings.repartition_topic, n, {"retention.ms": str(24 * 3600 * 1000)}),
        TopicSpec(settings.kill_topic, n, {"retention.ms": str(24 * 3600 * 1000)}),
        TopicSpec(settings.ack_topic, n, {"retention.ms": week}),
        TopicSpec(settings.goal_topic, n, {"retention.ms": str(24 * 3600 * 1000)}),
        TopicSpec(settings.detections_topic, n, {"retention.ms": week}),
        TopicSpec(settings.dead_letter_topic, n, {"retention.ms": week}),
        # Faust's table changelog: compacted, the latest state per trace is all it needs.
        TopicSpec(settings.changelog_topic, n, {"cleanup.policy": "compact"}),
    ]


def create_topics(settings: WorkerSettings, timeout: float = 30.0) -> dict[str, str]:
    """Create every topic; existing ones are left as they are. Returns name -> outcome."""
    errors = ClientErrors(settings.bootstrap)
    admin = AdminClient(
        {
            "bootstrap.servers": settings.bootstrap,
            **settings.kafka.confluent_config(),
            "error_cb": errors,
            "logger": LibrdkafkaLog(log),  # librdkafka's lines via logging, repeats dropped
        }
    )
    # A wrong password or an untrusted certificate ends here, at once (KafkaConnectError).
    wait_for_metadata(admin, errors, timeout=min(timeout, 15.0))
    specs = topic_specs(settings)
    futures = admin.create_topics(
        [
            NewTopic(spec.name, spec.partitions, settings.replication_factor, config=spec.config)
            for spec in specs
        ],
        request_timeout=timeout,
        operation_timeout=timeout,
    )
    outcomes: dict[str, str] = {}
    for name, future in futures.items():
        try:
            future.result(timeout=timeout)
            outcomes[name] = "created"
        except KafkaException as exc:
            error: KafkaError = exc.args[0]
            if error.code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
            outcomes[name] = "exists"
    metadata = admin.list_topics(timeout=timeout)
    for spec in specs:
        topic = metadata.topics.get(spec.name)
        if topic is None or outcomes.get(spec.name) == "created":
            continue  # just made with the right count (and maybe not in metadata yet)
        found = len(topic.partitions)
        if found != spec.partitions and spec.name != settings.kill_topic:
            log.warning(
                "topic %s has %d partitions, not %d: traces and their state may land in different partitions",
                spec.name,
                found,
                spec.partitions,
            )
    return outcomes
