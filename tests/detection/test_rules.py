"""The rules over spans made by the real SDK and encoded by the real OTLP encoder."""

from __future__ import annotations

import json

import pytest

from spanguard.detection.guard import Guard
from spanguard.schemas.decision import KillSignal, validate
from spanguard.schemas.policy import Policy
from tests.support.spans import AgentRecorder, encode, one_request_per_span, span_id_of, trace_id_of

REFUND = {"query": "refund policy"}


def run(guard: Guard, spans) -> list:
    """Feed spans one request each, in order, as a stream would deliver them."""
    return [d for request in one_request_per_span(spans) for d in guard.process(request)]


def tool_spans(recorder: AgentRecorder):
    return [
        s
        for s in recorder.finished()
        if s.attributes.get("gen_ai.operation.name") == "execute_tool"
    ]


def test_research_agent_with_80_distinct_calls_never_trips():
    agent = AgentRecorder("research-assistant")
    for step in range(80):
        agent.chat(500, 50)
        agent.tool(["search_web", "fetch_pdf", "summarize"][step % 3], {"q": f"topic {step}"})
    agent.finish()
    guard = Guard()
    assert run(guard, agent.finished()) == []
    assert guard.stats.tool_calls == 80


def test_flaky_index_agent_trips_on_its_third_identical_call():
    agent = AgentRecorder("support-bot", "support")
    for step in range(7):
        agent.chat(300, 40)
        agent.tool("search_docs", {**REFUND, "timestamp": step})
    agent.finish()
    guard = Guard()
    decisions = run(guard, agent.finished())
    assert len(decisions) == 1  # the loop goes on to 7 calls: still one kill
    decision = decisions[0]
    third = tool_spans(agent)[2]
    assert decision.span_id == span_id_of(third)
    assert decision.trace_id == trace_id_of(third)
    assert (decision.rule, decision.action, decision.evidence.hits, decision.evidence.window) == (
        "tool_loop",
        "kill",
        3,
        10,
    )
    assert decision.reason == "search_docs called 3x in last 3 steps"
    assert decision.agent.service == "support-bot"
    validate(decision.to_dict(), "detection")
    validate(KillSignal.from_decision(decision).to_dict(), "kill-signal")


def test_oscillation_is_a_loop_at_its_fifth_call_and_a_cycle_at_its_sixth():
    agent = AgentRecorder()
    for step in range(8):
        if step % 2 == 0:
            agent.tool("search_docs", REFUND)
        else:
            agent.tool("read_page", {"url": "https://kb/refunds"})
    # The default policy's tool_loop catches the round first, at A's 3rd call (the 5th: the
    # first call of the third round): the B between is made again and again, no new work.
    [loop] = run(Guard(), agent.finished())
    assert loop.rule == "tool_loop"
    assert loop.span_id == span_id_of(agent.finished()[4])
    assert loop.reason == "search_docs called 3x in last 5 steps"
    # With tool_loop off, the cycle rule catches it at the call ending the third round.
    no_loop = Policy.from_yaml("defaults: {loop: {enabled: false}}")
    [decision] = run(Guard(no_loop), agent.finished())  # the cycle's kill restarts the window
    assert (decision.rule, decision.action, decision.evidence.period, decision.evidence.hits) == (
        "cycle",
        "kill",
        2,
        3,
    )
    assert decision.span_id == span_id_of(agent.finished()[5])  # (A, B) three times: 6th call
    assert decision.reason == (
        "a sequence of 2 calls (search_docs -> read_page) repeated 3x with the same arguments"
        " and results"
    )


def test_two_tries_of_each_query_are_exploration_not_a_loop():
    agent = AgentRecorder()
    for step in range(30):
        # Each query tried twice (a third identical try is the default threshold: a loop).
        agent.tool("search_docs", {"query": f"q{step // 2}"})
    assert run(Guard(), agent.finished()) == []


