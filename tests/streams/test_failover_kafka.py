"""Two workers in one group as deployed: default store, 4 partitions, a worker SIGKILLed mid-trace.

Spans are produced with each partitioner a real producer uses: `fnv1a` is the Collector's kafka
exporter (sarama-compatible FNV-1a, the same function in librdkafka), `consistent_random` is
librdkafka's default (CRC32), `murmur2_random` is the Java client's. The worker's state must
live where a trace's messages arrive, whichever of them put them there: before the table's
changelog followed the source partition, half the loops were lost here with fnv1a.

The broker's own SIGKILL and restart from its data directory runs on a broker the test starts
for itself (free ports, its own data dir); it takes about a minute, so it is marked
`broker_failover` and runs in `make test-failover`, not in `make test`.
"""

from __future__ import annotations

import collections
import json
import signal
import time

import pytest
from confluent_kafka import Producer

from tests.support.kafka_harness import (
    CLUSTER,
    Broker,
    Cluster,
    Collector,
    Topics,
    WorkerProcess,
    ensure_broker,
)
from tests.support.spans import AgentRecorder, encode, span_id_of

pytestmark = pytest.mark.kafka

PARTITIONS = 4
LOOPS = 12
CLEAN = 4
THRESHOLD = 4  # the shipped default: a key seen 4 times in the window trips


def produce(
    topic: str,
    partitioner: str,
    agents_spans: list[tuple[AgentRecorder, list]],
    cluster: Cluster = CLUSTER,
) -> None:
    out = Producer(cluster.config(partitioner=partitioner, **{"enable.idempotence": True}))
    for agent, spans in agents_spans:
        for span in spans:
            out.produce(
                topic,
                key=agent.trace_id.encode(),
                value=encode([span]).SerializeToString(),
            )
    assert out.flush(20) == 0


def observed(*workers: WorkerProcess) -> float:
    return sum((w.metrics() or {}).get("spanguard_tool_calls_observed_total", 0) for w in workers)


@pytest.mark.parametrize("partitioner", ["fnv1a", "consistent_random", "murmur2_random"])
def test_sigkill_of_one_of_two_workers_loses_no_kill(tmp_path, partitioner):
    ensure_broker()
    topics = Topics()
    collector = Collector(topics.kills)
    first = WorkerProcess(topics, tmp_path / "a", partitions=PARTITIONS).start()
    second = WorkerProcess(topics, tmp_path / "b", partitions=PARTITIONS).start()
    workers = [first, second]
    try:
        loops = [AgentRecorder("support-bot") for _ in range(LOOPS)]
        clean = [AgentRecorder("support-bot") for _ in range(CLEAN)]
        for agent in loops:
            for step in range(8):  # loops go on past the threshold: still one kill each
                agent.tool("search_docs", {"query": "refund policy", "timestamp": step})
        for agent in clean:
            for step in range(8):
                agent.tool("search_docs", {"query": f"question {step}"})

        # Two calls of every trace, then a worker dies holding their state.
        produce(topics.input, partitioner, [(a, a.finished()[:2]) for a in loops + clean])
        deadline = time.monotonic() + 60
        while observed(first, second) < 2 * (LOOPS + CLEAN) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert observed(first, second) == 2 * (LOOPS + CLEAN)
        time.sleep(2.5)  # past the commit interval: offsets and changelog are written
        second.stop(signal.SIGKILL)
        # Rescheduled without its volume, it rejoins: a second rebalance, and its state can
        # only come from the changelog.
        second = WorkerProcess(topics, tmp_path / "b-rescheduled", partitions=PARTITIONS).start()
        workers = [first, second]

        produce(topics.input, partitioner, [(a, a.finished()[2:]) for a in loops + clean])
        wanted = {a.trace_id.encode() for a in loops}
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if wanted <= {m["key"] for m in collector.messages}:
                break
            time.sleep(0.2)
        time.sleep(2.0)  # time for a duplicate or a false kill to show up, were there one

        kills = collections.defaultdict(list)
        for message in collector.messages:
            kills[message["key"].decode()].append(json.loads(message["value"]))
        missed = [a.trace_id for a in loops if a.trace_id not in kills]
        print(f"\n{partitioner}: {LOOPS - len(missed)}/{LOOPS} loops killed, "
              f"{sum(a.trace_id in kills for a in clean)}/{CLEAN} clean traces killed")  # fmt: skip
        assert not missed, f"{len(missed)}/{LOOPS} loops never killed"
        for agent in loops:
            records = kills[agent.trace_id]
            assert len({r["signal_id"] for r in records}) == 1, records  # exactly one decision
            assert records[0]["evidence"]["span_id"] == span_id_of(agent.finished()[THRESHOLD - 1])
        assert not [a for a in clean if a.trace_id in kills]
    finally:
        collector.close()
        for worker in workers:
            worker.stop()
        topics.delete()


