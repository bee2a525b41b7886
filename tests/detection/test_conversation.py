"""The conversation scope: traces that share a conversation id, their calls in order under the
loop and cycle rules, and their budgets; and the conversation id read from each convention."""

from __future__ import annotations

import io
import json
import logging
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from spanguard.cli.replay import replay
from spanguard.config.policy_file import load_policy
from spanguard.detection.conversation import MAX_TRACES_REMEMBERED, ConversationGuard
from spanguard.detection.explain import explain_records
from spanguard.detection.guard import Guard
from spanguard.errors import PolicyError
from spanguard.killswitch.signals import AgentKilled, SignalBook
from spanguard.schemas.decision import (
    KillSignal,
    caller_trace_of,
    keyring,
    kill_signals,
    read_signal,
    sign,
    validate,
)
from spanguard.schemas.otlp import ExportTraceServiceRequest, encode_json_line
from spanguard.schemas.policy import Policy
from tests.support.recorded_runs import per_trace, spans
from tests.support.spans import AgentRecorder, encode

from .test_rules import run

REFUND = {"query": "refund policy"}
ON = {"conversation": {"enabled": True}}


def turn(conversation: str | None, calls: int = 2, key: str = "gen_ai.conversation.id"):
    """One trace of a chat app: one user turn, `calls` identical searches, the same empty
    result each time, and the conversation id on every span (as pydantic-ai and ADK write it)."""
    agent = AgentRecorder()
    attributes = {key: conversation} if conversation is not None else {}
    for _ in range(calls):
        agent.tool(
            "search_docs",
            attributes={
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": "search_docs",
                "gen_ai.tool.call.arguments": json.dumps(REFUND),
                "gen_ai.tool.call.result": "[]",
                **attributes,
            },
        )
    agent.finish(**attributes)
    return agent


def guard_for(settings: dict) -> Guard:
    policy = Policy.from_mapping({"defaults": settings})
    return Guard(policy, conversations=ConversationGuard(policy))


def test_six_turns_of_two_identical_calls_are_flagged_once_across_traces():
    guard = guard_for(ON)
    decisions = []
    turns = [turn("conv-1") for _ in range(6)]
    for agent in turns:
        decisions += run(guard, agent.finished())
    # No trace alone reaches 3; the conversation does at its 3rd call (the 2nd turn's 1st).
    assert [(d.rule, d.action, d.scope_kind) for d in decisions] == [
        ("tool_loop", "flag", "conversation")
    ]
    decision = decisions[0]
    assert decision.trace_id == turns[1].trace_id and decision.scope.traces == 2
    assert decision.scope.conversation_id == "conv-1" and decision.evidence.hits == 3
    assert "conversation conv-1, 2 traces" in decision.reason
    assert len({call["span_id"] for call in decision.evidence.calls}) == 3
    validate(decision.to_dict(), "detection")
    assert len(decision.decision_id) == 32
    explained = explain_records(decision.trace_id, [decision.to_dict()])
    assert "scope: conversation conv-1, the evidence across 2 of its traces" in explained


def test_the_trace_scope_alone_catches_nothing_there():
    guard = Guard(Policy())
    decisions = [d for _ in range(6) for d in run(guard, turn("conv-1").finished())]
    assert decisions == []


def test_a_loop_within_one_trace_is_left_to_the_trace_rules():
    guard = guard_for(ON)
    decisions = run(guard, turn("conv-1", calls=5).finished())
    assert [(d.rule, d.action, d.scope_kind) for d in decisions] == [("tool_loop", "kill", None)]


def test_a_kill_action_kills_the_trace_that_completed_the_repeat():
    guard = guard_for({"conversation": {"enabled": True, "action": "kill"}})
    first, second = turn("c"), turn("c")
    assert run(guard, first.finished()) == []
    (decision,) = run(guard, second.finished())
    assert (decision.action, decision.trace_id) == ("kill", second.trace_id)
    signal = KillSignal.from_decision(decision)  # a trace kill every killswitch obeys
    validate(signal.to_dict(), "kill-signal")
    assert signal.scope is None and signal.topic_key() == second.trace_id.encode()


