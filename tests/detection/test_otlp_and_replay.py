"""OTLP decoding (protobuf and OTLP/JSON lines) and `spanguard replay` end to end on files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from spanguard.errors import OtlpDecodeError
from spanguard.schemas.decision import validate
from spanguard.schemas.otlp import (
    decode_json_line,
    decode_protobuf,
    encode_json_line,
    split_by_trace,
)
from tests.support.spans import AgentRecorder, encode, span_id_of

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
REFUND = {"query": "refund policy"}

# What the Collector's file exporter writes: hex ids, int64 as strings, enums as numbers.
COLLECTOR_LINE = json.dumps(
    {
        "resourceSpans": [
            {
                "resource": {
                    "attributes": [{"key": "service.name", "value": {"stringValue": "support-bot"}}]
                },
                "scopeSpans": [
                    {
                        "scope": {"name": "agent"},
                        "spans": [
                            {
                                "traceId": "5b8efff798038103d269b633813fc60c",
                                "spanId": "eee19b7ec3c1b174",
                                "parentSpanId": "eee19b7ec3c1b173",
                                "name": "execute_tool search_docs",
                                "kind": 1,
                                "startTimeUnixNano": "1544712660000000000",
                                "endTimeUnixNano": "1544712661000000000",
                                "attributes": [
                                    {
                                        "key": "gen_ai.operation.name",
                                        "value": {"stringValue": "execute_tool"},
                                    },
                                    {
                                        "key": "gen_ai.tool.name",
                                        "value": {"stringValue": "search_docs"},
                                    },
                                    {
                                        "key": "gen_ai.usage.input_tokens",
                                        "value": {"intValue": "42"},
                                    },
                                ],
                                "status": {},
                            }
                        ],
                    }
                ],
            }
        ]
    }
)


def test_collector_style_otlp_json_line():
    request = decode_json_line(COLLECTOR_LINE)
    span = request.resource_spans[0].scope_spans[0].spans[0]
    assert span.trace_id.hex() == "5b8efff798038103d269b633813fc60c"
    assert span.span_id.hex() == "eee19b7ec3c1b174"
    assert span.start_time_unix_nano == 1544712660000000000
    assert span.attributes[2].value.int_value == 42


def test_protobuf_and_json_round_trip_to_the_same_request():
    agent = AgentRecorder()
    agent.tool("search_docs", REFUND)
    request = encode(agent.finished())
    assert decode_protobuf(request.SerializeToString()) == request
    assert decode_json_line(encode_json_line(request)) == request


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\xff\xff\xff\xff garbage", "not an OTLP ExportTraceServiceRequest"),
        (b"\n\x04\x12\x02\x12\x00", "no span has an end_time_unix_nano"),  # an empty span
        (b"\n\r\x12\x0b\x12\tA\x01\x00\x00\x00\x00\x00\x00\x00", "0-byte trace id"),
    ],
)
def test_bad_protobuf_is_a_clear_error(payload, reason):
    with pytest.raises(OtlpDecodeError, match=reason):
        decode_protobuf(payload)


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "an object with resourceSpans"),
        ('{"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz"}]}]}]}', "is not hex"),
        ('{"resourceSpans": [{"scopeSpans": [{"spans": [{"name": 5}]}]}]}', "not an OTLP/JSON"),
    ],
)
def test_bad_json_lines_are_clear_errors(line, reason):
    with pytest.raises(OtlpDecodeError, match=reason):
        decode_json_line(line)


def test_split_by_trace_keeps_resource_and_every_span():
    first, second = AgentRecorder("svc-a"), AgentRecorder("svc-b")
    for agent in (first, second, first):
        agent.tool("search_docs", REFUND)
    request = encode(first.finished() + second.finished())
    parts = split_by_trace(request)
    assert set(parts) == {first.trace_id, second.trace_id}
    for agent, part in ((first, parts[first.trace_id]), (second, parts[second.trace_id])):
        spans = [s for rs in part.resource_spans for ss in rs.scope_spans for s in ss.spans]
        assert [s.span_id.hex() for s in spans] == [span_id_of(s) for s in agent.finished()]
        service = part.resource_spans[0].resource.attributes
        assert any(kv.key == "service.name" for kv in service)


def run_replay(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "spanguard.cli", "replay", *args],
        input=stdin,
        capture_output=True,
        timeout=120,
    )


@pytest.fixture
def corpus(tmp_path: Path) -> dict[str, object]:
    """A looping support agent (JSON lines, one broken line), a research agent (.pb)."""
    looper = AgentRecorder("support-bot", "support")
    for step in range(6):
        looper.chat(100, 10)
        looper.tool("search_docs", {**REFUND, "request_id": f"r{step}"})
    looper.finish()
    lines = [encode_json_line(encode([span])) for span in looper.finished()]
    lines.insert(3, '{"resourceSpans": [ broken')
    (tmp_path / "support.jsonl").write_text("\n".join(lines) + "\n")

    research = AgentRecorder("research-assistant", "researcher")
    for step in range(80):
        research.tool("search_web", {"q": f"topic {step}"})
    research.finish()
    (tmp_path / "research.pb").write_bytes(encode(research.finished()).SerializeToString())
    return {"dir": tmp_path, "looper": looper, "research": research}


def test_replay_prints_one_decision_per_line(corpus):
    directory: Path = corpus["dir"]
    result = run_replay(
        "--policy",
        str(EXAMPLES / "policy.yaml"),
        str(directory / "research.pb"),
        str(directory / "support.jsonl"),
    )
    assert result.returncode == 1, result.stderr.decode()  # 1: a broken line was skipped
    records = [json.loads(line) for line in result.stdout.decode().splitlines()]
    looper = corpus["looper"]
    tool_spans = [s for s in looper.finished() if s.name.startswith("execute_tool")]
    # support-bot's policy says downgrade: a downgrade on the 3rd call, then the window starts
    # afresh and the 3rd call after it (the 6th) is killed.
    assert [(r["rule"], r["action"], r["span_id"]) for r in records] == [
        ("tool_loop", "downgrade", span_id_of(tool_spans[2])),
        ("tool_loop", "kill", span_id_of(tool_spans[5])),
    ]
    record = records[0]
    for record in records:
        validate(record, "detection")
    assert record["trace_id"] == looper.trace_id
    assert record["reason"] == "search_docs called 3x in last 3 steps"
    assert record["agent"] == {"service": "support-bot", "name": None}
    stderr = result.stderr.decode()
    assert "support.jsonl:4: skipped: not JSON" in stderr
    assert "replay: " in stderr.splitlines()[-1] and "86 tool calls" in stderr.splitlines()[-1]
    assert "1 broken inputs skipped" in stderr.splitlines()[-1]


def test_replay_of_intact_inputs_exits_0(corpus):
    result = run_replay(str(corpus["dir"] / "research.pb"))
    assert result.returncode == 0, result.stderr.decode()
    assert "broken inputs skipped" not in result.stderr.decode()


def test_replay_reads_stdin(corpus):
    data = (corpus["dir"] / "support.jsonl").read_bytes()
    result = run_replay("-", stdin=data)
    assert result.returncode == 1  # the corpus's broken line
    (record,) = (json.loads(line) for line in result.stdout.decode().splitlines())
    assert record["action"] == "kill" and record["hits"] == 3


def test_replay_bad_policy_exits_2_naming_the_field(tmp_path, corpus):
    policy = tmp_path / "policy.yaml"
    policy.write_text("defaults:\n  loop: {window: 10, threshold: 0}\n")
    result = run_replay("--policy", str(policy), str(corpus["dir"] / "research.pb"))
    assert result.returncode == 2
    assert "defaults.loop.threshold" in result.stderr.decode()


def test_replay_missing_file_exits_2(tmp_path):
    result = run_replay(str(tmp_path / "nope.jsonl"))
    assert result.returncode == 2
    assert "nope.jsonl" in result.stderr.decode()


def test_a_span_without_an_end_time_costs_only_itself():
    """Among spans that have one, a span with no end time is a bad span of a trace request,
    not a metrics request in disguise: the other spans' loop is still caught."""
    from spanguard.detection.guard import Guard
    from spanguard.schemas.otlp_view import not_a_trace_request

    agent = AgentRecorder()
    for _ in range(4):
        agent.tool("search_docs", REFUND)
    request = encode(agent.finished())
    spans = request.resource_spans[0].scope_spans[0].spans
    broken = spans.add()
    broken.CopyFrom(spans[0])
    broken.span_id = b"\x07" * 8
    broken.ClearField("end_time_unix_nano")
    data = request.SerializeToString()
    assert not_a_trace_request(data) is None
    decisions = Guard().process(data)
    assert [d.action for d in decisions] == ["kill"]
    broken_only = encode(agent.finished()[:1])
    broken_only.resource_spans[0].scope_spans[0].spans[0].ClearField("end_time_unix_nano")
    assert "no span has an end_time_unix_nano" in not_a_trace_request(
        broken_only.SerializeToString()
    )
