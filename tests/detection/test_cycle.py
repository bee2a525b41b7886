"""The cycle rule on its own: spans from the real SDK through the guard, one rule's behaviour
per test (spanguard/detection/rules/cycle.py)."""

from __future__ import annotations

import json

import pytest

from spanguard.detection.conventions.events import ToolCall
from spanguard.detection.guard import Guard
from spanguard.detection.rules import CYCLE
from spanguard.detection.trace_state import CallWindow, TraceState
from spanguard.schemas.decision import KillSignal, validate
from spanguard.schemas.policy import Policy
from tests.support.spans import AgentRecorder, one_request_per_span, span_id_of


def call(agent: AgentRecorder, tool: str, arguments: dict, result: str):
    return agent.tool(
        tool,
        attributes={
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": tool,
            "gen_ai.tool.call.arguments": json.dumps(arguments),
            "gen_ai.tool.call.result": result,
        },
    )


def round_of(period: int) -> list[tuple[str, dict, str]]:
    """`period` different calls: a coding agent's round (list, read, grep, tests, ...)."""
    tools = ["list_dir", "read_file", "grep", "run_tests"]
    return [(tools[i % 4], {"target": f"item-{i}"}, f"result {i}") for i in range(period)]


def run(guard: Guard, spans) -> list:
    return [d for request in one_request_per_span(spans) for d in guard.process(request)]


# tool_loop switched off: a round short enough for tool_loop's window (10) to hold the first
# calls of three rounds (period <= 4) is caught by tool_loop first, at call 2p+1.
NO_LOOP = "defaults: {loop: {enabled: false}}"


def cycling(period: int, rounds: int, service: str = "coder") -> tuple[AgentRecorder, list]:
    agent = AgentRecorder(service, "coder")
    spans = [call(agent, *step) for _ in range(rounds) for step in round_of(period)]
    return agent, spans


@pytest.mark.parametrize("period", range(2, 11))
def test_the_default_policy_catches_periods_2_to_10_by_the_call_ending_the_third_round(period):
    agent, spans = cycling(period, 4)
    decisions = run(Guard(), agent.finished())
    if 2 * period + 1 <= 10:
        # The first calls of three rounds fit in tool_loop's window: it catches the round
        # first, at the first call of the third round. The cycle rule on its own, below.
        assert [(d.rule, d.action) for d in decisions] == [("tool_loop", "kill")]
        assert decisions[0].span_id == span_id_of(spans[2 * period])
        decisions = run(Guard(Policy.from_yaml(NO_LOOP)), agent.finished())
    assert [(d.rule, d.action) for d in decisions] == [("cycle", "kill")]
    [decision] = decisions
    assert decision.span_id == span_id_of(spans[3 * period - 1])  # the call ending round 3
    assert (decision.evidence.period, decision.evidence.hits, decision.evidence.steps) == (
        period,
        3,
        3 * period,
    )
    assert (decision.evidence.threshold, decision.evidence.window) == (3, 10)
    sequence = [call["tool_name"] for call in decision.evidence.calls[-period:]]
    assert sequence == [tool for tool, _, _ in round_of(period)]
    assert decision.evidence.calls[-1]["span_id"] == decision.span_id
    validate(decision.to_dict(), "detection")
    validate(KillSignal.from_decision(decision).to_dict(), "kill-signal")


def test_a_period_longer_than_max_period_is_not_a_cycle_until_the_policy_says_so():
    agent, spans = cycling(11, 4)
    assert run(Guard(), agent.finished()) == []
    policy = Policy.from_yaml("defaults: {cycle: {max_period: 12}}")
    [decision] = run(Guard(policy), agent.finished())
    assert (decision.rule, decision.evidence.period, decision.span_id) == (
        "cycle",
        11,
        span_id_of(spans[32]),
    )


