"""Convention adapters: one OTLP span in, at most one guard event out.

Every instrumentation names the same facts differently. The names below were checked against
each convention's own source (the version read is given per convention):

- OTel GenAI semantic conventions v1.41 and the semantic-conventions-genai repo
  (model/gen-ai/registry.yaml, spans.yaml): `gen_ai.operation.name` (`execute_tool`, `chat`,
  `text_completion`, `generate_content`, `invoke_agent`), `gen_ai.tool.name`,
  `gen_ai.tool.call.id`, `gen_ai.tool.call.arguments` (type `any`: a JSON string or a
  structured value, opt-in), `gen_ai.usage.input_tokens` / `output_tokens` (cache and
  reasoning tokens are already inside them), deprecated `gen_ai.usage.prompt_tokens` /
  `completion_tokens`, `gen_ai.agent.name`.
- The bare form: span name exactly `execute_tool` with no operation name.
- OpenInference semconv 0.1.27+ (python/openinference-semantic-conventions):
  `openinference.span.kind` (`TOOL`, `LLM`, `AGENT`), `tool.name`, `tool.id`, `input.value`
  (the call's arguments), `llm.token_count.prompt` / `completion`. Its `tool.parameters` is the
  tool's parameter *schema*, never the arguments: it is ignored on OpenInference spans.
- Traceloop / OpenLLMetry (semconv_ai, langchain callback_handler, sdk decorators):
  `traceloop.span.kind` (`tool`, `agent`, `workflow`), `traceloop.entity.name`,
  `traceloop.entity.input`: for LangChain a JSON wrapper `{"input_str", "tags", "metadata",
  "inputs", "kwargs"}` whose `metadata` changes every step (we use `inputs`, else `input_str`,
  a Python repr); for decorated functions `{"args": [...], "kwargs": {...}}`. LLM spans carry
  `llm.request.type` (`chat`, `completion`) and the deprecated usage names.
- Google ADK (src/google/adk/telemetry/tracing.py): `gcp.vertex.agent.tool_call_args` (JSON
  string), `gen_ai.tool.call.id` = `'<not specified>'` when unknown (a placeholder, no id),
  `gen_ai.tool.name` = `'(merged tools)'` on a span that repeats parallel calls already seen.
- pydantic-ai (_tool_manager.py, _instrumentation.py): tool spans `execute_tool {name}`
  (instrumentation version >= 3, no operation name) or `running tool` (version <= 2) with
  `gen_ai.tool.name`; arguments in `gen_ai.tool.call.arguments` or `tool_arguments`; agent
  spans carry `gen_ai.aggregated_usage.*`.
- strands-agents (src/strands/telemetry/tracer.py): `execute_tool {name}` spans with the
  arguments in a `gen_ai.tool.message` event's `content`; older releases: `Tool: {name}` spans
  with `tool.name` and the actual arguments in `tool.parameters`; `invoke_agent` totals.

- The Vercel AI SDK's legacy spans (ai 6.0.333 packages/ai/src/generate-text, and
  @ai-sdk/otel 1.0.173's LegacyOpenTelemetry for ai 7): `ai.operationId` (`ai.toolCall`,
  `ai.generateText.doGenerate`, `ai.streamText.doStream`, ...), `ai.toolCall.name`, `.id`,
  `.args` (JSON text), `.result`; the provider call's usage on its `do*` span (also as
  `gen_ai.usage.*`), the sum over the steps on the `ai.generateText` span (`ai.usage.*`, an
  aggregate). AI SDK 7's own integration (@ai-sdk/otel `OpenTelemetry`, scope `gen_ai`) writes
  the GenAI conventions above.
- Genkit for Go 1.4.0 (core/tracing): scope `genkit-tracer`; a tool's span has
  `genkit:metadata:subtype` `tool` (or `tool.v2`), its name in `genkit:name`, the arguments in
  `genkit:input` and the result in `genkit:output` (`{"output": ...}` for tool.v2); no call id,
  and no usage outside the model span's `genkit:output` document (not read). It has no setting
  that turns content off.
- LangChain4j 1.19 (Java) makes no spans of its own (it has ChatModelListener, AI service
  events and before/afterToolExecution hooks); clients/java's LangChain4jTracing (scope
  `dev.spanguard.langchain4j`) makes the GenAI conventions above from them: one `chat` span per
  model call with its usage, one `execute_tool NAME` span per tool call with the call id, and,
  with `captureContent` on (its default), the arguments (LangChain4j's JSON text) and the
  result (the tool's return value as LangChain4j hands it to the model).
- Spring AI 1.1 (Java): its Micrometer observations, made spans by Micrometer Tracing's OTel
  bridge (Spring Boot's tracer, scope `org.springframework.boot`). A tool call is a
  `tool_call NAME` span with `gen_ai.operation.name` `framework` and `spring.ai.kind`
  `tool_call`, its name in `spring.ai.tool.definition.name`; with
  `spring.ai.tools.observations.include-content` the arguments (JSON text) in
  `spring.ai.tool.call.arguments` and the result in `spring.ai.tool.call.result`; no call id.
  A model call is a `chat` span with its usage as text (`"120"`).
- Mastra 1.71.0's observability through @mastra/otel-exporter 1.4.0: the GenAI conventions
  above; `tracingOptions: {hideInput: true}` drops the arguments.
- OpenInference JS (@arizeai/openinference-instrumentation-langchain 4.1.1, -openai-agents
  0.2.15): as OpenInference; LangChain.js writes a one-argument tool's input bare
  (`input.value` = `refund policy`, kept as that string) and its result as a serialised
  ToolMessage (`{"lc": 1, "type": "constructor", "id": [..., "ToolMessage"], "kwargs": ...}`).

- LiteLLM's proxy (its `otel` callback, instrumentation scope `litellm`, litellm 1.106): one
  `litellm_request` span per model call, `gen_ai.operation.name` `acompletion`, the request's
  messages in `gen_ai.input.messages` (JSON: OpenAI's shape, text in `parts`). It makes no tool
  span: a call shows up as the model's `tool_calls` in one request's history and its result as
  the `tool` messages (`tool_call_id`) that close the next request. So a `litellm` span whose
  input messages end with tool results yields one ToolCall per call they answer, besides its
  own usage (`gateway_calls`). An agent that records its own tool spans with the call id is
  counted once: these calls carry no start time and end when the request started, so either
  copy of a call id is the other's partial span to the guard.

Results (the result-aware loop rule): `gen_ai.tool.call.result`, OpenInference `output.value`,
`traceloop.entity.output` (`{"output": ..., "kwargs": ...}`), ADK `gcp.vertex.agent.tool_response`,
pydantic-ai <= 2 `tool_response`, strands' legacy `gen_ai.choice` event (`message`) on tool
spans. A LangChain ToolMessage in a result (LangChain's own serialisation, or OpenInference's
`{"type": "tool", "data": ...}`) counts by its `content`: its `tool_call_id` changes on every
call. A llama-index ToolOutput counts by its `raw_output`.

Checked against spans the libraries themselves emit (tests/fixtures/instrumentation, made by
tests/support/instrumented_agents.py): on langgraph 1.2.22, openinference-instrumentation-
langchain 0.1.80 and opentelemetry-instrumentation-langchain 0.62.4 (OpenLLMetry); on
openai-agents 0.24.0, openinference-instrumentation-openai-agents 2.6.0 and
opentelemetry-instrumentation-openai-agents-v2 0.1.0 (the OTel GenAI bridge); pydantic-ai-slim
2.68.0; openinference-instrumentation-smolagents 0.1.43 on smolagents 1.26.0;
openinference-instrumentation-llama-index 4.6.1 on llama-index-core 0.14.25; google-adk 2.13.0
(both schemas) and strands-agents 1.62.0 (both conventions), whose OTel pins exclude this
project's SDK, in virtualenvs of their own; and the TypeScript frameworks above under node
(tests/support/ts_agents, its own lockfile):

- Not recorded: the redaction placeholders `__REDACTED__` (OpenInference's hide_inputs),
  `[REDACTED]` (strands' gen_ai_unredacted_attributes), `<elided>` and `<not specified>` (ADK),
  `readacted` (sic: opentelemetry-instrumentation-openai-agents-v2 0.1.0 in messages),
  and `{}` on ADK's spans (its legacy schema writes `{}` when content capture is off). Such a
  value is "arguments not recorded", never arguments that are all alike.
- The LangChain envelope `{"input_str", "tags", "metadata", "inputs", "kwargs"}` is recognised by
  its shape in any argument attribute (OpenLLMetry 0.62 writes it into
  `gen_ai.tool.call.arguments` too); its `kwargs.tool_call_id` is the call id.
- `spanguard.tool.args_hash` / `spanguard.tool.result_hash`, written by
  killswitch.hashing.ArgsHashingSpanProcessor or the Collector config in deploy/collector, stand
  for the arguments and the result: the core prefers them to any raw value.

Span kind is never used: tool spans come as INTERNAL or CLIENT depending on the library.
"""

