"""The agent-windows agent: the agent usage topic's rows counted into each agent's rolling
window, over the agent window table (streams/agent_windows.py has the scope's worker parts,
streams/scope.py what every scope's agent shares)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from spanguard.schemas.decision import Decision
from spanguard.streams.agent_windows import (
    AgentWindowCount,
    Row,
    WorkerAgentBudgets,
    decode_usage,
    longest_window,
)
from spanguard.streams.decoded_states import DecodedStates
from spanguard.streams.scope import ScopeRowsAgent

if TYPE_CHECKING:
    from spanguard.schemas.policy import Policy
    from spanguard.streams.wiring import Worker

__all__ = ["AgentWindowsAgent"]

AgentRows = tuple[tuple[str, str | None], list[Row]]


class AgentWindowsAgent(ScopeRowsAgent[tuple[str, str | None], Row]):
    """Counts each message's rows into its agent's window; a row counted before (the same
    source partition at or below the offset last counted) is dropped."""

    agent_name = "guard-agent-windows"
    record_name = "agent usage record"
    states_name = "agent windows"
    counts = AgentWindowCount
    evicted = AgentWindowCount.EVICTED
    rows_read = AgentWindowCount.RECORDS_READ
    decided = AgentWindowCount.DECISIONS
    guard: WorkerAgentBudgets

    def make_guard(self, worker: Worker, states: DecodedStates) -> WorkerAgentBudgets:
        policy = worker.guard.policy
        return WorkerAgentBudgets(policy, states, self.outcomes, clock=worker.guard.clock)

    def idle_window(self, policy: Policy) -> float:
        return float(longest_window(policy))

    def decode(self, key: bytes | None, value: bytes | None) -> AgentRows:
        return decode_usage(key, value)

    def lost_signal(self, decision: Decision) -> tuple[str, dict[str, Any]]:
        return "agent kill signal not sent; it can trip again", {"service": decision.agent.service}
