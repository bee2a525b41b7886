"""The attribute keys each instrumentation writes, and the values that tell what a span is.

Which convention and version each name was read from: docs/conventions.md. Grouped by what
they tell; WANTED_KEYS is every key the adapters (adapt.py) may read.
"""

from __future__ import annotations

from typing import Final

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
CALL_ID_KEYS: Final = ("gen_ai.tool.call.id", "tool.id", "ai.toolCall.id", "tool.call.id")
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
    "conversation.id",  # VoltAgent's, on every span of a run given a conversationId
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
EMPTY_WHEN_OFF_SCOPES: Final = frozenset({"gcp.vertex.agent"})  # ADK_SCOPE
# LiteLLM's proxy spans (gateway.py): the tool calls its requests answer.
GATEWAY_SCOPE: Final = "litellm"
# A handoff between agents (opentelemetry-instrumentation-openai-agents): read as a call.
HANDOFF_OPERATION: Final = "agent_handoff"
HANDOFF_FROM: Final = "gen_ai.handoff.from_agent"
HANDOFF_TO: Final = "gen_ai.handoff.to_agent"
# Handoffs that are tool calls: a LangGraph tool returning a Command to its parent graph that
# goes to another node (langgraph-supervisor's and langgraph-swarm's `transfer_to_<agent>`),
# and Google ADK's `transfer_to_agent` (its argument `agent_name`, on spans of ADK_SCOPE).
LANGGRAPH_PARENT_GRAPH: Final = "__parent__"
ADK_SCOPE: Final = "gcp.vertex.agent"
ADK_TRANSFER_TOOL: Final = "transfer_to_agent"
ADK_TRANSFER_ARGUMENT: Final = "agent_name"
# a2a-sdk's own spans (scope A2A_SCOPE) carry no attribute: the span that answers one request
# is named `<module>.<handler class>.<method>` (its `trace_class`), and is one run of the agent
# the service serves (conventions/adapt.py, _a2a_span). The 1.x classes and the 0.x one.
A2A_SCOPE: Final = "a2a-python-sdk"
A2A_HANDLER_CLASSES: Final = frozenset(
    {"DefaultRequestHandlerV2", "LegacyRequestHandler", "DefaultRequestHandler"}
)
# Not `on_message_send_stream`: its span ends as the stream is handed back, before any of the
# answer, so it holds nothing of the run (the agent's spans sit beside it, not inside).
A2A_HANDLER_METHODS: Final = frozenset({"on_message_send"})
# The classes whose spans start answering one request (the 1.x dispatchers and handlers, the
# 0.x handlers): such a span without a parent is a request whose caller's trace did not come
# with it (conventions/adapt.py, _a2a_span).
A2A_REQUEST_CLASSES: Final = A2A_HANDLER_CLASSES | frozenset(
    {"JsonRpcDispatcher", "RestDispatcher", "JSONRPCHandler", "RESTHandler"}
)
# VoltAgent's own spans (@voltagent/core 2.x, exported through the span processors its
# VoltAgentObservability is given) carry none of the GenAI conventions' keys
# (conventions/voltagent.py): a tool's span is named `tool.execution:<tool>` with `tool.name`,
# its arguments and result as JSON in `input` and `output`; an agent's run is a span with
# `entity.type` "agent" and no `span.type`, named by `entity.name` (a sub-agent's by
# `subagent.name`: its spans' `entity.name` is the parent's), holding the run's usage.
VOLTAGENT_SCOPE: Final = "@voltagent/core"
VOLTAGENT_TOOL_PREFIX: Final = "tool.execution:"
VOLTAGENT_INPUT: Final = "input"
VOLTAGENT_OUTPUT: Final = "output"
VOLTAGENT_SPAN_TYPE: Final = "span.type"
VOLTAGENT_ENTITY_TYPE: Final = "entity.type"
VOLTAGENT_ENTITY_NAME: Final = "entity.name"
VOLTAGENT_SUBAGENT_NAME: Final = "subagent.name"
VOLTAGENT_USAGE_INPUT: Final = "usage.prompt_tokens"
VOLTAGENT_USAGE_OUTPUT: Final = "usage.completion_tokens"
VOLTAGENT_MODEL: Final = "ai.model.name"
# OpenInference's handoff tool spans are named so ("handoff to billing").
HANDOFF_TOOL_PREFIX: Final = "handoff to "
# An agent's own span: the GenAI conventions' operation, OpenInference's kind and agent name.
INVOKE_AGENT_OPERATION: Final = "invoke_agent"
OI_AGENT_KIND: Final = "AGENT"
OI_AGENT_NAME: Final = "agent.name"
# LangGraph under OpenInference: an AGENT span names no agent, but its `metadata` (JSON) holds
# the namespace of the subgraph it runs in ("supervisor:<task>|worker_a:<task>"): the last
# node of it is the agent, the whole namespace one run of it (its model turns share it).
OI_METADATA: Final = "metadata"
LANGGRAPH_NAMESPACE: Final = "checkpoint_ns"
STRANDS_TOOL_EVENT: Final = "gen_ai.tool.message"
STRANDS_RESULT_EVENT: Final = "gen_ai.choice"


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
        *USAGE_KEYS,
    }
)
