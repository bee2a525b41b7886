"""`spanguard backtest`: what a new policy would have decided on recorded traffic, against the
current one. Pure: records in (partition, key, value, record time), a report out; reading them
from Kafka is connectors/backtest.py's business.

Both policies run the worker's own path (SpanPipeline: routing, dead letters, the guard) over
the same records in one pass. Memory stays bounded whatever the history's size:

- a trace's state is evicted once it has been idle for the state TTL in record time, per
  partition (each partition's clock is the newest record time read from it, so a partition
  read ahead of another does not evict the other's live traces), as the worker evicts idle
  traces by its own clock; at most `max_traces` traces are held, the oldest evicted first
  beyond that (counted and reported);
- an evicted trace's decisions are folded into counters per agent, rule and action; only the
  first `keep_traces` changed traces are kept in detail (trace id, a few fields per decision).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from spanguard.detection.fleet import FleetGuard
from spanguard.detection.guard import Guard
from spanguard.detection.pipeline import SpanPipeline
from spanguard.detection.timelines import Timeline, Timelines
from spanguard.detection.trace_state import TraceState
from spanguard.schemas.decision import Decision
from spanguard.schemas.policy import Policy

__all__ = [
    "DEFAULT_KEEP_TRACES",
    "DEFAULT_MAX_TRACES",
    "Backtest",
    "BacktestReport",
    "Change",
    "ChangedTrace",
    "Verdict",
    "format_report",
    "iso_time",
]

NEW, CURRENT = 0, 1
# Traces whose state is held at once; beyond it the oldest are evicted before their TTL.
DEFAULT_MAX_TRACES = 100_000
# Changed traces kept in detail (the counters count every one).
DEFAULT_KEEP_TRACES = 1000
# Trace ids listed per agent, rule and action (the counters count every one).
TRACES_PER_ROW = 20
# Skipped records whose reason is kept (all are counted).
SKIP_REASONS_KEPT = 5
MAX_FLEET_INCIDENTS = 1000  # incident records a report keeps per policy


def iso_time(seconds: float) -> str:
    """A record time (epoch seconds) as the reports write it: ISO 8601, to the second."""
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds")


@dataclass(slots=True, frozen=True)
class Verdict:
    """One decision, compact: what a report needs of it."""

    rule: str
    action: str
    span_id: str
    at: float  # record time of the message that carried the span (epoch seconds)
    reason: str
    tokens_at: int | None  # the trace's tokens when it fired (where a budget is tracked)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rule": self.rule,
            "action": self.action,
            "span_id": self.span_id,
            "at": iso_time(self.at),
            "reason": self.reason,
            "tokens_at": self.tokens_at,
        }


@dataclass(slots=True)
class ChangedTrace:
    """A trace whose decisions differ between the two policies."""

    trace_id: str
    service: str
    agent_name: str | None
    added: list[Verdict]
    removed: list[Verdict]
    tokens: int | None  # the trace's tokens when last seen (where a budget is tracked)
    # --html only: the new policy's timeline and both policies' full decisions.
    timeline: Timeline | None = None
    decisions: tuple[list[Decision], list[Decision]] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "trace_id": self.trace_id,
            "service": self.service,
            "agent_name": self.agent_name,
            "added": [v.to_dict() for v in self.added],
            "removed": [v.to_dict() for v in self.removed],
            "tokens": self.tokens,
        }

    @property
    def current_decisions(self) -> list[Decision]:
        """The current policy's full decisions (--html only; empty without them)."""
        return self.decisions[CURRENT] if self.decisions else []


@dataclass(slots=True)
class Change:
    """Decisions added and removed for one agent, rule and action."""

    added: int = 0
    removed: int = 0
    # Tokens the traces used after the decision's span (where a budget is tracked): what an
    # added kill would have saved, what a removed one lets the agent spend.
    tokens_after_added: int = 0
    tokens_after_removed: int = 0
    added_traces: list[str] = field(default_factory=list)
    removed_traces: list[str] = field(default_factory=list)


