"""The fleet window's cost per tool span, against the guard's cost per span, in one process.

The bench corpus (bench/corpus.py) goes through the guard (`Guard.process`, every rule on: the
per-span cost the worker pays now). Its tool calls, adapted once with the guard's result class
and the span's attribute map, then go through a FleetWindow as the tool scope would feed it:
`server_of` on the span, `tool_call`, `observe`, the corpus spread over ten minutes so steps
turn and traces leave the window. Printed: µs per span (guard), µs per tool span (fleet), and
their ratio, median of back-to-back pairs; the last line is one JSON object.
"""

from __future__ import annotations

import json
import statistics
import sys
from typing import Any

from bench.bench_core import _best
from bench.corpus import build_corpus, corpus_parser
from spanguard.detection import core_build
from spanguard.detection.conventions.adapt import adapt_span
from spanguard.detection.conventions.events import MISSING, ToolCall
from spanguard.detection.conventions.keys import WANTED_KEYS
from spanguard.detection.fleet import FleetWindow, server_of, tool_call
from spanguard.detection.guard import Guard
from spanguard.detection.results import result_key
from spanguard.schemas.otlp_view import parse_view
from spanguard.schemas.policy import FleetPolicy

BASE_NS = 1_800_000_000_000_000_000
MINUTES_NS = 10 * 60 * 1_000_000_000


def tool_events(requests: list[bytes]) -> list[tuple[ToolCall, str | None, str, str, Any]]:
    """(call, result class, trace id, agent, the span's attribute map) per tool span, each
    call's end time spread over ten minutes in request order."""
    events = []
    for index, data in enumerate(requests):
        at = BASE_NS + index * MINUTES_NS // len(requests)
        for resource_spans in parse_view(data).resource_spans:
            agent = resource_spans.resource.attributes["service.name"].string_value
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    event = adapt_span(span, WANTED_KEYS, scope=scope_spans.scope.name)
                    if isinstance(event, ToolCall):
                        event.end_time_unix_nano = at
                        result = result_key(
                            event.result, event.failed, event.result_digest, frozenset(), MISSING
                        )
                        events.append((event, result, span.trace_id.hex(), agent, span.attributes))
    return events


def main() -> int:
    args = corpus_parser(__doc__).parse_args()

    corpus = build_corpus(args.spans, args.traces)
    events = tool_events(corpus.requests)
    policy = FleetPolicy(enabled=True)

    def guard_all() -> None:
        guard = Guard()
        for data in corpus.requests:
            guard.process(data)

    def fleet_all() -> None:
        window = FleetWindow(policy)
        for call, result, trace_id, agent, attributes in events:
            window.observe(tool_call(call, result, trace_id, agent, server_of(attributes)))

    guard_times, fleet_times, ratios = [], [], []
    for _ in range(args.runs):  # back to back: on a shared machine a pair's ratio is steadier
        guard_times.append(_best(1, guard_all) / corpus.spans * 1e6)
        fleet_times.append(_best(1, fleet_all) / len(events) * 1e6)
        ratios.append(fleet_times[-1] / guard_times[-1])
    guard_us, fleet_us = min(guard_times), min(fleet_times)
    ratio = statistics.median(ratios)
    # What the stream pays: the fleet's time over every span (tool spans are a share of them).
    stream_ratio = ratio * len(events) / corpus.spans
    print(f"detection core: {core_build()}; {corpus.spans:,} spans, {len(events):,} tool spans")
    print(f"guard: {guard_us:.2f} µs per span (every span, every rule)")
    print(f"fleet: {fleet_us:.2f} µs per tool span (server_of, tool_call, observe)")
    print(
        f"fleet per tool span / guard per span: {ratio:.3f} (median of {args.runs} pairs);"
        f" added to the stream's per-span cost: {stream_ratio:.3f}"
    )
    print(
        json.dumps(
            {
                "core_build": core_build(),
                "guard_us_per_span": round(guard_us, 3),
                "fleet_us_per_tool_span": round(fleet_us, 3),
                "fleet_to_guard_per_span": round(ratio, 3),
                "fleet_share_of_stream": round(stream_ratio, 3),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
