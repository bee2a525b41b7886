"""Records of the Collector's spanguard_pack exporter (deploy/collector/packexporter): each batch
as one record per input partition, marked with its partition. The worker decides such a record
where it reads it when the mark and every trace agree with that partition, and otherwise splits
it through the repartition topic as it does a stock Collector's batch: no trace is lost.

The packs are built here as the exporter builds them (its Go tests check its placement against
the same FNV-1a); the routing is the span agent's and spanguard/detection/pipeline.py's own.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

import pytest
from faust.types import Message

from spanguard.detection.guard import Guard
from spanguard.detection.pipeline import Outcome, SpanPipeline
from spanguard.outcomes import Tally
from spanguard.streams.agents.guard_spans import (
    HEADER_PACK,
    SpanAgent,
    SpanCount,
    packed_partition,
)
from spanguard.streams.partitioner import collector_partition
from tests.support.spans import AgentRecorder, encode

PARTITIONS = 4
INPUT = "otlp_spans"
REPARTITION = "spans-repartition"


def home(trace_id: str, partitions: int = PARTITIONS) -> int:
    return collector_partition(trace_id.encode(), partitions)


def looping_fleet(count: int) -> list[AgentRecorder]:
    fleet = [AgentRecorder(f"svc-{n}") for n in range(count)]
    for agent in fleet:
        for _ in range(4):
            agent.tool("search_docs", {"query": "refund policy"})
    return fleet


def collector_packs(fleet: list[AgentRecorder], partitions: int) -> dict[int, bytes]:
    """What spanguard_pack writes for one batch: a request per partition, its traces only."""
    members: dict[int, list[AgentRecorder]] = {}
    for agent in fleet:
        members.setdefault(home(agent.trace_id, partitions), []).append(agent)
    return {
        partition: encode(
            [span for agent in agents for span in agent.finished()]
        ).SerializeToString()
        for partition, agents in members.items()
    }


def record(partition: int, value: bytes, mark: str | None, topic: str = INPUT) -> Message:
    headers = None if mark is None else [(HEADER_PACK, mark.encode())]
    return Message(topic, partition, 7, 0.0, 0, headers, None, value, None)


def span_agent() -> SpanAgent:
    """The span agent's routing without a worker: its topic and its counts are all it reads."""
    return cast(SpanAgent, SimpleNamespace(repartition_topic=REPARTITION, outcomes=Tally()))


def route(agent: SpanAgent, pipeline: SpanPipeline, message: Message) -> Outcome:
    home_partition = SpanAgent.home_partition(agent, message)
    outcome = pipeline.handle(message.key, message.value, home_partition)
    SpanAgent.count_pack(agent, message, home_partition, outcome)
    return outcome


@pytest.mark.parametrize(
    ("headers", "claimed"),
    [
        ([(HEADER_PACK, b"3/8")], 3),
        ({HEADER_PACK: b"0/1"}, 0),
        ([("traceparent", b"x"), (HEADER_PACK, b"7/8")], 7),
        (None, None),
        ([], None),
        ([(HEADER_PACK, b"8/8")], None),  # no such partition
        ([(HEADER_PACK, b"-1/8")], None),
        ([(HEADER_PACK, b"3")], None),
        ([(HEADER_PACK, b"three/8")], None),
        ([(HEADER_PACK, b"\xff/8")], None),
    ],
)
def test_the_pack_header_is_read_or_ignored(headers: object, claimed: int | None) -> None:
    assert packed_partition(headers) == claimed


def test_packs_on_their_partition_are_decided_where_they_land() -> None:
    fleet = looping_fleet(16)
    agent, pipeline = span_agent(), SpanPipeline(Guard(), home=home)
    killed: list[str] = []
    packs = collector_packs(fleet, PARTITIONS)
    for partition, value in packs.items():
        outcome = route(agent, pipeline, record(partition, value, f"{partition}/{PARTITIONS}"))
        assert outcome.repartition == [] and outcome.dead_letter is None
        killed += [d.trace_id for d in outcome.decisions if d.action == "kill"]
    assert sorted(killed) == sorted(a.trace_id for a in fleet)
    assert pipeline.repartitioned == 0
    assert agent.outcomes.count(SpanCount.PACKS_DECIDED) == len(packs)


def test_unmarked_batches_still_take_the_repartition_hop() -> None:
    fleet = looping_fleet(8)
    batch = encode([span for a in fleet for span in a.finished()]).SerializeToString()
    agent, pipeline = span_agent(), SpanPipeline(Guard(), home=home)
    outcome = route(agent, pipeline, record(0, batch, None))
    assert outcome.decisions == [] and len(outcome.repartition) == len(fleet)
    assert agent.outcomes.count(SpanCount.PACKS_DECIDED) == 0
    assert agent.outcomes.count(SpanCount.PACKS_REPARTITIONED) == 0


def test_a_pack_on_another_partition_than_it_names_is_repartitioned_whole() -> None:
    fleet = looping_fleet(16)
    agent, pipeline = span_agent(), SpanPipeline(Guard(), home=home)
    partition, value = next(iter(collector_packs(fleet, PARTITIONS).items()))
    elsewhere = (partition + 1) % PARTITIONS
    outcome = route(agent, pipeline, record(elsewhere, value, f"{partition}/{PARTITIONS}"))
    held = {a.trace_id for a in fleet if home(a.trace_id) == partition}
    assert outcome.decisions == [] and {t for t, _ in outcome.repartition} == held
    assert agent.outcomes.count(SpanCount.PACKS_REPARTITIONED) == 1


def test_packs_of_a_collector_that_saw_another_partition_count_lose_no_trace() -> None:
    """The Collector packed for 3 partitions, the worker's topic has 4: a pack whose traces do
    not all live where it landed is split and every one of its traces re-keyed; one whose
    traces happen to all live there is decided there. Every loop trips once."""
    fleet = looping_fleet(24)
    agent, pipeline = span_agent(), SpanPipeline(Guard(), home=home)
    rekeyed: dict[str, bytes] = {}
    killed: list[str] = []
    for partition, value in collector_packs(fleet, 3).items():
        outcome = route(agent, pipeline, record(partition, value, f"{partition}/3"))
        assert outcome.dead_letter is None
        rekeyed.update(outcome.repartition)
        killed += [d.trace_id for d in outcome.decisions if d.action == "kill"]
    assert agent.outcomes.count(SpanCount.PACKS_REPARTITIONED) >= 1
    # The repartition topic's records, read on their partition, are decided there.
    for trace_id, part in rekeyed.items():
        outcome = pipeline.handle(None, part, home(trace_id))
        assert outcome.repartition == []
        killed += [d.trace_id for d in outcome.decisions if d.action == "kill"]
    assert sorted(killed) == sorted(a.trace_id for a in fleet)
