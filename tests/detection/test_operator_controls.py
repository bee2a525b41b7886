"""The operator's controls in the policy: shadow mode, per-tool settings, rules switched off."""

from __future__ import annotations

import json

import pytest

from spanguard.detection.guard import Guard
from spanguard.errors import PolicyError
from spanguard.schemas.decision import validate
from spanguard.schemas.otlp import encode_json_line
from spanguard.schemas.policy import Policy
from tests.detection.test_otlp_and_replay import run_replay
from tests.detection.test_rules import REFUND, run, searches_that_find_nothing
from tests.support.spans import AgentRecorder, encode


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
    agent = searches_that_find_nothing()
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
    assert {d.policy.entry for d in decisions} == {"agents.0"}


def test_flag_is_a_valid_action_and_other_words_are_not():
    assert Policy.from_yaml("defaults: {action: flag}").defaults.action == "flag"
    with pytest.raises(PolicyError, match="action"):
        Policy.from_yaml("defaults: {action: shadow}")


# -- per-tool and per-rule controls ------------------------------------------------------------

CONTROLS = """
defaults:
  tools:
    sleep: {exempt: true}
agents:
  - match: {service.name: job-runner}
    tools:
      wait_for_job: {threshold: 8, window: 12}
  - match: {service.name: batch-bot}
    loop: {enabled: false}
"""


def poller(service: str, polls: int) -> AgentRecorder:
    """An agent waiting on a job: wait_for_job with the same arguments, a sleep in between."""
    agent = AgentRecorder(service, "runner")
    for _ in range(polls):
        agent.tool("wait_for_job", {"job": "42"})
        agent.tool("sleep", {"seconds": 5})
    agent.finish()
    return agent


def test_a_tool_with_its_own_threshold_and_window():
    policy = Policy.from_yaml(CONTROLS)
    assert run(Guard(policy), poller("job-runner", 7).finished()) == []
    (decision,) = run(Guard(policy), poller("job-runner", 10).finished())
    assert (decision.rule, decision.evidence.tool_name, decision.evidence.hits) == (
        "tool_loop",
        "wait_for_job",
        8,
    )
    assert (decision.evidence.threshold, decision.evidence.window) == (8, 12)
    assert decision.reason == "wait_for_job called 8x in last 8 steps"  # sleeps are not counted
    # Another tool of the same agent keeps the entry's own loop settings.
    other = AgentRecorder("job-runner")
    for _ in range(3):
        other.tool("search_docs", REFUND)
    (loop,) = run(Guard(policy), other.finished())
    assert (
        loop.evidence.tool_name,
        loop.evidence.hits,
        loop.evidence.threshold,
        loop.evidence.window,
    ) == ("search_docs", 3, 3, 10)


def test_each_tool_counts_in_its_own_window():
    """job-runner's trace keeps 12 calls (wait_for_job's window); search_docs still counts
    in the entry's window of 10: a third search 10 calls after the first is no loop."""
    policy = Policy.from_yaml(CONTROLS)
    agent = AgentRecorder("job-runner")
    agent.tool("search_docs", REFUND)
    for step in range(8):
        # Log lines that answer nothing: no new work between the searches, so only the
        # window keeps the first search out of the count.
        agent.tool("fetch_log", {"line": step}, result="")
    for _ in range(2):
        agent.tool("search_docs", REFUND)
    assert run(Guard(policy), agent.finished()) == []
    agent.tool("search_docs", REFUND)
    (decision,) = run(Guard(policy), agent.finished())
    assert (decision.evidence.tool_name, decision.evidence.hits, decision.evidence.steps) == (
        "search_docs",
        3,
        10,
    )


def test_an_exempt_tool_is_never_counted():
    policy = Policy.from_yaml(CONTROLS)
    agent = AgentRecorder("support-bot")
    for _ in range(20):
        agent.tool("sleep", {"seconds": 5})
    guard = Guard(policy)
    assert run(guard, agent.finished()) == []
    assert guard.stats.tool_calls == 20
    # Without the exemption the same agent is a loop.
    assert [d.evidence.tool_name for d in run(Guard(), agent.finished())] == ["sleep"]


