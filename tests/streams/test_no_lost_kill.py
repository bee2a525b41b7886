"""A kill is never lost to a bad neighbour: a span the rules cannot read costs itself only.

Each case puts the looping trace's 3rd identical call in one request with a hostile span after
it; before, the exception dead-lettered the whole request and the trace's fired mark (set
before the raise) meant it never tripped again.
"""

from __future__ import annotations

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from spanguard.detection.guard import Guard
from spanguard.detection.pipeline import SpanPipeline
from spanguard.schemas.policy import Policy
from tests.support.spans import AgentRecorder, encode, span_id_of

REFUND = {"query": "refund policy"}
BUDGET = Policy.from_mapping({"defaults": {"token_budget": 1000}})


def deep(depth: int) -> str:
    return "[" * depth + "]" * depth


HOSTILE = [
    ("NaN token count", lambda a: a.chat(0, 0, **{"gen_ai.usage.input_tokens": float("nan")})),
    ("superscript token count", lambda a: a.chat(0, 0, **{"gen_ai.usage.output_tokens": "²"})),
    ("arguments nested 5000 deep", lambda a: a.tool("search_docs", deep(5000))),
    ("a megabyte tool name", lambda a: a.tool("x" * 1_000_000, REFUND, call_id="y" * 1_000_000)),
]


@pytest.mark.parametrize(("label", "hostile"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_span_after_the_tripping_call_keeps_the_kill(label, hostile):
    agent = AgentRecorder()
    for _ in range(3):
        agent.tool("search_docs", REFUND)
    hostile(agent)
    guard = Guard(BUDGET)
    pipeline = SpanPipeline(guard)
    key = agent.trace_id.encode()
    spans = agent.finished()
    for span in spans[:2]:
        assert pipeline.handle(key, encode([span]).SerializeToString()).decisions == []
    outcome = pipeline.handle(key, encode(spans[2:]).SerializeToString())
    assert outcome.dead_letter is None, outcome.dead_letter
    (decision,) = outcome.decisions
    assert decision.span_id == span_id_of(spans[2])
    state = guard.states[agent.trace_id]
    assert len(state.to_bytes()) < 10_000  # bounded in bytes, whatever the names


def test_a_retracted_kill_trips_again_on_the_next_call():
    agent = AgentRecorder()
    for _ in range(6):
        agent.tool("search_docs", REFUND)
    guard = Guard()
    spans = agent.finished()
    (first,) = [d for s in spans[:3] for d in guard.process(encode([s]))]
    guard.retract(first)  # its signal could not be sent
    # The window restarted at the trip: three more identical calls trip it again.
    (again,) = [d for s in spans[3:] for d in guard.process(encode([s]))]
    assert again.span_id == span_id_of(spans[5])


def test_a_malformed_trace_id_costs_its_spans_not_the_other_traces():
    good, bad = AgentRecorder(), AgentRecorder()
    good.tool("search_docs", REFUND)
    bad.tool("search_docs", REFUND)
    request = encode(good.finished() + bad.finished())
    request.resource_spans[-1].scope_spans[-1].spans[-1].trace_id = b"\x01" * 5
    outcome = SpanPipeline(Guard()).handle(None, request.SerializeToString())
    assert [trace_id for trace_id, _ in outcome.repartition] == [good.trace_id]
    assert outcome.dead_letter == "a span has a 5-byte trace id (OTLP requires 16 bytes)"
    (dead,) = [s for r in ExportTraceServiceRequest.FromString(outcome.dead_value).resource_spans
               for ss in r.scope_spans for s in ss.spans]  # fmt: skip
    assert dead.trace_id == b"\x01" * 5