def test_streaming_partial_spans_of_one_call_count_once():
    """Spans sharing a call id while they overlap in time are parts of one call."""
    agent = AgentRecorder()
    tracer = agent.tracer
    for call in range(2):  # two calls of 4 parts each: the third call is the loop's
        parts = [
            tracer.start_span(
                "execute_tool search_docs", context=agent._context, attributes=tool_attributes(call)
            )
            for _part in range(4)
        ]
        for part in parts:
            part.end()
    guard = Guard()
    assert run(guard, agent.finished()) == []
    assert guard.stats.repeated_call_ids == 6
    agent.tool("search_docs", REFUND, call_id="call_2")
    assert len(run(guard, agent.finished()[-1:])) == 1


def tool_attributes(call: int) -> dict:
    return {
        "gen_ai.operation.name": "execute_tool",
        "gen_ai.tool.name": "search_docs",
        "gen_ai.tool.call.arguments": json.dumps(REFUND),
        "gen_ai.tool.call.id": f"call_{call}",
    }


def test_a_call_id_made_again_after_its_call_ended_is_a_new_execution():
    """Harnesses re-issue a call with the first call's id, and models reuse ids across turns:
    each execution counts (a state written before version 4 knows no end times: partial)."""
    agent = AgentRecorder()
    for _ in range(3):
        agent.tool(
            "transfer_to_human_agents",
            {"summary": "refund"},
            call_id="call_1",
            result="Transfer failed: no agent available",
        )
    guard = Guard()
    [decision] = run(guard, agent.finished())
    assert (decision.rule, decision.evidence.hits) == ("tool_loop", 3)
    assert decision.span_id == span_id_of(agent.finished()[2])
    assert (guard.stats.reissued_call_ids, guard.stats.repeated_call_ids) == (2, 0)


def test_placeholder_call_ids_are_no_ids():
    agent = AgentRecorder()
    for _ in range(4):
        agent.tool("search_docs", REFUND, call_id="<not specified>")
    assert len(run(Guard(), agent.finished())) == 1


def test_duplicate_deliveries_are_not_recounted():
    agent = AgentRecorder()
    for _ in range(2):  # one call short of the loop
        agent.tool("search_docs", REFUND)
    request = encode(agent.finished())
    guard = Guard()
    for _ in range(3):  # an exporter retry and a Kafka redelivery of the same batch
        assert guard.process(request) == []
    assert guard.stats.duplicate_spans == 4
    agent.tool("search_docs", REFUND)
    assert len(run(guard, agent.finished()[-1:])) == 1


BACKOFF_POLICY = Policy.from_mapping(
    {"agents": [{"match": {"service.name": "poller"}, "loop": {"window": 20, "threshold": 4}}]}
)


def backoff_agent(service: str) -> AgentRecorder:
    """Calls, waits longer each time (a distinct wait call per step), calls again. The waits
    (4, 5, 6, ... calls) keep three status calls out of any 10 calls: the default threshold."""
    agent = AgentRecorder(service)
    for attempt in range(6):
        agent.tool("get_job_status", {"job": "j-42"})
        for pause in range(attempt + 4):
            # A wait answers nothing: no new work.
            agent.tool("sleep", {"seconds": 2**attempt, "i": pause}, result="")
    return agent


def test_backoff_loop_escapes_window_10_and_is_caught_by_the_window_20_override():
    assert run(Guard(BACKOFF_POLICY), backoff_agent("other").finished()) == []
    decisions = run(Guard(BACKOFF_POLICY), backoff_agent("poller").finished())
    assert [(d.evidence.tool_name, d.evidence.hits, d.evidence.window) for d in decisions] == [
        ("get_job_status", 4, 20)
    ]


def test_per_agent_volatile_keys_are_added_to_the_defaults():
    policy = Policy.from_mapping(
        {
            "agents": [
                {"match": {"gen_ai.agent.name": "ticket-bot"}, "volatile_keys": ["created_at"]}
            ]
        }
    )
    for name, expected in (("ticket-bot", 1), ("other-bot", 0)):
        # The agent's name on the resource: known from the trace's first span on.
        agent = AgentRecorder("helpdesk", name, **{"gen_ai.agent.name": name})
        for step in range(5):
            agent.tool("create_ticket", {"title": "refund", "created_at": step})
        assert len(run(Guard(policy), agent.finished())) == expected, name


