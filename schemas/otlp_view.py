"""A lean read-only view of OTLP trace requests, for the detection core's hot path.

The core needs a handful of attributes out of every span. On the wire, OTLP's
`repeated KeyValue attributes` is encoded exactly like a protobuf `map<string, AnyValue>`
(entries with key = 1, value = 2), so declaring the attributes as a map makes the C parser
build a hash table: the core then looks up the keys it wants instead of walking every
attribute in Python. Fields the core never reads are left unparsed. The messages below are
wire-compatible subsets of opentelemetry-proto's (same field numbers, the same AnyValue and
Span.Event types), so the very bytes the Collector writes parse as a view.
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

# Importing these registers the real OTLP types our view refers to.
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1 import common_pb2  # noqa: F401
from opentelemetry.proto.trace.v1 import trace_pb2  # noqa: F401

__all__ = ["RequestView", "parse_view", "view_of"]

_PACKAGE = "spanguard.otlpview"
_ANY_VALUE = ".opentelemetry.proto.common.v1.AnyValue"
_EVENT = ".opentelemetry.proto.trace.v1.Span.Event"
_F = descriptor_pb2.FieldDescriptorProto


def _build() -> Any:
    file = descriptor_pb2.FileDescriptorProto(
        name="spanguard/otlp_view.proto",
        package=_PACKAGE,
        syntax="proto3",
        dependency=[
            "opentelemetry/proto/common/v1/common.proto",
            "opentelemetry/proto/trace/v1/trace.proto",
        ],
    )

    def message(name: str, fields: list[tuple[str, int, int, bool, str]], maps=()) -> None:
        proto = file.message_type.add(name=name)
        for field_name, number, kind, repeated, type_name in fields:
            label = _F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL
            field = proto.field.add(name=field_name, number=number, type=kind, label=label)
            if type_name:
                field.type_name = type_name
        for field_name, number in maps:
            entry = proto.nested_type.add(name="AttributesEntry")
            entry.options.map_entry = True
            entry.field.add(name="key", number=1, type=_F.TYPE_STRING, label=_F.LABEL_OPTIONAL)
            entry.field.add(
                name="value",
                number=2,
                type=_F.TYPE_MESSAGE,
                label=_F.LABEL_OPTIONAL,
                type_name=_ANY_VALUE,
            )
            proto.field.add(
                name=field_name,
                number=number,
                type=_F.TYPE_MESSAGE,
                label=_F.LABEL_REPEATED,
                type_name=f".{_PACKAGE}.{name}.AttributesEntry",
            )

    # Field numbers as in opentelemetry/proto/trace/v1/trace.proto and resource.proto.
    message(
        "Span",
        [
            ("trace_id", 1, _F.TYPE_BYTES, False, ""),
            ("span_id", 2, _F.TYPE_BYTES, False, ""),
            ("parent_span_id", 4, _F.TYPE_BYTES, False, ""),
            ("name", 5, _F.TYPE_STRING, False, ""),
            # When the call ended: the start of the detection-latency clock.
            ("end_time_unix_nano", 8, _F.TYPE_FIXED64, False, ""),
            ("events", 11, _F.TYPE_MESSAGE, True, _EVENT),
        ],
        maps=[("attributes", 9)],
    )
    message("Resource", [], maps=[("attributes", 1)])
    message("ScopeSpans", [("spans", 2, _F.TYPE_MESSAGE, True, f".{_PACKAGE}.Span")])
    message(
        "ResourceSpans",
        [
            ("resource", 1, _F.TYPE_MESSAGE, False, f".{_PACKAGE}.Resource"),
            ("scope_spans", 2, _F.TYPE_MESSAGE, True, f".{_PACKAGE}.ScopeSpans"),
        ],
    )
    message("Request", [("resource_spans", 1, _F.TYPE_MESSAGE, True, f".{_PACKAGE}.ResourceSpans")])
    pool = descriptor_pool.Default()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PACKAGE}.Request"))


RequestView = _build()


def parse_view(data: bytes) -> Any:
    """Parse ExportTraceServiceRequest bytes as a view; google.protobuf DecodeError if not."""
    return RequestView.FromString(data)


def view_of(request: ExportTraceServiceRequest) -> Any:
    return RequestView.FromString(request.SerializeToString())