from __future__ import annotations

import ast
import hashlib
import json
import math
import re
from collections.abc import Container, Mapping
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

from mypy_extensions import mypyc_attr
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from spanguard.schemas.otlp import any_value_to_python

__all__ = [
    "ARGS_HASH_KEY",
    "CAPTURE_SETTINGS",
    "CAPTURE_SETTINGS_EXACT",
    "CONVERSATION_KEY_SET",
    "MISSING",
    "PRICE_KEYS",
    "RESULT_HASH_KEY",
    "WANTED_KEYS",
    "AgentSeen",
    "ResourceInfo",
    "SpanReading",
    "TokenUsage",
    "ToolCall",
    "adapt_read",
    "adapt_span",
    "capture_setting",
    "decode_arguments",
    "gateway_calls",
    "reading_of",
    "resource_info",
]

# Attribute names, grouped by what they tell.
OPERATION: Final = "gen_ai.operation.name"
OPENINFERENCE_KIND: Final = "openinference.span.kind"
TRACELOOP_KIND: Final = "traceloop.span.kind"
TRACELOOP_REQUEST_TYPE: Final = "llm.request.type"
AGENT_NAME: Final = "gen_ai.agent.name"
SERVICE_NAME: Final = "service.name"

ARGS_HASH_KEY: Final = "spanguard.tool.args_hash"
RESULT_HASH_KEY: Final = "spanguard.tool.result_hash"
# The Vercel AI SDK's legacy spans (`ai.*`): what its own `ai.operationId` says a span is.
AI_SDK_OPERATION: Final = "ai.operationId"
AI_SDK_TOOL_OPERATION: Final = "ai.toolCall"
# One provider call each; the `ai.generateText` / `ai.streamText` span around them repeats the sum.
AI_SDK_INFERENCE_OPERATIONS: Final = frozenset(
    {
        "ai.generateText.doGenerate",
        "ai.streamText.doStream",
        "ai.generateObject.doGenerate",
        "ai.streamObject.doStream",
        "ai.embed.doEmbed",
        "ai.embedMany.doEmbed",
    }
)
# Genkit (Go, JS): every action's span says what it is in `genkit:metadata:subtype`.
GENKIT_SUBTYPE: Final = "genkit:metadata:subtype"
GENKIT_TOOL_SUBTYPES: Final = frozenset({"tool", "tool.v2"})
# Spring AI's observations: every framework span (tool call, chat client, advisor) has the
# operation `framework`; `spring.ai.kind` tells a tool call.
SPRING_AI_OPERATION: Final = "framework"
SPRING_AI_KIND: Final = "spring.ai.kind"
TOOL_NAME_KEYS: Final = (
    "gen_ai.tool.name",
    "tool.name",
    "traceloop.entity.name",
    "ai.toolCall.name",
    "genkit:name",
    "spring.ai.tool.definition.name",
)
CALL_ID_KEYS: Final = ("gen_ai.tool.call.id", "tool.id", "ai.toolCall.id")
# First present wins; `tool.parameters` is only read off non-OpenInference spans.
ARGUMENT_KEYS: Final = (
    "gen_ai.tool.call.arguments",
    "gcp.vertex.agent.tool_call_args",
    "ai.toolCall.args",
    "input.value",
    "traceloop.entity.input",
    "tool_arguments",
    "tool.parameters",
    "genkit:input",
    "spring.ai.tool.call.arguments",
)
RESULT_KEYS: Final = (
    "gen_ai.tool.call.result",
    "gcp.vertex.agent.tool_response",
    "ai.toolCall.result",
    "output.value",
    "traceloop.entity.output",
    "tool_response",
    "genkit:output",
    "spring.ai.tool.call.result",
)
INPUT_TOKEN_KEYS: Final = (
    "gen_ai.usage.input_tokens",
    "gen_ai.usage.prompt_tokens",
    "llm.token_count.prompt",
    "ai.usage.inputTokens",  # the AI SDK's legacy spans (>= 5; promptTokens before)
    "ai.usage.promptTokens",
)
OUTPUT_TOKEN_KEYS: Final = (
    "gen_ai.usage.output_tokens",
    "gen_ai.usage.completion_tokens",
    "llm.token_count.completion",
    "ai.usage.outputTokens",
    "ai.usage.completionTokens",
)
# Cached input tokens, counted inside the input tokens by the conventions (pricing only).
CACHE_READ_KEYS: Final = (
    "gen_ai.usage.cache_read.input_tokens",  # GenAI conventions
    "gen_ai.usage.cache_read_input_tokens",  # OpenLLMetry, strands
    "llm.token_count.prompt_details.cache_read",  # OpenInference
    "ai.usage.inputTokenDetails.cacheReadTokens",  # AI SDK 6
    "ai.usage.cachedInputTokens",  # AI SDK 5
)
CACHE_WRITE_KEYS: Final = (
    "gen_ai.usage.cache_creation.input_tokens",
    "gen_ai.usage.cache_creation_input_tokens",
    "gen_ai.usage.cache_write_input_tokens",  # strands
    "llm.token_count.prompt_details.cache_write",
    "ai.usage.inputTokenDetails.cacheWriteTokens",
)
CACHE_KEYS: Final = CACHE_READ_KEYS + CACHE_WRITE_KEYS
# The model a span names: what answered first (a dated snapshot), then what was asked for.
RESPONSE_MODEL_KEYS: Final = ("gen_ai.response.model", "ai.response.model")
REQUEST_MODEL_KEYS: Final = ("gen_ai.request.model", "llm.model_name", "ai.model.id")
PROVIDER_KEYS: Final = (
    "gen_ai.provider.name",
    "gen_ai.system",
    "llm.provider",
    "llm.system",
    "ai.model.provider",
)
# Read only when some policy prices usage (a usd budget): then inference spans cost a few
# lookups more, and nothing otherwise.
PRICE_KEYS: Final = frozenset(
    {*CACHE_READ_KEYS, *CACHE_WRITE_KEYS, *RESPONSE_MODEL_KEYS, *REQUEST_MODEL_KEYS, *PROVIDER_KEYS}
)
MODEL_KEYS: Final = frozenset({*RESPONSE_MODEL_KEYS, *REQUEST_MODEL_KEYS})
# A conversation (thread, session) that spans traces, first present wins; where each
# instrumentation writes it is in docs/conversations.md. Read only when a policy asks for the
# conversation scope.
CONVERSATION_KEYS: Final = (
    "gen_ai.conversation.id",
    "session.id",
    "langfuse.session.id",
    "ai.telemetry.metadata.sessionId",
)
CONVERSATION_KEY_SET: Final = frozenset(CONVERSATION_KEYS)
# A failed call: the span's status ERROR, or this attribute (OpenTelemetry's `error.type`).
ERROR_TYPE: Final = "error.type"
# What an inference span was sent (GenAI semantic conventions, JSON): a new user message last
# means the user spoke since the agent's previous turn.
INPUT_MESSAGES: Final = "gen_ai.input.messages"
STATUS_ERROR: Final = 2  # opentelemetry.proto.trace.v1.Status.STATUS_CODE_ERROR
AGGREGATE_INPUT_KEY: Final = "gen_ai.aggregated_usage.input_tokens"
AGGREGATE_OUTPUT_KEY: Final = "gen_ai.aggregated_usage.output_tokens"

