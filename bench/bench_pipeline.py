"""`make bench-pipeline`: the streaming worker's speed and detection latency on a real broker.

Through the project's Kafka broker (scripts/kafka.sh) and `spanguard worker` processes on the
shipped defaults (RocksDB store, a signing key, `--partitions 8`, fresh topic names), in one
run, each figure next to its same-run baseline:

1. One worker's drain. The core benchmark's span mix (bench/corpus.py) as the Collector's
   kafka exporter writes it for interactive agents: one trace per message, keyed by its hex
   trace id, 1 to 3 spans per message. The worker is started and has taken its partitions
   (a probe record on each is processed) before the corpus is produced; the rate is the
   worker's `spanguard_spans_total` (from /metrics) from the moment the producer is done to
   the moment it has every span. /metrics is scraped once a second, no more: a scrape costs
   the worker about 10 ms of CPU (10 a second took a tenth of its core), and Prometheus
   scrapes every 15-30 s. The window ends at the worker's own
   `spanguard_last_span_batch_timestamp_seconds`, not at the scrape that saw the last span.
   The detection core (`Guard().process(bytes)`, dict state) runs over the same requests in
   this process, before any worker starts, for the ratio.
2. Latency. A second corpus with fresh trace ids (one trace in four loops,
   `--latency-loop-every`: a few hundred kills, so the p99 is not the one slowest) is
   produced at a paced `--rate` spans/s to the same worker; every looping trace's tripping call arrives
   during the run. The input and kill topics use `message.timestamp.type=LogAppendTime`, so
   both ends of latency = kill signal's append to the kill topic - append to the input topic
   of the message holding the span that tripped it (the signal's `evidence.span_id`) are the
   broker's clock. The input append time comes from the producer's delivery report.
2b. Through the Collector (phase `collector`): scripts/collector.sh starts the Collector with
   the configuration the project ships (deploy/collector/config.yaml: its batch timeout, the
   exporter writing whole batches), and the same span mix (fresh trace ids) is posted to it
   over OTLP/HTTP, 128 requests a post, as fast as it takes them. One worker's rate from the
   first post to the last span, and the spans per record the Collector wrote (input topic) and
   the worker's repartition hop packed. Then the latency run again through the Collector at
   each rate of `--rates` (`--rate`'s 2,000 spans/s, then 10,000), each span ending as it is
   posted: latency = the kill signal's append to the kill topic - the end time of the span
   that tripped it (same machine's clock), batching included. The requests are parsed before
   the clock starts; a run that posts less than 0.95 of its rate is said NOT REACHED in the
   targets line, with the rate it posted, rather than judged at the rate asked for.
   It is printed by stage: span end -> input append (the Collector), -> repartition append
   (the worker's first hop), -> the signal's `detected_at` (the second fetch and the guard),
   -> kill append (the signal's send); the repartition topic is LogAppendTime too. And
   whether a flush of the worker's states (a burst of records on the trace table's changelog,
   LogAppendTime as well) ran while each of the slowest tenth of kills was on its way.
   `--profile DIR` samples the worker with py-spy over this drain and phase 1's
   (bench/worker_profile.py).
2d. The packing Collector (with `collector`): the project's Collector build with
   deploy/collector/packed.yaml (spanguard_pack: each batch as one record per input partition,
   decided where it lands), the same drain and latency runs (at each rate of `--rates`) with
   fresh trace ids, beside the repartition path's figures of 2b from the same run; its latency
   stages have no hop. The targets line judges each rate after the first on both paths.
   Then, where py-spy is found (the dev extra's, or PY_SPY), a drain of half the corpus through each
   Collector with the worker sampled: the worker's CPU per span by stage (fetch, decode,
   rules, state, produce, other; bench/worker_profile.py's STAGES), in a table and in the
   JSON as `stage_us_per_span`. Sampled drains are slower: their rates are not reported.
2c. The scopes (phase `scopes`, with `collector`): a worker with the conversation, agent and
   tool scopes on (`SCOPES_POLICY`: a conversation scope, per-agent budgets no run reaches and
   the policy's `fleet` section, so every tool call travels to the tool scope too) and
   one with the shipped defaults, and a third with every scope on but the tool scope, each on
   topics and a Collector of its own, all warmed up alike; then `--scope-rounds` corpora like
   2b's (every span naming its conversation) are each drained through the three, back to back,
   which goes first turning. The median of the rounds' on/off rates is the scopes' cost on the
   shipped path, the median of on/third the tool scope's alone: the sides of a round meet the
   same load from the rest of a shared machine, which drains minutes apart do not.
   This is done once per `--scope-builds`: the worker image's compiled core first (what the
   compose file and the chart deploy: setup.py, scripts/compiled_core.py), then pure Python
   (a plain install); the first is judged against the target, and the latency run then goes
   through its scope-on worker. The other phases run pure Python workers. `--profile DIR`
   samples both workers over the first round (DIR/worker-drain-scopes-BUILD-on.txt, -off.txt).
2f. Fleet decision time (phase `fleet`): a worker with the policy's fleet rules on (the first
   of `--scope-builds`), topics and a Collector of its own; 200 agents (a trace each, the
   corpus's tools) posted at `--rate` through the Collector for `--fleet-incidents` segments
   of `--fleet-segment` seconds. In each segment the tools have fresh names (NAME-k) and one
   of them fails for every agent from a third of the segment on: one `tool_failing` incident
   each. The span that crossed the threshold is found by the oracle of tests/support/fleet.py
   (`first_crossing`, recounted from scratch on every call) over the calls as posted; the
   decision time = the incident record's append to the detections topic (LogAppendTime) -
   that span's arrival (its end time, the moment its body was posted). Its p99 is judged
   against one window step (30 s).
2g. The worker image's build on the packed path (phase `compiled`): the compiled core's rate
   over the drain corpus, in a process of its own (scripts/compiled_core.py run, this module's
   `--core-rate`), then a compiled worker with topics and a packing Collector of its own
   drains a corpus; its spans/s against that rate is judged against 0.25.
3. Two workers. A second worker joins the group; once both hold partitions (a probe record on
   each partition is processed), a third corpus (fresh trace ids) is drained by the two
   (through the Collector when phase `collector` ran), and the rate is compared with one
   worker's drained the same way, with the cores each worker used.
4. Faust's floor. Both workers stopped, a bare Faust agent (bench/faust_passthrough.py: the
   worker's app settings and batches, nothing done per record) reads the same input topic
   from its beginning under its own group; its records/s against the worker's of phase 1.

The targets line judges the Collector's path when it ran (the synthetic producer's figures
stay in the JSON as `pipeline_*` and `latency_*`). Human lines first; the last line is one
JSON object. Topics are deleted at the end. The
cores the workers, the broker, this bench and other processes used are printed with each
phase: on a shared 2-core machine other load moves the numbers, and this says by how much.

Reading the latency: Faust creates its aiokafka consumer with fetch_max_wait_ms=1500, and
aiokafka keeps one fetch in flight per broker; when every input partition still has buffered
records, the next fetch names only idle partitions (detections, goal checks, changelogs) and
the broker holds it for 1.5 s, input waiting behind it. The worker sets it to
`SPANGUARD_FETCH_MAX_WAIT` (20 ms, streams/faust_internals.py); a run caught in the old cycle
shows latencies of 1-2 s in every third of the run.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import gc
import http.client
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

from confluent_kafka import (
    TIMESTAMP_LOG_APPEND_TIME,
    Consumer,
    ConsumerGroupState,
    KafkaException,
    Producer,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient, NewTopic
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Status

from bench.bench_scopes import with_conversations
from bench.corpus import TOOLS, Corpus, build_corpus
from bench.worker_profile import STAGE_NAMES, Profiler, find_py_spy, summarize
from spanguard.detection import core_build
from spanguard.detection.fleet import FleetCall
from spanguard.detection.guard import Guard
from spanguard.schemas.policy import FleetPolicy
from tests.support.fleet import events_of as fleet_events
from tests.support.fleet import first_crossing
from tests.support.kafka_harness import (
    BOOTSTRAP,
    CLUSTER,
    ROOT,
    Collector,
    Topics,
    WorkerProcess,
    end_offsets,
    ensure_broker,
    free_port,
)

DAY_MS = str(24 * 3600 * 1000)
# Seconds between two scrapes of a worker's /metrics while it is measured. A scrape costs the
# worker about 10 ms of CPU; Prometheus scrapes every 15-30 s. The end of a drain is the
# worker's own `spanguard_last_span_batch_timestamp_seconds`, not the scrape that saw it.
SCRAPE_INTERVAL = 1.0
WARM_UP_SPANS = 1  # the latency run's first record, sent before its clock starts
Messages = list[tuple[bytes, bytes, list[str]]]


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


def core_rate(requests: list[bytes], spans: int, runs: int, cpu: bool = False) -> float:
    """The core's spans per second of wall time, or with `cpu` of this process's CPU time."""
    clock = time.process_time if cpu else time.perf_counter
    best = float("inf")
    for _ in range(runs):
        gc.collect()
        guard = Guard()
        started = clock()
        for data in requests:
            guard.process(data)
        best = min(best, clock() - started)
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
    """CPU seconds of each worker, the broker and the whole machine over an interval (Linux
    /proc; zeros elsewhere): a shared 2-core machine's other load shows in the numbers."""

    def __init__(self, workers: dict[str, int]) -> None:
        self.workers = list(workers)
        self.pids = {**workers, "broker": _broker_pid(), "bench": os.getpid()}
        self.start = self._read()

    def _read(self) -> dict[str, float]:
        values = {name: proc_cpu(pid) for name, pid in self.pids.items()}
        try:
            ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
            values["machine"] = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            values["machine"] = 0.0
        values["wall"] = time.monotonic()
        return values

    def cores(self, seconds: float | None = None) -> dict[str, float]:
        """Cores busy since the start: per worker, broker, this bench, machine, others.

        `seconds`: the measured window, when it ended before this reading (the last scrape
        comes up to SCRAPE_INTERVAL later): our processes' CPU is spread over it (they idle
        after it), the other processes' over the whole time read."""
        end = self._read()
        wall = max(end["wall"] - self.start["wall"], 1e-9)
        window = min(seconds, wall) if seconds else wall
        spent = {name: end[name] - self.start[name] for name in end if name != "wall"}
        used = {name: spent[name] / window for name in self.pids}
        ours = sum(spent[name] for name in self.pids)
        used["others"] = max(0.0, (spent["machine"] - ours) / wall)
        used["machine"] = sum(used[name] for name in self.pids) + used["others"]
        return used

    def text(self, cores: dict[str, float]) -> str:
        return (
            "cores busy: "
            + ", ".join(f"{name} {cores[name]:.2f}" for name in self.workers)
            + f", broker {cores['broker']:.2f}, bench {cores['bench']:.2f},"
            f" other processes {cores['others']:.2f} (of {os.cpu_count()})"
        )


def proc_cpu(pid: int | None) -> float:
    """User + system CPU seconds of a process so far (0 when it cannot be read)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _broker_pid() -> int | None:
    try:
        out = subprocess.run(["pgrep", "-f", "kafka.Kafka"], capture_output=True, text=True)
        return int(out.stdout.split()[0])
    except (OSError, ValueError, IndexError):
        return None


class Counters:
    """The workers' spanguard_spans_total and _messages_total, summed; a scrape that fails
    keeps that worker's last value."""

    def __init__(self, workers: list[WorkerProcess]) -> None:
        self.workers = workers
        self.last = [(0.0, 0.0) for _ in workers]
        self.batch_at: list[float | None] = [None for _ in workers]

    def read(self) -> tuple[float, float, list[float]]:
        for i, worker in enumerate(self.workers):
            values = worker.metrics()
            if values is not None:
                self.last[i] = (
                    values.get("spanguard_spans_total", 0.0),
                    values.get("spanguard_messages_total", 0.0),
                )
                self.batch_at[i] = values.get("spanguard_last_span_batch_timestamp_seconds")
        spans = [spans for spans, _ in self.last]
        return sum(spans), sum(messages for _, messages in self.last), spans

    def last_batch_at(self) -> float | None:
        """Unix time the last of the workers completed its last batch, as of the last read."""
        times = [at for at in self.batch_at if at is not None]
        return max(times) if times else None

    def wait_for(
        self, spans: float, started_at: float, deadline: float
    ) -> tuple[float, float, list[float], float]:
        """Scrape every SCRAPE_INTERVAL until the workers have `spans` spans or `deadline`
        (monotonic) passes: (spans, messages, per worker, seconds from `started_at`). Done, the window ends at the workers' last batch, not at the scrape."""
        got, got_messages, per = self.read()
        while got < spans and time.monotonic() < deadline:
            time.sleep(SCRAPE_INTERVAL)
            got, got_messages, per = self.read()
        ended = self.last_batch_at() if got >= spans else None
        return got, got_messages, per, (ended or time.time()) - started_at


@dataclass
class Drain:
    spans_per_s: float
    messages_per_s: float
    seconds: float
    produce_s: float
    before_done: float  # share of the spans processed while the producer was still writing
    done: bool
    cores: dict[str, float]
    meter: CpuMeter
    per_worker: list[float]  # spans each worker took in the measured window


