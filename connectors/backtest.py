"""Reading the spans topic's retained history for `spanguard backtest`.

Every partition is read from the first offset at or after the start time (offsets_for_times)
to the end offsets taken when the read starts (or those of the end time): a consumer with no
group, that commits nothing, so the worker's offsets and its state are untouched. What is read
goes through spanguard/detection/backtest.py, which holds no Kafka.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TextIO

from confluent_kafka import Consumer, KafkaError, TopicPartition

from spanguard.config.kafka_security import KafkaSecurity
from spanguard.connectors.kafka_clients import (
    ClientErrors,
    reading,
    throwaway_reader,
    wait_for_metadata,
)
from spanguard.detection.backtest import Backtest
from spanguard.errors import BacktestError
from spanguard.progress import ProgressLine

__all__ = ["ReadPlan", "plan_read", "read_history"]

log = logging.getLogger(__name__)

BATCH = 1000  # records per consume() call
# Seconds to wait for the first record of a partition when probing its oldest record time.
PROBE_TIMEOUT = 10.0
# Beyond this many records a start line says what the read costs.
LARGE_HISTORY = 5_000_000


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="seconds")


@dataclass
class ReadPlan:
    """What will be read: per partition, [start, end) offsets."""

    topic: str
    start_ms: int
    end_ms: int | None
    ranges: dict[int, tuple[int, int]] = field(default_factory=dict)
    # The oldest record time retained, when the start lies before it (probed), else None.
    oldest_ms: int | None = None
    # Records before the oldest offset were deleted (retention), not merely never written.
    truncated: bool = False

    @property
    def total(self) -> int:
        return sum(end - start for start, end in self.ranges.values())


def _consumer(bootstrap: str, security: KafkaSecurity, errors: ClientErrors) -> Consumer:
    properties = {
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",
        # A bounded prefetch: the read's memory does not grow with the topic's size.
        "queued.max.messages.kbytes": 16384,
    }
    return throwaway_reader(bootstrap, security, errors, "backtest", log, properties)


def plan_read(
    consumer: Consumer,
    errors: ClientErrors,
    topic: str,
    start_ms: int,
    end_ms: int | None,
    timeout: float = 15.0,
) -> ReadPlan:
    """The offsets to read; BacktestError when the topic does not exist."""
    metadata = wait_for_metadata(consumer, errors, topic, timeout)
    described = metadata.topics.get(topic)
    if described is None or described.error is not None or not described.partitions:
        raise BacktestError(
            f"topic {topic} does not exist at {errors.bootstrap} (is --input-topic right?)"
        )
    partitions = sorted(described.partitions)
    plan = ReadPlan(topic, start_ms, end_ms)
    starts = consumer.offsets_for_times(
        [TopicPartition(topic, p, start_ms) for p in partitions], timeout=timeout
    )
    ends = (
        consumer.offsets_for_times(
            [TopicPartition(topic, p, end_ms) for p in partitions], timeout=timeout
        )
        if end_ms is not None
        else None
    )
    at_oldest = []
    for index, partition in enumerate(partitions):
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout)
        start = starts[index].offset
        start = high if start < 0 else start  # no record at or after the start time
        end = high
        if ends is not None and ends[index].offset >= 0:
            end = ends[index].offset  # the first record at or after the end time: excluded
        if end > start:
            plan.ranges[partition] = (start, end)
        if start == low and high > low:
            at_oldest.append((partition, low))
            plan.truncated = plan.truncated or low > 0
    if at_oldest:
        plan.oldest_ms = _oldest_time(consumer, topic, at_oldest)
        if plan.oldest_ms is not None and plan.oldest_ms <= start_ms:
            plan.oldest_ms = None  # the start lies within what is retained
    return plan


def _oldest_time(consumer: Consumer, topic: str, firsts: list[tuple[int, int]]) -> int | None:
    """The oldest record time among the first retained record of these partitions."""
    consumer.assign([TopicPartition(topic, p, offset) for p, offset in firsts])
    waiting = {p for p, _ in firsts}
    oldest: int | None = None
    deadline = time.monotonic() + PROBE_TIMEOUT
    try:
        while waiting and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is None or message.error() is not None:
                continue
            if message.partition() in waiting:
                waiting.discard(message.partition())
                stamp = message.timestamp()[1]
                if stamp >= 0:
                    oldest = stamp if oldest is None else min(oldest, stamp)
    finally:
        consumer.unassign()
    return oldest


class _Progress(ProgressLine):
    """Records read of how many, the rate and the time left, on one line of a terminal."""

    def __init__(self, stream: TextIO, total: int, enabled: bool) -> None:
        super().__init__(stream, enabled, every=0.5)
        self.total = total
        self.started = time.monotonic()

    def update(self, done: int) -> None:
        if not self.due():
            return
        elapsed = max(time.monotonic() - self.started, 1e-6)
        rate = done / elapsed
        left = (self.total - done) / rate if rate > 0 else 0.0
        share = done / self.total if self.total else 1.0
        minutes, seconds = divmod(int(left), 60)
        self.draw(
            f"backtest: {done:,} of {self.total:,} records ({share:4.0%}),"
            f" {rate:,.0f} records/s, {minutes}:{seconds:02d} left   "
        )


def read_history(
    bootstrap: str,
    security: KafkaSecurity,
    topic: str,
    start_ms: int,
    end_ms: int | None,
    backtest: Backtest,
    *,
    stderr: TextIO | None = None,
    progress: bool | None = None,
    timeout: float = 15.0,
    on_plan: Callable[[ReadPlan], None] | None = None,
) -> ReadPlan:
    """Feed every record of `topic` between the two times to `backtest`; return the plan read.

    Progress goes to `stderr` when it is a terminal (or `progress` says so)."""
    err = stderr or sys.stderr
    errors = ClientErrors(bootstrap, security)
    consumer = _consumer(bootstrap, security, errors)
    with reading(consumer, topic, bootstrap, BacktestError):
        plan = plan_read(consumer, errors, topic, start_ms, end_ms, timeout)
        if on_plan is not None:
            on_plan(plan)
        if not plan.ranges:
            return plan
        bar = _Progress(err, plan.total, err.isatty() if progress is None else progress)
        try:
            _consume(consumer, plan, backtest, bar, timeout)
        finally:
            bar.close()
        return plan


def _consume(
    consumer: Consumer, plan: ReadPlan, backtest: Backtest, bar: _Progress, timeout: float
) -> None:
    topic = plan.topic
    ends = {p: end for p, (_, end) in plan.ranges.items()}
    consumer.assign([TopicPartition(topic, p, start) for p, (start, _) in plan.ranges.items()])
    feed = backtest.feed
    done = 0
    idle_since = time.monotonic()
    while ends:
        messages = consumer.consume(BATCH, 0.5)
        if not messages:
            if time.monotonic() - idle_since > max(timeout, 30.0):
                raise BacktestError(
                    f"{topic}: no record for {max(timeout, 30.0):.0f}s with"
                    f" {sum(ends.values())} offsets still to read (partitions"
                    f" {sorted(ends)}); was the topic deleted or truncated during the read?"
                )
            continue
        idle_since = time.monotonic()
        for message in messages:
            # (confluent-kafka types partition() and offset() Optional: a consumed message,
            # an end-of-partition event among them, has both.)
            partition: int = message.partition()  # type: ignore[assignment]
            error = message.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    # The end of what is there (transaction markers may stop short of `end`).
                    if partition in ends and message.offset() >= ends[partition] - 1:  # type: ignore[operator]
                        _finish(consumer, topic, ends, partition)
                    continue
                raise BacktestError(f"{topic} partition {partition}: {error.str()}")
            end = ends.get(partition)
            if end is None:
                continue  # read past its end in the same batch
            offset: int = message.offset()  # type: ignore[assignment]
            if offset >= end:
                _finish(consumer, topic, ends, partition)
                continue
            stamp = message.timestamp()[1]
            feed(partition, message.key(), message.value(), stamp / 1000 if stamp >= 0 else 0.0)
            done += 1
            if offset + 1 >= end:
                _finish(consumer, topic, ends, partition)
        bar.update(done)


def _finish(consumer: Consumer, topic: str, ends: dict[int, int], partition: int) -> None:
    if ends.pop(partition, None) is not None:
        consumer.incremental_unassign([TopicPartition(topic, partition)])


def describe_plan(plan: ReadPlan, requested_ms: int) -> list[str]:
    """The lines said before the read: what is read, and whether the start was retained."""
    lines = []
    if plan.oldest_ms is not None:
        # The first retained record of each partition: the history's start, as far as record
        # times grow with offsets (they do for a Collector's records).
        why = (
            "its retention deleted older records" if plan.truncated else "nothing older was written"
        )
        lines.append(
            f"backtest: {plan.topic} holds records from {_iso(plan.oldest_ms)} on ({why}),"
            f" not from {_iso(requested_ms)}: the whole retained history is read"
        )
    until = _iso(plan.end_ms) if plan.end_ms is not None else "now"
    lines.append(
        f"backtest: reading {plan.total:,} records of {plan.topic} ({len(plan.ranges)} of its"
        f" partitions with records), record times from {_iso(requested_ms)} to {until}"
    )
    if plan.total > LARGE_HISTORY:
        lines.append(
            f"backtest: {plan.total:,} records is a long read (this machine's benchmark:"
            " `make bench-backtest`); memory stays bounded (--state-ttl, --max-traces)"
        )
    return lines
