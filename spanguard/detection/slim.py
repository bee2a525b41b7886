"""A trace's part cut down to what the rules read, for a part too large to be one Kafka record.

A message of the input topic may be compressed on the wire and several megabytes once read;
the part of one trace the worker re-sends to the repartition topic must fit a record (the
topic's max.message.bytes, 1 MiB by default). Cut down, it holds only the span ids, names and
the attributes the guard reads, with tool names, call ids and agent names shortened the way
the adapters shorten them (spanguard/detection/conventions/values.py `bounded_text`, which leaves its own output as
it is): the guard decides the slim part exactly as it would the whole one.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import KeyValue

from spanguard.detection.conventions.keys import (
    AGENT_NAME,
    CALL_ID_KEYS,
    SERVICE_NAME,
    STRANDS_TOOL_EVENT,
    TOOL_NAME_KEYS,
)
from spanguard.detection.conventions.values import bounded_text

if TYPE_CHECKING:
    from google.protobuf.internal.containers import RepeatedCompositeFieldContainer

__all__ = ["slim_part"]

# Read by the rules only through bounded_text: shortening them changes nothing they decide.
_BOUNDED_KEYS = frozenset({*TOOL_NAME_KEYS, *CALL_ID_KEYS, AGENT_NAME, SERVICE_NAME})
_EVENT_ARGUMENTS = "gen_ai.tool.call.arguments"


def _copy_kept(
    source: Iterable[KeyValue],
    target: RepeatedCompositeFieldContainer[KeyValue],
    keep: frozenset[str],
) -> None:
    for kv in source:
        if kv.key not in keep:
            continue
        copy: KeyValue = target.add()
        copy.CopyFrom(kv)
        if kv.key in _BOUNDED_KEYS and kv.value.WhichOneof("value") == "string_value":
            copy.value.string_value = bounded_text(kv.value.string_value)


def slim_part(part: ExportTraceServiceRequest, wanted: frozenset[str]) -> ExportTraceServiceRequest:
    """`part` with only the span fields and the attributes in `wanted` (the guard's keys)."""
    slim = ExportTraceServiceRequest()
    resource_keys = wanted | {SERVICE_NAME, AGENT_NAME}
    for resource_spans in part.resource_spans:
        target = slim.resource_spans.add()
        _copy_kept(resource_spans.resource.attributes, target.resource.attributes, resource_keys)
        for scope_spans in resource_spans.scope_spans:
            scope = target.scope_spans.add()
            for span in scope_spans.spans:
                copy = scope.spans.add(
                    trace_id=span.trace_id,
                    span_id=span.span_id,
                    parent_span_id=span.parent_span_id,
                    # Only its first words are read ("execute_tool ...", "Tool: ...").
                    name=bounded_text(span.name),
                    kind=span.kind,
                    start_time_unix_nano=span.start_time_unix_nano,
                    end_time_unix_nano=span.end_time_unix_nano,
                )
                _copy_kept(span.attributes, copy.attributes, wanted)
                for event in span.events:  # tool arguments some instrumentations log as events
                    keys = frozenset({_EVENT_ARGUMENTS, "content"}) if (
                        event.name == STRANDS_TOOL_EVENT
                    ) else frozenset({_EVENT_ARGUMENTS})  # fmt: skip
                    if any(kv.key in keys for kv in event.attributes):
                        kept = copy.events.add(name=event.name, time_unix_nano=event.time_unix_nano)
                        _copy_kept(event.attributes, kept.attributes, keys)
    return slim
