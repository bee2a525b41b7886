"""The tool scope in the worker, on the real broker: a fleet's tool calls land on every span
partition, their compact rows meet on the tool call topic keyed by tool, and the tool scope
agent decides one incident per cause: a tool failing for the fleet is one incident (through a
SIGKILL of one of two workers too), and so is a provider failing for the fleet (its model
calls); one agent hammering a tool alone, or a tool failing for a few traces among thousands,
is none.

The fleet is the bench corpus (bench/corpus.py) laid over ten minutes of span time, its
`search_docs` failing for everyone from minute 2 to minute 6 (tests/support/fleet.py's
synthetic fleet, as OTLP requests)."""

from __future__ import annotations

import collections
import json
import signal
import time
from collections.abc import Callable

import pytest
import yaml
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from bench.corpus import build_corpus
from spanguard.detection.fleet import FleetGuard
from spanguard.detection.guard import Guard
from spanguard.schemas.policy import FleetPolicy, Policy
from spanguard.schemas.scope_records import decode_tool_calls
from tests.support.fleet import BASE_NS, SECOND, model_requests
from tests.support.kafka_harness import Collector, Topics, ensure_broker, producer
from tests.support.worker import running_worker, worker_starter

pytestmark = pytest.mark.kafka

FAILING = "search_docs"
POLICY = {"fleet": {"enabled": True}}
STATUS_ERROR = 2


def fleet_requests(
    traces: int = 200,
    spans: int = 12_000,
    fails: tuple[int, int] | None = (120, 360),
    failing_traces: set[str] | None = None,
    minutes: int = 10,
) -> list[bytes]:
    """The bench corpus's requests spread evenly over `minutes` of span time, FAILING's spans
    failing from `fails[0]` to `fails[1]` seconds in (or only those of `failing_traces`)."""
    corpus = build_corpus(total_spans=spans, traces=traces, loop_every=10**9)
    requests = []
    count = len(corpus.requests)
    for index, data in enumerate(corpus.requests):
        request = ExportTraceServiceRequest.FromString(data)
        at = BASE_NS + index * minutes * 60 * SECOND // count
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    span.start_time_unix_nano, span.end_time_unix_nano = at - 1000, at
                    if not _calls(span, FAILING):
                        continue
                    if fails is not None and fails[0] * SECOND <= at - BASE_NS < fails[1] * SECOND:
                        span.status.code = STATUS_ERROR
                    if failing_traces is not None and span.trace_id.hex() in failing_traces:
                        span.status.code = STATUS_ERROR
        requests.append(request.SerializeToString())
    return requests


def _calls(span, tool: str) -> bool:
    return any(
        a.key == "gen_ai.tool.name" and a.value.string_value == tool for a in span.attributes
    )


def hammering(requests: list[bytes], calls: int = 40) -> bytes:
    """One agent alone calling FAILING again and again with the same arguments, failing: a
    trace of its own, over two minutes from minute 2."""
    for data in requests:
        request = ExportTraceServiceRequest.FromString(data)
        for resource_spans in request.resource_spans:
            for span in resource_spans.scope_spans[0].spans:
                if _calls(span, FAILING):
                    template, resource = span, resource_spans
                    break
            else:
                continue
            break
        else:
            continue
        break
    alone = ExportTraceServiceRequest()
    part = alone.resource_spans.add()
    part.resource.CopyFrom(resource.resource)
    scope_spans = part.scope_spans.add()
    for n in range(calls):
        span = scope_spans.spans.add()
        span.CopyFrom(template)
        span.trace_id = bytes.fromhex("feed" * 8)
        span.span_id = (n + 1).to_bytes(8, "big")
        span.end_time_unix_nano = BASE_NS + (120 + 3 * n) * SECOND
        span.start_time_unix_nano = span.end_time_unix_nano - 1000
        span.status.code = STATUS_ERROR
    return alone.SerializeToString()


def core_decisions(requests: list[bytes]) -> list:
    """What the pure core decides over the requests, in order (replay's answer)."""
    policy = Policy.from_mapping(POLICY)
    guard = Guard(policy, tools=FleetGuard(policy))
    return [decision for request in requests for decision in guard.process(request)]


