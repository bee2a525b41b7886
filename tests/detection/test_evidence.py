"""What a decision carries to answer "why was my agent killed": the window when the rule
tripped, the policy entry in force, the threshold, and when the tripping span ended."""

from __future__ import annotations

from datetime import UTC, datetime

from spanguard.detection.guard import Guard
from spanguard.detection.trace_state import TraceState
from spanguard.schemas.decision import Decision, validate
from spanguard.schemas.policy import Policy
from tests.support.spans import AgentRecorder, one_request_per_span, span_id_of

REFUND = {"query": "refund policy"}
POLICY = {
    "agents": [
        {"match": {"service.name": "someone-else"}, "loop": {"window": 20, "threshold": 5}},
        {"match": {"service.name": "support-bot"}, "loop": {"window": 6, "threshold": 3}},
    ]
}


def iso(unix_nano: int) -> str:
    """The SDK's end time in nanoseconds, to the microsecond (truncated, as the guard does)."""
    seconds, nanos = divmod(unix_nano, 1_000_000_000)
    moment = datetime.fromtimestamp(seconds, UTC).replace(microsecond=nanos // 1000)
    return moment.isoformat(timespec="microseconds")


def run(guard: Guard, agent: AgentRecorder) -> list[Decision]:
    return [d for r in one_request_per_span(agent.finished()) for d in guard.process(r)]


def test_a_loop_decision_carries_its_window_policy_entry_and_threshold() -> None:
    agent = AgentRecorder("support-bot")
    tools = []
    for step in range(5):  # search, read, search, read, search: the 3rd search trips (6, 3)
        tools.append(agent.tool("search_docs", REFUND))
        if step < 4:  # pages that answer nothing: no new work between the searches
            tools.append(agent.tool("read_page", {"url": f"kb/{step}"}, result=""))
    (decision,) = run(Guard(Policy.from_mapping(POLICY)), agent)
    validate(decision.to_dict(), "detection")
    assert (decision.policy.entry, decision.policy.match) == (
        "agents.1",
        {"service.name": "support-bot"},
    )
    assert (decision.evidence.window, decision.evidence.threshold, decision.evidence.hits) == (
        6,
        3,
        3,
    )
    tripping = tools[4]
    assert decision.span_id == span_id_of(tripping)
    assert decision.span_ended_at == iso(tripping.end_time)
    # The window as it was: the 5 calls up to and including the tripping one, oldest first.
    assert [c["span_id"] for c in decision.evidence.calls] == [span_id_of(s) for s in tools[:5]]
    assert [c["tool_name"] for c in decision.evidence.calls] == ["search_docs", "read_page"] * 2 + [
        "search_docs"
    ]
    assert [c["ended_at"] for c in decision.evidence.calls] == [iso(s.end_time) for s in tools[:5]]
    searches = {c["args_hash"] for c in decision.evidence.calls if c["tool_name"] == "search_docs"}
    assert searches == {decision.evidence.args_hash}
    reads = [c["args_hash"] for c in decision.evidence.calls if c["tool_name"] == "read_page"]
    assert len(set(reads)) == 2 and decision.evidence.args_hash not in reads
    assert "refund policy" not in decision.to_json()  # hashes, never arguments


def test_the_window_slides_and_the_defaults_are_named() -> None:
    agent = AgentRecorder("support-bot")
    spans = [agent.tool("step", {"n": n}) for n in range(12)]
    spans += [agent.tool("search_docs", REFUND) for _ in range(3)]
    (decision,) = run(Guard(), agent)
    assert (decision.policy.entry, decision.policy.match, decision.evidence.threshold) == (
        "defaults",
        None,
        3,
    )
    # Window 10: the 3 searches and the 7 distinct steps before them, the older ones slid out.
    assert [c["span_id"] for c in decision.evidence.calls] == [span_id_of(s) for s in spans[-10:]]


def test_a_budget_decision_names_its_entry_and_has_no_window() -> None:
    agent = AgentRecorder("support-bot")
    agent.chat(900, 200)
    policy = Policy.from_mapping({"defaults": {"token_budget": 1000}})
    (decision,) = run(Guard(policy), agent)
    assert decision.rule == "token_budget" and decision.evidence.calls is None
    assert decision.policy.entry == "defaults" and decision.spend.token_budget == 1000
    assert decision.span_ended_at == iso(agent.finished()[-1].end_time)
    validate(decision.to_dict(), "detection")


def test_window_marks_survive_the_changelog_and_older_states_still_load() -> None:
    agent = AgentRecorder("support-bot")
    spans = [agent.tool("search_docs", REFUND) for _ in range(2)]  # one short of the loop
    guard = Guard()
    run(guard, agent)
    (state,) = guard.states.values()
    restored = TraceState.from_bytes(state.to_bytes())
    assert restored.window_calls() == state.window_calls()
    assert [c["span_id"] for c in restored.window_calls()] == [span_id_of(s) for s in spans]

    # A state written before window marks existed: its calls have unknown span ids and times.
    old = state.to_dict()
    del old["window_marks"]
    calls = TraceState.from_dict(old).window_calls()
    assert [(c["tool_name"], c["span_id"], c["ended_at"]) for c in calls] == [
        ("search_docs", None, None)
    ] * 2
    # And it keeps counting: the 3rd identical call still trips, with a partly known window.
    guard.states[next(iter(guard.states))] = TraceState.from_dict(old)
    third = agent.tool("search_docs", REFUND)
    (decision,) = [d for r in one_request_per_span([third]) for d in guard.process(r)]
    assert [c["span_id"] for c in decision.evidence.calls] == [None, None, span_id_of(third)]
    validate(decision.to_dict(), "detection")
