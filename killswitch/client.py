"""The agent side: a background consumer of agent-kill-signals and a `check()` before each step.

    switch = KillSwitch(bootstrap_servers="kafka:9092", signing_key=b"...")
    ...
    message = switch.check()      # raises AgentKilled once this trace is killed
    if message:                   # a downgrade: hand the model this system message
        messages.append({"role": "system", "content": message})

The consumer starts at the latest offsets (signals sent before this process started are about
other processes' traces) and keeps every signal in a bounded SignalBook, so a signal that
arrives between two `check()` calls is never lost. `check()` takes a lock and reads memory: it
is safe from threads and from asyncio code, and never blocks on Kafka.

TLS and SASL come from `security=` (a `KafkaSecurity`), by default from the same
SPANGUARD_KAFKA_* variables the worker reads. A wrong password or an untrusted certificate makes
`start()` raise `KafkaConnectError` at once, instead of waiting for a broker that will never
let it in.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from spanguard.kafka_clients import ClientErrors, LibrdkafkaLog, wait_for_metadata
from spanguard.kafka_security import KafkaSecurity
from spanguard.killswitch.signals import SignalBook, current_trace_id
from spanguard.schemas.decision import KillSignal, signature_valid

__all__ = ["KillSwitch"]

# What a topic reports while it is being created or its leaders elected.
_SETTLING = frozenset(
    {
        KafkaError.UNKNOWN_TOPIC_OR_PART,
        KafkaError.LEADER_NOT_AVAILABLE,
        KafkaError.NOT_LEADER_FOR_PARTITION,
        KafkaError._TIMED_OUT,
        KafkaError._TRANSPORT,
    }
)

log = logging.getLogger("spanguard.killswitch")


class KillSwitch:
    def __init__(
        self,
        bootstrap_servers: str,
        topic: str = "agent-kill-signals",
        *,
        signing_key: bytes | str | None = None,
        signals: SignalBook | None = None,
        consumer_config: dict[str, Any] | None = None,
        security: KafkaSecurity | None = None,
        start: bool = True,
    ) -> None:
        self.topic = topic
        self.security = security if security is not None else KafkaSecurity.from_env()
        self._errors = ClientErrors(bootstrap_servers)
        self.signals = signals if signals is not None else SignalBook()
        self._key = signing_key.encode() if isinstance(signing_key, str) else signing_key
        self._config = {
            "bootstrap.servers": bootstrap_servers,
            **self.security.confluent_config(),
            "error_cb": self._on_error,
            "logger": LibrdkafkaLog(log),  # librdkafka's lines via logging, repeats dropped
            # Every process reads every partition itself: no group, no rebalance, no commits.
            "group.id": f"spanguard-killswitch-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "fetch.wait.max.ms": 50,
            **(consumer_config or {}),
        }
        self.received = 0
        self.rejected = 0  # unsigned or forged, when a signing key is set
        self.malformed = 0
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._error: Exception | None = None
        self._thread = threading.Thread(target=self._run, name="spanguard-killswitch", daemon=True)
        if start:
            self.start()

    def start(self, timeout: float = 30.0) -> KillSwitch:
        """Start the consumer and wait until it is positioned at the latest offsets."""
        self._thread.start()
        if not self._ready.wait(timeout):
            raise TimeoutError(f"kill-signal consumer not ready in {timeout}s")
        if self._error is not None:
            raise self._error
        return self

    def check(self, trace_id: str | None = None) -> str | None:
        """Raise AgentKilled if the trace (default: the current span's) was killed; return a
        downgrade's system message once; else None."""
        trace_id = trace_id or current_trace_id()
        if trace_id is None:
            return None
        return self.signals.check(trace_id)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def __enter__(self) -> KillSwitch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _on_error(self, error: Any) -> None:
        refused = self._errors.refused
        self._errors(error)
        if refused is None and self._errors.refused is not None and self._ready.is_set():
            # Once, not per reconnect: the credentials or certificate changed under us.
            log.error("kill-signal consumer: %s", self._errors.refused)

    def _run(self) -> None:
        consumer = Consumer(self._config)
        try:
            consumer.assign(self._end_positions(consumer))
        except Exception as exc:
            self._error = exc
            self._ready.set()
            consumer.close()
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                message = consumer.poll(0.1)
                if message is None:
                    continue
                if message.error():
                    log.warning("kill-signal consumer: %s", message.error())
                    continue
                self._accept(message.value())
        finally:
            consumer.close()

    def _end_positions(self, consumer: Consumer, timeout: float = 15.0) -> list[TopicPartition]:
        """Every partition at its end offset, resolved now (not OFFSET_END at the first fetch):
        every signal sent after start() returns is seen. A topic that was just created may
        not have its leaders yet: retriable errors are retried until `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                # Raises KafkaConnectError at once on a refused password or certificate.
                remaining = max(0.5, deadline - time.monotonic())
                metadata = wait_for_metadata(consumer, self._errors, self.topic, remaining)
                topic = metadata.topics.get(self.topic)
                if topic is None or not topic.partitions:
                    raise KafkaException(
                        KafkaError(
                            KafkaError.UNKNOWN_TOPIC_OR_PART, f"topic {self.topic!r} not found"
                        )
                    )
                if topic.error is not None:
                    raise KafkaException(topic.error)
                positions = []
                for partition in topic.partitions:
                    _low, high = consumer.get_watermark_offsets(
                        TopicPartition(self.topic, partition), timeout=timeout
                    )
                    positions.append(TopicPartition(self.topic, partition, high))
                return positions
            except KafkaException as exc:
                error = exc.args[0] if exc.args else None
                retriable = isinstance(error, KafkaError) and (
                    error.retriable() or error.code() in _SETTLING
                )
                if not retriable or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def _accept(self, value: bytes | None) -> None:
        self.received += 1
        try:
            record = json.loads(value or b"")
            signal = KillSignal.from_dict(record)
        except (ValueError, TypeError, KeyError) as exc:
            self.malformed += 1
            log.warning("ignored a malformed kill signal: %s", exc)
            return
        if self._key is not None and not signature_valid(record, self._key):
            self.rejected += 1
            log.warning("ignored an unsigned or forged kill signal for trace %s", signal.trace_id)
            return
        self.signals.deliver(signal)
