"""Brokers of a three-node cluster fail under two shipped workers: no kill lost or doubled.

The cluster is `scripts/kafka-cluster.sh` (replication factor 3, min.insync.replicas 2), the
workers run on their shipped defaults, the spans sit on the partition the Collector's exporter
gives their trace id. Each test prints kills expected, sent, doubled and lost, and how long the
pipeline took to recover. `make test-faults` runs them.
"""

from __future__ import annotations

import threading
import time

import pytest

from tests.support.faults import (
    KafkaCluster,
    KillLedger,
    Pipeline,
    loops_and_clean,
    wait_for_kills,
    wait_processed,
)

pytestmark = [pytest.mark.kafka, pytest.mark.faults]

LOOPS = 12
CLEAN = 4


def test_partition_leaders_sigkilled_mid_trace(kafka_cluster: KafkaCluster, tmp_path) -> None:
    """The leader of the spans topic dies between a trace's calls, then the kill topic's leader
    as the kills are decided, then the state changelog's: each SIGKILLed and restarted."""
    pipeline = Pipeline(kafka_cluster, tmp_path).start()
    try:
        loops, clean = loops_and_clean(LOOPS, CLEAN)
        ledger = KillLedger(loops, clean)
        everyone = loops + clean
        # One call before the faults: the threshold call (the 3rd) comes with the second fault.
        pipeline.spans.send(everyone, slice(0, 1))
        pipeline.spans.flush()

        wait_processed(pipeline.workers, len(everyone))
        time.sleep(2.5)  # past the commit interval: offsets and changelog written

        started = time.monotonic()
        faults = []
        for topic, calls in (
            (pipeline.topics.input, slice(1, 2)),  # spans arrive while their leader is gone
            (pipeline.topics.kills, slice(2, 3)),  # the threshold call: kills to a lost leader
            (pipeline.changelog, slice(3, 8)),  # state written while its leader is gone
        ):
            node = kafka_cluster.busiest_leader(topic)
            kafka_cluster.kill(node)
            faults.append(f"{topic.rsplit('-', 1)[-1]}: node {node}")
            pipeline.spans.send(everyone, calls)
            time.sleep(3)
            kafka_cluster.start(node)
        pipeline.spans.flush()
        wait_processed(pipeline.workers, 8 * len(everyone), timeout=300)
        done = wait_for_kills(ledger, pipeline.collector, timeout=300)
        time.sleep(3)  # time for a doubled or a false kill to show up, were there one
        ledger.read(pipeline.collector)
        print("\n" + ledger.summary(f"leaders SIGKILLed ({', '.join(faults)})", done - started))
        ledger.check()
        for worker in pipeline.workers:
            assert worker.process.poll() is None, worker.log_tail()
    finally:
        pipeline.close()


class Traffic(threading.Thread):
    """New traces every few seconds, each making its next call every second, until stopped;
    then the traces under way finish."""

    def __init__(self, pipeline: Pipeline, every: float = 1.0, wave_every: int = 3) -> None:
        super().__init__(daemon=True)
        self.pipeline = pipeline
        self.every = every
        self.wave_every = wave_every
        self.loops: list = []
        self.clean: list = []
        self.sent = 0
        self.stopping = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            active: list[list] = []
            tick = 0
            while not self.stopping.is_set() or active:
                if not self.stopping.is_set() and tick % self.wave_every == 0:
                    loops, clean = loops_and_clean(2, 1)
                    self.loops += loops
                    self.clean += clean
                    active += [[agent, 0] for agent in loops + clean]
                for item in active:
                    self.sent += self.pipeline.spans.send([item[0]], slice(item[1], item[1] + 1))
                    item[1] += 1
                active = [item for item in active if item[1] < 8]
                tick += 1
                time.sleep(self.every)
            self.pipeline.spans.flush()
        except BaseException as exc:  # reported by the test  # noqa: BLE001
            self.error = exc


def test_rolling_restart_of_every_broker(kafka_cluster: KafkaCluster, tmp_path) -> None:
    """Each node in turn stopped (SIGTERM: controlled shutdown), restarted, and waited for
    until every partition is in sync again, while traces start and go on."""
    pipeline = Pipeline(kafka_cluster, tmp_path).start()
    traffic = Traffic(pipeline)
    try:
        traffic.start()
        time.sleep(5)
        started = time.monotonic()
        for node in kafka_cluster.nodes:
            kafka_cluster.stop(node)
            kafka_cluster.start(node)
            kafka_cluster.wait_in_sync()
        rolled = time.monotonic()
        traffic.stopping.set()
        traffic.join(timeout=120)
        assert traffic.error is None, traffic.error
        ledger = KillLedger(traffic.loops, traffic.clean)
        wait_processed(pipeline.workers, traffic.sent, timeout=300)
        done = wait_for_kills(ledger, pipeline.collector, timeout=300)
        time.sleep(3)
        ledger.read(pipeline.collector)
        print(
            "\n"
            + ledger.summary(
                f"rolling restart of {len(kafka_cluster.nodes)} brokers in"
                f" {rolled - started:.0f} s, {traffic.sent} spans flowing",
                done - started,
            )
        )
        ledger.check()
        for worker in pipeline.workers:
            assert worker.process.poll() is None, worker.log_tail()
    finally:
        traffic.stopping.set()
        pipeline.close()
