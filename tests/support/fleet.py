"""The fleet rules (spanguard/detection/fleet.py) over the repo's corpora, replayed as one fleet.

Each corpus is a list of OTLP requests. Every request goes through a trace guard (its decisions
are the trace-level decisions the fleet counts), and its spans become fleet calls: tool calls
with the guard's result classes (ERROR, EMPTY) and the server they name, and model calls. Runs
recorded one by one have no shared clock, so each is laid out as if the fleet ran them at once:
its spans shifted to start at an offset drawn (seeded) within `spread` seconds.

    python -m tests.support.fleet             # the precision table at the default FleetPolicy
    python -m tests.support.fleet --sweep     # incidents per setting, around the defaults
    python -m tests.support.fleet --stress    # the real runs on other seeds, and in one minute
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from functools import cache

from bench.corpus import build_corpus
from spanguard.detection.conventions.adapt import adapt_span
from spanguard.detection.conventions.events import MISSING, ToolCall
from spanguard.detection.conventions.keys import AGENT_NAME, SERVICE_NAME, WANTED_KEYS
from spanguard.detection.fleet import (
    FleetCall,
    FleetIncident,
    FleetWindow,
    model_call,
    server_of,
    tool_call,
)
from spanguard.detection.guard import Guard
from spanguard.detection.results import result_key
from spanguard.schemas.otlp import decode_json_line
from spanguard.schemas.otlp_view import parse_view
from spanguard.schemas.policy import FleetPolicy
from tests.support.instrumented_agents import FIXTURES
from tests.support.realruns import load_runs, to_request

BASE_NS = 1_800_000_000_000_000_000
SECOND = 1_000_000_000
HEALTHY_SCENARIOS = ("distinct", "retry", "polling")  # test_instrumentation_fixtures' HEALTHY
RECORDED_MODES = ("capture", "hashed", "legacy", "latest")


@dataclass(slots=True)
class Decided:
    """A trace-level decision as the fleet hears of it."""

    tool: str | None
    args_hash: str | None
    trace_id: str
    end_time_unix_nano: int


Event = FleetCall | Decided


def _agent(resource_attributes) -> str:
    for key in (AGENT_NAME, SERVICE_NAME):
        if key in resource_attributes:
            return resource_attributes[key].string_value
    return ""


def events_of(request: bytes, guard: Guard | None, shift: Callable[[int], int]) -> list[Event]:
    """The fleet's events of one request: its calls, then the guard's decisions on it, each at
    its span's end time moved by `shift`."""
    events: list[Event] = []
    ends: dict[str, int] = {}
    for resource_spans in parse_view(request).resource_spans:
        agent = _agent(resource_spans.resource.attributes)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                trace_id = span.trace_id.hex()
                end = shift(span.end_time_unix_nano)
                ends[span.span_id.hex()] = end
                adapted = adapt_span(span, WANTED_KEYS, scope=scope_spans.scope.name)
                for event in adapted if isinstance(adapted, tuple) else (adapted,):
                    if isinstance(event, ToolCall):
                        result = result_key(
                            event.result, event.failed, event.result_digest, frozenset(), MISSING
                        )
                        call = tool_call(event, result, trace_id, agent, server_of(span.attributes))
                        call.end_time_unix_nano = end
                        events.append(call)
                model = model_call(span, trace_id, agent)
                if model is not None:
                    model.end_time_unix_nano = end
                    events.append(model)
    if guard is not None:
        for decision in guard.process(request):
            at = ends.get(decision.span_id or "", max(ends.values(), default=0))
            evidence = decision.evidence
            events.append(Decided(evidence.tool_name, evidence.args_hash, decision.trace_id, at))
    return events


@dataclass
class FleetRun:
    """What the fleet decided over one corpus."""

    corpus: str
    traces: int = 0
    tool_calls: int = 0
    failed: int = 0
    empty: int = 0
    decisions: int = 0
    minutes: float = 0.0
    incidents: list[FleetIncident] = field(default_factory=list)
    window: FleetWindow | None = None


