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
  sampled every 5 s, the dead worker's partitions included), how long it took from that peak
  to under a tenth of it, and how long the pipeline took to drain once the traffic stopped
  (`--drain` s at most; the lag left then is printed, and kills still unread count as lost);
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
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, TopicPartition
from prometheus_client.parser import text_string_to_metric_families

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


def make_chunk(seed: int, spans: int) -> tuple[list[tuple[bytes, set[str]]], dict[str, str]]:
    """One minute of the fleet (fresh trace ids), each request with its span ids, and the
    kills the detection core makes over it (trace id -> tripping span id)."""
    corpus = build_corpus(total_spans=spans, traces=1000, seed=seed)
    return [(data, span_ids(data)) for data in corpus.requests], expected_kills(corpus.requests)


class Traffic(threading.Thread):
    """Fresh corpora, posted at a steady rate; remembers when each tripping span was sent.
    The next minute is built in another process while this one is posted, so the rate holds."""

    def __init__(self, collector: RealCollector, rate: float, seconds: float) -> None:
        super().__init__(daemon=True)
        self.collector = collector
        self.rate = rate
        self.seconds = seconds
        self.expected: dict[str, str] = {}  # trace id -> span id of its tripping span
        self.posted_at: dict[str, float] = {}  # tripping span id -> wall time posted
        self.spans = 0
        self.posting_seconds = 0.0
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        from concurrent.futures import ProcessPoolExecutor

        try:
            seed = random.randrange(1 << 30)
            per_chunk = int(self.rate * CHUNK_SECONDS)
            with ProcessPoolExecutor(max_workers=1) as pool:
                upcoming = pool.submit(make_chunk, seed, per_chunk)
                started = time.monotonic()
                while not self.stopping.is_set() and time.monotonic() - started < self.seconds:
                    requests, kills = upcoming.result()
                    seed += 1
                    upcoming = pool.submit(make_chunk, seed, per_chunk)
                    self._post(requests, kills)
                self.posting_seconds = time.monotonic() - started
                upcoming.cancel()
        # Any failure of the traffic thread is handed to the main thread, which reports it.
        except BaseException as exc:  # noqa: BLE001
            self.error = exc

    def _post(self, requests: list[tuple[bytes, set[str]]], kills: dict[str, str]) -> None:
        tripping = set(kills.values())
        chunk_start = time.monotonic()
        sent_in_chunk = 0
        for data, ids in requests:
            if self.stopping.is_set():
                return
            # Paced: this request leaves when the rate says it should.
            wait = chunk_start + sent_in_chunk / self.rate - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            now = time.time()
            self.collector.post(data)
            for span_id in ids & tripping:
                self.posted_at[span_id] = now
            sent_in_chunk += len(ids)
            self.spans += len(ids)
        # Only what was posted is expected: a chunk cut short by a stop counts its part.
        self.expected.update({t: s for t, s in kills.items() if s in self.posted_at})


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
    """The group's lag over the input topic: end offsets minus committed, every 5 s, read with
    one plain consumer that never joins the group (librdkafka's admin client crashed this
    process once here, mid broker restart)."""

    def __init__(self, bootstrap: str, group: str, topic: str) -> None:
        super().__init__(daemon=True)
        self.bootstrap = bootstrap
        self.group = group
        self.topic = topic
        self.samples: list[tuple[float, int]] = []
        self.stopping = threading.Event()

    def read(self, consumer: Consumer) -> int | None:
        partitions = [TopicPartition(self.topic, p) for p in range(SHIPPED_PARTITIONS)]
        try:
            committed = {tp.partition: tp.offset for tp in consumer.committed(partitions, 10)}
            lag = 0
            for p in range(SHIPPED_PARTITIONS):
                _low, high = consumer.get_watermark_offsets(
                    TopicPartition(self.topic, p), timeout=10
                )
                lag += max(high - max(committed.get(p, 0), 0), 0)
            return lag
        except Exception:  # a broker down mid-read: the next sample counts  # noqa: BLE001
            return None  # a broker down mid-read: the next sample counts

    def run(self) -> None:
        consumer = Consumer(
            {
                "bootstrap.servers": self.bootstrap,
                "group.id": self.group,  # only to read its committed offsets: never subscribes
                "enable.auto.commit": False,
                "log_level": 2,
            }
        )
        while not self.stopping.is_set():
            lag = self.read(consumer)
            if lag is not None:
                self.samples.append((time.monotonic(), lag))
            self.stopping.wait(5)
        consumer.close()

    def peak_and_drain(self) -> tuple[int, float | None]:
        if not self.samples:
            return 0, None
        peak_at, peak = max(self.samples, key=lambda s: s[1])
        for at, lag in self.samples:
            if at > peak_at and lag <= peak / 10:
                return peak, at - peak_at
        return peak, None


