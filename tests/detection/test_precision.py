"""Precision, measured: every rule over every fixture of every instrumentation, through the real
CLI (`spanguard replay`, the shipped default policy).

Per (library, mode): the decisions each rule takes on the healthy scenarios (the target is 0)
and, for each stuck scenario, which rule caught it at which call (the earliest call its rule
can). `pytest -s` prints the table.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from spanguard.detection.rules import RULES
from tests.detection.test_instrumentation_fixtures import (
    CASES,
    RECORDED_MODES,
    TOOL_NAME_KEYS,
    read_request,
    replayed,
    run_replay,
    scenario_file,
)
from tests.support.instrumented_agents import SCENARIOS
from tests.support.spans import tool_span_ids_in

HEALTHY = ("distinct", "retry", "polling", "round_fresh", "tests_improving", "canned_ok")
# Stuck scenario -> (the rule that must catch it, the call at which it can first): a loop's
# third identical call, a round of four's first call made a third time (the start of the
# third round), a round of eight's last call of its third round, the empty index's fourth
# rephrasing.
STUCK = {
    "loop_volatile": ("tool_loop", 3),
    "loop_identical": ("tool_loop", 3),
    "cycle_4": ("tool_loop", 9),
    "cycle_8": ("cycle", 24),  # two rounds of eight do not fit in the loop window
    "no_progress": ("no_progress", 4),
}


def test_every_scenario_is_either_healthy_or_stuck():
    assert set(HEALTHY) | set(STUCK) == set(SCENARIOS)


def tool_calls(path: Path, tools: set[str]) -> list[str]:
    """Span ids of the calls of `tools` (the scenario's; smolagents adds final_answer) in the
    order they started."""
    return tool_span_ids_in(read_request(path), tools, TOOL_NAME_KEYS)


def measure(name: str, mode: str) -> tuple[Counter, dict[str, str]]:
    """(decisions per rule on healthy scenarios, stuck scenario -> "rule@call" or "-")."""
    decisions = replayed(name, mode).decisions
    healthy = Counter({rule.name: 0 for rule in RULES})
    for scenario in HEALTHY:
        healthy.update(record["rule"] for record in decisions[scenario])
    caught = {}
    for scenario in STUCK:
        records = decisions[scenario]
        if not records:
            caught[scenario] = "-"
            continue
        first = records[0]
        tools = {call.tool for call in SCENARIOS[scenario]}
        calls = tool_calls(scenario_file(name, mode, scenario), tools)
        assert len(calls) == len(SCENARIOS[scenario]), (name, mode, scenario)
        at = calls.index(first["span_id"]) + 1 if first["span_id"] in calls else "?"
        caught[scenario] = f"{first['rule']}@{at}" + ("" if len(records) == 1 else "+")
    return healthy, caught


@pytest.fixture(scope="module")
def table() -> dict[tuple[str, str], tuple[Counter, dict[str, str]]]:
    return {(name, mode): measure(name, mode) for name, mode in CASES}


def test_the_false_alarm_and_catch_table(table):
    rules = [rule.name for rule in RULES]
    header = f"{'instrumentation/mode':<42}" + "".join(f"{r:>13}" for r in rules)
    header += "  " + "  ".join(f"{s:>17}" for s in STUCK)
    lines = ["", "decisions on healthy traces per rule | stuck scenario: rule@call", header]
    totals: Counter = Counter()
    for (name, mode), (healthy, caught) in table.items():
        totals.update(healthy)
        lines.append(
            f"{name + '/' + mode:<42}"
            + "".join(f"{healthy[r]:>13}" for r in rules)
            + "  "
            + "  ".join(f"{caught[s]:>17}" for s in STUCK)
        )
    lines.append(
        f"{'total over ' + str(len(table)) + ' cases':<42}"
        + "".join(f"{totals[r]:>13}" for r in rules)
    )
    print("\n".join(lines))
    # No rule takes a decision on any healthy fixture of any instrumentation.
    assert totals == Counter({rule: 0 for rule in rules})
    for (name, mode), (_, caught) in table.items():
        if mode in RECORDED_MODES:
            # Every stuck agent is caught, by its rule, at the earliest call it can be, once.
            expected = {scenario: f"{rule}@{call}" for scenario, (rule, call) in STUCK.items()}
            assert caught == expected, (name, mode)
        else:
            # Arguments not recorded: nothing is keyed, nothing is decided, never a kill.
            assert set(caught.values()) == {"-"}, (name, mode)


@pytest.fixture(scope="module")
def scoped_policy(tmp_path_factory) -> Path:
    """The default policy with money and the conversation scope on (generous budgets)."""
    path = tmp_path_factory.mktemp("policy") / "scoped.yaml"
    path.write_text(
        "defaults:\n"
        "  usd_budget: 5\n"
        "  conversation: {enabled: true, action: kill, token_budget: 1000000, usd_budget: 50}\n"
    )
    return path


@pytest.mark.parametrize(("name", "mode"), CASES)
def test_money_and_the_conversation_scope_change_no_decision(name, mode, scoped_policy):
    """Over every scenario of a library replayed together (every trace one guard sees, in one
    conversation scope), the scopes add nothing: the same decisions, on the same spans."""
    plain = replayed(name, mode).decisions
    scoped = run_replay(name, mode, policy=scoped_policy).decisions

    def seen(decisions: dict[str, list[dict]]) -> dict[str, list[tuple]]:
        return {
            scenario: [(r["rule"], r["action"], r["span_id"], r.get("scope")) for r in records]
            for scenario, records in decisions.items()
        }

    assert seen(scoped) == seen(plain)
