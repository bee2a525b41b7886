"""Recorded runs of real agents as OTLP traces, made with the OpenTelemetry SDK, and replayed
through the guard.

The runs live in tests/fixtures/realruns/*.jsonl.gz (extracted from public sources by
scripts/realruns/extract_*.py, the step format in scripts/realruns/common.py) and the peers'
loop-detection suites in tests/fixtures/peer_suites/*.json. Each run becomes one trace the way
a GenAI instrumentation writes it: an `invoke_agent` span, a `chat` span per model turn (its
`gen_ai.input.messages` holding what came in since the previous turn: the user's messages and
the tool results), and an `execute_tool` span per call with the call id, the arguments and the
result as recorded (status ERROR and `error.type` where the call failed). Calls a user
simulator made on its own device (`user:` tools) are not the agent's and are left out.

    python -m tests.support.realruns            # the precision table over every run
    python -m tests.support.realruns --show RUN # one run, step by step, with its decisions

The table is followed by the fleet's line: the recorded runs (not the peers' suites) as one
fleet through one guard with the fleet rules on at their shipped thresholds (`fleet_incidents`),
and the incidents they open. A healthy corpus opens none.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import random
import re
import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import Status, StatusCode

from spanguard.detection.fleet import FleetGuard
from spanguard.detection.guard import Guard
from spanguard.detection.results import EMPTY, classify
from spanguard.detection.rules import RULES
from spanguard.schemas.decision import Decision
from spanguard.schemas.policy import Policy

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "tests" / "fixtures" / "realruns"
PEERS = ROOT / "tests" / "fixtures" / "peer_suites"
LABELS = RUNS / "labels.jsonl"
SCOPE = "spanguard.realruns"
TURN_NS = 1_000_000_000  # a model turn
TOOL_NS = 100_000_000  # a tool call
USER_NS = 2_000_000_000  # a user's message


@dataclass
class Run:
    """One recorded run: its id, where it came from, its outcome and its steps."""

    run: str
    source: str  # the corpus file it came from (tau2, swe, a peer's name)
    harness: str
    kind: str
    outcome: str | None
    steps: list[dict[str, Any]]
    # A peer suite's case: what the peer's test asserts, and whether it is spanguard's remit.
    stuck: bool | None = None
    in_remit: bool = True
    peer_stop_at: int | None = None
    why: str = ""  # a peer case: what its test sets and asserts (its limit, where it sets one)

    @property
    def tool_steps(self) -> list[dict[str, Any]]:
        """The agent's own tool calls, in order (what the call indices count)."""
        return [step for step in self.steps if is_agent_call(step)]


def is_agent_call(step: dict[str, Any]) -> bool:
    return step["type"] == "tool" and not str(step["name"]).startswith("user:")


def load_runs(sources: Iterable[str] | None = None) -> list[Run]:
    """Every run of the corpus and every case of the peers' suites (or those of `sources`)."""
    wanted = None if sources is None else set(sources)
    runs: list[Run] = []
    for path in sorted(RUNS.glob("*.jsonl.gz")):
        name = path.name.removesuffix(".jsonl.gz")
        if wanted is not None and name not in wanted:
            continue
        with gzip.open(path, "rt", encoding="utf-8") as lines:
            for line in lines:
                record = json.loads(line)
                runs.append(
                    Run(
                        record["run"],
                        name,
                        record["harness"],
                        record["kind"],
                        record["outcome"],
                        record["steps"],
                    )
                )
    for path in sorted(PEERS.glob("*.json")):
        suite = json.loads(path.read_text())
        name = f"peer:{path.stem}"
        if wanted is not None and name not in wanted:
            continue
        for case in suite["cases"]:
            runs.append(
                Run(
                    case["case"],
                    name,
                    suite["peer"],
                    "peer",
                    None,
                    case["steps"],
                    stuck=case["stuck"],
                    in_remit=case["in_remit"],
                    peer_stop_at=case.get("peer_stop_at"),
                    why=case["why"],
                )
            )
    return runs


