"""tool_polling: the same call (tool, arguments) whose recorded result changes, seen
`polling.threshold` times in the last `polling.window` such calls: a job waited on forever."""

from __future__ import annotations

from typing import TYPE_CHECKING

from spanguard.detection.rules.base import OFF, ToolCallRule, Trip
from spanguard.detection.rules.tool_loop import recorded_arguments
from spanguard.schemas.decision import Evidence

if TYPE_CHECKING:
    from spanguard.detection.conventions.events import ToolCall
    from spanguard.detection.trace_state import CallKey, TraceState
    from spanguard.schemas.policy import AgentPolicy

__all__ = ["ToolPolling"]


class ToolPolling(ToolCallRule):
    name = "tool_polling"
    catches = (
        "the same call whose result changes without progressing (answers seen before),"
        " `threshold` times in the last `window`"
    )
    settings = "polling: {window: 30, threshold: 20, tools: []}"
    default_action = "kill"
    counts = True

    def wanted(self, policy: AgentPolicy) -> str:
        return policy.action if policy.polling.enabled else OFF

    @staticmethod
    def polled(key: CallKey, policy: AgentPolicy) -> bool:
        """A call this rule counts: arguments recorded, and a result (or a polling tool)."""
        tool, digest, result = key
        return digest is not None and (result is not None or tool in policy.polling.tools)

    def count(self, state: TraceState, call: ToolCall, key: CallKey, policy: AgentPolicy) -> None:
        tool, digest, result = key
        polling = policy.polling
        if digest is None or (result is None and tool not in polling.tools):
            return  # not polled (self.polled, inlined: this runs on every call)
        polls = state.polls
        polls.append((tool, digest))
        polls.drop_oldest(len(polls) - polling.window)

    def check(
        self, state: TraceState, call: ToolCall, key: CallKey, policy: AgentPolicy
    ) -> Trip | None:
        tool, digest, result = key
        polling = policy.polling
        if digest is None or (result is None and tool not in polling.tools):
            return None  # not polled
        hits = state.polls.count((tool, digest))
        if hits < polling.threshold:
            return None
        if result is not None and state.window.count(key) < 2:
            # An answer the recent calls have not seen: the job is moving (output growing, a
            # counter going up). Its count alone is no reason to stop it.
            return None
        steps = len(state.polls)
        return Trip(
            f"{tool} polled {hits}x in last {steps} calls with the same arguments",
            Evidence(
                tool_name=tool,
                args_hash=digest,
                hits=hits,
                window=polling.window,
                steps=steps,
                tool_arguments=recorded_arguments(call, policy),
            ),
            message=(
                f"You polled {tool} {hits} times with the same arguments. Stop waiting: report"
                " the last status you got, or try something else."
            ),
        )
