"""`make soak`: 20-30 minutes of fleet traffic through the real pipeline under chaos.

A three-broker cluster of its own (scripts/kafka.sh cluster, free ports), the real Collector
(scripts/collector.sh, deploy/collector/config.yaml) and two `spanguard worker` processes on
their shipped defaults. The agents' spans are the benchmarks' fleet (bench/corpus.py: tool
calls with JSON arguments, chat spans with token usage, HTTP and retriever spans; one trace in
twenty loops), a fresh set of 1,000 traces every minute, sent to the Collector over OTLP/HTTP
in batches at `--rate` spans/s. Every `--chaos-every` seconds a chaos step SIGKILLs, in turn, a
worker (restarted at once from its data dir, as an orchestrator would) or a broker (restarted
10 s later from its data dir).

At the end (traffic stopped, the pipeline drained) it prints:
- kills expected (the detection core's own decisions over every request sent), sent (records
  on the kill topic), doubled (traces with two decisions), lost (expected, never sent), and
  false (sent for a trace the core would not kill);
- the workers' RSS after the warm-up and at the end (a slot whose worker was SIGKILLed is
  measured on its replacement);
- the longest consumer lag of the group over the input topic (end offsets minus committed,
  sampled every 5 s, the dead worker's partitions included) and how long it took from that peak
  to under a tenth of it;
- detection latency: the kill record's timestamp minus the time the request holding the
  tripping span was posted to the Collector, p50/p99 over the run.

The last line is one JSON object. Everything started is stopped and the cluster's data deleted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient

from bench.bench_pipeline import expected_kills, percentile
from bench.corpus import build_corpus
from tests.support.faults import (
    SHIPPED_PARTITIONS,
    KafkaCluster,
    RealCollector,
    rss_kib,
    shipped_worker,
)
from tests.support.kafka_harness import Collector, Topics, WorkerProcess

CHUNK_SECONDS = 60


class Traffic(threading.Thread):
    """Fresh corpora, posted at a steady rate; remembers when each tripping span was sent."""

    def __init__(self, collector: RealCollector, rate: float, seconds: float) -> None:
        super().__init__(daemon=True)
        self.collector = collector
        self.rate = rate
        self.seconds = seconds
        self.expected: dict[str, str] = {}  # trace id -> span id of its tripping span
        self.posted_at: dict[str, float] = {}  # tripping span id -> wall time posted
        self.spans = 0
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            started = time.monotonic()
            seed = random.randrange(1 << 30)
            while not self.stopping.is_set() and time.monotonic() - started < self.seconds:
                seed += 1
                corpus = build_corpus(
                    total_spans=int(self.rate * CHUNK_SECONDS), traces=1000, seed=seed
                )
                kills = expected_kills(corpus.requests)
                tripping = set(kills.values())
                self.expected.update(kills)
                chunk_start = time.monotonic()
                sent_in_chunk = 0
                for data in corpus.requests:
                    if self.stopping.is_set():
                        break
                    # Paced: this request leaves when the rate says it should.
                    wait = chunk_start + sent_in_chunk / self.rate - time.monotonic()
                    if wait > 0:
                        time.sleep(wait)
                    now = time.time()
                    self.collector.post(data)
                    ids = span_ids(data)
                    for span_id in ids & tripping:
                        self.posted_at[span_id] = now
                    sent_in_chunk += len(ids)
                    self.spans += len(ids)
        except BaseException as exc:
            self.error = exc


def span_ids(data: bytes) -> set[str]:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    request = ExportTraceServiceRequest.FromString(data)
    return {
        span.span_id.hex()
        for resource_spans in request.resource_spans
        for scope_spans in resource_spans.scope_spans
        for span in scope_spans.spans
    }


class LagMeter(threading.Thread):
    """The group's lag over the input topic: end offsets minus committed, every 5 s."""

    def __init__(self, bootstrap: str, group: str, topic: str) -> None:
        super().__init__(daemon=True)
        self.admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 2})
        self.consumer = Consumer(
            {"bootstrap.servers": bootstrap, "group.id": f"lag-{uuid.uuid4().hex}", "log_level": 2}
        )
        self.group = group
        self.topic = topic
        self.samples: list[tuple[float, int]] = []
        self.stopping = threading.Event()

    def read(self) -> int | None:
        from confluent_kafka import ConsumerGroupTopicPartitions

        partitions = [TopicPartition(self.topic, p) for p in range(SHIPPED_PARTITIONS)]
        try:
            future = self.admin.list_consumer_group_offsets(
                [ConsumerGroupTopicPartitions(self.group, partitions)]
            )[self.group]
            committed = {tp.partition: tp.offset for tp in future.result(10).topic_partitions}
            lag = 0
            for p in range(SHIPPED_PARTITIONS):
                _low, high = self.consumer.get_watermark_offsets(
                    TopicPartition(self.topic, p), timeout=10
                )
                lag += max(high - max(committed.get(p, 0), 0), 0)
            return lag
        except Exception:
            return None  # a broker down mid-read: the next sample counts

    def run(self) -> None:
        while not self.stopping.is_set():
            lag = self.read()
            if lag is not None:
                self.samples.append((time.monotonic(), lag))
            self.stopping.wait(5)
        self.consumer.close()

    def peak_and_drain(self) -> tuple[int, float | None]:
        if not self.samples:
            return 0, None
        peak_at, peak = max(self.samples, key=lambda s: s[1])
        for at, lag in self.samples:
            if at > peak_at and lag <= peak / 10:
                return peak, at - peak_at
        return peak, None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=25.0)
    parser.add_argument("--rate", type=float, default=2000.0, help="spans per second")
    parser.add_argument("--chaos-every", type=float, default=180.0, help="seconds")
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds before RSS is read")
    parser.add_argument(
        "--cluster-dir",
        help="a `scripts/kafka.sh cluster` data dir to use (started if needed) and leave running",
    )
    args = parser.parse_args()

    home = Path(tempfile.mkdtemp(prefix="spanguard-soak-"))
    kafka = KafkaCluster(Path(args.cluster_dir) if args.cluster_dir else home / "cluster")
    workers: list[WorkerProcess] = []
    otelcol: RealCollector | None = None
    kills: Collector | None = None
    lag: LagMeter | None = None
    traffic: Traffic | None = None
    chaos_log: list[str] = []
    try:
        kafka.up()
        print(f"soak: cluster up at {kafka.bootstrap}", flush=True)
        topics = Topics(cluster=kafka.cluster)
        workers = [shipped_worker(topics, home / f"worker-{n}").start(240) for n in range(2)]
        kills = Collector(topics.kills, cluster=kafka.cluster, log_level=2)
        otelcol = RealCollector(
            home / "otelcol", kafka.bootstrap.split(",")[0], topics.input, persistent=False
        ).up()
        lag = LagMeter(kafka.bootstrap, topics.app_id, topics.input)
        lag.start()
        traffic = Traffic(otelcol, args.rate, args.minutes * 60)
        started = time.monotonic()
        started_wall = time.time()
        traffic.start()
        print(f"soak: {args.rate:.0f} spans/s for {args.minutes:.0f} min, chaos every "
              f"{args.chaos_every:.0f} s", flush=True)  # fmt: skip

        time.sleep(args.warmup)
        rss_start = [rss_kib(w.process.pid) for w in workers]
        step = 0
        next_chaos = started + args.chaos_every
        while traffic.is_alive():
            time.sleep(1)
            if time.monotonic() < next_chaos:
                continue
            next_chaos += args.chaos_every
            if step % 2 == 0:
                slot = (step // 2) % len(workers)
                victim = workers[slot]
                victim.stop(signal.SIGKILL)
                workers[slot] = shipped_worker(topics, home / f"worker-{slot}").start(240)
                chaos_log.append(
                    f"{time.monotonic() - started:.0f}s worker {slot} SIGKILLed"
                    f" ({traffic.spans} spans sent so far)"
                )
            else:
                node = kafka.nodes[(step // 2) % len(kafka.nodes)]
                kafka.kill(node)
                time.sleep(10)
                kafka.start(node)
                chaos_log.append(
                    f"{time.monotonic() - started:.0f}s broker {node} SIGKILLed"
                    f" ({traffic.spans} spans sent so far)"
                )
            print(f"soak: {chaos_log[-1]}", flush=True)
            step += 1
        if traffic.error is not None:
            raise traffic.error

        # Drain: every expected kill, or two minutes at most.
        print(f"soak: traffic done ({traffic.spans} spans), draining", flush=True)
        deadline = time.monotonic() + 120
        wanted = set(traffic.expected)
        while time.monotonic() < deadline:
            got = {m["key"].decode() for m in kills.messages}
            if wanted <= got:
                break
            time.sleep(2)
        time.sleep(10)  # late duplicates, were there any
        rss_end = [rss_kib(w.process.pid) for w in workers]

        by_trace: dict[str, set[str]] = {}
        latencies = []
        for message in kills.messages:
            record = json.loads(message["value"])
            trace = message["key"].decode()
            by_trace.setdefault(trace, set()).add(record["signal_id"])
            span = record.get("evidence", {}).get("span_id")
            if trace in traffic.expected and span in traffic.posted_at:
                latencies.append(message["timestamp_ms"] / 1000 - traffic.posted_at[span])
        expected = len(traffic.expected)
        doubled = sum(len(ids) > 1 for ids in by_trace.values())
        lost = len(set(traffic.expected) - set(by_trace))
        false = len(set(by_trace) - set(traffic.expected))
        peak, drain = lag.peak_and_drain()
        # When were the lost kills' tripping spans posted, against the chaos steps?
        trips = {traffic.expected[t]: t for t in set(traffic.expected) - set(by_trace)}
        lost_posted = sorted(
            round(traffic.posted_at[span] - started_wall)
            for span in trips
            if span in traffic.posted_at
        )
        result = {
            "minutes": round((time.monotonic() - started) / 60, 1),
            "spans": traffic.spans,
            "rate": args.rate,
            "chaos": chaos_log,
            "kills_expected": expected,
            "kills_sent": len(kills.messages),
            "doubled": doubled,
            "lost": lost,
            "false": false,
            "lost_posted_s": lost_posted[:50],
            "rss_start_mib": [round(r / 1024) for r in rss_start],
            "rss_end_mib": [round(r / 1024) for r in rss_end],
            "max_lag": peak,
            "drain_s": None if drain is None else round(drain, 1),
            "latency_p50_s": round(percentile(latencies, 0.5), 3) if latencies else None,
            "latency_p99_s": round(percentile(latencies, 0.99), 3) if latencies else None,
            "cores": os.cpu_count(),
            "load_avg_1m": os.getloadavg()[0],
        }
        print(
            f"soak: {result['minutes']} min, {traffic.spans} spans; kills expected {expected},"
            f" sent {len(kills.messages)}, doubled {doubled}, lost {lost}, false {false};"
            f" RSS MiB start {result['rss_start_mib']} end {result['rss_end_mib']};"
            f" longest lag {peak} messages, drained in {result['drain_s']} s;"
            f" detection latency p50 {result['latency_p50_s']} s p99 {result['latency_p99_s']} s"
            f" ({os.cpu_count()} cores, load {result['load_avg_1m']:.1f})"
        )
        print(json.dumps(result))
        return 0 if doubled == 0 and lost == 0 else 1
    finally:
        if traffic is not None:
            traffic.stopping.set()
        if lag is not None:
            lag.stopping.set()
        if kills is not None:
            kills.close()
        if otelcol is not None:
            with contextlib.suppress(Exception):
                otelcol.down()
        for worker in workers:
            worker.stop()
        if args.cluster_dir:
            kafka.up()  # a node the chaos step stopped comes back; the cluster stays up
        else:
            kafka.down()


if __name__ == "__main__":
    sys.exit(main())
