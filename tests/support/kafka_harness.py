"""Real Kafka for the tests and the pipeline benchmark: the broker, a worker process, consumers.

Nothing here is a mock: the worker is the `spanguard worker` command in a subprocess, messages go
through confluent-kafka, and the broker is one of (chosen once per run, printed at its start):

- SPANGUARD_TEST_BOOTSTRAP set: that cluster, with the SPANGUARD_KAFKA_* security settings
  (TLS, SASL) the worker and the killswitch read;
- a Docker engine answers: a broker started by testcontainers' Kafka module (image
  SPANGUARD_TEST_KAFKA_IMAGE, default the module's own), on a free port, stopped at exit;
- otherwise: Apache Kafka started by scripts/kafka.sh on 127.0.0.1:${KAFKA_PORT:-9092}.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from spanguard.config.kafka_security import KafkaSecurity

ROOT = Path(__file__).resolve().parents[2]
# Workers sign by default and refuse to start without a key: the tests set one the way the
# README tells a user to (SPANGUARD_SIGNING_KEY), unless a test passes its own.
SIGNING_KEY = "spanguard-tests-signing-key-5f0c2a"

FROM_ENV = "SPANGUARD_TEST_BOOTSTRAP"
TESTCONTAINERS = "testcontainers"
KAFKA_SH = "scripts/kafka.sh"
# testcontainers' KafkaContainer drives the Confluent image's own start scripts.
TESTCONTAINERS_IMAGE = "confluentinc/cp-kafka:7.6.0"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def collector_env(
    brokers: str, topic: str, state_dir: Path, **more: str
) -> tuple[dict[str, str], int]:
    """The environment of `scripts/collector.sh up`: OTLP received on free ports, exported to
    `topic` at `brokers`, its state under `state_dir`, plus `more`; and the OTLP/HTTP port."""
    http_port = free_port()
    env = {
        **os.environ,
        "OTLP_HTTP_ENDPOINT": f"127.0.0.1:{http_port}",
        "OTLP_GRPC_ENDPOINT": f"127.0.0.1:{free_port()}",
        "KAFKA_BROKERS": brokers,
        "SPANGUARD_INPUT_TOPIC": topic,
        "COLLECTOR_STATE_DIR": str(state_dir),
        **more,
    }
    return env, http_port


def docker_answers(timeout: float = 3.0) -> bool:
    """A Docker engine answers a ping (through the docker SDK testcontainers uses)."""
    try:
        import docker
    except ImportError:
        return False
    try:
        client = docker.from_env(timeout=timeout)
    except Exception:  # no socket, no DOCKER_HOST: docker.errors.DockerException  # noqa: BLE001
        return False
    try:
        return bool(client.ping())
    except Exception:  # any failure to ping: no Docker engine to use  # noqa: BLE001
        return False
    finally:
        client.close()


def select_source(environ: dict[str, str] | os._Environ, docker: Callable[[], bool]) -> str:
    """Which broker the tests use: an explicit cluster, else Docker's, else scripts/kafka.sh."""
    if (environ.get(FROM_ENV) or "").strip():
        return FROM_ENV
    return TESTCONTAINERS if docker() else KAFKA_SH


@dataclass(frozen=True)
class Cluster:
    """Where a test's clients connect, and how (the same settings the worker gets)."""

    bootstrap: str
    security: KafkaSecurity = field(default_factory=KafkaSecurity)
    source: str = KAFKA_SH

    def config(self, **extra: Any) -> dict[str, Any]:
        """confluent-kafka settings for this cluster."""
        return {"bootstrap.servers": self.bootstrap, **self.security.confluent_config(), **extra}

    def env(self) -> dict[str, str]:
        """The worker's and the killswitch's variables for this cluster."""
        return {"SPANGUARD_BOOTSTRAP": self.bootstrap, **self.security.to_env()}

    def describe(self) -> str:
        return f"{self.source} at {self.bootstrap} ({self.security.security_protocol})"


def select_cluster(
    environ: dict[str, str] | os._Environ = os.environ,
    docker: Callable[[], bool] = docker_answers,
) -> Cluster:
    source = select_source(environ, docker)
    if source == FROM_ENV:
        return Cluster(environ[FROM_ENV].strip(), KafkaSecurity.from_env(environ), source)
    if source == TESTCONTAINERS:
        # A fixed host port, chosen now, so BOOTSTRAP is known before the container starts.
        return Cluster(f"127.0.0.1:{free_port()}", source=source)
    return Cluster(f"127.0.0.1:{environ.get('KAFKA_PORT', '9092')}", source=source)