# Every `gen_ai.operation.name` of the GenAI conventions is in exactly one of these three
# (tests/detection/test_conventions.py fails when the installed conventions name a new one).
# Inference spans' usage counts towards a budget; agent spans' usage repeats it.
INFERENCE_OPERATIONS: Final = frozenset(
    {"chat", "text_completion", "generate_content", "embeddings"}
)
AGENT_OPERATIONS: Final = frozenset({"invoke_agent", "invoke_workflow"})
OTHER_OPERATIONS: Final = frozenset({"execute_tool", "retrieval", "create_agent"})
OPENINFERENCE_INFERENCE_KINDS: Final = frozenset({"LLM", "EMBEDDING"})
TRACELOOP_LLM_TYPES: Final = frozenset({"chat", "completion", "embedding"})
# Ids that instrumentations write when they have none; merging calls on them would hide loops.
PLACEHOLDER_CALL_IDS: Final = frozenset(
    {"", "<not specified>", "none", "null", "undefined", "unknown", "n/a"}
)
ADK_MERGED_TOOLS: Final = "(merged tools)"
# What instrumentations write in place of content they hide: never an argument or a result.
PLACEHOLDERS: Final = frozenset(
    {"__REDACTED__", "[REDACTED]", "<elided>", "<not specified>", "readacted"}
)
# Instrumentations known to write an empty object when content capture is off (by scope name).
EMPTY_WHEN_OFF_SCOPES: Final = frozenset({"gcp.vertex.agent"})
LANGCHAIN_ENVELOPE: Final = frozenset({"input_str", "tags", "metadata", "inputs", "kwargs"})
# LiteLLM's proxy spans (see the module docstring): the tool calls its requests answer.
GATEWAY_SCOPE: Final = "litellm"
# A handoff between agents (opentelemetry-instrumentation-openai-agents): read as a call.
HANDOFF_OPERATION: Final = "agent_handoff"
HANDOFF_FROM: Final = "gen_ai.handoff.from_agent"
HANDOFF_TO: Final = "gen_ai.handoff.to_agent"
STRANDS_TOOL_EVENT: Final = "gen_ai.tool.message"
STRANDS_RESULT_EVENT: Final = "gen_ai.choice"
MAX_REPR_CHARS: Final = 65_536
# The scanner json.loads uses (a decoder with its defaults): a value and where it ends.
_scan_json: Final = json.JSONDecoder().scan_once  # type: ignore[attr-defined]

USAGE_KEYS: Final = frozenset(
    {*INPUT_TOKEN_KEYS, *OUTPUT_TOKEN_KEYS, AGGREGATE_INPUT_KEY, AGGREGATE_OUTPUT_KEY}
)
WANTED_KEYS: Final = frozenset(
    {
        OPERATION,
        OPENINFERENCE_KIND,
        TRACELOOP_KIND,
        TRACELOOP_REQUEST_TYPE,
        AI_SDK_OPERATION,
        GENKIT_SUBTYPE,
        AGENT_NAME,
        *TOOL_NAME_KEYS,
        *CALL_ID_KEYS,
        *ARGUMENT_KEYS,
        *RESULT_KEYS,
        ARGS_HASH_KEY,
        RESULT_HASH_KEY,
        ERROR_TYPE,
        INPUT_MESSAGES,
        *INPUT_TOKEN_KEYS,
        *OUTPUT_TOKEN_KEYS,
        AGGREGATE_INPUT_KEY,
        AGGREGATE_OUTPUT_KEY,
    }
)


# A span's or resource's attributes in the request view: a map from key to AnyValue.
# Index it only with keys known to be present (indexing a missing key inserts it).
AttributeMap = Mapping[str, AnyValue]


class _Missing:
    """The arguments were not recorded (content capture off): not the same as `{}`."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "MISSING"


MISSING: Final = _Missing()


@dataclass(slots=True)
class ResourceInfo:
    """What a span's resource tells: the service and any attributes the policy matches on."""

    service: str
    agent_name: str | None
    match_attributes: dict[str, str]


# The events: one object a span, short-lived and never part of a reference cycle. Compiled, they
# are kept out of the cyclic garbage collector's reach and the last one's memory is reused
# (`mypyc_attr` does nothing in pure Python). Their __init__ is written out: mypyc compiles it,
# where the one @dataclass would write stays interpreted (a Python call a span). @dataclass
# still gives them __eq__ and __repr__.
@mypyc_attr(acyclic=True, free_list_len=1)
@dataclass(slots=True, init=False)
class ToolCall:
    span_id: bytes  # raw 8 bytes; hex only when a decision is written
    tool_name: str
    arguments: Any  # decoded JSON-like value, or MISSING
    call_id: str | None
    agent_name: str | None
    match_attributes: dict[str, str] | None
    result: Any  # decoded JSON-like value, or MISSING
    args_digest: str | None  # spanguard.tool.args_hash, made before the span left
    result_digest: str | None  # spanguard.tool.result_hash
    scope: str  # the instrumentation scope's name: which library made the span
    end_time_unix_nano: int  # 0: the span carries no end time
    conversation_id: str | None  # read only when the conversation scope is on
    start_time_unix_nano: int  # 0: the span carries no start time
    failed: bool  # the span says the call failed (status ERROR, error.type)

    def __init__(
        self,
        span_id: bytes,
        tool_name: str,
        arguments: Any,
        call_id: str | None,
        agent_name: str | None,
        match_attributes: dict[str, str] | None,
        result: Any = MISSING,
        args_digest: str | None = None,
        result_digest: str | None = None,
        scope: str = "",
        end_time_unix_nano: int = 0,
        conversation_id: str | None = None,
        start_time_unix_nano: int = 0,
        failed: bool = False,
    ) -> None:
        self.span_id = span_id
        self.tool_name = tool_name
        self.arguments = arguments
        self.call_id = call_id
        self.agent_name = agent_name
        self.match_attributes = match_attributes
        self.result = result
        self.args_digest = args_digest
        self.result_digest = result_digest
        self.scope = scope
        self.end_time_unix_nano = end_time_unix_nano
        self.conversation_id = conversation_id
        self.start_time_unix_nano = start_time_unix_nano
        self.failed = failed


