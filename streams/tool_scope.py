"""The tool scope in the worker: one tool (or model) across every agent, by a repartition of
compact call records by tool key.

A tool's calls land on every partition of the span topics (they are keyed by trace id), so no
span agent sees a tool's whole fleet. The span agent's guard hands each tool call it counts to
its recorder (`ToolCallRecorder`, the guard's tool call sink: spanguard/detection/fleet.py), which
sums them per span message, trace and tool key, and keeps the trace-level decisions that named a
tool; the span agent sends the batch's rows to the tool call topic, one Kafka record per tool
key (`tool_key`: the tool's name and its server). The tool scope agent
(streams/agents/guard_tools.py) reads that topic, keeps each key's `FleetWindow` in a table
keyed the same way (its changelog follows the partition a record arrives on, as the trace
table's does), decides with the kernel's code and sends the incidents' decisions to the
detections topic. What the scopes share in the worker is streams/scope.py's.

Records sent twice (a span batch decided again after a crash re-sends what it had sent) are
dropped by where they came from, as the agent windows drop them: each window remembers the last
offset it counted of each source partition. An incident taken again after a crash (its window
not yet flushed) carries the same ids: its record is the same record.

Off (the policy's `fleet.enabled` false, the default), the worker builds none of it: no
recorder, no topic, no table, no agent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, MutableMapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from spanguard.detection.fleet import (
    FleetCall,
    FleetIncident,
    FleetWindow,
    decided_tools,
    incident_decision,
    window_from_bytes,
)
from spanguard.outcomes import CountedOutcome, Tally
from spanguard.schemas.decision import Decision
from spanguard.schemas.policy import FleetPolicy, Policy
from spanguard.schemas.scope_records import ToolRow, encode_tool_calls, tool_key
from spanguard.streams.decoded_states import DecodedStates
from spanguard.streams.delivery import Send
from spanguard.streams.scope import ScopeRecorder, scope_view

if TYPE_CHECKING:
    from spanguard.streams.wiring import Worker

__all__ = [
    "ToolCallRecorder",
    "ToolScopeCount",
    "WorkerFleet",
    "tool_call_sends",
    "tool_scope_wanted",
    "tool_window_view",
]

log = logging.getLogger("spanguard.worker")

MAX_SOURCES = 512  # source partitions a window remembers the last offset of
MAX_HELD_TRACES = 100_000  # (trace, key) sums one span message may hold
MAX_KNOWN_KEYS = 10_000  # (tool, server) -> tool key texts the recorder keeps made


def tool_scope_wanted(policy: Policy) -> bool:
    """Whether the policy turns the fleet rules on: when not, the worker builds none of the
    tool scope (no record sent, no table, no agent)."""
    return policy.fleet.enabled


class ToolScopeCount(CountedOutcome):
    """What the tool scope counts in the worker."""

    RECORDS_SENT = "tool_call_records_sent"
    RECORDS_READ = "tool_call_records_read"
    DUPLICATES = "tool_call_duplicates"
    # Not kept: a new tool key past the policy's fleet.max_tools on this worker (told once).
    OVER_TOOL_CAP = "tool_call_over_tool_cap"
    DECISIONS = "tool_scope_decisions"
    EVICTED = "tool_windows_evicted"


# -- the trace side: record, do not decide ----------------------------------------------------


class ToolCallRecorder(ScopeRecorder[tuple[str, list[Any]]]):
    """The span agent's guard's tool call sink: one row per trace and tool key of each span
    message (its calls summed), then a row per trace-level decision that named a tool, for the
    span agent to send (the tool scope agent decides, from the topic)."""

    def __init__(self) -> None:
        super().__init__()
        # The current message's calls: (tool key, trace) -> its row as sent, summed so far:
        # ["c", trace, agent, end, calls, failures, empties, last].
        self._summed: dict[tuple[str, str], list[Any]] = {}
        self._servers: dict[tuple[str, str], str] = {}  # (trace, tool) -> its calls' server
        self._decided: list[tuple[str, list[Any]]] = []
        # Every tool call needs its key's text: made once per tool (bounded: cleared when full).
        self._keys: dict[tuple[str, str], str] = {}

    def _key_of(self, tool: str, server: str) -> str:
        key = self._keys.get((tool, server))
        if key is None:
            if len(self._keys) >= MAX_KNOWN_KEYS:
                self._keys.clear()
            key = self._keys[(tool, server)] = tool_key(tool, server)
        return key

    def hand_tool_call(self, call: FleetCall) -> None:
        tool, server = call.tool, call.server
        if not tool:
            return
        key = self._keys.get((tool, server))  # `_key_of` inlined: once per tool and model call
        if key is None:
            key = self._key_of(tool, server)
        last = 1 if call.failed else 2 if call.empty else 0
        summed = self._summed.get((key, call.trace_id))
        if summed is None:
            if len(self._summed) >= MAX_HELD_TRACES:
                self.close_message()
            # The row itself, not a sum turned into a row at the message's end: every call of
            # a repartitioned batch is nearly a row of its own.
            self._summed[(key, call.trace_id)] = [
                "c",
                call.trace_id,
                call.agent,
                call.end_time_unix_nano,
                1,
                int(call.failed),
                int(call.empty and not call.failed),
                last,
            ]
            if call.server:
                self._servers[(call.trace_id, call.tool)] = call.server
            return
        if call.end_time_unix_nano >= summed[3]:
            summed[3], summed[7] = call.end_time_unix_nano, last
        summed[4] += 1
        summed[5] += int(call.failed)
        summed[6] += int(call.empty and not call.failed)

    def hand_decisions(self, decisions: list[Decision]) -> None:
        """The trace-level decisions of the current message that name a tool."""
        if not decisions:  # most messages: nothing decided
            return
        for tool, args_hash, trace_id, ended in decided_tools(decisions):
            server = self._servers.get((trace_id, tool), "")
            self._decided.append((self._key_of(tool, server), ["d", trace_id, ended, args_hash]))

    def close_message(self) -> None:
        if not self._summed and not self._decided:  # a message without tool calls
            return
        self.records.extend([(key, row) for (key, _trace), row in self._summed.items()])
        self.records.extend(self._decided)
        self._summed.clear()
        self._servers.clear()
        self._decided.clear()


def _source_of(message: Any) -> tuple[str, int] | None:
    if message is None:
        return None
    return f"{message.topic}:{message.partition}", int(message.offset)


def tool_call_sends(
    worker: Worker, records: list[tuple[str, list[Any]]], sources: list[Any]
) -> list[Send]:
    """The span agent's rows for the tool call topic, one record per tool key, in order; a
    record that cannot be written leaves a dead letter pointing at the first message that
    contributed to it (`sources` is aligned with `records`)."""
    topic = worker.tool_calls_out
    assert topic is not None
    first_source: dict[str, Any] = {}
    for (key, _row), source in zip(records, sources, strict=True):
        first_source.setdefault(key, source)
    encoded = encode_tool_calls(records, [_source_of(message) for message in sources])
    return [
        Send(topic, {"key": key.encode(), "value": value}, source=first_source[key], deferred=True)
        for key, value in encoded.items()
    ]


# -- the agent side: decide ---------------------------------------------------------------


def tool_window_view(
    policy: FleetPolicy,
) -> Callable[[MutableMapping[bytes, bytes], float, int], DecodedStates]:
    """The tool window table as the scope reads it: a FleetWindow per tool key."""

    def view(
        table: MutableMapping[bytes, bytes], bucket_seconds: float = 60.0, cache_size: int = 0
    ) -> DecodedStates:
        return scope_view(
            table, lambda data: window_from_bytes(data, policy), bucket_seconds, cache_size
        )

    return view


class WorkerFleet:
    """The fleet rules over the worker's table: a FleetWindow per tool key, rows counted before
    (the same source partition at or below the offset last counted) dropped, a new key past
    the policy's `max_tools` on this worker not kept."""

    def __init__(
        self,
        policy: Policy,
        states: DecodedStates,
        tally: Tally | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.fleet = policy.fleet  # --mode observe made its action flag already
        self.states = states
        self.tally = Tally() if tally is None else tally
        self.clock = clock
        self._told = False

    def _window(self, key: str) -> FleetWindow | None:
        window: Any = self.states.get(key)
        if window is not None:
            return window
        if self.states.indexed() >= self.fleet.max_tools:
            return None
        return FleetWindow(self.fleet)

    def observe_rows(self, key: tuple[str, str], rows: list[ToolRow]) -> list[Decision]:
        """One message's rows of one tool key: each counted once, the decisions taken."""
        text = tool_key(*key)
        window = self._window(text)
        if window is None:
            self.tally.add(ToolScopeCount.OVER_TOOL_CAP, len(rows))
            if not self._told:
                self._told = True
                log.warning(
                    "tool scope: more than %d tools on this worker; the calls of new ones are"
                    ' not counted (spanguard_tool_call_records_total{what="over_tool_cap"})',
                    self.fleet.max_tools,
                )
            return []
        counted_before = dict(window.sources)
        reached: dict[str, int] = {}
        window.last_seen = self.clock() if self.clock is not None else 0.0
        now = datetime.fromtimestamp(window.last_seen, UTC) if self.clock is not None else None
        decisions: list[Decision] = []
        for row in rows:
            source, offset = row[1], row[2]
            if source is not None:
                if offset <= counted_before.get(source, -1):
                    self.tally.add(ToolScopeCount.DUPLICATES)
                    continue
                reached[source] = max(reached.get(source, -1), offset)
            # Each record as the incident stood then: one record may open and close it.
            found = _observe_row(window, key, row)
            if found:  # most rows: none
                decisions.extend(
                    incident_decision(incident, self.fleet, detected=now) for incident in found
                )
        for source, offset in reached.items():
            window.sources.pop(source, None)  # most recently counted last
            window.sources[source] = offset
        while len(window.sources) > MAX_SOURCES:
            del window.sources[next(iter(window.sources))]
        window.incidents.clear()  # the table keeps the open incident in its key
        self.states[text] = window  # type: ignore[assignment]
        return decisions

    def retract(self, decision: Decision) -> None:
        """An incident's record not written: the incident is not open, it can open again."""
        scope = decision.scope
        if scope is None or scope.tool is None or decision.action == "recovered":
            return
        text = tool_key(scope.tool, scope.server or "")
        window: Any = self.states.get(text)
        if window is None:
            return
        held = window.keys.get((scope.tool, scope.server or ""))
        if held is not None and held.incident is not None and held.incident.rule == decision.rule:
            held.incident = None
            self.states[text] = window


def _observe_row(window: FleetWindow, key: tuple[str, str], row: ToolRow) -> list[FleetIncident]:
    """One row into the window: a trace's summed calls replayed as calls (the last one as it
    ended, so the trace counts as failing or not as its last call did), or a decision."""
    tool, server = key
    if row[0] == "d":
        _, _, _, trace_id, end, args_hash = row
        found = window.observe_decision(tool, server, args_hash, trace_id, end)
        return [] if found is None else [found]
    _, _, _, trace_id, agent, end, calls, failures, empties, last = row
    return window.observe_summed(
        tool, server, trace_id, agent, end, (calls, failures, empties, last)
    )
