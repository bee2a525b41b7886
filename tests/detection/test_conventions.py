"""Each convention's tool and inference spans, made by the real SDK, through the same core."""

from __future__ import annotations

import json

import pytest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue, KeyValueList
from opentelemetry.trace import SpanKind

from spanguard.detection.conventions.adapt import adapt_span
from spanguard.detection.conventions.capture import capture_setting
from spanguard.detection.conventions.events import MISSING, TokenUsage, ToolCall
from spanguard.detection.conventions.keys import (
    AGENT_OPERATIONS,
    ARGS_HASH_KEY,
    INFERENCE_OPERATIONS,
    OTHER_OPERATIONS,
)
from spanguard.detection.conventions.turns import ends_with_user_message
from spanguard.detection.guard import MAX_WARNED, Guard
from spanguard.schemas.otlp_view import view_of
from spanguard.schemas.policy import Policy
from tests.support.spans import AgentRecorder, encode, one_request_per_span, span_id_of

REFUND = {"query": "refund policy"}


def decisions(spans, policy: Policy | None = None):
    guard = Guard(policy)
    return [d for request in one_request_per_span(spans) for d in guard.process(request)]


def adapted(span):
    scope_spans = view_of(encode([span])).resource_spans[0].scope_spans[0]
    (proto,) = scope_spans.spans
    return adapt_span(proto, scope=scope_spans.scope.name)


def test_otel_genai_json_string_arguments_and_client_kind():
    agent = AgentRecorder()
    for _ in range(4):
        agent.tool("search_docs", REFUND, kind=SpanKind.CLIENT)
    result = decisions(agent.finished())
    assert [(d.evidence.tool_name, d.evidence.hits) for d in result] == [("search_docs", 3)]