def drain(
    topic: str,
    messages: Messages,
    spans: int,
    workers: list[WorkerProcess],
    timeout: float,
    profiler: Profiler | None = None,
) -> Drain:
    """Produce `messages` as fast as the producer goes, then time the workers to the last span,
    from the moment the producer is done (its CPU is out of the window). With a `profiler`,
    the first worker is sampled over the same window."""
    counters = Counters(workers)
    base, _, _ = counters.read()
    produce_s = preproduce(topic, messages)
    started, started_at = time.monotonic(), time.time()
    # (The harness started it above: its process is set.)
    meter = CpuMeter({f"worker {i + 1}": w.process.pid for i, w in enumerate(workers)})  # type: ignore[union-attr]
    # (The harness started it above: its process is set.)
    profile = profiler.start(workers[0].process.pid) if profiler is not None else None  # type: ignore[union-attr]
    first, first_messages, first_per = counters.read()
    got, got_messages, per, wall = counters.wait_for(base + spans, started_at, started + timeout)
    if profile is not None:
        # (A profile is taken only with a profiler.)
        profiler.stop(profile)  # type: ignore[union-attr]
    wall = max(wall, 1e-9)
    cores = meter.cores(wall)
    return Drain(
        spans_per_s=(got - first) / wall,
        messages_per_s=(got_messages - first_messages) / wall,
        seconds=wall,
        produce_s=produce_s,
        before_done=(first - base) / spans,
        done=got >= base + spans,
        cores=cores,
        meter=meter,
        per_worker=[b - a for a, b in zip(first_per, per, strict=True)],
    )


def probe(topic: str, partitions: int, workers: list[WorkerProcess], seed: int) -> list[float]:
    """One single-span record on each partition, waited for: every partition is assigned and
    its table recovered. Returns the probe spans each worker took."""
    corpus = build_corpus(partitions, partitions, per_trace=True, message_spans=(1, 1), seed=seed)
    counters = Counters(workers)
    base, _, before = counters.read()
    out = Producer(CLUSTER.config(**{"linger.ms": 0, "enable.idempotence": True}))
    for partition, (key, value, _) in enumerate(keyed_messages(corpus.requests)):
        out.produce(topic, key=key, value=value, partition=partition)
    if out.flush(30) != 0:
        raise RuntimeError("probe records undelivered after 30 s")
    started = time.monotonic()
    got, _, after, _ = counters.wait_for(base + partitions, time.time(), started + 90)
    if got < base + partitions:
        raise TimeoutError(f"probe: {got - base:.0f}/{partitions} spans processed in 90 s")
    return [b - a for a, b in zip(before, after, strict=True)]


def wait_for_group(admin: AdminClient, group: str, topic: str, members: int) -> list[int]:
    """Until the group is stable with `members` members that each hold input partitions;
    returns how many each holds."""
    deadline = time.monotonic() + 90
    held: list[int] = []
    while time.monotonic() < deadline:
        with contextlib.suppress(KafkaException):
            description = admin.describe_consumer_groups([group])[group].result(timeout=10)
            held = [
                sum(1 for tp in member.assignment.topic_partitions if tp.topic == topic)
                for member in description.members
            ]
            stable = description.state == ConsumerGroupState.STABLE
            if stable and len(held) == members and all(held):
                return held
        time.sleep(0.5)
    raise TimeoutError(f"group {group}: not {members} members holding {topic} in 90 s ({held})")


def worker_store(worker: WorkerProcess) -> str:
    """The store the worker says it runs (its "starting" log line)."""
    return str(starting_line(worker).get("store", "unknown"))


def worker_core(worker: WorkerProcess) -> str:
    """The core build the worker says it runs (its "starting" log line)."""
    return str(starting_line(worker).get("detection_core", "unknown"))


def starting_line(worker: WorkerProcess) -> dict[str, object]:
    """The worker's "starting" log line, as JSON ({} before it is written)."""
    for line in worker.log_text().splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict) and record.get("msg") == "starting":
                return record
    return {}


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
    # Connected, with its idempotence id, before the clock starts: else the first ~300 ms of
    # messages wait for that and reach the broker in one burst (one clean span warms it up).
    warm = build_corpus(WARM_UP_SPANS, 1, per_trace=True, message_spans=(1, 1), seed=103)
    ((key, value, _),) = keyed_messages(warm.requests)
    out.produce(topic, key=key, value=value)
    if out.flush(30) != 0:
        raise RuntimeError("latency run: the warm-up record was not delivered in 30 s")
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


@dataclass
class Latency:
    p50: float | None
    p99: float | None
    max: float | None
    measured: int
    expected: int
    offered: float  # spans/s the run sent (the rate reached)
    cores: dict[str, float]
    rate: float = 0.0  # spans/s the run was asked for, where it is judged against it