@pytest.mark.parametrize(("kill_ttl", "seconds"), [(None, 3600), (120, 120)])
def test_a_kill_also_stops_the_conversations_later_traces_until_its_ttl(kill_ttl, seconds):
    conversation = {"enabled": True, "action": "kill"}
    if kill_ttl is not None:
        conversation["kill_ttl"] = kill_ttl
    guard = guard_for({"conversation": conversation})
    first, second, later = turn("c"), turn("c"), turn("c")
    run(guard, first.finished())
    (decision,) = run(guard, second.finished())
    detected = datetime.fromisoformat(decision.detected_at)
    assert datetime.fromisoformat(decision.scope.until) == detected + timedelta(seconds=seconds)
    validate(decision.to_dict(), "detection")

    key = b"k" * 32
    traced, scoped = kill_signals(decision)
    # One decision, one id: the agent obeys and acks it once, `explain` finds its acks.
    assert traced.signal_id == scoped.signal_id == decision.decision_id
    assert (traced.scope, traced.trace_id) == (None, second.trace_id)
    assert (scoped.scope, scoped.conversation_id) == ("conversation", "c")
    assert scoped.expires_at == decision.scope.until and scoped.topic_key() == b"conversation:c"
    for sent in (traced, scoped):
        record = sign(sent.to_dict(), key)
        validate(record, "kill-signal")
        assert read_signal(json.dumps(record).encode(), keyring(key)) == sent

    book = SignalBook(clock=lambda: detected + timedelta(seconds=seconds - 1))
    assert [book.deliver(sent) for sent in (traced, scoped)] == [True, True]
    with pytest.raises(AgentKilled):  # the trace that tripped, its conversation unknown
        book.check(second.trace_id)
    with pytest.raises(AgentKilled) as killed:  # the next turn, before any call of its own
        book.check(later.trace_id, conversation_id="c")
    assert killed.value.scope == "conversation"
    book.check(later.trace_id, conversation_id="another")  # other conversations go on
    expired = SignalBook(clock=lambda: detected + timedelta(seconds=seconds + 1))
    expired.deliver(scoped)
    expired.check(later.trace_id, conversation_id="c")  # the conversation kill expired


def test_a_flag_sends_no_signal_and_names_no_expiry():
    guard = guard_for(ON)
    decisions = [d for _ in range(2) for d in run(guard, turn("c").finished())]
    assert [(d.action, d.scope.until) for d in decisions] == [("flag", None)]
    assert kill_signals(decisions[0]) == []


def test_shadow_mode_flags_even_when_the_conversation_action_is_kill():
    guard = guard_for({"action": "flag", "conversation": {"enabled": True, "action": "kill"}})
    decisions = [d for _ in range(2) for d in run(guard, turn("c").finished())]
    assert [d.action for d in decisions] == ["flag"]


def test_a_cycle_spanning_traces():
    guard = guard_for(ON)
    decisions = []
    for _ in range(3):  # each turn goes round list_dir, read_file, run_tests once
        agent = AgentRecorder()
        for tool in ("list_dir", "read_file", "run_tests"):
            agent.tool(
                tool,
                attributes={
                    "gen_ai.operation.name": "execute_tool",
                    "gen_ai.tool.name": tool,
                    "gen_ai.tool.call.arguments": '{"path": "src"}',
                    "gen_ai.tool.call.result": '"same"',
                    "session.id": "s-9",
                },
            )
        decisions += run(guard, agent.finished())
    # tool_loop's flag comes first, at the first call of the third round (the 3rd trace's
    # first: list_dir's 3rd with the same calls between); a flag leaves the window as it is,
    # and the cycle rule's comes at the call ending the third round.
    assert [(d.rule, d.evidence.period, d.scope.traces) for d in decisions] == [
        ("tool_loop", None, 3),
        ("cycle", 3, 3),
    ]


def test_different_conversations_do_not_add_up():
    guard = guard_for(ON)
    decisions = [d for n in range(6) for d in run(guard, turn(f"conv-{n}").finished())]
    assert decisions == []


@pytest.mark.parametrize(
    "key",
    [
        "gen_ai.conversation.id",
        "session.id",
        "langfuse.session.id",
        "ai.telemetry.metadata.sessionId",
    ],
)
def test_each_convention_names_the_conversation(key):
    guard = guard_for(ON)
    decisions = [d for _ in range(2) for d in run(guard, turn("thread-7", key=key).finished())]
    assert [d.scope.conversation_id for d in decisions] == ["thread-7"]


def test_an_id_only_on_the_agent_span_still_joins_the_trace():
    guard = guard_for(ON)
    agent = AgentRecorder()
    agent.span("invoke_agent", {"gen_ai.operation.name": "invoke_agent", "session.id": "s1"})
    agent.finish()
    run(guard, agent.finished())
    assert guard.states[agent.trace_id].conversation_id == "s1"


