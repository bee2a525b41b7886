"""Reading the detections audit back: one trace's decisions, or one tool's fleet incidents,
for `spanguard explain`.

The topic is keyed by trace id, but which partition a key lands on depends on the producer's
partitioner (the worker's aiokafka uses murmur2; another producer may not), so every
partition is read from its first offset up to the end offsets taken at the start.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

from spanguard.config.kafka_security import KafkaSecurity
from spanguard.connectors.kafka_clients import (
    ClientErrors,
    reading,
    throwaway_reader,
    wait_for_metadata,
)
from spanguard.errors import AuditReadError

__all__ = ["AuditScan", "read_decisions", "read_tool_incidents"]

log = logging.getLogger(__name__)


@dataclass
class AuditScan:
    """What a scan found: the trace's records in topic order, and what it read to find them."""

    records: list[dict[str, Any]] = field(default_factory=list)
    scanned: int = 0
    unreadable: int = 0  # records under the key that are not JSON objects


# Which records a scan keeps: by key and raw value (a cheap look before the JSON is parsed),
# then by the parsed record.
Wanted = Callable[[bytes | None, bytes | None], bool]
Kept = Callable[[dict[str, Any]], bool]


def read_decisions(
    bootstrap: str,
    security: KafkaSecurity,
    topic: str,
    trace_id: str,
    timeout: float = 30.0,
) -> AuditScan:
    """Every record of `topic` keyed by `trace_id`; AuditReadError if the topic is not there,
    KafkaConnectError if the cluster refuses the connection or does not answer."""
    key = trace_id.lower().encode()
    return _read(bootstrap, security, topic, lambda k, _v: k == key, None, timeout)


def read_tool_incidents(
    bootstrap: str,
    security: KafkaSecurity,
    topic: str,
    tool: str,
    server: str | None = None,
    timeout: float = 30.0,
) -> AuditScan:
    """Every fleet incident record (scope "tool") of `topic` on `tool` (and `server`, if
    given), in topic order per partition; the errors of `read_decisions`."""

    def wanted(_key: bytes | None, value: bytes | None) -> bool:
        return value is not None and b'"tool"' in value  # only a tool-scoped record has it

    def kept(record: dict[str, Any]) -> bool:
        if record.get("scope") != "tool" or record.get("tool") != tool:
            return False
        return server is None or record.get("server") == server

    return _read(bootstrap, security, topic, wanted, kept, timeout)


def _read(
    bootstrap: str,
    security: KafkaSecurity,
    topic: str,
    wanted: Wanted,
    kept: Kept | None,
    timeout: float,
) -> AuditScan:
    errors = ClientErrors(bootstrap, security)
    consumer = throwaway_reader(bootstrap, security, errors, "explain", log)
    with reading(consumer, topic, bootstrap, AuditReadError):
        return _scan(consumer, errors, topic, wanted, kept, timeout)


def _scan(
    consumer: Consumer,
    errors: ClientErrors,
    topic: str,
    wanted: Wanted,
    kept: Kept | None,
    timeout: float,
) -> AuditScan:
    metadata = wait_for_metadata(consumer, errors, topic, min(timeout, 15.0)).topics.get(topic)
    if metadata is None or metadata.error is not None or not metadata.partitions:
        raise AuditReadError(f"topic {topic} does not exist (is --detections-topic right?)")
    ends = {}
    for partition in metadata.partitions:
        low, high = consumer.get_watermark_offsets(
            TopicPartition(topic, partition), timeout=timeout
        )
        if high > low:
            ends[partition] = high
    scan = AuditScan()
    if not ends:
        return scan
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in ends])
    deadline = time.monotonic() + timeout
    while ends:
        if time.monotonic() > deadline:
            raise AuditReadError(
                f"{topic}: not read to its end in {timeout:.0f}s"
                f" ({scan.scanned} records read); raise --timeout"
            )
        message = consumer.poll(0.5)
        if message is None:
            continue
        partition = message.partition()
        error = message.error()
        if error is not None:
            if error.code() == KafkaError._PARTITION_EOF:
                ends.pop(partition, None)
                continue
            raise AuditReadError(f"{topic}: {error}")
        scan.scanned += 1
        if wanted(message.key(), message.value()):
            try:
                # A tombstone's None raises TypeError: counted unreadable below.
                record = json.loads(message.value())  # type: ignore[arg-type]
            except (TypeError, ValueError):
                record = None
            if not isinstance(record, dict):
                scan.unreadable += 1
            elif kept is None or kept(record):
                scan.records.append(record)
        # (confluent-kafka types offset() Optional; a consumed message without error has one.)
        if message.offset() + 1 >= ends.get(partition, 0):  # type: ignore[operator]
            ends.pop(partition, None)
    return scan