def test_repeats_come_from_the_policy():
    agent, spans = cycling(4, 5)
    # tool_loop off: it would catch the round at its 9th call (see NO_LOOP).
    policy = Policy.from_yaml("defaults: {cycle: {repeats: 5}, loop: {enabled: false}}")
    [decision] = run(Guard(policy), agent.finished())
    assert (decision.evidence.hits, decision.span_id) == (5, span_id_of(spans[19]))


def test_two_rounds_are_not_a_cycle():
    agent, _ = cycling(5, 2)
    assert run(Guard(), agent.finished()) == []


def test_fresh_arguments_every_round_never_trip():
    """search, fetch, summarize, each time about something new: 90 calls, nothing."""
    agent = AgentRecorder("researcher", "research")
    for topic in range(30):
        call(agent, "search_web", {"q": f"topic {topic}"}, "3 hits")
        call(agent, "fetch", {"url": f"https://example.org/{topic}"}, "page")
        call(agent, "summarize", {"text_id": topic}, "a summary")
    guard = Guard()
    assert [d.rule for d in run(guard, agent.finished())] == []
    assert guard.stats.tool_calls == 90


def test_a_result_that_changes_breaks_the_cycle():
    """A coding agent re-running its tests while the failures go down is making progress."""
    agent = AgentRecorder("coder", "coder")
    for failing in (9, 8, 7, 6, 5, 4, 3, 2, 1, 0):
        call(agent, "read_file", {"path": "src/app.py"}, "def app(): ...")
        call(agent, "run_tests", {"suite": "unit"}, f"{failing} failed")
    policy = Policy.from_yaml("defaults: {loop: {threshold: 20, window: 20}}")  # not tool_loop's
    assert run(Guard(policy), agent.finished()) == []
    # The same agent whose failures stop going down is stuck: a cycle once the result holds.
    for _ in range(3):
        call(agent, "read_file", {"path": "src/app.py"}, "def app(): ...")
        call(agent, "run_tests", {"suite": "unit"}, "0 failed")
    [decision] = run(Guard(policy), agent.finished())
    assert (decision.rule, decision.evidence.period) == ("cycle", 2)
    # The last round of the first part and the first two added ones: three alike.
    assert decision.span_id == span_id_of(agent.finished()[-3])


def test_one_call_repeated_is_tool_loops_and_not_a_cycle():
    agent = AgentRecorder("coder", "coder")
    for _ in range(12):
        call(agent, "search_docs", {"q": "refund"}, "none found")
    policy = Policy.from_yaml("defaults: {loop: {enabled: false}}")
    assert run(Guard(policy), agent.finished()) == []


def test_calls_without_arguments_never_make_a_cycle():
    """Keyed on the tool name alone, a round of fresh searches would look like a cycle."""
    agent = AgentRecorder("coder", "coder")
    for _ in range(6):
        for tool in ("search", "fetch"):
            agent.tool(tool)  # no arguments recorded
    policy = Policy.from_yaml("defaults: {missing_args: name_only}")
    decisions = run(Guard(policy), agent.finished())
    assert {d.rule for d in decisions} <= {"tool_loop"}
    assert all(d.action == "flag" for d in decisions)


def test_a_polling_tool_or_a_tool_left_out_keeps_the_round_alive():
    agent = AgentRecorder("runner", "runner")
    for _ in range(6):
        call(agent, "wait_for_job", {"job": "42"}, "running")
        call(agent, "sleep", {"seconds": 5}, "slept")
    polling = Policy.from_yaml(
        "defaults: {polling: {tools: [wait_for_job]}, loop: {enabled: false}}"
    )
    left_out = Policy.from_yaml(
        "defaults: {tools: {sleep: {cycle: false}}, loop: {enabled: false}}"
    )
    assert run(Guard(polling), agent.finished()) == []
    assert run(Guard(left_out), agent.finished()) == []


