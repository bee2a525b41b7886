"""The operator's controls in the policy: shadow mode, per-tool settings, rules switched off."""

from __future__ import annotations

import json

import pytest

from spanguard.detection.guard import Guard
from spanguard.errors import PolicyError
from spanguard.schemas.decision import validate
from spanguard.schemas.policy import Policy
from tests.detection.test_rules import REFUND, run
from tests.support.spans import AgentRecorder


def looping(service: str = "support-bot", calls: int = 12, **resource) -> AgentRecorder:
    agent = AgentRecorder(service, "support", **resource)
    for _ in range(calls):
        agent.tool("search_docs", REFUND)
        agent.chat(200, 20)
    agent.finish()
    return agent


def test_shadow_mode_flags_every_rule_once_and_restarts_nothing():
    policy = Policy.from_yaml("defaults: {action: flag, token_budget: 1000}")
    decisions = run(Guard(policy), looping().finished())
    assert sorted((d.rule, d.action) for d in decisions) == [
        ("token_budget", "flag"),
        ("tool_loop", "flag"),
    ]
    for decision in decisions:
        validate(decision.to_dict(), "detection")
        assert decision.system_message is None  # nothing for the agent to read


def test_shadow_mode_per_agent_beside_a_killing_default():
    policy = Policy.from_yaml("agents: [{match: {deployment.environment: canary}, action: flag}]")
    canary = run(Guard(policy), looping(**{"deployment.environment": "canary"}).finished())
    production = run(Guard(policy), looping(**{"deployment.environment": "production"}).finished())
    assert [(d.rule, d.action) for d in canary] == [("tool_loop", "flag")]
    assert [(d.rule, d.action) for d in production] == [("tool_loop", "kill")]


def test_shadow_mode_turns_a_killing_no_progress_into_a_flag():
    policy = Policy.from_yaml("defaults: {action: flag, no_progress: {action: kill}}")
    agent = AgentRecorder()
    for query in ("refund", "refunds", "refund policy", "returns", "money back"):
        agent.tool("search_docs", None, attributes={
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": "search_docs",
            "gen_ai.tool.call.arguments": json.dumps({"query": query}),
            "gen_ai.tool.call.result": "[]",
        })  # fmt: skip
    (decision,) = run(Guard(policy), agent.finished())
    assert (decision.rule, decision.action) == ("no_progress", "flag")


def test_observed_forces_flag_for_every_entry():
    policy = Policy.from_yaml(
        "defaults: {action: downgrade, token_budget: 1000}\n"
        "agents: [{match: {service.name: a}, action: kill}]"
    ).observed()
    assert policy.defaults.action == "flag"
    assert [rule.policy.action for rule in policy.rules] == ["flag"]
    decisions = run(Guard(policy), looping("a").finished())
    assert {d.action for d in decisions} == {"flag"}
    assert {d.policy_entry for d in decisions} == {"agents.0"}


def test_flag_is_a_valid_action_and_other_words_are_not():
    assert Policy.from_yaml("defaults: {action: flag}").defaults.action == "flag"
    with pytest.raises(PolicyError, match="action"):
        Policy.from_yaml("defaults: {action: shadow}")
