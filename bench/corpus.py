"""A synthetic fleet's spans, as real OTLP requests, for the benchmarks.

1,000 concurrent traces, about 30% tool spans (GenAI execute_tool with JSON arguments), the
rest chat spans with usage and other spans (HTTP clients, retrievers) with the attribute counts
real instrumentations produce. One trace in twenty loops (`loop_every`). Requests interleave the traces the
way a Collector batch does; `per_trace=True` gives one request per trace and batch, as the
kafka exporter writes with partition_traces_by_id. `message_spans=(1, 3)` (with `per_trace`)
makes each request 1 to 3 consecutive spans of one trace, uniformly: what the Collector's batch
processor hands the exporter for interactive agents, whose spans end a few at a time.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass, field

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span

TOOLS = ("search_web", "fetch_url", "read_file", "search_docs", "run_sql", "summarize")


@dataclass
class Corpus:
    requests: list[bytes]
    spans: int
    tool_calls: list[tuple[str, str, dict]] = field(default_factory=list)  # trace, tool, args
    looping_traces: set[str] = field(default_factory=set)


def _kv(key: str, value: object) -> KeyValue:
    if isinstance(value, bool):
        return KeyValue(key=key, value=AnyValue(bool_value=value))
    if isinstance(value, int):
        return KeyValue(key=key, value=AnyValue(int_value=value))
    if isinstance(value, float):
        return KeyValue(key=key, value=AnyValue(double_value=value))
    return KeyValue(key=key, value=AnyValue(string_value=str(value)))


def _resource(service: str, index: int) -> Resource:
    return Resource(
        attributes=[
            _kv("service.name", service),
            _kv("service.version", "1.4.2"),
            _kv("service.instance.id", f"pod-{index}"),
            _kv("deployment.environment", "prod"),
            _kv("telemetry.sdk.language", "python"),
            _kv("telemetry.sdk.name", "opentelemetry"),
            _kv("telemetry.sdk.version", "1.45.2"),
        ]
    )


def _span(rng: random.Random, trace_id: bytes, parent: bytes, kind: str, step: int, loop: bool):
    span = Span(
        trace_id=trace_id,
        span_id=rng.randbytes(8),
        parent_span_id=parent,
        start_time_unix_nano=1_700_000_000_000_000_000 + step * 1_000_000,
        end_time_unix_nano=1_700_000_000_000_000_000 + step * 1_000_000 + 500_000,
    )
    args = None
    if kind == "tool":
        tool = "search_docs" if loop else rng.choice(TOOLS)
        args = {"query": "refund policy"} if loop else {"query": f"q-{rng.randrange(10**9)}"}
        args["request_id"] = f"req-{rng.randrange(10**9)}"
        span.name = f"execute_tool {tool}"
        span.kind = Span.SPAN_KIND_INTERNAL
        span.attributes.extend(
            [
                _kv("gen_ai.operation.name", "execute_tool"),
                _kv("gen_ai.tool.name", tool),
                _kv("gen_ai.tool.type", "function"),
                _kv("gen_ai.tool.call.id", f"call_{rng.randrange(10**12)}"),
                _kv("gen_ai.tool.call.arguments", json.dumps(args)),
                _kv("gen_ai.provider.name", "openai"),
            ]
        )
    elif kind == "chat":
        span.name = "chat gpt-4o"
        span.kind = Span.SPAN_KIND_CLIENT
        span.attributes.extend(
            [
                _kv("gen_ai.operation.name", "chat"),
                _kv("gen_ai.provider.name", "openai"),
                _kv("gen_ai.request.model", "gpt-4o"),
                _kv("gen_ai.response.model", "gpt-4o-2024-08-06"),
                _kv("gen_ai.request.temperature", 0.2),
                _kv("gen_ai.request.max_tokens", 1024),
                _kv("gen_ai.response.id", f"chatcmpl-{rng.randrange(10**12)}"),
                _kv("gen_ai.response.finish_reasons", "tool_calls"),
                _kv("gen_ai.usage.input_tokens", rng.randrange(500, 4000)),
                _kv("gen_ai.usage.output_tokens", rng.randrange(20, 400)),
                _kv("server.address", "api.openai.com"),
                _kv("server.port", 443),
            ]
        )
    else:
        span.name = "POST"
        span.kind = Span.SPAN_KIND_CLIENT
        span.attributes.extend(
            [
                _kv("http.request.method", "POST"),
                _kv("url.full", f"https://internal.example/api/v1/items/{rng.randrange(10**6)}"),
                _kv("server.address", "internal.example"),
                _kv("server.port", 443),
                _kv("http.response.status_code", 200),
                _kv("network.protocol.version", "1.1"),
                _kv("user_agent.original", "python-httpx/0.28.1"),
            ]
        )
    return span, args


def corpus_parser(description: str | None) -> argparse.ArgumentParser:
    """The command line of a benchmark over this corpus: its size (--spans over --traces) and
    how many runs to take the best or median of; the caller adds its own options."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--spans", type=int, default=100_000)
    parser.add_argument("--traces", type=int, default=1_000)
    parser.add_argument("--runs", type=int, default=5)
    return parser


