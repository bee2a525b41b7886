"""The tool scope agent: the tool call topic's rows counted into each tool key's window, over
the tool window table (streams/tool_scope.py has the scope's worker parts, streams/scope.py what
every scope's agent shares)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from spanguard.schemas.decision import Decision
from spanguard.schemas.scope_records import ToolRow, decode_tool_calls
from spanguard.streams.decoded_states import DecodedStates
from spanguard.streams.scope import ScopeRowsAgent
from spanguard.streams.tool_scope import ToolScopeCount, WorkerFleet

if TYPE_CHECKING:
    from spanguard.schemas.policy import Policy
    from spanguard.streams.wiring import Worker

__all__ = ["ToolScopeAgent"]

ToolRows = tuple[tuple[str, str], list[ToolRow]]


class ToolScopeAgent(ScopeRowsAgent[tuple[str, str], ToolRow]):
    """Counts each message's rows into its tool key's window; a row counted before (the same
    source partition at or below the offset last counted) is dropped. An incident's records go
    to the detections topic; an incident of action `contain` (and its recovery) also sends
    the signed signal scoped to its tool, through the outbox's `tool_signals` hook
    (streams/delivery.py, spanguard/detection/fleet_signals.py)."""

    agent_name = "guard-tools"
    record_name = "tool call record"
    states_name = "tool windows"
    counts = ToolScopeCount
    evicted = ToolScopeCount.EVICTED
    rows_read = ToolScopeCount.RECORDS_READ
    decided = ToolScopeCount.DECISIONS
    guard: WorkerFleet

    def make_guard(self, worker: Worker, states: DecodedStates) -> WorkerFleet:
        return WorkerFleet(worker.guard.policy, states, self.outcomes, clock=worker.guard.clock)

    def idle_window(self, policy: Policy) -> float:
        return float(policy.fleet.window)

    def decode(self, key: bytes | None, value: bytes | None) -> ToolRows:
        return decode_tool_calls(key, value)

    def lost_signal(self, decision: Decision) -> tuple[str, dict[str, Any]]:
        tool = decision.scope.tool if decision.scope is not None else None
        return "tool incident record not sent; it can open again", {"tool": tool}
