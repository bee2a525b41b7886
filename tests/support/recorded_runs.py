"""The recorded multi-agent runs (gzipped OTLP/JSON requests) as the fixture tests read them:
their spans, and the decisions `spanguard replay` makes on them."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

from spanguard.schemas.decision import validate


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
