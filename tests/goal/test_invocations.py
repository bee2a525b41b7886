"""The end-of-invocation trigger (goal/invocations.py) over real-SDK spans: where an agent's run
ends, and the request, answer and instructions it recorded."""

from __future__ import annotations

import json

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList
from opentelemetry.trace import SpanKind

from spanguard.goal.invocations import InvocationEnd, find_invocation_ends
from tests.support.goal_runs import (
    ANSWER,
    INPUT_MESSAGES,
    INSTRUCTIONS,
    REQUEST,
    agent_run,
    genai_content,
    wire,
)
from tests.support.spans import AgentRecorder, encode, span_id_of


def test_root_invoke_agent_end_with_genai_content():
    agent = agent_run(**genai_content())
    root = agent.finished()[-1]
    ends = find_invocation_ends(wire(agent.finished()))
    assert ends == [
        InvocationEnd(
            trace_id=agent.trace_id,
            span_id=span_id_of(root),
            service="support-bot",
            agent_name="support",
            request=REQUEST,  # the last user message, not the earlier one nor the system's
            answer=ANSWER,  # the text parts only, not the tool call
            instructions=INSTRUCTIONS,
            kind="agent",
        )
    ]
    assert ends[0].has_content


def test_spans_before_the_root_ends_are_not_an_end():
    agent = AgentRecorder("support-bot", "support")
    agent.chat(800, 60)
    agent.tool("search_docs", {"query": "refund damaged"})
    assert find_invocation_ends(wire(agent.finished())) == []
    agent.finish(**genai_content())
    # The root alone, in a later export batch, is the end.
    assert len(find_invocation_ends(wire(agent.finished()[-1:]))) == 1


def test_content_not_recorded_gives_none_never_a_guess():
    agent = agent_run()  # content capture off: no content attributes on the root
    (end,) = find_invocation_ends(wire(agent.finished()))
    assert (end.request, end.answer, end.instructions) == (None, None, None)
    assert not end.has_content
    assert end.kind == "agent" and end.agent_name == "support"


@pytest.mark.parametrize(
    "overrides, expected",
    [
        # Truncated by an attribute length limit: not JSON, not recorded in a form we can read.
        (
            {"gen_ai.input.messages": json.dumps(INPUT_MESSAGES)[:70]},
            (None, ANSWER, INSTRUCTIONS),
        ),
        # Output recorded, input not.
        ({"gen_ai.input.messages": None}, (None, ANSWER, INSTRUCTIONS)),
        # An answer that is only a tool call has no text: no answer.
        (
            {
                "gen_ai.output.messages": json.dumps(
                    [{"role": "assistant", "parts": [{"type": "tool_call", "name": "t"}]}]
                )
            },
            (REQUEST, None, INSTRUCTIONS),
        ),
        # Only the user's message recorded as input, and the older {role, content} shape.
        (
            {
                "gen_ai.input.messages": json.dumps([{"role": "user", "content": REQUEST}]),
                "gen_ai.system_instructions": None,
            },
            (REQUEST, ANSWER, None),
        ),
        # Several text parts are joined; empty text parts are dropped.
        (
            {
                "gen_ai.output.messages": json.dumps(
                    [
                        {
                            "role": "assistant",
                            "parts": [
                                {"type": "text", "content": "Part one."},
                                {"type": "text", "content": "  "},
                                {"type": "reasoning", "content": "thinking..."},
                                {"type": "text", "content": "Part two."},
                            ],
                            "finish_reason": "stop",
                        }
                    ]
                )
            },
            (REQUEST, "Part one.\nPart two.", INSTRUCTIONS),
        ),
        # Plain-text system instructions are kept as recorded.
        ({"gen_ai.system_instructions": INSTRUCTIONS}, (REQUEST, ANSWER, INSTRUCTIONS)),
    ],
    ids=["truncated-json", "no-input", "tool-call-only", "content-shape", "parts", "plain-instr"],
)
def test_partial_or_odd_content(overrides, expected):
    agent = agent_run(**genai_content(**overrides))
    (end,) = find_invocation_ends(wire(agent.finished()))
    assert (end.request, end.answer, end.instructions) == expected


def test_sub_agent_invoke_agent_is_not_an_end():
    agent = AgentRecorder("support-bot", "support")
    sub = agent.span(
        "invoke_agent researcher",
        {
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.agent.name": "researcher",
            **genai_content(
                **{
                    "gen_ai.input.messages": json.dumps(
                        [{"role": "user", "parts": [{"type": "text", "content": "sub task"}]}]
                    )
                }
            ),
        },
    )
    assert sub.parent is not None
    assert find_invocation_ends(wire([sub])) == []
    root = agent.finish(**genai_content())
    ends = find_invocation_ends(wire(agent.finished()))
    assert [(e.span_id, e.agent_name, e.request) for e in ends] == [
        (span_id_of(root), "support", REQUEST)
    ]


