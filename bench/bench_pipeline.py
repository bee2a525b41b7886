"""`make bench-pipeline`: the streaming worker's speed and detection latency on a real broker.

Through the project's Kafka broker (scripts/kafka.sh) and ONE `spanguard worker` process
(memory store, fresh topic names, `--partitions` partitions):

1. Throughput. The core benchmark's span mix (bench/corpus.py, `per_trace=True`: one OTLP
   request per trace and batch, keyed by the hex trace id, as the Collector's kafka exporter
   writes with partition_traces_by_id) is produced into the input topic BEFORE the worker
   starts, so the producer's speed is out of the measurement; the rate is the worker's
   `spanguard_spans_total` (from /metrics) over the time it takes to drain the topic, the
   start-up ramp left out. The detection core (`Guard().process(bytes)`, dict state) runs over
   the same requests in this process, before the worker starts, for the ratio.
2. Latency. A second corpus with fresh trace ids (one trace in twenty loops) is produced at a
   paced `--rate` spans/s; every looping trace's tripping call arrives during the run. The
   input and kill topics use `message.timestamp.type=LogAppendTime`, so both ends of
   latency = kill signal's append to the kill topic - append to the input topic of the message
   holding the span that tripped it (the signal's `evidence.span_id`) are the broker's clock.
   The input append time comes from the producer's delivery report.

Human lines first; the last line is one JSON object. Topics are deleted at the end. The
cores the worker, the broker, this bench and other processes used are printed with each
phase: on a shared 2-core machine other load moves the numbers, and this says by how much.

Reading the latency: Faust creates its aiokafka consumer with fetch_max_wait_ms=1500, and
aiokafka keeps one fetch in flight per broker; when every input partition still has buffered
records, the next fetch names only idle partitions (detections, goal checks, changelogs) and
the broker holds it for 1.5 s, input waiting behind it. A run caught in that cycle shows
latencies of 1-2 s in every third of the run; a run that escapes it, tens of milliseconds.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

from confluent_kafka import TIMESTAMP_LOG_APPEND_TIME, KafkaException, Producer
from confluent_kafka.admin import AdminClient, NewTopic
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from bench.corpus import build_corpus
from spanguard.detection.guard import Guard
from tests.support.kafka_harness import (
    BOOTSTRAP,
    CLUSTER,
    Collector,
    Topics,
    WorkerProcess,
    ensure_broker,
)

DAY_MS = str(24 * 3600 * 1000)


def keyed_messages(requests: list[bytes]) -> list[tuple[bytes, bytes, list[str]]]:
    """(key = hex trace id, value, hex span ids) per single-trace request."""
    out = []
    for data in requests:
        request = ExportTraceServiceRequest.FromString(data)
        span_ids, trace_ids = [], set()
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    trace_ids.add(span.trace_id)
                    span_ids.append(span.span_id.hex())
        if len(trace_ids) != 1:
            raise ValueError("per_trace corpus request with several traces")
        out.append((next(iter(trace_ids)).hex().encode(), data, span_ids))
    return out


def core_rate(requests: list[bytes], spans: int, runs: int) -> float:
    best = float("inf")
    for _ in range(runs):
        gc.collect()
        guard = Guard()
        started = time.perf_counter()
        for data in requests:
            guard.process(data)
        best = min(best, time.perf_counter() - started)
    return spans / best


def expected_kills(requests: list[bytes]) -> dict[str, str]:
    """trace id -> span id of the span that trips its kill, by the core on its own."""
    guard = Guard()
    return {
        decision.trace_id: decision.span_id
        for data in requests
        for decision in guard.process(data)
        if decision.action == "kill"
    }


def create_timed_topics(admin: AdminClient, names: list[str], partitions: int) -> None:
    """The topics whose append times are measured: broker clock (LogAppendTime)."""
    config = {"message.timestamp.type": "LogAppendTime", "retention.ms": DAY_MS}
    futures = admin.create_topics(
        [NewTopic(name, partitions, 1, config=config) for name in names], request_timeout=30
    )
    for future in futures.values():
        future.result(timeout=30)


def delete_topics(admin: AdminClient, prefix: str) -> list[str]:
    names = [name for name in admin.list_topics(timeout=10).topics if name.startswith(prefix)]
    if names:
        for future in admin.delete_topics(names, request_timeout=30).values():
            with contextlib.suppress(KafkaException):
                future.result(timeout=30)
    return names


def create_worker_topics(topics: Topics, partitions: int, attempts: int = 3) -> None:
    """`spanguard topics create` for the rest (the timed topics exist and are left alone);
    run here, with its output shown on failure, before WorkerProcess.start() runs it again."""
    command = [sys.executable, "-m", "spanguard.cli", "topics", "create", "--bootstrap"]
    command += [BOOTSTRAP, *topics.flags(), "--partitions", str(partitions)]
    for attempt in range(attempts):
        result = subprocess.run(
            command, capture_output=True, text=True, timeout=60, env={**os.environ, **CLUSTER.env()}
        )
        if result.returncode == 0:
            return
        print(f"topics create failed (attempt {attempt + 1}):\n{result.stderr[-2000:]}")
        time.sleep(1.0)
    raise RuntimeError("spanguard topics create kept failing")


def preproduce(topic: str, messages: list[tuple[bytes, bytes, list[str]]]) -> float:
    # CLUSTER.config(): the run's broker with its SPANGUARD_KAFKA_* security settings.
    bulk = Producer(
        CLUSTER.config(
            **{
                "linger.ms": 20,
                "enable.idempotence": True,
                "queue.buffering.max.messages": 1_000_000,
            }
        )
    )
    started = time.perf_counter()
    for key, value, _ in messages:
        bulk.produce(topic, key=key, value=value)
        bulk.poll(0)
    if bulk.flush(60) != 0:
        raise RuntimeError("pre-produce: messages still undelivered after 60s")
    return time.perf_counter() - started


class CpuMeter:
    """CPU seconds of the worker, the broker and the whole machine over an interval (Linux
    /proc; zeros elsewhere): a shared 2-core machine's other load shows in the numbers."""

    def __init__(self, worker_pid: int) -> None:
        self.pids = {"worker": worker_pid, "broker": _broker_pid(), "bench": os.getpid()}
        self.start = self._read()

    @staticmethod
    def _proc(pid: int | None) -> float:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return 0.0

    def _read(self) -> dict[str, float]:
        values = {name: self._proc(pid) for name, pid in self.pids.items()}
        try:
            ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
            values["machine"] = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            values["machine"] = 0.0
        values["wall"] = time.monotonic()
        return values

    def cores(self) -> dict[str, float]:
        """Cores busy since the start: worker, broker, this bench, machine, others (the rest)."""
        end = self._read()
        wall = max(end["wall"] - self.start["wall"], 1e-9)
        used = {name: (end[name] - self.start[name]) / wall for name in end if name != "wall"}
        used["others"] = max(0.0, used["machine"] - used["worker"] - used["broker"] - used["bench"])
        return used


