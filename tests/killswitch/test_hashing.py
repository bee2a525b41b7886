"""ArgsHashingSpanProcessor with the real SDK: hashes leave the agent, content does not."""

from __future__ import annotations

import json

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from spanguard.detection.canonical import args_hash
from spanguard.detection.conventions import ARGS_HASH_KEY, RESULT_HASH_KEY, decode_arguments
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
