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

from collections.abc import Sequence
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError

# Importing these registers the real OTLP types our view refers to.
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1 import common_pb2  # noqa: F401
from opentelemetry.proto.trace.v1 import trace_pb2  # noqa: F401

from spanguard.errors import OtlpDecodeError

__all__ = ["RequestView", "not_a_trace_request", "parse_view", "view_of"]

_PACKAGE = "spanguard.otlpview"
_ANY_VALUE = ".opentelemetry.proto.common.v1.AnyValue"
_EVENT = ".opentelemetry.proto.trace.v1.Span.Event"
# A root span's links to another trace (VoltAgent's agent runs link their caller's span): a
# run whose caller's trace was linked, not carried (read on an agent's root span only).
_LINK = ".opentelemetry.proto.trace.v1.Span.Link"
_SCOPE = ".opentelemetry.proto.common.v1.InstrumentationScope"
_STATUS = ".opentelemetry.proto.trace.v1.Status"
_F = descriptor_pb2.FieldDescriptorProto
_DEPENDENCIES = [
    "opentelemetry/proto/common/v1/common.proto",
    "opentelemetry/proto/trace/v1/trace.proto",
]


def _build() -> Any:
    file = descriptor_pb2.FileDescriptorProto(
        name="spanguard/otlp_view.proto",
        package=_PACKAGE,
        syntax="proto3",
        dependency=_DEPENDENCIES,
    )

    def message(
        name: str,
        fields: Sequence[tuple[str, int, int, bool, str]],
        maps: Sequence[tuple[str, int]] = (),
    ) -> None:
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
            # When the call started: a call id seen again is a partial span of one call only
            # while the two overlap in time.
            ("start_time_unix_nano", 7, _F.TYPE_FIXED64, False, ""),
            # When the call ended: the start of the detection-latency clock.
            ("end_time_unix_nano", 8, _F.TYPE_FIXED64, False, ""),
            ("events", 11, _F.TYPE_MESSAGE, True, _EVENT),
            ("links", 13, _F.TYPE_MESSAGE, True, _LINK),
            # A failed call (code ERROR) is one result, whatever its error text.
            ("status", 15, _F.TYPE_MESSAGE, False, _STATUS),
        ],
        maps=[("attributes", 9)],
    )
    message("Resource", [], maps=[("attributes", 1)])
    # The scope's name says which instrumentation made the spans (for the capture hints).
    message(
        "ScopeSpans",
        [
            ("scope", 1, _F.TYPE_MESSAGE, False, _SCOPE),
            ("spans", 2, _F.TYPE_MESSAGE, True, f".{_PACKAGE}.Span"),
        ],
    )
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
    """Parse ExportTraceServiceRequest bytes as a view; OtlpDecodeError saying why if not.

    The one decode of the worker's hot path: the pipeline parses a message here and hands
    the view on to the guard (`Guard.process_view`); `Guard.process` parses bytes here too.
    """
    try:
        return RequestView.FromString(data)
    except DecodeError as exc:
        raise OtlpDecodeError(f"not an OTLP ExportTraceServiceRequest: {exc}") from None


def view_of(request: ExportTraceServiceRequest) -> Any:
    return RequestView.FromString(request.SerializeToString())


# -- what makes bytes a traces request ----------------------------------------------------------
#
# Protobuf parses any message's bytes as any other message when their field numbers line up:
# an ExportMetricsServiceRequest (resource_metrics = 1, scope_metrics = 2, metrics = 2, a
# metric's name = 1) parses as an ExportTraceServiceRequest whose "spans" have the metric's
# name as trace id, a 16-byte name making a valid-looking one. A field whose number a trace
# request declares but whose wire type differs is kept aside as unknown, with no error. The
# probe below checks, in one C parse and one C IsInitialized() walk, the field numbers a
# trace request's spans carry:
# - end_time_unix_nano (8, fixed64), which every exported span has (OTLP: semantically
#   required) and no metric (8 is unused) nor log record (8 is a fixed32) has; one span
#   without it among spans with it is a bad span, skipped alone, not a foreign request;
# - no length-delimited value where a span declares a number (kind 6, start time 7, dropped
#   counts 10, 12, 14, flags 16): a metric's sum (7), exponential histogram (10) and metadata
#   (12), a log record's attributes (6).
# Numbers a span does not declare are left alone: a newer OTLP may add fields.

_PROBE = "spanguard.otlpprobe"
# Span fields of a scalar type, by number: a length-delimited value there is not a span's.
_SCALAR_SPAN_FIELDS = {
    6: "kind (varint)",
    7: "start_time_unix_nano (fixed64)",
    10: "dropped_attributes_count (varint)",
    12: "dropped_events_count (varint)",
    14: "dropped_links_count (varint)",
    16: "flags (fixed32)",
}


def _build_probe() -> Any:
    file = descriptor_pb2.FileDescriptorProto(
        name="spanguard/otlp_probe.proto", package=_PROBE, syntax="proto2"
    )

    def message(name: str, fields: Sequence[tuple[str, int, int, int, str]]) -> None:
        proto = file.message_type.add(name=name)
        for field_name, number, kind, label, type_name in fields:
            field = proto.field.add(name=field_name, number=number, type=kind, label=label)
            if type_name:
                field.type_name = f".{_PROBE}.{type_name}"

    optional, repeated, required = _F.LABEL_OPTIONAL, _F.LABEL_REPEATED, _F.LABEL_REQUIRED
    # A message that is never complete: its field is required and nothing sends it.
    message("Poison", [("never", 536_870_911, _F.TYPE_BOOL, required, "")])
    message(
        "Span",
        [("end_time_unix_nano", 8, _F.TYPE_FIXED64, required, "")]
        + [(f"field_{n}", n, _F.TYPE_MESSAGE, optional, "Poison") for n in _SCALAR_SPAN_FIELDS],
    )
    message("ScopeSpans", [("spans", 2, _F.TYPE_MESSAGE, repeated, "Span")])
    message("ResourceSpans", [("scope_spans", 2, _F.TYPE_MESSAGE, repeated, "ScopeSpans")])
    message("Request", [("resource_spans", 1, _F.TYPE_MESSAGE, repeated, "ResourceSpans")])
    pool = descriptor_pool.Default()
    pool.Add(file)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PROBE}.Request"))


_Probe = _build_probe()


def not_a_trace_request(data: bytes) -> str | None:
    """Why `data`, which parsed as a trace request, is not one; None when it is (see above)."""
    try:
        probe = _Probe.FromString(data)
    except DecodeError:  # a length-delimited value where a span has a scalar, and not a message
        return "a span field carries a value of the wrong wire type"
    if probe.IsInitialized():
        return None
    # The rare case: say what was wrong. A span without an end time among spans with one is a
    # bad span of a trace request (the guard skips what it cannot read), not a foreign message:
    # it must not cost the other spans of the batch.
    ended = False
    for resource_spans in probe.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                for number, declared in _SCALAR_SPAN_FIELDS.items():
                    if span.HasField(f"field_{number}"):
                        return (
                            f"span field {number} is length-delimited, where a trace request"
                            f" has {declared} (a metrics or logs request?)"
                        )
                ended = ended or span.HasField("end_time_unix_nano")
    if not ended:
        return (
            "no span has an end_time_unix_nano (field 8, fixed64), which every exported span"
            " carries (a metrics or logs request?)"
        )
    return None