def send(topic: str, requests: list[bytes]) -> None:
    """Unkeyed, as a Collector without the trace-id partitioner writes them: the worker
    splits each through its repartition topic."""
    out = producer()
    for request in requests:
        out.produce(topic, value=request)
    assert out.flush(30) == 0


def rows_through(collector: Collector, topic: str) -> int:
    """The newest span end time the tool call topic's rows hold so far (ns)."""
    newest = 0
    for message in list(collector.messages):
        if message["topic"] == topic:
            _key, rows = decode_tool_calls(message["key"], message["value"])
            newest = max([newest, *(row[5] if row[0] == "c" else row[4] for row in rows)])
    return newest


def send_in_step(
    topic: str, requests: list[bytes], collector: Collector, tool_calls: str, minutes: int = 10
) -> None:
    """A minute of span time at a time, each once its rows are on the tool call topic: the
    fleet's spans arrive as they end, not ten minutes of them in a burst (the partitions would
    then run minutes apart, further than the window's clock follows)."""
    per_minute = len(requests) // minutes + 1
    for start in range(0, len(requests), per_minute):
        chunk = requests[start : start + per_minute]
        send(topic, chunk)
        last = ExportTraceServiceRequest.FromString(chunk[-1])
        ended = last.resource_spans[0].scope_spans[0].spans[0].end_time_unix_nano
        wait_until(
            lambda ended=ended: rows_through(collector, tool_calls) >= ended,
            90,
            f"the tool call rows through request {start + len(chunk)}",
        )


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def detections(collector: Collector, topic: str) -> list[dict]:
    return [json.loads(m["value"]) for m in list(collector.messages) if m["topic"] == topic]


def tool_records(collector: Collector, topic: str) -> list[dict]:
    return [d for d in detections(collector, topic) if d.get("scope") == "tool"]


def test_a_fleet_whose_tool_breaks_at_minute_2_is_one_incident(tmp_path):
    requests = fleet_requests()
    expected = [d for d in core_decisions(requests) if d.scope_kind == "tool"]
    assert [(d.rule, d.action) for d in expected] == [
        ("tool_failing", "flag"),
        ("tool_failing", "recovered"),
    ]
    with running_worker(
        tmp_path, policy=yaml.safe_dump(POLICY), collect=("detections", "tool_calls")
    ) as worker:
        topics = worker.topics
        send_in_step(topics.input, requests, worker.collector, topics.tool_calls)
        wait_until(
            lambda: any(
                r["action"] == "recovered"
                for r in tool_records(worker.collector, topics.detections)
            ),
            120,
            "the incident and its recovery",
        )
        time.sleep(3.0)  # time for a second incident to show up, were there one
        records = tool_records(worker.collector, topics.detections)
        rows = [m for m in list(worker.collector.messages) if m["topic"] == topics.tool_calls]
    opened = {r["decision_id"]: r for r in records if r["action"] == "flag"}
    assert len(opened) == 1, [
        (r["action"], r["tool"], r["reason"], r["decision_id"][:6]) for r in records
    ]
    [incident] = opened.values()
    recovery = next(r for r in records if r["action"] == "recovered")
    assert (incident["rule"], incident["tool"], incident["trace_id"]) == (
        "tool_failing",
        FAILING,
        recovery["trace_id"],
    )
    # Decided on the spans of minutes 2 to 4, naming the traces and agents it hit.
    ended = incident["span_ended_at"]
    assert "T08:02:" <= ended[10:17] < "T08:04:", ended
    assert len(incident["trace_ids"]) == 20 and incident["agents"]
    assert incident["hits"] >= 8 and incident["traces"] >= incident["hits"]
    assert {m["key"] for m in rows} >= {json.dumps([FAILING, ""]).replace(" ", "").encode()}
    print(
        f"\nfleet of 200: failure from 08:02:00 (span time), incident at {ended} span time"
        f" ({incident['hits']} of {incident['traces']} traces failing), recovered at"
        f" {recovery['span_ended_at']};"
        f" core: {expected[0].span_ended_at}; {len(rows)} tool call records"
    )