def test_openinference_agent_root_with_input_and_output_value():
    agent = AgentRecorder("triage-bot", "unused")
    span = agent.tracer.start_span(
        "Agent",
        context=otel_context.Context(),  # a new trace: this span is its root
        attributes={
            "openinference.span.kind": "AGENT",
            "agent.name": "triage",
            "input.value": "Where is my order 1234?",
            "input.mime_type": "text/plain",
            "output.value": json.dumps("It shipped yesterday and arrives Friday."),
            "output.mime_type": "application/json",
        },
    )
    span.end()
    finished = agent.finished()[-1]
    (end,) = find_invocation_ends(wire([finished]))
    assert end.kind == "agent"
    assert end.trace_id == format(finished.context.trace_id, "032x")
    assert end.span_id == span_id_of(finished)
    assert (end.service, end.agent_name) == ("triage-bot", "triage")
    assert end.request == "Where is my order 1234?"
    assert end.answer == "It shipped yesterday and arrives Friday."  # a JSON string, unwrapped
    assert end.instructions is None


def lone_root_end(service: str, name: str, attributes: dict[str, str]):
    """The invocation end found in a trace of one root span, `name` with `attributes`."""
    agent = AgentRecorder(service, "unused")
    agent.tracer.start_span(name, context=otel_context.Context(), attributes=attributes).end()
    (end,) = find_invocation_ends(wire(agent.finished()[-1:]))
    return end


def test_openinference_json_input_is_passed_as_recorded():
    document = json.dumps({"messages": [{"role": "user", "content": "Cancel order 77"}]})
    end = lone_root_end(
        "triage-bot",
        "Agent",
        {
            "openinference.span.kind": "AGENT",
            "input.value": document,
            "input.mime_type": "application/json",
        },
    )
    assert end.request == document  # not reinterpreted
    assert end.answer is None


def test_trace_root_without_agent_spans_is_the_end():
    end = lone_root_end(
        "rag-service",
        "answer_question",
        {"openinference.span.kind": "CHAIN", "input.value": REQUEST, "output.value": ANSWER},
    )
    assert (end.kind, end.agent_name, end.request, end.answer) == (
        "trace_root",
        None,
        REQUEST,
        ANSWER,
    )


def test_agent_under_a_server_span_the_trace_root_borrows_the_agents_content():
    agent = AgentRecorder("web", "unused")
    server = agent.tracer.start_span(
        "POST /chat", context=otel_context.Context(), kind=SpanKind.SERVER
    )
    in_server = trace.set_span_in_context(server)
    invoke = agent.tracer.start_span(
        "invoke_agent support",
        context=in_server,
        attributes={
            "gen_ai.operation.name": "invoke_agent",
            "gen_ai.agent.name": "support",
            **genai_content(),
        },
    )
    sub = agent.tracer.start_span(
        "invoke_agent researcher",
        context=trace.set_span_in_context(invoke),
        attributes={"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "researcher"},
    )
    sub.end()
    invoke.end()
    # The invoke_agent span has a parent: on its own it is not an end.
    assert find_invocation_ends(wire(agent.finished()[-2:])) == []
    server.end()
    spans = agent.finished()[-3:]
    (end,) = find_invocation_ends(wire(spans))
    assert end.kind == "trace_root" and end.span_id == span_id_of(spans[-1])
    assert (end.agent_name, end.request, end.answer) == ("support", REQUEST, ANSWER)
    # The server span exported alone (the agent went in an earlier batch): nothing to borrow.
    (alone,) = find_invocation_ends(wire(spans[-1:]))
    assert alone.kind == "trace_root" and not alone.has_content


def test_two_runs_in_one_request():
    first = agent_run("support", **genai_content())
    second = agent_run("billing")
    ends = find_invocation_ends(wire(first.finished() + second.finished()))
    assert sorted((e.trace_id, e.agent_name, e.has_content) for e in ends) == sorted(
        [(first.trace_id, "support", True), (second.trace_id, "billing", False)]
    )


def test_structured_content_attributes_from_other_sdks():
    agent = agent_run()
    request = encode(agent.finished())
    root = request.resource_spans[0].scope_spans[0].spans[-1]

    def message(role: str, text: str) -> AnyValue:
        part = KeyValueList(
            values=[
                KeyValue(key="type", value=AnyValue(string_value="text")),
                KeyValue(key="content", value=AnyValue(string_value=text)),
            ]
        )
        return AnyValue(
            kvlist_value=KeyValueList(
                values=[
                    KeyValue(key="role", value=AnyValue(string_value=role)),
                    KeyValue(
                        key="parts",
                        value=AnyValue(
                            array_value=ArrayValue(values=[AnyValue(kvlist_value=part)])
                        ),
                    ),
                ]
            )
        )

    root.attributes.add(
        key="gen_ai.input.messages",
        value=AnyValue(array_value=ArrayValue(values=[message("user", REQUEST)])),
    )
    root.attributes.add(
        key="gen_ai.output.messages",
        value=AnyValue(array_value=ArrayValue(values=[message("assistant", ANSWER)])),
    )
    (end,) = find_invocation_ends(request)
    assert (end.request, end.answer) == (REQUEST, ANSWER)
