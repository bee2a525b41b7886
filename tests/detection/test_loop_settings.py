"""The settings that let spanguard judge as a peer does (docs/rules.md, "Settings like a
peer's"): user turns counted through, a lower threshold for failing calls, cycles whatever
the results. Runs are step lists turned into spans by the OpenTelemetry SDK."""

from __future__ import annotations

from typing import Any

from spanguard.schemas.policy import Policy
from tests.support.realruns import Run, replay


def decisions(steps: list[dict[str, Any]], **defaults: Any) -> list[tuple[str, str, int | None]]:
    run = Run("settings", "unit", "unit", "unit", None, steps)
    (found,) = replay([run], Policy.from_mapping({"defaults": defaults}))
    return found.decisions


def call(name: str, result: str | None, error: bool = False, **arguments: Any) -> dict[str, Any]:
    return {"type": "tool", "name": name, "id": None, "arguments": arguments, "result": result,
            "error": error}  # fmt: skip


def user(text: str) -> dict[str, Any]:
    return {"type": "user", "text": text}


LS = call("execute_bash", "file1.txt", command="ls")
NUDGED = [LS, LS, user("Please continue working on the task."), LS, LS]


def test_a_user_message_starts_the_count_afresh_by_default():
    assert decisions(NUDGED) == []


def test_user_turns_keep_counts_through_an_automated_continue():
    assert decisions(NUDGED, user_turns="keep") == [("tool_loop", "kill", 3)]


FAILING = call("book", "Error: seat 4A is taken", error=True, seat="4A")
SUCCEEDING = call("book", '{"booking": "B1"}', seat="4A")


def test_failing_threshold_stops_a_call_failing_again_sooner():
    assert decisions([FAILING, FAILING], loop={"failing_threshold": 2}) == [
        ("tool_loop", "kill", 2)
    ]
    assert decisions([FAILING, FAILING]) == []  # the shipped threshold: 3


def test_failing_threshold_leaves_calls_that_succeed_at_the_threshold():
    assert decisions([SUCCEEDING, SUCCEEDING], loop={"failing_threshold": 2}) == []
    assert decisions([SUCCEEDING] * 3, loop={"failing_threshold": 2}) == [("tool_loop", "kill", 3)]


def test_a_failing_threshold_beyond_the_window_is_refused():
    import pytest

    from spanguard.errors import PolicyError

    with pytest.raises(PolicyError, match="failing_threshold 11 can never be reached"):
        Policy.from_mapping({"defaults": {"loop": {"failing_threshold": 11}}})


def ping_pong(rounds: int) -> list[dict[str, Any]]:
    """read/list alternated, each answer different from every other (the files grow)."""
    steps = []
    for turn in range(rounds):
        steps.append(call("read", f"line {turn}", path="log.txt"))
        steps.append(call("list", f"{turn} files", path="."))
    return steps


def test_a_round_whose_results_change_is_not_a_cycle_by_default():
    assert decisions(ping_pong(6)) == []


def test_cycle_compare_results_false_stops_the_round_whatever_it_returns():
    assert decisions(ping_pong(6), cycle={"compare_results": False}) == [("cycle", "kill", 6)]