def test_otel_genai_structured_arguments_kvlist():
    agent = AgentRecorder()
    for _ in range(4):
        agent.tool(
            "search_docs",
            attributes={"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "search_docs"},
        )
    request = encode(agent.finished())
    spans = request.resource_spans[0].scope_spans[0].spans
    for index, span in enumerate(spans):
        # The SDK only makes primitive attributes; structured values come from other SDKs.
        pairs = [("query", "refund policy"), ("page", 1), ("nonce", f"n{index}")]
        if index % 2:
            pairs.reverse()
        kvlist = KeyValueList(
            values=[
                KeyValue(
                    key=k,
                    value=AnyValue(string_value=v) if isinstance(v, str) else AnyValue(int_value=v),
                )
                for k, v in pairs
            ]
        )
        span.attributes.add(key="gen_ai.tool.call.arguments", value=AnyValue(kvlist_value=kvlist))
    call = adapt_span(view_of(request).resource_spans[0].scope_spans[0].spans[0])
    assert isinstance(call, ToolCall) and call.arguments == {
        "query": "refund policy",
        "page": 1,
        "nonce": "n0",
    }
    result = Guard().process(request)
    assert [d.span_id for d in result] == [spans[2].span_id.hex()]


def test_bare_form_span_named_execute_tool_without_operation_name():
    agent = AgentRecorder()
    for _ in range(4):
        agent.span(
            "execute_tool",
            {"gen_ai.tool.name": "search_docs", "gen_ai.tool.call.arguments": json.dumps(REFUND)},
        )
    assert len(decisions(agent.finished())) == 1


def test_span_name_alone_is_not_a_tool_span():
    agent = AgentRecorder()
    for name in ("search_docs", "search_docs.tool", "execute_tool search_docs"):
        agent.span(name, {"q": "refund"})
    assert all(adapted(span) is None for span in agent.finished())


def test_openinference_tool_spans_use_input_value_not_tool_parameters():
    agent = AgentRecorder()
    schema = json.dumps({"type": "object", "properties": {"query": {"type": "string"}}})
    for step in range(4):
        agent.span(
            "search_docs",
            {
                "openinference.span.kind": "TOOL",
                "tool.name": "search_docs",
                "tool.parameters": schema,
                "input.value": json.dumps({"query": f"q{step}"}),
                "input.mime_type": "application/json",
            },
        )
    assert decisions(agent.finished()) == []  # four different queries


def test_openinference_without_input_value_is_missing_arguments_not_the_schema():
    agent = AgentRecorder()
    for _ in range(80):
        agent.span(
            "search_web",
            {
                "openinference.span.kind": "TOOL",
                "tool.name": "search_web",
                "tool.parameters": '{"query": "string"}',
            },
        )
    assert adapted(agent.finished()[0]).arguments is MISSING
    assert decisions(agent.finished()) == []


def test_openinference_tool_id_and_llm_tokens():
    agent = AgentRecorder()
    for _ in range(3):
        agent.span(
            "search_docs",
            {
                "openinference.span.kind": "TOOL",
                "tool.name": "search_docs",
                "tool.id": "call_1",
                "input.value": json.dumps(REFUND),
            },
        )
    agent.span(
        "ChatOpenAI",
        {
            "openinference.span.kind": "LLM",
            "llm.token_count.prompt": 70,
            "llm.token_count.completion": 30,
            "llm.token_count.total": 100,
        },
    )
    guard = Guard(Policy.from_mapping({"defaults": {"token_budget": 99}}))
    result = [d for r in one_request_per_span(agent.finished()) for d in guard.process(r)]
    # `tool.id` read: the one id on three calls one after the other is the call made again,
    # three executions: the third is the default threshold's loop.
    assert [(d.rule, d.spend.tokens) for d in result] == [
        ("tool_loop", None),
        ("token_budget", 100),
    ]
    assert (guard.stats.reissued_call_ids, guard.stats.repeated_call_ids) == (2, 0)


def traceloop_langchain_input(step: int, inputs, input_str: str) -> str:
    return json.dumps(
        {
            "input_str": input_str,
            "tags": [],
            "metadata": {"langgraph_step": step, "run_id": f"r{step}"},  # changes every step
            "inputs": inputs,
            "kwargs": {"name": "search_docs"},
        }
    )


def test_traceloop_langchain_uses_inputs_not_the_wrapper():
    agent = AgentRecorder()
    for step in range(4):
        agent.span(
            "search_docs.tool",
            {
                "traceloop.span.kind": "tool",
                "traceloop.entity.name": "search_docs",
                "traceloop.entity.input": traceloop_langchain_input(step, REFUND, str(REFUND)),
            },
        )
    (decision,) = decisions(agent.finished())
    assert decision.evidence.tool_name == "search_docs"


def test_traceloop_langchain_input_str_is_a_python_repr():
    agent = AgentRecorder()
    agent.span(
        "search_docs.tool",
        {
            "traceloop.span.kind": "tool",
            "traceloop.entity.name": "search_docs",
            "traceloop.entity.input": traceloop_langchain_input(
                0, None, str({"query": "refund", "k": 3})
            ),
        },
    )
    agent.span(
        "lookup.tool",
        {
            "traceloop.span.kind": "tool",
            "traceloop.entity.name": "lookup",
            "traceloop.entity.input": traceloop_langchain_input(0, None, "plain text query"),
        },
    )
    repr_call, text_call = (adapted(span) for span in agent.finished())
    assert repr_call.arguments == {"query": "refund", "k": 3}
    assert text_call.arguments == "plain text query"


def test_traceloop_decorated_tool_and_llm_span_tokens():
    agent = AgentRecorder()
    payload = json.dumps({"args": ["refund policy"], "kwargs": {}})
    for _ in range(4):
        agent.span(
            "search_docs.tool",
            {
                "traceloop.span.kind": "tool",
                "traceloop.entity.name": "search_docs",
                "traceloop.entity.input": payload,
            },
        )
    agent.span(
        "openai.chat",
        {
            "llm.request.type": "chat",
            "gen_ai.usage.prompt_tokens": 10,
            "gen_ai.usage.completion_tokens": 5,
            "llm.usage.total_tokens": 15,
        },
        kind=SpanKind.CLIENT,
    )
    usage = adapted(agent.finished()[-1])
    assert isinstance(usage, TokenUsage) and usage.tokens == 15 and not usage.aggregate
    assert len(decisions(agent.finished())) == 1


def test_google_adk_arguments_and_placeholder_call_ids():
    agent = AgentRecorder()
    for _ in range(4):
        agent.span(
            "execute_tool search_docs",
            {
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": "search_docs",
                "gen_ai.tool.call.id": "<not specified>",
                "gcp.vertex.agent.tool_call_args": json.dumps(REFUND),
            },
        )
    agent.span(
        "execute_tool (merged tools)",
        {
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": "(merged tools)",
            "gcp.vertex.agent.tool_call_args": "N/A",
        },
    )
    assert adapted(agent.finished()[0]).call_id is None
    assert adapted(agent.finished()[-1]) is None
    assert len(decisions(agent.finished())) == 1


def test_pydantic_ai_tool_spans_without_operation_name():
    agent = AgentRecorder()
    for _ in range(2):  # instrumentation version >= 3
        agent.span(
            "execute_tool search_docs",
            {"gen_ai.tool.name": "search_docs", "gen_ai.tool.call.arguments": json.dumps(REFUND)},
        )
    for _ in range(2):  # instrumentation version <= 2
        agent.span(
            "running tool",
            {"gen_ai.tool.name": "search_docs", "tool_arguments": json.dumps(REFUND)},
        )
    result = decisions(agent.finished())
    assert [(d.evidence.tool_name, d.evidence.hits) for d in result] == [("search_docs", 3)]


def test_strands_arguments_in_span_events_and_old_tool_parameters():
    agent = AgentRecorder()
    for _ in range(2):
        agent.span(
            "execute_tool search_docs",
            {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "search_docs"},
            events=[
                (
                    "gen_ai.tool.message",
                    {"role": "tool", "content": json.dumps(REFUND), "id": "tooluse_1x"},
                )
            ],
        )
    for _ in range(2):  # older strands: "Tool: {name}" with the actual input in tool.parameters
        agent.span(
            "Tool: search_docs", {"tool.name": "search_docs", "tool.parameters": json.dumps(REFUND)}
        )
    assert adapted(agent.finished()[0]).arguments == REFUND
    (decision,) = decisions(agent.finished())
    # The third call (the first of the older form) is the same call: the loop's third.
    assert decision.span_id == span_id_of(agent.finished()[2])


LANGCHAIN_ENVELOPE = {
    "input_str": "{'query': 'refund policy'}",
    "tags": ["seq:step:1"],
    "metadata": {"langgraph_step": 2, "checkpoint_ns": "tools:4c37a8a6"},
    "inputs": REFUND,
    "kwargs": {"color": "green", "name": None, "tool_call_id": "call_0"},
}


def test_a_langchain_envelope_is_unwrapped_by_its_shape_in_any_argument_attribute():
    """Per-step metadata changes every call: hashed whole, a loop would never trip."""
    agent = AgentRecorder()
    for step, key in enumerate(("gen_ai.tool.call.arguments", "input.value", "tool_arguments")):
        envelope = {
            **LANGCHAIN_ENVELOPE,
            "metadata": {"langgraph_step": step},
            "kwargs": {"tool_call_id": f"call_{step}"},
        }
        agent.span(
            "execute_tool search_docs",
            {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "search_docs",
             key: json.dumps(envelope)},
        )  # fmt: skip
    calls = [adapted(span) for span in agent.finished()]
    assert [call.arguments for call in calls] == [REFUND] * 3
    assert [call.call_id for call in calls] == ["call_0", "call_1", "call_2"]
    without_inputs = {**LANGCHAIN_ENVELOPE, "inputs": {}}
    agent.tool("search_docs", without_inputs)
    assert adapted(agent.finished()[-1]).arguments == REFUND  # from input_str, a Python repr
    # The same keys in another shape are arguments like any other.
    agent.tool("search_docs", {"inputs": [1], "extra": True})
    assert adapted(agent.finished()[-1]).arguments == {"inputs": [1], "extra": True}


@pytest.mark.parametrize(
    ("attributes", "events", "scope"),
    [
        # OpenInference hide_inputs
        ({"openinference.span.kind": "TOOL", "tool.name": "t", "input.value": "__REDACTED__"},
         (), "openinference.instrumentation.langchain"),
        # strands, latest conventions, with gen_ai_unredacted_attributes=
        ({"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "t",
          "gen_ai.tool.call.arguments": "[REDACTED]"}, (), "strands.telemetry.tracer"),
        # strands, legacy event
        ({"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "t"},
         [("gen_ai.tool.message", {"role": "tool", "content": "[REDACTED]"})],
         "strands.telemetry.tracer"),
        # Google ADK legacy schema with ADK_CAPTURE_MESSAGE_CONTENT_IN_SPANS=false
        ({"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "t",
          "gcp.vertex.agent.tool_call_args": "{}", "gcp.vertex.agent.tool_response": "{}"},
         (), "gcp.vertex.agent"),
    ],
)  # fmt: skip
def test_redaction_placeholders_are_not_recorded_arguments(attributes, events, scope, caplog):
    agent = AgentRecorder()
    for _ in range(12):
        agent.span("execute_tool t", attributes, events=events, scope=scope)
    guard = Guard()
    assert [d for r in one_request_per_span(agent.finished()) for d in guard.process(r)] == []
    assert guard.stats.missing_arguments == 12
    instrumentation, setting = capture_setting(scope)
    [warning] = [r.getMessage() for r in caplog.records if "carry no arguments" in r.getMessage()]
    assert instrumentation in warning and setting in warning and repr(scope) in warning


def test_the_missing_arguments_warnings_are_bounded_in_number_and_length(caplog):
    """Scope and service names come from the spans: a flood of new ones is told up to
    MAX_WARNED times, each name cut."""
    agent = AgentRecorder()
    scopes = [f"{n}-" + "s" * 1000 for n in range(MAX_WARNED + 50)]
    for scope in scopes:
        agent.span("execute_tool t", {"gen_ai.operation.name": "execute_tool"}, scope=scope)
    guard = Guard()
    with caplog.at_level("WARNING", logger="spanguard.core"):
        assert guard.process(encode(agent.finished())) == []
    told = [r.getMessage() for r in caplog.records if "carry no arguments" in r.getMessage()]
    assert guard.stats.missing_arguments == len(scopes)
    assert len(told) == MAX_WARNED
    assert max(len(message) for message in told) < 1000


def test_an_empty_object_is_a_call_without_arguments_outside_adk():
    agent = AgentRecorder()
    for _ in range(4):
        agent.tool("list_tickets", {})
    assert adapted(agent.finished()[0]).arguments == {}
    assert len(decisions(agent.finished())) == 1


def test_capture_settings_name_each_instrumentation_exactly():
    assert capture_setting("gcp.vertex.agent") == (
        "Google ADK",
        "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_ONLY (or SPAN_AND_EVENT);"
        " on the legacy schema (ADK_TELEMETRY_SCHEMA_VERSION_OPT_IN=1)"
        " ADK_CAPTURE_MESSAGE_CONTENT_IN_SPANS=true",
    )
    assert (
        "TRACELOOP_TRACE_CONTENT=true"
        in capture_setting("opentelemetry.instrumentation.langchain")[1]
    )
    assert "OPENINFERENCE_HIDE_INPUTS" in capture_setting("openinference.instrumentation.x")[1]
    assert capture_setting("my.own.tracer")[0] == "an unknown instrumentation"


def test_the_args_hash_attribute_is_preferred_to_raw_arguments():
    agent = AgentRecorder()
    for step in range(4):
        agent.tool("search_docs", None, attributes={
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": "search_docs",
            ARGS_HASH_KEY: "1D79773F7DD21571",
            "gen_ai.tool.call.arguments": json.dumps({"differs": step}),
        })  # fmt: skip
    (decision,) = decisions(agent.finished())
    assert decision.evidence.args_hash == "1d79773f7dd21571"
    agent = AgentRecorder()
    agent.tool("search_docs", REFUND, attributes={
        "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "search_docs",
        ARGS_HASH_KEY: "not a hash", "gen_ai.tool.call.arguments": json.dumps(REFUND),
    })  # fmt: skip
    assert adapted(agent.finished()[0]).args_digest is None  # malformed: the raw value counts


def test_tool_names_alone_never_kill_when_only_the_hash_is_missing():
    policy = Policy.from_mapping({"defaults": {"missing_args": "name_only"}})
    agent = AgentRecorder()
    for _ in range(10):
        agent.tool("search_docs", None)
    assert {d.action for d in decisions(agent.finished(), policy)} == {"flag"}


def test_every_genai_operation_is_classified():
    """Fails when the installed GenAI conventions name an operation the adapters do not list."""
    from opentelemetry.semconv._incubating.attributes.gen_ai_attributes import (
        GenAiOperationNameValues,
    )

    named = {member.value for member in GenAiOperationNameValues}
    listed = [INFERENCE_OPERATIONS, AGENT_OPERATIONS, OTHER_OPERATIONS]
    assert named <= set().union(*listed), named - set().union(*listed)
    assert sum(len(group) for group in listed) == len(set().union(*listed))  # no overlap
    assert "embeddings" in INFERENCE_OPERATIONS


@pytest.mark.parametrize(
    "attributes",
    [
        {"gen_ai.operation.name": "embeddings", "gen_ai.usage.input_tokens": 600},
        {"openinference.span.kind": "EMBEDDING", "llm.token_count.prompt": 600},
        {"llm.request.type": "embedding", "gen_ai.usage.input_tokens": 600},
    ],
)
def test_embeddings_count_towards_the_token_budget(attributes):
    agent = AgentRecorder()
    agent.span("embeddings text-embedding-3-small", attributes, kind=SpanKind.CLIENT)
    agent.span("embeddings text-embedding-3-small", attributes, kind=SpanKind.CLIENT)
    usage = adapted(agent.finished()[0])
    assert isinstance(usage, TokenUsage) and not usage.aggregate and usage.tokens == 600
    policy = Policy.from_mapping({"defaults": {"token_budget": 1000}})
    (decision,) = decisions(agent.finished(), policy)
    assert decision.rule == "token_budget" and decision.spend.tokens == 1200


def test_results_are_unwrapped_from_their_framework_envelopes():
    agent = AgentRecorder()
    tool_message = {"lc": 1, "type": "constructor", "id": ["langchain", "schema", "messages",
                    "ToolMessage"], "kwargs": {"content": "no results", "type": "tool",
                    "tool_call_id": "call_1"}}  # fmt: skip
    results = [
        {"output": tool_message, "kwargs": {"tags": []}},  # OpenLLMetry
        {"type": "tool", "data": {"content": "no results", "tool_call_id": "call_2"}},  # OI
        {"blocks": [], "tool_name": "t", "raw_input": {"q": 1}, "raw_output": "no results"},
        "no results",
    ]
    for result in results:
        agent.tool("t", REFUND, attributes={
            "gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "t",
            "gen_ai.tool.call.arguments": json.dumps(REFUND),
            "gen_ai.tool.call.result": json.dumps(result),
        })  # fmt: skip
    assert [adapted(span).result for span in agent.finished()] == ["no results"] * 4


# -- TypeScript frameworks: the Vercel AI SDK's legacy spans, LangChain.js, OpenInference JS --


def ai_sdk_tool_call(agent: AgentRecorder, args: str | None, result: str | None, call: int) -> None:
    attributes = {
        "operation.name": "ai.toolCall support",
        "ai.operationId": "ai.toolCall",
        "ai.toolCall.name": "search_docs",
        "ai.toolCall.id": f"call_{call}",
    }
    if args is not None:
        attributes["ai.toolCall.args"] = args
    if result is not None:
        attributes["ai.toolCall.result"] = result
    agent.span("ai.toolCall", attributes, scope="ai")


def test_ai_sdk_tool_call_spans_are_tool_calls():
    agent = AgentRecorder()
    for call in range(4):
        ai_sdk_tool_call(agent, json.dumps(REFUND), json.dumps("no results"), call)
    first = adapted(agent.finished()[0])
    assert isinstance(first, ToolCall)
    assert (first.tool_name, first.arguments, first.result, first.call_id) == (
        "search_docs",
        REFUND,
        "no results",
        "call_0",
    )
    assert [(d.rule, d.evidence.hits) for d in decisions(agent.finished())] == [("tool_loop", 3)]


@pytest.mark.parametrize(
    "args",
    [
        "refund policy",  # not JSON: the text itself
        '{"query": "refund pol',  # truncated
        json.dumps({"query": "x" * 1_000_000}),  # huge
        "",
    ],
)
def test_malformed_ai_sdk_arguments_are_hashed_as_text_never_dropped(args):
    agent = AgentRecorder()
    for call in range(4):
        ai_sdk_tool_call(agent, args, None, call)
    call = adapted(agent.finished()[0])
    assert isinstance(call, ToolCall) and call.arguments is not MISSING
    [decision] = decisions(agent.finished())
    assert decision.rule == "tool_loop" and decision.evidence.hits == 3


def test_ai_sdk_without_recorded_arguments_is_skipped_and_names_its_setting(caplog):
    agent = AgentRecorder()
    for call in range(6):
        ai_sdk_tool_call(agent, None, None, call)
    guard = Guard()
    assert [d for r in one_request_per_span(agent.finished()) for d in guard.process(r)] == []
    assert guard.stats.missing_arguments == 6
    [warning] = [r.getMessage() for r in caplog.records if "carry no arguments" in r.getMessage()]
    assert "Vercel AI SDK" in warning and "recordOutputs" in warning and "recordInputs" in warning


def test_ai_sdk_per_call_usage_counts_once_per_inference_call():
    """doGenerate spans are inference calls; the ai.generateText span's sum is an aggregate."""
    agent = AgentRecorder()
    for _ in range(3):
        agent.span(
            "ai.generateText.doGenerate",
            {
                "ai.operationId": "ai.generateText.doGenerate",
                "gen_ai.usage.input_tokens": 300,
                "gen_ai.usage.output_tokens": 100,
                "ai.usage.inputTokens": 300,
                "ai.usage.outputTokens": 100,
            },
            scope="ai",
        )
    agent.span(
        "ai.generateText",
        {
            "ai.operationId": "ai.generateText",
            "ai.usage.inputTokens": 900,
            "ai.usage.outputTokens": 300,
        },
        scope="ai",
    )
    inner = adapted(agent.finished()[0])
    outer = adapted(agent.finished()[-1])
    assert isinstance(inner, TokenUsage) and not inner.aggregate and inner.tokens == 400
    assert isinstance(outer, TokenUsage) and outer.aggregate and outer.tokens == 1200
    policy = Policy.from_mapping({"defaults": {"token_budget": 1000}})
    [decision] = decisions(agent.finished(), policy)
    assert decision.rule == "token_budget" and decision.spend.tokens == 1200  # not 1200 + 1200
    assert decision.span_id == span_id_of(agent.finished()[2])


@pytest.mark.parametrize("lc", [1, 2, 0])
def test_a_langchain_js_tool_message_counts_by_its_content(lc):
    agent = AgentRecorder()
    for call in range(4):
        message = {
            "lc": lc,
            "type": "constructor",
            "id": ["langchain_core", "messages", "ToolMessage"],
            "kwargs": {
                "status": "success",
                "content": "no results",
                "tool_call_id": f"call_{call}",
            },
        }
        agent.span(
            "search_docs",
            {
                "openinference.span.kind": "TOOL",
                "tool.name": "search_docs",
                "input.value": "refund policy",
                "output.value": json.dumps({"output": message}),
            },
            scope="@arizeai/openinference-instrumentation-langchain",
        )
    call = adapted(agent.finished()[0])
    assert call.arguments == "refund policy" and call.result == "no results"
    [decision] = decisions(agent.finished())
    assert (decision.rule, decision.evidence.hits) == ("tool_loop", 3)


@pytest.mark.parametrize(
    "message",
    [
        {"lc": "1", "type": "constructor", "id": ["ToolMessage"], "kwargs": {"content": "x"}},
        {"lc": 1, "type": "constructor", "id": ["AIMessage"], "kwargs": {"content": "x"}},
        {"lc": 1, "type": "constructor", "id": "ToolMessage", "kwargs": {"content": "x"}},
        {"lc": 1, "type": "constructor", "id": ["ToolMessage"], "kwargs": {"text": "x"}},
    ],
)
def test_other_lc_payloads_are_kept_whole(message):
    agent = AgentRecorder()
    agent.span(
        "t",
        {"openinference.span.kind": "TOOL", "tool.name": "t", "input.value": "q",
         "output.value": json.dumps(message)},
    )  # fmt: skip
    assert adapted(agent.finished()[0]).result == message


def test_capture_settings_of_the_typescript_frameworks():
    legacy = capture_setting("ai")
    assert "Vercel AI SDK" in legacy[0] and "recordOutputs" in legacy[1]
    genai = capture_setting("gen_ai")
    assert "@ai-sdk/otel" in genai[0] and "recordInputs" in genai[1]
    langchain = capture_setting("@arizeai/openinference-instrumentation-langchain")
    assert langchain[0] == "OpenInference JS" and "hideInputs" in langchain[1]
    assert "hideInput" in capture_setting("@mastra/otel-exporter")[1]
    # Exact names only: a scope that merely starts with "ai" is not the AI SDK.
    assert capture_setting("aiohttp")[0] == "an unknown instrumentation"


def test_genkit_tool_actions_are_tool_calls_and_other_actions_are_not():
    agent = AgentRecorder()
    for _ in range(4):
        agent.span(
            "search_docs",
            {
                "genkit:type": "action",
                "genkit:metadata:subtype": "tool.v2",
                "genkit:name": "search_docs",
                "genkit:input": json.dumps(REFUND),
                "genkit:output": json.dumps({"output": "no results"}),
            },
            scope="genkit-tracer",
        )
    agent.span(
        "scripted/model",
        {"genkit:metadata:subtype": "model", "genkit:name": "scripted/model", "genkit:input": "{}"},
        scope="genkit-tracer",
    )
    first = adapted(agent.finished()[0])
    assert isinstance(first, ToolCall)
    assert (first.tool_name, first.arguments, first.result) == ("search_docs", REFUND, "no results")
    assert adapted(agent.finished()[-1]) is None
    assert [(d.rule, d.evidence.hits) for d in decisions(agent.finished())] == [("tool_loop", 3)]
    assert capture_setting("genkit-tracer")[0] == "Genkit"


LANGGRAPH_HANDOFF = {  # a langgraph-supervisor handoff tool's output: a Command to the parent
    "graph": "__parent__",
    "update": {"messages": [{"type": "tool", "data": {"content": "Successfully transferred"}}]},
    "resume": None,
    "goto": "worker_a",
}


@pytest.mark.parametrize(
    ("attributes", "scope"),
    [
        ({"openinference.span.kind": "TOOL", "tool.name": "transfer_to_worker_a",
          "output.value": json.dumps(LANGGRAPH_HANDOFF)},
         "openinference.instrumentation.langchain"),
        ({"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "transfer_to_worker_a",
          "gen_ai.tool.call.arguments": json.dumps({"input_str": "{}", "inputs": {}}),
          "gen_ai.tool.call.result": json.dumps({"output": LANGGRAPH_HANDOFF, "kwargs": {}})},
         "opentelemetry.instrumentation.langchain"),
        ({"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "transfer_to_agent",
          "gen_ai.agent.name": "supervisor",
          "gen_ai.tool.call.arguments": json.dumps({"agent_name": "worker_a"}),
          "gen_ai.tool.call.result": json.dumps({"result": None})},
         "gcp.vertex.agent"),
    ],
)  # fmt: skip
def test_handoff_tools_are_handoffs(attributes, scope):
    """LangGraph's and Google ADK's handoffs are tool calls: read as OpenAI's are, the handing
    agent's call "handoff to <agent>", with no result (the graph's whole state is no work)."""
    agent = AgentRecorder()
    agent.span(f"execute_tool {attributes.get('tool.name', '')}", attributes, scope=scope)
    call = adapted(agent.finished()[-1])
    assert isinstance(call, ToolCall)
    assert call.tool_name == "handoff to worker_a"
    assert call.arguments == {
        "from_agent": attributes.get("gen_ai.agent.name", ""),
        "to_agent": "worker_a",
    }
    assert call.result is MISSING


@pytest.mark.parametrize(
    ("attributes", "scope", "tool_name"),
    [
        # A Command to the graph itself, or to several nodes at once (`Send`s): no handoff.
        ({"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "route",
          "gen_ai.tool.call.arguments": "{}",
          "gen_ai.tool.call.result": json.dumps({**LANGGRAPH_HANDOFF, "graph": None})},
         "opentelemetry.instrumentation.langchain", "route"),
        ({"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "route",
          "gen_ai.tool.call.arguments": "{}",
          "gen_ai.tool.call.result": json.dumps({**LANGGRAPH_HANDOFF, "goto": [{"node": "a"}]})},
         "opentelemetry.instrumentation.langchain", "route"),
        # A tool of that name outside ADK is the user's own.
        ({"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "transfer_to_agent",
          "gen_ai.tool.call.arguments": json.dumps({"agent_name": "worker_a"})},
         "my.instrumentation", "transfer_to_agent"),
    ],
)  # fmt: skip
def test_other_tool_calls_are_no_handoffs(attributes, scope, tool_name):
    agent = AgentRecorder()
    agent.span("execute_tool", attributes, scope=scope)
    call = adapted(agent.finished()[-1])
    assert isinstance(call, ToolCall)
    assert call.tool_name == tool_name
    assert call.result is not MISSING or "gen_ai.tool.call.result" not in attributes


ADK_CONTEXT = "For context: below is a transcript of what another agent did."


@pytest.mark.parametrize(
    ("last_parts", "user_spoke"),
    [
        ([ADK_CONTEXT, "[billing] called tool `transfer_to_agent` with parameters: {}"], False),
        ([ADK_CONTEXT, "[billing] `transfer_to_agent` tool returned result: {}"], False),
        (["For context:", "[billing] said: I can't help with that."], False),  # ADK 1.x
        (["I was charged twice."], True),
        (["For context: I ordered on [Monday] and paid twice."], True),
    ],
)
def test_adk_accounts_of_other_agents_are_no_user_turn(last_parts, user_spoke):
    """Google ADK passes the run's other agents' turns to the next agent as user messages:
    each transfer would otherwise look like the user speaking, and start the loop rules anew."""
    messages = [
        {"role": "user", "parts": [{"content": "I was charged twice.", "type": "text"}]},
        {"role": "user", "parts": [{"content": part, "type": "text"} for part in last_parts]},
    ]
    value = AnyValue(string_value=json.dumps(messages))
    assert ends_with_user_message(value) is user_spoke