def test_bad_ids_cost_themselves_only(caplog):
    guard = guard_for(ON)
    huge = "x" * 100_000
    run(guard, turn(huge).finished())
    (conversation_id,) = guard.conversations.states
    assert len(conversation_id) <= 200 and "sha256:" in conversation_id
    # Empty ids are no conversation at all.
    empty = turn("   ")
    run(guard, empty.finished())
    assert guard.states[empty.trace_id].conversation_id is None
    # Different values within one trace: the first wins, counted and told once.
    agent = AgentRecorder()
    for n in range(3):
        agent.tool("search_docs", REFUND, attributes=None)
        agent.span("chat", {"gen_ai.operation.name": "invoke_agent", "session.id": f"s-{n}"})
    with caplog.at_level(logging.WARNING, logger="spanguard.core"):
        run(guard, agent.finished())
    assert guard.states[agent.trace_id].conversation_id == "s-0"
    assert guard.stats.conversation_conflicts == 2
    assert len([r for r in caplog.records if "the first stands" in r.getMessage()]) == 1


def test_a_conversation_shared_by_thousands_of_traces_stays_bounded():
    guard = guard_for(ON)
    for n in range(MAX_TRACES_REMEMBERED + 50):
        agent = AgentRecorder()
        agent.tool(
            "lookup",
            attributes={
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": "lookup",
                "gen_ai.tool.call.arguments": json.dumps({"n": n}),
                "session.id": "busy",
            },
        )
        run(guard, agent.finished())
    state = guard.conversations.states["busy"]
    assert len(state.traces) == MAX_TRACES_REMEMBERED
    assert state.trace_count == MAX_TRACES_REMEMBERED + 50
    assert len(state.window) <= Policy().defaults.history


def test_the_conversation_token_budget_kills_each_trace_that_spends_past_it():
    guard = guard_for({"conversation": {"enabled": True, "token_budget": 1000}})
    decisions = []
    agents = []
    for _ in range(4):
        agent = AgentRecorder()
        agent.chat(300, 100, **{"gen_ai.conversation.id": "c"})  # 400 a turn
        agents.append(agent)
        decisions += run(guard, agent.finished())
    # 400, 800, 1200 (over: the 3rd turn is killed), 1600 (the 4th is killed too).
    assert [(d.rule, d.action, d.spend.tokens, d.trace_id) for d in decisions] == [
        ("token_budget", "kill", 1200, agents[2].trace_id),
        ("token_budget", "kill", 1600, agents[3].trace_id),
    ]
    assert all(d.scope_kind == "conversation" and d.spend.token_budget == 1000 for d in decisions)
    assert decisions[0].decision_id != decisions[1].decision_id


def priced_turns(usd_budget: float, turns: int, conversation_id: str) -> list:
    """The decisions over `turns` chat turns of one conversation at $0.005 each (gpt-4o at $10
    a million tokens), under a conversation budget of `usd_budget` dollars."""
    guard = guard_for(
        {
            "prices": {"gpt-4o": {"input_mtok": 10, "output_mtok": 10}},
            "conversation": {"enabled": True, "usd_budget": usd_budget},
        }
    )
    decisions = []
    for _ in range(turns):
        agent = AgentRecorder()
        agent.chat(400, 100, **{"gen_ai.conversation.id": conversation_id})  # $0.005 a turn
        decisions += run(guard, agent.finished())
    return decisions


def test_the_conversation_usd_budget():
    decisions = priced_turns(0.01, 3, "c")
    assert [(d.rule, d.spend.cost_micro_usd, d.spend.budget_micro_usd) for d in decisions] == [
        ("cost_budget", 15_000, 10_000)
    ]


def test_off_by_default_and_nothing_read_then():
    guard = Guard(Policy())
    assert guard.conversations is None
    assert "gen_ai.conversation.id" not in guard.wanted_keys


