"""OTLP trace decoding: protobuf requests, OTLP/JSON lines, and attribute values.

Two wire forms reach spanguard:
- `ExportTraceServiceRequest` protobuf bytes, what the Collector's kafka exporter writes with
  `encoding: otlp_proto` (and what `.pb` / `.binpb` files hold);
- OTLP/JSON, one request a line, as the Collector's file exporter writes it. OTLP/JSON differs
  from protobuf's canonical JSON mapping: trace and span ids are lowercase hex, not base64
  (int64 values as strings and enums as integers are accepted by the protobuf parser as is).
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Sequence
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ScopeSpans, Span

from spanguard.errors import OtlpDecodeError
from spanguard.schemas.otlp_view import not_a_trace_request

__all__ = [
    "ExportTraceServiceRequest",
    "any_value_to_python",
    "decode_json_line",
    "decode_protobuf",
    "encode_json_line",
    "split_by_trace",
    "split_serialized",
]

_HEX_ID_FIELDS = ("traceId", "spanId", "parentSpanId")
_ENCLOSING_FIELDS = re.compile(r"(Failed to parse \w+ field: )+")


def decode_protobuf(data: bytes) -> ExportTraceServiceRequest:
    """Parse `ExportTraceServiceRequest` bytes; raise OtlpDecodeError on anything else."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise OtlpDecodeError(f"expected bytes, got {type(data).__name__}")
    try:
        request = ExportTraceServiceRequest.FromString(bytes(data))
    except DecodeError as exc:
        raise OtlpDecodeError(f"not an OTLP ExportTraceServiceRequest: {exc}") from None
    foreign = not_a_trace_request(bytes(data))  # a metrics request parses too
    if foreign is not None:
        raise OtlpDecodeError(f"not an OTLP ExportTraceServiceRequest: {foreign}")
    _check_ids(request)
    return request


def decode_json_line(line: str | bytes) -> ExportTraceServiceRequest:
    """Parse one OTLP/JSON request (hex ids) into the protobuf request."""
    try:
        document = json.loads(line)
    except RecursionError:
        raise OtlpDecodeError("not JSON: nested too deeply to decode") from None
    except ValueError as exc:
        raise OtlpDecodeError(f"not JSON: {exc}") from None
    if not isinstance(document, dict):
        raise OtlpDecodeError("an OTLP/JSON request is an object with resourceSpans")
    try:
        for resource_spans in document.get("resourceSpans") or ():
            for scope_spans in resource_spans.get("scopeSpans") or ():
                for span in scope_spans.get("spans") or ():
                    _hex_ids_to_base64(span)
                    for link in span.get("links") or ():
                        _hex_ids_to_base64(link)
        request = json_format.ParseDict(
            document, ExportTraceServiceRequest(), ignore_unknown_fields=True
        )
    except RecursionError:
        raise OtlpDecodeError("not an OTLP/JSON trace request: nested too deeply") from None
    except SystemError:
        # protobuf's C parser, handed a lone surrogate where it looks up a field name.
        raise OtlpDecodeError(
            "not an OTLP/JSON trace request: a string that is not valid Unicode"
        ) from None
    except (AttributeError, TypeError, ValueError, OverflowError, json_format.ParseError) as exc:
        # protobuf names every enclosing field ("Failed to parse resourceSpans field: ..."):
        # the cause is what is left, and its message ends with the path.
        cause = _ENCLOSING_FIELDS.sub("", str(exc))
        raise OtlpDecodeError(f"not an OTLP/JSON trace request: {cause}") from None
    _check_ids(request)
    return request


def encode_json_line(request: ExportTraceServiceRequest) -> str:
    """One request as an OTLP/JSON line (hex ids), as the Collector's file exporter writes it."""
    document = json_format.MessageToDict(request)
    for resource_spans in document.get("resourceSpans", ()):
        for scope_spans in resource_spans.get("scopeSpans", ()):
            for span in scope_spans.get("spans", ()):
                _base64_ids_to_hex(span)
                for link in span.get("links", ()):
                    _base64_ids_to_hex(link)
    return json.dumps(document, separators=(",", ":"))


def _base64_ids_to_hex(obj: dict[str, Any]) -> None:
    for field in _HEX_ID_FIELDS:
        if obj.get(field):
            obj[field] = base64.b64decode(obj[field]).hex()


def _hex_ids_to_base64(obj: dict[str, Any]) -> None:
    for field in _HEX_ID_FIELDS:
        value = obj.get(field)
        if not value:
            continue
        if not isinstance(value, str):
            raise ValueError(f"{field} must be a hex string, got {type(value).__name__}")
        try:
            raw = bytes.fromhex(value)
        except ValueError:
            raise ValueError(f"{field} {value!r} is not hex") from None
        obj[field] = base64.b64encode(raw).decode("ascii")


