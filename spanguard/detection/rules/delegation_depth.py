"""delegation_depth: agents nested in one another (an agent calling an agent as a tool, that
one calling another...) deeper than `multi_agent.max_depth`.

Spans end inner first, so the depth of a chain is known as its outer agents end: a chain of
`max_depth + 1` agents trips when the outermost of those ends (spanguard/detection/agent_tree.py),
before the agents above it return.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spanguard.detection.rules.base import OFF, AgentRule, Trip
from spanguard.schemas.decision import Evidence

if TYPE_CHECKING:
    from spanguard.detection.conventions.events import AgentRun
    from spanguard.detection.trace_state import TraceState
    from spanguard.schemas.policy import AgentPolicy

__all__ = ["DelegationDepth"]


class DelegationDepth(AgentRule):
    name = "delegation_depth"
    catches = "agents nested in one another (agents called as tools) deeper than `max_depth`"
    settings = "multi_agent: {max_depth: 5}"
    default_action = "kill"

    def wanted(self, policy: AgentPolicy) -> str:
        return policy.action if policy.multi_agent.max_depth is not None else OFF

    def check_run(self, state: TraceState, run: AgentRun, policy: AgentPolicy) -> Trip | None:
        tree = state.agent_tree
        limit = policy.multi_agent.max_depth
        if tree is None or limit is None or tree.deepest <= limit:
            return None
        agents = tree.deepest_chain()
        return Trip(
            f"agents nested {tree.deepest} deep ({' -> '.join(agents)}), over {limit}",
            Evidence(threshold=limit, agents=agents, depth=tree.deepest),
            message=(
                f"Agents have delegated {tree.deepest} levels deep. Stop delegating: answer"
                " with what you have."
            ),
        )
