"""The agent-windows agent: the agent usage topic's rows counted into each agent's rolling
window, over the agent window table (streams/agent_windows.py has the scope's worker parts,
streams/scope.py what every scope's agent shares)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import faust

from spanguard.schemas.decision import Decision
from spanguard.streams.agent_windows import (
    AgentWindowCount,
    Row,
    WorkerAgentBudgets,
    decode_usage,
    longest_window,
)
from spanguard.streams.decoded_states import DecodedStates
from spanguard.streams.fence import Lease
from spanguard.streams.scope import ScopeRecordsAgent

if TYPE_CHECKING:
    from spanguard.streams.wiring import Worker

__all__ = ["AgentWindowsAgent"]

AgentRows = tuple[tuple[str, str | None], list[Row]]


class AgentWindowsAgent(ScopeRecordsAgent[AgentRows]):
    """Counts each message's rows into its agent's window; a row counted before (the same
    source partition at or below the offset last counted) is dropped."""

    agent_name = "guard-agent-windows"
    record_name = "agent usage record"
    states_name = "agent windows"
    evicted = AgentWindowCount.EVICTED

    def __init__(
        self, worker: Worker, topic: faust.TopicT, states: DecodedStates, lease: Lease
    ) -> None:
        super().__init__(worker, topic, states, lease)
        self.outcomes = worker.tally(AgentWindowCount)
        policy = worker.guard.policy
        self.guard = WorkerAgentBudgets(policy, states, self.outcomes, clock=worker.guard.clock)
        # An agent idle a whole window (or the state TTL, if longer) has an empty window.
        self.idle_after = max(worker.settings.state_ttl, float(longest_window(policy)))

    def decode(self, key: bytes | None, value: bytes | None) -> AgentRows:
        return decode_usage(key, value)

    def decide_message(self, decoded: AgentRows) -> list[Decision]:
        agent, rows = decoded
        self.outcomes.add(AgentWindowCount.RECORDS_READ, len(rows))
        decisions = self.guard.observe_rows(agent, rows)
        self.outcomes.add(AgentWindowCount.DECISIONS, len(decisions))
        return decisions

    def retract(self, decision: Decision) -> None:
        self.guard.retract(decision)

    def lost_signal(self, decision: Decision) -> tuple[str, dict[str, Any]]:
        return "agent kill signal not sent; it can trip again", {"service": decision.agent.service}
