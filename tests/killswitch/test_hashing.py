"""ArgsHashingSpanProcessor with the real SDK: hashes leave the agent, content does not."""

from __future__ import annotations

import json

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from spanguard.detection.canonical import args_hash
from spanguard.detection.conventions.decoding import decode_arguments
from spanguard.detection.conventions.keys import ARGS_HASH_KEY, RESULT_HASH_KEY
from spanguard.killswitch.hashing import ArgsHashingSpanProcessor
from spanguard.schemas.policy import DEFAULT_VOLATILE_KEYS, Policy

REFUND = {"query": "refund policy", "request_id": "r-1"}


def pipeline(**options):
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "support-bot"}))
    provider.add_span_processor(ArgsHashingSpanProcessor(SimpleSpanProcessor(exporter), **options))
    return provider.get_tracer("openinference.instrumentation.langchain"), exporter


def tool_span(tracer, arguments: str, result: str = "no results") -> None:
    attributes = {
        "openinference.span.kind": "TOOL",
        "tool.name": "search_docs",
        "input.value": arguments,
        "output.value": result,
    }
    with tracer.start_as_current_span("search_docs", attributes=attributes) as span:
        span.add_event("message", {"content": arguments})


def test_tool_arguments_and_results_leave_as_the_cores_own_hashes():
    tracer, exporter = pipeline()
    tool_span(tracer, json.dumps(REFUND))
    with tracer.start_as_current_span("chat", attributes={
        "openinference.span.kind": "LLM", "llm.input_messages.0.message.content": "my card is 4111",
        "input.value": "my card is 4111", "llm.token_count.prompt": 12,
    }):  # fmt: skip
        pass
    tool, chat = exporter.get_finished_spans()
    assert tool.attributes[ARGS_HASH_KEY] == args_hash(REFUND, DEFAULT_VOLATILE_KEYS)
    result = decode_arguments("no results")  # how the core reads a plain-text result
    assert tool.attributes[RESULT_HASH_KEY] == args_hash(result, DEFAULT_VOLATILE_KEYS)
    assert "input.value" not in tool.attributes and "output.value" not in tool.attributes
    assert tool.events[0].attributes == {}
    assert dict(chat.attributes) == {"openinference.span.kind": "LLM", "llm.token_count.prompt": 12}


def test_the_policys_volatile_keys_and_foldings_shape_the_hash():
    policy = Policy.from_mapping(
        {"defaults": {"volatile_keys": ["session"], "fold": {"search_docs": ["case"]}}}
    )
    tracer, exporter = pipeline(policy=policy)
    tool_span(tracer, json.dumps({"query": "Refund Policy", "session": "s-1"}))
    tool_span(tracer, json.dumps({"query": "refund policy", "session": "s-2"}))
    first, second = exporter.get_finished_spans()
    assert first.attributes[ARGS_HASH_KEY] == second.attributes[ARGS_HASH_KEY]


def test_redacted_arguments_get_no_hash_and_content_may_be_kept_elsewhere():
    tracer, exporter = pipeline(strip_content=False)
    tool_span(tracer, "__REDACTED__")
    with tracer.start_as_current_span("chat", attributes={"input.value": "hello"}):
        pass
    tool, chat = exporter.get_finished_spans()
    assert ARGS_HASH_KEY not in tool.attributes and "input.value" not in tool.attributes
    assert chat.attributes["input.value"] == "hello"  # strip_content=False: tool spans only


def strands_call(tracer, call_id: str) -> None:
    """One strands-agents 1.62 tool call with its legacy events, as its telemetry/tracer.py writes
    them: the tool span's `gen_ai.tool.message` (`"content": ... serialize(tool["input"])`) and
    `gen_ai.choice` (`"message": ... serialize(content)`), and the event loop cycle's
    `gen_ai.choice` with `event_attributes["tool.result"] = self._redact("gen_ai.input.messages",
    serialize(tool_result_message["content"]))`."""
    tool_use = {"toolUseId": call_id, "name": "search_docs", "input": REFUND}
    result = {"toolUseId": call_id, "status": "success", "content": [{"text": "no results"}]}
    with tracer.start_as_current_span("execute_event_loop_cycle", attributes={
        "gen_ai.operation.name": "execute_event_loop_cycle", "gen_ai.system": "strands-agents",
    }) as cycle:  # fmt: skip
        with tracer.start_as_current_span(f"execute_tool {tool_use['name']}", attributes={
            "gen_ai.operation.name": "execute_tool", "gen_ai.system": "strands-agents",
            "gen_ai.tool.name": "search_docs", "gen_ai.tool.call.id": call_id,
        }) as tool:  # fmt: skip
            tool.add_event(
                "gen_ai.tool.message",
                {"role": "tool", "content": json.dumps(REFUND), "id": call_id},
            )
            tool.add_event(
                "gen_ai.choice", {"message": json.dumps(result["content"]), "id": call_id}
            )
        cycle.add_event(
            "gen_ai.choice",
            {
                "message": json.dumps([{"toolUse": tool_use}]),
                "tool.result": json.dumps([{"toolResult": result}]),
            },
        )


def test_strands_events_leave_without_arguments_or_results():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(ArgsHashingSpanProcessor(SimpleSpanProcessor(exporter)))
    tracer = provider.get_tracer("strands.telemetry.tracer")
    strands_call(tracer, "call_1")
    strands_call(tracer, "call_2")
    spans = exporter.get_finished_spans()
    tools = [span for span in spans if span.name == "execute_tool search_docs"]
    assert len(spans) == 4 and len(tools) == 2
    # Identical calls keep identical keys: the arguments' and the result's hashes.
    assert tools[0].attributes[ARGS_HASH_KEY] == args_hash(REFUND, DEFAULT_VOLATILE_KEYS)
    assert tools[0].attributes[ARGS_HASH_KEY] == tools[1].attributes[ARGS_HASH_KEY]
    assert tools[0].attributes[RESULT_HASH_KEY] == tools[1].attributes[RESULT_HASH_KEY]
    for span in spans:
        texts = [str(value) for value in span.attributes.values()] + [
            str(value) for event in span.events for value in event.attributes.values()
        ]
        assert not [text for text in texts if "refund" in text or "no results" in text], span.name
    # What is no content stays: the call id, the role.
    assert dict(tools[0].events[0].attributes) == {"role": "tool", "id": "call_1"}