def _check_ids(request: ExportTraceServiceRequest) -> None:
    # A span without a 16-byte trace id cannot be keyed or killed: the request is malformed.
    for resource_spans in request.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                if len(span.trace_id) != 16:
                    raise OtlpDecodeError(
                        f"span {span.name!r} has a {len(span.trace_id)}-byte trace id"
                        " (OTLP requires 16 bytes)"
                    )
                if len(span.span_id) != 8:
                    raise OtlpDecodeError(
                        f"span {span.name!r} has a {len(span.span_id)}-byte span id"
                        " (OTLP requires 8 bytes)"
                    )


def any_value_to_python(value: AnyValue) -> Any:
    """An OTLP AnyValue as plain Python (kvlist -> dict, array -> list, bytes -> base64 str)."""
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "kvlist_value":
        return {kv.key: any_value_to_python(kv.value) for kv in value.kvlist_value.values}
    if kind == "array_value":
        return [any_value_to_python(item) for item in value.array_value.values]
    if kind == "bytes_value":
        return base64.b64encode(value.bytes_value).decode("ascii")
    return getattr(value, kind)


def split_by_trace(request: ExportTraceServiceRequest) -> dict[str, ExportTraceServiceRequest]:
    """Split a request into one request per trace id (hex), keeping resource and scope.

    The worker re-keys messages that hold several traces (or come without the trace-id key)
    so that each trace's state lives in exactly one partition.
    """
    parts: dict[str, ExportTraceServiceRequest] = {}
    for resource_spans in request.resource_spans:
        for scope_spans in resource_spans.scope_spans:
            by_trace: dict[str, list[Span]] = {}
            for span in scope_spans.spans:
                by_trace.setdefault(span.trace_id.hex(), []).append(span)
            for trace_id, spans in by_trace.items():
                part = parts.get(trace_id)
                if part is None:
                    part = parts[trace_id] = ExportTraceServiceRequest()
                target = part.resource_spans.add(
                    resource=resource_spans.resource, schema_url=resource_spans.schema_url
                )
                scope_part: ScopeSpans = target.scope_spans.add(
                    scope=scope_spans.scope, schema_url=scope_spans.schema_url
                )
                scope_part.spans.extend(spans)
    return parts


# -- splitting serialized requests by trace, on the wire ----------------------------------------
#
# The worker splits every Collector batch by trace (docs/design.md, "Spans per record"). Parsing
# the batch into messages, regrouping them and serializing each part costs more per span in
# CPython than the rules (docs/performance.md, "Figures behind the code"). The protobuf wire format lets the same parts be cut out of
# the bytes: a part is the request's own ResourceSpans, each holding the resource, the scope and
# that trace's spans as they were written, so nothing is decoded but the tags, the lengths and
# the trace ids. Anything it does not expect (a group, a field of the wrong wire type, a
# malformed length, a resource given twice) makes it give up, and the caller takes the protobuf
# path.

_WIRE_VARINT, _WIRE_I64, _WIRE_LEN, _WIRE_I32 = 0, 1, 2, 5
_RESOURCE_SPANS_TAG = b"\x0a"  # ExportTraceServiceRequest.resource_spans = 1
_SCOPE_SPANS_TAG = b"\x12"  # ResourceSpans.scope_spans = 2


class _Unexpected(Exception):
    """An encoding the wire splitter leaves to protobuf."""


def _varint(data: bytes, at: int) -> tuple[int, int]:
    """(value, next position) of the varint at `at`."""
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise _Unexpected("truncated varint")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _fields(data: bytes, start: int, end: int) -> list[tuple[int, int, int, int, int]]:
    """(field number, wire type, tag start, value start, value end) of each field in
    data[start:end]. A varint or fixed value spans its bytes, a length-delimited one its
    payload; data[tag start:value end] is the field as written."""
    fields = []
    at = start
    while at < end:
        tag_start = at
        key = data[at]
        if key < 0x80:
            at += 1
        else:
            key, at = _varint(data, at)
        number, wire = key >> 3, key & 7
        if wire == _WIRE_LEN:
            # Lengths under 16 kB (one or two bytes) read inline: a span's, a resource's.
            length = data[at]
            if length < 0x80:
                at += 1
            elif data[at + 1] < 0x80:
                length = (length & 0x7F) | (data[at + 1] << 7)
                at += 2
            else:
                length, at = _varint(data, at)
            fields.append((number, wire, tag_start, at, at + length))
            at += length
        elif wire == _WIRE_VARINT:
            _, after = _varint(data, at)
            fields.append((number, wire, tag_start, at, after))
            at = after
        elif wire == _WIRE_I64:
            fields.append((number, wire, tag_start, at, at + 8))
            at += 8
        elif wire == _WIRE_I32:
            fields.append((number, wire, tag_start, at, at + 4))
            at += 4
        else:
            raise _Unexpected(f"wire type {wire}")
    if at != end:
        raise _Unexpected("a field runs past its message")
    return fields