@dataclass
class BacktestReport:
    """What the backtest found; `to_dict` is the `--json` document."""

    new_policy: str
    current_policy: str
    records: int = 0
    spans: int = 0
    skipped: int = 0  # records that are not OTLP trace requests (or that detection failed on)
    skip_reasons: list[str] = field(default_factory=list)
    first_record_at: float | None = None
    last_record_at: float | None = None
    traces: int = 0  # traces with state, evicted or finished
    evicted_early: int = 0  # evicted before their TTL to stay under max_traces
    decisions: list[int] = field(default_factory=lambda: [0, 0])  # new, current
    traces_with_decisions: list[int] = field(default_factory=lambda: [0, 0])
    tokens_tracked: bool = False
    # (service, agent name, rule, action) -> change
    changes: dict[tuple[str, str | None, str, str], Change] = field(default_factory=dict)
    changed_traces: int = 0
    kept: list[ChangedTrace] = field(default_factory=list)
    seconds: float = 0.0
    # The fleet rules' incident records (scope tool), new and current: no trace's own, so kept
    # apart from the traces' verdicts (a few per week at most; bounded all the same).
    fleet_incidents: tuple[list[Decision], list[Decision]] = field(default_factory=lambda: ([], []))

    @property
    def added(self) -> int:
        return sum(c.added for c in self.changes.values())

    @property
    def removed(self) -> int:
        return sum(c.removed for c in self.changes.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "new_policy": self.new_policy,
            "current_policy": self.current_policy,
            "records": self.records,
            "spans": self.spans,
            "skipped": self.skipped,
            "skip_reasons": self.skip_reasons,
            "from": iso_time(self.first_record_at) if self.first_record_at is not None else None,
            "to": iso_time(self.last_record_at) if self.last_record_at is not None else None,
            "traces": self.traces,
            "evicted_early": self.evicted_early,
            "decisions": {"new": self.decisions[NEW], "current": self.decisions[CURRENT]},
            "fleet_incidents": {
                "new": [d.to_dict() for d in self.fleet_incidents[NEW]],
                "current": [d.to_dict() for d in self.fleet_incidents[CURRENT]],
            },
            "traces_with_decisions": {
                "new": self.traces_with_decisions[NEW],
                "current": self.traces_with_decisions[CURRENT],
            },
            "added": self.added,
            "removed": self.removed,
            "changed_traces": self.changed_traces,
            "tokens_tracked": self.tokens_tracked,
            "changes": [
                {
                    "service": service,
                    "agent_name": agent_name,
                    "rule": rule,
                    "action": action,
                    "added": change.added,
                    "removed": change.removed,
                    "tokens_after_added": change.tokens_after_added
                    if self.tokens_tracked
                    else None,
                    "tokens_after_removed": (
                        change.tokens_after_removed if self.tokens_tracked else None
                    ),
                    "added_traces": change.added_traces,
                    "removed_traces": change.removed_traces,
                }
                for (service, agent_name, rule, action), change in sorted(
                    self.changes.items(),
                    key=lambda item: (item[0][0], item[0][1] or "", *item[0][2:]),
                )
            ],
            "traces_kept": [trace.to_dict() for trace in self.kept],
            "seconds": round(self.seconds, 3),
        }


class _Trace:
    """One trace's state under both policies, and what each decided on it."""

    __slots__ = ("decisions", "last_seen", "partition", "states", "timeline", "verdicts")

    def __init__(self) -> None:
        self.states: list[TraceState | None] = [None, None]
        self.verdicts: tuple[list[Verdict], list[Verdict]] = ([], [])
        self.decisions: tuple[list[Decision], list[Decision]] | None = None
        self.timeline: Timeline | None = None
        self.partition = -1
        self.last_seen = 0.0


class _Store:
    """Every live trace, and per partition its traces in the order they were last written
    (so oldest first: a partition's clock only moves forward)."""

    def __init__(self) -> None:
        self.traces: dict[str, _Trace] = {}
        self.order: dict[int, OrderedDict[str, None]] = {}
        self.partition = 0
        self.now = 0.0

    def entry(self, trace_id: str) -> _Trace:
        trace = self.traces.get(trace_id)
        if trace is None:
            trace = self.traces[trace_id] = _Trace()
        return trace

    def touch(self, trace_id: str, trace: _Trace) -> None:
        trace.last_seen = self.now
        if trace.partition != self.partition:
            if trace.partition >= 0:
                self.order[trace.partition].pop(trace_id, None)
            trace.partition = self.partition
        order = self.order.get(self.partition)
        if order is None:
            order = self.order[self.partition] = OrderedDict()
        order[trace_id] = None
        order.move_to_end(trace_id)

    def pop_idle(self, partition: int, cutoff: float) -> Iterator[tuple[str, _Trace]]:
        order = self.order.get(partition)
        while order:
            trace_id = next(iter(order))
            trace = self.traces[trace_id]
            if trace.last_seen >= cutoff:
                return
            del order[trace_id]
            del self.traces[trace_id]
            yield trace_id, trace

    def pop_oldest(self) -> tuple[str, _Trace]:
        fronts = [
            (self.traces[next(iter(order))].last_seen, partition)
            for partition, order in self.order.items()
            if order
        ]
        _, partition = min(fronts)
        trace_id, _ = self.order[partition].popitem(last=False)
        return trace_id, self.traces.pop(trace_id)

    def pop_all(self) -> Iterator[tuple[str, _Trace]]:
        while self.traces:
            trace_id, trace = self.traces.popitem()
            if trace.partition >= 0:
                self.order[trace.partition].pop(trace_id, None)
            yield trace_id, trace