def replay(corpus: str, events: Iterable[Event], policy: FleetPolicy) -> FleetRun:
    """`events` in time order through one FleetWindow."""
    ordered = sorted(events, key=lambda event: event.end_time_unix_nano)
    window = FleetWindow(policy)
    run = FleetRun(corpus, window=window)
    traces = set()
    for event in ordered:
        if isinstance(event, Decided):
            run.decisions += 1
            found = window.observe_decision(
                event.tool, "", event.args_hash, event.trace_id, event.end_time_unix_nano
            )
        else:
            traces.add(event.trace_id)
            if not event.tool.startswith("model:"):
                run.tool_calls += 1
                run.failed += event.failed
                run.empty += event.empty
            found = window.observe(event)
        if found is not None and found.open:
            run.incidents.append(found)
    run.traces = len(traces)
    if ordered:
        span = ordered[-1].end_time_unix_nano - ordered[0].end_time_unix_nano
        run.minutes = span / SECOND / 60
    return run


def _shift_to(offset_ns: int, first_ns: int) -> Callable[[int], int]:
    return lambda time_ns: time_ns - first_ns + offset_ns if time_ns > 0 else 0


@cache
def _realrun_event_lists() -> list[list[Event]]:
    """Each real run's events, the run starting at BASE_NS (made once: the SDK is slow)."""
    return [
        events_of(to_request(run, start_ns=BASE_NS)[0], Guard(), lambda time_ns: time_ns)
        for run in load_runs(["swe", "tau-forks"])
    ]


def realrun_events(seed: int = 44, spread: int = 300) -> Iterator[Event]:
    """The real-run corpus (tests/fixtures/realruns), each run starting at a seeded random
    offset within `spread` seconds, as if they ran at once."""
    rng = random.Random(seed)
    for events in _realrun_event_lists():
        offset = rng.randrange(spread * SECOND)
        for event in events:
            yield replace(event, end_time_unix_nano=event.end_time_unix_nano + offset)


def instrumentation_events(seed: int = 44, spread: int = 300) -> Iterator[Event]:
    """Every recorded instrumentation fixture's healthy scenarios (HEALTHY_SCENARIOS), each
    request laid out at a seeded random offset within `spread` seconds."""
    rng = random.Random(seed)
    for path in sorted(FIXTURES.glob("*/*/*.json.gz")):
        if path.parent.name not in RECORDED_MODES or path.name[:-8] not in HEALTHY_SCENARIOS:
            continue
        request = decode_json_line(gzip.decompress(path.read_bytes()))
        starts = [
            span.start_time_unix_nano or span.end_time_unix_nano
            for resource_spans in request.resource_spans
            for scope_spans in resource_spans.scope_spans
            for span in scope_spans.spans
        ]
        shift = _shift_to(BASE_NS + rng.randrange(spread * SECOND), min(starts, default=0))
        yield from events_of(request.SerializeToString(), Guard(), shift)


def bench_events(minutes: int = 10, guard: bool = True, **corpus_args) -> Iterator[Event]:
    """bench/corpus.py's fleet, its requests spread evenly over `minutes` (the corpus's own
    times put every trace in one second): request i at i/len of the way."""
    corpus = build_corpus(**corpus_args)
    trace_guard = Guard() if guard else None
    count = len(corpus.requests)
    for index, request in enumerate(corpus.requests):
        at = BASE_NS + index * minutes * 60 * SECOND // count
        yield from events_of(request, trace_guard, lambda time_ns, at=at: at)


def synthetic_fleet(
    agents: int = 200,
    minutes: int = 10,
    failing: str = "search_docs",
    fails: tuple[int, int] = (120, 360),
    spans: int = 40_000,
) -> list[FleetCall]:
    """The bench corpus as `agents` agents (a trace each, no loops) whose `failing` tool fails
    for everyone from `fails[0]` to `fails[1]` seconds in: the issue's fleet of 200 agents."""
    calls = []
    start, end = BASE_NS + fails[0] * SECOND, BASE_NS + fails[1] * SECOND
    for event in bench_events(
        minutes, guard=False, total_spans=spans, traces=agents, loop_every=10**9
    ):
        if not isinstance(event, FleetCall) or event.tool.startswith("model:"):
            continue
        event.agent = f"agent-{event.trace_id[:8]}"
        if event.tool == failing and start <= event.end_time_unix_nano < end:
            event.failed = True
        calls.append(event)
    return calls