@mypyc_attr(acyclic=True, free_list_len=1)
@dataclass(slots=True, init=False)
class TokenUsage:
    span_id: bytes  # raw 8 bytes; hex only when a decision is written
    tokens: int
    aggregate: bool  # an agent span's total, which repeats its inference spans
    agent_name: str | None
    match_attributes: dict[str, str] | None
    end_time_unix_nano: int
    # Read only when usage is priced (PRICE_KEYS wanted) and the span names a model.
    input_tokens: int  # cached ones included
    output_tokens: int
    cache_read_tokens: int
    cache_write_tokens: int
    request_model: str | None
    response_model: str | None
    provider: str | None
    conversation_id: str | None  # read only when the conversation scope is on
    # When an inference sent a new user message started (microseconds; 0: not one).
    user_turn: int

    def __init__(
        self,
        span_id: bytes,
        tokens: int,
        aggregate: bool,
        agent_name: str | None,
        match_attributes: dict[str, str] | None,
        end_time_unix_nano: int = 0,
        input_tokens: int = 0,
        output_tokens: int = 0,
        cache_read_tokens: int = 0,
        cache_write_tokens: int = 0,
        request_model: str | None = None,
        response_model: str | None = None,
        provider: str | None = None,
        conversation_id: str | None = None,
    ) -> None:
        self.span_id = span_id
        self.tokens = tokens
        self.aggregate = aggregate
        self.agent_name = agent_name
        self.match_attributes = match_attributes
        self.end_time_unix_nano = end_time_unix_nano
        self.input_tokens = input_tokens
        self.output_tokens = output_tokens
        self.cache_read_tokens = cache_read_tokens
        self.cache_write_tokens = cache_write_tokens
        self.request_model = request_model
        self.response_model = response_model
        self.provider = provider
        self.conversation_id = conversation_id
        self.user_turn = 0

    @property
    def priced(self) -> bool:
        """Whether the span names a model to price its tokens by."""
        return self.request_model is not None or self.response_model is not None


@mypyc_attr(acyclic=True, free_list_len=1)
@dataclass(slots=True, init=False)
class AgentSeen:
    """A span that tells who the agent is, and nothing the rules count."""

    span_id: bytes
    agent_name: str | None
    match_attributes: dict[str, str] | None
    conversation_id: str | None
    user_turn: int  # when an inference sent a new user message started (us; 0: not one)

    def __init__(
        self,
        span_id: bytes,
        agent_name: str | None,
        match_attributes: dict[str, str] | None,
        conversation_id: str | None = None,
        user_turn: int = 0,
    ) -> None:
        self.span_id = span_id
        self.agent_name = agent_name
        self.match_attributes = match_attributes
        self.conversation_id = conversation_id
        self.user_turn = user_turn


def resource_info(attributes: AttributeMap, match_keys: frozenset[str]) -> ResourceInfo:
    """The service, agent name and matched attributes of a resource's attribute map."""
    service = attributes.get(SERVICE_NAME)
    agent_name = attributes.get(AGENT_NAME)
    matched = {}
    for key in match_keys:
        value = attributes.get(key)
        if value is not None:
            matched[key] = _text(value)
    return ResourceInfo(
        bounded_text(_text(service)) if service is not None else "unknown_service",
        bounded_text(_text(agent_name)) if agent_name is not None else None,
        matched,
    )


class SpanReading(NamedTuple):
    """What adapt_span looks for given its `wanted` keys, worked out once per key set."""

    # A span carrying none of these (and not named `execute_tool`) is no event: what makes a
    # span a tool call, an inference or an agent's, and its usage keys when wanted.
    gate: tuple[str, ...]
    gate_with_agent: tuple[str, ...]  # the same and the agent's name, for `match`
    gate_set: frozenset[str]  # the gate as a set, for spans with few attributes
    gate_set_with_agent: frozenset[str]
    operation_wanted: bool  # gen_ai.operation.name (the commonest gate key) is wanted
    usage: tuple[str, ...]  # the usage keys wanted
    input_tokens: tuple[str, ...]
    output_tokens: tuple[str, ...]
    aggregate_input: tuple[str, ...]
    aggregate_output: tuple[str, ...]
    # Wanted keys beyond the conventions': the policy's match keys, and the price and
    # conversation keys when those are wanted (all of them are match attributes).
    match_keys: tuple[str, ...]
    conversation: tuple[str, ...]  # the conversation keys wanted (the conversation scope)
    models: tuple[str, ...]  # the model keys wanted (usage is priced)
    # Every convention key but usage is wanted: the attribute map itself answers "present?"
    # (a hash lookup in C per key read) instead of a set built from all the span's keys.
    whole: bool
    wanted: frozenset[str]


# The keys that can make a span an event (see adapt_span), commonest first.
_GATE_KEYS: Final = (
    OPERATION,
    OPENINFERENCE_KIND,
    TRACELOOP_KIND,
    AI_SDK_OPERATION,
    GENKIT_SUBTYPE,
    "gen_ai.tool.name",
    "tool.name",
)
_READINGS: dict[frozenset[str], SpanReading] = {}