def build_corpus(
    total_spans: int = 100_000,
    traces: int = 1_000,
    *,
    pods: int = 60,
    batch_spans: int = 128,
    per_trace: bool = False,
    message_spans: tuple[int, int] | None = None,
    seed: int = 7,
    loop_every: int = 20,
) -> Corpus:
    """`loop_every`: one trace in that many loops (a latency run wants many kills)."""
    if message_spans is not None and not per_trace:
        raise ValueError("message_spans needs per_trace=True")
    rng = random.Random(seed)
    trace_ids = [rng.randbytes(16) for _ in range(traces)]
    roots = [rng.randbytes(8) for _ in range(traces)]
    # A trace runs on pod (index % pods); pods run one of three agent services.
    services = [("research-assistant", "support-bot", "ticket-bot")[i % 3] for i in range(pods)]
    looping = {i for i in range(traces) if i % loop_every == 0}
    steps = [0] * traces
    scope = InstrumentationScope(name="opentelemetry.instrumentation.genai", version="0.5b0")
    corpus = Corpus(requests=[], spans=0)
    corpus.looping_traces = {trace_ids[i].hex() for i in looping}

    pending: list[tuple[int, Span]] = []

    def flush() -> None:
        # One ResourceSpans per service instance (pod), as the Collector's batch groups them;
        # with per_trace, one request per trace.
        groups: dict[int, list[Span]] = {}
        for index, span in pending:
            groups.setdefault(index if per_trace else index % pods, []).append(span)
        parts = {
            key: ResourceSpans(
                resource=_resource(services[key % len(services)], key % pods),
                scope_spans=[ScopeSpans(scope=scope, spans=spans)],
            )
            for key, spans in groups.items()
        }
        batches = [[part] for part in parts.values()] if per_trace else [list(parts.values())]
        for batch in batches:
            corpus.requests.append(
                ExportTraceServiceRequest(resource_spans=batch).SerializeToString()
            )
        pending.clear()

    kinds = ("tool", "chat", "chat", "other", "other")  # ~30% tool after the mix below
    index, left = 0, 0  # with message_spans: the trace of the request being built, spans left
    for _ in range(total_spans):
        if message_spans is None:
            index = rng.randrange(traces)
        elif left == 0:
            index, left = rng.randrange(traces), rng.randint(*message_spans)
        roll = rng.random()
        kind = "tool" if roll < 0.30 else kinds[1 + int((roll - 0.30) / 0.70 * 4)]
        loop = kind == "tool" and index in looping and rng.random() < 0.7
        span, args = _span(rng, trace_ids[index], roots[index], kind, steps[index], loop)
        steps[index] += 1
        if args is not None:
            corpus.tool_calls.append(
                (trace_ids[index].hex(), span.attributes[1].value.string_value, args)
            )
        pending.append((index, span))
        corpus.spans += 1
        if message_spans is not None:
            left -= 1
            if left == 0:
                flush()
        elif len(pending) >= batch_spans:
            flush()
    flush()
    return corpus