def first_crossing(calls: list[FleetCall], tool: str, policy: FleetPolicy) -> FleetCall | None:
    """The call on which `tool_failing` crosses, recounted from scratch on every call (the
    oracle the window's incremental counts are checked against)."""
    last: dict[str, tuple[int, bool]] = {}  # trace -> (step of its last call, it was bad)
    now = -1
    step_ns = policy.step * SECOND
    for call in sorted(calls, key=lambda call: call.end_time_unix_nano):
        step = call.end_time_unix_nano // step_ns
        now = max(now, step)
        if call.tool != tool:
            continue
        last[call.trace_id] = (step, call.failed or call.empty)
        live = [bad for at, bad in last.values() if at > now - policy.steps]
        bad = sum(live)
        if bad >= policy.min_traces and bad >= policy.min_fraction * len(live):
            return call
    return None


CORPORA: dict[str, Callable[[], Iterator[Event]]] = {
    "real runs (swe, tau-forks)": realrun_events,
    "instrumentation fixtures (healthy)": instrumentation_events,
    "bench corpus, one looping trace": lambda: bench_events(loop_every=10**9),
    "bench corpus as shipped (1 in 20 loop on one call)": lambda: bench_events(),
}

HEADER = (
    "| corpus | traces | tool calls | failed | empty | trace decisions | minutes |"
    " tool_failing | loop_signature |\n|---|---|---|---|---|---|---|---|---|"
)


def row(run: FleetRun) -> str:
    failing = [i.tool for i in run.incidents if i.rule == "tool_failing"]
    loops = [i.tool for i in run.incidents if i.rule == "loop_signature"]
    return (
        f"| {run.corpus} | {run.traces} | {run.tool_calls} | {run.failed} | {run.empty} |"
        f" {run.decisions} | {run.minutes:.1f} | {len(failing)} {_names(failing)} |"
        f" {len(loops)} {_names(loops)} |"
    )


def _names(tools: list[str]) -> str:
    return f"({', '.join(sorted(set(tools)))})" if tools else ""


def table(policy: FleetPolicy, corpora: dict[str, list[Event]]) -> str:
    lines = [HEADER]
    for name, events in corpora.items():
        lines.append(row(replay(name, events, policy)))
    return "\n".join(lines)


def sweep(corpora: dict[str, list[Event]]) -> str:
    """Incidents on every corpus per setting near the defaults: how much room they leave."""
    lines = [
        "| min_traces | min_fraction | loop_traces | incidents (per corpus) |",
        "|---|---|---|---|",
    ]
    base = FleetPolicy(enabled=True)
    for min_traces in (2, 3, 5, 8):
        for fraction in (0.2, 0.35, 0.5):
            for loop_traces in (2, 3):
                policy = replace(
                    base, min_traces=min_traces, min_fraction=fraction, loop_traces=loop_traces
                )
                counts = [len(replay(n, e, policy).incidents) for n, e in corpora.items()]
                lines.append(f"| {min_traces} | {fraction} | {loop_traces} | {counts} |")
    return "\n".join(lines)


def stress(policy: FleetPolicy) -> str:
    """The real runs laid out on other seeds, and packed into one minute instead of five."""
    lines = ["| spread (s) | seed | incidents |", "|---|---|---|"]
    for spread in (300, 60):
        for seed in range(1, 6):
            run = replay("real runs", realrun_events(seed, spread), policy)
            lines.append(
                f"| {spread} | {seed} | {len(run.incidents)} {_names([i.tool for i in run.incidents])} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="incidents per setting")
    parser.add_argument("--show", action="store_true", help="print every incident")
    parser.add_argument("--stress", action="store_true", help="the real runs on other layouts")
    args = parser.parse_args(argv)
    corpora = {name: list(make()) for name, make in CORPORA.items()}
    policy = FleetPolicy(enabled=True)
    print(table(policy, corpora))
    if args.show:
        for name, events in corpora.items():
            for incident in replay(name, events, policy).incidents:
                print(name, json.dumps(incident.__repr__()))
    if args.sweep:
        print(sweep(corpora))
    if args.stress:
        print(stress(policy))
    return 0


if __name__ == "__main__":
    sys.exit(main())