def reading_of(wanted: frozenset[str]) -> SpanReading:
    """What adapt_span looks for given `wanted` (made once per key set)."""
    reading = _READINGS.get(wanted)
    if reading is not None:
        return reading

    def only_wanted(keys: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(key for key in keys if key in wanted)

    usage = only_wanted(
        (*INPUT_TOKEN_KEYS, *OUTPUT_TOKEN_KEYS, AGGREGATE_INPUT_KEY, AGGREGATE_OUTPUT_KEY)
    )
    gate = only_wanted(_GATE_KEYS) + usage
    gate_with_agent = gate + only_wanted((AGENT_NAME,))
    reading = SpanReading(
        gate=gate,
        gate_with_agent=gate_with_agent,
        gate_set=frozenset(gate),
        gate_set_with_agent=frozenset(gate_with_agent),
        operation_wanted=OPERATION in wanted,
        usage=usage,
        input_tokens=only_wanted(INPUT_TOKEN_KEYS),
        output_tokens=only_wanted(OUTPUT_TOKEN_KEYS),
        aggregate_input=only_wanted((AGGREGATE_INPUT_KEY,)),
        aggregate_output=only_wanted((AGGREGATE_OUTPUT_KEY,)),
        match_keys=tuple(sorted(wanted - WANTED_KEYS)),
        conversation=only_wanted(CONVERSATION_KEYS),
        models=only_wanted((*RESPONSE_MODEL_KEYS, *REQUEST_MODEL_KEYS)),
        whole=wanted >= WANTED_KEYS - USAGE_KEYS,
        wanted=wanted,
    )
    if len(_READINGS) >= 64:  # one per guard's policy in practice; bounded all the same
        _READINGS.clear()
    _READINGS[wanted] = reading
    return reading


def adapt_span(
    span: Any, wanted: frozenset[str] = WANTED_KEYS, *, match: bool = False, scope: str = ""
) -> ToolCall | TokenUsage | AgentSeen | tuple[ToolCall | TokenUsage | AgentSeen, ...] | None:
    """Map one span of a request view to a ToolCall, a TokenUsage, or None.

    `wanted` is WANTED_KEYS (less the usage keys when no budget is set anywhere: then chat
    spans cost a few lookups and nothing more) plus the policy's match keys, which are
    returned when `match` is set. The span's attributes are a map (see
    schemas/otlp_view.py): the keys that can make a span an event are looked up first (most
    spans are none: HTTP clients, retrievers), then only the wanted keys the span's kind
    needs, and only the values of those present are read. `scope` is the name of the span's
    instrumentation scope.
    """
    return adapt_read(span, reading_of(wanted), match, scope)


# What a span may be: one event, or (a LiteLLM proxy span) the tool calls its request answered
# followed by its own event, if any.
Event = ToolCall | TokenUsage | AgentSeen


def adapt_read(
    span: Any, reading: SpanReading, match: bool, scope: str
) -> Event | tuple[Event, ...] | None:
    """adapt_span with its `wanted` keys worked out already (`reading_of`): the guard's call,
    once per span. A tuple only for LiteLLM's proxy spans (scope `litellm`)."""
    event = _adapt_one(span, reading, match, scope)
    if scope != GATEWAY_SCOPE:
        return event
    calls = gateway_calls(span, scope)
    if not calls:
        return event
    return (*calls, event) if event is not None else tuple(calls)


def _adapt_one(
    span: Any, reading: SpanReading, match: bool, scope: str
) -> ToolCall | TokenUsage | AgentSeen | None:
    attributes: AttributeMap = span.attributes
    # Whether the span names its operation, asked once (a wanted key, so `OPERATION in present`
    # below would say the same).
    has_operation = reading.operation_wanted and OPERATION in attributes
    if not has_operation:
        gate = reading.gate_with_agent if match else reading.gate
        if 2 * len(attributes) < len(gate):
            # Few attributes: one pass over the span's keys costs less than a lookup per key.
            gate_set = reading.gate_set_with_agent if match else reading.gate_set
            through = not gate_set.isdisjoint(attributes)
        else:
            through = False
            for key in gate:
                if key in attributes:
                    through = True
                    break
        if not through and span.name != "execute_tool":
            return None
    # Which keys are there: the map itself when it can only be asked for wanted keys (every
    # key asked below is a convention key, the usage and match keys come filtered by wanted).
    present: Any = attributes if reading.whole else reading.wanted.intersection(attributes)

    operation: str | None = attributes[OPERATION].string_value if has_operation else None
    # The other conventions' span kinds: a span with an operation name is told by it alone,
    # so they are read only where the operation name cannot answer (`_other_kinds`).
    oi_kind: str | None = None
    tl_kind: str | None = None
    ai_operation: str | None = None
    if operation is None:
        oi_kind, tl_kind, ai_operation = _other_kinds(attributes, present)
    # Without a policy matching per agent, the keys read for prices or conversations are
    # no match attributes to build.
    match_attributes = None
    if match:
        for key in reading.match_keys:
            if key in present:
                if match_attributes is None:
                    match_attributes = {}
                match_attributes[key] = _text(attributes[key])
    agent_name = bounded_text(_text(attributes[AGENT_NAME])) if AGENT_NAME in present else None
    named = False  # a wanted conversation key is there (only with the conversation scope on)
    for key in reading.conversation:
        if key in present:
            named = True
            break

    if operation == HANDOFF_OPERATION:
        return _handoff(span, attributes, agent_name, match_attributes, scope)
    if (
        (operation == "execute_tool" or _is_spring_ai_tool(operation, attributes))
        if operation is not None
        else _is_tool_span(span.name, present, operation, oi_kind, tl_kind, ai_operation)
    ):
        tool_name = _first_text(attributes, present, TOOL_NAME_KEYS) or _tool_span_name(span.name)
        if tool_name == ADK_MERGED_TOOLS:
            return None
        if len(tool_name) > MAX_TEXT_CHARS:
            tool_name = bounded_text(tool_name)
        if operation is not None and "tool.parameters" in present:
            oi_kind = _other_kinds(attributes, present)[0]  # whether it is OpenInference's
        arguments, envelope_call_id = _arguments(span, attributes, present, oi_kind, scope)
        call_id = _call_id(attributes, present)
        if call_id is None and envelope_call_id:
            call_id = bounded_text(envelope_call_id)
        return ToolCall(
            span_id=span.span_id,
            tool_name=tool_name,
            arguments=arguments,
            call_id=call_id,
            agent_name=agent_name,
            match_attributes=match_attributes,
            result=_result(span, attributes, present, scope),
            # Hashes made before the span left (rare: most spans carry the values).
            args_digest=_digest(attributes, ARGS_HASH_KEY) if ARGS_HASH_KEY in present else None,
            result_digest=(
                _digest(attributes, RESULT_HASH_KEY) if RESULT_HASH_KEY in present else None
            ),
            scope=scope,
            end_time_unix_nano=span.end_time_unix_nano,
            conversation_id=conversation_of(attributes, present) if named else None,
            start_time_unix_nano=span.start_time_unix_nano,
            failed=span.status.code == STATUS_ERROR or ERROR_TYPE in present,
        )

    user_turn = 0
    if INPUT_MESSAGES in present and ends_with_user_message(attributes[INPUT_MESSAGES]):
        user_turn = (span.start_time_unix_nano or span.end_time_unix_nano) // 1000 or 1
    for key in reading.usage:
        if key in present:
            break
    else:
        # The conversation may be named only on the agent's span: read it off any span a GenAI
        # convention marks (`session.id` on a plain HTTP span is a web session, not a chat).
        if named and not operation and operation is not None:
            oi_kind, tl_kind, ai_operation = _other_kinds(attributes, present)
        conversation_id = (
            conversation_of(attributes, present)
            if named and (operation or oi_kind or tl_kind or ai_operation)
            else None
        )
        if (match and agent_name is not None) or conversation_id is not None or user_turn:
            # The policy matches on the agent's name, which may only be on this span.
            return AgentSeen(span.span_id, agent_name, match_attributes, conversation_id, user_turn)
        return None
    if operation is not None and operation not in INFERENCE_OPERATIONS:
        oi_kind, tl_kind, ai_operation = _other_kinds(attributes, present)
    inference = (
        operation in INFERENCE_OPERATIONS
        or oi_kind in OPENINFERENCE_INFERENCE_KINDS
        or ai_operation in AI_SDK_INFERENCE_OPERATIONS
        or (
            TRACELOOP_REQUEST_TYPE in present
            and attributes[TRACELOOP_REQUEST_TYPE].string_value in TRACELOOP_LLM_TYPES
        )
    )
    tokens_in = _first_int(attributes, present, reading.input_tokens)
    tokens_out = _first_int(attributes, present, reading.output_tokens)
    if tokens_in is None and tokens_out is None and not inference:
        tokens_in = _first_int(attributes, present, reading.aggregate_input)
        tokens_out = _first_int(attributes, present, reading.aggregate_output)
    if tokens_in is None and tokens_out is None:
        if user_turn:
            return AgentSeen(span.span_id, agent_name, match_attributes, None, user_turn)
        return None
    tokens = (tokens_in or 0) + (tokens_out or 0)
    # Usage on anything but an inference span (agent, workflow, chain) is an aggregate.
    # Positional: a call by keyword costs twice as much, once per inference span.
    usage = TokenUsage(
        span.span_id,
        tokens,
        not inference,  # aggregate
        agent_name,
        match_attributes,
        span.end_time_unix_nano,
    )
    if named:
        usage.conversation_id = conversation_of(attributes, present)
    usage.user_turn = user_turn
    for key in reading.models:
        if key in present:
            _read_price_facts(usage, attributes, present, inference, tokens_in, tokens_out)
            break
    return usage


_LAST_ROLE: Final = re.compile(r'"role"\s*:\s*"([A-Za-z_]+)"')


def ends_with_user_message(value: AnyValue) -> bool:
    """Whether input messages (GenAI conventions' JSON) end with the user's: the user spoke
    since the agent's previous turn. The last `"role"` key outside a string is the last
    message's; one found inside a string is escaped (`\\"role\\"`), and skipped. A user
    message of tool results (`tool_call_response` parts) is no new word from the user."""
    text = value.string_value
    end = len(text)
    while True:
        at = text.rfind('"role"', 0, end)
        if at < 0:
            return False
        if at == 0 or text[at - 1] != "\\":
            found = _LAST_ROLE.match(text, at)
            # Some instrumentations (pydantic-ai) send tool results as the user's parts.
            return (
                found is not None
                and found.group(1) == "user"
                and "tool_call_response" not in text[at:]
            )
        end = at


def _read_price_facts(
    usage: TokenUsage,
    attributes: AttributeMap,
    present: Container[str],
    inference: bool,
    tokens_in: int | None,
    tokens_out: int | None,
) -> None:
    """What pricing needs of a usage span: the model, the provider and the counts apart
    (`tokens_in`, `tokens_out`: the counts the span's usage was read from)."""
    usage.request_model = _model_text(attributes, present, REQUEST_MODEL_KEYS)
    usage.response_model = _model_text(attributes, present, RESPONSE_MODEL_KEYS)
    usage.provider = _model_text(attributes, present, PROVIDER_KEYS)
    if not inference:  # an agent's total: its own counts where the inference keys lack one
        if tokens_in is None:
            tokens_in = _first_int(attributes, present, (AGGREGATE_INPUT_KEY,))
        if tokens_out is None:
            tokens_out = _first_int(attributes, present, (AGGREGATE_OUTPUT_KEY,))
    usage.input_tokens = tokens_in or 0
    usage.output_tokens = tokens_out or 0
    # Most spans report no cache counts: one pass over both key lists finds that out.
    for key in CACHE_KEYS:
        if key in present:
            usage.cache_read_tokens = _first_int(attributes, present, CACHE_READ_KEYS) or 0
            usage.cache_write_tokens = _first_int(attributes, present, CACHE_WRITE_KEYS) or 0
            break


def _model_text(
    attributes: AttributeMap, present: Container[str], keys: tuple[str, ...]
) -> str | None:
    """The first non-empty text of `keys` on the span, bounded (MAX_TEXT_CHARS): the model or
    provider a priced span names (three per span, so a string value is read inline)."""
    for key in keys:
        if key in present:
            value = attributes[key]
            text = value.string_value or _text(value)
            if text:
                return text if len(text) <= MAX_TEXT_CHARS else bounded_text(text)
    return None


def conversation_of(attributes: AttributeMap, present: Container[str]) -> str | None:
    """The conversation a span names: the first non-empty of CONVERSATION_KEYS, at most
    MAX_TEXT_CHARS (a longer one is cut and hashed: still one id per conversation)."""
    for key in CONVERSATION_KEYS:
        if key in present:
            value = attributes[key]
            raw = value.string_value or _text(value)
            # Every span of a conversation names it again: the answer is kept per text.
            found = _conversation_ids.get(raw)
            if found is None:
                found = _conversation_id(raw)
                if len(raw) <= MAX_TEXT_CHARS:
                    if len(_conversation_ids) >= MAX_CONVERSATION_IDS_KEPT:
                        _conversation_ids.clear()
                    _conversation_ids[raw] = found
            if found:
                return found
    return None


# conversation_of's answers by the text a span gave ("" for none), bounded.
_conversation_ids: dict[str, str] = {}
MAX_CONVERSATION_IDS_KEPT: Final = 16_384


def _conversation_id(raw: str) -> str:
    """The conversation id `raw` names: "" when blank or a placeholder."""
    text = raw.strip()
    if not text or text.lower() in PLACEHOLDER_CALL_IDS:
        return ""
    return bounded_text(text)


def _other_kinds(
    attributes: AttributeMap, present: Container[str]
) -> tuple[str | None, str | None, str | None]:
    """The span kinds of the conventions without an operation name: OpenInference's,
    Traceloop's, and the AI SDK's operation (Genkit's subtype read as one)."""
    oi_kind = attributes[OPENINFERENCE_KIND].string_value if OPENINFERENCE_KIND in present else None
    tl_kind = attributes[TRACELOOP_KIND].string_value if TRACELOOP_KIND in present else None
    ai_operation = (
        attributes[AI_SDK_OPERATION].string_value if AI_SDK_OPERATION in present else None
    )
    if GENKIT_SUBTYPE in present and ai_operation is None:
        ai_operation = _genkit_operation(attributes[GENKIT_SUBTYPE].string_value)
    return oi_kind, tl_kind, ai_operation


def _tool_span_name(name: str) -> str:
    """A tool span's own name where it records no tool name (OpenInference's OpenAI Agents
    handoffs: "handoff to billing"): "execute_tool X" is X; a bare or empty name is unknown."""
    name = name.removeprefix("execute_tool ").strip()
    if not name or name.lower() in PLACEHOLDERS or name == "execute_tool":
        return "unknown"
    return bounded_text(name)


def _handoff(
    span: Any,
    attributes: AttributeMap,
    agent_name: str | None,
    match_attributes: dict[str, str] | None,
    scope: str,
) -> ToolCall | None:
    """An `agent_handoff` span (the OpenTelemetry OpenAI Agents instrumentation): the agent
    handing the run to another, counted as its call "handoff to <agent>" with both agents as
    arguments, so two agents handing a task back and forth are a loop like any other."""
    if HANDOFF_TO not in attributes:
        return None
    to_agent = bounded_text(_text(attributes[HANDOFF_TO]))
    from_agent = bounded_text(_text(attributes[HANDOFF_FROM])) if HANDOFF_FROM in attributes else ""
    return ToolCall(
        span_id=span.span_id,
        tool_name=f"handoff to {to_agent}",
        arguments={"from_agent": from_agent, "to_agent": to_agent},
        call_id=None,
        agent_name=agent_name,
        match_attributes=match_attributes,
        result=MISSING,
        scope=scope,
        end_time_unix_nano=span.end_time_unix_nano,
        start_time_unix_nano=span.start_time_unix_nano,
    )


def _is_tool_span(
    name: str,
    present: Container[str],
    operation: str | None,
    oi_kind: str | None,
    tl_kind: str | None,
    ai_operation: str | None = None,
) -> bool:
    if operation is not None:
        return operation == "execute_tool"
    if oi_kind is not None:
        return oi_kind == "TOOL"
    if tl_kind is not None:
        return tl_kind == "tool"
    if ai_operation is not None:
        return ai_operation == AI_SDK_TOOL_OPERATION
    if name == "execute_tool":
        return True
    # pydantic-ai and strands name their tool spans but set no operation name.
    if "gen_ai.tool.name" in present:
        return name.startswith("execute_tool ") or name == "running tool"
    return "tool.name" in present and name.startswith("Tool: ")


def _is_spring_ai_tool(operation: str, attributes: AttributeMap) -> bool:
    return (
        operation == SPRING_AI_OPERATION
        and SPRING_AI_KIND in attributes
        and attributes[SPRING_AI_KIND].string_value == "tool_call"
    )


def _genkit_operation(subtype: str) -> str:
    # A Genkit tool action reads as the AI SDK's tool operation; anything else as no tool.
    return AI_SDK_TOOL_OPERATION if subtype in GENKIT_TOOL_SUBTYPES else f"genkit:{subtype}"


def _arguments(
    span: Any, attributes: AttributeMap, present: Container[str], oi_kind: str | None, scope: str
) -> tuple[Any, str | None]:
    """The call's arguments (MISSING when not recorded) and a call id found in an envelope."""
    for key in ARGUMENT_KEYS:
        if key not in present:
            continue
        if key == "tool.parameters" and oi_kind is not None:
            continue  # OpenInference: the parameter schema, the same for every call
        value = _decode_value(attributes[key], python_repr=key == "traceloop.entity.input")
        if type(value) is dict and value and not ("input_str" in value or "inputs" in value):
            return value, None  # the common case: a JSON object, recorded, no envelope
        arguments, call_id = _unwrap_envelope(value)
        if not _not_recorded(arguments, scope):
            return arguments, call_id
    events = span.events
    for event in events if len(events) else ():  # (an empty one would end on an IndexError)
        for kv in event.attributes:
            if kv.key == "gen_ai.tool.call.arguments" or (
                kv.key == "content" and event.name == STRANDS_TOOL_EVENT
            ):
                arguments, call_id = _unwrap_envelope(_decode_value(kv.value))
                if not _not_recorded(arguments, scope):
                    return arguments, call_id
    return MISSING, None


def _unwrap_envelope(value: Any) -> tuple[Any, str | None]:
    """LangChain's callback envelope, wherever it is met: the arguments inside, and the call id.

    `{"input_str", "tags", "metadata", "inputs", "kwargs"}` carries per-step metadata
    (`langgraph_step`, `checkpoint_ns`) that changes on every call: hashing it whole would make
    every call unique. `inputs` holds the arguments, else `input_str` (a Python repr)."""
    if type(value) is not dict or not ("input_str" in value or "inputs" in value):
        return value, None
    if not value.keys() <= LANGCHAIN_ENVELOPE:
        return value, None
    kwargs = value.get("kwargs")
    call_id = kwargs.get("tool_call_id") if type(kwargs) is dict else None
    call_id = call_id if isinstance(call_id, str) else None
    inputs = value.get("inputs")
    if inputs:
        return inputs, call_id
    input_str = value.get("input_str")
    if not isinstance(input_str, str):
        return MISSING, call_id
    return decode_arguments(input_str, python_repr=True), call_id


def gateway_calls(span: Any, scope: str = GATEWAY_SCOPE) -> list[ToolCall]:
    """The tool calls a LiteLLM proxy span's request answers: the `tool` messages that end its
    `gen_ai.input.messages`, each with the call of the assistant message before them that it
    answers (name, arguments, id). Empty when the request ends otherwise (a user's message,
    the first request of a run) or records no messages."""
    attributes: AttributeMap = span.attributes
    if INPUT_MESSAGES not in attributes:
        return []
    messages = decode_arguments(_text(attributes[INPUT_MESSAGES]))
    if type(messages) is not list:
        return []
    first = len(messages)
    while first and _role(messages[first - 1]) == "tool":
        first -= 1
    if first == len(messages) or first == 0 or _role(messages[first - 1]) != "assistant":
        return []
    results: dict[str, Any] = {}
    for message in messages[first:]:
        call_id = message.get("tool_call_id")
        if isinstance(call_id, str):
            results[call_id] = _message_content(message)
    asked = messages[first - 1].get("tool_calls")
    calls: list[ToolCall] = []
    for index, call in enumerate(asked if type(asked) is list else ()):
        function = call.get("function") if type(call) is dict else None
        if type(function) is not dict or not isinstance(function.get("name"), str):
            continue
        call_id = call.get("id") if isinstance(call.get("id"), str) else None
        arguments = function.get("arguments", MISSING)
        calls.append(
            ToolCall(
                # One span, several calls: each its own id (the guard drops a repeated span id),
                # the same on every redelivery of the span.
                span_id=_derived_span_id(span.span_id, call_id or str(index)),
                tool_name=bounded_text(function["name"]),
                arguments=decode_arguments(arguments) if type(arguments) is str else arguments,
                call_id=bounded_text(call_id) if call_id else None,
                agent_name=None,
                match_attributes=None,
                result=results.get(call_id, MISSING) if call_id else MISSING,
                scope=scope,
                # The tool ran before this request was sent; when it started is not recorded.
                end_time_unix_nano=span.start_time_unix_nano,
                start_time_unix_nano=0,
            )
        )
    return calls


def _role(message: Any) -> Any:
    return message.get("role") if type(message) is dict else None


def _message_content(message: dict[str, Any]) -> Any:
    """A tool message's result: OpenAI's `content`, or the text of its GenAI `parts`."""
    content = message.get("content", MISSING)
    if content is MISSING:
        parts = message.get("parts")
        texts = [
            part.get("content") for part in parts if type(part) is dict
        ] if type(parts) is list else []  # fmt: skip
        if len(texts) == 1:
            content = texts[0]
        elif texts:
            content = "".join(text for text in texts if isinstance(text, str))
    return decode_arguments(content) if type(content) is str else content


def _derived_span_id(span_id: bytes, call_id: str) -> bytes:
    return hashlib.sha256(span_id + call_id.encode("utf-8", "surrogatepass")).digest()[:8]


def _not_recorded(value: Any, scope: str) -> bool:
    if value is MISSING:
        return True
    if type(value) is str:
        return value.strip() in PLACEHOLDERS
    if type(value) is dict and not value:
        return scope in EMPTY_WHEN_OFF_SCOPES
    return False


def _result(span: Any, attributes: AttributeMap, present: Container[str], scope: str) -> Any:
    for key in RESULT_KEYS:
        if key not in present:
            continue
        result = _unwrap_result(_decode_value(attributes[key]))
        if not _not_recorded(result, scope):
            return result
    events = span.events
    # strands' legacy conventions: a gen_ai.choice event's message. Most spans have no events,
    # and iterating an empty repeated field costs an IndexError protobuf formats.
    for event in events if len(events) else ():
        for kv in event.attributes:
            if kv.key == "gen_ai.tool.call.result" or (
                kv.key == "message" and event.name == STRANDS_RESULT_EVENT
            ):
                result = _decode_value(kv.value)
                if not _not_recorded(result, scope):
                    return result
    return MISSING


def _unwrap_result(value: Any) -> Any:
    if type(value) is dict and "output" in value and value.keys() <= {"output", "kwargs"}:
        value = value["output"]  # OpenLLMetry's {"output": ..., "kwargs": ...}
    if type(value) is not dict:
        return value
    # A LangChain ToolMessage: its content, without the tool_call_id that changes every call.
    if _is_serialised_tool_message(value):
        return value["kwargs"].get("content")
    data = value.get("data")
    if value.get("type") == "tool" and type(data) is dict and "content" in data:
        return data["content"]
    # llama-index's ToolOutput repeats the call's input beside what the tool returned.
    if "raw_output" in value and "raw_input" in value and "tool_name" in value:
        return value["raw_output"]
    return value


def _is_serialised_tool_message(value: dict[str, Any]) -> bool:
    """LangChain's serialised ToolMessage, Python's or LangChain.js's, whatever its `lc` version.

    Python writes `kwargs.type == "tool"`; LangChain.js writes no type in kwargs, and names the
    class as the last element of `id` (`["langchain_core", "messages", "ToolMessage"]`)."""
    kwargs = value.get("kwargs")
    lc = value.get("lc")
    if type(kwargs) is not dict or type(lc) is not int or "content" not in kwargs:
        return False
    if kwargs.get("type") == "tool":
        return True
    class_path = value.get("id")
    return (
        value.get("type") == "constructor"
        and type(class_path) is list
        and bool(class_path)
        and class_path[-1] in ("ToolMessage", "ToolMessageChunk")
    )


def _digest(attributes: AttributeMap, key: str) -> str | None:
    """The hash under `key` (present), if it is one of ours: 16 hex digits."""
    text = _text(attributes[key]).strip().lower()
    return text if _is_hex_digest(text) else None


def _is_hex_digest(text: str) -> bool:
    return len(text) == 16 and all(c in "0123456789abcdef" for c in text)


def _decode_value(value: AnyValue, *, python_repr: bool = False) -> Any:
    # A oneof member that is not set reads as its default: a non-empty string_value is the
    # value's kind, and one read answers the common case without WhichOneof.
    text = value.string_value
    if text:
        return decode_arguments(text, python_repr=python_repr)
    kind = value.WhichOneof("value")
    if kind == "string_value":
        return decode_arguments(text, python_repr=python_repr)
    if kind is None:
        return MISSING
    return any_value_to_python(value)


def decode_arguments(text: str, *, python_repr: bool = False) -> Any:
    """Arguments recorded as text: JSON, else (LangChain) a Python literal, else the text itself.

    A bare string is what a one-argument tool's input is written as (OpenInference JS's
    `input.value` = `refund policy`), and what a truncated or malformed JSON document is."""
    try:
        try:
            # json.loads's own scanner without its whitespace handling: a whole document with
            # nothing around it (what instrumentations write) is decoded in one C call.
            value, end = _scan_json(text, 0)
            if end == len(text):
                return value
        except (StopIteration, ValueError):  # not JSON from its first character
            pass
        return json.loads(text)  # whitespace around, or not JSON: as json.loads says
    except ValueError:
        pass
    except RecursionError:  # nested past the decoder's depth: identical texts still key alike
        return {"_raw": text}
    if python_repr and len(text) <= MAX_REPR_CHARS:
        try:
            return _jsonable(ast.literal_eval(text))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            pass
    return text


def _jsonable(value: Any) -> Any:
    # Python literals hold tuples, sets and bytes, which JSON has not: give them a JSON shape.
    if isinstance(value, dict):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(item) for item in value]
    if isinstance(value, set | frozenset):
        return sorted((_jsonable(item) for item in value), key=repr)
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, complex):
        return str(value)
    return value