def loops_and_clean() -> tuple[list[AgentRecorder], list[AgentRecorder]]:
    loops = [AgentRecorder("support-bot") for _ in range(LOOPS)]
    clean = [AgentRecorder("support-bot") for _ in range(CLEAN)]
    for agent in loops:
        for step in range(8):  # loops go on past the threshold: still one kill each
            agent.tool("search_docs", {"query": "refund policy", "timestamp": step})
    for agent in clean:
        for step in range(8):
            agent.tool("search_docs", {"query": f"question {step}"})
    return loops, clean


@pytest.mark.broker_failover
def test_broker_sigkill_and_restart_from_its_data_dir_loses_no_kill(tmp_path):
    broker = Broker(tmp_path / "broker").start()
    topics = Topics(cluster=broker.cluster)
    workers: list[WorkerProcess] = []
    collector = None
    try:
        first = WorkerProcess(topics, tmp_path / "a", partitions=PARTITIONS).start()
        second = WorkerProcess(topics, tmp_path / "b", partitions=PARTITIONS).start()
        workers = [first, second]
        # log_level 2: no line per refused reconnect while the broker is down.
        collector = Collector(topics.kills, cluster=broker.cluster, log_level=2)
        loops, clean = loops_and_clean()

        produce(topics.input, "fnv1a", [(a, a.finished()[:2]) for a in loops + clean],
                broker.cluster)  # fmt: skip
        deadline = time.monotonic() + 60
        while observed(first, second) < 2 * (LOOPS + CLEAN) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert observed(first, second) == 2 * (LOOPS + CLEAN)
        time.sleep(2.5)  # past the commit interval: offsets and changelog are written

        # Mid-trace, the broker dies without a clean shutdown and comes back from its disk.
        killed = time.monotonic()
        broker.kill()
        time.sleep(3)  # the workers notice: connections refused, the group coordinator gone
        broker.start()
        restarted = time.monotonic()
        for worker in workers:
            assert worker.process is not None and worker.process.poll() is None, worker.log_tail()

        produce(topics.input, "fnv1a", [(a, a.finished()[2:]) for a in loops + clean],
                broker.cluster)  # fmt: skip
        wanted = {a.trace_id.encode() for a in loops}
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if wanted <= {m["key"] for m in collector.messages}:
                break
            time.sleep(0.2)
        caught_up = time.monotonic()
        time.sleep(3.0)  # time for a duplicate or a false kill to show up, were there one

        kills = collections.defaultdict(list)
        for message in collector.messages:
            kills[message["key"].decode()].append(json.loads(message["value"]))
        missed = [a.trace_id for a in loops if a.trace_id not in kills]
        print(f"\nbroker SIGKILL + restart: {LOOPS - len(missed)}/{LOOPS} loops killed, "
              f"{sum(a.trace_id in kills for a in clean)}/{CLEAN} clean traces killed, "
              f"broker down {restarted - killed:.1f} s, "
              f"last kill {caught_up - restarted:.1f} s after the restart")  # fmt: skip
        assert not missed, f"{len(missed)}/{LOOPS} loops never killed"
        for agent in loops:
            records = kills[agent.trace_id]
            assert len({r["signal_id"] for r in records}) == 1, records  # exactly one decision
            assert records[0]["evidence"]["span_id"] == span_id_of(agent.finished()[THRESHOLD - 1])
        assert not [a for a in clean if a.trace_id in kills]
        for worker in workers:
            assert worker.process is not None and worker.process.poll() is None, worker.log_tail()
    finally:
        if collector is not None:
            collector.close()
        for worker in workers:
            worker.stop()
        broker.stop()
