"""Rules as parts: the registry against the README, the schemas and the policy; the guard's one
path from a trip to a decision, exercised with a rule of the test's own; the observer hook."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import typing
from pathlib import Path

from spanguard.detection import timelines
from spanguard.detection.guard import Guard
from spanguard.detection.rules import RULES, markdown_table, rule_named
from spanguard.detection.rules.base import Fired, GuardObserver, ToolCallRule, Trip
from spanguard.schemas import decision as decision_module
from spanguard.schemas.policy import Policy
from tests.support.spans import AgentRecorder, one_request_per_span, span_id_of

ROOT = Path(__file__).resolve().parents[2]


def schema(name: str) -> dict:
    return json.loads((ROOT / "schemas" / name).read_text())


def test_the_readme_rule_table_is_the_registrys():
    readme = (ROOT / "README.md").read_text()
    found = re.search(r"<!-- rules table[^>]*-->\n(.*?)<!-- end of rules table -->", readme, re.S)
    assert found, "README.md lost its rules table markers"
    assert found.group(1) == markdown_table(), "run `python scripts/rule_lists.py`"


def test_every_rule_is_in_the_wire_contracts_and_the_policy():
    names = [rule.name for rule in RULES]
    assert len(set(names)) == len(names)
    assert set(names) <= set(schema("detection.schema.json")["properties"]["rule"]["enum"])
    assert set(names) <= set(schema("kill-signal.schema.json")["properties"]["rule"]["enum"])
    assert set(names) <= set(typing.get_args(decision_module.Rule))
    sections = schema("policy.schema.json")["$defs"]["settings"]["properties"]
    effective = Policy().effective()["defaults"]
    for rule in RULES:
        section = rule.settings.split(":")[0]
        assert section in sections and section in effective, rule.name
    assert rule_named("cycle").default_action == "kill"


def test_policy_check_prints_the_cycle_settings(tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text(
        "defaults:\n  cycle: {max_period: 12}\n  tools: {sleep: {cycle: false}}\n"
        "agents:\n  - match: {service.name: coder}\n    cycle: {repeats: 4, enabled: false}\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "spanguard.cli", "policy", "check", str(policy)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "max_period: 12" in result.stdout and "repeats: 4" in result.stdout
    assert "cycle: false" in result.stdout


class EveryThird(ToolCallRule):
    """A rule of the test's own: every third call of a trace trips it."""

    name = "every_third"
    catches = "every third call"
    settings = "loop: {}"
    default_action = "kill"
    counts = True

    def wanted(self, policy):
        return policy.action

    def count(self, state, call, key, policy):
        state.aggregate_tokens += 1  # a counter the test can borrow

    def check(self, state, call, key, policy):
        if state.aggregate_tokens % 3:
            return None
        return Trip("a third call", {"tool_name": key[0], "hits": 3}, message="slow down")


def calls(agent: AgentRecorder, count: int) -> list:
    return [agent.tool("search", {"q": f"fresh {agent.root.name} {i}"}) for i in range(count)]


def decide(guard: Guard, spans) -> list:
    return [d for r in one_request_per_span(spans) for d in guard.process(r)]


def test_one_path_fires_once_per_trace_and_rule_and_kills_after_a_downgrade():
    agent = AgentRecorder()
    spans = calls(agent, 12)
    kill = decide(Guard(rules=[EveryThird()]), spans)
    assert [(d.rule, d.action, d.span_id) for d in kill] == [
        ("every_third", "kill", span_id_of(spans[2]))
    ]
    downgrade = decide(
        Guard(Policy.from_yaml("defaults: {action: downgrade}"), rules=[EveryThird()]), spans
    )
    assert [d.action for d in downgrade] == ["downgrade", "kill"]
    assert downgrade[0].system_message == "slow down" and downgrade[1].system_message is None
    flags = decide(Guard(Policy.from_yaml("defaults: {action: flag}"), rules=[EveryThird()]), spans)
    assert [d.action for d in flags] == ["flag"]


def test_one_path_rearms_on_release_and_retracts_an_unsent_decision():
    released: dict[str, float] = {}
    guard = Guard(rules=[EveryThird()], released=released)
    agent = AgentRecorder()
    [first] = decide(guard, calls(agent, 3))
    state = guard.states[agent.trace_id]
    assert state.fired == {Fired("every_third", "kill")}
    guard.retract(first)  # its signal could not be sent: it may trip again
    assert guard.states[agent.trace_id].fired == set()
    [again] = decide(guard, calls(agent, 3))
    assert decide(guard, calls(agent, 6)) == []
    released[agent.trace_id] = 7.0
    [after_release] = decide(guard, calls(agent, 3))
    assert after_release.decision_id != again.decision_id


class Recorder(GuardObserver):
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple | None]] = []
        self.decisions: list[str] = []

    def on_tool_call(self, trace_id, state, call, key):
        self.calls.append((call.tool_name, key))

    def on_decision(self, decision, state):
        self.decisions.append(f"{decision.rule}:{decision.action}:{state.service}")


def test_observers_hear_every_call_and_decision():
    agent = AgentRecorder("support-bot")
    for _ in range(4):
        agent.tool("search_docs", {"query": "refund"})
    agent.tool("lookup")  # no arguments recorded: not counted
    observer = Recorder()
    guard = Guard(observers=[observer])
    [decision] = decide(guard, agent.finished())
    assert [tool for tool, _ in observer.calls] == ["search_docs"] * 4 + ["lookup"]
    assert observer.calls[0][1] == ("search_docs", decision.evidence.args_hash, None)
    assert observer.calls[-1][1] is None
    assert observer.decisions == ["tool_loop:kill:support-bot"]


def test_the_replay_page_observes_the_guard_instead_of_subclassing_it():
    assert not issubclass(timelines.Timelines, Guard)
    assert issubclass(timelines.Timelines, GuardObserver)
