"""handoff_cycle: agents handing the run to each other in the same sequence (the same agents,
and the same inputs where the spans record them) `multi_agent.cycles` times in a row with
nothing new between; it trips at the handoff that completes the last repetition.

Nothing new: no call between the handoffs made for the first time in the trace's window that
brought content back (a lookup, an edit), as tool_loop counts new work. With the default of 2,
triage -> billing -> triage -> billing trips at the 4th handoff, one before tool_loop would
on the 3rd same handoff. Handoffs are this rule's: while it is on, tool_loop and cycle leave a
handoff alone, so one trace gets one decision for one ping-pong (handoff_cycle's, which names
the agents).

A transfer that names no agent (Google ADK without content capture) hands to the first other
agent seen after it, else to the agent making the next transfer; its handoff is known at that
next transfer (AgentTree.add_transfer). Between handoffs known so, a call whose arguments are
not recorded may be new work, and breaks the cycle.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spanguard.detection.agent_tree import MAX_NAMED, AgentTree
from spanguard.detection.results import is_content
from spanguard.detection.rules.base import OFF, ToolCallRule, Trip
from spanguard.schemas.decision import Evidence

if TYPE_CHECKING:
    from spanguard.detection.conventions.events import ToolCall
    from spanguard.detection.trace_state import CallKey, TraceState
    from spanguard.schemas.policy import AgentPolicy

__all__ = ["HandoffCycle", "handing_to"]

HANDOFF_PREFIX = "handoff to "


def handing_to(call: ToolCall) -> str:
    """The agent a handoff call hands the run to."""
    return call.tool_name.removeprefix(HANDOFF_PREFIX)


class HandoffCycle(ToolCallRule):
    name = "handoff_cycle"
    catches = (
        "agents handing the run to each other in the same sequence (same inputs where"
        " recorded) `cycles` times in a row with nothing new between"
    )
    settings = "multi_agent: {cycles: 2}"
    default_action = "kill"
    agents_only = True

    def wanted(self, policy: AgentPolicy) -> str:
        return policy.action if policy.multi_agent.cycles is not None else OFF

    def check(
        self, state: TraceState, call: ToolCall, key: CallKey, policy: AgentPolicy
    ) -> Trip | None:
        """Called on the counted calls of traces with agents, in the window already: a handoff
        is remembered and checked; new work (a call once in the window that brought content
        back) forgets the handoffs before it."""
        tree = state.agent_tree
        if not call.handoff:
            if tree is not None and tree.handoffs and state.window.count(key) == 1:
                result = key[2]
                if result is not None and is_content(result):
                    tree.handoffs.clear()
            return None
        if tree is None:
            tree = state.agent_tree = AgentTree()
        if call.tool_name.startswith(HANDOFF_PREFIX):
            tree.add_handoff(key, handing_to(call))
        else:  # a transfer naming no agent: known at the next transfer (AgentTree.add_transfer)
            resolved = tree.add_transfer(key, call.agent_name or "?")
            if resolved is None:
                return None
            key = resolved
        cycles = policy.multi_agent.cycles
        if cycles is None:
            return None
        period = tree.repeated_handoffs(cycles)
        if not period:
            return None
        handoffs = tree.handoffs[-period * cycles :]
        agents = [to_agent for _key, to_agent in handoffs][-MAX_NAMED:]
        sequence = " -> ".join(agents[-period:])
        return Trip(
            f"agents handed the run round the same {period} handoff(s) ({sequence})"
            f" {cycles}x with nothing new between",
            Evidence(
                tool_name=key[0],
                args_hash=key[1],
                hits=cycles,
                steps=len(handoffs),
                threshold=cycles,
                period=period if period > 1 else None,
                agents=agents,
            ),
            message=(
                f"The agents have handed the task back and forth {cycles} times ({sequence})"
                " with nothing new. Stop handing off: do the work or report what is missing."
            ),
        )