class _SeededIds(IdGenerator):
    """Trace and span ids drawn from the run's id: the same run makes the same trace."""

    def __init__(self, seed: str) -> None:
        self._random = random.Random(hashlib.sha256(seed.encode()).digest())

    def generate_span_id(self) -> int:
        return self._random.getrandbits(64) or 1

    def generate_trace_id(self) -> int:
        return self._random.getrandbits(128) or 1


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def to_request(run: Run, *, start_ns: int = 1_700_000_000_000_000_000) -> tuple[bytes, list[str]]:
    """The run as one OTLP ExportTraceServiceRequest, and the span ids (hex) of its agent tool
    calls in order."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(
        resource=Resource.create({"service.name": f"realruns-{run.source}"}),
        id_generator=_SeededIds(run.run),
    )
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer(SCOPE)
    now = start_ns
    call_span_ids: list[str] = []
    root = tracer.start_span(
        f"invoke_agent {run.harness}",
        start_time=now,
        attributes={"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": run.harness},
    )
    context = trace.set_span_in_context(root)
    incoming: list[dict[str, Any]] = []

    def model_turn() -> None:
        nonlocal now, incoming
        chat = tracer.start_span(
            "chat",
            context=context,
            start_time=now,
            attributes={
                "gen_ai.operation.name": "chat",
                "gen_ai.input.messages": json.dumps(incoming, ensure_ascii=False),
            },
        )
        now += TURN_NS
        chat.end(end_time=now)
        incoming = []

    for step in run.steps:
        kind = step["type"]
        if kind == "user":
            now += USER_NS
            incoming.append(
                {"role": "user", "parts": [{"type": "text", "content": step.get("text", "")}]}
            )
        elif kind == "model":
            model_turn()
        elif is_agent_call(step):
            if incoming and incoming[-1]["role"] == "user":
                model_turn()  # the model heard the user before it called the tool
            attributes: dict[str, Any] = {
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": step["name"],
                "gen_ai.tool.call.arguments": _text(step.get("arguments")),
            }
            if step.get("id"):
                attributes["gen_ai.tool.call.id"] = step["id"]
            if step.get("result") is not None:
                attributes["gen_ai.tool.call.result"] = step["result"]
            if step.get("error"):
                attributes["error.type"] = "tool_error"
            span = tracer.start_span(
                f"execute_tool {step['name']}",
                context=context,
                start_time=now,
                attributes=attributes,
            )
            if step.get("error"):
                span.set_status(Status(StatusCode.ERROR))
            now += TOOL_NS
            span.end(end_time=now)
            call_span_ids.append(format(span.get_span_context().span_id, "016x"))
            incoming.append(
                {"role": "tool", "parts": [{"type": "tool_call_response", "id": step.get("id")}]}
            )
        else:  # the user's own device calls: their results reach the agent as the user's words
            now += TOOL_NS
    root.end(end_time=now + 1)
    request = encode_spans(exporter.get_finished_spans())
    provider.shutdown()
    return request.SerializeToString(), call_span_ids


@dataclass
class RunDecisions:
    """What the guard decided on one run: (rule, action, call index from 1 or None)."""

    run: Run
    decisions: list[tuple[str, str, int | None]] = field(default_factory=list)


# The settings that make spanguard judge as each peer does, with the limit each test sets:
# docs/rules.md, "Settings like a peer's".
PEER_SETTINGS: dict[str, dict[str, Any]] = {
    # Its TOOL_CALL_LOOP_THRESHOLD; its cycle needs 15 calls of a round of 3.
    "peer:gemini-cli": {"loop": {"threshold": 5}, "cycle": {"repeats": 5}},
    "peer:openhands": {"user_turns": "keep"},  # headless: a user message resets nothing
    # Its mistake counter runs across turns; identical calls stop at its hard limit, 5.
    "peer:cline": {"user_turns": "keep", "loop": {"threshold": 5}},
    "peer:openclaw": {"cycle": {"compare_results": False}},  # ping-pong whatever the results
    "peer:roo-code": {},
}


def peer_policy(run: Run) -> Policy:
    """The policy judging `run` as its peer does: the peer's settings, and the limit its test
    sets (Roo Code's `limit` N blocks the (N+1)th identical call, Cline's loop detection
    `hard` N the Nth, its `maxConsecutiveMistakes` N the Nth failed one)."""
    defaults = {
        key: dict(value) if isinstance(value, dict) else value
        for key, value in PEER_SETTINGS[run.source].items()
    }
    limits = dict(re.findall(r"\b(limit|maxConsecutiveMistakes|hard)=(\d+)", run.why))
    if not run.in_remit:
        limits = {}  # limit 0 or below: "unlimited" and config cases, nothing to mirror
    if "limit" in limits:
        defaults.setdefault("loop", {})["threshold"] = int(limits["limit"]) + 1
    if "hard" in limits:
        defaults.setdefault("loop", {})["threshold"] = int(limits["hard"])
    if "maxConsecutiveMistakes" in limits:
        mistakes = int(limits["maxConsecutiveMistakes"])
        defaults.setdefault("loop", {})["failing_threshold"] = mistakes
    return Policy.from_mapping({"defaults": defaults})


def replay(
    runs: Iterable[Run],
    policy: Policy | None = None,
    policy_of: Callable[[Run], Policy] | None = None,
) -> Iterator[RunDecisions]:
    """Each run through a guard of its own on `policy` (the shipped defaults by default), or
    on `policy_of(run)`."""
    policy = policy or Policy()
    for run in runs:
        request, calls = to_request(run)
        guard = Guard(policy_of(run) if policy_of is not None else policy)
        index = {span_id: position + 1 for position, span_id in enumerate(calls)}
        found = RunDecisions(run)
        for decision in guard.process(request):
            found.decisions.append(
                (decision.rule, decision.action, index.get(decision.span_id or ""))
            )
        yield found


FLEET_START_NS = 1_800_000_000_000_000_000
FLEET_SPREAD_S = 300  # as tests/support/fleet.py lays the real runs out


def fleet_incidents(runs: Iterable[Run], seed: int = 44) -> list[Decision]:
    """The fleet rules (shipped thresholds) over `runs` as if a fleet ran them at once: each
    starts at a seeded offset within FLEET_SPREAD_S, and every span goes through one guard
    in the order the spans ended, as the worker's tool scope sees a fleet. Returns the tool
    scope's decisions (incidents and recoveries)."""
    policy = Policy.from_mapping({"fleet": {"enabled": True}})
    guard = Guard(policy, tools=FleetGuard(policy))
    rng = random.Random(seed)
    spans = []
    for run in runs:
        start = FLEET_START_NS + rng.randrange(FLEET_SPREAD_S * 1_000_000_000)
        request = ExportTraceServiceRequest.FromString(to_request(run, start_ns=start)[0])
        for part in request.resource_spans:
            for scoped in part.scope_spans:
                spans.extend((span.end_time_unix_nano, part, scoped, span) for span in scoped.spans)
    spans.sort(key=lambda item: item[0])
    decided = []
    for _ended, part, scoped, span in spans:
        one = ExportTraceServiceRequest()
        resource_spans = one.resource_spans.add(resource=part.resource)
        resource_spans.scope_spans.add(scope=scoped.scope, spans=[span])
        decided.extend(d for d in guard.process(one) if d.scope_kind == "tool")
    return decided