def test_agent_name_learned_from_an_earlier_span_of_the_trace():
    policy = Policy.from_mapping(
        {
            "agents": [
                {"match": {"gen_ai.agent.name": "ticket-bot"}, "volatile_keys": ["created_at"]}
            ]
        }
    )
    agent = AgentRecorder("helpdesk", "ticket-bot")
    # One span says who the agent is (here a chat span); later tool spans do not.
    agent.chat(10, 10, **{"gen_ai.agent.name": "ticket-bot"})
    for step in range(4):
        agent.tool("create_ticket", {"title": "refund", "created_at": step})
    decisions = run(Guard(policy), agent.finished())
    assert [(d.evidence.tool_name, d.agent.name) for d in decisions] == [
        ("create_ticket", "ticket-bot")
    ]


def test_token_budget_trips_on_the_span_that_crossed_it():
    policy = Policy.from_mapping({"defaults": {"token_budget": 1000}})
    agent = AgentRecorder()
    for _ in range(5):
        agent.chat(300, 100)  # 400 per call: crosses 1000 on the 3rd
    agent.finish(**{"gen_ai.usage.input_tokens": 1500, "gen_ai.usage.output_tokens": 500})
    decisions = run(Guard(policy), agent.finished())
    assert len(decisions) == 1
    chats = [s for s in agent.finished() if s.name.startswith("chat")]
    assert decisions[0].span_id == span_id_of(chats[2])
    assert (decisions[0].rule, decisions[0].action, decisions[0].spend.tokens) == (
        "token_budget",
        "kill",
        1200,
    )


def test_agent_aggregates_and_cache_tokens_are_not_double_counted():
    policy = Policy.from_mapping({"defaults": {"token_budget": 1000}})
    agent = AgentRecorder()
    agent.chat(400, 100, **{"gen_ai.usage.cache_read.input_tokens": 300})
    # The agent span repeats the aggregate, under either name.
    agent.finish(**{"gen_ai.usage.input_tokens": 400, "gen_ai.aggregated_usage.output_tokens": 100})
    guard = Guard(policy)
    assert run(guard, agent.finished()) == []  # 500, not 800 nor 1000
    assert guard.states[agent.trace_id].inference_tokens == 500


def test_agent_usage_is_the_fallback_when_no_inference_span_has_usage():
    policy = Policy.from_mapping({"defaults": {"token_budget": 1000}})
    agent = AgentRecorder()
    agent.tool("search_docs", REFUND)
    agent.finish(
        **{
            "gen_ai.aggregated_usage.input_tokens": 900,
            "gen_ai.aggregated_usage.output_tokens": 200,
        }
    )
    decisions = run(Guard(policy), agent.finished())
    assert [(d.rule, d.spend.tokens) for d in decisions] == [("token_budget", 1100)]


def test_downgrade_then_kill():
    policy = Policy.from_mapping({"defaults": {"action": "downgrade"}})
    agent = AgentRecorder()
    for _ in range(12):
        agent.tool("search_docs", REFUND)
    decisions = run(Guard(policy), agent.finished())
    assert [d.action for d in decisions] == ["downgrade", "kill"]
    downgrade, kill = decisions
    assert downgrade.system_message == (
        "You called search_docs 3 times with the same arguments; the tool returns the same"
        " result. Try a different approach or stop and report what you found."
    )
    # The window restarts after the downgrade: the kill comes at the 3rd call after it.
    assert kill.span_id == span_id_of(agent.finished()[5])
    assert kill.system_message is None
    signal = KillSignal.from_decision(downgrade).to_dict()
    validate(signal, "kill-signal")
    assert signal["kind"] == "downgrade" and signal["evidence"]["hits"] == 3


