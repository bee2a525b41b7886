"""One Faust setting that Faust does not expose: how long a Kafka fetch may wait for data.

faust-streaming 0.15.3 builds its aiokafka consumer with `fetch_max_wait_ms=1500` hard-coded.
The worker reads the busy input partitions and several nearly idle ones (repartition,
detections, goal checks, changelogs, Faust's leader topic), and aiokafka keeps one fetch in
flight per broker: when every busy partition still has records buffered, the next fetch names
only idle ones and the broker holds it for the full 1.5 s while new spans wait behind it.
A wait of 20 ms keeps those stalls out of the detection latency (bench/bench_pipeline.py's
figures for both waits: docs/performance.md, "Figures behind the code").
"""

from __future__ import annotations

from typing import Any

from faust.transport.drivers import aiokafka as faust_aiokafka

__all__ = ["set_fetch_max_wait"]

_original = faust_aiokafka.AIOKafkaConsumerThread._create_worker_consumer
_fetch_max_wait_ms: int | None = None


def _create_worker_consumer(self: Any, transport: Any) -> Any:
    consumer = _original(self, transport)
    if _fetch_max_wait_ms is not None:
        # aiokafka reads this attribute when the consumer starts, after construction.
        consumer._fetch_max_wait_ms = _fetch_max_wait_ms
    return consumer


def set_fetch_max_wait(milliseconds: int) -> None:
    """Make every worker consumer built from now on wait at most `milliseconds` per fetch."""
    global _fetch_max_wait_ms
    _fetch_max_wait_ms = milliseconds
    faust_aiokafka.AIOKafkaConsumerThread._create_worker_consumer = _create_worker_consumer  # type: ignore[method-assign]  # patched on purpose