def _call_id(attributes: AttributeMap, present: Container[str]) -> str | None:
    for key in CALL_ID_KEYS:
        if key in present:
            text = _text(attributes[key])
            if text.strip().lower() not in PLACEHOLDER_CALL_IDS:
                return bounded_text(text)
    return None


# Names and ids are kept in every trace's state and copied into signals and detections: a
# megabyte-long tool name must cost a few hundred bytes, not a megabyte per changelog write.
MAX_TEXT_CHARS: Final = 200


def bounded_text(text: str, limit: int = MAX_TEXT_CHARS) -> str:
    """`text` itself when short; else its head and a hash of the whole, still unique."""
    if len(text) <= limit:
        return text
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]
    return f"{text[: limit - 30]}...sha256:{digest}"


def _first_int(
    attributes: AttributeMap, present: Container[str], keys: tuple[str, ...]
) -> int | None:
    for key in keys:
        if key not in present:
            continue
        value = attributes[key]
        count = value.int_value
        if count:  # a non-zero int_value is the value's kind (see _decode_value)
            return count if count > 0 else 0
        kind = value.WhichOneof("value")
        if kind == "int_value":
            return 0
        if kind == "double_value":
            if not math.isfinite(value.double_value):
                continue  # Infinity or NaN counts nothing; the span's other data still does
            return max(int(value.double_value), 0)
        if kind == "string_value" and value.string_value.strip().isdigit():
            return int(value.string_value)
    return None


