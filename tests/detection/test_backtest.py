"""The backtest's comparison, without Kafka: records in, decisions added and removed out."""

from __future__ import annotations

import json

import pytest

from spanguard.cli.report import render_backtest_html
from spanguard.detection.backtest import Backtest, format_report
from spanguard.schemas.policy import Policy
from tests.detection.test_report import Page
from tests.support.spans import AgentRecorder, encode

T0 = 1_780_000_000.0  # record time of the first record
STRICT = Policy.from_mapping({"defaults": {"loop": {"threshold": 3}}})
# The current policy STRICT is tried against: the default before it went to 3 (the shipped
# default is now STRICT's threshold, and would change nothing).
LENIENT = Policy.from_mapping({"defaults": {"loop": {"threshold": 4}}})
BUDGET = Policy.from_mapping({"defaults": {"token_budget": 1000}})
SHADOW = Policy.from_mapping({"defaults": {"action": "flag"}})


def records(agent: AgentRecorder, start: float = T0, step: float = 1.0):
    """(key, value, record time) of each finished span of `agent`, one request per span."""
    return [
        (agent.trace_id.encode(), encode([span]).SerializeToString(), start + i * step)
        for i, span in enumerate(agent.finished())
    ]


# Without agent rules the guard reads no agent name: agents are told apart by service.
def looping(service: str, calls: int, agent_name: str = "bot") -> AgentRecorder:
    agent = AgentRecorder(service, agent_name)
    for _ in range(calls):
        agent.tool("search_docs", {"query": "refund policy"})
    agent.finish()  # the invoke_agent span, with the agent's name, ends last
    return agent


def run(new: Policy, current: Policy, *feeds, **options) -> object:
    backtest = Backtest(new, current, **options)
    for partition, key, value, at in feeds:
        backtest.feed(partition, key, value, at)
    return backtest.finish()


def on(partition: int, recs) -> list:
    return [(partition, *record) for record in recs]


def test_a_stricter_loop_threshold_adds_a_kill_where_the_current_policy_had_none() -> None:
    three = looping("support-bot", 3)
    four = looping("support-bot", 4)
    two = looping("research", 2)
    report = run(STRICT, LENIENT, *on(0, records(three)), *on(1, records(four)),
                 *on(0, records(two)))  # fmt: skip
    assert report.decisions == [2, 1]
    assert report.added == 1 and report.removed == 0 and report.changed_traces == 1
    change = report.changes[("support-bot", None, "tool_loop", "kill")]
    assert change.added == 1 and change.added_traces == [three.trace_id]
    assert [t.trace_id for t in report.kept] == [three.trace_id]
    assert report.kept[0].added[0].reason == "search_docs called 3x in last 3 steps"
    assert report.traces == 3 and report.records == 4 + 5 + 3 and report.skipped == 0
    text = format_report(report)
    assert "1 added, 0 removed in 1 changed traces" in text
    assert f"+ {three.trace_id} support-bot tool_loop -> kill" in text
    assert four.trace_id not in text  # both policies kill it: no change
    document = report.to_dict()
    json.dumps(document)
    assert document["changes"][0]["added_traces"] == [three.trace_id]
    assert document["tokens_tracked"] is False


def test_shadow_mode_removes_the_kill_and_adds_a_flag() -> None:
    four = looping("support-bot", 4)
    report = run(SHADOW, Policy(), *on(0, records(four)))
    assert report.changes[("support-bot", None, "tool_loop", "flag")].added == 1
    assert report.changes[("support-bot", None, "tool_loop", "kill")].removed == 1
    assert [v.action for v in report.kept[0].removed] == ["kill"]


def test_a_budget_reports_the_tokens_spent_after_the_kill() -> None:
    agent = AgentRecorder("ticket-bot", "tickets")
    for _ in range(5):
        agent.chat(300, 100)  # 400 a call: over 1000 at the 3rd, 2000 in all
    agent.finish()
    report = run(BUDGET, Policy(), *on(0, records(agent)))
    change = report.changes[("ticket-bot", None, "token_budget", "kill")]
    assert change.added == 1
    assert report.kept[0].tokens == 2000
    assert report.kept[0].added[0].tokens_at == 1200
    assert change.tokens_after_added == 800  # what enforcing the budget would have saved
    assert "tokens after added" in format_report(report)
    # The other way round: the kill is removed, and the same tokens are now spent.
    back = run(Policy(), BUDGET, *on(0, records(agent)))
    assert back.changes[("ticket-bot", None, "token_budget", "kill")].tokens_after_removed == 800


