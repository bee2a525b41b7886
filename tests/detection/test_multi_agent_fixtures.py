"""Agents handing a run to each other (tests/fixtures/multi_agent, made by the real OpenAI
Agents SDK under OpenInference's and OpenTelemetry's instrumentations: tests/support/
multi_agents.py), replayed by `spanguard replay` on the shipped defaults.

A handoff is read as the handing agent's call "handoff to <agent>" (OpenInference names its
handoff span so; OpenTelemetry's `agent_handoff` span names both agents): two agents handing a
task back and forth with nothing done between are a handoff cycle, and a healthy chain of
handoffs, or visits that each do new work, are not. The agents' own spans make the trace's
agent tree: agents called as tools nested too deep, or a supervisor starting too many."""

from __future__ import annotations

import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from tests.support.multi_agents import EXPECTED, FIXTURES, INSTRUMENTATIONS, SCENARIOS
from tests.support.recorded_runs import replay_decisions, spans


def agent_of(span: dict) -> str | None:
    """The agent an agent's own span names (invoke_agent, OpenInference's AGENT kind)."""
    attributes = {a["key"]: a["value"].get("stringValue") for a in span.get("attributes", ())}
    if attributes.get("gen_ai.operation.name") == "invoke_agent":
        return attributes.get("gen_ai.agent.name")
    if attributes.get("openinference.span.kind") == "AGENT":
        return attributes.get("agent.name")
    return None


def handoff_to(span: dict) -> str | None:
    """The agent a handoff span hands to, in either instrumentation's form."""
    if span["name"].startswith("handoff to "):
        return span["name"].removeprefix("handoff to ")
    for attribute in span.get("attributes", ()):
        if attribute["key"] == "gen_ai.handoff.to_agent":
            return attribute["value"]["stringValue"]
    return None


@cache
def replayed(root: Path, instrumentation: str) -> dict[str, list[dict]]:
    return replay_decisions(
        {name: root / instrumentation / f"{name}.json.gz" for name in SCENARIOS}
    )


@pytest.mark.parametrize("instrumentation", INSTRUMENTATIONS)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_each_scenario_is_decided_as_expected(instrumentation, scenario):
    decisions = replayed(FIXTURES, instrumentation)[scenario]
    expected = EXPECTED[scenario]
    if expected is None:
        assert decisions == []
        return
    [decision] = decisions
    rule, action, at = expected
    assert (decision["rule"], decision["action"]) == (rule, action)
    # The span it trips at: the `at`-th of the spans the rule reads, in the order they ended.
    path = FIXTURES / instrumentation / f"{scenario}.json.gz"
    read = handoff_to if rule == "handoff_cycle" else agent_of
    tripping = sorted(
        (span for span in spans(path) if read(span)), key=lambda s: int(s["endTimeUnixNano"])
    )
    assert decision["span_id"] == tripping[at - 1]["spanId"]
    if rule == "handoff_cycle":
        assert decision["tool_name"] == f"handoff to {handoff_to(tripping[at - 1])}"
        assert decision["hits"] == 2
        assert decision["agents"] == [handoff_to(span) for span in tripping[:at]]
    elif rule == "delegation_depth":
        assert decision["depth"] == 6
        assert decision["agents"] == [f"level_{depth}" for depth in range(1, 7)]
    else:
        assert decision["sub_agents"] == at - 1
        assert decision["agents"] == ["worker"]


def test_the_fixtures_are_what_the_libraries_emit_now(tmp_path):
    """Made again from the installed SDK and instrumentations: the same decisions."""
    subprocess.run(
        [sys.executable, "-m", "tests.support.multi_agents", "--out", str(tmp_path)],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    for instrumentation in INSTRUMENTATIONS:
        fresh = replayed(tmp_path, instrumentation)
        kept = replayed(FIXTURES, instrumentation)
        assert {
            name: [(d["rule"], d["action"], d["tool_name"], d["hits"]) for d in records]
            for name, records in fresh.items()
        } == {
            name: [(d["rule"], d["action"], d["tool_name"], d["hits"]) for d in records]
            for name, records in kept.items()
        }
