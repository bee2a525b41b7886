"""Spans made by the real OpenTelemetry SDK and encoded by the real OTLP encoder."""

from __future__ import annotations

import json
import uuid
from collections.abc import Container, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, Tracer

from spanguard.schemas.decision import AgentIdentity, Decision, Evidence, KillSignal, tool_signal

Attributes = Mapping[str, Any]


class AgentRecorder:
    """One agent run: a TracerProvider with an in-memory exporter and an open root span.

    Every span made through it belongs to the run's trace, under its `invoke_agent` root span,
    which ends (and is exported, last, as in real runs) on `finish()`.
    """

    def __init__(
        self, service: str = "support-bot", agent_name: str = "agent", **resource: Any
    ) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider(
            resource=Resource.create({"service.name": service, **resource})
        )
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.tracer: Tracer = self.provider.get_tracer("spanguard-tests")
        self.root = self.tracer.start_span(
            f"invoke_agent {agent_name}",
            attributes={"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": agent_name},
        )
        self._context = trace.set_span_in_context(self.root)

    def finish(self, **root_attributes: Any) -> ReadableSpan:
        self.root.set_attributes(root_attributes)
        self.root.end()
        return self.exporter.get_finished_spans()[-1]

    @property
    def trace_id(self) -> str:
        return format(self.root.get_span_context().trace_id, "032x")

    def tool(
        self,
        name: str,
        arguments: Any = None,
        *,
        call_id: str | None = None,
        result: str | None = None,
        attributes: Attributes | None = None,
        span_name: str | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        events: Sequence[tuple[str, Attributes]] = (),
    ) -> ReadableSpan:
        """An OTel GenAI execute_tool span (arguments JSON-encoded unless None, the result as
        `gen_ai.tool.call.result` when given)."""
        attrs: dict[str, Any] = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": name}
        if arguments is not None:
            attrs["gen_ai.tool.call.arguments"] = (
                arguments if isinstance(arguments, str) else json.dumps(arguments)
            )
        if call_id is not None:
            attrs["gen_ai.tool.call.id"] = call_id
        if result is not None:
            attrs["gen_ai.tool.call.result"] = result
        if attributes is not None:
            attrs = dict(attributes)
        return self.span(span_name or f"execute_tool {name}", attrs, kind=kind, events=events)

    def chat(self, input_tokens: int, output_tokens: int, **extra: Any) -> ReadableSpan:
        attrs = {
            "gen_ai.operation.name": "chat",
            "gen_ai.request.model": "gpt-4o",
            "gen_ai.usage.input_tokens": input_tokens,
            "gen_ai.usage.output_tokens": output_tokens,
            **extra,
        }
        return self.span("chat gpt-4o", attrs, kind=SpanKind.CLIENT)

    def span(
        self,
        name: str,
        attributes: Attributes,
        *,
        kind: SpanKind = SpanKind.INTERNAL,
        events: Sequence[tuple[str, Attributes]] = (),
        scope: str | None = None,
    ) -> ReadableSpan:
        """A span of the run; `scope` names the instrumentation scope (default: the tests')."""
        tracer = self.tracer if scope is None else self.provider.get_tracer(scope)
        with tracer.start_as_current_span(
            name, context=self._context, kind=kind, attributes=attributes
        ) as span:
            for event_name, event_attributes in events:
                span.add_event(event_name, event_attributes)
        return self.exporter.get_finished_spans()[-1]

    def finished(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())


def encode(spans: Sequence[ReadableSpan]) -> ExportTraceServiceRequest:
    """The real OTLP protobuf request the SDK's exporter would send."""
    return encode_spans(spans)


def one_request_per_span(spans: Sequence[ReadableSpan]) -> list[ExportTraceServiceRequest]:
    return [encode([span]) for span in spans]


def trace_id_of(span: ReadableSpan) -> str:
    return format(span.context.trace_id, "032x")


def span_id_of(span: ReadableSpan) -> str:
    return format(span.context.span_id, "016x")


def tool_span_ids_in(
    request: Mapping[str, Any], tools: Container[str], name_keys: Container[str]
) -> list[str]:
    """Span ids of the spans of an OTLP/JSON request that name one of `tools` (under one of
    `name_keys`), in the order they started."""
    spans = [
        span
        for resource in request["resourceSpans"]
        for scope in resource["scopeSpans"]
        for span in scope["spans"]
        if any(
            attribute["key"] in name_keys and attribute["value"].get("stringValue") in tools
            for attribute in span.get("attributes", ())
        )
    ]
    spans.sort(key=lambda span: int(span["startTimeUnixNano"]))
    return [span["spanId"] for span in spans]


def kill_signal(trace_id: str, kind: str = "kill", message: str | None = None) -> KillSignal:
    """A kill (or downgrade) signal for `trace_id`, as the worker would send it."""
    return KillSignal.from_decision(
        Decision(
            trace_id=trace_id,
            span_id="00f067aa0ba902b7",
            rule="tool_loop",
            action=kind,  # type: ignore[arg-type]
            reason="search_docs called 4x in last 4 steps",
            agent=AgentIdentity("support-bot"),
            # Now: a signal expires an hour after its detection.
            detected_at=datetime.now(UTC).isoformat(timespec="milliseconds"),
            evidence=Evidence(
                tool_name="search_docs", args_hash="1d79773f7dd21571", hits=4, window=10, steps=4
            ),
            system_message=message,
        )
    )


def _at(minutes: float = 0.0) -> str:
    return (datetime.now(UTC) + timedelta(minutes=minutes)).isoformat(timespec="milliseconds")


def tool_contain(
    tool: str = "search_docs",
    server: str = "",
    *,
    kind: str = "kill",
    minutes: float = 60,
    detected: float = 0.0,
) -> KillSignal:
    """A tool_failing contain of `tool` (a release: an operator's), `minutes` long, detected
    `detected` minutes from now."""
    return tool_signal(
        tool,
        server,
        "manual" if kind == "release" else "tool_failing",
        "the index answers 503 for every trace",
        uuid.uuid4().hex,
        _at(minutes),
        kind=kind,  # type: ignore[arg-type]
        detected_at=_at(detected),
        operator="oncall@example.com" if kind == "release" else None,
    )