def _first_text(
    attributes: AttributeMap, present: Container[str], keys: tuple[str, ...]
) -> str | None:
    for key in keys:
        if key in present:
            text = _text(attributes[key])
            if text:
                return text
    return None


def _text(value: AnyValue) -> str:
    text = value.string_value
    if text:  # a non-empty string_value is the value's kind (see _decode_value)
        return text
    kind = value.WhichOneof("value")
    if kind == "string_value" or kind is None:
        return ""
    python = any_value_to_python(value)
    if isinstance(python, bool):
        return "true" if python else "false"
    return python if isinstance(python, str) else json.dumps(python, sort_keys=True)


# Which setting puts tool arguments on the spans, per instrumentation whose scope name is
# exactly this (generic names a prefix must not catch: `ai`, `gen_ai`).
CAPTURE_SETTINGS_EXACT: Final = {
    "ai": (
        "the Vercel AI SDK's legacy ai.* spans",
        "experimental_telemetry: {isEnabled: true} with recordOutputs left on (AI SDK <= 6"
        " records a tool call's arguments as an output of the model); through @ai-sdk/otel's"
        " LegacyOpenTelemetry (AI SDK 7) with recordInputs left on",
    ),
    "genkit-tracer": (
        "Genkit",
        "Genkit always records a tool's input (genkit:input); a span processor or the Collector"
        " must have dropped it",
    ),
    "dev.spanguard.langchain4j": (
        "LangChain4j (through clients/java's LangChain4jTracing)",
        "LangChain4jTracing.create(openTelemetry) or create(openTelemetry, true):"
        " captureContent true, its default",
    ),
    "org.springframework.boot": (
        "Spring AI (its Micrometer observations through Spring Boot's OpenTelemetry bridge)",
        "spring.ai.tools.observations.include-content=true (it registers"
        " ToolCallingContentObservationFilter; off by default)",
    ),
    "gen_ai": (
        "the Vercel AI SDK's OpenTelemetry integration (@ai-sdk/otel)",
        "telemetry: {recordInputs: true} (its default) in generateText / streamText",
    ),
}
# The same by scope name prefix (first match wins). Read from each library's source at the
# versions named above.
CAPTURE_SETTINGS: Final = (
    (
        "@arizeai/openinference-instrumentation",
        "OpenInference JS",
        "traceConfig: {hideInputs: false} (its default), or OPENINFERENCE_HIDE_INPUTS unset or"
        " false; hideOutputs hides only results",
    ),
    (
        "@mastra/",
        "Mastra's observability",
        "leave hideInput unset or false in the tracing options of the call (hideOutput hides"
        " only results)",
    ),
    (
        "openinference.instrumentation",
        "OpenInference",
        "leave OPENINFERENCE_HIDE_INPUTS unset or false (TraceConfig(hide_inputs=False))",
    ),
    (
        "opentelemetry.instrumentation.langchain",
        "OpenLLMetry (opentelemetry-instrumentation-langchain)",
        "TRACELOOP_TRACE_CONTENT=true (its default)",
    ),
    (
        "opentelemetry.instrumentation.openai_agents",
        "the OpenAI Agents SDK's OTel GenAI bridge (opentelemetry-instrumentation-openai-agents-v2)",
        "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=span_only or span_and_event (its"
        " default; false turns it off); OpenLLMetry's package of that name:"
        " TRACELOOP_TRACE_CONTENT=true",
    ),
    (
        "gcp.vertex.agent",
        "Google ADK",
        "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=SPAN_ONLY (or SPAN_AND_EVENT);"
        " on the legacy schema (ADK_TELEMETRY_SCHEMA_VERSION_OPT_IN=1)"
        " ADK_CAPTURE_MESSAGE_CONTENT_IN_SPANS=true",
    ),
    (
        "pydantic-ai",
        "pydantic-ai",
        "InstrumentationSettings(include_content=True) (its default)",
    ),
    (
        "strands.telemetry",
        "strands-agents",
        "drop gen_ai_unredacted_attributes= from OTEL_SEMCONV_STABILITY_OPT_IN, or list"
        " gen_ai.tool.call.arguments and gen_ai.input.messages in it",
    ),
    (
        "opentelemetry.instrumentation.",
        "an OpenTelemetry or OpenLLMetry instrumentation",
        "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true (SPAN_ONLY for those built on"
        " opentelemetry-util-genai); OpenLLMetry's: TRACELOOP_TRACE_CONTENT=true",
    ),
)
UNKNOWN_INSTRUMENTATION: Final = (
    "an unknown instrumentation",
    "turn on its argument capture (for OTel GenAI instrumentations"
    " OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true)",
)


def capture_setting(scope: str) -> tuple[str, str]:
    """(instrumentation, the setting that puts tool arguments on its spans) for a scope name."""
    exact = CAPTURE_SETTINGS_EXACT.get(scope)
    if exact is not None:
        return exact
    for prefix, instrumentation, setting in CAPTURE_SETTINGS:
        if scope.startswith(prefix):
            return instrumentation, setting
    return UNKNOWN_INSTRUMENTATION
