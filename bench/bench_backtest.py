"""`spanguard backtest` over a topic of a million spans: records/s, peak RSS, and a bare
consume loop over the same topic in the same process as the baseline.

The topic is produced quickly: one synthetic fleet chunk (bench/corpus.py, one trace per
record, 1 to 3 spans a record) is built once and produced `--copies` times, each copy with
its own trace ids (the 16 id bytes swapped in the serialised record) and record times spread
over six days, half an hour of traffic per copy: each copy's traces go idle before the next
one starts, so the state TTL in record time is what keeps memory bounded.

The read runs in a child process (`--read TOPIC`), so its peak RSS is the read's own and not
the producer's. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import uuid

from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from bench.corpus import build_corpus
from spanguard.connectors.backtest import BATCH, read_history
from spanguard.detection.backtest import Backtest
from spanguard.schemas.policy import Policy
from tests.support.kafka_harness import BOOTSTRAP, CLUSTER, ensure_broker

DAY = 86_400
NEW_POLICY = """
defaults:
  loop: {threshold: 3}
  token_budget: 20000
"""


def peak_rss_mb() -> float:
    """This process's peak RSS. Linux keeps getrusage's ru_maxrss across fork and exec (a
    child starts with its parent's peak), so the memory map's own high-water mark is read
    where there is one (/proc/self/status VmHWM), getrusage elsewhere."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux, BSD: kB


def produce(topic: str, spans: int, copies: int, partitions: int) -> tuple[int, int, float]:
    """Create and fill the topic; (records, spans, seconds)."""
    admin = AdminClient(CLUSTER.config())
    config = {"retention.ms": str(14 * DAY * 1000)}
    for future in admin.create_topics([NewTopic(topic, partitions, 1, config=config)]).values():
        future.result(timeout=30)
    started = time.perf_counter()
    corpus = build_corpus(spans // copies, traces=2000, per_trace=True, message_spans=(1, 3))
    keyed = []
    for value in corpus.requests:
        # per_trace: one trace a record; its id is the first span's trace_id field.
        trace_id = _first_trace_id(value)
        keyed.append((trace_id, value))
    out = Producer(
        CLUSTER.config(
            **{
                "linger.ms": 50,
                "batch.size": 1_000_000,
                "compression.type": "lz4",
                "queue.buffering.max.messages": 500_000,
            }
        )
    )
    start = time.time() - 6 * DAY
    step = 1800.0 / len(keyed)  # half an hour of traffic per copy
    records = 0
    for copy in range(copies):
        base = start + copy * (6 * DAY / copies)
        for index, (trace_id, value) in enumerate(keyed):
            new_id = trace_id[:15] + bytes([trace_id[15] ^ copy])
            while True:
                try:
                    out.produce(
                        topic,
                        key=new_id.hex().encode(),
                        value=value.replace(trace_id, new_id) if copy else value,
                        timestamp=int((base + index * step) * 1000),
                    )
                    break
                except BufferError:
                    out.poll(0.1)
            records += 1
        out.poll(0)
    if out.flush(120) != 0:
        raise RuntimeError("records still undelivered after 120 s")
    return records, corpus.spans * copies, time.perf_counter() - started


def _first_trace_id(value: bytes) -> bytes:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    request = ExportTraceServiceRequest.FromString(value)
    return request.resource_spans[0].scope_spans[0].spans[0].trace_id


def bare_consume(topic: str) -> tuple[int, float]:
    """The floor: the same consumer settings, every record fetched and its value touched."""
    consumer = Consumer(
        CLUSTER.config(
            **{
                "group.id": f"bench-{uuid.uuid4().hex}",
                "enable.auto.commit": False,
                "enable.partition.eof": True,
                "queued.max.messages.kbytes": 16384,
            }
        )
    )
    partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
    ends = {}
    for p in partitions:
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
        if high > low:
            ends[p] = high
    consumer.assign([TopicPartition(topic, p, 0) for p in ends])
    count = size = 0
    started = time.perf_counter()
    while ends:
        for message in consumer.consume(BATCH, 0.5):
            if message.error() is not None:
                # (error() again: the same error, not None, which mypy cannot know.)
                if message.error().code() == KafkaError._PARTITION_EOF:  # type: ignore[union-attr]
                    ends.pop(message.partition(), None)
                continue
            count += 1
            # (confluent-kafka types these Optional; a consumed message without error has them.)
            size += len(message.value())  # type: ignore[arg-type]
            if message.offset() + 1 >= ends.get(message.partition(), 0):  # type: ignore[operator]
                ends.pop(message.partition(), None)
    seconds = time.perf_counter() - started
    consumer.close()
    return count, seconds


def read(topic: str) -> dict[str, float]:
    """The child: the backtest (its peak RSS is the process's, read right after), then the
    bare loop over the same topic, each timed."""
    rss_start = peak_rss_mb()
    backtest = Backtest(Policy.from_yaml(NEW_POLICY), Policy(), state_ttl=3600.0)
    started = time.perf_counter()
    read_history(BOOTSTRAP, CLUSTER.security, topic, 0, None, backtest, progress=False)
    report = backtest.finish()
    seconds = time.perf_counter() - started
    rss_backtest = peak_rss_mb()
    floor_records, floor_seconds = bare_consume(topic)
    return {
        "records": report.records,
        "spans": report.spans,
        "traces": report.traces,
        "decisions_new": report.decisions[0],
        "decisions_current": report.decisions[1],
        "added": report.added,
        "removed": report.removed,
        "evicted_early": report.evicted_early,
        "backtest_seconds": round(seconds, 2),
        "backtest_records_per_s": round(report.records / seconds),
        "backtest_spans_per_s": round(report.spans / seconds),
        "bare_consume_records_per_s": round(floor_records / floor_seconds),
        "ratio_to_bare_consume": round(
            (report.records / seconds) / (floor_records / floor_seconds), 3
        ),
        "rss_mb_before": round(rss_start, 1),
        "peak_rss_mb": round(rss_backtest, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=1_000_000)
    parser.add_argument("--copies", type=int, default=10)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--read", metavar="TOPIC", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.read:
        print(json.dumps(read(args.read)))
        return 0
    ensure_broker()
    topic = f"bench-backtest-{uuid.uuid4().hex[:8]}"
    try:
        records, spans, seconds = produce(topic, args.spans, args.copies, args.partitions)
        print(f"produced {records:,} records ({spans:,} spans) to {topic} in {seconds:.1f}s")
        child = subprocess.run(
            [sys.executable, "-m", "bench.bench_backtest", "--read", topic],
            capture_output=True,
            text=True,
            env={**os.environ, **CLUSTER.env()},
            timeout=3600,
        )
        if child.returncode != 0:
            print(child.stderr, file=sys.stderr)
            return 1
        result = json.loads(child.stdout.strip().splitlines()[-1])
        print(
            f"backtest: {result['records']:,} records ({result['spans']:,} spans) in"
            f" {result['backtest_seconds']}s: {result['backtest_records_per_s']:,} records/s,"
            f" {result['backtest_spans_per_s']:,} spans/s; bare consume loop"
            f" {result['bare_consume_records_per_s']:,} records/s (ratio"
            f" {result['ratio_to_bare_consume']}); peak RSS {result['peak_rss_mb']} MB"
            f" ({result['rss_mb_before']} MB before the read);"
            f" {result['traces']:,} traces, {result['added']:,} decisions added,"
            f" {result['removed']:,} removed"
        )
        print(json.dumps({"topic": topic, "produced_records": records, **result}))
        return 0
    finally:
        # Waited for: a client destroyed at once would drop the request.
        for future in AdminClient(CLUSTER.config()).delete_topics([topic]).values():
            future.result(timeout=60)


if __name__ == "__main__":
    sys.exit(main())
