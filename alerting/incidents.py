"""Open fleet incidents, as the paging agent knows them: one page per cause.

A fleet incident (a decision of scope "tool", spanguard/detection/fleet.py) is paged once; its
`recovered` record resolves the page. While it is open, the per-trace pages of traces decided
on its tool (their evidence names the tool) are folded into it: not paged, counted, and their
decisions still on the detections topic. Every worker learns of the incidents from every
partition of the detections topic (alerting/incident_reader.py, a thread) as well as from the
paging agent's own records, so whichever worker holds a trace folds its page; a restarted worker
reads the topic back and still folds. Both call `record`: an opening record noted twice is
one incident, and one read after its recovery (a lagging partition) does not reopen it.

A value is the JSON of {incident trace id: {"rule", "server", "opened_at", "failing",
"folded", "noted_at"}}: a tool may have a `tool_failing` and a `loop_signature` incident open at
once. `noted_at` is when the record was appended to the topic (or read), which `prune` judges.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from spanguard.schemas.decision import Decision

__all__ = [
    "MAX_GAUGED_TOOLS",
    "MAX_OPEN_INCIDENTS",
    "OTHER_TOOLS",
    "FoldedInto",
    "OpenIncidents",
    "delivery_mark",
    "is_incident",
]

log = logging.getLogger("spanguard.alerting")

RECOVERED = "recovered"  # an incident's closing record (spanguard.detection.fleet.RECOVERED)
# The failing-traces gauge names at most this many tools (those with the most), so its series
# stay few whatever the fleet does.
MAX_GAUGED_TOOLS = 20
OTHER_TOOLS = "(other)"  # the gauge's series of the tools past MAX_GAUGED_TOOLS
# Incidents kept open at most, and closed ones remembered: far more than a fleet has tools
# failing at once; past it, the oldest are forgotten (their pages are paged, not folded).
MAX_OPEN_INCIDENTS = 10_000


def is_incident(decision: Decision) -> bool:
    """A fleet incident's record: one tool (or model) across every agent."""
    return decision.scope_kind == "tool"


def delivery_mark(decision: Decision) -> str:
    """What the delivered tables remember of a decision: its rule, or, for an incident's
    recovery (the same trace id and rule as its opening record), the rule and `:recovered`."""
    if decision.action == RECOVERED:
        return f"{decision.rule}:{RECOVERED}"
    return decision.rule


@dataclass(frozen=True, slots=True)
class FoldedInto:
    """A per-trace page folded into an open incident: which one, and how many so far."""

    tool: str
    incident: str  # the incident's trace id
    folded: int


