"""`spanguard topics create`: the topics the worker reads and writes, made with the admin API."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, NewTopic

from spanguard.config.settings import WorkerSettings
from spanguard.connectors.kafka_clients import (
    ClientErrors,
    LibrdkafkaLog,
    client_config,
    wait_for_metadata,
)
from spanguard.errors import SettingsError

__all__ = [
    "Replication",
    "TopicSpec",
    "choose_replication",
    "cluster_replication",
    "create_topics",
    "scope_partitions_found",
    "topic_specs",
    "with_scope_partitions_found",
]

log = logging.getLogger("spanguard.topics")


@dataclass(frozen=True)
class Replication:
    """How many copies of each partition, and how many must have a write before it counts."""

    factor: int
    min_insync: int
    brokers: int
    chosen: bool  # picked for the cluster found (replication_factor 0), not set by the operator

    def describe(self) -> str:
        how = "chosen for" if self.chosen else "as set, on"
        return (
            f"replication factor {self.factor}, min.insync.replicas {self.min_insync}"
            f" ({how} {self.brokers} broker{'s' if self.brokers != 1 else ''})"
        )


def choose_replication(brokers: int, requested: int = 0) -> Replication:
    """`requested` 0: three copies where the cluster has three brokers or more, else one per
    broker. min.insync.replicas is one less than the factor (at least 1): with acks=all a
    write then survives the loss of any one broker, and one broker down still takes writes."""
    if brokers < 1:
        raise ValueError("the cluster reported no broker")
    if requested > brokers:
        raise ValueError(
            f"replication factor {requested} needs {requested} brokers, the cluster has {brokers}"
            " (SPANGUARD_REPLICATION_FACTOR=0 picks one that fits)"
        )
    factor = requested or min(3, brokers)
    return Replication(factor, max(1, factor - 1), brokers, chosen=requested == 0)


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    config: dict[str, str]


def topic_specs(settings: WorkerSettings) -> list[TopicSpec]:
    """Input, repartition and the state changelog must share a partition count: a trace's
    messages and its state then live in the same partition number. So must each scope's topic
    and its table's changelog (`scope_partitions`: fewer, as the scopes' records are few)."""
    n, scopes = settings.partitions, settings.scope_partitions
    week = str(7 * 24 * 3600 * 1000)
    return [
        TopicSpec(settings.input_topic, n, {"retention.ms": str(24 * 3600 * 1000)}),
        TopicSpec(settings.repartition_topic, n, {"retention.ms": str(24 * 3600 * 1000)}),
        TopicSpec(settings.kill_topic, n, {"retention.ms": str(24 * 3600 * 1000)}),
        TopicSpec(settings.ack_topic, n, {"retention.ms": week}),
        TopicSpec(settings.goal_topic, n, {"retention.ms": str(24 * 3600 * 1000)}),
        # Keyed by conversation id; its changelog follows the partition a record arrives on.
        TopicSpec(settings.conversation_topic, scopes, {"retention.ms": str(24 * 3600 * 1000)}),
        # Keyed by agent identity; its changelog follows the partition a record arrives on.
        TopicSpec(settings.agent_usage_topic, scopes, {"retention.ms": str(24 * 3600 * 1000)}),
        # Keyed by tool; its changelog follows the partition a record arrives on.
        TopicSpec(settings.tool_calls_topic, scopes, {"retention.ms": str(24 * 3600 * 1000)}),
        TopicSpec(settings.detections_topic, n, {"retention.ms": week}),
        TopicSpec(settings.dead_letter_topic, n, {"retention.ms": week}),
        # Faust's table changelog: compacted, the latest state per trace is all it needs.
        TopicSpec(settings.changelog_topic, n, {"cleanup.policy": "compact"}),
        TopicSpec(settings.conversation_changelog_topic, scopes, {"cleanup.policy": "compact"}),
        TopicSpec(settings.agent_window_changelog_topic, scopes, {"cleanup.policy": "compact"}),
        TopicSpec(settings.tool_window_changelog_topic, scopes, {"cleanup.policy": "compact"}),
    ]


def _connect(settings: WorkerSettings, timeout: float) -> tuple[AdminClient, Any]:
    errors = ClientErrors(settings.bootstrap)
    admin = AdminClient(
        client_config(
            settings.bootstrap,
            settings.kafka,
            {
                "error_cb": errors,
                "logger": LibrdkafkaLog(log),  # librdkafka's lines via logging, repeats dropped
            },
        )
    )
    # A wrong password or an untrusted certificate ends here, at once (KafkaConnectError).
    return admin, wait_for_metadata(admin, errors, timeout=min(timeout, 15.0))


def cluster_replication(settings: WorkerSettings, timeout: float = 15.0) -> Replication:
    """The replication `topics create` uses on the cluster `settings` point at."""
    _, cluster = _connect(settings, timeout)
    return choose_replication(len(cluster.brokers), settings.replication_factor)


def scope_partitions_found(settings: WorkerSettings, timeout: float = 15.0) -> int | None:
    """The partition count of the scope topics (the conversation and agent usage topics and
    their tables' changelogs) where some exist already: topics made before
    `scope_partitions`, or by hand, are used with the count they have, and the missing ones
    made to match. None when none exists; SettingsError when those that exist disagree."""
    _, cluster = _connect(settings, timeout)
    return _scope_partitions_in(settings, cluster)


def with_scope_partitions_found(
    settings: WorkerSettings, cluster: Any = None, timeout: float = 15.0
) -> WorkerSettings:
    """`settings` with the scope topics' count where some exist with another (topics made
    before `scope_partitions`, or by hand): the worker packs conversations for the partitions
    there are and its scope tables follow them, and `topics create` makes the missing ones
    with that count (a scope's topic and its changelog must share it). `cluster`: metadata
    already read, else read here."""
    if cluster is None:
        _, cluster = _connect(settings, timeout)
    found = _scope_partitions_in(settings, cluster)
    if found is None or found == settings.scope_partitions:
        return settings
    log.info(
        "the scope topics have %d partitions (SPANGUARD_SCOPE_PARTITIONS says %d for topics made"
        " new): %d are used, and given to the missing ones",
        found,
        settings.scope_partitions,
        found,
    )
    return replace(settings, scope_partitions=found)


def _scope_partitions_in(settings: WorkerSettings, cluster: Any) -> int | None:
    names = (
        settings.conversation_topic,
        settings.agent_usage_topic,
        settings.tool_calls_topic,
        settings.conversation_changelog_topic,
        settings.agent_window_changelog_topic,
        settings.tool_window_changelog_topic,
    )
    found = {
        name: len(cluster.topics[name].partitions)
        for name in names
        if name in cluster.topics and cluster.topics[name].partitions
    }
    if len(set(found.values())) > 1:  # a SettingsError: the worker's CLI says it in one line
        raise SettingsError(
            "the scope topics differ in partitions ("
            + ", ".join(f"{name}: {count}" for name, count in found.items())
            + "): recreate them with one count (SPANGUARD_SCOPE_PARTITIONS)"
        )
    return next(iter(found.values()), None)


def create_topics(
    settings: WorkerSettings, timeout: float = 30.0
) -> tuple[Replication, dict[str, str]]:
    """Create every topic; existing ones are left as they are. Returns the replication used
    and name -> outcome."""
    admin, cluster = _connect(settings, timeout)
    replication = choose_replication(len(cluster.brokers), settings.replication_factor)
    log.info("topics: %s", replication.describe())
    settings = with_scope_partitions_found(settings, cluster)
    specs = topic_specs(settings)
    futures = admin.create_topics(
        [
            NewTopic(
                spec.name,
                spec.partitions,
                replication.factor,
                config={**spec.config, "min.insync.replicas": str(replication.min_insync)},
            )
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
    return replication, outcomes
