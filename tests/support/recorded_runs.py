"""The recorded multi-agent runs (gzipped OTLP/JSON requests) as the fixture tests read them:
their spans, and the decisions `spanguard replay` makes on them."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

from spanguard.schemas.decision import validate
from spanguard.schemas.otlp import ExportTraceServiceRequest, decode_json_line


def resources(path: Path) -> list[dict]:
    return json.loads(gzip.decompress(path.read_bytes()))["resourceSpans"]


def spans(path: Path) -> list[dict]:
    return [
        span
        for resource in resources(path)
        for scope in resource["scopeSpans"]
        for span in scope["spans"]
    ]


def replay_decisions(files: dict[str, Path]) -> dict[str, list[dict]]:
    """{name: the decisions made on its run} for runs replayed together in one `spanguard
    replay` (each decision valid against the schema and owned by its trace's run)."""
    result = subprocess.run(
        [sys.executable, "-m", "spanguard.cli", "replay", *map(str, files.values())],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    owner = {span["traceId"]: name for name, path in files.items() for span in spans(path)}
    decisions: dict[str, list[dict]] = {name: [] for name in files}
    for line in result.stdout.splitlines():
        record = json.loads(line)
        validate(record, "detection")
        decisions[owner[record["trace_id"]]].append(record)
    return decisions


def per_trace(path: Path) -> list[tuple[str, ExportTraceServiceRequest]]:
    """The run's request split into one request per trace (what the Collector's partitioning
    by trace id makes of it), each with its resource and scope, in the order their traces
    ended (the last span of each)."""
    request = decode_json_line(gzip.decompress(path.read_bytes()))
    split: dict[str, ExportTraceServiceRequest] = {}
    ended: dict[str, int] = {}
    for resource in request.resource_spans:
        for scope in resource.scope_spans:
            for span in scope.spans:
                trace = span.trace_id.hex()
                one = split.setdefault(trace, ExportTraceServiceRequest())
                if not one.resource_spans or one.resource_spans[-1].resource != resource.resource:
                    one.resource_spans.add(resource=resource.resource)
                scopes = one.resource_spans[-1].scope_spans
                if not scopes or scopes[-1].scope != scope.scope:
                    scopes.add(scope=scope.scope)
                scopes[-1].spans.append(span)
                ended[trace] = max(ended.get(trace, 0), span.end_time_unix_nano)
    return sorted(split.items(), key=lambda item: ended[item[0]])
