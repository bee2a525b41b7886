"""Splitting a serialized trace request by trace on the wire gives the parts protobuf gives.

The worker splits every Collector batch with `split_serialized`; `split_by_trace` (parse,
regroup, serialize) is the reference, and the path taken for any encoding the wire splitter
does not expect.
"""

from __future__ import annotations

import random

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

from bench.corpus import build_corpus
from spanguard.detection.guard import Guard
from spanguard.detection.pipeline import SpanPipeline
from spanguard.schemas.otlp import split_by_trace, split_serialized

TRACE_A, TRACE_B = bytes(range(16)), bytes(range(16, 32))


def span(trace_id: bytes, number: int, **fields) -> Span:
    return Span(
        trace_id=trace_id,
        span_id=number.to_bytes(8, "big"),
        name=f"span {number}",
        end_time_unix_nano=1_700_000_000_000_000_000 + number,
        **fields,
    )


def request(*resource_spans: ResourceSpans) -> bytes:
    return ExportTraceServiceRequest(resource_spans=resource_spans).SerializeToString()


def service(name: str, *scopes: ScopeSpans, schema_url: str = "") -> ResourceSpans:
    attributes = [KeyValue(key="service.name", value=AnyValue(string_value=name))]
    return ResourceSpans(
        resource=Resource(attributes=attributes), scope_spans=scopes, schema_url=schema_url
    )


def scope(name: str, *spans: Span, schema_url: str = "") -> ScopeSpans:
    return ScopeSpans(scope=InstrumentationScope(name=name), spans=spans, schema_url=schema_url)


def present(part: ExportTraceServiceRequest) -> ExportTraceServiceRequest:
    """`part` with every resource and scope present: split_by_trace sets them, empty or not,
    the wire split keeps them as written (absent when the request had none), and to a reader
    an absent and an empty resource are the same."""
    for resource_spans in part.resource_spans:
        resource_spans.resource.SetInParent()
        for scope_spans in resource_spans.scope_spans:
            scope_spans.scope.SetInParent()
    return part


def assert_same_parts(data: bytes) -> dict[bytes, bytes]:
    """The wire split's parts parse to the messages split_by_trace makes, in order."""
    expected = split_by_trace(ExportTraceServiceRequest.FromString(data))
    parts = split_serialized(data)
    assert parts is not None
    assert [trace_id.hex() for trace_id in parts] == list(expected)
    for trace_id, part in parts.items():
        assert present(ExportTraceServiceRequest.FromString(part)) == expected[trace_id.hex()]
    return parts


def test_a_collector_batch_splits_as_protobuf_splits_it() -> None:
    corpus = build_corpus(6_000, 300, batch_spans=600, seed=5)
    for data in corpus.requests:
        assert_same_parts(data)


def test_a_batch_of_one_trace_exports_splits_as_protobuf_splits_it() -> None:
    # The Collector's batch of SDK exports: a ResourceSpans per export, each of one trace.
    corpus = build_corpus(3_000, 300, per_trace=True, message_spans=(1, 3), seed=5)
    for at in range(0, len(corpus.requests), 300):
        assert_same_parts(b"".join(corpus.requests[at : at + 300]))


def test_resources_scopes_and_schema_urls_stay_with_each_traces_spans() -> None:
    data = request(
        service(
            "support-bot",
            scope("genai", span(TRACE_A, 1), span(TRACE_B, 2), span(TRACE_A, 3)),
            scope("http", span(TRACE_B, 4), schema_url="https://opentelemetry.io/schemas/1.2"),
            schema_url="https://opentelemetry.io/schemas/1.1",
        ),
        service("research-bot", scope("genai", span(TRACE_A, 5))),
    )
    parts = assert_same_parts(data)
    first = ExportTraceServiceRequest.FromString(parts[TRACE_A])
    assert [rs.resource.attributes[0].value.string_value for rs in first.resource_spans] == [
        "support-bot",
        "research-bot",
    ]
    assert [s.name for rs in first.resource_spans for ss in rs.scope_spans for s in ss.spans] == [
        "span 1",
        "span 3",
        "span 5",
    ]
    second = ExportTraceServiceRequest.FromString(parts[TRACE_B])
    assert [ss.schema_url for ss in second.resource_spans[1].scope_spans] == [
        "https://opentelemetry.io/schemas/1.2"
    ]


def test_a_trace_id_not_written_first_or_missing_or_short_is_still_found() -> None:
    # Field order on the wire is the writer's choice: the trace id after the span id here.
    late = span(b"", 1).SerializeToString() + b"\x0a\x10" + TRACE_A
    spans = b"".join(b"\x12" + bytes([len(s)]) + s for s in (late,))
    missing = span(b"", 2).SerializeToString()
    short = span(b"\x01\x02", 3).SerializeToString()
    for extra in (missing, short):
        spans += b"\x12" + bytes([len(extra)]) + extra
    scope_spans = b"\x12" + bytes([len(spans)]) + spans
    data = b"\x0a" + bytes([len(scope_spans)]) + scope_spans
    parts = assert_same_parts(data)
    assert set(parts) == {TRACE_A, b"", b"\x01\x02"}