def test_policy_shape_round_trips_and_refuses_bad_values():
    policy = Policy.from_mapping({"defaults": {"conversation": {"enabled": True, "usd_budget": 5}}})
    assert Policy.from_mapping(policy.effective()) == policy
    with pytest.raises(PolicyError, match=r"field defaults\.conversation\.action"):
        Policy.from_mapping({"defaults": {"conversation": {"action": "downgrade"}}})
    timed = Policy.from_mapping({"defaults": {"conversation": {"kill_ttl": 600}}})
    assert (
        timed.defaults.conversation.kill_ttl == 600
        and Policy().defaults.conversation.kill_ttl == 3600
    )
    assert Policy.from_mapping(timed.effective()) == timed
    for bad in (0, 5, 10**9):
        with pytest.raises(PolicyError, match=r"conversation\.kill_ttl"):
            Policy.from_mapping({"defaults": {"conversation": {"kill_ttl": bad}}})


def test_replay_over_a_multi_trace_file(tmp_path):
    path = tmp_path / "spans.jsonl"
    with path.open("w") as handle:
        for _ in range(6):
            handle.write(encode_json_line(encode(turn("conv-42").finished())) + "\n")
    policy_path = tmp_path / "policy.yaml"
    policy_path.write_text("defaults:\n  conversation: {enabled: true}\n")
    out, err = io.StringIO(), io.StringIO()
    replay([str(path)], load_policy(policy_path), stdout=out, stderr=err)
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(r["rule"], r["action"], r["scope"], r["conversation_id"]) for r in records] == [
        ("tool_loop", "flag", "conversation", "conv-42")
    ]
    # Without the scope, the same file decides nothing.
    out = io.StringIO()
    replay([str(path)], Policy(), stdout=out, stderr=io.StringIO())
    assert out.getvalue() == ""


def test_a_page_names_the_conversation_and_the_cost():
    from spanguard.alerting.pagerduty import PagerSettings, build_event

    (decision,) = priced_turns(0.006, 2, "c-7")
    settings = PagerSettings(routing_key="R0uT1nGk3yS3cR3tV4lu3F0rT3sts42x")
    details = build_event(decision.to_dict(), settings)["payload"]["custom_details"]
    assert (details["scope"], details["conversation_id"], details["traces"]) == (
        "conversation",
        "c-7",
        2,
    )
    assert (details["cost_micro_usd"], details["budget_micro_usd"]) == (10_000, 6_000)


def test_a_kill_action_kills_once_per_trace_and_again_on_a_new_repeat():
    guard = guard_for({"conversation": {"enabled": True, "action": "kill"}})
    turns = [turn("c") for _ in range(6)]
    decisions = [d for agent in turns for d in run(guard, agent.finished())]
    # 3 identical calls across traces kill; the window starts afresh; 3 more kill again.
    assert [(d.action, d.trace_id) for d in decisions] == [
        ("kill", turns[1].trace_id),
        ("kill", turns[2].trace_id),
        ("kill", turns[4].trace_id),
        ("kill", turns[5].trace_id),
    ]
    assert len({d.decision_id for d in decisions}) == 4


def test_a_conversation_decision_not_sent_is_retracted_in_the_conversation_only():
    guard = guard_for({"conversation": {"enabled": True, "action": "kill"}})
    first, second = turn("c"), turn("c", calls=5)
    run(guard, first.finished())
    trace_decisions = run(guard, second.finished())
    # The second turn: the conversation's kill at its 1st call, then its own at its 3rd.
    assert [(d.rule, d.scope_kind) for d in trace_decisions] == [
        ("tool_loop", "conversation"),
        ("tool_loop", None),
    ]
    conversation_kill, trace_kill = trace_decisions
    guard.retract(conversation_kill)
    assert "tool_loop:" + second.trace_id not in guard.conversations.states["c"].killed
    assert trace_kill.rule in {mark.rule for mark in guard.states[second.trace_id].fired}


def test_the_conversation_a_span_names_is_the_same_read_again():
    from spanguard.detection.conventions.keys import CONVERSATION_KEY_SET
    from spanguard.detection.conventions.turns import conversation_of
    from spanguard.schemas.otlp_view import view_of
    from tests.support.spans import encode

    huge = "y" * 1_000
    answers = []
    for _ in range(2):  # the second read answers from what the first kept
        agent = AgentRecorder()
        # A placeholder in the first key falls through to the next; blank is none at all.
        agent.span("a", {"gen_ai.conversation.id": "none", "session.id": " s-1 "})
        agent.span("b", {"gen_ai.conversation.id": huge})
        agent.span("c", {"session.id": "   "})
        view = view_of(encode(agent.finished()))
        spans = view.resource_spans[0].scope_spans[0].spans
        answers.append([conversation_of(span.attributes, span.attributes) for span in spans])
    assert answers[0] == answers[1]
    first, long, blank = answers[0]
    assert first == "s-1" and blank is None
    assert len(long) <= 200 and "sha256:" in long
    assert "session.id" in CONVERSATION_KEY_SET