class _GuardStates(MutableMapping[str, TraceState]):
    """One guard's view of the shared store: its own state of each trace."""

    def __init__(self, store: _Store, index: int) -> None:
        self.store = store
        self.index = index

    def get(self, trace_id: str, default: Any = None) -> Any:  # the guard's hot path
        trace = self.store.traces.get(trace_id)
        state = trace.states[self.index] if trace is not None else None
        return default if state is None else state

    def __getitem__(self, trace_id: str) -> TraceState:
        state: TraceState | None = self.get(trace_id)
        if state is None:
            raise KeyError(trace_id)
        return state

    def __setitem__(self, trace_id: str, state: TraceState) -> None:
        trace = self.store.entry(trace_id)
        trace.states[self.index] = state
        self.store.touch(trace_id, trace)

    def __delitem__(self, trace_id: str) -> None:
        trace = self.store.traces.get(trace_id)
        if trace is None or trace.states[self.index] is None:
            raise KeyError(trace_id)
        trace.states[self.index] = None

    def __iter__(self) -> Iterator[str]:
        index = self.index
        return (t for t, trace in list(self.store.traces.items()) if trace.states[index])

    def __len__(self) -> int:
        return sum(1 for trace in self.store.traces.values() if trace.states[self.index])


class _Timelines:
    """The `timelines` of a Timelines observer, kept in the store's entries: evicted with
    their trace."""

    def __init__(self, store: _Store) -> None:
        self.store = store

    def __getitem__(self, trace_id: str) -> Timeline:
        trace = self.store.entry(trace_id)
        if trace.timeline is None:
            trace.timeline = Timeline()
        return trace.timeline


class _BothGuards:
    """What SpanPipeline drives: the new and the current policy's guards over one parsed view,
    so routing, dead letters and parsing happen once for both."""

    def __init__(self, new: Guard, current: Guard, on_decisions: Any) -> None:
        self.guards = (new, current)
        self.on_decisions = on_decisions
        self.wanted_keys = new.wanted_keys | current.wanted_keys

    def process_view(self, view: Any) -> list[Decision]:
        new, current = self.guards
        self.on_decisions(new.process_view(view), current.process_view(view))
        return []


def _tokens(state: TraceState | None) -> int | None:
    if state is None:
        return None
    return state.inference_tokens if state.inference_tokens is not None else state.aggregate_tokens


