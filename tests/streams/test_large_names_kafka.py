"""Megabyte-long tool names and call ids against the real broker and worker, shipped defaults.

The spans come from a producer that compresses (gzip), so a message of a few megabytes of
repetitive text still fits the input topic's default max.message.bytes (1 MiB) on the broker,
which checks the compressed batch. Everything the worker writes must fit that limit too,
uncompressed: kill signals, detections, repartitioned parts and dead letters.
"""

from __future__ import annotations

import json
import time

import pytest
from confluent_kafka import Producer

from tests.support.kafka_harness import CLUSTER, Collector, Topics, WorkerProcess, ensure_broker
from tests.support.spans import AgentRecorder, encode, span_id_of

pytestmark = pytest.mark.kafka

MAX_MESSAGE_BYTES = 1_048_588  # Kafka's default max.message.bytes for a topic
NAME = "search_docs_" + "x" * 1_500_000
CALL_ID = "call_" + "y" * 1_200_000


def compressing_producer() -> Producer:
    return Producer({
        **CLUSTER.config(),
        "compression.type": "gzip",
        "message.max.bytes": 10_000_000,  # the client's own cap is on uncompressed bytes
        "enable.idempotence": True,
    })  # fmt: skip


def huge_loop() -> AgentRecorder:
    agent = AgentRecorder()
    for n in range(6):  # goes on past the threshold: still one kill
        agent.tool(NAME, {"query": "refund policy"}, call_id=f"{CALL_ID}{n}")
    return agent


def test_megabyte_names_and_ids_keep_one_kill_and_every_record_fits(tmp_path):
    ensure_broker()
    topics = Topics()
    worker = WorkerProcess(topics, tmp_path / "w").start()
    changelog = f"{topics.app_id}-trace-state-changelog"
    out = Collector(topics.kills, topics.detections, topics.dead_letters, changelog)
    try:
        keyed, unkeyed = huge_loop(), huge_loop()
        producer = compressing_producer()
        for span in keyed.finished():  # one span per message, keyed like the Collector's
            value = encode([span]).SerializeToString()
            assert len(value) > MAX_MESSAGE_BYTES  # too big for the topic uncompressed
            producer.produce(topics.input, key=keyed.trace_id.encode(), value=value)
        for span in unkeyed.finished():  # unkeyed: the worker re-keys it through repartition
            # One partition keeps the calls in order (unkeyed, they would be spread at random).
            producer.produce(topics.input, value=encode([span]).SerializeToString(), partition=0)
        # Not OTLP, 2 MB: a dead letter.
        producer.produce(topics.input, key=b"junk", value=b"\xff" * 2_000_000)
        # One bad trace id beside a good call in an unkeyed message: the bad span dead-letters.
        bad = AgentRecorder()
        bad.tool(NAME, {"query": "bad id"}, call_id=CALL_ID)
        mixed = encode([*bad.finished(), AgentRecorder().tool("lookup", {"n": 1})])
        mixed.resource_spans[0].scope_spans[0].spans[0].trace_id = b"\x01" * 5
        producer.produce(topics.input, value=mixed.SerializeToString())
        assert producer.flush(30) == 0

        loops = {keyed.trace_id: keyed, unkeyed.trace_id: unkeyed}
        kills = out.wait(lambda m: m["topic"] == topics.kills, count=2, timeout=60)
        out.wait(lambda m: m["topic"] == topics.dead_letters, count=2, timeout=30)
        time.sleep(3)  # time for a second kill or a stray record to show up, were there one

        kills = out.where(lambda m: m["topic"] == topics.kills)
        assert sorted(m["key"].decode() for m in kills) == sorted(loops)  # one kill each
        for message in kills:
            signal = json.loads(message["value"])
            agent = loops[message["key"].decode()]
            assert signal["evidence"]["span_id"] == span_id_of(agent.finished()[2])  # the 3rd
            assert signal["evidence"]["tool_name"].startswith("search_docs_xxx")
            assert len(signal["evidence"]["tool_name"]) <= 200
        for message in out.where(lambda m: m["topic"] != changelog):
            assert len(message["value"] or b"") < MAX_MESSAGE_BYTES, message["topic"]
        detections = out.where(lambda m: m["topic"] == topics.detections)
        assert len(detections) == 2
        assert all(len(m["value"]) < 10_000 for m in kills + detections)

        dead = out.where(lambda m: m["topic"] == topics.dead_letters)
        reasons = sorted(m["headers"]["spanguard.reason"].decode() for m in dead)
        assert reasons[0] == "a span has a 5-byte trace id (OTLP requires 16 bytes)"
        assert reasons[1].startswith("not an OTLP ExportTraceServiceRequest")
        for message in dead:  # too large to copy: the headers point at the source
            assert message["value"] in (b"", None)
            assert message["headers"]["spanguard.source.topic"] == topics.input.encode()
            assert int(message["headers"]["spanguard.source.offset"]) >= 0

        states = [m for m in out.where(lambda m: m["topic"] == changelog) if m["value"]]
        assert {m["key"].decode() for m in states} >= set(loops)
        assert max(len(m["value"]) for m in states) < 10_000  # state stays small
        metrics = worker.metrics() or {}
        assert metrics.get("spanguard_dead_letters_total", 0) == 2, metrics
    finally:
        out.close()
        worker.stop()
        topics.delete()