def test_a_rule_switched_off_for_one_agent():
    policy = Policy.from_yaml(CONTROLS)
    assert run(Guard(policy), looping("batch-bot").finished()) == []
    assert [d.rule for d in run(Guard(policy), looping("support-bot").finished())] == ["tool_loop"]
    off = Policy.from_yaml(
        "defaults: {polling: {enabled: false, threshold: 3, window: 5}, cycle: {enabled: false}}"
    )
    agent = AgentRecorder()
    for status in range(4):  # two of each answer: a third would be tool_loop's
        agent.tool("wait", {"job": 1}, result=f'{{"done": {status % 2}}}')
    on = Policy.from_yaml("defaults: {polling: {threshold: 3, window: 5}, cycle: {enabled: false}}")
    assert [d.rule for d in run(Guard(on), agent.finished())] == ["tool_polling"]
    assert run(Guard(off), agent.finished()) == []


def test_the_effective_policy_keeps_the_controls():
    policy = Policy.from_yaml(CONTROLS)
    document = policy.effective()
    assert document["agents"][0]["tools"] == {
        "sleep": {"exempt": True, "cycle": True},
        "wait_for_job": {"threshold": 8, "window": 12, "exempt": False, "cycle": True},
    }
    assert document["agents"][1]["loop"]["enabled"] is False
    assert Policy.from_mapping(document) == policy


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("defaults: {tools: {poll: {threshold: 9, window: 5}}}", "defaults.tools.poll"),
        ("defaults: {tools: {poll: {exempted: true}}}", "exempted"),
        ("defaults: {loop: {enabled: 'no'}}", "defaults.loop.enabled"),
    ],
)
def test_bad_controls_name_the_field(text, field):
    with pytest.raises(PolicyError, match=field):
        Policy.from_yaml(text)