# VoltAgent starting a trace per run, each linked to the span of the request it answers: one
# request asking the same lookup six times, and one asking about four invoices.
LINKED_RUNS = Path(__file__).parents[1] / "fixtures" / "multi_agent" / "voltagent" / "capture"
CALLER_SPAN = "POST /agents/run"


def linked_traces(scenario: str) -> tuple[str, list[tuple[str, ExportTraceServiceRequest]]]:
    """The caller's trace id and the scenario's requests, one per trace, as they ended."""
    path = LINKED_RUNS / f"{scenario}.json.gz"
    (caller,) = {span["traceId"] for span in spans(path) if span["name"] == CALLER_SPAN}
    return caller, per_trace(path)


def test_runs_linked_to_one_callers_trace_are_one_conversation():
    caller, traces = linked_traces("linked_runs_repeat")
    guard = guard_for({"conversation": {"enabled": True, "action": "kill"}})
    decisions = [d for _trace, request in traces for d in guard.process(request)]
    runs = [trace for trace, _request in traces if trace != caller]
    # Each run looks inv-1 up once, with the same answer: the 3rd run completes the repeat, the
    # window restarts at the kill, the 6th completes the next. No run alone is a loop.
    assert [(d.rule, d.action, d.scope_kind, d.trace_id) for d in decisions] == [
        ("tool_loop", "kill", "conversation", runs[2]),
        ("tool_loop", "kill", "conversation", runs[5]),
    ]
    assert {d.scope.conversation_id for d in decisions} == {f"trace:{caller}"}
    assert [d.scope.traces for d in decisions] == [3, 3]
    assert guard.stats.linked_runs == len(runs) == 6
    for decision in decisions:
        validate(decision.to_dict(), "detection")
    # The run that tripped, the caller's linked runs, and the caller itself: what calls again.
    traced, scoped, callers = kill_signals(decisions[0])
    assert traced.signal_id == scoped.signal_id == callers.signal_id
    assert (traced.scope, traced.trace_id) == (None, runs[2])
    assert (scoped.scope, scoped.conversation_id) == ("conversation", f"trace:{caller}")
    assert (callers.scope, callers.trace_id) == (None, caller)
    validate(callers.to_dict(), "kill-signal")
    book = SignalBook()
    assert all(book.deliver(signal) for signal in (traced, scoped, callers))
    with pytest.raises(AgentKilled):
        book.check(caller)
    book.check(runs[0])  # an earlier run is not stopped by its trace


def test_linked_runs_doing_new_work_each_time_are_not_decided():
    _caller, traces = linked_traces("linked_runs_with_work")
    guard = guard_for({"conversation": {"enabled": True, "action": "kill"}})
    assert [d for _trace, request in traces for d in guard.process(request)] == []
    assert guard.stats.linked_runs == 4


def test_linked_runs_are_not_followed_with_the_scope_off_or_a_conversation_named():
    caller, traces = linked_traces("linked_runs_repeat")
    guard = Guard(Policy())  # the shipped default: the conversation scope off
    assert [d for _trace, request in traces for d in guard.process(request)] == []
    assert guard.stats.linked_runs == 6
    assert all(state.conversation_id is None for state in guard.states.values())
    # Runs that name a conversation of their own stay in it: the link is only a fallback.
    guard = guard_for({"conversation": {"enabled": True}})
    decisions = []
    for _trace, request in traces:
        for resource in request.resource_spans:
            for scope in resource.scope_spans:
                for span in scope.spans:
                    span.attributes.add(key="conversation.id").value.string_value = "chat-7"
        decisions += guard.process(request)
    assert [(d.rule, d.scope.conversation_id) for d in decisions] == [("tool_loop", "chat-7")]
    assert f"trace:{caller}" not in {s.conversation_id for s in guard.states.values()}


def test_a_conversation_named_like_a_linked_one_stops_no_other_trace():
    """Only `trace:` and a trace id of 32 hex digits names a caller's trace."""
    for named in ("trace:", "trace:not-a-trace-id", "trace:" + "AB" * 16, "c"):
        assert caller_trace_of(named) is None
    assert caller_trace_of("trace:" + "ab" * 16) == "ab" * 16