class Backtest:
    """Feed records in the order they were read; `finish()` returns the report."""

    def __init__(
        self,
        new: Policy,
        current: Policy,
        *,
        state_ttl: float = 3600.0,
        max_traces: int = DEFAULT_MAX_TRACES,
        keep_traces: int = DEFAULT_KEEP_TRACES,
        timelines: bool = False,
        new_name: str = "new",
        current_name: str = "current",
    ) -> None:
        if max_traces < 1:
            raise ValueError("max_traces must be at least 1")
        self.state_ttl = state_ttl
        self.max_traces = max_traces
        self.keep_traces = keep_traces
        self.timelines = timelines
        self.store = _Store()
        self._clocks: dict[int, float] = {}
        self.guards = (
            Guard(
                new,
                states=_GuardStates(self.store, NEW),
                clock=self._now,
                tools=FleetGuard(new, clock=self._now),
            ),
            Guard(
                current,
                states=_GuardStates(self.store, CURRENT),
                clock=self._now,
                tools=FleetGuard(current, clock=self._now),
            ),
        )
        if timelines:
            # Only the new policy's calls are drawn: the spans are the same under both.
            observer = Timelines()
            observer.timelines = _Timelines(self.store)  # type: ignore[assignment]
            self.guards[NEW].add_observer(observer)
        self._token_guards = [g for g in self.guards if g.tracks_tokens]
        self.pipeline = SpanPipeline(_BothGuards(*self.guards, self._record))  # type: ignore[arg-type]
        self.report = BacktestReport(
            new_name, current_name, tokens_tracked=bool(self._token_guards)
        )
        self._started = time.monotonic()

    def _now(self) -> float:
        return self.store.now

    # -- feeding ---------------------------------------------------------------------------

    def feed(self, partition: int, key: bytes | None, value: bytes | None, at: float) -> None:
        """One record of the spans topic: `at` is its record time (epoch seconds)."""
        report = self.report
        report.records += 1
        clock = max(self._clocks.get(partition, at), at)
        self._clocks[partition] = clock
        if report.first_record_at is None or at < report.first_record_at:
            report.first_record_at = at
        if report.last_record_at is None or at > report.last_record_at:
            report.last_record_at = at
        self.store.partition, self.store.now = partition, clock
        outcome = self.pipeline.handle(key, value)
        # An unkeyed or mixed message: the worker re-keys its parts through the repartition
        # topic; here they go straight to the guards, in the partition they came from.
        for trace_id, part in outcome.repartition:
            self.pipeline.handle(trace_id.encode(), part)
        if outcome.dead_letter is not None:
            report.skipped += 1
            if len(report.skip_reasons) < SKIP_REASONS_KEPT:
                report.skip_reasons.append(f"partition {partition}: {outcome.dead_letter}")
        # Cheap when nothing is idle: one look at the partition's oldest trace.
        self._evict(partition, clock)

    def _evict(self, partition: int, clock: float) -> None:
        cutoff = clock - self.state_ttl
        for trace_id, trace in list(self.store.pop_idle(partition, cutoff)):
            self._fold(trace_id, trace)
        while len(self.store.traces) > self.max_traces:
            trace_id, trace = self.store.pop_oldest()
            self.report.evicted_early += 1
            self._fold(trace_id, trace)

    def _record(self, new: list[Decision], current: list[Decision]) -> None:
        for index, decisions in ((NEW, new), (CURRENT, current)):
            for decision in decisions:
                if decision.scope_kind == "tool":
                    incidents = self.report.fleet_incidents[index]
                    if len(incidents) < MAX_FLEET_INCIDENTS:
                        incidents.append(decision)
                    continue
                trace = self.store.entry(decision.trace_id)
                tokens_at = decision.spend.tokens
                if tokens_at is None and self._token_guards:
                    tokens_at = _tokens(self._token_guards[0].states.get(decision.trace_id))
                trace.verdicts[index].append(
                    Verdict(
                        decision.rule,
                        decision.action,
                        decision.span_id,
                        self.store.now,
                        decision.reason,
                        tokens_at,
                    )
                )
                if self.timelines:
                    if trace.decisions is None:
                        trace.decisions = ([], [])
                    trace.decisions[index].append(decision)

    # -- folding a finished trace into the report -------------------------------------------

    def _fold(self, trace_id: str, trace: _Trace) -> None:
        report = self.report
        report.traces += 1
        new, current = trace.verdicts
        if not new and not current:
            return
        for index, verdicts in enumerate(trace.verdicts):
            report.decisions[index] += len(verdicts)
            report.traces_with_decisions[index] += bool(verdicts)
        new_keys = {(v.rule, v.action) for v in new}
        current_keys = {(v.rule, v.action) for v in current}
        if new_keys == current_keys:
            return
        added = [v for v in new if (v.rule, v.action) not in current_keys]
        removed = [v for v in current if (v.rule, v.action) not in new_keys]
        state = next(s for s in trace.states if s is not None) if any(trace.states) else None
        service = state.service if state else "unknown_service"
        agent_name = state.agent_name if state else None
        tokens = None
        if self._token_guards:
            counts = [_tokens(trace.states[i]) for i in (NEW, CURRENT)]
            tokens = max((c for c in counts if c is not None), default=None)
        report.changed_traces += 1
        for verdicts, adding in ((added, True), (removed, False)):
            for verdict in verdicts:
                key = (service, agent_name, verdict.rule, verdict.action)
                change = report.changes.get(key)
                if change is None:
                    change = report.changes[key] = Change()
                after = (
                    max((tokens or 0) - verdict.tokens_at, 0)
                    if verdict.tokens_at is not None
                    else 0
                )
                if adding:
                    change.added += 1
                    change.tokens_after_added += after
                    if len(change.added_traces) < TRACES_PER_ROW:
                        change.added_traces.append(trace_id)
                else:
                    change.removed += 1
                    change.tokens_after_removed += after
                    if len(change.removed_traces) < TRACES_PER_ROW:
                        change.removed_traces.append(trace_id)
        if len(report.kept) < self.keep_traces:
            report.kept.append(
                ChangedTrace(
                    trace_id,
                    service,
                    agent_name,
                    added,
                    removed,
                    tokens,
                    timeline=trace.timeline,
                    decisions=trace.decisions,
                )
            )

    def finish(self) -> BacktestReport:
        """Fold every trace still held (the history's end) and return the report."""
        for trace_id, trace in list(self.store.pop_all()):
            self._fold(trace_id, trace)
        report = self.report
        report.spans = self.guards[NEW].stats.spans
        report.kept.sort(key=lambda t: min(v.at for v in (*t.added, *t.removed)))
        report.seconds = time.monotonic() - self._started
        return report