def _trace_id(data: bytes, start: int, end: int) -> bytes:
    """The trace id (field 1) of the span in data[start:end]; b"" if it has none."""
    # The common case: the trace id written first, 16 bytes long.
    if end - start >= 18 and data[start] == 0x0A and data[start + 1] == 16:
        return data[start + 2 : start + 18]
    found = b""
    for number, wire, _, value_start, value_end in _fields(data, start, end):
        if number == 1:
            if wire != _WIRE_LEN:
                raise _Unexpected("a trace id of the wrong wire type")
            found = data[value_start:value_end]  # the last one wins, as when protobuf parses
    return found


def _singular(fields: list[tuple[int, int, int, int, int]], data: bytes) -> dict[int, bytes]:
    """Fields 1 and 3 of a ResourceSpans or ScopeSpans (a message and a string), as written."""
    found: dict[int, bytes] = {}
    for number, wire, tag_start, _, value_end in fields:
        if number in (1, 3):
            if wire != _WIRE_LEN or number in found:
                raise _Unexpected(f"field {number} given twice, or not length-delimited")
            found[number] = data[tag_start:value_end]
    return found


def _messages(
    fields: list[tuple[int, int, int, int, int]], number: int, what: str
) -> list[tuple[int, int, int]]:
    """(tag start, value start, value end) of each field `number` of `fields`: embedded
    messages (`what` they are, for the error when one is not length-delimited)."""
    found = []
    for field_number, wire, tag_start, start, end in fields:
        if field_number == number:
            if wire != _WIRE_LEN:
                raise _Unexpected(f"{what} not length-delimited")
            found.append((tag_start, start, end))
    return found


def split_serialized(
    data: bytes, span_trace_ids: Sequence[bytes] | None = None
) -> dict[bytes, bytes] | None:
    """Split serialized ExportTraceServiceRequest bytes into one serialized request per trace
    id (raw bytes; b"" for spans without one), keeping each span's resource and scope, as
    `split_by_trace` does, without parsing the spans. None for an encoding it leaves to
    protobuf. The caller has checked that `data` parses as a trace request.

    `span_trace_ids`, each span's trace id as protobuf parsed it, in order: a span whose id
    read on the wire differs (a hostile span that writes its trace id twice: protobuf keeps
    the last) leaves the whole request to protobuf, so no span is ever sent to a partition
    its parsed trace id does not name."""
    try:
        return _split_serialized(data, span_trace_ids)
    except (_Unexpected, IndexError):
        return None


def _split_serialized(data: bytes, expected: Sequence[bytes] | None) -> dict[bytes, bytes]:
    parts: dict[bytes, list[bytes]] = {}
    spans_read = 0
    # A trace request's other fields: split_by_trace drops them too.
    for _, start, end in _messages(_fields(data, 0, len(data)), 1, "resource_spans"):
        fields = _fields(data, start, end)
        resource_fields = _singular(fields, data)
        resource = resource_fields.get(1, b"")
        schema_url = resource_fields.get(3, b"")
        for _, scope_start, scope_end in _messages(fields, 2, "scope_spans"):
            scope_fields = _fields(data, scope_start, scope_end)
            by_trace: dict[bytes, list[bytes]] = {}
            for tag_start, span_start, span_end in _messages(scope_fields, 2, "a span"):
                trace_id = _trace_id(data, span_start, span_end)
                if expected is not None:
                    if spans_read >= len(expected) or expected[spans_read] != trace_id:
                        raise _Unexpected("a span's trace id differs from protobuf's")
                    spans_read += 1
                # The span as written, its tag and length included.
                by_trace.setdefault(trace_id, []).append(data[tag_start:span_end])
            singular = _singular(scope_fields, data)
            scope, scope_url = singular.get(1, b""), singular.get(3, b"")
            for trace_id, spans in by_trace.items():
                scope_spans = b"".join((scope, *spans, scope_url))
                resource_spans = b"".join(
                    (
                        resource,
                        _SCOPE_SPANS_TAG,
                        _encode_varint(len(scope_spans)),
                        scope_spans,
                        schema_url,
                    )
                )
                parts.setdefault(trace_id, []).append(
                    _RESOURCE_SPANS_TAG + _encode_varint(len(resource_spans)) + resource_spans
                )
    if expected is not None and spans_read != len(expected):
        raise _Unexpected("not the spans protobuf parsed")
    return {trace_id: b"".join(pieces) for trace_id, pieces in parts.items()}