def latency_run(
    worker: WorkerProcess,
    topics: Topics,
    paced: Messages,
    expected: dict[str, str],
    rate: float,
    seconds: float,
) -> Latency:
    """Produce `paced` at `rate` spans/s; input append -> kill append of every expected kill."""
    collector = Collector(topics.kills)
    try:
        time.sleep(1.0)  # the collector's consumer joins before the first kill can appear
        before = (worker.metrics() or {}).get("spanguard_spans_total", 0.0)
        # (The harness started it above: its process is set.)
        meter = CpuMeter({"worker": worker.process.pid})  # type: ignore[union-attr]
        appended, paced_s, paced_spans = paced_produce(
            topics.input, paced, rate, limit_s=seconds * 1.5
        )
        cores = meter.cores()
        print(
            f"latency run (1 worker): {paced_spans:,} spans in {paced_s:.1f}s"
            f" = {paced_spans / paced_s:,.0f} spans/s offered; {meter.text(cores)}"
        )
        span_index = {
            span_id: index
            for index, (_key, _value, span_ids) in enumerate(paced)
            for span_id in span_ids
        }

        def kills_seen() -> list[dict]:
            return [r for r in collector.where(lambda m: True) if r["key"].decode() in expected]

        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline and len(kills_seen()) < len(expected):
            time.sleep(0.1)
        after = (worker.metrics() or {}).get("spanguard_spans_total", 0.0)
        kills = kills_seen()
    finally:
        collector.close()
    latencies, mismatched = [], 0
    timeline: list[tuple[int, int]] = []  # (input append ms, latency ms)
    for record in kills:
        signal = json.loads(record["value"])
        if signal["kind"] != "kill":
            continue
        span_id = signal["evidence"]["span_id"]
        index = span_index.get(span_id)
        if index is None or index not in appended or expected.get(signal["trace_id"]) != span_id:
            mismatched += 1
            continue
        latencies.append(record["timestamp_ms"] - appended[index])
        timeline.append((appended[index], latencies[-1]))
    if not latencies:
        print(f"detection latency: no kill signal measured ({mismatched} unmatched)")
        return Latency(None, None, None, 0, len(expected), paced_spans / paced_s, cores)
    p50, p99 = percentile(latencies, 0.50), percentile(latencies, 0.99)
    print(
        f"detection latency (input append -> kill append, broker clock):"
        f" p50 {p50:.0f} ms, p99 {p99:.0f} ms, max {max(latencies):.0f} ms over"
        f" {len(latencies)} kills ({len(expected)} expected, {mismatched} unmatched);"
        f" worker took {after - before - WARM_UP_SPANS:,.0f}/{paced_spans:,} spans"
    )
    # Steady or growing? The median by thirds of the run tells a backlog from noise.
    timeline.sort()
    thirds = [timeline[i * len(timeline) // 3 : (i + 1) * len(timeline) // 3] for i in range(3)]
    print(
        "  latency p50 by third of the run: "
        + " / ".join(
            f"{percentile([lat for _, lat in part], 0.5):.0f} ms" if part else "-"
            for part in thirds
        )
        + f"; min {min(latencies):.0f} ms"
    )
    slowest = sorted(timeline, key=lambda item: -item[1])[:3]
    run_start = min(appended.values())
    print(
        "  slowest kills: "
        + ", ".join(f"{lat} ms at {(at - run_start) / 1000:.1f}s" for at, lat in slowest)
        + f" into the run (first kill at {(timeline[0][0] - run_start) / 1000:.1f}s)"
    )
    return Latency(
        p50, p99, max(latencies), len(latencies), len(expected), paced_spans / paced_s, cores
    )


@dataclass
class Floor:
    records_per_s: float
    cores: float  # of the pass-through process, over its measured window


def faust_floor(topics: Topics, records: int, env: dict[str, str], timeout: float) -> Floor:
    """bench/faust_passthrough.py over the whole input topic, from its beginning."""
    data_dir = Path(tempfile.mkdtemp(prefix="spanguard-passthrough-"))
    log = open(data_dir / "passthrough.log", "wb")  # noqa: SIM115 - closed below
    command = [sys.executable, "-m", "bench.faust_passthrough", "--topic", topics.input]
    command += ["--expect", str(records), "--app-id", f"{topics.prefix}-passthrough"]
    report = data_dir / "report.json"
    command += ["--data-dir", str(data_dir), "--report", str(report)]
    process = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,  # mode's terminal escapes; the figures come in `report`
        stderr=log,
        env={**os.environ, **CLUSTER.env(), **env},
        cwd=ROOT,
    )
    cpu: list[tuple[float, float]] = []  # (monotonic, CPU seconds): its cores in the window
    try:
        deadline = time.monotonic() + timeout
        while not report.exists() and process.poll() is None and time.monotonic() < deadline:
            cpu.append((time.monotonic(), proc_cpu(process.pid)))
            time.sleep(0.1)
        if not report.exists():
            tail = (data_dir / "passthrough.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"faust pass-through did not finish ({process.poll()}):\n{tail}")
        seen = json.loads(report.read_text())
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
    wall = max(seen["done_at"] - seen["at_2pct"], 1e-9)
    start = min(cpu, key=lambda sample: abs(sample[0] - seen["at_2pct"]))
    end = min(cpu, key=lambda sample: abs(sample[0] - seen["done_at"]))
    cores = (end[1] - start[1]) / max(end[0] - start[0], 1e-9)
    shutil.rmtree(data_dir, ignore_errors=True)
    return Floor((seen["records"] - seen["records_2pct"]) / wall, cores)


# -- the real Collector, with the configuration the project ships ---------------------------

COLLECTOR_SH = ROOT / "scripts" / "collector.sh"
COLLECTOR_CONFIG = ROOT / "deploy" / "collector" / "config.yaml"
# The project's Collector build writing through spanguard_pack: a record per partition.
PACKED = (str(ROOT / "deploy" / "collector" / "packed.yaml"),)
# Corpus requests (1-3 spans each) per OTLP/HTTP post in a drain: about what an agent SDK's
# BatchSpanProcessor sends per export when busy.
POST_REQUESTS = 128


class ShippedCollector:
    """scripts/collector.sh up with deploy/collector/config.yaml (batch timeout, exporter and
    all) and the `overlays` merged over it, writing to `topic`; spans go in over OTLP/HTTP
    like an agent's exporter sends them."""

    def __init__(self, topic: str, overlays: tuple[str, ...] = ()) -> None:
        self.configs = [str(COLLECTOR_CONFIG), *overlays] if overlays else []
        self.state_dir = Path(tempfile.mkdtemp(prefix="spanguard-bench-collector-"))
        self.http_port = free_port()
        self.env = {
            **os.environ,
            "OTLP_HTTP_ENDPOINT": f"127.0.0.1:{self.http_port}",
            "OTLP_GRPC_ENDPOINT": f"127.0.0.1:{free_port()}",
            "OTELCOL_METRICS_PORT": str(free_port()),
            "OTELCOL_LOG_LEVEL": "warn",
            "KAFKA_BROKERS": BOOTSTRAP,
            "SPANGUARD_INPUT_TOPIC": topic,
            "COLLECTOR_STATE_DIR": str(self.state_dir),
        }
        up = self._script("up", *self.configs)
        if up.returncode != 0:
            raise RuntimeError(f"scripts/collector.sh up failed: {up.stderr.strip()}")
        self.pid = int((self.state_dir / "collector.pid").read_text().strip())
        self.connection = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=30)

    def _script(self, command: str, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(COLLECTOR_SH), command, *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    def post(self, body: bytes) -> None:
        """One OTLP/HTTP export; a refusal (the Collector's queue full) is retried, and a
        connection the Collector closed while idle (between phases) is opened again."""
        status: object = "no answer"
        for attempt in range(20):
            try:
                self.connection.request(
                    "POST", "/v1/traces", body, {"Content-Type": "application/x-protobuf"}
                )
                response = self.connection.getresponse()
            except (ConnectionError, http.client.HTTPException):
                self.connection.close()
                self.connection = http.client.HTTPConnection(
                    "127.0.0.1", self.http_port, timeout=30
                )
                continue
            response.read()
            status = response.status
            if status == 200:
                return
            time.sleep(0.05 * (attempt + 1))
        raise RuntimeError(f"the Collector refused a post: HTTP {status}")

    def close(self) -> None:
        self.connection.close()
        down = self._script("down")
        if down.returncode == 0:
            shutil.rmtree(self.state_dir, ignore_errors=True)
        else:
            print(f"collector.sh down failed; state kept: {self.state_dir}\n{down.stderr}")


def per_worker_cpu(drained: Drain) -> float:
    """Spans per CPU second of worker 1 over the drain (0 where /proc says nothing)."""
    busy = drained.cores.get("worker 1", 0.0)
    return drained.spans_per_s / busy if busy > 0 else 0.0


def topic_records(topic: str, partitions: int) -> int:
    return sum(end_offsets(topic, partitions))


def settled_records(topic: str, partitions: int, quiet: float = 2.0, most: float = 10.0) -> int:
    """The topic's records once none came for `quiet` seconds (at most `most`): a drain ends
    when the spans are decided, and the scope records they made are sent with the next state
    write (the worker's commit_interval, 1 s by default) or after its scope_hold."""
    deadline = time.monotonic() + most
    count = topic_records(topic, partitions)
    while time.monotonic() < deadline:
        time.sleep(quiet)
        now = topic_records(topic, partitions)
        if now == count:
            break
        count = now
    return count


@dataclass
class Fed:
    """A drain through the Collector, and what the records carried."""

    drain: Drain
    input_records: int
    repartition_records: int

    def spans_per_record(self, spans: int) -> tuple[float, float]:
        """Spans per input record and per repartition record (every span takes the hop)."""
        return spans / max(self.input_records, 1), spans / max(self.repartition_records, 1)


def drain_through_collector(
    collector: ShippedCollector,
    topics: Topics,
    partitions: int,
    requests: list[bytes],
    spans: int,
    workers: list[WorkerProcess],
    timeout: float,
    profiler: Profiler | None = None,
) -> Fed:
    """Post `requests` to the Collector as fast as it takes them; time the workers from the
    first post to the last span (the Collector's batching and export are in the window).
    With a `profiler`, the first worker is sampled over the same window."""
    counters = Counters(workers)
    base, base_messages, base_per = counters.read()
    inputs, hops = (
        topic_records(topics.input, partitions),
        topic_records(topics.repartition, partitions),
    )
    started, started_at = time.monotonic(), time.time()
    meter = CpuMeter(
        # (The harness started it above: its process is set.)
        {f"worker {i + 1}": w.process.pid for i, w in enumerate(workers)}  # type: ignore[union-attr]
        | {"collector": collector.pid}
    )
    # (The harness started it above: its process is set.)
    profile = profiler.start(workers[0].process.pid) if profiler is not None else None  # type: ignore[union-attr]
    for at in range(0, len(requests), POST_REQUESTS):
        collector.post(b"".join(requests[at : at + POST_REQUESTS]))
    posted = time.monotonic() - started
    got, got_messages, per, wall = counters.wait_for(base + spans, started_at, started + timeout)
    if profile is not None:
        # (A profile is taken only with a profiler.)
        profiler.stop(profile)  # type: ignore[union-attr]
    wall = max(wall, 1e-9)
    cores = meter.cores(wall)
    drained = Drain(
        spans_per_s=(got - base) / wall,
        messages_per_s=(got_messages - base_messages) / wall,
        seconds=wall,
        produce_s=posted,
        before_done=0.0,
        done=got >= base + spans,
        cores=cores,
        meter=meter,
        per_worker=[b - a for a, b in zip(base_per, per, strict=True)],
    )
    return Fed(
        drained,
        topic_records(topics.input, partitions) - inputs,
        topic_records(topics.repartition, partitions) - hops,
    )


def span_appends(topic: str, start: list[int], end: list[int]) -> dict[str, int]:
    """Span id (hex) -> append time (ms, LogAppendTime) of the record of `topic` that holds it,
    over the offsets [start, end) of each partition."""
    consumer = Consumer(
        CLUSTER.config(**{"group.id": f"bench-{os.getpid()}-appends", "enable.auto.commit": False})
    )
    appended: dict[str, int] = {}
    try:
        left = {p: (first, last) for p, (first, last) in enumerate(zip(start, end, strict=True))}
        left = {p: span for p, span in left.items() if span[0] < span[1]}
        consumer.assign([TopicPartition(topic, p, first) for p, (first, _) in left.items()])
        deadline = time.monotonic() + 60
        while left and time.monotonic() < deadline:
            for message in consumer.consume(500, timeout=1.0):
                if message.error() or message.partition() not in left:
                    continue
                # (confluent-kafka types these Optional; a consumed message without error has them.)
                request = ExportTraceServiceRequest.FromString(message.value())  # type: ignore[arg-type]
                stamp = message.timestamp()[1]
                for resource_spans in request.resource_spans:
                    for scope_spans in resource_spans.scope_spans:
                        for span in scope_spans.spans:
                            appended.setdefault(span.span_id.hex(), stamp)
                # (confluent-kafka types these Optional; a consumed message without error has them.)
                if message.offset() + 1 >= left[message.partition()][1]:  # type: ignore[index, operator]
                    del left[message.partition()]  # type: ignore[arg-type]
    finally:
        consumer.close()
    return appended


def changelog_of(topics: Topics) -> str:
    """The trace table's changelog topic (WorkerSettings.changelog_topic)."""
    return f"{topics.app_id}-trace-state-changelog"


def record_times(topic: str, start: list[int], end: list[int]) -> list[int]:
    """The timestamps (ms) of the records of `topic` over the offsets [start, end), sorted."""
    consumer = Consumer(
        CLUSTER.config(**{"group.id": f"bench-{os.getpid()}-times", "enable.auto.commit": False})
    )
    times: list[int] = []
    try:
        left = {p: end[p] for p in range(len(start)) if start[p] < end[p]}
        consumer.assign([TopicPartition(topic, p, start[p]) for p in left])
        deadline = time.monotonic() + 60
        while left and time.monotonic() < deadline:
            for message in consumer.consume(1000, timeout=1.0):
                if message.error() or message.partition() not in left:
                    continue
                times.append(message.timestamp()[1])
                # (confluent-kafka types these Optional; a consumed message without error has them.)
                if message.offset() + 1 >= left[message.partition()]:  # type: ignore[index, operator]
                    del left[message.partition()]  # type: ignore[arg-type]
    finally:
        consumer.close()
    return sorted(times)


def bursts(times: list[int], gap: int = 50) -> list[tuple[int, int, int]]:
    """(first ms, last ms, records) of each run of `times` with no gap over `gap` ms: the
    changelog records of one flush of the worker's states."""
    runs: list[tuple[int, int, int]] = []
    for at in times:
        if runs and at - runs[-1][1] <= gap:
            first, _, count = runs[-1]
            runs[-1] = (first, at, count + 1)
        else:
            runs.append((at, at, 1))
    return runs


def print_flush_overlap(
    stages: list[dict[str, int]], flushes: list[tuple[int, int, int]]
) -> dict[str, float]:
    """How many kills had a flush of the states (a burst of changelog records) between their
    input append and their detection: for the slowest tenth, and for the rest."""
    if not stages or not flushes:
        return {}
    starts = [first for first, _, _ in flushes]

    def overlapped(kill: dict[str, int]) -> bool:
        at = bisect.bisect_right(starts, kill["detected"]) - 1
        return at >= 0 and flushes[at][1] >= kill["input"]

    ranked = sorted(stages, key=lambda kill: -kill["total"])
    tenth = max(1, len(ranked) // 10)
    slow, rest = ranked[:tenth], ranked[tenth:]
    share = {
        "slowest_tenth": sum(map(overlapped, slow)) / len(slow),
        "rest": sum(map(overlapped, rest)) / len(rest) if rest else 0.0,
    }
    sizes = sorted(count for _, _, count in flushes)
    spans = sorted(last - first for first, last, _ in flushes)
    print(
        f"  state flushes in the run: {len(flushes)}, {sizes[len(sizes) // 2]} changelog"
        f" records each (median; appended over {spans[len(spans) // 2]} ms, at most"
        f" {spans[-1]} ms); a flush ran while the kill was on its way for"
        f" {share['slowest_tenth']:.0%} of the slowest tenth of kills, {share['rest']:.0%} of"
        " the others"
    )
    return share


# The stages of a kill's latency through the Collector, each the difference of two clocks
# (this machine's and the broker's, the same clock here).
STAGES = (
    ("collector", "span end -> input append (batch timeout, export)"),
    ("hop", "input append -> repartition append (fetch, split, pack, produce)"),
    ("decide", "repartition append -> detected_at (fetch, guard)"),
    ("signal", "detected_at -> kill append (sign, produce)"),
)


def latency_stages(
    kills: list[tuple[str, int, int]],
    ended: dict[str, int],
    input_at: dict[str, int],
    hop_at: dict[str, int],
    packed: bool = False,
) -> list[dict[str, int]]:
    """Per kill (span id, detected_at ms, kill append ms): the stages of STAGES, in ms; a kill
    whose span was not found on both topics is left out. `packed`: the Collector packed by
    partition, no record took the hop (its stage is 0)."""
    out = []
    for span_id, detected, killed in kills:
        if span_id not in input_at or (span_id not in hop_at and not packed):
            continue
        hopped = hop_at.get(span_id, input_at[span_id]) if not packed else input_at[span_id]
        out.append(
            {
                "collector": input_at[span_id] - ended[span_id],
                "hop": hopped - input_at[span_id],
                "decide": detected - hopped,
                "signal": killed - detected,
                "total": killed - ended[span_id],
                "input": input_at[span_id],
                "detected": detected,
            }
        )
    return out


def print_stages(stages: list[dict[str, int]]) -> dict[str, dict[str, float]]:
    """Each stage's p50, p99 and max, and the stages of the slowest kills."""
    if not stages:
        print("  latency by stage: no kill found on the input and repartition topics")
        return {}
    figures = {}
    print(f"  latency by stage over {len(stages)} kills (p50 / p99 / max, ms):")
    for name, what in STAGES:
        values = [float(kill[name]) for kill in stages]
        figures[name] = {
            "p50": percentile(values, 0.5),
            "p99": percentile(values, 0.99),
            "max": max(values),
        }
        print(
            f"    {name:9} {figures[name]['p50']:5.0f} / {figures[name]['p99']:5.0f}"
            f" / {figures[name]['max']:5.0f}   {what}"
        )
    slowest = sorted(stages, key=lambda kill: -kill["total"])[: max(3, len(stages) // 100)]
    print(
        "  slowest kills: "
        + "; ".join(
            f"{kill['total']} ms = " + " + ".join(str(kill[name]) for name, _ in STAGES)
            for kill in slowest
        )
        + " ("
        + " + ".join(name for name, _ in STAGES)
        + ")"
    )
    return figures


@dataclass
class Posted:
    """A paced run of posts: each span's end time, the bodies as posted, what was sent."""

    ended: dict[str, int]  # span id (hex) -> end time, ms: the moment its body was posted
    bodies: list[bytes]
    spans: int
    seconds: float


def post_paced(
    collector: ShippedCollector, requests: list[bytes], rate: float, limit_s: float
) -> Posted:
    """Post `requests` at `rate` spans/s, each span ending as its body is posted. The
    requests are parsed before the clock starts, so that at a high rate the loop does little
    more than post."""
    parsed = [ExportTraceServiceRequest.FromString(data) for data in requests]
    spans_of = [
        [span for rs in request.resource_spans for ss in rs.scope_spans for span in ss.spans]
        for request in parsed
    ]
    ended: dict[str, int] = {}
    bodies: list[bytes] = []
    started = time.monotonic()
    sent, index, tick = 0, 0, 0.01
    while index < len(parsed) and time.monotonic() - started < limit_s:
        due = (time.monotonic() - started + tick) * rate
        now_ns = time.time_ns()
        parts = []
        while index < len(parsed) and sent < due:
            for span in spans_of[index]:
                span.start_time_unix_nano = now_ns - 1_000_000
                span.end_time_unix_nano = now_ns
                ended[span.span_id.hex()] = now_ns // 1_000_000
            sent += len(spans_of[index])
            # Serialized requests joined are their merge: one body of every request due.
            parts.append(parsed[index].SerializeToString())
            index += 1
        if parts:
            bodies.append(b"".join(parts))
            collector.post(bodies[-1])
        while (wait := started + sent / rate - time.monotonic()) > 0:
            time.sleep(wait)
    return Posted(ended, bodies, sent, time.monotonic() - started)


def latency_through_collector(
    worker: WorkerProcess,
    topics: Topics,
    partitions: int,
    collector: ShippedCollector,
    requests: list[bytes],
    expected: dict[str, str],
    rate: float,
    seconds: float,
    packed: bool = False,
) -> tuple[Latency, dict[str, dict[str, float]]]:
    """Post `requests` at `rate` spans/s, each span ending as it is posted; latency = the kill
    signal's append to the kill topic (broker clock, LogAppendTime) - the end time of the span
    that tripped it (this machine's clock, the broker's too), the Collector's batch wait in.
    With the figures of each stage (STAGES): the input and repartition topics' append times of
    the tripping span's records, and the signal's detected_at (the worker's clock)."""
    reader = Collector(topics.kills)
    changelog = changelog_of(topics)  # a burst of records each flush
    starts = {
        topic: end_offsets(topic, partitions)
        for topic in (topics.input, topics.repartition, changelog)
    }
    try:
        time.sleep(1.0)  # the reader's consumer joins before the first kill can appear
        # (The harness started it above: its process is set.)
        meter = CpuMeter({"worker": worker.process.pid, "collector": collector.pid})  # type: ignore[union-attr]
        paced = post_paced(collector, requests, rate, seconds * 1.5)
        ended, sent, elapsed = paced.ended, paced.spans, paced.seconds
        cores = meter.cores()
        print(
            f"latency run through the {'packing ' if packed else ''}Collector (1 worker):"
            f" {sent:,} spans in {elapsed:.1f}s = {sent / elapsed:,.0f} spans/s posted"
            f" ({rate:,.0f} offered); {meter.text(cores)}"
        )
        deadline = time.monotonic() + 15.0
        kills: list[dict] = []
        while time.monotonic() < deadline and len(kills) < len(expected):
            time.sleep(0.1)
            kills = [r for r in reader.where(lambda m: True) if r["key"].decode() in expected]
    finally:
        reader.close()
    latencies, mismatched = [], 0
    measured: list[tuple[str, int, int]] = []  # (span id, detected_at ms, kill append ms)
    for record in kills:
        signal = json.loads(record["value"])
        if signal["kind"] != "kill":
            continue
        span_id = signal["evidence"]["span_id"]
        if span_id not in ended or expected.get(signal["trace_id"]) != span_id:
            mismatched += 1
            continue
        latencies.append(record["timestamp_ms"] - ended[span_id])
        detected = datetime.fromisoformat(signal["detected_at"]).timestamp()
        measured.append((span_id, round(detected * 1000), record["timestamp_ms"]))
    if not latencies:
        print(f"detection latency: no kill signal measured ({mismatched} unmatched)")
        return Latency(None, None, None, 0, len(expected), sent / elapsed, cores), {}
    p50, p99 = percentile(latencies, 0.50), percentile(latencies, 0.99)
    print(
        f"detection latency (span end -> kill append, Collector batching included):"
        f" p50 {p50:.0f} ms, p99 {p99:.0f} ms, max {max(latencies):.0f} ms over"
        f" {len(latencies)} kills ({len(expected)} expected, {mismatched} unmatched)"
    )
    input_at, hop_at = (
        span_appends(topic, starts[topic], end_offsets(topic, partitions))
        for topic in (topics.input, topics.repartition)
    )
    per_kill = latency_stages(measured, ended, input_at, hop_at, packed)
    stages = print_stages(per_kill)
    flushes = bursts(record_times(changelog, starts[changelog], end_offsets(changelog, partitions)))
    print_flush_overlap(per_kill, flushes)
    latency = Latency(
        p50, p99, max(latencies), len(latencies), len(expected), sent / elapsed, cores
    )
    return latency, stages


# The detection core's two builds (setup.py): the worker image's, compiled by mypyc, and a
# plain install's. The compiled one runs from build/compiled-core (scripts/compiled_core.py).
BUILDS = {"compiled": "the worker image's compiled core", "python": "pure Python, a plain install"}


def start_worker(
    topics: Topics, partitions: int, args: argparse.Namespace, build: str = "python"
) -> WorkerProcess:
    env = dict(item.split("=", 1) for item in args.worker_env)
    data_dir = Path(tempfile.mkdtemp(prefix="spanguard-bench-"))
    worker = WorkerProcess(topics, data_dir, partitions=partitions, extra=args.worker_arg, env=env)
    if build == "compiled":  # `spanguard worker` importing the wheel's compiled core first
        runner = [str(ROOT / "scripts" / "compiled_core.py"), "run", "-m", "spanguard.cli"]
        worker.args[1:3] = runner
    launched = time.monotonic()
    worker.start()
    running = worker_core(worker)
    if running != ("compiled" if build == "compiled" else "pure Python"):
        stop_worker(worker)
        raise RuntimeError(f"a worker meant to run the {build} core runs {running!r}")
    print(
        f"worker ready in {time.monotonic() - launched:.1f}s (store {worker_store(worker)},"
        f" core {running})"
    )
    return worker


def compiled_core_built() -> bool:
    return any((ROOT / "build" / "compiled-core" / "spanguard" / "detection").glob("guard.*.so"))


def stop_worker(worker: WorkerProcess) -> None:
    code = worker.stop()
    if code == 0:
        shutil.rmtree(worker.log_path.parent, ignore_errors=True)
    else:
        print(f"worker exited with {code}; log kept: {worker.log_path}\n{worker.log_tail()}")


# The conversation, agent and tool scopes on, with budgets no run reaches: every call travels
# to the conversation agent and to the tool scope, every inference's usage to the agent windows,
# and nothing but the loops is decided (no tool of the scope rounds fails for the fleet).
# Without TOOL_SCOPE, the third worker of the phase: what the tool scope alone costs.
SCOPES_WITHOUT_TOOLS_POLICY = """\
defaults:
  conversation: {enabled: true}
  agent_budget: {window: 1h, tokens: 1000000000000, usd: 1000000000, action: flag}
"""
TOOL_SCOPE = "fleet: {enabled: true}\n"
SCOPES_POLICY = SCOPES_WITHOUT_TOOLS_POLICY + TOOL_SCOPE


@dataclass
class ScopesRun:
    build: str  # the core build both workers ran (BUILDS)
    on: list[Drain]  # each round's drain with the scopes on ...
    off: list[Drain]  # ... and the same corpus's through the scope-off worker
    tool_off: list[Drain]  # ... and through the worker with every scope on but the tool scope
    latency: Latency | None
    conversation_records: int  # Kafka records the rounds sent to the conversation topic
    usage_records: int  # ... to the agent usage topic
    tool_call_records: int  # ... and to the tool call topic

    @property
    def ratios(self) -> list[float]:
        return [on.spans_per_s / off.spans_per_s for on, off in zip(self.on, self.off, strict=True)]

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)

    @property
    def tool_ratios(self) -> list[float]:
        """Each round's spans/s with the tool scope on to with it off (the others on in both)."""
        pairs = zip(self.on, self.tool_off, strict=True)
        return [on.spans_per_s / off.spans_per_s for on, off in pairs]

    @property
    def tool_ratio(self) -> float:
        return statistics.median(self.tool_ratios)


def scopes_run(
    args: argparse.Namespace,
    admin: AdminClient,
    warmup: Corpus,
    rounds: list[Corpus],
    latency_corpus: Corpus | None,
    expected: dict[str, str],
    build: str,
) -> ScopesRun:
    """Phase `scopes`: a worker with the conversation, agent and tool scopes on (SCOPES_POLICY),
    one with the shipped defaults and one with every scope on but the tool scope, all running
    the core's `build`, each on topics and a Collector of its own, each warmed up by `warmup`;
    then each corpus of `rounds` is drained through the three, back to back (which goes first
    turns), so that the sides of a round meet the same load from the rest of this machine.
    With `latency_corpus`, the latency run goes through the scope-on worker."""
    policies = Path(tempfile.mkdtemp(prefix="spanguard-bench-scopes-"))
    sided = [args]
    for name, text in (("scopes", SCOPES_POLICY), ("no-tools", SCOPES_WITHOUT_TOOLS_POLICY)):
        policy = policies / f"{name}.yaml"
        policy.write_text(text)
        sided.append(
            argparse.Namespace(
                **{**vars(args), "worker_arg": [*args.worker_arg, f"--policy={policy}"]}
            )
        )
    sides: list[tuple[Topics, WorkerProcess, ShippedCollector]] = []
    try:
        for worker_args, seed in zip(sided, (104, 103, 105), strict=True):  # off, on, tool off
            topics = Topics()
            timed = [topics.input, topics.kills, topics.repartition, changelog_of(topics)]
            create_timed_topics(admin, timed, args.partitions)
            create_worker_topics(topics, args.partitions)
            worker = start_worker(topics, args.partitions, worker_args, build)
            sides.append((topics, worker, ShippedCollector(topics.input)))
            probe(topics.input, args.partitions, [worker], seed=seed)
        off_worker = sides[0][1]
        topics, worker, shipped = sides[1]
        scope_topics = (topics.conversations, topics.agent_usage, topics.tool_calls)
        for side_topics, side_worker, collector in sides:
            drain_through_collector(
                collector, side_topics, args.partitions, warmup.requests, warmup.spans,
                [side_worker], args.drain_timeout,
            )  # fmt: skip
        # The scope topics have `scope_partitions` (the worker's setting), not --partitions.
        metadata = admin.list_topics(timeout=10).topics
        scope_partitions = [len(metadata[topic].partitions) for topic in scope_topics]
        scope_records = [
            topic_records(topic, count)
            for topic, count in zip(scope_topics, scope_partitions, strict=True)
        ]
        drains: dict[str, list[Drain]] = {"off": [], "on": [], "tool_off": []}
        for index, corpus in enumerate(rounds):
            names = list(drains)
            order = names[index % 3 :] + names[: index % 3]
            for side in order:
                side_topics, side_worker, collector = sides[names.index(side)]
                name = f"worker-drain-scopes-{build}-{side}.txt"
                profiler = Profiler(args.profile, name) if args.profile and index == 0 else None
                fed = drain_through_collector(
                    collector, side_topics, args.partitions, corpus.requests, corpus.spans,
                    [side_worker], args.drain_timeout, profiler,
                )  # fmt: skip
                drains[side].append(fed.drain)
        conversation_records, usage_records, tool_call_records = (
            settled_records(topic, count) - before
            for topic, count, before in zip(
                scope_topics, scope_partitions, scope_records, strict=True
            )
        )
        for idle in (off_worker, sides[2][1]):  # the latency run has the machine to itself
            stop_worker(idle)
        latency = None
        if latency_corpus is not None:
            latency, _ = latency_through_collector(
                worker, topics, args.partitions, shipped, latency_corpus.requests, expected,
                args.rate, args.seconds,
            )  # fmt: skip
        return ScopesRun(
            build, drains["on"], drains["off"], drains["tool_off"], latency,
            conversation_records, usage_records, tool_call_records,
        )  # fmt: skip
    finally:
        for side_topics, side_worker, collector in sides:
            # (The harness started it above: its process is set.)
            if side_worker.process.poll() is None:  # type: ignore[union-attr]
                stop_worker(side_worker)
            collector.close()
            delete_topics(admin, side_topics.prefix)
        shutil.rmtree(policies, ignore_errors=True)


def print_scopes(scopes: ScopesRun, repartition_records: int) -> None:
    done = all(d.done for d in scopes.on + scopes.off + scopes.tool_off)
    print(
        f"pipeline through the Collector with the conversation, agent and tool scopes on"
        f" (1 worker, {BUILDS[scopes.build]}):"
        f" {statistics.median(d.spans_per_s for d in scopes.on):12,.0f}"
        f" spans/s = {scopes.ratio:.2f} of a scope-off worker's (median of {len(scopes.on)}"
        " rounds, each corpus through both, back to back: "
        + ", ".join(f"{r:.2f}" for r in scopes.ratios)
        + ")"
        + ("" if done else "  [INCOMPLETE]")
    )
    print(
        f"  the tool scope alone: {scopes.tool_ratio:.2f} of the same worker without it (the"
        " conversation and agent scopes on in both; rounds: "
        + ", ".join(f"{r:.2f}" for r in scopes.tool_ratios)
        + ")"
    )
    for side, drains in (("on", scopes.on), ("off", scopes.off), ("no tools", scopes.tool_off)):
        print(
            f"  scopes {side:>8}: "
            + ", ".join(f"{d.spans_per_s:,.0f}" for d in drains)
            + " spans/s; worker cores "
            + ", ".join(f"{d.cores['worker 1']:.2f}" for d in drains)
        )
    print(
        f"  records the scopes added: {scopes.conversation_records:,} to the conversation"
        f" topic, {scopes.usage_records:,} to the agent usage topic,"
        f" {scopes.tool_call_records:,} to the tool call topic"
        f" ({repartition_records:,} repartition records carried the spans)"
    )


def scopes_result(scopes: ScopesRun, prefix: str) -> dict[str, object]:
    """One build's scope figures for the JSON line, under `prefix`."""
    figures: dict[str, object] = {
        f"{prefix}_spans_per_s": round(statistics.median(d.spans_per_s for d in scopes.on)),
        f"{prefix}_off_spans_per_s": round(statistics.median(d.spans_per_s for d in scopes.off)),
        f"{prefix}_to_off": round(scopes.ratio, 3),
        f"{prefix}_rounds_to_off": [round(r, 3) for r in scopes.ratios],
        f"{prefix}_tool_to_tool_off": round(scopes.tool_ratio, 3),
        f"{prefix}_rounds_tool_to_tool_off": [round(r, 3) for r in scopes.tool_ratios],
        f"{prefix}_tool_off_spans_per_s": round(
            statistics.median(d.spans_per_s for d in scopes.tool_off)
        ),
        f"{prefix}_drain_complete": all(d.done for d in scopes.on + scopes.off + scopes.tool_off),
        f"worker_cores_{prefix}": [round(d.cores["worker 1"], 2) for d in scopes.on],
        f"{prefix}_conversation_records": scopes.conversation_records,
        f"{prefix}_usage_records": scopes.usage_records,
        f"{prefix}_tool_call_records": scopes.tool_call_records,
    }
    if scopes.latency is not None:
        figures[f"{prefix}_latency_p50_ms"] = scopes.latency.p50
        figures[f"{prefix}_latency_p99_ms"] = scopes.latency.p99
        figures[f"{prefix}_kills_measured"] = scopes.latency.measured
    return figures


def met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def p99_target(latency: Latency) -> str:
    """The p99 target judged: under 100 ms, with every expected kill measured."""
    p99 = latency.p99
    ok = p99 is not None and p99 < 100 and latency.measured == latency.expected
    return f"{met(ok)} ({'-' if p99 is None else f'{p99:.0f} ms'} over {latency.measured} kills)"


# The second rate of the Collector's latency run by default (issue 46's target).
HIGH_RATE = 10_000.0


# A latency run that sent less than this share of the rate asked for is not judged at it.
RATE_REACHED = 0.95


def rate_target(latency: Latency) -> str:
    """The p99 target at a rate, or that the rate was not reached: the rate sent is shown."""
    if latency.offered < RATE_REACHED * latency.rate:
        return (
            f"NOT REACHED (offered {latency.rate:,.0f} spans/s, posted {latency.offered:,.0f};"
            f" p99 {'-' if latency.p99 is None else f'{latency.p99:.0f} ms'} at that)"
        )
    return p99_target(latency)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spans", type=int, default=100_000, help="spans per drain corpus")
    parser.add_argument("--traces", type=int, default=1_000, help="traces per drain corpus")
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3, help="core runs (best of)")
    parser.add_argument("--rate", type=float, default=2_000.0, help="latency run spans/s")
    parser.add_argument(
        "--rates",
        default=None,
        metavar="LIST",
        help="comma-separated spans/s of the latency runs through the Collector (phase"
        " collector), each judged against the p99 target (default: --rate and 10,000)",
    )
    parser.add_argument("--seconds", type=float, default=25.0, help="latency run length")
    parser.add_argument(
        "--latency-traces", type=int, default=1_500, help="traces in the latency run"
    )
    parser.add_argument(
        "--latency-loop-every",
        type=int,
        default=4,
        metavar="N",
        help="one trace in N of the latency runs loops: 375 kills at the defaults, so that a"
        " p99 is not just the slowest kill",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="sample the first worker with py-spy over its drains: the raw samples go to DIR"
        " (python -m bench.worker_profile DIR/worker-drain-one.txt, the synthetic producer's;"
        " DIR/worker-drain.txt, through the Collector; DIR/worker-drain-scopes-BUILD-on.txt and"
        " -off.txt, phase scopes)",
    )
    parser.add_argument(
        "--phases",
        default="one,latency,collector,scopes,fleet,compiled,two,faust",
        help="comma-separated subset of one,latency,collector,scopes,fleet,compiled,two,faust"
        " (one is always run); with collector, the two-worker drain goes through the Collector"
        " too, and scopes drains it again (and runs latency) with the conversation, agent and"
        " tool scopes on; fleet times the fleet incidents through a Collector of its own;"
        " compiled drains a compiled worker through the packing Collector",
    )
    parser.add_argument(
        "--worker-arg", action="append", default=[], help="extra `spanguard worker` argument"
    )
    parser.add_argument(
        "--worker-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="environment for the workers and the pass-through (e.g. SPANGUARD_BATCH_SIZE=1000)",
    )
    parser.add_argument(
        "--message-spans",
        default="1,3",
        metavar="LOW,HIGH",
        help="spans per message, uniformly (the Collector's batch timeout decides it)",
    )
    parser.add_argument("--drain-timeout", type=float, default=120.0)
    parser.add_argument(
        "--scope-rounds",
        type=int,
        default=5,
        help="phase scopes: corpora drained through both the scope-on and a scope-off worker",
    )
    parser.add_argument(
        "--scope-builds",
        default="compiled,python",
        help="phase scopes: the core builds its workers run, each pair in turn (compiled: the"
        " worker image's, from build/compiled-core: `python scripts/compiled_core.py build`;"
        " python: a plain install's); the first is judged and runs the latency run",
    )
    parser.add_argument(
        "--core-rate",
        action="store_true",
        help="print the core's spans/s over the drain corpus as JSON and exit (phase compiled"
        " runs it under scripts/compiled_core.py run)",
    )
    parser.add_argument(
        "--fleet-incidents",
        type=int,
        default=8,
        help="phase fleet: tools failing one after another, an incident each",
    )
    parser.add_argument(
        "--fleet-segment",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="phase fleet: seconds between two tools starting to fail (at --rate)",
    )
    parser.add_argument(
        "--conversations",
        action="store_true",
        help="every span of the drain and latency corpora names its trace's conversation, six"
        " traces a conversation (the conversation scope's load, with a policy that turns it on:"
        " --worker-arg=--policy=FILE)",
    )
    args = parser.parse_args(argv)
    args.phase_set = set(args.phases.split(","))
    rates = args.rates.split(",") if args.rates else [args.rate, HIGH_RATE]
    args.rate_list = list(dict.fromkeys(float(rate) for rate in rates))
    args.builds = [build for build in args.scope_builds.split(",") if build]
    unknown = [build for build in args.builds if build not in BUILDS]
    if unknown or not args.builds:
        parser.error(f"--scope-builds: {unknown or 'none'}; choose from {', '.join(BUILDS)}")
    compiled_wanted = args.phase_set & {"scopes", "fleet"} and "compiled" in args.builds
    if (compiled_wanted or "compiled" in args.phase_set) and not compiled_core_built():
        parser.error(
            "--scope-builds compiled: nothing in build/compiled-core; run"
            " `python scripts/compiled_core.py build` (make bench-pipeline does) or pass"
            " --scope-builds python"
        )
    return args


@dataclass
class Run:
    """One run of the benchmark: its arguments, corpora, live processes, what each phase
    measured, and `result`, the JSON line printed last. Each phase reads and adds to it."""

    args: argparse.Namespace
    started: float  # time.monotonic() at the start, for the closing line
    # The corpora (built by `corpora`): drain, second drain (phase two), latency run; the
    # Collector's (phase collector) and the scope rounds' (phase scopes) with fresh trace ids.
    corpus: Corpus | None = None
    messages: list[tuple[bytes, bytes, list[str]]] | None = None
    second: Corpus | None = None
    paced: list[tuple[bytes, bytes, list[str]]] | None = None
    expected: dict[str, str] | None = None
    corpus_c: Corpus | None = None
    latency_c: Corpus | None = None
    expected_c: dict[str, str] | None = None
    # The Collector's latency runs at the rates after the first of --rates: (rate, corpus,
    # expected kills) each.
    latency_rates: list[tuple[float, Corpus, dict[str, str]]] | None = None
    # The packing Collector's (phase collector): drain, latency run, and the stage profiles'
    # drains of both Collectors (with py-spy).
    corpus_p: Corpus | None = None
    latency_p: Corpus | None = None
    expected_p: dict[str, str] | None = None
    latency_rates_p: list[tuple[float, Corpus, dict[str, str]]] | None = None  # as latency_rates
    profile_c: Corpus | None = None
    profile_p: Corpus | None = None
    rounds_s: list[Corpus] | None = None
    latency_s: Corpus | None = None
    warmup_s: Corpus | None = None
    expected_s: dict[str, str] | None = None
    # Phase fleet's requests, and the tool failing in each of its segments.
    fleet_requests: list[bytes] | None = None
    fleet_tools: list[str] | None = None
    corpus_k: Corpus | None = None  # phase compiled's drain (the packing Collector's)
    per_message: float = 0.0
    # Live: the topics, the admin client, the workers and the Collector (stopped at the end).
    topics: Topics | None = None
    admin: AdminClient | None = None
    workers: list[WorkerProcess] | None = None
    shipped: ShippedCollector | None = None
    packing: ShippedCollector | None = None
    # Measured.
    core: float = 0.0
    one: Drain | None = None
    latency: Latency | None = None
    fed: Fed | None = None
    fed_latency: Latency | None = None
    rate_latencies: list[Latency] | None = None  # at each rate after the first of --rates
    fed_packed: Fed | None = None
    packed_latency: Latency | None = None
    packed_rate_latencies: list[Latency] | None = None  # at each rate after the first of --rates
    two: Drain | None = None
    scope_runs: list[ScopesRun] | None = None
    fleet: FleetTimes | None = None
    compiled_packed: float | None = None  # compiled worker's spans/s to the compiled core's
    floor: Floor | None = None
    result: dict[str, object] | None = None

    @property
    def phases(self) -> set[str]:
        return self.args.phase_set


def build_corpora(run: Run) -> None:
    """Every corpus the chosen phases drain, built before anything is timed."""
    args, phases = run.args, run.phases
    started = time.perf_counter()
    low, high = (int(n) for n in args.message_spans.split(","))
    mix: dict[str, Any] = {"per_trace": True, "message_spans": (low, high)}
    corpus = build_corpus(args.spans, args.traces, seed=7, **mix)
    messages = keyed_messages(
        with_conversations(corpus.requests) if args.conversations else corpus.requests
    )
    run.corpus, run.messages = corpus, messages
    run.second = build_corpus(args.spans, args.traces, seed=9, **mix) if "two" in phases else None
    loops = {"loop_every": args.latency_loop_every}
    latency_corpus = build_corpus(
        int(args.rate * args.seconds), args.latency_traces, seed=8, **mix, **loops
    )
    run.paced = paced = keyed_messages(
        with_conversations(latency_corpus.requests, prefix="latency-conv")
        if args.conversations
        else latency_corpus.requests
    )
    run.expected = expected = expected_kills(latency_corpus.requests)
    # Fresh trace ids for the Collector's drain and latency run.
    run.expected_c = {}
    if "collector" in phases:
        run.corpus_c = corpus_c = build_corpus(args.spans, args.traces, seed=11, **mix)
        first_rate, *more_rates = args.rate_list
        run.latency_c = latency_c = build_corpus(
            int(first_rate * args.seconds), args.latency_traces, seed=12, **mix, **loops
        )
        run.expected_c = expected_kills(latency_c.requests)
        run.latency_rates = []
        for index, rate in enumerate(more_rates if "latency" in phases else []):
            more = build_corpus(
                int(rate * args.seconds), args.latency_traces, seed=40 + index, **mix, **loops
            )
            if args.conversations or "scopes" in phases:
                more.requests = with_conversations(more.requests, prefix=f"latency-{index}-conv")
            run.latency_rates.append((rate, more, expected_kills(more.requests)))
        run.corpus_p = build_corpus(args.spans, args.traces, seed=16, **mix)
        run.latency_p = build_corpus(
            int(first_rate * args.seconds), args.latency_traces, seed=17, **mix, **loops
        )
        run.expected_p = expected_kills(run.latency_p.requests)
        run.latency_rates_p = []
        for index, rate in enumerate(more_rates if "latency" in phases else []):
            more = build_corpus(
                int(rate * args.seconds), args.latency_traces, seed=60 + index, **mix, **loops
            )
            run.latency_rates_p.append((rate, more, expected_kills(more.requests)))
        if stage_profiles_wanted():
            half = (args.spans // 2, args.traces // 2)
            run.profile_c = build_corpus(*half, seed=18, **mix)
            run.profile_p = build_corpus(*half, seed=19, **mix)
        # The Collector's corpora carry the scope's load too; with phase `scopes`, whose run
        # they are the scope-off half of, always.
        if args.conversations or "scopes" in phases:
            corpus_c.requests = with_conversations(corpus_c.requests, prefix="collector-conv")
            latency_c.requests = with_conversations(latency_c.requests, prefix="latency-c-conv")
    run.rounds_s = []
    run.expected_s = {}
    if "scopes" in phases and "collector" in phases:
        for round_index in range(args.scope_rounds):
            corpus_s = build_corpus(args.spans, args.traces, seed=13 + 10 * round_index, **mix)
            corpus_s.requests = with_conversations(
                corpus_s.requests, prefix=f"scopes-{round_index}-conv"
            )
            run.rounds_s.append(corpus_s)
        run.warmup_s = warmup_s = build_corpus(args.spans // 10, args.traces // 10, seed=15, **mix)
        warmup_s.requests = with_conversations(warmup_s.requests, prefix="warmup-conv")
        if "latency" in phases:
            run.latency_s = latency_s = build_corpus(
                int(args.rate * args.seconds), args.latency_traces, seed=14, **mix, **loops
            )
            run.expected_s = expected_kills(latency_s.requests)
            latency_s.requests = with_conversations(latency_s.requests, prefix="latency-s-conv")
    if "compiled" in phases:
        run.corpus_k = build_corpus(args.spans, args.traces, seed=21, **mix)
    if "fleet" in phases:
        run.fleet_requests, run.fleet_tools = fleet_corpus(
            args.rate, args.fleet_segment, args.fleet_incidents, mix
        )
    run.per_message = corpus.spans / len(messages)
    print(
        f"corpus: {corpus.spans:,} spans in {len(messages):,} one-trace messages"
        f" ({run.per_message:.2f} spans each, {low}-{high}) over {args.traces:,} traces"
        f" ({sum(map(len, corpus.requests)) / 1e6:.1f} MB); latency run:"
        f" {latency_corpus.spans:,} spans in {len(paced):,} messages over"
        f" {args.latency_traces:,} traces, {len(expected)} loops to kill"
        f" (built in {time.perf_counter() - started:.1f}s)"
    )


def core_before(run: Run) -> None:
    """The core over the same requests, best of runs, before the workers start and after
    they stop (`core_after`): other load on a shared machine only ever slows a run down."""
    assert run.corpus is not None
    runs = run.args.runs
    core = run.core = core_rate(run.corpus.requests, run.corpus.spans, runs)
    print(f"core (Guard().process, same requests, best of {runs}): {core:12,.0f} spans/s")


def start_first_worker(run: Run) -> None:
    """The topics, then one worker, probed until it takes spans from every partition."""
    topics, admin, args = run.topics, run.admin, run.args
    assert topics is not None and admin is not None and run.workers is not None
    # The repartition topic's append times split the Collector's latency into stages, the
    # trace table changelog's tell when the worker flushed its states.
    timed = [topics.input, topics.kills, topics.repartition, changelog_of(topics)]
    create_timed_topics(admin, timed, args.partitions)
    create_worker_topics(topics, args.partitions)
    run.workers.append(start_worker(topics, args.partitions, args))
    probe(topics.input, args.partitions, run.workers, seed=101)


def phase_one(run: Run) -> None:
    """1. One worker drains a backlog."""
    args, topics, workers = run.args, run.topics, run.workers
    assert topics is not None and workers is not None and run.corpus is not None
    assert run.messages is not None and run.result is not None
    one = run.one = drain(
        topics.input, run.messages, run.corpus.spans, workers, args.drain_timeout,
        Profiler(args.profile, "worker-drain-one.txt") if args.profile else None,
    )  # fmt: skip
    print(
        f"pipeline (1 worker, {args.partitions} partitions): {one.spans_per_s:12,.0f} spans/s"
        f" = {one.spans_per_s / run.core:.3f} of the core so far"
        f" ({one.messages_per_s:,.0f} messages/s)"
        + ("" if one.done else "  [INCOMPLETE]")
        + f"; produced in {one.produce_s:.1f}s ({one.before_done:.0%} processed meanwhile),"
        f" then drained in {one.seconds:.1f}s"
    )
    print(f"  during the drain: {one.meter.text(one.cores)}")
    run.result.update(
        {
            "pipeline_spans_per_s": round(one.spans_per_s),
            "spans_per_message": round(run.per_message, 2),
            "store": worker_store(workers[0]),
            "partitions": args.partitions,
            "drain_complete": one.done,
            "worker_cores_drain": round(one.cores["worker 1"], 2),
            "other_cores_drain": round(one.cores["others"], 2),
        }
    )


def phase_latency(run: Run) -> None:
    """2. Detection latency at a steady rate."""
    if "latency" not in run.phases:
        return
    assert run.workers and run.topics is not None and run.result is not None
    assert run.paced is not None and run.expected is not None
    latency = run.latency = latency_run(
        run.workers[0], run.topics, run.paced, run.expected, run.args.rate, run.args.seconds
    )
    run.result.update(
        {
            "latency_p50_ms": latency.p50,
            "latency_p99_ms": latency.p99,
            "latency_max_ms": latency.max,
            "kills_measured": latency.measured,
            "kills_expected": latency.expected,
            "other_cores_latency": round(latency.cores["others"], 2),
        }
    )


def phase_collector(run: Run) -> None:
    """2b. The same through the shipped Collector."""
    corpus_c, latency_c = run.corpus_c, run.latency_c
    if corpus_c is None or latency_c is None:
        return
    args, topics, workers, result = run.args, run.topics, run.workers, run.result
    assert topics is not None and workers is not None and result is not None
    assert run.corpus is not None and run.one is not None and run.expected_c is not None
    shipped = run.shipped = ShippedCollector(topics.input)
    print(f"collector: {COLLECTOR_SH.name} up with deploy/collector/config.yaml")
    fed = run.fed = drain_through_collector(
        shipped, topics, args.partitions, corpus_c.requests, corpus_c.spans, workers,
        args.drain_timeout, Profiler(args.profile) if args.profile else None,
    )  # fmt: skip
    per_input, per_hop = fed.spans_per_record(corpus_c.spans)
    print(
        f"pipeline through the Collector (1 worker): {fed.drain.spans_per_s:12,.0f}"
        f" spans/s = {fed.drain.spans_per_s / run.core:.3f} of the core so far"
        + ("" if fed.drain.done else "  [INCOMPLETE]")
        + f"; {per_input:.1f} spans per input record ({fed.input_records:,} records),"
        f" {per_hop:.1f} per repartition record ({fed.repartition_records:,});"
        f" posted in {fed.drain.produce_s:.1f}s, done in {fed.drain.seconds:.1f}s"
    )
    print(f"  during the drain: {fed.drain.meter.text(fed.drain.cores)}")
    # Spans per second of the worker's own CPU: what the worker would move on a core of
    # its own, whatever else this machine ran meanwhile (the core runs on one).
    per_cpu = per_worker_cpu(fed.drain)
    synthetic_per_cpu = per_worker_cpu(run.one)
    core_cpu = core_rate(run.corpus.requests, run.corpus.spans, args.runs, cpu=True)
    print(
        f"  per worker CPU second: {per_cpu:,.0f} spans through the Collector"
        f" ({per_cpu / core_cpu:.3f} of the core's {core_cpu:,.0f} per CPU second),"
        f" {synthetic_per_cpu:,.0f} from the synthetic producer"
        f" ({synthetic_per_cpu / core_cpu:.3f})"
    )
    result.update(
        {
            "collector_spans_per_s": round(fed.drain.spans_per_s),
            "collector_spans_per_input_record": round(per_input, 1),
            "collector_spans_per_repartition_record": round(per_hop, 1),
            "collector_drain_complete": fed.drain.done,
            "worker_cores_collector": round(fed.drain.cores["worker 1"], 2),
            "collector_spans_per_worker_cpu_s": round(per_cpu),
            "pipeline_spans_per_worker_cpu_s": round(synthetic_per_cpu),
            "core_spans_per_cpu_s": round(core_cpu),
            "collector_per_cpu_to_core": round(per_cpu / core_cpu, 3),
        }
    )
    if "latency" in run.phases:
        fed_latency, stages = latency_through_collector(
            workers[0], topics, args.partitions, shipped, latency_c.requests,
            run.expected_c, args.rate_list[0], args.seconds,
        )  # fmt: skip
        run.fed_latency = fed_latency
        result.update(
            {
                "collector_latency_p50_ms": fed_latency.p50,
                "collector_latency_p99_ms": fed_latency.p99,
                "collector_kills_measured": fed_latency.measured,
                "collector_latency_posted_spans_per_s": round(fed_latency.offered),
                "collector_latency_stages_p99_ms": {
                    name: figures["p99"] for name, figures in stages.items()
                },
            }
        )
        latencies_at_rates(run)


def latencies_at_rates(run: Run) -> None:
    """The Collector's latency run again at each rate after the first of --rates."""
    assert run.shipped is not None
    run.rate_latencies = latencies_through(run, run.shipped, run.latency_rates, "collector")


def latencies_through(
    run: Run,
    collector: ShippedCollector,
    corpora: list[tuple[float, Corpus, dict[str, str]]] | None,
    prefix: str,
    packed: bool = False,
) -> list[Latency]:
    """A latency run through `collector` at each (rate, corpus, expected kills) of `corpora`,
    its figures in the JSON line as `PREFIX_latency_RATE_*`."""
    args, topics, workers, result = run.args, run.topics, run.workers, run.result
    assert topics is not None and workers and result is not None
    latencies = []
    for rate, corpus, expected in corpora or []:
        latency, stages = latency_through_collector(
            workers[0], topics, args.partitions, collector, corpus.requests, expected, rate,
            args.seconds, packed=packed,
        )  # fmt: skip
        latency.rate = rate
        latencies.append(latency)
        name = f"{prefix}_latency_{rate:.0f}"
        result.update(
            {
                f"{name}_p50_ms": latency.p50,
                f"{name}_p99_ms": latency.p99,
                f"{name}_kills_measured": latency.measured,
                f"{name}_posted_spans_per_s": round(latency.offered),
                f"{name}_stages_p99_ms": {name: figures["p99"] for name, figures in stages.items()},
            }
        )
    return latencies


def phase_packed(run: Run) -> None:
    """2d. The same through the project's Collector build packing by partition (packed.yaml):
    every input record decided where it lands, no repartition hop."""
    corpus_p, latency_p = run.corpus_p, run.latency_p
    if corpus_p is None or latency_p is None or run.fed is None:
        return
    args, topics, workers, result = run.args, run.topics, run.workers, run.result
    assert topics is not None and workers is not None and result is not None
    assert run.expected_p is not None
    packing = run.packing = ShippedCollector(topics.input, PACKED)
    print(f"packing collector: {COLLECTOR_SH.name} up with config.yaml + packed.yaml")
    fed = run.fed_packed = drain_through_collector(
        packing, topics, args.partitions, corpus_p.requests, corpus_p.spans, workers,
        args.drain_timeout,
    )  # fmt: skip
    per_input, _ = fed.spans_per_record(corpus_p.spans)
    rate, baseline = fed.drain.spans_per_s, run.fed.drain.spans_per_s
    print(
        f"pipeline through the packing Collector (1 worker): {rate:12,.0f} spans/s"
        f" = {rate / run.core:.3f} of the core so far, {rate / baseline:.2f}x the repartition"
        f" path's {baseline:,.0f}"
        + ("" if fed.drain.done else "  [INCOMPLETE]")
        + f"; {per_input:.1f} spans per input record ({fed.input_records:,} records),"
        f" {fed.repartition_records:,} repartition records; done in {fed.drain.seconds:.1f}s"
    )
    print(f"  during the drain: {fed.drain.meter.text(fed.drain.cores)}")
    # Per worker CPU second, against the core's per CPU second (phase collector's figure):
    # what a loaded shared machine moves least.
    per_cpu = per_worker_cpu(fed.drain)
    core_cpu = result.get("core_spans_per_cpu_s")
    per_cpu_to_core = per_cpu / core_cpu if isinstance(core_cpu, int) and core_cpu else 0.0
    print(
        f"  per worker CPU second: {per_cpu:,.0f} spans through the packing Collector"
        f" ({per_cpu_to_core:.3f} of the core's per CPU second), against"
        f" {per_worker_cpu(run.fed.drain):,.0f} on the repartition path"
    )
    result.update(
        {
            "packed_per_cpu_to_core": round(per_cpu_to_core, 3),
            "packed_spans_per_s": round(rate),
            "packed_to_repartition_path": round(rate / baseline, 2),
            "packed_spans_per_input_record": round(per_input, 1),
            "packed_repartition_records": fed.repartition_records,
            "packed_drain_complete": fed.drain.done,
            "worker_cores_packed": round(fed.drain.cores["worker 1"], 2),
            "packed_spans_per_worker_cpu_s": round(per_cpu),
        }
    )
    if "latency" in run.phases:
        latency, stages = latency_through_collector(
            workers[0], topics, args.partitions, packing, latency_p.requests,
            run.expected_p, args.rate_list[0], args.seconds, packed=True,
        )  # fmt: skip
        run.packed_latency = latency
        result.update(
            {
                "packed_latency_p50_ms": latency.p50,
                "packed_latency_p99_ms": latency.p99,
                "packed_kills_measured": latency.measured,
                "packed_latency_stages_p99_ms": {
                    name: figures["p99"] for name, figures in stages.items()
                },
            }
        )
        run.packed_rate_latencies = latencies_through(
            run, packing, run.latency_rates_p, "packed", packed=True
        )


def stage_profiles_wanted() -> bool:
    """The stage table needs py-spy (the dev extra's, or named by PY_SPY)."""
    return find_py_spy() is not None


def phase_stages(run: Run) -> None:
    """2e. Where a span's worker time goes on each Collector path, by stage: a drain of half
    the corpus through each, the worker sampled by py-spy (so not the drains timed above)."""
    if run.profile_c is None or run.profile_p is None or run.packing is None:
        if "collector" in run.phases:
            print("stages: py-spy not found (make install, or PY_SPY): no per-stage table")
        return
    args, topics, workers, result = run.args, run.topics, run.workers, run.result
    assert topics is not None and workers is not None and result is not None
    assert run.shipped is not None
    directory = args.profile or Path(tempfile.mkdtemp(prefix="spanguard-bench-stages-"))
    tables: dict[str, dict[str, float]] = {}
    for path, collector, corpus in (
        ("repartition", run.shipped, run.profile_c),
        ("packed", run.packing, run.profile_p),
    ):
        profiler = Profiler(directory, f"worker-stages-{path}.txt")
        fed = drain_through_collector(
            collector, topics, args.partitions, corpus.requests, corpus.spans, workers,
            args.drain_timeout, profiler,
        )  # fmt: skip
        summary = summarize(profiler.raw) if profiler.raw.exists() else None
        if summary is None:
            continue
        # The worker's CPU per span, shared out by where its samples fell.
        cpu_us = fed.drain.cores["worker 1"] * fed.drain.seconds / max(corpus.spans, 1) * 1e6
        tables[path] = {stage: round(share * cpu_us, 1) for stage, share in summary.stages}
        tables[path]["total"] = round(cpu_us, 1)
    print_stage_table(tables)
    result["stage_us_per_span"] = tables


def print_stage_table(tables: dict[str, dict[str, float]]) -> None:
    paths = list(tables)
    if not paths:
        print("stages: no samples")
        return
    print("worker CPU per span by stage, us (py-spy shares of the worker's CPU per span):")
    print("  " + f"{'stage':10}" + "".join(f"{path:>14}" for path in paths))
    for stage in [*STAGE_NAMES, "total"]:
        print("  " + f"{stage:10}" + "".join(f"{tables[path][stage]:14.1f}" for path in paths))


def phase_two(run: Run) -> None:
    """2g. The worker image's build on the packed path (phase `compiled`): the compiled core's rate
       over the drain corpus, in a process of its own (scripts/compiled_core.py run, this module's
       `--core-rate`), then a compiled worker with topics and a packing Collector of its own
       drains a corpus; its spans/s against that rate is judged against 0.25.
    3. Two workers."""
    second = run.second
    if second is None:
        return
    args, topics, admin, workers = run.args, run.topics, run.admin, run.workers
    assert topics is not None and admin is not None and workers is not None
    assert run.one is not None and run.result is not None
    workers.append(start_worker(topics, args.partitions, args))
    held = wait_for_group(admin, topics.app_id, topics.input, 2)
    took = probe(topics.input, args.partitions, workers, seed=102)
    print(
        f"two workers: input partitions held {held[0]}+{held[1]}; probe spans taken"
        f" {took[0]:.0f}+{took[1]:.0f}"
    )
    # Through the Collector when it ran: compared with one worker's drain the same way.
    one_rate = run.fed.drain.spans_per_s if run.fed is not None else run.one.spans_per_s
    shipped = run.shipped
    if shipped is not None:
        two = drain_through_collector(
            shipped, topics, args.partitions, second.requests, second.spans, workers,
            args.drain_timeout,
        ).drain  # fmt: skip
    else:
        two = drain(
            topics.input, keyed_messages(second.requests), second.spans, workers,
            args.drain_timeout,
        )  # fmt: skip
    run.two = two
    print(
        f"pipeline (2 workers, {args.partitions} partitions"
        + (", through the Collector" if shipped is not None else "")
        + f"): {two.spans_per_s:12,.0f}"
        f" spans/s = {two.spans_per_s / one_rate:.2f}x one worker"
        + ("" if two.done else "  [INCOMPLETE]")
        + f"; spans per worker {two.per_worker[0]:,.0f} + {two.per_worker[1]:,.0f}"
        f" in {two.seconds:.1f}s"
    )
    print(f"  during the drain: {two.meter.text(two.cores)}")
    run.result.update(
        {
            "two_workers_spans_per_s": round(two.spans_per_s),
            "two_to_one": round(two.spans_per_s / one_rate, 2),
            "two_worker_cores": [
                round(two.cores["worker 1"], 2),
                round(two.cores["worker 2"], 2),
            ],
            "other_cores_two": round(two.cores["others"], 2),
        }
    )


def stop_workers(run: Run) -> None:
    """The workers and the Collector of the phases above stop before the scope phase's."""
    assert run.workers is not None
    for worker in run.workers:
        stop_worker(worker)
    run.workers.clear()
    if run.shipped is not None:
        run.shipped.close()
        run.shipped = None
    if run.packing is not None:
        run.packing.close()
        run.packing = None


def phase_scopes(run: Run) -> None:
    """2c. The same with the conversation, agent and tool scopes on, per core build."""
    run.scope_runs = []
    rounds_s, warmup_s, fed = run.rounds_s, run.warmup_s, run.fed
    if not (rounds_s and warmup_s is not None and fed is not None):
        return
    assert run.admin is not None and run.result is not None and run.expected_s is not None
    builds = run.args.builds
    for index, build in enumerate(builds):
        scopes = scopes_run(
            run.args, run.admin, warmup_s, rounds_s, run.latency_s if index == 0 else None,
            run.expected_s, build,
        )  # fmt: skip
        run.scope_runs.append(scopes)
        print_scopes(scopes, fed.repartition_records)
        # The first build's figures under the keys of earlier releases, the others' with
        # their build in the key.
        prefix = "scopes" if index == 0 else f"scopes_{build}"
        run.result.update(scopes_result(scopes, prefix))
    run.result["scopes_core_builds"] = builds


# The fleet phase: the issue's fleet of 200 agents, a trace each, calling the corpus's tools.
FLEET_AGENTS = 200
FLEET_POLICY = "fleet: {enabled: true}\n"  # the shipped fleet rules, turned on
STATUS_ERROR = Status.STATUS_CODE_ERROR


def fleet_corpus(
    rate: float, segment_s: float, incidents: int, mix: dict[str, Any]
) -> tuple[list[bytes], list[str]]:
    """The bench corpus as FLEET_AGENTS agents, laid out at `rate` spans/s over `incidents`
    segments of `segment_s` seconds. In segment k every tool is named NAME-k (fresh keys, so
    each segment's incident is counted from nothing, as a tool breaking in a healthy fleet
    is) and one of them, TOOLS[k % 6]-k, fails for every agent from a third of the segment
    on. Returns the requests and the failing tool of each segment."""
    corpus = build_corpus(
        int(rate * segment_s * incidents), FLEET_AGENTS, seed=61, loop_every=10**9, **mix
    )
    requests, spans = [], 0
    for data in corpus.requests:
        request = ExportTraceServiceRequest.FromString(data)
        at = spans / rate
        segment = min(int(at // segment_s), incidents - 1)
        failing = at - segment * segment_s >= segment_s / 3
        broken = TOOLS[segment % len(TOOLS)]
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    spans += 1
                    for attribute in span.attributes:
                        if attribute.key != "gen_ai.tool.name":
                            continue
                        tool = attribute.value.string_value
                        attribute.value.string_value = f"{tool}-{segment}"
                        if failing and tool == broken:
                            span.status.code = STATUS_ERROR
        requests.append(request.SerializeToString())
    return requests, [f"{TOOLS[k % len(TOOLS)]}-{k}" for k in range(incidents)]


@dataclass
class FleetTimes:
    """Phase fleet: each failing tool's decision time, crossing to incident record."""

    decision_ms: list[int]  # incident record's append - arrival of the span that crossed
    failing: int  # tools that failed for the fleet (one incident expected each)
    crossed: int  # ... whose threshold the oracle saw crossed in the run
    opened: int  # incidents of those tools on the detections topic
    others: int  # incident records of any other tool or rule
    at_crossing: int  # incidents whose span time is the oracle's crossing span's
    tool_call_records: int
    step_s: int

    @property
    def p50(self) -> float | None:
        return percentile(list(map(float, self.decision_ms)), 0.5) if self.decision_ms else None

    @property
    def p99(self) -> float | None:
        return percentile(list(map(float, self.decision_ms)), 0.99) if self.decision_ms else None


def fleet_crossings(bodies: list[bytes], tools: list[str]) -> dict[str, FleetCall]:
    """The call of each of `tools` on which `tool_failing` crossed, by the oracle of
    tests/support/fleet.py (recounted from scratch on every call), over the calls as posted."""
    calls = [
        event
        for body in bodies
        for event in fleet_events(body, None, lambda time_ns: time_ns)
        if isinstance(event, FleetCall) and not event.tool.startswith("model:")
    ]
    policy = FleetPolicy(enabled=True)
    crossings = {tool: first_crossing(calls, tool, policy) for tool in tools}
    return {tool: call for tool, call in crossings.items() if call is not None}


def fleet_decision_times(
    records: list[dict[str, Any]], crossings: dict[str, FleetCall], tools: list[str]
) -> tuple[list[int], int, int, int]:
    """Per incident of a failing tool: its record's append (ms) - the crossing span's arrival
    (its end time, the moment its body was posted). Returns those, the incidents of the
    failing tools opened, the other incident records, and the incidents whose span time is the
    oracle's crossing span's."""
    decision_ms: list[int] = []
    opened = others = at_crossing = 0
    seen: set[str] = set()
    for record in sorted(records, key=lambda record: record["timestamp_ms"]):
        incident = json.loads(record["value"])
        if incident.get("scope") != "tool" or incident.get("action") == "recovered":
            continue
        # An incident's record taken again (a batch decided again) has the same decision id.
        if incident.get("decision_id") in seen:
            continue
        seen.add(str(incident.get("decision_id")))
        tool = incident.get("tool")
        if tool not in tools or incident.get("rule") != "tool_failing":
            others += 1
            continue
        opened += 1
        crossing = crossings.get(tool)
        if crossing is None:
            continue
        arrived_ms = crossing.end_time_unix_nano // 1_000_000
        decision_ms.append(record["timestamp_ms"] - arrived_ms)
        ended = datetime.fromisoformat(incident["span_ended_at"]).timestamp() * 1000
        at_crossing += abs(ended - arrived_ms) <= 1
    return decision_ms, opened, others, at_crossing


def fleet_run(
    args: argparse.Namespace, admin: AdminClient, requests: list[bytes], tools: list[str]
) -> FleetTimes:
    """A worker with the fleet rules on (FLEET_POLICY, the first of --scope-builds), its own
    topics and Collector; `requests` posted at --rate, each span ending as it is posted; the
    detections topic read for the incidents."""
    policy = Path(tempfile.mkdtemp(prefix="spanguard-bench-fleet-")) / "policy.yaml"
    policy.write_text(FLEET_POLICY)
    fleet_args = argparse.Namespace(
        **{**vars(args), "worker_arg": [*args.worker_arg, f"--policy={policy}"]}
    )
    topics = Topics()
    timed = [topics.input, topics.kills, topics.repartition, topics.detections]
    create_timed_topics(admin, [*timed, changelog_of(topics)], args.partitions)
    create_worker_topics(topics, args.partitions)
    worker = start_worker(topics, args.partitions, fleet_args, args.builds[0])
    collector = ShippedCollector(topics.input)
    reader = Collector(topics.detections)
    step = FleetPolicy().step
    try:
        probe(topics.input, args.partitions, [worker], seed=105)
        # (The harness started it above: its process is set.)
        meter = CpuMeter({"worker": worker.process.pid, "collector": collector.pid})  # type: ignore[union-attr]
        posted = post_paced(collector, requests, args.rate, args.fleet_segment * len(tools) * 1.5)
        cores = meter.cores()
        print(
            f"fleet run through the Collector (1 worker, {BUILDS[args.builds[0]]}, fleet rules"
            f" on): {posted.spans:,} spans of {FLEET_AGENTS} agents in {posted.seconds:.1f}s ="
            f" {posted.spans / posted.seconds:,.0f} spans/s posted ({args.rate:,.0f} offered);"
            f" {len(tools)} tools failing, one each {args.fleet_segment:.0f}s; {meter.text(cores)}"
        )

        def incidents() -> list[dict[str, Any]]:
            return reader.where(lambda record: json.loads(record["value"]).get("scope") == "tool")

        def tools_opened() -> set[str]:
            """The failing tools with an incident opened (a recovery record is not one)."""
            found = (json.loads(record["value"]) for record in incidents())
            return {
                incident.get("tool")
                for incident in found
                if incident.get("action") != "recovered" and incident.get("tool") in tools
            }

        deadline = time.monotonic() + step + 15.0
        while time.monotonic() < deadline and len(tools_opened()) < len(tools):
            time.sleep(0.2)
        time.sleep(1.0)  # a second incident of a tool, were there one
        records = incidents()
        if len(tools_opened()) < len(tools):  # what the worker counted, to tell why
            counted = {
                name: value
                for name, value in (worker.metrics() or {}).items()
                if "tool_call" in name or "tool_scope" in name or "dead_letter" in name
            }
            print(f"fleet: incidents missing; the worker's counts {counted}\n{worker.log_tail()}")
        metadata = admin.list_topics(timeout=10).topics
        tool_call_records = topic_records(
            topics.tool_calls, len(metadata[topics.tool_calls].partitions)
        )
    finally:
        reader.close()
        stop_worker(worker)
        collector.close()
        delete_topics(admin, topics.prefix)
        shutil.rmtree(policy.parent, ignore_errors=True)
    crossings = fleet_crossings(posted.bodies, tools)
    decision_ms, opened, others, at_crossing = fleet_decision_times(records, crossings, tools)
    return FleetTimes(
        decision_ms, len(tools), len(crossings), opened, others, at_crossing, tool_call_records,
        step,
    )  # fmt: skip


def phase_fleet(run: Run) -> None:
    """2f. Fleet decision time: one tool after another failing for a fleet of agents, through
    the Collector; from the span that crossed the threshold to the incident's record."""
    if run.fleet_requests is None or run.fleet_tools is None:
        return
    assert run.admin is not None and run.result is not None
    fleet = run.fleet = fleet_run(run.args, run.admin, run.fleet_requests, run.fleet_tools)
    times = sorted(fleet.decision_ms)
    figures = (
        f"p50 {fleet.p50:,.0f} ms, p99 {fleet.p99:,.0f} ms,"
        f" max {times[-1]:,} ms over {len(times)} incidents"
        if times
        else "no incident measured"
    )
    print(
        f"fleet decision time (the crossing span's arrival -> the incident's append on the"
        f" detections topic): {figures}; {fleet.failing} tools failed, the oracle saw"
        f" {fleet.crossed} cross, {fleet.opened} incidents opened on them"
        f" ({fleet.at_crossing} at the oracle's crossing span), {fleet.others} other incident"
        f" records; {fleet.tool_call_records:,} tool call records"
    )
    run.result.update(
        {
            "fleet_decision_p50_ms": fleet.p50,
            "fleet_decision_p99_ms": fleet.p99,
            "fleet_decision_ms": times,
            "fleet_incidents_expected": fleet.failing,
            "fleet_incidents_crossed": fleet.crossed,
            "fleet_incidents_opened": fleet.opened,
            "fleet_other_incident_records": fleet.others,
            "fleet_tool_call_records": fleet.tool_call_records,
        }
    )


def fleet_target(fleet: FleetTimes) -> str:
    """Every failing tool's incident, p99 within one window step."""
    p99 = fleet.p99
    whole = fleet.opened == fleet.failing == len(fleet.decision_ms)
    ok = whole and p99 is not None and p99 <= fleet.step_s * 1000
    shown = "-" if p99 is None else f"{p99:,.0f} ms"
    return f"{met(ok)} ({shown} over {len(fleet.decision_ms)} of {fleet.failing} incidents)"


def compiled_core_rate(args: argparse.Namespace) -> float:
    """The compiled core's spans/s over the drain corpus (best of --runs), in a process of its
    own that imports the wheel's core first (scripts/compiled_core.py run)."""
    command = [sys.executable, str(ROOT / "scripts" / "compiled_core.py"), "run"]
    command += ["-m", "bench.bench_pipeline", "--core-rate", "--runs", str(args.runs)]
    command += ["--spans", str(args.spans), "--traces", str(args.traces)]
    command += ["--message-spans", args.message_spans]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"the compiled core's rate: {done.stderr[-2000:]}")
    return float(json.loads(done.stdout.strip().splitlines()[-1])["core_spans_per_s"])


def phase_compiled(run: Run) -> None:
    """2g. The worker image's build on the packed path: a compiled worker, topics and a packing
    Collector of its own, drains a corpus; against the compiled core's rate over the drain
    corpus, measured just before in a process of its own."""
    corpus = run.corpus_k
    if corpus is None:
        return
    args, admin, result = run.args, run.admin, run.result
    assert admin is not None and result is not None
    core = compiled_core_rate(args)
    print(f"compiled core (Guard().process, same requests, best of {args.runs}): {core:12,.0f}")
    topics = Topics()
    timed = [topics.input, topics.kills, topics.repartition, changelog_of(topics)]
    create_timed_topics(admin, timed, args.partitions)
    create_worker_topics(topics, args.partitions)
    worker = start_worker(topics, args.partitions, args, "compiled")
    packing = ShippedCollector(topics.input, PACKED)
    try:
        probe(topics.input, args.partitions, [worker], seed=106)
        fed = drain_through_collector(
            packing, topics, args.partitions, corpus.requests, corpus.spans, [worker],
            args.drain_timeout,
        )  # fmt: skip
    finally:
        stop_worker(worker)
        packing.close()
        delete_topics(admin, topics.prefix)
    rate = fed.drain.spans_per_s
    run.compiled_packed = rate / core
    print(
        f"pipeline through the packing Collector (1 worker, {BUILDS['compiled']}):"
        f" {rate:12,.0f} spans/s = {rate / core:.3f} of the compiled core"
        + ("" if fed.drain.done else "  [INCOMPLETE]")
        + f"; {fed.repartition_records:,} repartition records; done in {fed.drain.seconds:.1f}s"
    )
    print(f"  during the drain: {fed.drain.meter.text(fed.drain.cores)}")
    result.update(
        {
            "compiled_core_spans_per_s": round(core),
            "compiled_packed_spans_per_s": round(rate),
            "compiled_packed_to_compiled_core": round(rate / core, 3),
            "compiled_packed_drain_complete": fed.drain.done,
            "worker_cores_compiled_packed": round(fed.drain.cores["worker 1"], 2),
        }
    )


def core_after(run: Run) -> None:
    """The core again, workers stopped; the better of the two runs is the core's figure."""
    assert run.corpus is not None
    later = core_rate(run.corpus.requests, run.corpus.spans, run.args.runs)
    print(f"core again, workers stopped (best of {run.args.runs}): {later:12,.0f} spans/s")
    run.core = max(run.core, later)


def phase_faust(run: Run) -> None:
    """4. Faust's own floor on the same topic."""
    if "faust" not in run.phases:
        return
    args, topics, one, per_message = run.args, run.topics, run.one, run.per_message
    assert topics is not None and one is not None and run.result is not None
    records = sum(end_offsets(topics.input, args.partitions))
    env = dict(item.split("=", 1) for item in args.worker_env)
    floor = run.floor = faust_floor(topics, records, env, args.drain_timeout)
    print(
        f"faust pass-through (same topic, {records:,} records from its start):"
        f" {floor.records_per_s:12,.0f} records/s"
        f" (= {floor.records_per_s * per_message:,.0f} spans/s at {per_message:.2f}"
        f" spans each), {floor.cores:.2f} cores; the worker moves"
        f" {one.messages_per_s / floor.records_per_s:.3f} of it"
    )
    run.result.update(
        {
            "faust_records_per_s": round(floor.records_per_s),
            "pipeline_to_faust": round(one.messages_per_s / floor.records_per_s, 3),
            "faust_cores": round(floor.cores, 2),
        }
    )


def print_targets(run: Run) -> None:
    """The ratios to the core, and the targets line: met or not, with each figure."""
    one, fed, two, floor, core = run.one, run.fed, run.two, run.floor, run.core
    result, args, per_message = run.result, run.args, run.per_message
    assert one is not None and result is not None
    ratio = one.spans_per_s / core
    result["core_spans_per_s"] = round(core)
    result["pipeline_to_core"] = round(ratio, 3)
    if floor is not None:
        # Any agent on Faust moves at most this share of the core's spans/s.
        result["faust_to_core"] = round(floor.records_per_s * per_message / core, 3)
        print(
            f"faust's floor = {floor.records_per_s * per_message / core:.3f} of core in"
            f" spans/s: the most any Faust agent reaches on this topic; the worker"
            f" {ratio:.3f} of core"
        )
    if fed is not None:
        result["collector_to_core"] = round(fed.drain.spans_per_s / core, 3)
    # The targets are the shipped path's when it ran: the Collector's records, its batching.
    via = "through the Collector" if fed is not None else "synthetic producer"
    if fed is not None:
        ratio = fed.drain.spans_per_s / core
    latency = run.fed_latency if run.fed_latency is not None else run.latency
    line = f"targets ({via}): 1 worker >= 1/5 of core: {met(ratio >= 0.2)} ({ratio:.3f})"
    if latency is not None:
        first = args.rate_list[0] if run.fed_latency is not None else args.rate
        line += f"; p99 < 100 ms at {first:,.0f} spans/s: {p99_target(latency)}"
    packed_at = {latency.rate: latency for latency in run.packed_rate_latencies or []}
    for more in run.rate_latencies or []:
        line += f"; p99 < 100 ms at {more.rate:,.0f} spans/s: "
        packed_more = packed_at.get(more.rate)
        if packed_more is not None:
            line += f"packed {rate_target(packed_more)} / repartition "
        line += rate_target(more)
    if run.fed_packed is not None:
        packed = run.fed_packed.drain.spans_per_s / core
        result["packed_to_core"] = round(packed, 3)
        line += f"; packed >= 0.35 of core: {met(packed >= 0.35)} ({packed:.3f}"
        line += f", repartition path {ratio:.3f})"
        if run.packed_latency is not None:
            first = args.rate_list[0]
            line += (
                f"; packed p99 < 100 ms at {first:,.0f} spans/s: {p99_target(run.packed_latency)}"
            )
    if two is not None:
        scale = two.spans_per_s / (fed.drain.spans_per_s if fed is not None else one.spans_per_s)
        busy = two.cores["worker 1"] + two.cores["worker 2"] + two.cores["broker"]
        line += f"; 2 workers >= 1.6x: {met(scale >= 1.6)} ({scale:.2f}x"
        if scale < 1.6:
            line += (
                f"; workers and broker kept {busy:.2f} of this machine's"
                f" {os.cpu_count()} cores busy"
            )
        line += ")"
    if run.scope_runs and fed is not None:
        judged, *others = run.scope_runs
        scale = judged.ratio
        line += f"; scopes on >= 0.8 of off: {met(scale >= 0.8)} ({scale:.2f}, median of"
        line += f" {len(judged.ratios)} rounds, {BUILDS[judged.build]}"
        line += "".join(f"; {BUILDS[other.build]}: {other.ratio:.2f}" for other in others)
        line += ")"
        tool = judged.tool_ratio
        line += f"; tool scope on >= 0.8 of off: {met(tool >= 0.8)} ({tool:.2f}, the other"
        line += " scopes on in both"
        line += "".join(f"; {BUILDS[other.build]}: {other.tool_ratio:.2f}" for other in others)
        line += ")"
        if judged.latency is not None:
            line += f"; p99 with scopes < 100 ms: {p99_target(judged.latency)}"
    if run.compiled_packed is not None:
        compiled = run.compiled_packed
        line += f"; compiled packed >= 0.25 of compiled core: {met(compiled >= 0.25)}"
        line += f" ({compiled:.3f})"
    if run.fleet is not None:
        line += f"; fleet incident p99 within a step ({run.fleet.step_s} s)"
        line += f": {fleet_target(run.fleet)}"
    print(line)


def clean_up(run: Run) -> None:
    """Whatever the phases left running stops, and the run's topics are deleted."""
    for worker in run.workers or []:
        stop_worker(worker)
    for collector in (run.shipped, run.packing):
        if collector is not None:
            collector.close()
    assert run.admin is not None and run.topics is not None
    deleted = delete_topics(run.admin, run.topics.prefix)
    print(
        f"cleanup: workers stopped, {len(deleted)} topics deleted;"
        f" bench took {time.monotonic() - run.started:.0f}s"
    )


# Before the workers: the corpora and the core's first figure (nothing to clean up yet).
SETUP = (("corpora", build_corpora), ("core", core_before))
# With the broker's topics, workers and the Collector, in this order; `clean_up` runs after
# them whatever happens. A phase not chosen by --phases returns at once.
PHASES = (
    ("start", start_first_worker),
    ("one", phase_one),
    ("latency", phase_latency),
    ("collector", phase_collector),
    ("packed", phase_packed),
    ("stages", phase_stages),
    ("two", phase_two),
    ("stop", stop_workers),
    ("scopes", phase_scopes),
    ("fleet", phase_fleet),
    ("compiled", phase_compiled),
    ("core again", core_after),
    ("faust", phase_faust),
    ("targets", print_targets),
)


def print_core_rate(args: argparse.Namespace) -> int:
    """--core-rate: the drain corpus of build_corpora (its seed and mix), the core over it."""
    low, high = (int(n) for n in args.message_spans.split(","))
    corpus = build_corpus(
        args.spans, args.traces, seed=7, per_trace=True, message_spans=(low, high)
    )
    rate = core_rate(corpus.requests, corpus.spans, args.runs)
    print(json.dumps({"core_spans_per_s": rate, "detection_core": core_build()}))
    return 0


def stop_on_sigterm(signum: int, _frame: object) -> None:
    # A benchmark stopped with kill runs its clean-up as Ctrl-C does: a worker or Collector
    # left running would skew the next run.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, stop_on_sigterm)
    run = Run(parse_args(argv), started=time.monotonic())
    if run.args.core_rate:
        return print_core_rate(run.args)
    ensure_broker()
    for _name, phase in SETUP:
        phase(run)
    run.topics, run.admin = Topics(), AdminClient(CLUSTER.config())
    run.workers, run.result = [], {}
    try:
        for _name, phase in PHASES:
            phase(run)
    finally:
        clean_up(run)
    print(json.dumps(run.result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
