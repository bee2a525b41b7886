"""The streaming worker against a real Kafka broker, with spans from the real SDK.

Spans are made by the OpenTelemetry SDK, encoded by its OTLP encoder and produced with
confluent-kafka the way the Collector's kafka exporter writes them (key = hex trace id).
"""

from __future__ import annotations

import json
import signal
import time
from datetime import datetime
from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from spanguard.schemas.decision import key_id, signature_valid, validate
from spanguard.streams.partitioner import collector_partition
from tests.support.cli import run_spanguard
from tests.support.kafka_harness import Collector, Topics, WorkerProcess, ensure_broker, producer
from tests.support.spans import AgentRecorder, encode, span_id_of
from tests.support.worker import running_worker, send_spans

pytestmark = pytest.mark.kafka

REFUND = {"query": "refund policy"}
SIGNING_KEY = b"worker-test-signing-key"
DEADLINE = 20.0  # seconds from produce to kill signal; typically well under one second

POLICY = """
agents:
  - match: {service.name: support-downgrade}
    action: downgrade
"""


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    with running_worker(
        tmp_path_factory.mktemp("worker"),
        policy=POLICY,
        collect=("kills", "detections", "dead_letters", "repartition"),
        env={"SPANGUARD_SIGNING_KEY": SIGNING_KEY.decode()},
    ) as running:
        yield running.process, running.collector


def kills_for(collector: Collector, topics: Topics, trace_id: str) -> list[dict]:
    return collector.json_from(topics.kills, trace_id)


def test_looping_trace_gets_one_kill_with_evidence(worker):
    process, collector = worker
    topics = process.topics
    agent = AgentRecorder("support-bot", "support")
    for step in range(10):  # the loop goes on after the threshold: still one kill
        agent.tool("search_docs", {**REFUND, "timestamp": step})
    send_spans(topics.input, agent)
    collector.wait(
        lambda m: m["topic"] == topics.kills and m["key"] == agent.trace_id.encode(),
        timeout=DEADLINE,
    )
    process.wait_for("spanguard_tool_calls_observed_total", 3)
    time.sleep(1.0)  # time for a duplicate to show up, were there one
    (signal_record,) = kills_for(collector, topics, agent.trace_id)
    validate(signal_record, "kill-signal")
    assert signature_valid(signal_record, SIGNING_KEY)
    assert not signature_valid(signal_record, b"another key")
    assert signal_record["key_id"] == key_id(SIGNING_KEY)
    # Obeyed for the default SPANGUARD_SIGNAL_TTL (an hour) after the detection.
    lifetime = datetime.fromisoformat(signal_record["expires_at"]) - datetime.fromisoformat(
        signal_record["detected_at"]
    )
    assert lifetime.total_seconds() == 3600
    assert SIGNING_KEY.decode() not in process.log_text()  # never logged
    assert signal_record["kind"] == "kill" and signal_record["rule"] == "tool_loop"
    assert signal_record["trace_id"] == agent.trace_id
    assert signal_record["reason"] == "search_docs called 3x in last 3 steps"
    assert signal_record["evidence"]["span_id"] == span_id_of(agent.finished()[2])
    assert signal_record["evidence"]["tool_name"] == "search_docs"
    assert signal_record["evidence"]["hits"] == 3 and signal_record["evidence"]["window"] == 10
    (detection,) = collector.json_from(topics.detections, agent.trace_id)
    validate(detection, "detection")
    assert detection["decision_id"] == signal_record["signal_id"]


def test_legitimate_traces_get_no_kill(worker):
    process, collector = worker
    topics = process.topics
    research = AgentRecorder("research-assistant", "researcher")
    for step in range(80):
        research.chat(400, 40)
        research.tool(["search_web", "fetch_pdf", "summarize"][step % 3], {"q": f"topic {step}"})
    research.finish()
    before = (process.metrics() or {}).get("spanguard_spans_total", 0)
    send_spans(topics.input, research)
    process.wait_for("spanguard_spans_total", before + len(research.finished()))
    time.sleep(0.5)
    assert kills_for(collector, topics, research.trace_id) == []
    assert collector.json_from(topics.detections, research.trace_id) == []