CLUSTER = select_cluster()
BOOTSTRAP = CLUSTER.bootstrap
_container: Any = None


def _start_container(cluster: Cluster) -> None:
    global _container
    from testcontainers.community.kafka import KafkaContainer

    port = int(cluster.bootstrap.rpartition(":")[2])
    image = os.environ.get("SPANGUARD_TEST_KAFKA_IMAGE", TESTCONTAINERS_IMAGE)
    container = KafkaContainer(image).with_kraft().with_bind_ports(9093, port)
    container.start(timeout=180)
    atexit.register(container.stop)
    _container = container
    started = container.get_bootstrap_server().replace("localhost", "127.0.0.1")
    if started != cluster.bootstrap:
        raise RuntimeError(f"the Kafka container answers on {started}, not {cluster.bootstrap}")


def ensure_broker() -> str:
    """The run's broker, started if it is ours to start (idempotent and fast when it runs)."""
    if CLUSTER.source == FROM_ENV:
        return BOOTSTRAP
    if CLUSTER.source == TESTCONTAINERS:
        if _container is None:
            _start_container(CLUSTER)
        return BOOTSTRAP
    result = subprocess.run(
        [str(ROOT / "scripts" / "kafka.sh"), "up"], capture_output=True, text=True, timeout=300
    )
    if result.returncode != 0:
        raise RuntimeError(f"scripts/kafka.sh up failed:\n{result.stdout}\n{result.stderr}")
    return BOOTSTRAP


def _prefixed(suffix: str) -> property:
    """A Topics name: the run's prefix, then `suffix`."""
    return property(lambda self: f"{self.prefix}-{suffix}")


# WorkerSettings' keyword -> the Topics attribute it is given (Topics.settings).
WORKER_TOPIC_SETTINGS = {
    "app_id": "app_id", "input_topic": "input", "kill_topic": "kills",
    "detections_topic": "detections", "dead_letter_topic": "dead_letters",
    "repartition_topic": "repartition", "goal_topic": "goal_checks",
    "conversation_topic": "conversations", "agent_usage_topic": "agent_usage",
    "tool_calls_topic": "tool_calls",
}  # fmt: skip


@dataclass
class Topics:
    """A fresh set of topic names, so runs and tests never see each other's messages."""

    prefix: str = field(default_factory=lambda: f"t{uuid.uuid4().hex[:8]}")
    cluster: Cluster = field(default_factory=lambda: CLUSTER)

    # Each topic's name: the prefix, then what it holds.
    app_id = _prefixed("spanguard")
    input = _prefixed("otlp_spans")
    kills = _prefixed("agent-kill-signals")
    acks = _prefixed("agent-kill-acks")
    detections = _prefixed("detections")
    dead_letters = _prefixed("dead-letters")
    repartition = _prefixed("repartition")
    goal_checks = _prefixed("goal-checks")
    conversations = _prefixed("conversation-calls")
    agent_usage = _prefixed("agent-usage")
    tool_calls = _prefixed("tool-calls")

    def delete(self) -> None:
        """Delete every topic of this run (the worker's and Faust's own, all prefixed)."""
        from confluent_kafka.admin import AdminClient

        admin = AdminClient(self.cluster.config())
        names = [n for n in admin.list_topics(timeout=10).topics if n.startswith(self.prefix)]
        if names:
            for future in admin.delete_topics(names, operation_timeout=30).values():
                # Already gone, or the broker is stopping: nothing to keep either way.
                with contextlib.suppress(Exception):
                    future.result(timeout=30)

    def settings(self) -> dict[str, str]:
        """The worker's settings that name these topics (WorkerSettings' keywords)."""
        return {setting: getattr(self, name) for setting, name in WORKER_TOPIC_SETTINGS.items()}

    def flags(self) -> list[str]:
        return [
            "--app-id", self.app_id,
            "--input-topic", self.input,
            "--kill-topic", self.kills,
            "--ack-topic", self.acks,
            "--detections-topic", self.detections,
            "--dead-letter-topic", self.dead_letters,
            "--repartition-topic", self.repartition,
            "--goal-topic", self.goal_checks,
            "--conversation-topic", self.conversations,
            "--agent-usage-topic", self.agent_usage,
            "--tool-calls-topic", self.tool_calls,
        ]  # fmt: skip


