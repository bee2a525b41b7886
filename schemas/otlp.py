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
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import ScopeSpans

from spanguard.errors import OtlpDecodeError
from spanguard.schemas.otlp_view import not_a_trace_request

__all__ = [
    "ExportTraceServiceRequest",
    "any_value_to_python",
    "decode_json_line",
    "decode_protobuf",
    "encode_json_line",
    "split_by_trace",
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
            by_trace: dict[str, list] = {}
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
