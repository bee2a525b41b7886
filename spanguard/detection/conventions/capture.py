"""Which setting of each instrumentation puts tool arguments on its spans: what the guard's
warning about missing arguments names (docs/conventions.md, "When arguments are missing")."""

from __future__ import annotations

from typing import Final

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
    "@voltagent/core": (
        "VoltAgent's observability",
        "VoltAgent always records a tool call's arguments (`input`) when it has any; a span"
        " processor or the Collector must have dropped them",
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
