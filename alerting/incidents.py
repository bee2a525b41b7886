"""Open fleet incidents, as the paging agent knows them: one page per cause.

A fleet incident (a decision of scope "tool", spanguard/detection/fleet.py) is paged once; its
`recovered` record resolves the page. While it is open, the per-trace pages of traces decided
on its tool (their evidence names the tool) are folded into it: not paged, counted, and their
decisions still on the detections topic. The open incidents live in a mapping the worker backs
with a changelog-backed table keyed by tool name (streams/app.py), so a restarted worker still
folds. With two workers or more, a worker does not yet see the incidents the other one noted
(docs/fleet.md, "What it cannot do").

A value is the JSON of {incident trace id: {"rule", "server", "opened_at", "failing",
"folded"}}: a tool may have a `tool_failing` and a `loop_signature` incident open at once.
"""

from __future__ import annotations

import json
import logging
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

from spanguard.schemas.decision import Decision

__all__ = [
    "MAX_GAUGED_TOOLS",
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
    """The open incidents by tool, over a mutable mapping of bytes (a Faust table, or a dict)."""

    def __init__(self, table: MutableMapping[Any, Any] | None = None) -> None:
        self.table: MutableMapping[Any, Any] = {} if table is None else table

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

    def record(self, decision: Decision) -> int | None:
        """Note an incident's record: open it, or close it on `recovered`. Returns, on closing,
        how many per-trace pages were folded into it (None otherwise)."""
        scope = decision.scope
        if scope is None or not scope.tool:
            return None
        incidents = self._read(scope.tool)
        if decision.action == RECOVERED:
            closed = incidents.pop(decision.trace_id, None)
            self._write(scope.tool, incidents)
            folded = int(closed.get("folded", 0)) if closed else 0
            log.info(
                "fleet incident closed: %d per-trace page(s) were folded into it",
                folded,
                extra={"tool": scope.tool, "incident": decision.trace_id, "folded": folded},
            )
            return folded
        if decision.trace_id not in incidents:
            incidents[decision.trace_id] = {
                "rule": decision.rule,
                "server": scope.server,
                "opened_at": decision.detected_at,
                "failing": decision.evidence.hits or 0,
                "folded": 0,
            }
            self._write(scope.tool, incidents)
        return None

    def fold(self, decision: Decision) -> FoldedInto | None:
        """Fold a per-trace decision into the open incident on its tool, if there is one (the
        oldest, when two are): counted there, and logged."""
        tool = decision.evidence.tool_name
        if not tool or is_incident(decision):
            return None
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
        failing: dict[str, int] = {}
        for key in list(self.table.keys()):
            tool = key.decode(errors="replace") if isinstance(key, bytes) else str(key)
            incidents = self._read(tool)
            if incidents:
                failing[tool] = max(int(i.get("failing", 0)) for i in incidents.values())
        ranked = sorted(failing.items(), key=lambda item: (-item[1], item[0]))
        top = dict(ranked[:limit])
        # The rest, summed: always there (0 with none), so the series exists before any incident.
        top[OTHER_TOOLS] = sum(traces for _tool, traces in ranked[limit:])
        return top
