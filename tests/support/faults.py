"""Faults of a real cluster for the tests and the soak: three brokers, a TCP proxy that cuts a
client off, traffic partitioned as the Collector partitions it, and the kill ledger.

The cluster is `scripts/kafka-cluster.sh` (its own data dir, free ports): the shared broker on
9092 is never touched. Every process started here is stopped by the one who started it.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from spanguard.streams.partitioner import collector_partition
from tests.support.kafka_harness import (
    ROOT,
    Cluster,
    Collector,
    WorkerProcess,
    free_port,
    run_script,
)
from tests.support.spans import AgentRecorder, encode, span_id_of

COLLECTOR_CONFIG = ROOT / "deploy" / "collector" / "config.yaml"
PERSISTENT_QUEUE = ROOT / "deploy" / "collector" / "persistent-queue.yaml"
# The project's packing exporter in place of the stock one, and its queue on disk.
PACKED = ROOT / "deploy" / "collector" / "packed.yaml"
PACKED_QUEUE = ROOT / "deploy" / "collector" / "packed-persistent-queue.yaml"
THRESHOLD = 3  # the shipped loop rule: the 3rd identical call in the window trips
SHIPPED_PARTITIONS = 8  # the shipped SPANGUARD_PARTITIONS


class KafkaCluster:
    """`scripts/kafka-cluster.sh`: three KRaft nodes, each broker and controller."""

    def __init__(self, data_dir: Path, brokers: int = 3) -> None:
        self.data_dir = data_dir
        self.brokers = brokers
        self.env: dict[str, str] = {}

    def _script(self, *args: str, timeout: float = 600) -> str:
        return run_script("kafka-cluster.sh", ["--data-dir", str(self.data_dir)], args, timeout)

    def up(self) -> KafkaCluster:
        self._script("up", "--brokers", str(self.brokers))
        for line in (self.data_dir / "cluster.env").read_text().splitlines():
            name, sep, value = line.partition("=")
            if sep and not line.startswith("#"):
                self.env[name] = value
        return self

    def port(self, node: int) -> int:
        return int(self.env[f"PORT_{node}"])

    @property
    def bootstrap(self) -> str:
        return ",".join(f"127.0.0.1:{self.port(n)}" for n in self.nodes)

    @property
    def nodes(self) -> list[int]:
        return list(range(1, self.brokers + 1))

    @property
    def cluster(self) -> Cluster:
        return Cluster(self.bootstrap, source="a three-broker cluster of the test's own")

    def proxied(self) -> tuple[Cluster, list[TcpProxy]]:
        """A bootstrap whose every connection goes through a proxy per node (started here)."""
        proxies = [
            TcpProxy(int(self.env[f"PROXY_PORT_{n}"]), int(self.env[f"PROXIED_PORT_{n}"]))
            for n in self.nodes
        ]
        bootstrap = ",".join(f"127.0.0.1:{p.listen_port}" for p in proxies)
        return Cluster(bootstrap, source="the cluster through a TCP proxy"), proxies

    def kill(self, node: int) -> None:
        self._script("kill", str(node))

    def stop(self, node: int) -> None:
        self._script("stop", str(node))

    def start(self, node: int) -> None:
        self._script("start", str(node))

    def pid(self, node: int) -> int:
        return int(self._script("pid", str(node)).strip())

    def down(self) -> None:
        with contextlib.suppress(Exception):
            self._script("down", "--purge", timeout=180)

    def admin(self) -> AdminClient:
        return AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 2})

    def leaders(self, topic: str) -> dict[int, int]:
        """partition -> leader node of `topic`."""
        metadata = self.admin().list_topics(topic, timeout=20)
        return {p: info.leader for p, info in metadata.topics[topic].partitions.items()}

    def busiest_leader(self, topic: str) -> int:
        """The node leading most partitions of `topic`."""
        counts = collections.Counter(self.leaders(topic).values())
        return counts.most_common(1)[0][0]

    def wait_in_sync(self, timeout: float = 180.0) -> float:
        """Until every partition of every topic has all its replicas in sync; returns seconds."""
        started = time.monotonic()
        deadline = started + timeout
        lagging: list[str] = []
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                metadata = self.admin().list_topics(timeout=10)
                lagging = [
                    f"{name}/{p}"
                    for name, topic in metadata.topics.items()
                    for p, info in topic.partitions.items()
                    if len(info.isrs) < len(info.replicas) or info.leader < 0
                ]
                if not lagging and len(metadata.brokers) == self.brokers:
                    return time.monotonic() - started
            time.sleep(0.5)
        raise TimeoutError(f"partitions not in sync after {timeout}s: {lagging[:10]}")


class TcpProxy:
    """Forwards 127.0.0.1:listen_port to 127.0.0.1:target_port, and fails on demand:

    - `stall()`: no byte moves either way and every connection stays open (no RST, no FIN):
      a silent network partition. What a client wrote before it still reaches the other end
      after `heal()` (it waits in the kernel's socket buffers).
    - `cut()`: every connection reset and new ones refused: the brokers unreachable. What the
      client had not written yet stays in the client.
    - `heal()`: forwarding again (new connections accepted).
    """

    def __init__(self, listen_port: int, target_port: int) -> None:
        self.listen_port = listen_port
        self.target_port = target_port
        self._mode = "flowing"  # or "stalled", "cut"
        self._stop = threading.Event()
        self._selector = selectors.DefaultSelector()
        self._server: socket.socket | None = None
        self._peers: dict[socket.socket, socket.socket] = {}
        self._listen()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        self._server = socket.create_server(("127.0.0.1", self.listen_port))
        self._server.setblocking(False)
        self._selector.register(self._server, selectors.EVENT_READ, None)

    def stall(self) -> None:
        self._mode = "stalled"

    def cut(self) -> None:
        self._mode = "cut"
        deadline = time.monotonic() + 5
        while self._server is not None and time.monotonic() < deadline:
            time.sleep(0.02)

    def heal(self) -> None:
        self._mode = "flowing"

    def _drop(self, sock: socket.socket) -> None:
        with contextlib.suppress(Exception):
            self._selector.unregister(sock)
        with contextlib.suppress(OSError):
            # RST rather than FIN: the connection is gone, not closed by its peer.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
        self._peers.pop(sock, None)

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._mode == "cut" and self._server is not None:
                for sock in list(self._peers):
                    self._drop(sock)
                self._drop(self._server)
                self._server = None
            if self._mode == "flowing" and self._server is None:
                with contextlib.suppress(OSError):
                    self._listen()
            if self._mode != "flowing":
                time.sleep(0.05)
                continue
            for key, _ in self._selector.select(timeout=0.1):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self._server:
                    with contextlib.suppress(OSError):
                        client, _ = self._server.accept()
                        upstream = socket.create_connection(("127.0.0.1", self.target_port), 5)
                        for s in (client, upstream):
                            s.setblocking(False)
                            self._selector.register(s, selectors.EVENT_READ, None)
                        self._peers[client], self._peers[upstream] = upstream, client
                    continue
                other = self._peers.get(sock)
                try:
                    data = sock.recv(65536)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                if not data or other is None:
                    for s in (sock, other):
                        if s is not None:
                            with contextlib.suppress(Exception):
                                self._selector.unregister(s)
                            s.close()
                            self._peers.pop(s, None)
                    continue
                with contextlib.suppress(OSError):
                    other.setblocking(True)
                    other.sendall(data)
                    other.setblocking(False)
        for sock in list(self._peers):
            sock.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self._server is not None:
            self._server.close()
        self._selector.close()


def loops_and_clean(
    loops: int, clean: int, calls: int = 8, agent: str = "support-bot"
) -> tuple[list[AgentRecorder], list[AgentRecorder]]:
    """Looping traces (the same call again and again) and clean ones (every call different)."""
    looping = [AgentRecorder(agent) for _ in range(loops)]
    healthy = [AgentRecorder(agent) for _ in range(clean)]
    for recorder in looping:
        for step in range(calls):  # past the threshold: still one kill each
            recorder.tool("search_docs", {"query": "refund policy", "timestamp": step})
    for recorder in healthy:
        for step in range(calls):
            recorder.tool("search_docs", {"query": f"question {step}"})
    return looping, healthy


class SpanProducer:
    """Spans keyed by trace id on the partition the Collector's exporter picks."""

    def __init__(self, cluster: Cluster, topic: str, partitions: int) -> None:
        self.topic = topic
        self.partitions = partitions
        self.failed = 0
        # acks=all with idempotence, as the Collector's exporter (required_acks -1 by default).
        self._producer = Producer(
            cluster.config(**{"enable.idempotence": True, "linger.ms": 5, "log_level": 2})
        )

    def _delivered(self, err, _msg) -> None:
        if err is not None:
            self.failed += 1

    def send(self, agents: Iterable[AgentRecorder], calls: slice) -> int:
        sent = 0
        for recorder in agents:
            key = recorder.trace_id.encode()
            for span in recorder.finished()[calls]:
                self._producer.produce(
                    self.topic,
                    key=key,
                    value=encode([span]).SerializeToString(),
                    partition=collector_partition(key, self.partitions),
                    on_delivery=self._delivered,
                )
                sent += 1
            self._producer.poll(0)
        return sent

    def flush(self, timeout: float = 120.0) -> None:
        left = self._producer.flush(timeout)
        assert left == 0 and self.failed == 0, f"{left} spans not delivered, {self.failed} failed"


@dataclass
class KillLedger:
    """What the kill topic holds against what it should: one decision per looping trace, made
    at the call the threshold allows, none for a clean trace."""

    loops: list[AgentRecorder]
    clean: list[AgentRecorder]
    records: list[dict] = field(default_factory=list)

    def read(self, collector: Collector) -> KillLedger:
        self.records = [json.loads(m["value"]) | {"_key": m["key"]} for m in collector.messages]
        return self

    def by_trace(self) -> dict[str, list[dict]]:
        found: dict[str, list[dict]] = collections.defaultdict(list)
        for record in self.records:
            found[record["_key"].decode()].append(record)
        return found

    @property
    def expected(self) -> int:
        return len(self.loops)

    @property
    def sent(self) -> int:
        return len(self.records)

    @property
    def doubled(self) -> list[str]:
        """Traces with more than one decision (a repeated record of one decision is not one:
        the killswitch obeys a decision id once)."""
        found = self.by_trace()
        return [t for t, records in found.items() if len({r["signal_id"] for r in records}) > 1]

    @property
    def lost(self) -> list[str]:
        found = self.by_trace()
        return [a.trace_id for a in self.loops if a.trace_id not in found]

    @property
    def redelivered(self) -> int:
        """Records beyond the first of each decision (at-least-once's repeats, harmless)."""
        return self.sent - len({r["signal_id"] for r in self.records})

    @property
    def false_kills(self) -> list[str]:
        found = self.by_trace()
        return [a.trace_id for a in self.clean if a.trace_id in found]

    def _calls_off_threshold(self, first_only: bool) -> list[str]:
        found = self.by_trace()  # in the kill topic's order: a trace's records share a partition
        wrong = []
        for agent in self.loops:
            calls = [span_id_of(span) for span in agent.finished()]
            records = found.get(agent.trace_id, [])
            for record in records[:1] if first_only else records[1:]:
                span = record["evidence"]["span_id"]
                if span != calls[THRESHOLD - 1]:
                    at = calls.index(span) + 1 if span in calls else "?"
                    wrong.append(f"{agent.trace_id}: call {at}")
        return wrong

    @property
    def wrong_call(self) -> list[str]:
        """Looping traces whose kill (the first record, the one an agent obeys) is not at the
        threshold call: 'trace: call N'."""
        return self._calls_off_threshold(first_only=True)

    @property
    def stale_repeats(self) -> list[str]:
        """Later records of a trace's decision made at another call than the threshold's: the
        rule tripped again, so some worker's state had lost the trace's kill (stale state).
        The agent obeys the decision id once; the audit and the kill topic get a repeat."""
        return self._calls_off_threshold(first_only=False)

    def complete(self, collector: Collector) -> bool:
        wanted = {a.trace_id.encode() for a in self.loops}
        return wanted <= {m["key"] for m in collector.messages}

    def summary(self, name: str, recovery: float | None) -> str:
        recovered = (
            "never recovered"
            if recovery is None
            else f"recovered (every kill sent) {recovery:.1f} s after the fault began"
        )
        return (
            f"{name}: kills expected {self.expected}, sent {self.sent}"
            f" ({self.redelivered} repeated records of one decision), doubled {len(self.doubled)},"
            f" lost {len(self.lost)}, clean traces killed {len(self.false_kills)},"
            f" killed at another call {len(self.wrong_call)}, tripped again later (stale state)"
            f" {len(self.stale_repeats)}; {recovered}"
        )

    def check(self) -> None:
        """Every property: nothing lost, doubled or false, each kill at the threshold call,
        no rule tripped again (a zombie worker's stale state winning would show here)."""
        assert not self.lost, f"{len(self.lost)}/{self.expected} loops never killed"
        assert not self.doubled, f"traces with two decisions: {self.doubled}"
        assert not self.false_kills, f"clean traces killed: {self.false_kills}"
        assert not self.wrong_call, (
            f"killed at another call than the threshold's: {self.wrong_call}"
        )
        assert not self.stale_repeats, f"rules tripped again (stale state): {self.stale_repeats}"


def wait_for_kills(ledger: KillLedger, collector: Collector, timeout: float) -> float:
    """Until every looping trace has its kill; returns when (monotonic), or raises."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ledger.complete(collector):
            return time.monotonic()
        time.sleep(0.2)
    ledger.read(collector)
    raise AssertionError(f"after {timeout:.0f}s, {len(ledger.lost)} loops still not killed")


def unconsumed(worker: WorkerProcess, topic: str, partitions: int) -> dict[int, float | None]:
    """Partitions of `topic` the worker has records of left to consume: its lag, or None where
    it has no fetch position at all (never fetched: spanguard_consumer_lag leaves it out)."""
    lags: dict[int, float | None] = dict.fromkeys(range(partitions))
    for name, value in (worker.metrics() or {}).items():
        if name.startswith("spanguard_consumer_lag{") and f'topic="{topic}"' in name:
            partition = int(name.split('partition="')[1].split('"')[0])
            lags[partition] = value
    return {p: lag for p, lag in lags.items() if lag is None or lag > 0}


def shipped_worker(topics, data_dir: Path, cluster: Cluster | None = None) -> WorkerProcess:
    """`spanguard worker` on its shipped defaults (session timeout, partitions, commit interval),
    only the connection, the topic names, the data dir and the metrics port given."""
    worker = WorkerProcess(topics, data_dir, partitions=SHIPPED_PARTITIONS, session_timeout=None)
    if cluster is not None:  # e.g. through the proxy: the worker's connections only
        worker.args[worker.args.index("--bootstrap") + 1] = cluster.bootstrap
        worker.env["SPANGUARD_BOOTSTRAP"] = cluster.bootstrap
    return worker


def processed(*workers: WorkerProcess) -> float:
    return sum((w.metrics() or {}).get("spanguard_tool_calls_observed_total", 0) for w in workers)


def wait_processed(workers: list[WorkerProcess], count: float, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if processed(*workers) >= count:
            return
        time.sleep(0.2)
    raise AssertionError(f"workers saw {processed(*workers)} calls, not {count}, in {timeout}s")


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def freeze(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)


def thaw(pid: int) -> None:
    os.kill(pid, signal.SIGCONT)


class Pipeline:
    """Two shipped workers on fresh topics of `cluster`, a reader of the kill topic, spans
    partitioned as the Collector does. Closed by `close()`, which stops all it started."""

    def __init__(self, kafka: KafkaCluster, tmp_path: Path, worker_clusters=(None, None)) -> None:
        from spanguard.config.settings import WorkerSettings
        from tests.support.kafka_harness import Topics

        self.kafka = kafka
        self.topics = Topics(cluster=kafka.cluster)
        self.changelog = WorkerSettings(app_id=self.topics.app_id).changelog_topic
        self.workers: list[WorkerProcess] = []
        self.collector: Collector | None = None
        self.spans = SpanProducer(kafka.cluster, self.topics.input, SHIPPED_PARTITIONS)
        self.tmp_path = tmp_path
        self.worker_clusters = worker_clusters

    def start(self) -> Pipeline:
        for n, cluster in enumerate(self.worker_clusters):
            self.workers.append(
                shipped_worker(self.topics, self.tmp_path / f"worker-{n}", cluster).start(
                    timeout=240
                )
            )
        self.collector = Collector(self.topics.kills, cluster=self.kafka.cluster, log_level=2)
        return self

    def close(self) -> None:
        if self.collector is not None:
            self.collector.close()
        for worker in self.workers:
            if worker.process is not None and worker.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    thaw(worker.process.pid)  # a frozen worker cannot act on SIGTERM
            worker.stop()
        with contextlib.suppress(Exception):
            self.topics.delete()


class RealCollector:
    """scripts/collector.sh up/down on ports of its own, its state and queue under `home`."""

    def __init__(
        self, home: Path, brokers: str, topic: str, persistent: bool, packed: bool = False
    ) -> None:
        self.home = home
        (home / "queue").mkdir(parents=True, exist_ok=True)
        self.http_port = free_port()
        overlays = [PERSISTENT_QUEUE] if persistent else []
        if packed:
            overlays += [PACKED, PACKED_QUEUE] if persistent else [PACKED]
        self.configs = [str(config) for config in (COLLECTOR_CONFIG, *overlays)]
        self.env = {
            **os.environ,
            "OTLP_HTTP_ENDPOINT": f"127.0.0.1:{self.http_port}",
            "OTLP_GRPC_ENDPOINT": f"127.0.0.1:{free_port()}",
            "OTELCOL_METRICS_PORT": str(free_port()),
            "KAFKA_BROKERS": brokers,
            "SPANGUARD_INPUT_TOPIC": topic,
            "COLLECTOR_STATE_DIR": str(home / "run"),
            "SPANGUARD_COLLECTOR_QUEUE_DIR": str(home / "queue"),
        }

    def _script(self, *args: str) -> None:
        result = subprocess.run(
            [str(ROOT / "scripts" / "collector.sh"), *args],
            env=self.env, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        if result.returncode != 0:
            raise RuntimeError(f"collector.sh {args} failed:\n{result.stdout}\n{result.stderr}")

    def up(self) -> RealCollector:
        self._script("up", *self.configs)
        return self

    def kill(self) -> None:
        pid = int((self.home / "run" / "collector.pid").read_text())
        os.kill(pid, signal.SIGKILL)
        while Path(f"/proc/{pid}").exists():
            time.sleep(0.05)

    def down(self) -> None:
        self._script("down")

    def post(self, body: bytes, attempts: int = 60) -> None:
        """One OTLP/HTTP protobuf request, retried as an SDK exporter retries."""
        for _attempt in range(attempts):
            request = urllib.request.Request(
                f"http://127.0.0.1:{self.http_port}/v1/traces",
                data=body,
                headers={"Content-Type": "application/x-protobuf"},
            )
            try:
                with urllib.request.urlopen(request, timeout=10) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError):
                pass
            time.sleep(0.5)
        raise AssertionError(f"the Collector refused a request {attempts} times")

    def export(self, agents: list, calls: slice) -> int:
        """One request per trace of its spans `calls`; spans sent."""
        sent = 0
        for agent in agents:
            spans = agent.finished()[calls]
            self.post(encode(spans).SerializeToString())
            sent += len(spans)
        return sent