def test_downgrade_then_kill(worker):
    process, collector = worker
    topics = process.topics
    agent = AgentRecorder("support-downgrade")
    for _ in range(8):  # downgraded at the 3rd call, killed at the 6th, then goes on
        agent.tool("search_docs", REFUND)
    send_spans(topics.input, agent)
    collector.wait(
        lambda m: m["topic"] == topics.kills and m["key"] == agent.trace_id.encode(),
        count=2,
        timeout=DEADLINE,
    )
    signals = kills_for(collector, topics, agent.trace_id)
    assert [s["kind"] for s in signals] == ["downgrade", "kill"]
    assert signals[0]["system_message"].startswith("You called search_docs 3 times")
    assert signals[0]["evidence"]["span_id"] == span_id_of(agent.finished()[2])
    assert signals[1]["evidence"]["span_id"] == span_id_of(agent.finished()[5])
    for record in signals:
        validate(record, "kill-signal")


def test_unkeyed_mixed_message_is_repartitioned(worker):
    process, collector = worker
    topics = process.topics
    first, second, calm = AgentRecorder("svc-a"), AgentRecorder("svc-b"), AgentRecorder("svc-c")
    for step in range(4):
        first.tool("search_docs", REFUND)
        second.tool("lookup", {"id": 7})
        calm.tool("lookup", {"id": step})
    mixed = encode(first.finished() + second.finished() + calm.finished()).SerializeToString()
    out = producer()
    out.produce(topics.input, key=None, value=mixed)
    assert out.flush(10) == 0
    for agent in (first, second):
        collector.wait(
            lambda m, a=agent: m["topic"] == topics.kills and m["key"] == a.trace_id.encode(),
            timeout=DEADLINE,
        )
    # Each trace went to the repartition topic exactly once, with its spans only, on the
    # partition its key gives; the traces bound for one partition share one record (a lone
    # trace keeps its id as the key, a pack has none).
    ours = {a.trace_id for a in (first, second, calm)}

    def traces_in(record: dict) -> list[str]:
        request = ExportTraceServiceRequest.FromString(record["value"])
        return [
            span.trace_id.hex()
            for resource_spans in request.resource_spans
            for scope_spans in resource_spans.scope_spans
            for span in scope_spans.spans
        ]

    homes = {trace_id: collector_partition(trace_id.encode(), 2) for trace_id in ours}
    rekeyed = collector.wait(
        lambda m: m["topic"] == topics.repartition and bool(set(traces_in(m)) & ours),
        count=len(set(homes.values())),
    )
    seen = [trace_id for record in rekeyed for trace_id in dict.fromkeys(traces_in(record))]
    assert sorted(seen) == sorted(ours)
    for record in rekeyed:
        held = set(traces_in(record))
        assert {homes[trace_id] for trace_id in held} == {record["partition"]}
        assert record["key"] == (next(iter(held)).encode() if len(held) == 1 else None)
    assert kills_for(collector, topics, calm.trace_id) == []
    assert (process.metrics() or {})["spanguard_messages_repartitioned_total"] >= 1


def test_poison_message_goes_to_dead_letters_and_the_partition_keeps_going(worker):
    process, collector = worker
    topics = process.topics
    agent = AgentRecorder("support-bot")
    for _ in range(4):
        agent.tool("search_docs", REFUND)
    out = producer()
    poison = b"\x0a\xff\xff\xff\xff\x0f garbage"
    # Same key as the looping trace: same partition, right before its spans.
    out.produce(topics.input, key=agent.trace_id.encode(), value=poison)
    assert out.flush(10) == 0
    send_spans(topics.input, agent)
    (dead,) = collector.wait(lambda m: m["topic"] == topics.dead_letters and m["value"] == poison)
    assert dead["key"] == agent.trace_id.encode()
    assert dead["headers"]["spanguard.reason"].startswith(b"not an OTLP ExportTraceServiceRequest")
    assert dead["headers"]["spanguard.source.topic"] == topics.input.encode()
    assert int(dead["headers"]["spanguard.source.offset"]) >= 0
    collector.wait(
        lambda m: m["topic"] == topics.kills and m["key"] == agent.trace_id.encode(),
        timeout=DEADLINE,
    )
    assert (process.metrics() or {})["spanguard_dead_letters_total"] >= 1


