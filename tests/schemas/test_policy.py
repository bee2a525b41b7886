"""The policy loader on good files, and `spanguard policy check` as CI runs it (the bad files
are the policy table of tests/test_bad_input.py)."""

from __future__ import annotations

import json
import re
from dataclasses import fields, is_dataclass
from pathlib import Path

import pytest
import yaml

from spanguard.config.policy_file import load_policy
from spanguard.errors import PolicyError
from spanguard.schemas.policy import AgentPolicy, FleetPolicy, Policy, ToolPolicy
from tests.support.cli import run_spanguard

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "policy.yaml"


def test_yaml_anchors_within_bounds_still_work(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text(
        "agents:\n"
        "  - match: {service.name: a}\n"
        "    loop: &wide {window: 20, threshold: 5}\n"
        "  - match: {service.name: b}\n"
        "    loop: *wide\n"
    )
    policy = load_policy(path)
    assert [(r.policy.loop.window, r.policy.loop.threshold) for r in policy.rules] == [(20, 5)] * 2


def test_the_effective_policy_is_itself_a_policy_file_that_loads_to_the_same_policy():
    policy = load_policy(EXAMPLE)
    document = policy.effective()
    assert Policy.from_mapping(yaml.safe_load(yaml.safe_dump(document))) == policy
    support = document["agents"][2]
    assert support["match"] == {"service.name": "support-bot"}
    assert support["action"] == "downgrade" and support["loop"] == {
        "window": 10,
        "threshold": 3,  # examples/policy.yaml's defaults: the shipped threshold
        "failing_threshold": None,
        "enabled": True,
    }


def test_policy_check_prints_the_policy_in_force_per_agent_match(tmp_path):
    result = run_spanguard("policy", "check", str(EXAMPLE))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"# {EXAMPLE}: valid; the defaults and 4 agent rules")
    printed = yaml.safe_load(result.stdout)
    assert [rule["match"] for rule in printed["agents"]] == [
        {"service.name": "research-assistant"},
        {"gen_ai.agent.name": "ticket-bot"},
        {"service.name": "support-bot"},
        {"gen_ai.agent.name": "coding-agent"},
    ]
    ticket_bot = printed["agents"][1]
    assert ticket_bot["token_budget"] == 200000
    assert "created_at" in ticket_bot["volatile_keys"] and "nonce" in ticket_bot["volatile_keys"]
    # What CI saves is a policy file: loading it gives the very policy that was checked.
    saved = tmp_path / "effective.yaml"
    saved.write_text(result.stdout)
    assert load_policy(saved) == load_policy(EXAMPLE)


def test_policy_check_of_a_bad_file_exits_2_with_one_line(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text("defaults:\n  tokenbudget: 100\n")
    result = run_spanguard("policy", "check", str(path))
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == [
        f"spanguard policy: bad policy: {path}: field defaults: unknown key 'tokenbudget'"
        " (did you mean 'token_budget'?); valid keys: action, agent_budget, autonomous,"
        " conversation, cycle, fold, goal, loop, missing_args, multi_agent, no_progress, pause, polling, prices, record_arguments,"
        " severity, token_budget, tools, usd_budget, user_turns, volatile_keys"
    ]


def test_the_policy_classes_mirror_the_schema_key_for_key():
    """Merging and `policy check` follow the dataclasses' fields: a key of the schema without
    its field would be accepted and then ignored."""
    schema = json.loads((ROOT / "schemas" / "policy.schema.json").read_text())
    settings = schema["$defs"]["settings"]["properties"]
    assert {f.name for f in fields(AgentPolicy)} == set(settings)
    for setting in fields(AgentPolicy):
        section = getattr(AgentPolicy(), setting.name)
        if is_dataclass(section):
            names = {f.name for f in fields(section)}
            assert names == set(settings[setting.name]["properties"]), setting.name
    tool = settings["tools"]["additionalProperties"]["properties"]
    assert {f.name for f in fields(ToolPolicy)} == set(tool)
    fleet = schema["properties"]["fleet"]["properties"]
    assert {f.name for f in fields(FleetPolicy)} == set(fleet)


def test_the_fleet_section_is_global_off_by_default_and_checked_like_the_others():
    assert Policy().fleet == FleetPolicy() and not Policy().fleet.enabled
    policy = Policy.from_yaml("fleet: {enabled: true, action: contain, window: 600, step: 60}\n")
    assert (policy.fleet.enabled, policy.fleet.action, policy.fleet.steps) == (True, "contain", 10)
    assert policy.observed().fleet.action == "flag"  # --mode observe: shadow for the fleet too
    document = yaml.safe_load(yaml.safe_dump(policy.effective()))
    assert document["fleet"]["window"] == 600 and Policy.from_mapping(document) == policy
    for text, message in [
        ("fleet: {windw: 300}", "field fleet: unknown key 'windw' (did you mean 'window'?)"),
        ("fleet: {window: 100}", "field fleet.window: must be a whole number of steps (30 s)"),
        ("fleet: {action: kill}", "field fleet.action: 'kill' is not one of ['flag', 'contain']"),
        ("defaults: {fleet: {enabled: true}}", "field defaults: unknown key 'fleet'"),
    ]:
        with pytest.raises(PolicyError, match=re.escape(message)):
            Policy.from_yaml(text, source="p.yaml")
