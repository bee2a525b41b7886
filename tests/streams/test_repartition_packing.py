"""The repartition hop packs every trace bound for one partition into one record, and the
worker decides such a record where it lands: more spans per record, state where it was.

Faust topics and messages are the real types (an app that is never started); the routing is
streams/delivery.py's and spanguard/detection/pipeline.py's own.
"""

from __future__ import annotations

import faust
from faust.types import Message
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from spanguard.detection.guard import Guard
from spanguard.detection.pipeline import MAX_RECORD_BYTES, SpanPipeline
from spanguard.streams.delivery import HEADER_OFFSET, HEADER_TOPIC, Outbox
from spanguard.streams.partitioner import collector_partition
from tests.support.spans import AgentRecorder, encode

PARTITIONS = 4
APP = faust.App("repartition-packing-test")
REFUND = {"query": "refund policy"}


def outbox() -> Outbox:
    return Outbox(
        repartition=APP.topic("spans-repartition"),
        detections=APP.topic("detections"),
        kill_signals=APP.topic("kills"),
        dead_letters=APP.topic("dead-letters"),
        partitions=PARTITIONS,
        signing_key=None,
    )


def home(trace_id: str) -> int:
    return collector_partition(trace_id.encode(), PARTITIONS)


def source(topic: str = "otlp_spans", partition: int = 0, offset: int = 41) -> Message:
    return Message(topic, partition, offset, 0.0, 0, None, None, b"batch", None)


def traces_in(value: bytes) -> list[str]:
    return [
        span.trace_id.hex()
        for resource_spans in ExportTraceServiceRequest.FromString(value).resource_spans
        for scope_spans in resource_spans.scope_spans
        for span in scope_spans.spans
    ]


def agents(count: int, calls: int = 4) -> list[AgentRecorder]:
    out = [AgentRecorder(f"svc-{n}") for n in range(count)]
    for agent in out:
        for _ in range(calls):
            agent.tool("search_docs", REFUND)
    return out


def test_a_whole_batch_becomes_one_record_per_partition_each_trace_on_its_own() -> None:
    fleet = agents(24)
    batch = encode([span for agent in fleet for span in agent.finished()]).SerializeToString()
    outcome = SpanPipeline(Guard()).handle(None, batch)  # the Collector's unkeyed batch
    assert outcome.decisions == [] and len(outcome.repartition) == 24
    sends = outbox().sends_for(outcome, source())
    partitions = [send.kwargs["partition"] for send in sends]
    assert sorted(partitions) == sorted({home(a.trace_id) for a in fleet})  # one per partition
    placed: list[str] = []
    for send in sends:
        held = set(traces_in(send.kwargs["value"]))
        assert {home(trace_id) for trace_id in held} == {send.kwargs["partition"]}
        assert send.kwargs["key"] == (next(iter(held)).encode() if len(held) == 1 else None)
        assert send.deferred and send.decision is None  # acked by the flush, not per batch
        assert send.source.offset == 41  # a pack that cannot be written points at its source
        placed.extend(held)
    assert sorted(placed) == sorted(a.trace_id for a in fleet)


def test_a_pack_read_on_its_partition_is_decided_there_and_trips_every_loop() -> None:
    fleet = agents(12)
    batch = encode([span for agent in fleet for span in agent.finished()]).SerializeToString()
    sends = outbox().sends_for(SpanPipeline(Guard()).handle(None, batch), source())
    guard = Guard()
    pipeline = SpanPipeline(guard, home=home)
    killed: list[str] = []
    for send in sends:
        partition = send.kwargs["partition"]
        outcome = pipeline.handle(send.kwargs["key"], send.kwargs["value"], partition)
        assert outcome.repartition == [] and outcome.dead_letter is None
        killed += [d.trace_id for d in outcome.decisions if d.action == "kill"]
    assert sorted(killed) == sorted(a.trace_id for a in fleet)
    assert pipeline.repartitioned == 0  # no second hop


def test_a_pack_read_elsewhere_or_from_the_input_topic_is_split_again() -> None:
    fleet = agents(12)
    batch = encode([span for agent in fleet for span in agent.finished()]).SerializeToString()
    (pack, *_) = [
        s for s in outbox().sends_for(SpanPipeline(Guard()).handle(None, batch), source())
        if s.kwargs["key"] is None
    ]  # fmt: skip
    value, partition = pack.kwargs["value"], pack.kwargs["partition"]
    pipeline = SpanPipeline(Guard(), home=home)
    wrong = pipeline.handle(None, value, (partition + 1) % PARTITIONS)
    assert wrong.decisions == [] and {t for t, _ in wrong.repartition} == set(traces_in(value))
    # Unkeyed input is always re-keyed, whatever partition it landed on: every unkeyed span of
    # a trace takes the same hop, so its calls stay in order.
    on_input = pipeline.handle(None, value, None)
    assert on_input.decisions == [] and len(on_input.repartition) == len(set(traces_in(value)))


def test_a_pack_stays_under_the_record_limit() -> None:
    parts = [(f"{n:032x}", b"x" * 300_000) for n in range(40)]
    sends = outbox().repartition_sends(parts, source())
    assert all(len(s.kwargs["value"]) <= MAX_RECORD_BYTES for s in sends)
    assert sum(len(s.kwargs["value"]) for s in sends) == 40 * 300_000
    per_partition: dict[int, int] = {}
    for trace_id, _ in parts:
        per_partition[home(trace_id)] = per_partition.get(home(trace_id), 0) + 1
    # Three parts of 300 kB fit a record: ceil(n / 3) records for a partition's n parts.
    assert len(sends) == sum(-(-n // 3) for n in per_partition.values())


def test_a_pack_that_cannot_be_written_leaves_a_pointer_to_its_source() -> None:
    box = outbox()
    (send,) = box.repartition_sends([("a" * 32, b"spans")], source("otlp_spans", 2, 977))
    (pointer,) = box.pointers_to_unsent([send])
    headers = dict(pointer.kwargs["headers"])
    assert headers[HEADER_TOPIC] == b"otlp_spans" and headers[HEADER_OFFSET] == b"977"
    assert pointer.kwargs["key"] == b"a" * 32
