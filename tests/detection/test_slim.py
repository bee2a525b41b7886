"""A part too large for one record is cut to what the rules read, and decided the same."""

from __future__ import annotations

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from spanguard.detection.guard import Guard
from spanguard.detection.pipeline import MAX_RECORD_BYTES, SpanPipeline
from spanguard.detection.slim import slim_part
from spanguard.schemas.policy import Policy
from tests.support.spans import AgentRecorder, encode

BUDGET = Policy.from_mapping({"defaults": {"token_budget": 1000}})


def big_agent() -> AgentRecorder:
    agent = AgentRecorder("svc-" + "s" * 300_000, agent_name="agent-" + "a" * 300_000)
    for n in range(5):
        agent.tool("search_" + "x" * 400_000, {"query": "refund"}, call_id="c" * 300_000 + str(n))
        agent.chat(300, 100, **{"gen_ai.output.messages": "o" * 200_000})
    return agent


def decisions(request: ExportTraceServiceRequest) -> list[tuple[str, str, str | None]]:
    guard = Guard(BUDGET)
    found = [d for span in request.resource_spans[0].scope_spans[0].spans
             for d in guard.process(_one(request, span))]  # fmt: skip
    assert all(len(s.to_bytes()) < 10_000 for s in guard.states.values())
    return [(d.rule, d.span_id, d.evidence.tool_name) for d in found]


def _one(request: ExportTraceServiceRequest, span) -> ExportTraceServiceRequest:
    single = ExportTraceServiceRequest()
    single.resource_spans.add(resource=request.resource_spans[0].resource)
    single.resource_spans[0].scope_spans.add().spans.append(span)
    return single


def test_the_slim_part_is_decided_like_the_whole_one() -> None:
    whole = encode(big_agent().finished())
    slim = slim_part(whole, Guard(BUDGET).wanted_keys)
    assert len(whole.SerializeToString()) > 4_000_000
    assert len(slim.SerializeToString()) < 20_000
    found = decisions(whole)
    assert sorted(rule for rule, _, _ in found) == ["token_budget", "tool_loop"]
    assert decisions(slim) == found


def test_an_unkeyed_message_too_large_to_repartition_is_slimmed() -> None:
    agent = big_agent()
    outcome = SpanPipeline(Guard()).handle(None, encode(agent.finished()).SerializeToString())
    assert outcome.dead_letter is None
    ((trace_id, part),) = outcome.repartition
    assert trace_id == agent.trace_id and len(part) <= MAX_RECORD_BYTES


def test_arguments_too_large_even_slim_cost_their_trace_only() -> None:
    big, small = AgentRecorder(), AgentRecorder()
    big.tool("search_docs", {"query": "q" * 1_000_000})
    small.tool("search_docs", {"query": "refund"})
    request = encode(big.finished() + small.finished())
    outcome = SpanPipeline(Guard()).handle(None, request.SerializeToString())
    assert [trace_id for trace_id, _ in outcome.repartition] == [small.trace_id]
    assert outcome.dead_letter is not None
    assert f"the spans of trace {big.trace_id} hold" in outcome.dead_letter