def test_a_metrics_request_that_parses_as_traces_is_a_dead_letter(worker):
    """A sum metric named with 16 bytes, keyed by that name in hex: it parses as a traces request
    whose one span has that trace id, and must still be dead-lettered, not guarded."""
    from tests.test_bad_input import metrics_request

    process, collector = worker
    topics = process.topics
    name = "sixteen-byte-nam"
    value = metrics_request(name, "sum")
    out = producer()
    out.produce(topics.input, key=name.encode().hex().encode(), value=value)
    assert out.flush(10) == 0
    (dead,) = collector.wait(lambda m: m["topic"] == topics.dead_letters and m["value"] == value)
    reason = dead["headers"]["spanguard.reason"].decode()
    assert reason.startswith("not an OTLP ExportTraceServiceRequest: span field 7")
    assert not collector.json_from(topics.detections, name.encode().hex())


def test_metrics_endpoint_speaks_prometheus(worker):
    process, _ = worker
    values = process.metrics()
    assert values is not None
    for name in (
        "spanguard_spans_total",
        "spanguard_tool_calls_observed_total",
        "spanguard_dead_letters_total",
        "spanguard_active_traces",
        "spanguard_cached_traces",
    ):
        assert name in values
    assert values["spanguard_active_traces"] >= 1
    # Decoded states kept between messages: the traces decided so far, within the cache.
    assert 1 <= values["spanguard_cached_traces"] <= 5000


def test_crash_recovery_from_the_changelog(tmp_path):
    ensure_broker()
    topics = Topics()
    collector = Collector(topics.kills)
    worker = WorkerProcess(topics, tmp_path).start()
    try:
        resumed, killed = AgentRecorder("support-bot"), AgentRecorder("support-bot")
        for _ in range(4):
            resumed.tool("search_docs", REFUND)
            killed.tool("lookup_order", {"order": 42})
        send_spans(topics.input, resumed, resumed.finished()[:2])
        send_spans(topics.input, killed)
        collector.wait(lambda m: m["key"] == killed.trace_id.encode(), timeout=DEADLINE)
        worker.wait_for("spanguard_tool_calls_observed_total", 6)
        time.sleep(2.5)  # past the commit interval (1 s): offsets and changelog are written
        worker.stop(signal.SIGKILL)

        worker = WorkerProcess(topics, tmp_path).start()
        killed.tool("lookup_order", {"order": 42})  # the loop goes on after the restart
        send_spans(topics.input, resumed, resumed.finished()[2:])
        send_spans(topics.input, killed, killed.finished()[4:])
        (kill,) = collector.wait(lambda m: m["key"] == resumed.trace_id.encode(), timeout=DEADLINE)
        record = json.loads(kill["value"])
        # The 3rd call tripped: the first two were recovered from the changelog.
        assert record["evidence"]["hits"] == 3
        assert record["evidence"]["span_id"] == span_id_of(resumed.finished()[2])
        worker.wait_for("spanguard_spans_total", 3)
        time.sleep(1.5)
        assert len(kills_for(collector, topics, killed.trace_id)) == 1  # not killed twice
    finally:
        collector.close()
        worker.stop()
        topics.delete()


def test_bad_policy_stops_the_worker_before_kafka(tmp_path: Path):
    policy = tmp_path / "policy.yaml"
    policy.write_text("defaults:\n  action: explode\n")
    result = run_spanguard("worker", "--policy", str(policy))
    assert result.returncode == 2
    assert "defaults.action" in result.stderr