def test_replay_applies_the_controls(tmp_path):
    """`spanguard replay` over OTLP/JSON lines: the same file, with and without the policy."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(CONTROLS)
    runner, batch = poller("job-runner", 10), looping("batch-bot")
    lines = [
        encode_json_line(encode([span])) for agent in (runner, batch) for span in agent.finished()
    ]
    spans = tmp_path / "spans.jsonl"
    spans.write_text("\n".join(lines) + "\n")
    result = run_replay("--policy", str(policy), str(spans))
    assert result.returncode == 0, result.stderr.decode()
    records = [json.loads(line) for line in result.stdout.decode().splitlines()]
    assert [(r["trace_id"], r["tool_name"], r["hits"]) for r in records] == [
        (runner.trace_id, "wait_for_job", 8)
    ]
    defaults = run_replay(str(spans))
    records = [json.loads(line) for line in defaults.stdout.decode().splitlines()]
    first = {}
    for record in records:
        first.setdefault(record["trace_id"], (record["rule"], record["tool_name"]))
    # Without the policy the poller's (wait_for_job, sleep) round is caught by tool_loop at
    # its third wait_for_job (the first call of the third round), before the cycle completes
    # the round; the batch bot's loop is tool_loop's.
    assert first == {
        runner.trace_id: ("tool_loop", "wait_for_job"),
        batch.trace_id: ("tool_loop", "search_docs"),
    }


# -- an operator's release (connectors/releases.py fills `released` from the kill topic) -----


def _calls(agent: AgentRecorder, count: int, tool: str = "search_docs") -> list:
    before = len(agent.finished())
    for _ in range(count):
        agent.tool(tool, REFUND)
    return agent.finished()[before:]


def test_a_release_rearms_the_loop_rule_and_the_same_loop_kills_again():
    released: dict[str, float] = {}
    guard = Guard(Policy(), released=released)
    agent = AgentRecorder("support-bot", "support")
    (first,) = run(guard, _calls(agent, 3))
    assert (first.rule, first.action) == ("tool_loop", "kill")
    assert run(guard, _calls(agent, 6)) == []  # killed: one kill per trace and rule

    released[agent.trace_id] = 1000.0
    assert run(guard, _calls(agent, 2)) == []  # a fresh window: two calls are not three
    (again,) = run(guard, _calls(agent, 1))
    assert (again.rule, again.action) == ("tool_loop", "kill")
    assert again.decision_id != first.decision_id  # a new signal, not a duplicate
    assert guard.stats.releases_applied == 1
    assert guard.states[agent.trace_id].released_at == 1000.0

    # The same release is applied once: the second kill stands.
    assert run(guard, _calls(agent, 8)) == []
    released[agent.trace_id] = 2000.0  # a second release re-arms again
    (third,) = run(guard, _calls(agent, 3))
    assert third.action == "kill" and guard.stats.releases_applied == 2


def test_a_release_before_the_kill_does_not_undo_it():
    released: dict[str, float] = {}
    guard = Guard(Policy(), released=released)
    agent = AgentRecorder("support-bot")
    assert run(guard, _calls(agent, 1)) == []
    released[agent.trace_id] = 1000.0  # released while nothing had tripped
    (kill,) = run(guard, _calls(agent, 3))
    assert kill.action == "kill"
    assert run(guard, _calls(agent, 8)) == []  # that old release does not re-arm this kill
    assert guard.stats.releases_applied == 0


def test_a_release_leaves_the_token_budget_spent():
    released: dict[str, float] = {}
    guard = Guard(Policy.from_yaml("defaults: {token_budget: 1000}"), released=released)
    agent = AgentRecorder("support-bot")
    for _ in range(6):
        agent.chat(200, 20)
    (budget,) = run(guard, agent.finished())
    assert budget.rule == "token_budget"
    released[agent.trace_id] = 1000.0
    before = len(agent.finished())
    agent.chat(200, 20)
    assert run(guard, agent.finished()[before:]) == []  # not killed again for spent tokens
    (loop,) = run(guard, _calls(agent, 4))  # but a loop after the release is caught
    assert (loop.rule, loop.action) == ("tool_loop", "kill")


def test_a_release_survives_the_changelog_form():
    from spanguard.detection.trace_state import TraceState, encode_record, stored_state_last_seen

    state = TraceState("svc", released_at=1234.5, last_seen=99.5)
    assert TraceState.from_bytes(state.to_bytes()).released_at == 1234.5
    # Eviction reads last_seen without decoding the state: off the binary header, or off the
    # end of a JSON record (the conversation's).
    assert stored_state_last_seen(state.to_bytes()) == 99.5
    assert encode_record(state.to_dict()).endswith(b',"last_seen":99.5}')
    old = state.to_dict()
    del old["released_at"]  # a state written before releases re-armed anything
    assert TraceState.from_dict(old).released_at == 0.0


def test_an_exemption_can_name_an_argument_value():
    """Ten scrolls of a browser tool are reading a page, not a loop; its other calls count."""
    policy = Policy.from_yaml(
        "defaults:\n  tools:\n    browser: {exempt_when: {action: [scroll_down, scroll_up]}}\n"
    )
    scrolling = AgentRecorder()
    for _ in range(10):
        scrolling.tool("browser", {"action": "scroll_down"})
    assert run(Guard(policy), scrolling.finished()) == []
    assert [d.rule for d in run(Guard(), scrolling.finished())] == ["tool_loop"]
    clicking = AgentRecorder()
    for _ in range(3):
        clicking.tool("browser", {"action": "click", "target": "#buy"})
    assert [d.rule for d in run(Guard(policy), clicking.finished())] == ["tool_loop"]
    document = policy.effective()
    assert document["defaults"]["tools"]["browser"]["exempt_when"] == {
        "action": ["scroll_down", "scroll_up"]
    }
    assert Policy.from_mapping(document) == policy
