"""What the scopes beyond the trace share in the pure kernel: the conversation scope
(conversation.py) and the agent scope over time (agent_budget.py).

A scope decides over the records the trace guard hands it (a conversation's calls and usage, an
agent's usage), each keyed by the scope's key, in a state per key. The trace guard hands them
through the scope's sink protocol (`ConversationSink`, `AgentUsageSink`): a `ScopeGuard`
subclass decides them (replay, the in-process processor, the worker's scope agents); the
worker's span agent gives the guard a recorder instead, which keeps the records for its scope's
topic and decides nothing (streams/scope.py).

`ScopeGuard` is what the deciding scopes share: the policy entry of an agent, the decisions the
trace guard has not collected yet (`take`), a decision of the scope's built the one way
(`scope_decision`: its id deterministic, so a decision replayed after a crash carries the same
one), and what is logged once. A subclass keeps its states and says what it decides and what
a signal not sent takes back (`retract`). The tool scope (the calls of a tool across every
agent, over a window: fleet.py's FleetGuard) is a third subclass: its sink fed the counted
calls, its window per tool key, its `retract`.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Protocol

from mypy_extensions import mypyc_attr

from spanguard.detection.conventions.keys import AGENT_NAME, SERVICE_NAME
from spanguard.detection.trace_state import iso_from_micros
from spanguard.schemas.decision import (
    NO_EVIDENCE,
    NO_SPEND,
    AgentIdentity,
    Decision,
    DecisionScope,
    Evidence,
    PolicyInForce,
    ScopeKind,
    Spend,
)
from spanguard.schemas.policy import AgentPolicy, Policy

__all__ = ["MAX_TOLD", "ScopeGuard", "ScopeRecord", "policy_for"]

log = logging.getLogger("spanguard.core")

# Messages a scope logs once each, at most.
MAX_TOLD = 4096


class ScopeRecord(Protocol):
    """What every record a scope decides on names: the trace and span it came from, when the
    span ended, and the agent."""

    trace_id: str
    span_id: bytes
    end_time_unix_nano: int
    service: str
    agent_name: str | None


def policy_for(policy: Policy, service: str, agent_name: str | None) -> AgentPolicy:
    """The policy entry of an agent, from the identity a scope's record carries."""
    if not policy.rules:
        return policy.defaults
    attributes = {SERVICE_NAME: service}
    if agent_name is not None:
        attributes[AGENT_NAME] = agent_name
    return policy.for_attributes(attributes)


@mypyc_attr(allow_interpreted_subclasses=True)  # the agent scope is not compiled
class ScopeGuard:
    """The part every deciding scope shares (see the module's notes)."""

    def __init__(
        self, policy: Policy, scope: ScopeKind, clock: Callable[[], float] = time.time
    ) -> None:
        self.policy = policy
        self.scope = scope  # its decisions' scope kind
        self.clock = clock
        self.pending: list[Decision] = []  # decisions the trace guard has not collected yet
        self.decisions = 0
        self._told: set[str] = set()

    def take(self) -> list[Decision]:
        """The decisions taken since the last call (the guard returns them with its own)."""
        taken, self.pending = self.pending, []
        return taken

    def retract(self, decision: Decision) -> None:
        """Undo the mark of a decision of this scope whose signal could not be sent."""
        raise NotImplementedError

    def policy_of(self, service: str, agent_name: str | None) -> AgentPolicy:
        return policy_for(self.policy, service, agent_name)

    def tell_once(self, what: str, message: str, *args: object) -> None:
        if what in self._told or len(self._told) >= MAX_TOLD:
            return
        self._told.add(what)
        log.warning(message, *args)

    def scope_decision(
        self,
        record: ScopeRecord,
        policy: AgentPolicy,
        rule: str,
        action: str,
        reason: str,
        decision_text: str,
        detected: datetime | None = None,
        *,
        evidence: Evidence = NO_EVIDENCE,
        spend: Spend = NO_SPEND,
        conversation_id: str | None = None,
        traces: int | None = None,
        until: str | None = None,
    ) -> Decision:
        """A decision of this scope at `record` (detected now unless `detected` says when);
        its id is a hash of `decision_text`, deterministic: the same decision taken again after
        a crash carries the same id. `until`: when a kill of the scope lifts."""
        entry, match = self.policy.entry_of(policy)
        self.decisions += 1
        if detected is None:
            detected = datetime.fromtimestamp(self.clock(), UTC)
        ended = record.end_time_unix_nano
        return Decision(
            trace_id=record.trace_id,
            span_id=record.span_id.hex(),
            rule=rule,  # type: ignore[arg-type]
            action=action,  # type: ignore[arg-type]
            reason=reason,
            agent=AgentIdentity(record.service, record.agent_name),
            detected_at=detected.isoformat(timespec="milliseconds"),
            evidence=evidence,
            spend=spend,
            policy=PolicyInForce(entry, match, policy.severity, policy.autonomous),
            span_ended_at=iso_from_micros(ended // 1000) if ended > 0 else None,
            scope=DecisionScope(self.scope, conversation_id, traces, until),
            decision_id=hashlib.sha256(decision_text.encode()).hexdigest()[:32],
        )
