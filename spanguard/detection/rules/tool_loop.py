"""tool_loop: the same call with the same result (or none recorded), `threshold` times in the
last `window` calls of the trace, with no new work between the repeats.

New work is a call made only once in the window that brought content back: an edit, a
different query answered. A coding agent re-running the same tests after each different edit
learns something each time, and is not stuck; the same no-op edit again and again is. Calls
that bring nothing (a `think` tool answering "", a search finding nothing, a call failing) are
not new work: the same booking rejected three times with a `think` between each is a loop.
Repeats interleaved with other repeats still count: stuck agents go round.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from spanguard.detection.conventions.events import MISSING
from spanguard.detection.results import ERROR, NOTHING, is_content
from spanguard.detection.rules.base import OFF, ToolCallRule, Trip
from spanguard.schemas.decision import Evidence

if TYPE_CHECKING:
    from spanguard.detection.conventions.events import ToolCall
    from spanguard.detection.trace_state import CallKey, TraceState
    from spanguard.schemas.policy import AgentPolicy

__all__ = ["ToolLoop", "recorded_arguments", "repeats_without_new_work"]


def repeats_without_new_work(window: Any, key: CallKey, last: int) -> int:
    """How many times `key`, the newest call of `window`, was made among its last `last`
    calls with no new work between (see the module's docstring). New work is a call made
    once in the window: one made again is part of the round, wherever the window starts."""
    calls = list(window)
    counts = Counter(calls)
    newest = len(calls) - 1
    oldest = max(0, len(calls) - last)
    with_content = {
        tool for tool, _digest, result in calls if result is not None and is_content(result)
    }
    repeats = 1
    for index in range(newest - 1, oldest - 1, -1):
        seen = calls[index]
        if seen == key:
            repeats += 1
            continue
        if counts.get(seen, 0) > 1:
            continue  # a call made again: part of the round, nothing new
        result = seen[2]
        if is_content(result) or (result == NOTHING and seen[0] in with_content):
            break  # new work: a call made once that brought something back
    return repeats


def recorded_arguments(call: ToolCall, policy: AgentPolicy) -> Any:
    """The raw arguments for a decision, only where the policy asks to keep them."""
    if not policy.record_arguments or call.arguments is MISSING:
        return None
    return call.arguments


class ToolLoop(ToolCallRule):
    name = "tool_loop"
    catches = (
        "the same call with the same result (or failing again), `threshold` times in the last"
        " `window` calls with no new work between"
    )
    settings = "loop: {window: 10, threshold: 3, failing_threshold: null}"
    default_action = "kill"

    def wanted(self, policy: AgentPolicy) -> str:
        return policy.action if policy.loop.enabled else OFF

    def check(
        self, state: TraceState, call: ToolCall, key: CallKey, policy: AgentPolicy
    ) -> Trip | None:
        tool, digest, result = key
        if digest is not None and tool in policy.polling.tools:
            return None  # the policy says this tool polls: tool_polling governs it
        loop = policy.loop
        window, threshold = loop.window, loop.threshold
        tool_policy = policy.tool(tool) if policy.tools else None
        if tool_policy is not None:
            window = tool_policy.window or window
            threshold = tool_policy.threshold or threshold
        if result == ERROR and loop.failing_threshold is not None:
            threshold = loop.failing_threshold
        calls = state.window
        if len(calls) > window:
            # The trace keeps a wider window (another tool's, or the cycle rule's): count this
            # tool's own window.
            hits = calls.count_recent(key, window)
            steps = window
        else:
            hits = calls.count(key)
            steps = len(calls)
        if hits < threshold:
            return None
        if digest is not None:
            hits = repeats_without_new_work(calls, key, window)
            if hits < threshold:
                return None
        if call.handoff and policy.multi_agent.cycles is not None:
            return None  # handoffs are handoff_cycle's while it is on
        reason = f"{tool} called {hits}x in last {steps} steps"
        if digest is None:
            # A name alone cannot tell a loop from twelve different searches: flag, once.
            return Trip(
                reason + " (arguments not recorded: keyed on the tool name alone, flagged only)",
                Evidence(tool_name=tool, result_hash=result, hits=hits, window=window, steps=steps),
                flag_only=True,
            )
        if result is not None:
            reason += " with the same result"
        return Trip(
            reason,
            Evidence(
                tool_name=tool,
                args_hash=digest,
                result_hash=result,
                hits=hits,
                window=window,
                steps=steps,
                threshold=threshold,
                calls=state.window_calls(window),  # the evidence: the window as it tripped
                tool_arguments=recorded_arguments(call, policy),
            ),
            message=(
                f"You called {tool} {hits} times with the same arguments; the tool returns the"
                " same result. Try a different approach or stop and report what you found."
            ),
        )