def _broker_pid() -> int | None:
    try:
        out = subprocess.run(["pgrep", "-f", "kafka.Kafka"], capture_output=True, text=True)
        return int(out.stdout.split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _cores_text(cores: dict[str, float]) -> str:
    return (
        f"cores busy: worker {cores['worker']:.2f}, broker {cores['broker']:.2f},"
        f" bench {cores['bench']:.2f}, other processes {cores['others']:.2f}"
        f" (of {os.cpu_count()})"
    )


def drain_rate(
    worker: WorkerProcess, total: int, timeout: float
) -> tuple[float, list[tuple[float, float]], bool]:
    """spans/s from the first sample past 2% of `total` to the sample that reaches it."""
    samples: list[tuple[float, float]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        spans = (worker.metrics() or {}).get("spanguard_spans_total", 0.0)
        samples.append((time.monotonic(), spans))
        if spans >= total:
            break
        time.sleep(0.1)
    done = samples[-1][1] >= total
    start = next((s for s in samples if s[1] >= 0.02 * total), samples[-1])
    end = samples[-1]
    rate = (end[1] - start[1]) / (end[0] - start[0]) if end[0] > start[0] else 0.0
    return rate, samples, done


def paced_produce(
    topic: str, messages: list[tuple[bytes, bytes, list[str]]], rate: float, limit_s: float
) -> tuple[dict[int, int], float, int]:
    """Produce at `rate` spans/s: (message index -> append time ms, seconds, spans sent)."""
    appended: dict[int, int] = {}
    types: set[int] = set()

    def delivered(index: int, err, msg) -> None:
        if err is None:
            kind, stamp = msg.timestamp()
            types.add(kind)
            appended[index] = stamp

    # Ticks of `tick` seconds: each sends the messages due by then (about 20 at 2,000 spans/s),
    # then the producer sleeps in poll() serving delivery reports; per-message wake-ups would
    # cost the bench a core on this small machine, taken from the worker it measures.
    out = Producer(CLUSTER.config(**{"linger.ms": 1, "enable.idempotence": True}))
    started = time.monotonic()
    spans_sent, index, tick = 0, 0, 0.01
    while index < len(messages) and time.monotonic() - started < limit_s:
        due_spans = (time.monotonic() - started + tick) * rate
        while index < len(messages) and spans_sent < due_spans:
            key, value, span_ids = messages[index]
            out.produce(topic, key=key, value=value, on_delivery=partial(delivered, index))
            spans_sent += len(span_ids)
            index += 1
        next_tick = started + spans_sent / rate
        while (wait := next_tick - time.monotonic()) > 0:
            out.poll(wait)
        out.poll(0)
    elapsed = time.monotonic() - started
    out.flush(30)
    if types - {TIMESTAMP_LOG_APPEND_TIME}:
        raise RuntimeError(f"input topic append times are not LogAppendTime: {types}")
    return appended, elapsed, spans_sent


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spans", type=int, default=100_000, help="throughput corpus spans")
    parser.add_argument("--traces", type=int, default=1_000, help="throughput corpus traces")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3, help="core runs (best of)")
    parser.add_argument("--rate", type=float, default=2_000.0, help="latency run spans/s")
    parser.add_argument("--seconds", type=float, default=25.0, help="latency run length")
    parser.add_argument(
        "--latency-traces", type=int, default=1_500, help="traces in the latency run"
    )
    parser.add_argument(
        "--worker-arg", action="append", default=[], help="extra `spanguard worker` argument"
    )
    parser.add_argument(
        "--worker-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="environment for the worker (e.g. Faust's PRODUCER_LINGER=0.005)",
    )
    parser.add_argument("--drain-timeout", type=float, default=90.0)
    args = parser.parse_args()
    bench_started = time.monotonic()

    ensure_broker()
    started = time.perf_counter()
    corpus = build_corpus(args.spans, args.traces, per_trace=True)
    messages = keyed_messages(corpus.requests)
    latency_spans = int(args.rate * args.seconds)
    latency_corpus = build_corpus(latency_spans, args.latency_traces, per_trace=True, seed=8)
    paced = keyed_messages(latency_corpus.requests)
    expected = expected_kills(latency_corpus.requests)
    print(
        f"corpus: {corpus.spans:,} spans in {len(messages):,} per-trace messages over"
        f" {args.traces:,} traces ({sum(map(len, corpus.requests)) / 1e6:.1f} MB); latency run:"
        f" {latency_corpus.spans:,} spans in {len(paced):,} messages over"
        f" {args.latency_traces:,} traces, {len(expected)} loops to kill"
        f" (built in {time.perf_counter() - started:.1f}s)"
    )

    core = core_rate(corpus.requests, corpus.spans, args.runs)
    print(f"core (Guard().process, same requests, best of {args.runs}): {core:12,.0f} spans/s")

    topics = Topics()
    admin = AdminClient(CLUSTER.config())
    worker: WorkerProcess | None = None
    collector: Collector | None = None
    result: dict[str, float | int | bool | None] = {}
    try:
        create_timed_topics(admin, [topics.input, topics.kills], args.partitions)
        create_worker_topics(topics, args.partitions)
        produce_s = preproduce(topics.input, messages)
        print(
            f"pre-produced {len(messages):,} messages into {topics.input} in {produce_s:.1f}s"
            f" ({args.partitions} partitions)"
        )

        env = dict(item.split("=", 1) for item in args.worker_env)
        data_dir = Path(tempfile.mkdtemp(prefix="spanguard-bench-"))
        worker = WorkerProcess(
            topics, data_dir, partitions=args.partitions, extra=args.worker_arg, env=env
        )
        launched = time.monotonic()
        worker.start()
        print(f"worker ready in {time.monotonic() - launched:.1f}s")
        meter = CpuMeter(worker.process.pid)
        pipeline, samples, done = drain_rate(worker, corpus.spans, args.drain_timeout)
        drain_cores = meter.cores()
        drained_s = samples[-1][0] - launched
        print(
            f"pipeline (1 worker, drain of the pre-produced topic): {pipeline:12,.0f} spans/s"
            f" = {pipeline / core:.3f} of core"
            + ("" if done else f"  [INCOMPLETE: {samples[-1][1]:,.0f}/{corpus.spans:,} spans]")
            + f"; all {corpus.spans:,} spans in {drained_s:.1f}s from worker launch"
        )
        print(f"  during the drain: {_cores_text(drain_cores)}")

        # -- latency at a steady rate ---------------------------------------------------
        collector = Collector(topics.kills)
        time.sleep(1.0)  # the collector's consumer joins before the first kill can appear
        before = (worker.metrics() or {}).get("spanguard_spans_total", 0.0)
        meter = CpuMeter(worker.process.pid)
        appended, paced_s, paced_spans = paced_produce(
            topics.input, paced, args.rate, limit_s=args.seconds * 1.5
        )
        paced_cores = meter.cores()
        print(
            f"latency run: {paced_spans:,} spans in {paced_s:.1f}s"
            f" = {paced_spans / paced_s:,.0f} spans/s offered; {_cores_text(paced_cores)}"
        )
        span_index = {
            span_id: index
            for index, (_key, _value, span_ids) in enumerate(paced)
            for span_id in span_ids
        }

        def kills_seen() -> list[dict]:
            return [
                record
                for record in collector.where(lambda m: True)
                if record["key"].decode() in expected
            ]

        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline and len(kills_seen()) < len(expected):
            time.sleep(0.1)
        after = (worker.metrics() or {}).get("spanguard_spans_total", 0.0)
        latencies, mismatched = [], 0
        timeline: list[tuple[int, int]] = []  # (input append ms, latency ms)
        for record in kills_seen():
            signal = json.loads(record["value"])
            if signal["kind"] != "kill":
                continue
            span_id = signal["evidence"]["span_id"]
            index = span_index.get(span_id)
            if (
                index is None
                or index not in appended
                or expected.get(signal["trace_id"]) != span_id
            ):
                mismatched += 1
                continue
            latencies.append(record["timestamp_ms"] - appended[index])
            timeline.append((appended[index], latencies[-1]))
        if latencies:
            p50, p99 = percentile(latencies, 0.50), percentile(latencies, 0.99)
            print(
                f"detection latency (input append -> kill append, broker clock):"
                f" p50 {p50:.0f} ms, p99 {p99:.0f} ms, max {max(latencies):.0f} ms over"
                f" {len(latencies)} kills ({len(expected)} expected, {mismatched} unmatched);"
                f" worker took {after - before:,.0f}/{paced_spans:,} spans"
            )
            # Steady or growing? The median by thirds of the run tells a backlog from noise.
            timeline.sort()
            thirds = [
                timeline[i * len(timeline) // 3 : (i + 1) * len(timeline) // 3] for i in range(3)
            ]
            print(
                "  latency p50 by third of the run: "
                + " / ".join(
                    f"{percentile([lat for _, lat in part], 0.5):.0f} ms" if part else "-"
                    for part in thirds
                )
                + f"; min {min(latencies):.0f} ms"
            )
        else:
            p50 = p99 = None
            print(f"detection latency: no kill signal measured ({mismatched} unmatched)")

        ratio_ok = pipeline >= core / 5
        p99_ok = p99 is not None and p99 < 100 and len(latencies) == len(expected)
        print(
            f"targets: pipeline >= 1/5 of core: {'met' if ratio_ok else 'MISSED'}"
            f" ({pipeline / core:.3f}); p99 < 100 ms: {'met' if p99_ok else 'MISSED'}"
            f" ({'-' if p99 is None else f'{p99:.0f} ms'})"
        )
        result = {
            "pipeline_spans_per_s": round(pipeline),
            "core_spans_per_s": round(core),
            "latency_p50_ms": p50,
            "latency_p99_ms": p99,
            "pipeline_to_core": round(pipeline / core, 3),
            "kills_measured": len(latencies),
            "latency_max_ms": max(latencies) if latencies else None,
            "partitions": args.partitions,
            "drain_complete": done,
            "worker_cores_drain": round(drain_cores["worker"], 2),
            "other_cores_drain": round(drain_cores["others"], 2),
            "other_cores_latency": round(paced_cores["others"], 2),
        }
    finally:
        if collector is not None:
            collector.close()
        if worker is not None:
            code = worker.stop()
            if code == 0:
                shutil.rmtree(worker.log_path.parent, ignore_errors=True)
            else:
                print(
                    f"worker exited with {code}; log kept: {worker.log_path}\n{worker.log_tail()}"
                )
        deleted = delete_topics(admin, topics.prefix)
        print(
            f"cleanup: worker stopped, {len(deleted)} topics deleted;"
            f" bench took {time.monotonic() - bench_started:.0f}s"
        )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