class OpenIncidents:
    """The open incidents by tool, over a mutable mapping of bytes (a dict by default).

    Written by the incident reader's thread and by the paging agent on the event loop: every
    read-modify-write holds the lock, so a fold never writes back an incident just closed."""

    def __init__(self, table: MutableMapping[Any, Any] | None = None) -> None:
        self.table: MutableMapping[Any, Any] = {} if table is None else table
        self._lock = threading.Lock()
        # Incidents closed (trace ids), oldest first: their opening record read late is ignored.
        self._closed: OrderedDict[str, None] = OrderedDict()

    def _read(self, tool: str) -> dict[str, dict[str, Any]]:
        stored = self.table.get(tool.encode())
        if not stored:
            return {}
        try:
            value = json.loads(stored)
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}

    def _write(self, tool: str, incidents: dict[str, dict[str, Any]]) -> None:
        key = tool.encode()
        if incidents:
            self.table[key] = json.dumps(incidents, sort_keys=True).encode()
        elif key in self.table:
            del self.table[key]

    def record(self, decision: Decision, noted_at: float | None = None) -> int | None:
        """Note an incident's record: open it, or close it on `recovered`. Returns, on closing,
        how many per-trace pages this worker folded into it (None otherwise). `noted_at`: when
        the record was appended to the topic (default: now)."""
        scope = decision.scope
        if scope is None or not scope.tool:
            return None
        with self._lock:
            if decision.action == RECOVERED:
                return self._close(scope.tool, decision.trace_id)
            self._open(decision, scope.tool, time.time() if noted_at is None else noted_at)
        return None

    def _close(self, tool: str, incident_id: str) -> int:
        incidents = self._read(tool)
        closed = incidents.pop(incident_id, None)
        self._closed[incident_id] = None
        if len(self._closed) > MAX_OPEN_INCIDENTS:
            self._closed.popitem(last=False)
        if closed is None:
            return 0  # closed already (the reader and the paging agent both read it), or unknown
        self._write(tool, incidents)
        folded = int(closed.get("folded", 0))
        log.info(
            "fleet incident closed: %d per-trace page(s) were folded into it",
            folded,
            extra={"tool": tool, "incident": incident_id, "folded": folded},
        )
        return folded

    def _open(self, decision: Decision, tool: str, noted_at: float) -> None:
        if decision.trace_id in self._closed:
            return
        incidents = self._read(tool)
        if decision.trace_id in incidents:
            return
        incidents[decision.trace_id] = {
            "rule": decision.rule,
            "server": decision.scope.server if decision.scope else "",
            "opened_at": decision.detected_at,
            "failing": decision.evidence.hits or 0,
            "folded": 0,
            "noted_at": noted_at,
        }
        self._write(tool, incidents)
        if len(self.table) > MAX_OPEN_INCIDENTS:
            self._drop_oldest(len(self.table) - MAX_OPEN_INCIDENTS)

    def prune(self, cutoff: float) -> int:
        """Forget the incidents noted before `cutoff` (epoch seconds), as a worker started now
        would not read them back; returns how many."""
        with self._lock:
            return self._forget(lambda noted_at: noted_at < cutoff)

    def _drop_oldest(self, tools: int) -> None:
        oldest = sorted(self._noted_at().items(), key=lambda item: item[1])[:tools]
        for tool, _noted_at in oldest:
            del self.table[tool.encode()]

    def _noted_at(self) -> dict[str, float]:
        """Each tool's latest noted incident."""
        return {
            tool: max(float(i.get("noted_at", 0.0)) for i in incidents.values())
            for tool, incidents in self._tools()
        }

    def _forget(self, old: Callable[[float], bool]) -> int:
        forgotten = 0
        for tool, incidents in self._tools():
            kept = {i: v for i, v in incidents.items() if not old(float(v.get("noted_at", 0.0)))}
            forgotten += len(incidents) - len(kept)
            if len(kept) != len(incidents):
                self._write(tool, kept)
        return forgotten

    def _tools(self) -> list[tuple[str, dict[str, dict[str, Any]]]]:
        tools = []
        for key in list(self.table.keys()):
            tool = key.decode(errors="replace") if isinstance(key, bytes) else str(key)
            incidents = self._read(tool)
            if incidents:
                tools.append((tool, incidents))
        return tools

    def fold(self, decision: Decision) -> FoldedInto | None:
        """Fold a per-trace decision into the open incident on its tool, if there is one (the
        oldest, when two are): counted there, and logged."""
        tool = decision.evidence.tool_name
        if not tool or is_incident(decision):
            return None
        with self._lock:
            incidents = self._read(tool)
            if not incidents:
                return None
            incident_id = min(incidents, key=lambda i: str(incidents[i].get("opened_at")))
            incident = incidents[incident_id]
            incident["folded"] = int(incident.get("folded", 0)) + 1
            self._write(tool, incidents)
        folded = FoldedInto(tool, incident_id, incident["folded"])
        log.info(
            "page folded into the open fleet incident on %s (%d so far)",
            tool,
            folded.folded,
            extra={"trace_id": decision.trace_id, "rule": decision.rule, "incident": incident_id},
        )
        return folded

    def failing_traces(self, limit: int = MAX_GAUGED_TOOLS) -> dict[str, int]:
        """The tools with an open incident and the failing traces their incidents counted
        (the most of each tool's), the `limit` tools with the most, and OTHER_TOOLS: the sum
        of the rest."""
        with self._lock:
            tools = self._tools()
        failing = {
            tool: max(int(i.get("failing", 0)) for i in incidents.values())
            for tool, incidents in tools
        }
        ranked = sorted(failing.items(), key=lambda item: (-item[1], item[0]))
        top = dict(ranked[:limit])
        # The rest, summed: always there (0 with none), so the series exists before any incident.
        top[OTHER_TOOLS] = sum(traces for _tool, traces in ranked[limit:])
        return top