def memory_parts(worker: WorkerProcess) -> list[int] | None:
    """What the settings bound of the worker's memory: RocksDB's (spanguard_table_memory_bytes,
    every table and kind) in MiB, and the decoded states it caches (spanguard_cached_traces,
    at most SPANGUARD_STATE_CACHE). None if /metrics does not answer."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{worker.port}/metrics", timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return None
    rocksdb = cached = 0.0
    for family in text_string_to_metric_families(text):
        if family.name == "spanguard_table_memory_bytes":
            rocksdb += sum(sample.value for sample in family.samples)
        elif family.name == "spanguard_cached_traces":
            cached += sum(sample.value for sample in family.samples)
    return [round(rocksdb / 2**20), round(cached)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=25.0)
    parser.add_argument("--rate", type=float, default=2000.0, help="spans per second")
    parser.add_argument("--chaos-every", type=float, default=180.0, help="seconds")
    parser.add_argument("--warmup", type=float, default=60.0, help="seconds before RSS is read")
    parser.add_argument(
        "--drain", type=float, default=600.0, help="seconds to wait after the traffic at most"
    )
    parser.add_argument(
        "--state-ttl",
        type=float,
        help="SPANGUARD_STATE_TTL for the workers (default: the shipped hour). Shorter, the"
        " run sees idle traces evicted and so whether memory levels off",
    )
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

        def soak_worker(slot: int) -> WorkerProcess:
            worker = shipped_worker(topics, home / f"worker-{slot}")
            if args.state_ttl is not None:
                worker.env["SPANGUARD_STATE_TTL"] = str(args.state_ttl)
            return worker

        workers = [soak_worker(n).start(240) for n in range(2)]
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
        # (The harness started it above: its process is set.)
        rss_start = [rss_kib(w.process.pid) for w in workers]  # type: ignore[union-attr]
        # Each minute: seconds since the start and each slot's RSS in MiB (a replaced worker's
        # from its replacement): memory that levels off, or not.
        rss_series: list[list[int]] = []
        # Each minute, likewise: RocksDB's share of it in MiB (memtables, block cache, table
        # readers) and the decoded states cached, [MiB, traces] per slot.
        memory_series: list[list[Any]] = []
        next_rss = time.monotonic()
        step = 0
        next_chaos = started + args.chaos_every
        while traffic.is_alive():
            time.sleep(1)
            if time.monotonic() >= next_rss:
                next_rss += 60
                with contextlib.suppress(OSError):  # a worker replaced this very second
                    # (The harness started it above: its process is set.)
                    rss = [round(rss_kib(w.process.pid) / 1024) for w in workers]  # type: ignore[union-attr]
                    rss_series.append([round(time.monotonic() - started), *rss])
                memory_series.append(
                    [round(time.monotonic() - started), *map(memory_parts, workers)]
                )
            if time.monotonic() < next_chaos:
                continue
            next_chaos += args.chaos_every
            if step % 2 == 0:
                slot = (step // 2) % len(workers)
                victim = workers[slot]
                victim.stop(signal.SIGKILL)
                # Its replacement replays its partitions' changelog first: minutes on a busy
                # machine with a backlog.
                workers[slot] = soak_worker(slot).start(900)
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
            peak_so_far = max((sample for _at, sample in lag.samples), default=0)
            print(
                f"soak: {chaos_log[-1]}; kills so far {len(kills.messages)},"
                f" longest lag so far {peak_so_far}",
                flush=True,
            )
            step += 1
        if traffic.error is not None:
            raise traffic.error

        # Drain: every expected kill, or the group's lag gone and 30 s more, or --drain s.
        print(f"soak: traffic done ({traffic.spans} spans), draining", flush=True)
        traffic_done = time.monotonic()
        deadline = traffic_done + args.drain
        wanted = set(traffic.expected)
        caught_up: float | None = None
        while time.monotonic() < deadline:
            got = {m["key"].decode() for m in kills.messages}
            if wanted <= got:
                break
            last = lag.samples[-1] if lag.samples else None
            if last is not None and last[0] > traffic_done and last[1] == 0:
                caught_up = caught_up or time.monotonic()
                if time.monotonic() - caught_up > 30:
                    break
            time.sleep(2)
        drained_in = time.monotonic() - traffic_done
        time.sleep(10)  # late duplicates, were there any
        # (The harness started it above: its process is set.)
        rss_end = [rss_kib(w.process.pid) for w in workers]  # type: ignore[union-attr]

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
            "spans_per_s": round(traffic.spans / max(traffic.posting_seconds, 1.0)),
            "chaos": chaos_log,
            "kills_expected": expected,
            "kills_sent": len(kills.messages),
            "doubled": doubled,
            "lost": lost,
            "false": false,
            "lost_posted_s": lost_posted[:50],
            "rss_start_mib": [round(r / 1024) for r in rss_start],
            "rss_end_mib": [round(r / 1024) for r in rss_end],
            "rss_series_mib": rss_series,
            "rocksdb_mib_and_cached_traces_series": memory_series,
            "state_ttl_s": args.state_ttl,
            "max_lag": peak,
            "final_drain_s": round(drained_in, 1),
            # Not zero: the drain gave up with records unread, so "lost" counts late kills too.
            "lag_at_end": lag.samples[-1][1] if lag.samples else None,
            "drain_s": None if drain is None else round(drain, 1),
            "latency_p50_s": round(percentile(latencies, 0.5), 3) if latencies else None,
            "latency_p99_s": round(percentile(latencies, 0.99), 3) if latencies else None,
            "cores": os.cpu_count(),
            "load_avg_1m": os.getloadavg()[0],
        }
        print(
            f"soak: {result['minutes']} min, {traffic.spans} spans ({result['spans_per_s']}/s"
            f" offered); kills expected {expected},"
            f" sent {len(kills.messages)}, doubled {doubled}, lost {lost}, false {false};"
            f" RSS MiB start {result['rss_start_mib']} end {result['rss_end_mib']};"
            f" longest lag {peak} messages, under a tenth of it {result['drain_s']} s later;"
            f" after the traffic, {result['final_drain_s']} s to drain (lag at the end"
            f" {result['lag_at_end']});"
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
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