def fleet_line(runs: list[Run]) -> str:
    recorded = [run for run in runs if not run.source.startswith("peer:")]
    decided = fleet_incidents(recorded)
    named = sorted({f"{d.rule} {d.scope.tool if d.scope else ''}" for d in decided})
    return (
        f"fleet: {len(recorded)} recorded runs as one fleet over {FLEET_SPREAD_S} s, the fleet"
        f" rules at their defaults: {sum(d.action != 'recovered' for d in decided)} incidents"
        + (f" ({', '.join(named)})" if named else "")
    )


def load_labels() -> dict[str, dict[str, Any]]:
    """Hand labels, by run id: verdict (loop or healthy), stop_at (the call a person stops
    it at), why."""
    if not LABELS.exists():
        return {}
    labels = {}
    for line in LABELS.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            labels[record["run"]] = record
    return labels


def needs_label(run: Run) -> bool:
    """Whether a person must label the run even when no rule decides on it: the same call
    (tool and arguments) made a third time, or three calls of one tool in a row that found
    nothing."""
    seen: Counter[tuple[str, str]] = Counter()
    streaks: Counter[str] = Counter()
    for step in run.tool_steps:
        call = (step["name"], json.dumps(step.get("arguments"), sort_keys=True))
        seen[call] += 1
        if seen[call] >= 3:
            return True
        result = step.get("result")
        if result is not None and classify(result) == EMPTY:
            streaks[step["name"]] += 1
            if streaks[step["name"]] >= 3:
                return True
        else:
            streaks[step["name"]] = 0
    return False


@dataclass
class Cell:
    """One row of the precision table: a rule (or every rule: "any") on one source."""

    runs: int = 0
    healthy_kills: int = 0
    healthy_flags: int = 0
    loops: int = 0
    caught_in_time: int = 0  # first decision at the person's call or one after
    caught_late: int = 0
    caught_early: int = 0  # before the person would have stopped it
    missed: int = 0
    unlabelled: list[str] = field(default_factory=list)  # decided runs nobody labelled

    def row(self, source: str, rule: str) -> str:
        return (
            f"| {source} | {rule} | {self.runs} | {self.healthy_kills} | {self.healthy_flags} |"
            f" {self.loops} | {self.caught_in_time} | {self.caught_early} | {self.caught_late} |"
            f" {self.missed} |"
        )