class WorkerProcess:
    """`spanguard worker` as a child process, with its /metrics and its JSON logs."""

    def __init__(
        self,
        topics: Topics,
        data_dir: Path,
        *,
        partitions: int = 2,
        policy: Path | None = None,
        extra: list[str] | None = None,
        env: dict[str, str] | None = None,
        session_timeout: float | None = 6.0,
    ) -> None:
        """`session_timeout` None: the worker's shipped one."""
        self.topics = topics
        cluster = topics.cluster
        data_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.log_path = data_dir / f"worker-{self.port}.log"
        self.args = [
            sys.executable, "-m", "spanguard.cli", "worker",
            "--bootstrap", cluster.bootstrap,
            "--data-dir", str(data_dir),
            "--partitions", str(partitions),
            "--metrics-port", str(self.port),
            "--metrics-host", "127.0.0.1",
            # 6 s: a kill -9'd worker's partitions come back quickly
            *(["--session-timeout", str(session_timeout)] if session_timeout else []),
            *topics.flags(),
            *(["--policy", str(policy)] if policy else []),
            *(extra or []),
        ]  # fmt: skip
        self.env = {**os.environ, **cluster.env(), **(env or {})}
        if not (
            self.env.get("SPANGUARD_SIGNING_KEY") or self.env.get("SPANGUARD_SIGNING_KEY_FILE")
        ):
            self.env["SPANGUARD_SIGNING_KEY"] = SIGNING_KEY
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 90.0) -> WorkerProcess:
        return self.launch().ready(timeout)

    def launch(self) -> WorkerProcess:
        """Its topics created and its process started, not waited for: `ready()` waits."""
        subprocess.run(
            [sys.executable, "-m", "spanguard.cli", "topics", "create",
             "--bootstrap", self.topics.cluster.bootstrap, *self.topics.flags(),
             "--partitions", self.args[self.args.index("--partitions") + 1]],
            check=True, capture_output=True, timeout=60, env=self.env,
        )  # fmt: skip
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            self.args, stdout=self._log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT
        )
        return self

    def ready(self, timeout: float = 90.0) -> WorkerProcess:
        assert self.process is not None, "launch() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"worker exited with {self.process.returncode}:\n{self.log_tail()}"
                )
            if "Worker ready" in self.log_text() and self.metrics() is not None:
                return self
            time.sleep(0.2)
        tail = self.log_tail()
        self.stop(signal.SIGKILL)  # a worker that never got ready must not outlive the test
        raise TimeoutError(f"worker not ready in {timeout}s:\n{tail}")

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def metrics(self) -> dict[str, float] | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=2) as r:
                text = r.read().decode()
        except OSError:
            return None
        values = {}
        for line in text.splitlines():
            match = re.match(r"^(spanguard_[^ ]+) ([0-9.e+-]+)$", line)
            if match:
                values[match.group(1)] = float(match.group(2))
        return values

    def wait_for(self, metric: str, at_least: float, timeout: float = 30.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            values = self.metrics() or {}
            if values.get(metric, 0.0) >= at_least:
                return values
            time.sleep(0.1)
        raise TimeoutError(
            f"{metric} did not reach {at_least}: {self.metrics()}\n{self.log_tail()}"
        )

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode


class Collector:
    """Consumes topics from their beginning in a background thread; tests read `messages`."""

    def __init__(self, *topics: str, cluster: Cluster | None = None, **config: Any) -> None:
        self.messages: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._consumer = Consumer(
            (cluster or CLUSTER).config(
                **{
                    "group.id": f"collector-{uuid.uuid4().hex}",
                    "auto.offset.reset": "earliest",
                    "enable.auto.commit": False,
                    **config,
                }
            )
        )
        self._consumer.subscribe(list(topics))
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            message = self._consumer.poll(0.1)
            if message is None or message.error():
                continue
            record = {
                "topic": message.topic(),
                "key": message.key(),
                "value": message.value(),
                "headers": dict(message.headers() or []),
                "partition": message.partition(),
                "offset": message.offset(),
                "timestamp_ms": message.timestamp()[1],
                "received": time.time(),
            }
            with self._lock:
                self.messages.append(record)
        self._consumer.close()

    def where(self, predicate: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
        with self._lock:
            return [m for m in self.messages if predicate(m)]

    def json_from(self, topic: str, trace_id: str | None = None) -> list[dict[str, Any]]:
        return [
            json.loads(m["value"])
            for m in self.where(lambda m: m["topic"] == topic)
            if trace_id is None or m["key"] == trace_id.encode()
        ]

    def wait(
        self, predicate: Callable[[dict[str, Any]], bool], count: int = 1, timeout: float = 30.0
    ):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.where(predicate)
            if len(found) >= count:
                return found
            time.sleep(0.05)
        raise TimeoutError(
            f"expected {count} matching messages in {timeout}s, got {self.where(predicate)}"
        )

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


@contextlib.contextmanager
def scratch_topic(
    partitions: int, suffix: str = "agent-kill-signals", cluster: Cluster | None = None
) -> Iterator[str]:
    """A topic of the test's own (a fresh name), deleted at the end."""
    from confluent_kafka.admin import AdminClient, NewTopic

    name = f"t{uuid.uuid4().hex[:8]}-{suffix}"
    admin = AdminClient((cluster or CLUSTER).config())
    admin.create_topics([NewTopic(name, partitions, 1)])[name].result(30)
    try:
        yield name
    finally:
        admin.delete_topics([name])


_PRODUCER_CONFIG = {"linger.ms": 0, "enable.idempotence": True}
_SHARED_PRODUCER: list[Producer] = []


def producer(cluster: Cluster | None = None) -> Producer:
    """Idempotent, no linger. The tests' own cluster's is one producer for the whole run: a new
    one connects and takes a producer id before its first send, which cost every send_spans of
    every agent a test sends; a cluster of the test's own gets a new one."""
    if cluster is not None:
        return Producer(cluster.config(**_PRODUCER_CONFIG))
    if not _SHARED_PRODUCER:
        _SHARED_PRODUCER.append(Producer(CLUSTER.config(**_PRODUCER_CONFIG)))
    return _SHARED_PRODUCER[0]


# What a broker answers while a partition's leader moves or is not yet known to it (a topic
# just created, a broker busy): the same question a moment later gets the offset.
LEADER_MOVING = {
    KafkaError.NOT_LEADER_FOR_PARTITION,
    KafkaError.LEADER_NOT_AVAILABLE,
    KafkaError.UNKNOWN_TOPIC_OR_PART,
}


def end_offsets(topic: str, partitions: int, cluster: Cluster | None = None) -> list[int]:
    consumer = Consumer((cluster or CLUSTER).config(**{"group.id": f"probe-{uuid.uuid4().hex}"}))
    try:
        return [high_watermark(consumer, TopicPartition(topic, p)) for p in range(partitions)]
    finally:
        consumer.close()


def high_watermark(consumer: Consumer, partition: TopicPartition, attempts: int = 5) -> int:
    for attempt in range(1, attempts + 1):
        try:
            return int(consumer.get_watermark_offsets(partition, timeout=10)[1])
        except KafkaException as exc:
            if attempt == attempts or exc.args[0].code() not in LEADER_MOVING:
                raise
            time.sleep(0.2 * attempt)
    raise AssertionError("unreachable")


def run_script(name: str, options: list[str], args: tuple[str, ...], timeout: float) -> str:
    """scripts/`name` with `options` then `args`; its stdout, or a RuntimeError with all it
    printed."""
    result = subprocess.run(
        [str(ROOT / "scripts" / name), *options, *args],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    if result.returncode != 0:
        raise RuntimeError(f"{name} {args} failed:\n{result.stdout}\n{result.stderr}")
    return result.stdout


class Broker:
    """A broker of the test's own (scripts/kafka.sh on free ports, its own data dir), which the
    test may SIGKILL and restart: the shared broker on 9092 is never touched."""

    def __init__(self, data_dir: Path) -> None:
        self.port, self.controller_port = free_port(), free_port()
        self.data_dir = data_dir
        self.bootstrap = f"127.0.0.1:{self.port}"
        self.cluster = Cluster(self.bootstrap, source="a broker of the test's own")

    def _script(self, *args: str, timeout: float = 300) -> str:
        return run_script(
            "kafka.sh",
            ["--port", str(self.port), "--controller-port", str(self.controller_port),
             "--data-dir", str(self.data_dir)],
            args, timeout,
        )  # fmt: skip

    def start(self) -> Broker:
        """Start (or restart, from the same data dir) and wait until it answers."""
        self._script("up")
        return self

    def pid(self) -> int:
        return int((self.data_dir / "kafka.pid").read_text())

    def kill(self) -> None:
        """SIGKILL: no clean shutdown, the logs are recovered at the next start."""
        pid = self.pid()
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)  # until init has reaped it

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._script("down", timeout=60)