def test_one_agent_hammering_a_tool_and_a_few_failing_traces_among_thousands_are_no_incident(
    tmp_path,
):
    healthy = fleet_requests(traces=2000, spans=24_000, fails=None)
    corpus = build_corpus(total_spans=24_000, traces=2000, loop_every=10**9)
    callers = sorted({trace for trace, tool, _ in corpus.tool_calls if tool == FAILING})
    assert len(callers) > 500  # calling FAILING: six of them fail
    requests = fleet_requests(
        traces=2000, spans=24_000, fails=None, failing_traces=set(callers[:6])
    )
    requests.insert(len(requests) // 4, hammering(healthy))
    core = core_decisions(requests)
    assert [d.scope_kind for d in core if d.scope_kind == "tool"] == []
    hammered = [(d.rule, d.action) for d in core if d.trace_id == "feed" * 8]
    assert hammered[0] == ("tool_loop", "kill")
    with running_worker(tmp_path, policy=yaml.safe_dump(POLICY), collect=("detections",)) as worker:
        topics = worker.topics
        send(topics.input, requests)
        wait_until(
            lambda: any(
                d["trace_id"] == "feed" * 8 for d in detections(worker.collector, topics.detections)
            ),
            120,
            "the hammering agent's trace-level decision",
        )
        # The last records through: the worker's metrics say every message was read.
        wait_until(
            lambda: (
                (worker.process.metrics() or {}).get("spanguard_messages_total", 0) >= len(requests)
            ),
            120,
            "every request read",
        )
        time.sleep(5.0)  # time for an incident to show up, were there one
        decided = detections(worker.collector, topics.detections)
    assert [d for d in decided if d.get("scope") == "tool"] == []
    assert [(d["rule"], d["action"]) for d in decided if d["trace_id"] == "feed" * 8] == hammered


def test_sigkill_of_one_of_two_workers_mid_window_is_one_incident(tmp_path):
    ensure_broker()
    requests = fleet_requests()
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(yaml.safe_dump(POLICY))
    topics = Topics()
    start = worker_starter(topics, tmp_path, policy_file, 4)
    first, second = start("a", "b")
    workers = [first, second]
    collector = Collector(topics.detections, topics.tool_calls)
    try:
        third = len(requests) * 3 // 10  # minute 3: the failure began, the incident is near
        send_in_step(topics.input, requests[:third], collector, topics.tool_calls, minutes=3)
        second.stop(signal.SIGKILL)  # mid-window: its batches maybe half decided
        (second,) = start("b-rescheduled")  # without its volume: its tables come from changelogs
        workers = [first, second]
        send_in_step(topics.input, requests[third:], collector, topics.tool_calls, minutes=7)
        wait_until(
            lambda: any(
                r["action"] == "recovered" for r in tool_records(collector, topics.detections)
            ),
            180,
            "the incident and its recovery",
        )
        time.sleep(3.0)
        records = tool_records(collector, topics.detections)
    finally:
        collector.close()
        for worker in workers:
            worker.stop()
        topics.delete()
    opened = collections.Counter(r["decision_id"] for r in records if r["action"] == "flag")
    print(f"\ntwo workers, one SIGKILLed at minute 3: incident records {dict(opened)}")
    assert len(opened) == 1, [
        (r["action"], r["tool"], r["reason"], r["decision_id"][:6]) for r in records
    ]  # one incident: not two, not none


def test_a_provider_failing_for_many_traces_is_one_incident_naming_the_model(tmp_path):
    failing = model_requests(20, True)
    expected = [d for d in core_decisions(failing) if d.scope_kind == "tool"]
    assert [(d.rule, d.scope.tool) for d in expected if d.scope] == [
        ("tool_failing", "model:openai/gpt-4o")
    ]
    with running_worker(tmp_path, policy=yaml.safe_dump(POLICY), collect=("detections",)) as worker:
        topics = worker.topics
        send(topics.input, failing)
        wait_until(
            lambda: tool_records(worker.collector, topics.detections), 60, "the model's incident"
        )
        wait_until(
            lambda: (
                (worker.process.metrics() or {}).get("spanguard_messages_total", 0) >= len(failing)
            ),
            60,
            "every request read",
        )
        time.sleep(3.0)  # time for a second incident to show up, were there one
        records = tool_records(worker.collector, topics.detections)
    assert [(r["rule"], r["action"], r["tool"]) for r in records] == [
        ("tool_failing", "flag", "model:openai/gpt-4o")
    ]
    assert records[0]["hits"] >= FleetPolicy().min_traces
    assert records[0]["agents"] == ["support-agent"]
