"""The trace table's writes as the shipped worker makes them (at least once, RocksDB): each
flush stores its states in write batches and sends their changelog records straight to the
producer (streams/state_table.py, `StateTable`), not through Faust's table path.

What Faust's path guaranteed must still hold, read from outside the worker: every trace's
last changelog record is the state its store holds, on the partition its spans arrive on,
and each partition's persisted offset (where recovery resumes reading the changelog) is
the offset of its last changelog record.
"""

from __future__ import annotations

import collections
import signal

import pytest
import rocksdict

from spanguard.detection.trace_state import TraceState
from spanguard.streams.partitioner import collector_partition
from tests.streams.test_eviction_kafka import observed, produce
from tests.support.kafka_harness import Collector, Topics, WorkerProcess, ensure_broker
from tests.support.spans import AgentRecorder
from tests.support.waiting import wait_until

pytestmark = pytest.mark.kafka

PARTITIONS = 4
OFFSET_KEY = b"__faust\x00offset__"


def calls_written(changelog: Collector, agents: list[AgentRecorder]) -> int:
    """The fewest calls any agent's last changelog record holds (0 before each has one)."""
    last: dict[bytes, bytes] = {}
    for record in changelog.where(lambda _: True):
        last[record["key"]] = record["value"]
    keys = [agent.trace_id.encode() for agent in agents]
    if not all(key in last for key in keys):
        return 0
    return min(len(TraceState.from_bytes(last[key]).window) for key in keys)


def test_changelog_records_and_persisted_offsets_match_the_store(tmp_path):
    ensure_broker()
    topics = Topics()
    worker = WorkerProcess(topics, tmp_path, partitions=PARTITIONS).start()
    changelog = Collector(f"{topics.app_id}-trace-state-changelog")
    try:
        agents = [AgentRecorder() for _ in range(24)]
        # Three rounds, each flushed apart: a trace's later records must supersede earlier ones.
        for round_ in range(3):
            produce(topics.input, [(a, a.tool("lookup", {"n": round_})) for a in agents])
            want = 24 * (round_ + 1)
            wait_until(lambda n=want: observed(worker) >= n, 30, "calls not processed")
        wait_until(lambda: calls_written(changelog, agents) == 3, 30, "last flush not written")
        assert worker.stop(signal.SIGTERM) == 0
    finally:
        worker.stop(signal.SIGKILL)
    records = changelog.where(lambda _: True)
    changelog.close()

    last_of: dict[bytes, dict] = {}
    last_offset: dict[int, int] = collections.defaultdict(lambda: -1)
    for record in records:
        last_of[record["key"]] = record
        last_offset[record["partition"]] = max(last_offset[record["partition"]], record["offset"])
    assert {agent.trace_id.encode() for agent in agents} <= set(last_of)
    for agent in agents:
        record = last_of[agent.trace_id.encode()]
        assert record["partition"] == collector_partition(agent.trace_id.encode(), PARTITIONS)
        assert len(TraceState.from_bytes(record["value"]).window) == 3  # every round's call

    stores = sorted(tmp_path.rglob("*trace-state*.db"))
    assert stores, f"no RocksDB partition stores under {tmp_path}"
    checked = 0
    for path in stores:
        partition = int(path.name.rsplit("-", 1)[1].split(".")[0])
        db = rocksdict.Rdict(str(path), options=rocksdict.Options(raw_mode=True))
        try:
            persisted = db.get(OFFSET_KEY)
            if last_offset[partition] < 0:
                continue
            assert persisted is not None and int(persisted) == last_offset[partition], (
                partition,
                persisted,
                last_offset[partition],
            )
            for key, record in last_of.items():
                if record["partition"] == partition:
                    assert db.get(key) == record["value"]
                    checked += 1
        finally:
            db.close()
    assert checked >= 24