@pytest.mark.parametrize("missing_args", ["skip", "name_only"])
def test_tool_spans_without_arguments(missing_args, caplog):
    policy = Policy.from_mapping({"defaults": {"missing_args": missing_args}})
    agent = AgentRecorder("research-assistant")
    for _ in range(80):
        agent.tool("search_web", None)  # content capture off: no arguments recorded
    guard = Guard(policy)
    decisions = run(guard, agent.finished())
    if missing_args == "skip":
        assert decisions == []
        assert guard.stats.missing_arguments == 80
        warnings = [r for r in caplog.records if "missing_args: name_only" in r.getMessage()]
        assert len(warnings) == 1  # once per service, naming the setting
    else:
        # A tool name alone cannot tell 80 different searches from a loop: flagged, not killed.
        assert len(decisions) == 1
        assert decisions[0].evidence.args_hash is None and decisions[0].action == "flag"
        assert "keyed on the tool name alone" in decisions[0].reason


def test_state_holds_hashes_not_raw_arguments():
    agent = AgentRecorder()
    secret = "4111-1111-1111-1111"
    for _ in range(2):  # one call short of the loop: its kill would empty the window
        agent.tool("charge_card", {"card": secret})
    guard = Guard()
    run(guard, agent.finished())
    (state,) = guard.states.values()
    assert secret not in json.dumps(state.to_dict())
    assert len(state.window) == 2


def test_state_is_bounded_by_the_window():
    agent = AgentRecorder()
    for step in range(500):
        agent.tool("search_web", {"q": step})
    guard = Guard()
    run(guard, agent.finished())
    (state,) = guard.states.values()
    assert len(state.window) == 10
    assert len(state.recent_span_ids) <= 64


def test_state_survives_serialization_mid_loop():
    agent = AgentRecorder()
    for _ in range(4):
        agent.tool("search_docs", REFUND)
    spans = agent.finished()
    first = Guard()
    run(first, spans[:2])
    restored = Guard(states={k: type(v).from_bytes(v.to_bytes()) for k, v in first.states.items()})
    assert run(restored, spans[:2]) == []  # redelivered: not recounted
    assert len(run(restored, spans[2:])) == 1


def test_idle_traces_are_evicted():
    now = [1000.0]
    guard = Guard(clock=lambda: now[0])
    agent = AgentRecorder()
    agent.tool("search_docs", REFUND)
    run(guard, agent.finished())
    now[0] += 3599
    assert guard.evict_idle(3600) == 0
    now[0] += 2
    assert guard.evict_idle(3600) == 1
    assert not guard.states


def test_mixed_traces_in_one_request_keep_separate_state():
    loopers = [AgentRecorder() for _ in range(2)]
    spans = []
    for _ in range(4):
        for agent in loopers:
            agent.tool("search_docs", REFUND)
    for agent in loopers:
        spans.extend(agent.finished())
    decisions = Guard().process(encode(spans))
    assert sorted(d.trace_id for d in decisions) == sorted(
        trace_id_of(agent.finished()[0]) for agent in loopers
    )


def test_same_call_same_result_is_a_loop_changing_result_is_polling():
    agent = AgentRecorder()
    job = {"job_id": "job-7"}
    for step in range(25):
        agent.tool("get_job_status", job, attributes={
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": "get_job_status",
            "gen_ai.tool.call.arguments": json.dumps(job),
            "gen_ai.tool.call.result": json.dumps({"state": "running", "done": step}),
        })  # fmt: skip
    assert run(Guard(), agent.finished()) == []  # the job makes progress: never killed for it
    flipping = AgentRecorder()  # a status going round the same answers: no progress
    for step in range(25):
        flipping.tool("get_job_status", job, result=f"stage {step % 6} of 6")
    (decision,) = run(
        Guard(Policy.from_yaml("defaults: {cycle: {enabled: false}}")), flipping.finished()
    )
    assert (decision.rule, decision.action, decision.evidence.hits) == ("tool_polling", "kill", 20)
    assert decision.span_id == span_id_of(flipping.finished()[19])
    validate(KillSignal.from_decision(decision).to_dict(), "kill-signal")

    stuck = AgentRecorder()
    for _ in range(4):
        stuck.tool("get_job_status", job, attributes={
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": "get_job_status",
            "gen_ai.tool.call.arguments": json.dumps(job),
            "gen_ai.tool.call.result": "running",
        })  # fmt: skip
    (loop,) = run(Guard(), stuck.finished())
    assert (loop.rule, loop.evidence.hits) == (
        "tool_loop",
        3,
    ) and loop.evidence.result_hash is not None


