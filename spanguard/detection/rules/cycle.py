"""cycle: a sequence of calls (same tools, same arguments, same results) of any period from 2
to `cycle.max_period` repeated `cycle.repeats` times in a row; it trips at the call that
completes the last repetition.

A stuck coding agent goes round list_dir, read_file, grep, run_tests with the same arguments
and the same results: no single call repeats often enough in a short window for tool_loop, yet
the whole round repeats. For every period p the state keeps a run length: how many calls in a
row equalled the call p calls before them. A sequence of period p repeated N times is a run of
(N - 1) * p. Each call updates the runs in O(max_period), and in O(1) when the call is new to
the window (every run breaks), which is what healthy agents mostly do. A result that changes
(tests re-run while the failures go down) makes the call differ from its predecessor and breaks
the run, as a changing result breaks a loop; `cycle.compare_results: false` compares calls by
tool and arguments alone, for agents whose rounds must stop however their results change.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from spanguard.detection.rules.base import OFF, ToolCallRule, Trip
from spanguard.schemas.decision import Evidence

if TYPE_CHECKING:
    from spanguard.detection.conventions.events import ToolCall
    from spanguard.detection.trace_state import CallKey, TraceState
    from spanguard.schemas.policy import AgentPolicy

__all__ = ["Cycle"]


class Cycle(ToolCallRule):
    name = "cycle"
    catches = (
        "a sequence of 2..`max_period` calls (same tools, arguments and results) repeated"
        " `repeats` times in a row"
    )
    settings = "cycle: {max_period: 10, repeats: 3}"
    default_action = "kill"
    counts = True

    def wanted(self, policy: AgentPolicy) -> str:
        return policy.action if policy.cycle.enabled else OFF

    def count(self, state: TraceState, call: ToolCall, key: CallKey, policy: AgentPolicy) -> None:
        """Called before the call joins the window, which holds the last max_period calls."""
        cycle = policy.cycle
        if not cycle.enabled:
            return
        compare_results = cycle.compare_results
        window = state.window
        if key[1] is None or (compare_results and not window.count(key)):
            # Not recorded (a tool name alone cannot tell a cycle from fresh arguments), or
            # not among the last max_period calls: every run breaks.
            state.cycle_runs = None
            return
        periods = cycle.max_period
        runs = state.cycle_runs or [0] * periods
        if len(runs) != periods:  # another policy entry's max_period: keep what fits
            runs = (runs + [0] * periods)[:periods]
        # The calls 1, 2, ... max_period back: run[p - 1] grows where the call p back is equal
        # (with its result, or by tool and arguments alone).
        equal = window.matches_back(key, periods, compare_results)
        fresh = [run + 1 if same else 0 for run, same in zip(runs, equal, strict=False)]
        fresh += [0] * (periods - len(fresh))
        state.cycle_runs = fresh

    def check(
        self, state: TraceState, call: ToolCall, key: CallKey, policy: AgentPolicy
    ) -> Trip | None:
        runs = state.cycle_runs
        if runs is None:
            return None
        cycle = policy.cycle
        needed = cycle.repeats - 1
        if max(runs) < 2 * needed:
            return None
        if call.handoff and policy.multi_agent.cycles is not None:
            return None  # handoffs are handoff_cycle's while it is on
        same_as_last = runs[0]  # calls in a row equal to the one before: tool_loop's business
        for period in range(2, len(runs) + 1):
            if runs[period - 1] < needed * period or same_as_last >= period - 1:
                continue
            sequence = state.window.last(period)
            if not self._may_trip(sequence, policy):
                continue
            repeats = runs[period - 1] // period + 1
            steps = repeats * period
            tools = " -> ".join(tool for tool, _, _ in sequence)
            same_results = " and results" if cycle.compare_results else ""
            return Trip(
                f"a sequence of {period} calls ({tools}) repeated {repeats}x with the same"
                f" arguments{same_results}",
                Evidence(
                    tool_name=key[0],
                    args_hash=key[1],
                    result_hash=key[2],
                    hits=repeats,
                    window=cycle.max_period,
                    steps=steps,
                    threshold=cycle.repeats,
                    period=period,
                    calls=state.window_calls(min(steps, len(state.window))),
                ),
                message=(
                    f"You have repeated the same {period} tool calls {repeats} times with the"
                    f" same arguments{same_results}. Try a different approach or stop and"
                    " report what you found."
                ),
            )
        return None

    @staticmethod
    def _may_trip(sequence: list[CallKey], policy: AgentPolicy) -> bool:
        """A sequence with a polling tool in it (waiting on a job: sleep, check, sleep, check)
        or a tool the policy leaves out of cycles does not trip."""
        for tool, _, _ in sequence:
            if tool in policy.polling.tools:
                return False
            tool_policy = policy.tool(tool) if policy.tools else None
            if tool_policy is not None and not tool_policy.cycle:
                return False
        return True
