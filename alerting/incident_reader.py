"""Open fleet incidents, read by every worker from every partition of the detections topic.

A fleet incident's records (scope "tool") are keyed by the incident's trace id, so they land on
one partition, held by one worker; the traces decided on its tool land on every partition. So
each worker reads every partition of the detections topic (no consumer group, no commits, as the
release reader does the kill topic, connectors/releases.py) and notes the incidents it finds in
the paging agent's OpenIncidents: whichever worker holds a trace folds its page.

Only tool-scoped records matter: a look at the raw bytes skips the others before any JSON is
parsed. A record that looks tool-scoped but holds no decision is counted and skipped.

On start the reader goes back `horizon` seconds (a day, not the fleet window): an incident stays
open until its `recovered` record, however many windows that takes, so a worker restarted during
a long outage must still see the opening record. A day bounds what a start reads (the day's
detections, most skipped by the byte look); an incident open longer than that is forgotten by
every worker alike (`OpenIncidents.prune`), and its traces page one by one again.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition

from spanguard.alerting.incidents import OpenIncidents, is_incident
from spanguard.config.settings import WorkerSettings
from spanguard.connectors.kafka_clients import (
    ClientErrors,
    LibrdkafkaLog,
    client_config,
    wait_for_metadata,
)
from spanguard.outcomes import CountedOutcome, Tally
from spanguard.schemas.decision import Decision

__all__ = ["INCIDENT_HORIZON", "IncidentReader", "IncidentSkip"]

log = logging.getLogger("spanguard.alerting")

INCIDENT_HORIZON = 86_400.0  # seconds read back on start: the longest fleet window allowed
PRUNE_INTERVAL = 60.0  # seconds between two prunings of incidents older than the horizon
# Only a tool-scoped record has this (`"scope": "tool"`); a per-trace one names `tool_name`.
TOOL_SCOPED = b'"tool"'


class IncidentSkip(CountedOutcome):
    """Why a record of the detections topic that looked tool-scoped was skipped."""

    UNREADABLE = "unreadable"  # not JSON, or not a decision


class IncidentReader:
    """A daemon thread that notes every fleet incident's records in `incidents`."""

    def __init__(
        self,
        settings: WorkerSettings,
        incidents: OpenIncidents,
        *,
        horizon: float = INCIDENT_HORIZON,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.topic = settings.detections_topic
        self.incidents = incidents
        self.horizon = horizon
        self.clock = clock
        self._errors = ClientErrors(settings.bootstrap)
        self._config = client_config(
            settings.bootstrap,
            settings.kafka,
            {
                "error_cb": self._errors,
                "logger": LibrdkafkaLog(log),
                "group.id": f"spanguard-incidents-{uuid.uuid4().hex}",  # never joins: assign()
                "enable.auto.commit": False,
                "fetch.wait.max.ms": 100,
            },
        )
        self.read = 0  # incident records read
        self.skipped = Tally()  # by IncidentSkip
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spanguard-incidents", daemon=True)

    def start(self) -> IncidentReader:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def accept(self, value: bytes | None, appended_at: float) -> bool:
        """Take one record of the detections topic; True when it was an incident's record."""
        if value is None or TOOL_SCOPED not in value:
            return False
        try:
            decision = Decision.from_json(value)
        except ValueError as exc:
            if not self.skipped[IncidentSkip.UNREADABLE]:
                log.warning("detections topic: record skipped by the incident reader (%s)", exc)
            self.skipped.add(IncidentSkip.UNREADABLE)
            return False
        if not is_incident(decision):
            return False
        self.incidents.record(decision, noted_at=appended_at)
        self.read += 1
        return True

    def _run(self) -> None:
        while not self._stop.is_set():
            consumer = Consumer(self._config)
            try:
                consumer.assign(self._start_positions(consumer))
                self._consume(consumer)
            # Never dies: an error costs a pause, then a new start.
            except Exception as exc:  # noqa: BLE001
                log.error("incident reader: %s; restarting in 5 s", exc)
                self._stop.wait(5.0)
            finally:
                consumer.close()

    def _start_positions(self, consumer: Consumer) -> list[TopicPartition]:
        """Every partition of the detections topic at its first record of the last `horizon`
        seconds (or its end, if it has none that recent)."""
        while True:
            try:
                metadata = wait_for_metadata(consumer, self._errors, self.topic, 15.0)
                topic = metadata.topics.get(self.topic)
                if topic is not None and topic.error is None and topic.partitions:
                    break
            except KafkaException as exc:
                log.debug("incident reader: topic not ready", extra={"error": repr(exc)})
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
                self.incidents.prune(self.clock() - self.horizon)
                pruned_at = self.clock()
            if message is None:
                continue
            if message.error():
                log.warning("incident reader: %s", message.error())
                continue
            _kind, timestamp_ms = message.timestamp()
            appended_at = timestamp_ms / 1000 if timestamp_ms > 0 else self.clock()
            try:
                self.accept(message.value(), appended_at)
            except Exception as exc:  # a bug costs one record, never the thread  # noqa: BLE001
                log.error("incident reader skipped a record: %r", exc)
