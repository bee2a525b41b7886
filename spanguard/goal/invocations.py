"""Goal completion, step one: where an agent invocation ends, and what it recorded.

Pure (no Kafka, no HTTP). Off the hot path: the loop and budget rules never wait on this.
The whole flow (docs/design.md, "Goal verification"):

    for end in find_invocation_ends(request):        # the canonical ExportTraceServiceRequest
        if not end.has_content:                      # content capture is opt-in: count, skip
            continue
        if should_sample(end.trace_id, rate):        # deterministic per trace id
            verdict = await judge.judge(end)         # Verdict, or JudgeError (never a pass)

**When an invocation ends.** Spans are exported when they end and a parent ends after its
children, so an invocation has ended when its outermost span shows up. An end is
- a root agent span: `gen_ai.operation.name` = `invoke_agent` (OTel GenAI) or
  `openinference.span.kind` = `AGENT` (OpenInference), with no parent (`kind="agent"`);
- failing that, the trace's root span, whatever it is (`kind="trace_root"`): frameworks that do
  not mark agent spans, or an agent run under a server span. Where that root recorded neither
  a request nor an answer and the same request holds exactly one top-level agent span of the
  trace (no agent span above it), the content is that agent span's; with several, none is
  borrowed. A trace root with no content and no agent in sight may be no agent at all (any
  service's traces pass through the Collector): `kind` tells such ends apart.
A sub-agent's `invoke_agent` span (it has a parent) is never an end.

**Content** (opt-in in every instrumentation: where it was not recorded the field is None, and
nothing is ever made up). OTel GenAI semconv (docs/gen-ai/gen-ai-input-messages.json,
gen-ai-output-messages.json and gen-ai-system-instructions.json of semantic-conventions-genai):
- `gen_ai.input.messages`: a list of `{"role", "parts": [...], "name"?}`; the request is the
  text parts (`{"type": "text", "content": "..."}`) of the last `user` message;
- `gen_ai.output.messages`: a list of `{"role", "parts", "finish_reason"}`; the answer is the
  text parts of the last message whose role is not user/system/tool (normally `assistant`);
- `gen_ai.system_instructions`: a list of parts; the instructions are its text parts.
Each is a JSON string, or a structured AnyValue (the attribute type is `any`). Messages in the
older `{"role", "content": "<text>"}` shape are read too. Text parts are joined with newlines.
OpenInference: `input.value` / `output.value`, plain text or JSON (`input.mime_type`); a JSON
string is unwrapped, any other JSON is passed to the judge as recorded. The GenAI attributes win
where both are present.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span

from spanguard.schemas.otlp import any_value_to_python

__all__ = ["EndKind", "InvocationEnd", "find_invocation_ends"]


OPERATION: Final = "gen_ai.operation.name"
OPENINFERENCE_KIND: Final = "openinference.span.kind"
GENAI_AGENT_NAME: Final = "gen_ai.agent.name"
OPENINFERENCE_AGENT_NAME: Final = "agent.name"
SERVICE_NAME: Final = "service.name"
INPUT_MESSAGES: Final = "gen_ai.input.messages"
OUTPUT_MESSAGES: Final = "gen_ai.output.messages"
SYSTEM_INSTRUCTIONS: Final = "gen_ai.system_instructions"
OI_INPUT: Final = "input.value"
OI_INPUT_MIME: Final = "input.mime_type"
OI_OUTPUT: Final = "output.value"
OI_OUTPUT_MIME: Final = "output.mime_type"
# Roles whose messages are not the model's answer.
NOT_ANSWER_ROLES: Final = frozenset({"user", "system", "tool", "developer"})

EndKind = Literal["agent", "trace_root"]


@dataclass(frozen=True, slots=True)
class InvocationEnd:
    """One finished agent invocation and what it recorded of the request and the answer."""

    trace_id: str  # 32 lowercase hex
    span_id: str  # 16 lowercase hex: the span whose end is the invocation's end
    service: str
    agent_name: str | None
    request: str | None  # the user's request; None: not recorded
    answer: str | None  # the agent's final answer; None: not recorded
    instructions: str | None  # the system instructions; None: not recorded
    kind: EndKind = "agent"  # a root agent span, or the trace's root span

    @property
    def has_content(self) -> bool:
        """Whether there is something to judge: both the request and the answer were recorded."""
        return self.request is not None and self.answer is not None


def find_invocation_ends(request: ExportTraceServiceRequest) -> list[InvocationEnd]:
    """The agent invocations that end in this request (see the module docstring), in order."""
    ends: list[InvocationEnd] = []
    for resource_spans in request.resource_spans:
        resource = {kv.key: kv.value for kv in resource_spans.resource.attributes}
        service_value = resource.get(SERVICE_NAME)
        service = _text(any_value_to_python(service_value)) if service_value else None
        resource_agent = resource.get(GENAI_AGENT_NAME)
        spans = [span for scope in resource_spans.scope_spans for span in scope.spans]
        for span in spans:
            if span.parent_span_id:
                continue
            attributes = _attributes(span)
            kind: EndKind = "agent" if _is_agent(attributes) else "trace_root"
            content = _content(attributes)
            agent_name = _agent_name(attributes)
            if kind == "trace_root" and content[0] is None and content[1] is None:
                # No content of its own: the top-level agent's, whole (never a mix of two spans).
                top = _top_agent(span, request)
                if top is not None:
                    content = _content(top)
                    agent_name = agent_name or _agent_name(top)
            if agent_name is None and resource_agent is not None:
                agent_name = _text(any_value_to_python(resource_agent))
            request_text, answer, instructions = content
            ends.append(
                InvocationEnd(
                    trace_id=span.trace_id.hex(),
                    span_id=span.span_id.hex(),
                    service=service or "unknown_service",
                    agent_name=agent_name or None,
                    request=request_text,
                    answer=answer,
                    instructions=instructions,
                    kind=kind,
                )
            )
    return ends


def _attributes(span: Span) -> dict[str, Any]:
    return {kv.key: any_value_to_python(kv.value) for kv in span.attributes}


def _is_agent(attributes: Mapping[str, Any]) -> bool:
    return attributes.get(OPERATION) == "invoke_agent" or (
        attributes.get(OPENINFERENCE_KIND) == "AGENT"
    )


def _is_agent_span(span: Span) -> bool:
    for kv in span.attributes:
        if kv.key == OPERATION and kv.value.string_value == "invoke_agent":
            return True
        if kv.key == OPENINFERENCE_KIND and kv.value.string_value == "AGENT":
            return True
    return False


def _agent_name(attributes: Mapping[str, Any]) -> str | None:
    for key in (GENAI_AGENT_NAME, OPENINFERENCE_AGENT_NAME):
        value = attributes.get(key)
        if value is not None and _text(value):
            return _text(value)
    return None


def _top_agent(root: Span, request: ExportTraceServiceRequest) -> dict[str, Any] | None:
    """The attributes of the one top-level agent span of root's trace in this request, if one."""
    trace_spans = [
        span
        for resource_spans in request.resource_spans
        for scope in resource_spans.scope_spans
        for span in scope.spans
        if span.trace_id == root.trace_id
    ]
    by_id = {span.span_id: span for span in trace_spans}
    agents = {span.span_id for span in trace_spans if _is_agent_span(span)}
    top = []
    for span_id in agents:
        parent = by_id[span_id].parent_span_id
        seen = {span_id}
        nested = False
        while parent and parent in by_id and parent not in seen:
            if parent in agents:
                nested = True
                break
            seen.add(parent)
            parent = by_id[parent].parent_span_id
        if not nested:
            top.append(by_id[span_id])
    return _attributes(top[0]) if len(top) == 1 else None