def test_polling_tools_are_patient_even_when_the_status_repeats():
    policy = Policy.from_mapping(
        {"defaults": {"polling": {"window": 12, "threshold": 10, "tools": ["get_job_status"]}}}
    )
    agent = AgentRecorder()
    for _ in range(12):
        agent.tool("get_job_status", None, attributes={
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": "get_job_status",
            "gen_ai.tool.call.arguments": '{"job_id": "job-7"}',
            "gen_ai.tool.call.result": "running",
        })  # fmt: skip
    (decision,) = run(Guard(policy), agent.finished())
    assert (decision.rule, decision.evidence.hits) == ("tool_polling", 10)


def searches_that_find_nothing() -> AgentRecorder:
    """Five different searches, each answered with nothing: no progress, not a loop."""
    agent = AgentRecorder()
    for query in ("refund", "refunds", "refund policy", "returns", "money back"):
        agent.tool("search_docs", None, attributes={
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": "search_docs",
            "gen_ai.tool.call.arguments": json.dumps({"query": query}),
            "gen_ai.tool.call.result": "[]",
        })  # fmt: skip
    return agent


def test_no_progress_is_a_flag_by_default_and_can_kill():
    agent = searches_that_find_nothing()
    (flag,) = run(Guard(), agent.finished())
    assert (flag.rule, flag.action, flag.evidence.hits) == ("no_progress", "flag", 4)
    policy = Policy.from_mapping({"defaults": {"no_progress": {"threshold": 5, "action": "kill"}}})
    (kill,) = run(Guard(policy), agent.finished())
    assert (kill.rule, kill.action, kill.evidence.hits) == ("no_progress", "kill", 5)
    off = Policy.from_mapping({"defaults": {"no_progress": {"action": "off"}}})
    assert run(Guard(off), agent.finished()) == []


def test_folding_is_opt_in_per_tool():
    policy = Policy.from_mapping({"defaults": {"fold": {"search_docs": ["case", "whitespace"]}}})
    agent = AgentRecorder()
    for query in ("Refund policy", "refund  policy", "REFUND POLICY ", "refund policy"):
        agent.tool("search_docs", {"query": query})
    (decision,) = run(Guard(policy), agent.finished())
    assert decision.evidence.tool_name == "search_docs" and decision.evidence.hits == 3
    assert run(Guard(), agent.finished()) == []


@pytest.mark.parametrize(
    ("settings", "field"),
    [
        ({"polling": {"window": 5, "threshold": 6}}, "defaults.polling"),
        ({"no_progress": {"threshold": 11}}, "defaults.no_progress"),
        ({"fold": {"search_docs": ["accents"]}}, "defaults.fold.search_docs.0"),
    ],
)
def test_bad_result_aware_settings_name_the_field(settings, field):
    from spanguard.errors import PolicyError

    with pytest.raises(PolicyError, match=field.replace(".", r"\.")):
        Policy.from_mapping({"defaults": settings})


def test_state_with_polls_survives_serialization_and_old_records_load():
    from spanguard.detection.trace_state import TraceState, encode_record

    state = TraceState()
    state.window.extend([("a", "h1", "r1"), ("a", "h1", None)])
    state.polls.append(("a", "h1"))
    restored = TraceState.from_bytes(state.to_bytes())
    assert list(restored.window) == list(state.window) and list(restored.polls) == [("a", "h1")]
    assert restored.counts == {("a", "h1", "r1"): 1, ("a", "h1", None): 1}
    old = json.loads(encode_record(state.to_dict()))  # a JSON record, as before version 5
    old["window"] = [["a", "h1"]]
    del old["polls"]
    assert list(TraceState.from_dict(old).window) == [("a", "h1", None)]
