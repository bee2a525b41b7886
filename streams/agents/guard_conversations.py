"""The conversation agent: the conversation topic's records decided per conversation, over the
conversation table (streams/conversations.py has the scope's worker parts, streams/scope.py
what every scope's agent shares)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from spanguard.schemas.decision import Decision
from spanguard.streams.conversations import (
    ConversationCount,
    Record,
    WorkerConversations,
    decode_records,
)
from spanguard.streams.decoded_states import DecodedStates
from spanguard.streams.scope import ScopeRecordsAgent

if TYPE_CHECKING:
    from spanguard.streams.wiring import Worker

__all__ = ["ConversationAgent"]


class ConversationAgent(ScopeRecordsAgent[list[Record]]):
    """Decides each record of the conversation topic over its conversation's state; a record
    seen before (sent again after a crash) is dropped by its span id."""

    agent_name = "guard-conversations"
    record_name = "conversation record"
    states_name = "conversations"
    counts = ConversationCount
    evicted = ConversationCount.EVICTED
    guard: WorkerConversations

    def make_guard(self, worker: Worker, states: DecodedStates) -> WorkerConversations:
        return WorkerConversations(worker.guard.policy, states, clock=worker.guard.clock)

    def decode(self, key: bytes | None, value: bytes | None) -> list[Record]:
        return decode_records(key, value)

    def decide_message(self, decoded: list[Record]) -> list[Decision]:
        decisions: list[Decision] = []
        before = self.guard.duplicates
        for record in decoded:
            decision = self.guard.observe(record)
            if decision is not None:
                decisions.append(decision)
        self.outcomes.add(ConversationCount.RECORDS_READ, len(decoded))
        self.outcomes.add(ConversationCount.DUPLICATES, self.guard.duplicates - before)
        self.outcomes.add(ConversationCount.DECISIONS, len(decisions))
        return decisions

    def retract(self, decision: Decision) -> None:
        self.guard.retract(decision)

    def lost_signal(self, decision: Decision) -> tuple[str, dict[str, Any]]:
        message = "conversation kill signal not sent; it can trip again"
        return message, {
            "conversation_id": decision.scope.conversation_id if decision.scope else None
        }