def _content(attributes: Mapping[str, Any]) -> tuple[str | None, str | None, str | None]:
    request = _last_message_text(attributes.get(INPUT_MESSAGES), want_user=True)
    if request is None:
        request = _plain(attributes.get(OI_INPUT), attributes.get(OI_INPUT_MIME))
    answer = _last_message_text(attributes.get(OUTPUT_MESSAGES), want_user=False)
    if answer is None:
        answer = _plain(attributes.get(OI_OUTPUT), attributes.get(OI_OUTPUT_MIME))
    instructions = _instructions(attributes.get(SYSTEM_INSTRUCTIONS))
    return request, answer, instructions


def _structured(value: Any) -> Any:
    """A content attribute as Python: JSON strings decoded; None if absent or not JSON."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return None  # truncated or not JSON: not recorded in a form we can read
    return value


def _last_message_text(value: Any, *, want_user: bool) -> str | None:
    messages = _structured(value)
    if not isinstance(messages, list):
        return None
    for message in reversed(messages):
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        wanted = role == "user" if want_user else role not in NOT_ANSWER_ROLES
        if not wanted:
            continue
        text = _message_text(message)
        if text is not None:
            return text
    return None


def _message_text(message: Mapping[str, Any]) -> str | None:
    parts = message.get("parts")
    if isinstance(parts, list):
        return _parts_text(parts)
    content = message.get("content")  # the older {"role", "content": "<text>"} shape
    if isinstance(content, str) and content.strip():
        return content
    return None


def _parts_text(parts: Iterable[Any]) -> str | None:
    texts = [
        part["content"]
        for part in parts
        if isinstance(part, dict)
        and part.get("type") == "text"
        and isinstance(part.get("content"), str)
        and part["content"].strip()
    ]
    return "\n".join(texts) if texts else None


def _instructions(value: Any) -> str | None:
    if isinstance(value, str):
        if not value.strip():
            return None
        decoded = _structured(value)
        if not isinstance(decoded, str | list):
            return value  # plain text instructions, as recorded
        value = decoded
    if isinstance(value, str):
        return value if value.strip() else None
    if not isinstance(value, list):
        return None
    if all(isinstance(item, dict) and "role" in item for item in value):
        texts = [text for item in value if (text := _message_text(item)) is not None]
        return "\n".join(texts) if texts else None
    return _parts_text(value)


def _plain(value: Any, mime_type: Any) -> str | None:
    """An OpenInference input/output value: the text as recorded (a JSON string unwrapped)."""
    if value is None:
        return None
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    if not text.strip():
        return None
    if mime_type == "application/json" or text.lstrip().startswith('"'):
        try:
            decoded = json.loads(text)
        except ValueError:
            return text
        if isinstance(decoded, str):
            return decoded if decoded.strip() else None
    return text


def _text(value: Any) -> str:
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    return json.dumps(value, sort_keys=True)
