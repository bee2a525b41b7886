"""The timelines the replay and backtest pages draw: a guard observer (`Timelines`) that keeps
each trace's tool calls in order, as the guard keyed them, and its decisions.

Data only: the pages themselves are rendered by the CLI (cli/report.py). Keys are the guard's
own, and arguments appear only as their hashes, as everywhere else.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from spanguard.detection.conventions.events import ToolCall
from spanguard.detection.rules.base import GuardObserver
from spanguard.detection.trace_state import CallKey, TraceState
from spanguard.schemas.decision import Decision

__all__ = ["MAX_CALLS_PER_TRACE", "Call", "Timeline", "Timelines"]

# Calls kept per trace for the page; a trace that ran longer shows its first ones and a count.
MAX_CALLS_PER_TRACE = 2000


@dataclass(slots=True)
class Call:
    span_id: str
    tool_name: str
    args_hash: str | None
    result_hash: str | None
    ended_unix_nano: int
    counted: bool  # False: no rule counted it (no arguments recorded, or an exempt tool)


@dataclass
class Timeline:
    """One trace as the page shows it."""

    service: str = "unknown_service"
    agent_name: str | None = None
    calls: list[Call] = field(default_factory=list)
    dropped: int = 0  # calls beyond MAX_CALLS_PER_TRACE
    # (decision, calls seen when it fired): a token budget fires on an inference span.
    decisions: list[tuple[Decision, int]] = field(default_factory=list)


class Timelines(GuardObserver):
    """A guard observer that remembers every tool call per trace, as the guard keyed it, and
    the decisions: what the page draws (`guard.add_observer(Timelines())`)."""

    def __init__(self) -> None:
        self.timelines: dict[str, Timeline] = defaultdict(Timeline)

    def on_tool_call(
        self, trace_id: str, state: TraceState, call: ToolCall, key: CallKey | None
    ) -> None:
        timeline = self.timelines[trace_id]
        timeline.service, timeline.agent_name = state.service, state.agent_name
        if len(timeline.calls) >= MAX_CALLS_PER_TRACE:
            timeline.dropped += 1
            return
        timeline.calls.append(
            Call(
                span_id=call.span_id.hex(),
                tool_name=call.tool_name,
                args_hash=key[1] if key is not None else None,
                result_hash=key[2] if key is not None else None,
                ended_unix_nano=call.end_time_unix_nano,
                counted=key is not None,
            )
        )

    def on_decision(self, decision: Decision, state: TraceState) -> None:
        timeline = self.timelines[decision.trace_id]
        timeline.service, timeline.agent_name = state.service, state.agent_name
        timeline.decisions.append((decision, len(timeline.calls)))

    def tripped(self) -> dict[str, Timeline]:
        """The timelines of traces with at least one decision, in the order they tripped."""
        found = {t: line for t, line in self.timelines.items() if line.decisions}
        return dict(sorted(found.items(), key=lambda item: item[1].decisions[0][0].detected_at))