# -- the text report ------------------------------------------------------------------------


def _incidents(report: BacktestReport, index: int) -> str:
    opened = [d for d in report.fleet_incidents[index] if d.action != "recovered"]
    named = ", ".join(f"{d.rule} {d.scope.tool if d.scope else ''}" for d in opened[:5])
    return f"{len(opened)}" + (f" ({named})" if named else "")


def format_report(report: BacktestReport, *, traces_shown: int = 20) -> str:
    """The human report: totals, a table per agent, rule and action, then changed traces."""
    lines = []
    span = (
        f" from {iso_time(report.first_record_at)} to {iso_time(report.last_record_at)}"
        if report.first_record_at is not None and report.last_record_at is not None
        else ""
    )
    lines.append(
        f"backtest: {report.new_policy} against {report.current_policy}:"
        f" {report.records:,} records, {report.spans:,} spans, {report.traces:,} traces{span}"
    )
    lines.append(
        f"decisions: {report.decisions[NEW]:,} under the new policy"
        f" ({report.traces_with_decisions[NEW]:,} traces), {report.decisions[CURRENT]:,} under"
        f" the current one ({report.traces_with_decisions[CURRENT]:,} traces);"
        f" {report.added:,} added, {report.removed:,} removed in {report.changed_traces:,}"
        " changed traces"
    )
    if any(report.fleet_incidents):
        lines.append(
            f"fleet incidents (a tool failing or looping across traces): {_incidents(report, NEW)}"
            f" under the new policy, {_incidents(report, CURRENT)} under the current one"
        )
    if report.skipped:
        lines.append(
            f"skipped: {report.skipped:,} record{'s' * (report.skipped != 1)} that"
            f" {'are' if report.skipped != 1 else 'is'} not OTLP trace requests"
            f" (first: {report.skip_reasons[0]})"
        )
    if report.evicted_early:
        lines.append(
            f"memory cap: {report.evicted_early:,} traces evicted before their TTL to stay under"
            " --max-traces; their later spans started fresh state (raise --max-traces to avoid)"
        )
    if not report.changes:
        lines.append("no change: the new policy decides exactly what the current one does")
        return "\n".join(lines) + "\n"
    tokens = report.tokens_tracked
    rows: list[tuple[str, ...]] = [("agent", "rule", "action", "added", "removed")]
    if tokens:
        rows[0] += ("tokens after added", "tokens after removed")
    for (service, agent_name, rule, action), change in sorted(
        report.changes.items(), key=lambda item: (item[0][0], item[0][1] or "", *item[0][2:])
    ):
        agent = service + (f"/{agent_name}" if agent_name else "")
        row: tuple[str, ...] = (agent, rule, action, f"{change.added:,}", f"{change.removed:,}")
        if tokens:
            row += (f"{change.tokens_after_added:,}", f"{change.tokens_after_removed:,}")
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines.append("")
    for row in rows:
        cells = [
            cell.rjust(width) if i >= 3 else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    shown = report.kept[:traces_shown]
    lines.append("")
    lines.append(f"changed traces (first {len(shown)} of {report.changed_traces:,}):")
    for trace in shown:
        agent = trace.service + (f"/{trace.agent_name}" if trace.agent_name else "")
        for sign, verdicts in (("+", trace.added), ("-", trace.removed)):
            for verdict in verdicts:
                lines.append(
                    f"  {sign} {trace.trace_id} {agent} {verdict.rule} -> {verdict.action}"
                    f" at {iso_time(verdict.at)}: {verdict.reason}"
                )
    return "\n".join(lines) + "\n"
