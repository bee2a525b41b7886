"""agent_fan_out: more agent runs in one trace than `multi_agent.max_sub_agents` beyond the
first (a supervisor starting workers, agents called as tools, handoffs).

Each run counts when its span ends, so a supervisor fanning out trips at the worker over the
limit, while it is still running.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spanguard.detection.rules.base import OFF, AgentRule, Trip
from spanguard.schemas.decision import Evidence

if TYPE_CHECKING:
    from spanguard.detection.conventions.events import AgentRun
    from spanguard.detection.trace_state import TraceState
    from spanguard.schemas.policy import AgentPolicy

__all__ = ["AgentFanOut"]


class AgentFanOut(AgentRule):
    name = "agent_fan_out"
    catches = "more agent runs in one trace than `max_sub_agents` beyond its first"
    settings = "multi_agent: {max_sub_agents: 20}"
    default_action = "kill"

    def wanted(self, policy: AgentPolicy) -> str:
        return policy.action if policy.multi_agent.max_sub_agents is not None else OFF

    def check_run(self, state: TraceState, run: AgentRun, policy: AgentPolicy) -> Trip | None:
        tree = state.agent_tree
        limit = policy.multi_agent.max_sub_agents
        if tree is None or limit is None:
            return None
        sub_agents = tree.started - 1
        if sub_agents <= limit:
            return None
        agents = tree.agent_names()
        return Trip(
            f"{sub_agents} sub-agents started in one trace ({', '.join(agents)}), over {limit}",
            Evidence(threshold=limit, agents=agents, sub_agents=sub_agents),
            message=(
                f"{sub_agents} sub-agents have been started for this task. Start no more:"
                " answer with what they found."
            ),
        )