def test_idle_traces_are_evicted_by_the_ttl_in_record_time() -> None:
    agent = looping("support-bot", 4)
    spread = records(agent, step=100.0)  # 100 s between calls
    other = looping("other", 1)
    # A trace of the same partition 1000 s on: the first is idle past a 60 s TTL by then.
    gap = [(0, *spread[0]), (0, *spread[1]), (0, *records(other, start=T0 + 1000)[0])]
    later = [(0, key, value, at + 1000) for key, value, at in spread[2:]]
    short = run(STRICT, LENIENT, *gap, *later, state_ttl=60.0)
    assert short.decisions == [0, 0]
    assert short.traces == 3  # the looping trace twice: evicted, then started afresh
    long = run(STRICT, LENIENT, *gap, *later, state_ttl=3600.0)
    assert long.decisions == [1, 1]


def test_a_partition_read_ahead_does_not_evict_another_partitions_traces() -> None:
    agent = looping("support-bot", 3)
    recs = records(agent)
    ahead = looping("other", 1)
    feeds = [
        (0, *recs[0]),
        (1, *records(ahead, start=T0 + 86_400)[0]),  # partition 1 a day ahead
        (0, *recs[1]),
        (0, *recs[2]),
    ]
    report = run(STRICT, LENIENT, *feeds, state_ttl=60.0)
    assert report.decisions == [1, 0]


def test_the_memory_cap_evicts_the_oldest_traces_and_says_so() -> None:
    agents = [looping(f"svc-{i}", 3) for i in range(3)]
    interleaved = [(0, *r) for step in zip(*(records(a) for a in agents), strict=True)
                   for r in step]  # fmt: skip
    report = run(STRICT, LENIENT, *interleaved, max_traces=2)
    assert report.evicted_early > 0
    assert report.decisions[0] < 3  # the evicted traces lost their windows
    assert "evicted before their TTL" in format_report(report)
    full = run(STRICT, LENIENT, *interleaved, max_traces=10)
    assert full.evicted_early == 0 and full.decisions == [3, 0]


def test_records_that_are_not_otlp_are_skipped_and_counted() -> None:
    agent = looping("support-bot", 3)
    feeds = [(0, b"k", b"not a protobuf \xff\xfe", T0), (0, None, b"", T0),
             *on(0, records(agent))]  # fmt: skip
    report = run(STRICT, LENIENT, *feeds)
    assert report.skipped == 2 and report.records == 2 + 4  # three calls and the root span
    assert report.skip_reasons[0].startswith("partition 0: not an OTLP")
    assert report.decisions == [1, 0]
    assert "skipped: 2 records that are not OTLP" in format_report(report)


def test_an_unkeyed_message_of_several_traces_is_split_as_the_worker_does() -> None:
    one, two = looping("a", 3), looping("b", 3)
    value = encode([*one.finished(), *two.finished()]).SerializeToString()
    report = run(STRICT, LENIENT, (0, None, value, T0))
    assert report.decisions == [2, 0] and report.skipped == 0


def test_no_change_says_so() -> None:
    report = run(Policy(), Policy(), *on(0, records(looping("a", 5))))
    assert report.changes == {} and report.decisions == [1, 1]
    assert "no change" in format_report(report)


def test_the_page_has_a_timeline_per_changed_trace() -> None:
    three = looping("support-bot", 3)
    four = looping("support-bot", 4)
    report = run(SHADOW, STRICT, *on(0, records(three)), *on(0, records(four)), timelines=True)
    page = Page()
    page.feed(render_backtest_html(report))
    assert set(page.sections) == {three.trace_id, four.trace_id}
    rows = page.sections[three.trace_id]
    assert len(rows) == 3  # every call of the trace, drawn from the new policy's guard
    text = render_backtest_html(report)
    assert "removed tool_loop → kill" in text and "added tool_loop → flag" in text


@pytest.mark.parametrize("bad", [0, -1])
def test_max_traces_must_be_positive(bad: int) -> None:
    with pytest.raises(ValueError):
        Backtest(Policy(), Policy(), max_traces=bad)
