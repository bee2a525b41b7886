"""no_progress: different calls of one tool in a row that all come back with nothing found: an
empty list or object, a "no results" text (spanguard/detection/results.py: EMPTY).

A hit of the tool between them (a result with content) ends the streak: an agent sweeping a
grid of routes and dates gets empty answers between its hits, and is making progress. A
failure is not "nothing found" (the same call failing is tool_loop's), and neither is a tool
that answers nothing by design (a `think` tool's "").

Different calls answered by one same *content* are not a stall: edits each answered
`{"ok": true}`, searches answered by one canned text, a tool that returns a fixed
acknowledgement. Only a result that carries nothing counts, so this rule fires on the agent
that rephrases its query against an empty index and stays quiet on healthy work. The result is
recognised from its value when the span carries it, or from its hash (an agent hashing
before the span leaves) against the hashes of the same empty shapes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spanguard.detection.results import EMPTY, is_content
from spanguard.detection.rules.base import ToolCallRule, Trip
from spanguard.schemas.decision import Evidence

if TYPE_CHECKING:
    from spanguard.detection.conventions.events import ToolCall
    from spanguard.detection.trace_state import CallKey, TraceState
    from spanguard.schemas.policy import AgentPolicy

__all__ = ["NoProgress"]


class NoProgress(ToolCallRule):
    name = "no_progress"
    catches = (
        "`threshold` different calls of one tool in the loop window that all found nothing"
        " (empty, no results), with no hit of the tool between"
    )
    settings = "no_progress: {threshold: 4, action: flag}"
    default_action = "flag"

    def wanted(self, policy: AgentPolicy) -> str:
        return policy.no_progress.action

    def check(
        self, state: TraceState, call: ToolCall, key: CallKey, policy: AgentPolicy
    ) -> Trip | None:
        tool, digest, result = key
        if result != EMPTY or digest is None:
            return None
        window = policy.loop.window
        distinct: set[str] = set()
        for name, seen_digest, seen_result in state.window.newest_first(window):
            if name != tool:
                continue
            if seen_result == EMPTY:
                if seen_digest is not None:
                    distinct.add(seen_digest)
            elif seen_result is not None and is_content(seen_result):
                break  # a hit: the tool is finding things
        if len(distinct) < policy.no_progress.threshold:
            return None
        steps = min(len(state.window), window)
        return Trip(
            f"{len(distinct)} different {tool} calls in last {steps} steps all found nothing",
            Evidence(
                tool_name=tool,
                result_hash=result,
                hits=len(distinct),
                window=window,
                steps=steps,
            ),
            message=(
                f"Your last {len(distinct)} different {tool} calls all came back empty."
                " Rephrasing will not help: report what you have or try another tool."
            ),
        )