def test_an_encoding_it_does_not_expect_is_left_to_protobuf() -> None:
    data = request(service("support-bot", scope("genai", span(TRACE_A, 1))))
    # resource_spans as a varint, a group, a length running past the end
    for odd in (b"\x08\x01", b"\x0b\x0c", b"\x0a\x7f\x01", b"\x0a\x80", b"\x0a\x80\x80"):
        assert split_serialized(data + odd) is None
    # a resource given twice (protobuf merges the two)
    twice = ResourceSpans(resource=Resource()).SerializeToString()
    resource_spans = twice + b"\x0a\x00"
    assert split_serialized(b"\x0a" + bytes([len(resource_spans)]) + resource_spans) is None


def test_the_pipeline_repartitions_the_same_parts_either_way() -> None:
    corpus = build_corpus(3_000, 200, batch_spans=500, seed=6)
    pipeline = SpanPipeline(Guard())
    for data in corpus.requests:
        outcome = pipeline.handle(None, data)
        expected = split_by_trace(ExportTraceServiceRequest.FromString(data))
        assert [trace_id for trace_id, _ in outcome.repartition] == list(expected)
        for trace_id, part in outcome.repartition:
            assert ExportTraceServiceRequest.FromString(part) == expected[trace_id]


def test_mangled_bytes_that_still_parse_split_as_protobuf_splits_them_or_fall_back() -> None:
    """Hostile input: bytes flipped, cut, duplicated or inserted at random. Whatever still
    parses as a trace request, the wire split (given each span's trace id as protobuf parsed
    it, as the pipeline gives it) yields protobuf's parts or leaves it to protobuf (None); it
    never raises nor gives different parts."""
    rng = random.Random(29)
    corpus = build_corpus(600, 30, batch_spans=60, seed=7)
    parsed = fell_back = 0
    for _ in range(3_000):
        data = bytearray(rng.choice(corpus.requests))
        for _ in range(rng.randint(1, 4)):
            if not data:
                break
            at = rng.randrange(len(data))
            how = rng.randrange(4)
            if how == 0:
                data[at] = rng.randrange(256)
            elif how == 1:
                del data[at : at + rng.randint(1, 8)]
            elif how == 2:
                data[at:at] = data[at : at + rng.randint(1, 16)]
            else:
                data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
        try:
            request_ = ExportTraceServiceRequest.FromString(bytes(data))
        except Exception:  # any parse failure of the mangled bytes  # noqa: BLE001
            continue  # the pipeline dead-letters it before any split
        parsed += 1
        span_ids = [
            span.trace_id
            for resource_spans in request_.resource_spans
            for scope_spans in resource_spans.scope_spans
            for span in scope_spans.spans
        ]
        parts = split_serialized(bytes(data), span_ids)
        if parts is None:
            fell_back += 1
            continue
        expected = split_by_trace(request_)
        assert [trace_id.hex() for trace_id in parts] == list(expected)
        for trace_id, part in parts.items():
            assert present(ExportTraceServiceRequest.FromString(part)) == expected[trace_id.hex()]
    assert parsed > 100, "the mangling should leave many requests that still parse"
    assert fell_back < parsed


def length_delimited(number: int, payload: bytes) -> bytes:
    assert len(payload) < 128
    return bytes([number << 3 | 2, len(payload)]) + payload


def test_a_span_that_writes_its_trace_id_twice_goes_where_protobuf_reads_it() -> None:
    """Protobuf keeps the last of a field written twice. Read on the wire alone, the span's
    first trace id would send it to a partition whose worker parses another trace id, splits
    it again and sends it back, for ever. Checked against protobuf's reading, the request is
    left to protobuf and the span goes where its parsed trace id lives."""
    twice = span(TRACE_A, 1).SerializeToString() + length_delimited(1, TRACE_B)
    plain = span(TRACE_A, 2).SerializeToString()
    scope_spans = length_delimited(2, twice) + length_delimited(2, plain)
    hostile = length_delimited(1, length_delimited(2, scope_spans))
    parsed = ExportTraceServiceRequest.FromString(hostile)
    assert [s.trace_id for s in parsed.resource_spans[0].scope_spans[0].spans] == [
        TRACE_B,
        TRACE_A,
    ]
    assert list(split_serialized(hostile) or {}) == [TRACE_A]  # the wire's first reading
    assert split_serialized(hostile, [TRACE_B, TRACE_A]) is None

    outcome = SpanPipeline(Guard()).handle(None, hostile)
    parts = dict(outcome.repartition)
    assert list(parts) == [TRACE_B.hex(), TRACE_A.hex()]
    (b_span,) = (
        ExportTraceServiceRequest.FromString(parts[TRACE_B.hex()])
        .resource_spans[0]
        .scope_spans[0]
        .spans
    )
    assert (b_span.trace_id, b_span.name) == (TRACE_B, "span 1")
