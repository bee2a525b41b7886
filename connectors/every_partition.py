"""A daemon thread that reads every partition of one topic, as every worker must for records
that concern traces on other workers' partitions: the operators' releases on the kill topic
(connectors/releases.py) and the fleet incidents on the detections topic
(alerting/incident_reader.py).

No consumer group and no commits, like an agent's killswitch: on each start it goes back
`horizon` seconds (offsets by time), so a restarted worker sees what is still in force. A
subclass names what it keeps: `accept` one record (with the time it was appended to the log)
and `prune` what is older than the horizon, every PRUNE_INTERVAL seconds. The thread never
dies: an error costs a pause and a new start, and a record that makes `accept` raise costs that
record only.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition

from spanguard.config.settings import WorkerSettings
from spanguard.connectors.kafka_clients import (
    ClientErrors,
    LibrdkafkaLog,
    client_config,
    wait_for_metadata,
)

__all__ = ["PRUNE_INTERVAL", "EveryPartitionReader"]

# Seconds between two prunings of what is older than the horizon.
PRUNE_INTERVAL = 60.0


class EveryPartitionReader:
    """Reads `topic` from `horizon` seconds back on a daemon thread named `spanguard-<name>`;
    subclasses give `accept` and `prune`."""

    def __init__(
        self,
        settings: WorkerSettings,
        topic: str,
        name: str,
        log: logging.Logger,
        *,
        horizon: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.topic = topic
        self.horizon = horizon
        self.clock = clock
        self._name = name
        self._log = log
        self._errors = ClientErrors(settings.bootstrap)
        self._config = client_config(
            settings.bootstrap,
            settings.kafka,
            {
                "error_cb": self._errors,
                "logger": LibrdkafkaLog(log),
                "group.id": f"spanguard-{name}-{uuid.uuid4().hex}",  # never joins: assign()
                "enable.auto.commit": False,
                "fetch.wait.max.ms": 100,
            },
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"spanguard-{name}", daemon=True)

    def accept(self, value: bytes | None, appended_at: float) -> bool:
        """Take one record; True when it was one the reader keeps."""
        raise NotImplementedError

    def prune(self) -> int:
        """Forget what is older than the horizon; how many entries went."""
        raise NotImplementedError

    def start(self) -> EveryPartitionReader:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            consumer = Consumer(self._config)
            try:
                consumer.assign(self._start_positions(consumer))
                self._consume(consumer)
            # Never dies: an error costs a pause, then a new start.
            except Exception as exc:  # noqa: BLE001
                self._log.error("%s reader: %s; restarting in 5 s", self._name, exc)
                self._stop.wait(5.0)
            finally:
                consumer.close()

    def _start_positions(self, consumer: Consumer) -> list[TopicPartition]:
        """Every partition of the topic at its first record of the last `horizon` seconds (or
        its end, if it has none that recent)."""
        while True:
            try:
                metadata = wait_for_metadata(consumer, self._errors, self.topic, 15.0)
                topic = metadata.topics.get(self.topic)
                if topic is not None and topic.error is None and topic.partitions:
                    break
            except KafkaException as exc:
                self._log.debug(
                    "%s reader: %s not ready", self._name, self.topic, extra={"error": repr(exc)}
                )
            if self._stop.wait(2.0):
                return []
        since_ms = int((self.clock() - self.horizon) * 1000)
        wanted = [TopicPartition(self.topic, partition, since_ms) for partition in topic.partitions]
        return consumer.offsets_for_times(wanted, timeout=15.0)

    def _consume(self, consumer: Consumer) -> None:
        pruned_at = self.clock()
        while not self._stop.is_set():
            message: Any = consumer.poll(0.2)
            if self.clock() - pruned_at > PRUNE_INTERVAL:
                self.prune()
                pruned_at = self.clock()
            if message is None:
                continue
            if message.error():
                self._log.warning("%s reader: %s", self._name, message.error())
                continue
            _kind, timestamp_ms = message.timestamp()
            appended_at = timestamp_ms / 1000 if timestamp_ms > 0 else self.clock()
            try:
                self.accept(message.value(), appended_at)
            except Exception as exc:  # a bug costs one record, never the thread  # noqa: BLE001
                self._log.error("%s reader skipped a record: %r", self._name, exc)
