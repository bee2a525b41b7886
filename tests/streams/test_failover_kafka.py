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

import signal
import time

import pytest
from confluent_kafka import Producer

from tests.support.faults import (
    KillLedger,
    loops_and_clean,
    processed,
    wait_for_kills,
    wait_processed,
)
from tests.support.kafka_harness import (
    CLUSTER,
    Broker,
    Cluster,
    Collector,
    Topics,
    WorkerProcess,
    ensure_broker,
)
from tests.support.spans import AgentRecorder, encode

pytestmark = pytest.mark.kafka

PARTITIONS = 4
LOOPS = 12
CLEAN = 4


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


def two_calls_each_seen(workers: list[WorkerProcess]) -> None:
    """The first two calls of every trace are in the workers' state; then past the commit
    interval, so offsets and changelog are written."""
    count = 2 * (LOOPS + CLEAN)
    wait_processed(workers, count, timeout=60)
    assert processed(*workers) == count
    time.sleep(2.5)


@pytest.mark.parametrize("partitioner", ["fnv1a", "consistent_random", "murmur2_random"])
def test_sigkill_of_one_of_two_workers_loses_no_kill(tmp_path, partitioner):
    ensure_broker()
    topics = Topics()
    collector = Collector(topics.kills)
    first = WorkerProcess(topics, tmp_path / "a", partitions=PARTITIONS).start()
    second = WorkerProcess(topics, tmp_path / "b", partitions=PARTITIONS).start()
    workers = [first, second]
    try:
        loops, clean = loops_and_clean(LOOPS, CLEAN)  # loops go on past the threshold

        # Two calls of every trace, then a worker dies holding their state.
        produce(topics.input, partitioner, [(a, a.finished()[:2]) for a in loops + clean])
        two_calls_each_seen(workers)
        second.stop(signal.SIGKILL)
        # Rescheduled without its volume, it rejoins: a second rebalance, and its state can
        # only come from the changelog.
        second = WorkerProcess(topics, tmp_path / "b-rescheduled", partitions=PARTITIONS).start()
        workers = [first, second]

        produce(topics.input, partitioner, [(a, a.finished()[2:]) for a in loops + clean])
        ledger = KillLedger(loops, clean)
        wait_for_kills(ledger, collector, timeout=60)
        time.sleep(2.0)  # time for a duplicate or a false kill to show up, were there one

        ledger.read(collector)
        print(f"\n{partitioner}: {LOOPS - len(ledger.lost)}/{LOOPS} loops killed, "
              f"{len(ledger.false_kills)}/{CLEAN} clean traces killed")  # fmt: skip
        ledger.check()  # one decision per loop, at the threshold call; no clean trace killed
    finally:
        collector.close()
        for worker in workers:
            worker.stop()
        topics.delete()


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
        loops, clean = loops_and_clean(LOOPS, CLEAN)

        produce(topics.input, "fnv1a", [(a, a.finished()[:2]) for a in loops + clean],
                broker.cluster)  # fmt: skip
        two_calls_each_seen(workers)

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
        ledger = KillLedger(loops, clean)
        caught_up = wait_for_kills(ledger, collector, timeout=120)
        time.sleep(3.0)  # time for a duplicate or a false kill to show up, were there one

        ledger.read(collector)
        print(f"\nbroker SIGKILL + restart: {LOOPS - len(ledger.lost)}/{LOOPS} loops killed, "
              f"{len(ledger.false_kills)}/{CLEAN} clean traces killed, "
              f"broker down {restarted - killed:.1f} s, "
              f"last kill {caught_up - restarted:.1f} s after the restart")  # fmt: skip
        ledger.check()  # one decision per loop, at the threshold call; no clean trace killed
        for worker in workers:
            assert worker.process is not None and worker.process.poll() is None, worker.log_tail()
    finally:
        if collector is not None:
            collector.close()
        for worker in workers:
            worker.stop()
        broker.stop()
