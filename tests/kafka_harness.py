"""Real Kafka for the tests and the pipeline benchmark: the broker, a worker process, consumers.

Nothing here is a mock: the broker is Apache Kafka started by scripts/kafka.sh, the worker is
the `spanguard worker` command in a subprocess, and messages go through confluent-kafka.
"""

from __future__ import annotations

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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, Producer, TopicPartition

ROOT = Path(__file__).resolve().parent.parent
BOOTSTRAP = f"127.0.0.1:{os.environ.get('KAFKA_PORT', '9092')}"


def ensure_broker() -> str:
    """Start the project's broker if it is not running (idempotent and fast when it is)."""
    result = subprocess.run(
        [str(ROOT / "scripts" / "kafka.sh"), "up"], capture_output=True, text=True, timeout=300
    )
    if result.returncode != 0:
        raise RuntimeError(f"scripts/kafka.sh up failed:\n{result.stdout}\n{result.stderr}")
    return BOOTSTRAP


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Topics:
    """A fresh set of topic names, so runs and tests never see each other's messages."""

    prefix: str = field(default_factory=lambda: f"t{uuid.uuid4().hex[:8]}")
    bootstrap: str = BOOTSTRAP  # another broker's, for a test that runs its own

    @property
    def app_id(self) -> str:
        return f"{self.prefix}-spanguard"

    @property
    def input(self) -> str:
        return f"{self.prefix}-otlp_spans"

    @property
    def kills(self) -> str:
        return f"{self.prefix}-agent-kill-signals"

    @property
    def detections(self) -> str:
        return f"{self.prefix}-detections"

    @property
    def dead_letters(self) -> str:
        return f"{self.prefix}-dead-letters"

    @property
    def repartition(self) -> str:
        return f"{self.prefix}-repartition"

    @property
    def goal_checks(self) -> str:
        return f"{self.prefix}-goal-checks"

    def delete(self) -> None:
        """Delete every topic of this run (the worker's and Faust's own, all prefixed)."""
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        names = [n for n in admin.list_topics(timeout=10).topics if n.startswith(self.prefix)]
        if names:
            for future in admin.delete_topics(names, operation_timeout=30).values():
                # Already gone, or the broker is stopping: nothing to keep either way.
                with contextlib.suppress(Exception):
                    future.result(timeout=30)

    def flags(self) -> list[str]:
        return [
            "--app-id", self.app_id,
            "--input-topic", self.input,
            "--kill-topic", self.kills,
            "--detections-topic", self.detections,
            "--dead-letter-topic", self.dead_letters,
            "--repartition-topic", self.repartition,
            "--goal-topic", self.goal_checks,
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
    ) -> None:
        self.topics = topics
        data_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.log_path = data_dir / f"worker-{self.port}.log"
        self.args = [
            sys.executable, "-m", "spanguard.cli", "worker",
            "--bootstrap", topics.bootstrap,
            "--data-dir", str(data_dir),
            "--partitions", str(partitions),
            "--metrics-port", str(self.port),
            "--metrics-host", "127.0.0.1",
            "--session-timeout", "6",  # a kill -9'd worker's partitions come back quickly
            *topics.flags(),
            *(["--policy", str(policy)] if policy else []),
            *(extra or []),
        ]  # fmt: skip
        self.env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen | None = None

    def start(self, timeout: float = 90.0) -> WorkerProcess:
        subprocess.run(
            [sys.executable, "-m", "spanguard.cli", "topics", "create",
             "--bootstrap", self.topics.bootstrap,
             *self.topics.flags(), "--partitions", self.args[self.args.index("--partitions") + 1]],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            self.args, stdout=self._log, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT
        )
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

    def __init__(self, *topics: str, bootstrap: str = BOOTSTRAP, **config: Any) -> None:
        self.messages: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"collector-{uuid.uuid4().hex}",
                "auto.offset.reset": "earliest",
                "enable.auto.commit": False,
                **config,
            }
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


def producer() -> Producer:
    return Producer({"bootstrap.servers": BOOTSTRAP, "linger.ms": 0, "enable.idempotence": True})


def end_offsets(topic: str, partitions: int) -> list[int]:
    consumer = Consumer({"bootstrap.servers": BOOTSTRAP, "group.id": f"probe-{uuid.uuid4().hex}"})
    try:
        return [
            consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
            for p in range(partitions)
        ]
    finally:
        consumer.close()


class Broker:
    """A broker of the test's own (scripts/kafka.sh on free ports, its own data dir), which the
    test may SIGKILL and restart: the shared broker on 9092 is never touched."""

    def __init__(self, data_dir: Path) -> None:
        self.port, self.controller_port = free_port(), free_port()
        self.data_dir = data_dir
        self.bootstrap = f"127.0.0.1:{self.port}"

    def _script(self, *args: str, timeout: float = 300) -> str:
        result = subprocess.run(
            [str(ROOT / "scripts" / "kafka.sh"), "--port", str(self.port),
             "--controller-port", str(self.controller_port), "--data-dir", str(self.data_dir),
             *args],
            capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip
        if result.returncode != 0:
            raise RuntimeError(f"kafka.sh {args} failed:\n{result.stdout}\n{result.stderr}")
        return result.stdout

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
