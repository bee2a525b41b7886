"""Eviction across rebalances, with two real workers and the default RocksDB store.

A partition that goes to another worker and comes back must not be evicted from the index it
had before it left (the other worker touched its traces since), and traces this worker only
recovered (from the changelog or its disk) must be evicted once idle like any other.

The state TTL is 20 s instead of the shipped hour so that a trace can go idle within a test;
everything else is the shipped default.
"""

from __future__ import annotations

import collections
import json
import signal
import time

import pytest
from confluent_kafka import Producer

from spanguard.streams.partitioner import collector_partition
from tests.support.kafka_harness import CLUSTER, Collector, Topics, WorkerProcess, ensure_broker
from tests.support.spans import AgentRecorder, encode
from tests.support.waiting import wait_until

pytestmark = pytest.mark.kafka

PARTITIONS = 4
TTL = 20.0


def per_partition(count: int) -> list[AgentRecorder]:
    """`count` agents whose traces land on each partition (the Collector's FNV-1a)."""
    buckets: dict[int, list[AgentRecorder]] = collections.defaultdict(list)
    while any(len(buckets[p]) < count for p in range(PARTITIONS)):
        agent = AgentRecorder()
        bucket = buckets[collector_partition(agent.trace_id.encode(), PARTITIONS)]
        if len(bucket) < count:
            bucket.append(agent)
    return [agent for p in range(PARTITIONS) for agent in buckets[p]]


def produce(topic: str, spans: list[tuple[AgentRecorder, object]]) -> None:
    out = Producer(CLUSTER.config(partitioner="fnv1a", **{"enable.idempotence": True}))
    for agent, span in spans:
        out.produce(topic, key=agent.trace_id.encode(), value=encode([span]).SerializeToString())
    assert out.flush(20) == 0


def restores(worker: WorkerProcess) -> int:
    return worker.log_text().count("Restore complete!")


def observed(worker: WorkerProcess) -> float:
    return (worker.metrics() or {}).get("spanguard_tool_calls_observed_total", 0.0)


def tick(topics: Topics, worker: WorkerProcess) -> None:
    """One fresh call on every partition: a batch there runs eviction."""
    before = observed(worker)
    produce(topics.input, [(a, a.tool("lookup", {"n": 1})) for a in per_partition(1)])
    wait_until(lambda: observed(worker) >= before + PARTITIONS, 30, "tick not processed")


def test_a_partition_back_from_another_worker_is_evicted_by_what_its_store_holds(tmp_path):
    ensure_broker()
    topics = Topics()
    extra = ["--state-ttl", str(TTL)]
    first = WorkerProcess(topics, tmp_path / "a", partitions=PARTITIONS, extra=extra).start()
    changelog = Collector(f"{topics.app_id}-trace-state-changelog", topics.kills)
    second = None
    try:
        idle_early = per_partition(2)  # touched by the first worker only
        loops = per_partition(2)  # touched by both; must keep their count
        idle_late = per_partition(2)  # written while their partition was on the second worker
        # One call per loop here, one on the second worker, the 3rd (the default threshold)
        # once the partitions are back: its kill needs the count the store kept.
        produce(topics.input, [(a, a.tool("search_docs", {"q": "idle"})) for a in idle_early]
                + [(a, a.tool("search_docs", {"q": "loop"})) for a in loops])  # fmt: skip
        wait_until(lambda: observed(first) >= 16, 30, "first calls not processed")
        started = time.time()

        restored = restores(first)
        second = WorkerProcess(topics, tmp_path / "b", partitions=PARTITIONS, extra=extra).start()
        wait_until(lambda: restores(first) > restored and restores(second) >= 1, 60,
                   "no rebalance")  # fmt: skip
        seen = observed(first) + observed(second)
        produce(topics.input, [(a, a.tool("search_docs", {"q": "idle"})) for a in idle_late]
                + [(a, a.tool("search_docs", {"q": "loop"})) for a in loops])  # fmt: skip
        wait_until(lambda: observed(first) + observed(second) >= seen + 16, 30, "not processed")
        assert observed(second) > 0  # the second worker owned some partitions
        touched_again = time.time()

        restored = restores(first)
        second.stop()  # its partitions come back to the first worker
        wait_until(lambda: restores(first) > restored, 60, "partitions did not come back")

        # Past the TTL of the first calls, within that of the second ones.
        time.sleep(max(0.0, started + TTL + 1 - time.time()))
        tick(topics, first)
        assert time.time() < touched_again + TTL, "too slow: the loops' second calls expired"
        produce(topics.input, [(a, a.tool("search_docs", {"q": "loop"})) for a in loops])
        wanted = {a.trace_id.encode() for a in loops}
        wait_until(lambda: wanted <= {m["key"] for m in changelog.where(
            lambda m: m["topic"] == topics.kills)}, 30, "loops not killed")  # fmt: skip

        time.sleep(max(0.0, touched_again + TTL + 1 - time.time()))
        tick(topics, first)
        idle = {a.trace_id.encode() for a in idle_early + idle_late}

        def tombstoned() -> set[bytes]:
            return {m["key"] for m in changelog.where(lambda m: m["value"] is None)}

        # Eviction runs with a partition's batches: on a loaded machine one tick's batch may
        # come before the tombstones of a partition are flushed, so tick again while waiting.
        deadline = time.monotonic() + 45
        while not idle <= tombstoned():
            assert time.monotonic() < deadline, f"{len(idle - tombstoned())} not evicted"
            time.sleep(2)
            if not idle <= tombstoned():
                tick(topics, first)
        kills = collections.defaultdict(set)
        for message in changelog.where(lambda m: m["topic"] == topics.kills):
            kills[message["key"]].add(json.loads(message["value"])["signal_id"])
        assert all(len(kills[key]) == 1 for key in wanted), kills
        assert not wanted & tombstoned()  # the loops were touched since: kept
    finally:
        changelog.close()
        for worker in (first, second):
            if worker is not None:
                worker.stop(signal.SIGTERM)
        topics.delete()
