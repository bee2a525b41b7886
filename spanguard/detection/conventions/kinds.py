"""What kind of span it is, for the conventions that name no `gen_ai.operation.name`."""

from __future__ import annotations

from collections.abc import Container
from typing import Any

from spanguard.detection.conventions.keys import (
    A2A_HANDLER_CLASSES,
    A2A_HANDLER_METHODS,
    A2A_REQUEST_CLASSES,
    AI_SDK_OPERATION,
    AI_SDK_TOOL_OPERATION,
    GENKIT_SUBTYPE,
    GENKIT_TOOL_SUBTYPES,
    OPENINFERENCE_KIND,
    PLACEHOLDERS,
    SPRING_AI_KIND,
    SPRING_AI_OPERATION,
    TRACELOOP_KIND,
    VOLTAGENT_TOOL_PREFIX,
)
from spanguard.detection.conventions.values import AttributeMap, bounded_text


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
    # VoltAgent names its tool spans `tool.execution:<tool>` (keys.VOLTAGENT_TOOL_PREFIX).
    return "tool.name" in present and name.startswith(("Tool: ", VOLTAGENT_TOOL_PREFIX))


def _is_spring_ai_tool(operation: str, attributes: AttributeMap) -> bool:
    return (
        operation == SPRING_AI_OPERATION
        and SPRING_AI_KIND in attributes
        and attributes[SPRING_AI_KIND].string_value == "tool_call"
    )


def _genkit_operation(subtype: str) -> str:
    # A Genkit tool action reads as the AI SDK's tool operation; anything else as no tool.
    return AI_SDK_TOOL_OPERATION if subtype in GENKIT_TOOL_SUBTYPES else f"genkit:{subtype}"


def is_a2a_handler(name: str) -> bool:
    """Whether a span of a2a-sdk's scope (A2A_SCOPE) is its request handler answering a
    message, `<module>.<handler class>.on_message_send`: one run of the service's agent."""
    head, _, method = name.rpartition(".")
    return method in A2A_HANDLER_METHODS and head.rpartition(".")[2] in A2A_HANDLER_CLASSES


def is_a2a_request(name: str) -> bool:
    """Whether a span of a2a-sdk's scope is one of the spans that start answering a request
    (`<module>.<dispatcher or handler class>.<method>`), whatever the method."""
    return name.rpartition(".")[0].rpartition(".")[2] in A2A_REQUEST_CLASSES


def caller_trace(span: Any) -> str | None:
    """The trace (hex) a span without a parent links to, where it links to another: its trace
    was started for a caller whose own trace is linked, not carried (VoltAgent links an agent's
    run to the span current when it started: an instrumented server's, in its caller's trace).
    None for a span with a parent or no such link (a link's trace id that is not a valid one,
    16 bytes not all zero, is none)."""
    if span.parent_span_id:
        return None
    links = span.links
    for index in range(len(links)):
        linked = bytes(links[index].trace_id)
        if len(linked) == 16 and linked != span.trace_id and any(linked):
            return linked.hex()
    return None