def test_per_agent_settings():
    policy = Policy.from_yaml(
        "agents:\n"
        "  - match: {service.name: relaxed}\n"
        "    cycle: {enabled: false}\n"
        "  - match: {service.name: strict}\n"
        "    cycle: {repeats: 2}\n"
    )
    relaxed, _ = cycling(4, 4, "relaxed")
    strict, strict_spans = cycling(4, 4, "strict")
    # No cycle for the relaxed agent: only tool_loop's kill at the first call of round 3.
    assert [d.rule for d in run(Guard(policy), relaxed.finished())] == ["tool_loop"]
    [decision] = run(Guard(policy), strict.finished())
    assert decision.span_id == span_id_of(strict_spans[7])
    assert (decision.policy.entry, decision.evidence.threshold) == ("agents.1", 2)


def test_shadow_mode_flags_once_and_downgrade_comes_before_the_kill():
    agent, spans = cycling(3, 8)
    flags = run(Guard(Policy.from_yaml("defaults: {action: flag}")), agent.finished())
    # Each rule flags once; tool_loop (3 in 10: the first call of the third round) comes
    # before the cycle (three rounds).
    assert [(d.rule, d.action) for d in flags] == [("tool_loop", "flag"), ("cycle", "flag")]
    assert flags[0].span_id == span_id_of(spans[6])
    assert flags[1].span_id == span_id_of(spans[8])
    # tool_loop off: its own downgrade would restart the window before the cycle's.
    downgrading = Policy.from_yaml("defaults: {action: downgrade, loop: {enabled: false}}")
    decisions = run(Guard(downgrading), agent.finished())
    assert [(d.rule, d.action) for d in decisions] == [("cycle", "downgrade"), ("cycle", "kill")]
    downgrade, kill = decisions
    assert "repeated the same 3 tool calls 3 times" in downgrade.system_message
    # After the downgrade the rounds count from a fresh window: three more rounds to the kill.
    assert downgrade.span_id == span_id_of(spans[8])
    assert kill.span_id == span_id_of(spans[17])


def test_a_release_rearms_the_cycle_rule():
    released: dict[str, float] = {}
    guard = Guard(Policy.from_yaml(NO_LOOP), released=released)  # tool_loop would come first
    agent, _ = cycling(4, 3)
    [first] = run(guard, agent.finished())
    more = [call(agent, *step) for _ in range(3) for step in round_of(4)]
    assert run(guard, more[:6]) == []  # killed: once per trace and rule
    released[agent.trace_id] = 500.0
    again = [call(agent, *step) for _ in range(3) for step in round_of(4)]
    [second] = run(guard, again)
    assert (second.rule, second.action) == ("cycle", "kill")
    assert second.decision_id != first.decision_id


def test_a_cycle_keeps_counting_across_the_changelog():
    """The state written between two messages (as the worker's table does) loses no run."""
    agent, spans = cycling(6, 3)
    guard = Guard()
    decisions = []
    for request in one_request_per_span(agent.finished()):
        decisions += guard.process(request)
        for trace_id, state in list(guard.states.items()):
            guard.states[trace_id] = TraceState.from_bytes(state.to_bytes())
    [decision] = decisions
    assert decision.span_id == span_id_of(spans[17])


def test_runs_are_kept_only_while_a_call_repeats():
    """The state stays compact: no run lengths while the calls are new (most of the time)."""
    agent = AgentRecorder("researcher", "research")
    for topic in range(20):
        call(agent, "search_web", {"q": f"topic {topic}"}, "hits")
    guard = Guard()
    run(guard, agent.finished())
    [state] = guard.states.values()
    assert state.cycle_runs is None and "cycle_runs" not in state.to_dict()


def test_the_rule_costs_max_period_per_call_at_most():
    """count() compares at most max_period earlier calls, however long the window is: the
    window answers for its last `calls` calls only."""
    state = TraceState()
    key = ("grep", "a" * 16, "b" * 16)
    state.window = CallWindow.of([key] * 500)
    max_period = Policy().defaults.cycle.max_period
    assert state.window.matches_back(key, max_period) == [True] * max_period
    call = ToolCall(b"\0" * 8, "grep", {}, None, None, None)
    CYCLE.count(state, call, key, Policy().defaults)
    assert state.cycle_runs == [1] * max_period
