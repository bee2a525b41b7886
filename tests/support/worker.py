"""A worker for a test: the broker, topics of the test's own, a policy file, `spanguard worker`
and a collector on the topics the test reads; stopped with SIGTERM (a clean exit is asserted)
and its topics deleted at the end. Also what tests feed it and how they run the CLI beside it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.support.kafka_harness import (
    CLUSTER,
    SIGNING_KEY,
    Collector,
    Topics,
    WorkerProcess,
    ensure_broker,
    producer,
)
from tests.support.spans import AgentRecorder, encode
from tests.support.waiting import wait_until


@dataclass
class RunningWorker:
    topics: Topics
    process: WorkerProcess
    collector: Collector


@contextmanager
def running_worker(
    data: Path,
    *,
    policy: str | None = None,
    collect: Sequence[str] = ("kills",),
    env: dict[str, str] | None = None,
    extra: list[str] | None = None,
) -> Iterator[RunningWorker]:
    """`collect` names the Topics attributes the collector reads (kills, detections, ...)."""
    ensure_broker()
    topics = Topics()
    process = start_worker(topics, data, policy, env=env, extra=extra)
    collector = Collector(*(getattr(topics, name) for name in collect))
    try:
        yield RunningWorker(topics, process, collector)
    finally:
        collector.close()
        code = process.stop()
        topics.delete()
    assert code == 0, process.log_tail()


@contextmanager
def notifying_worker(
    data: Path, policy: str, env: dict[str, str], secrets: Sequence[str]
) -> Iterator[RunningWorker]:
    """A worker that notifies a receiver (a pager, a webhook) as `env` configures it, with a
    collector on the kill and dead-letter topics; after it stops, none of `secrets` (keys,
    tokens in a URL) may stand in its log."""
    with running_worker(data, policy=policy, collect=("kills", "dead_letters"), env=env) as running:
        yield running
    log = running.process.log_text()
    assert not any(secret in log for secret in secrets), "a secret was logged"


def start_worker(
    topics: Topics,
    data: Path,
    policy: str | None = None,
    *,
    env: dict[str, str] | None = None,
    extra: list[str] | None = None,
) -> WorkerProcess:
    """`spanguard worker` on `topics`, started, with `policy` (YAML) written into `data`."""
    data.mkdir(parents=True, exist_ok=True)
    policy_file = None
    if policy is not None:
        policy_file = data / "policy.yaml"
        policy_file.write_text(policy)
    return WorkerProcess(topics, data, policy=policy_file, env=env, extra=extra).start()


def restart_mid_retry(
    data: Path,
    policy: str,
    env: dict[str, str],
    send: Callable[[Topics], AgentRecorder],
    failed_twice: Callable[[AgentRecorder], object],
    delivered: Callable[[AgentRecorder], object],
) -> AgentRecorder:
    """A worker (`policy`, `env`) SIGKILLed while it retries a delivery (the detection never
    acknowledged), then started again on the same data and topics of its own: `send` the spans,
    wait for two failed tries, restart, wait for the delivery and leave room for a second one,
    were there one. The caller asserts."""
    ensure_broker()
    topics = Topics()
    try:
        worker = start_worker(topics, data, policy, env=env)
        try:
            agent = send(topics)
            wait_until(lambda: failed_twice(agent), what="two failed tries")
            worker.stop(signal.SIGKILL)
            worker = start_worker(topics, data, policy, env=env)
            wait_until(lambda: delivered(agent), what="the delivery after the restart")
            time.sleep(1.5)
            return agent
        finally:
            worker.stop()
    finally:
        topics.delete()


def dead_letter(worker: WorkerProcess, collector: Collector, agent: AgentRecorder) -> dict:
    """The dead letter of `agent`'s detection, which it keeps whole; the caller checks why."""
    (dead,) = collector.wait(
        lambda m: m["topic"] == worker.topics.dead_letters and m["key"] == agent.trace_id.encode()
    )
    assert json.loads(dead["value"])["trace_id"] == agent.trace_id
    return dead


def assert_kill_not_delayed(
    worker: WorkerProcess, collector, send: Callable[[], AgentRecorder]
) -> None:
    """While a notification still waits on its slow receiver, the kill of another looping
    agent (`send`) reaches the kill topic within 5 s: notifying never holds the kills."""
    sent = time.monotonic()
    other = send()
    collector.wait(
        lambda m: m["topic"] == worker.topics.kills and m["key"] == other.trace_id.encode(),
        timeout=5.0,
    )
    assert time.monotonic() - sent < 5.0


def send_spans(
    topic: str,
    agent: AgentRecorder,
    spans: Iterable | None = None,
    key: bytes | None = b"trace",
) -> None:
    """One message per span, keyed by the trace id (what partition_traces_by_id writes)."""
    out = producer()
    for span in spans if spans is not None else agent.finished():
        message_key = agent.trace_id.encode() if key == b"trace" else key
        out.produce(topic, key=message_key, value=encode([span]).SerializeToString())
    assert out.flush(10) == 0


def send_calls(
    topic: str, agent: AgentRecorder, tool: str, arguments: dict, calls: int = 4
) -> AgentRecorder:
    """`agent` calling `tool` `calls` times with `arguments` and a nonce that differs each
    call, sent as send_spans sends; the agent."""
    for step in range(calls):
        agent.tool(tool, {**arguments, "nonce": step})
    send_spans(topic, agent)
    return agent


def worker_starter(
    topics: Topics, data: Path, policy: Path, partitions: int
) -> Callable[..., list[WorkerProcess]]:
    """`start(name, ...)`: a worker per name on the test's topics with the policy file, each in
    `data / name`, launched together and then waited for, so that their start-ups overlap; one
    that does not get ready stops them all."""

    def start(*names: str) -> list[WorkerProcess]:
        workers: list[WorkerProcess] = []
        try:
            for name in names:
                workers.append(
                    WorkerProcess(topics, data / name, partitions=partitions, policy=policy)
                )
                workers[-1].launch()
            return [worker.ready() for worker in workers]
        except BaseException:
            for worker in workers:
                worker.stop(signal.SIGKILL)
            raise

    return start


def operator_cli(command: str, topics: Topics, *args: str) -> subprocess.CompletedProcess:
    """`spanguard kill|release` with `args` (a scope: --conversation, --agent) by operator
    alice, on the test's kill and detections topics, with the tests' signing key."""
    env = {**os.environ, **CLUSTER.env(), "SPANGUARD_SIGNING_KEY": SIGNING_KEY}
    return subprocess.run(
        [sys.executable, "-m", "spanguard.cli", command, *args, "--bootstrap", CLUSTER.bootstrap,
         "--kill-topic", topics.kills, "--detections-topic", topics.detections,
         "--operator", "alice"],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip


def run_cli(command: str, trace_id: str, topics: Topics, *args: str) -> subprocess.CompletedProcess:
    """`spanguard kill|release TRACE_ID` on the test's topics, with the tests' signing key."""
    env = {**os.environ, **CLUSTER.env(), "SPANGUARD_SIGNING_KEY": SIGNING_KEY}
    return subprocess.run(
        [sys.executable, "-m", "spanguard.cli", command, trace_id,
         "--bootstrap", CLUSTER.bootstrap, *topics.flags(), *args],
        capture_output=True, text=True, timeout=60, env=env,
    )  # fmt: skip