HEADER = (
    "| source | rule | runs | kills on healthy | flags on healthy | loops | caught at the"
    " person's call (or one after) | caught earlier | caught later | missed |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


def truth(run: Run, labels: dict[str, dict[str, Any]]) -> tuple[str | None, int | None]:
    """(verdict, the call a person stops it at): the hand label, or the peer's assertion for a
    peer's in-remit case; (None, None) where there is none."""
    if run.source.startswith("peer:"):
        if not run.in_remit:
            return None, None
        if run.stuck:
            return "loop", run.peer_stop_at
        return "healthy", None
    label = labels.get(run.run)
    if label is None:
        return None, None
    return label["verdict"], label.get("stop_at")


def precision(found: Iterable[RunDecisions], labels: dict[str, dict[str, Any]]):
    """{(source, rule): Cell}: rule "any" for every rule together (a loop caught by the
    first decision on it); a rule's row counts its decisions on healthy runs and the loops it
    decided first (its `loops`)."""
    table: dict[tuple[str, str], Cell] = defaultdict(Cell)
    for item in found:
        run = item.run
        verdict, stop_at = truth(run, labels)
        for rule in ["any", *(r.name for r in RULES)]:
            mine = [d for d in item.decisions if rule == "any" or d[0] == rule]
            cell = table[(run.source, rule)]
            cell.runs += 1
            if verdict is None:
                if mine and (run.in_remit or not run.source.startswith("peer:")):
                    cell.unlabelled.append(run.run)
                continue
            if verdict == "healthy":
                cell.healthy_kills += sum(1 for d in mine if d[1] in ("kill", "downgrade", "pause"))
                cell.healthy_flags += sum(1 for d in mine if d[1] == "flag")
                continue
            if rule != "any" and (not mine or item.decisions[0] != mine[0]):
                continue  # a loop is caught by the first rule that decides on it
            cell.loops += 1
            if not mine:
                cell.missed += 1
                continue
            at = mine[0][2]
            if stop_at is None or at is None or stop_at <= at <= stop_at + 1:
                cell.caught_in_time += 1
            elif at < stop_at:
                cell.caught_early += 1
            else:
                cell.caught_late += 1
    return dict(table)


def render(table) -> str:
    lines = [HEADER]
    for (source, rule), cell in sorted(table.items()):
        if rule == "any" or cell.healthy_kills or cell.healthy_flags or cell.loops:
            lines.append(cell.row(source, rule))
    return "\n".join(lines)


def show(run: Run, decisions: list[tuple[str, str, int | None]], width: int = 300) -> str:
    """The run step by step, for a person labelling it: each agent call numbered."""
    by_call = defaultdict(list)
    for rule, action, at in decisions:
        by_call[at].append(f"<<< {rule} {action}")
    lines = [f"# {run.run}  harness={run.harness} kind={run.kind} outcome={run.outcome}"]
    number = 0
    for step in run.steps:
        if step["type"] == "user":
            lines.append(f"  USER: {step.get('text', '')[:width]!r}")
        elif step["type"] == "model":
            if step.get("text"):
                lines.append(f"  MODEL: {step['text'][:width]!r}")
        elif is_agent_call(step):
            number += 1
            arguments = _text(step.get("arguments"))
            result = step.get("result")
            flag = " ERROR" if step.get("error") else ""
            lines.append(
                f"  [{number}] {step['name']}({arguments[:width]}) id={step.get('id')}{flag}"
                f" -> {str(result)[:width]!r} {' '.join(by_call.get(number, []))}"
            )
        else:
            lines.append(f"  (user device) {step['name']}({_text(step.get('arguments'))[:120]})")
    if None in by_call:
        lines.append(f"  decisions not on a call: {by_call[None]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--show", nargs="*", default=None, help="run ids to print")
    parser.add_argument("--source", action="append", help="only these corpus files")
    parser.add_argument("--decided", action="store_true", help="print every decided run")
    parser.add_argument("--blind", action="store_true", help="--show without the decisions")
    parser.add_argument("--width", type=int, default=300, help="characters shown per text")
    parser.add_argument("--json", help="write every run's decisions to this file")
    parser.add_argument(
        "--peer-settings",
        action="store_true",
        help="replay the peers' suites on settings like each peer's (PEER_SETTINGS)",
    )
    args = parser.parse_args(argv)
    if args.peer_settings:
        peers = [run for run in load_runs(args.source or PEER_SETTINGS) if run.in_remit]
        print(render(precision(replay(peers, policy_of=peer_policy), load_labels())))
        return 0
    runs = load_runs(args.source)
    if args.show:
        wanted = set(args.show)
        runs = [run for run in runs if run.run in wanted]
    tally: Counter[tuple[str, str, str]] = Counter()
    everything = {}
    for found in replay(runs):
        everything[found.run.run] = found.decisions
        if args.show is not None or (args.decided and found.decisions):
            print(show(found.run, [] if args.blind else found.decisions, args.width))
        for rule, action, _at in found.decisions:
            tally[(found.run.source, rule, action)] += 1
    for (source, rule, action), count in sorted(tally.items()):
        print(f"{source:20} {rule:14} {action:9} {count}")
    print(f"{len(runs)} runs")
    if args.show is None:
        print(render(precision(replay(runs), load_labels())))
        print(fleet_line(runs))
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
