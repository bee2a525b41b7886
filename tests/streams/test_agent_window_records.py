"""Agent budgets in the worker, without a broker: the usage records the span agent sends, how
the agent-windows agent reads them (bad ones refused with a reason), the window's stored form,
records sent twice dropped by where they came from, and bad identities and clocks that cost
only themselves, counted."""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass

import pytest

from spanguard.detection.agent_budget import AgentBudgetGuard, AgentUsage, AgentWindow
from spanguard.detection.guard import Guard
from spanguard.schemas.policy import Policy
from spanguard.schemas.scope_records import agent_key
from spanguard.streams.agent_windows import (
    AgentUsageRecorder,
    AgentWindowCount,
    WorkerAgentBudgets,
    agent_usage_sends,
    agent_window_view,
    agent_windows_wanted,
    decode_usage,
    encode_usage,
    longest_window,
)
from spanguard.streams.expiry import stored_last_seen
from tests.detection.test_agent_budget import T0, chat_request, policy, usage

TRIAGE = ("support", "triage")


@dataclass
class Message:
    """What the span agent knows of a source message: where it was read."""

    topic: str
    partition: int
    offset: int


def hand(recorder: AgentUsageRecorder, record: AgentUsage) -> None:
    """Hand a usage record to the recorder as the guard does, field by field."""
    recorder.hand_spend(
        record.service,
        record.agent_name,
        record.trace_id,
        record.span_id,
        record.end_time_unix_nano,
        record.tokens,
        record.cost,
    )


def rows_of(records, messages) -> list:
    """The rows the agent-windows agent reads from what the span agent would send."""
    encoded = encode_usage(records, messages)
    rows = []
    for key, value in encoded.items():
        rows.append(decode_usage(key.encode(), value))
    return rows


def worker_guard(budget: Policy, **kwargs) -> WorkerAgentBudgets:
    return WorkerAgentBudgets(budget, agent_window_view({}), clock=lambda: T0 + 10, **kwargs)


def test_records_round_trip_grouped_by_agent_with_their_sources():
    records = [usage(T0, 10), usage(T0 + 1, 20, agent="billing"), usage(T0 + 2, 30)]
    messages = [Message("spans", 3, 17), Message("spans", 1, 4), Message("repartition", 3, 9)]
    encoded = encode_usage(records, messages)
    assert set(encoded) == {agent_key(*TRIAGE), agent_key("support", "billing")}
    agent, rows = decode_usage(agent_key(*TRIAGE).encode(), encoded[agent_key(*TRIAGE)])
    assert agent == TRIAGE
    assert rows == [(records[0], "spans:3", 17), (records[2], "repartition:3", 9)]
    # No source (a direct caller): counted, never dropped as a repeat.
    _, [(record, source, offset)] = decode_usage(
        agent_key("support", "billing").encode(),
        encode_usage([records[1]], [None])[agent_key("support", "billing")],
    )
    assert (record, source, offset) == (records[1], None, -1)
    # A name with any character stays one unambiguous key.
    odd = usage(T0, 1, agent='a/"b"', service="s/x")
    (key,) = encode_usage([odd], [None])
    assert json.loads(key) == ["s/x", 'a/"b"']


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        (None, b'{"v":1,"s":[],"r":[]}', "no agent identity"),
        (b"support", b'{"v":1,"s":[],"r":[]}', "not an agent usage record"),
        (b'["support"]', b'{"v":1,"s":[],"r":[]}', "not [service, agent name]"),
        (b'["",null]', b'{"v":1,"s":[],"r":[]}', "service is not a string"),
        (json.dumps(["s" * 600, None]).encode(), b'{"v":1,"s":[],"r":[]}', "service"),
        (b'["s",null]', b'{"v":2,"s":[],"r":[]}', "not a version 1"),
        (b'["s",null]', b'{"v":1,"s":[],"r":[[0]]}', "a row is not"),
        (b'["s",null]', b'{"v":1,"s":[],"r":[[0,1,"t","00",1,1,1]]}', "source index 0 of 0"),
        (b'["s",null]', b'{"v":1,"s":["x:0"],"r":[[0,1,"t","zz",1,1,1]]}', "span id"),
        (b'["s",null]', b'{"v":1,"s":["x:0"],"r":[[0,1,"t","00",1,-5,1]]}', "tokens"),
        (b'["s",null]', b'{"v":1,"s":["x:0"],"r":[[0,1,"t","00",1,true,1]]}', "tokens"),
    ],
)
def test_a_bad_record_is_refused_with_a_reason(key, value, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        decode_usage(key, value)


def test_the_window_round_trips_with_last_seen_last():
    guard = worker_guard(policy())
    messages = [Message("spans", 0, n) for n in range(3)]
    records = [usage(T0 + 60 * n, 100) for n in range(3)]
    for agent, rows in rows_of(records, messages):
        guard.observe_rows(agent, rows)
    stored = guard.states.table[agent_key(*TRIAGE).encode()]
    window = AgentWindow.from_bytes(stored)
    assert window.to_bytes() == stored
    assert (window.tokens, len(window.buckets), window.sources) == (300, 3, {"spans:0": 2})
    assert stored_last_seen(stored) == window.last_seen == T0 + 10


def test_the_worker_decides_what_the_core_decides_and_a_record_sent_twice_counts_once():
    budget = policy("{window: 1h, tokens: 10000, action: kill}")
    records = [usage(T0 + n, 1000) for n in range(12)]
    messages = [Message("spans", n % 3, n) for n in range(12)]
    core = AgentBudgetGuard(budget, clock=lambda: T0 + 10)
    expected = [d for d in map(core.observe_usage, records) if d is not None]
    assert [d.spend.tokens for d in expected] == [11000]

    guard = worker_guard(budget)
    decided = []
    # Six messages, then all twelve again (a span batch decided again after a crash), then
    # the last six once more: each row counts once.
    for batch in (slice(0, 6), slice(0, 12), slice(6, 12)):
        for agent, rows in rows_of(records[batch], messages[batch]):
            decided += guard.observe_rows(agent, rows)
    assert [d.decision_id for d in decided] == [d.decision_id for d in expected]
    assert decided[0].scope_kind == "agent" and decided[0].scope.until is not None
    assert guard.tally[AgentWindowCount.DUPLICATES] == 12
    window = guard.windows.get(TRIAGE)
    assert window.tokens == 12_000 and window.sources == {
        "spans:0": 9,
        "spans:1": 10,
        "spans:2": 11,
    }


def test_exact_however_many_records_one_crash_sends_again():
    guard = worker_guard(policy("{window: 1d, tokens: 1000000000}"))
    records = [usage(T0 + n, 1) for n in range(5000)]
    messages = [Message("spans", 0, n) for n in range(5000)]
    for _ in range(2):
        for agent, rows in rows_of(records, messages):
            guard.observe_rows(agent, rows)
    assert guard.windows.get(TRIAGE).tokens == 5000
    assert guard.tally[AgentWindowCount.DUPLICATES] == 5000


def test_a_retracted_decision_trips_again_on_the_next_record():
    guard = worker_guard(policy("{window: 1h, tokens: 100, action: kill}"))
    [(agent, rows)] = rows_of([usage(T0, 101)], [Message("spans", 0, 1)])
    [decision] = guard.observe_rows(agent, rows)
    guard.retract(decision)  # its signal was not sent
    [(agent, rows)] = rows_of([usage(T0 + 1, 1)], [Message("spans", 0, 2)])
    [again] = guard.observe_rows(agent, rows)
    assert again.decision_id == decision.decision_id  # the same crossing, the same id


def test_a_clock_that_jumps_costs_its_agent_only_counted_and_told_once(caplog):
    guard = worker_guard(policy("{window: 1h, tokens: 10000, action: kill}"))
    records = [
        usage(T0 + 1200, 4000),
        usage(T0 + 300, 4000),  # back within the window: counted into the newest bucket
        usage(T0 + 365 * 86400, 100),  # a year ahead: the window starts afresh
        usage(T0 + 1300, 100),  # and back: afresh again
        usage(T0 + 1300, 5000, agent="other"),
    ]
    with caplog.at_level(logging.WARNING, "spanguard.core"):
        for n, record in enumerate(records):
            for agent, rows in rows_of([record], [Message("spans", 0, n)]):
                assert guard.observe_rows(agent, rows) == []
    assert guard.tally[AgentWindowCount.LATE] == 1
    assert guard.tally[AgentWindowCount.RESETS] == 2
    assert guard.windows.get(TRIAGE).tokens == 100
    assert guard.windows.get(("support", "other")).tokens == 5000
    assert len([r for r in caplog.records if "starts afresh" in r.message]) == 1


def test_a_flood_of_new_agents_past_the_cap_costs_itself_only(caplog):
    guard = worker_guard(policy("{window: 1h, tokens: 100, action: kill}"), max_agents=3)

    # The cap counts the windows this worker indexes: written in an event's context, as the
    # worker does; here the view's index is filled directly.
    for n in range(3):
        guard.states._index(
            type("E", (), {"message": Message("usage", 0, n)})(), agent_key("s", f"a{n}"), T0
        )
    with caplog.at_level(logging.WARNING, "spanguard.worker"):
        for n in range(5):
            [(agent, rows)] = rows_of([usage(T0, 101, agent=f"new{n}")], [None])
            assert guard.observe_rows(agent, rows) == []
    assert guard.tally[AgentWindowCount.OVER_AGENT_CAP] == 5
    assert len([r for r in caplog.records if "more than 3 agents" in r.message]) == 1


def test_the_recorder_records_agents_with_a_budget_and_counts_an_empty_service(caplog):
    budget = Policy.from_yaml(
        "agents:\n  - match: {service.name: support}\n"
        "    agent_budget: {window: 1d, usd: 5, action: kill}\n"
    )
    assert agent_windows_wanted(budget) and not agent_windows_wanted(Policy())
    assert longest_window(budget) == 86400 and longest_window(Policy()) == 0
    recorder = AgentUsageRecorder(budget)
    guard = Guard(budget, agent_budgets=recorder)
    assert guard.agent_budgets is recorder and guard.prices_usage
    _, other = chat_request("billing-svc", "billing", 1000)  # no budget: not recorded
    _, request = chat_request("support", "triage", 1000)
    assert guard.process(other) + guard.process(request) == []  # recorded, not decided
    (record,), (source,) = recorder.drain()
    assert source is None and (record.service, record.agent_name, record.tokens) == (
        "support",
        "triage",
        1000,
    )
    assert b"gpt-4o" not in encode_usage([record], [None])[agent_key("support", "triage")]
    # A service with no name, where every agent has a budget: its usage is no agent's.
    recorder = AgentUsageRecorder(policy())
    with caplog.at_level(logging.WARNING, "spanguard.worker"):
        for _ in range(3):
            hand(recorder, usage(T0, 10, service=""))
    assert recorder.drain() == ([], [])
    assert recorder.tally[AgentWindowCount.NO_IDENTITY] == 3
    assert len([r for r in caplog.records if "service.name is empty" in r.message]) == 1


def test_a_batch_sends_one_record_per_agent_pointing_at_its_first_message():
    class Out:
        agent_usage_out = "the agent usage topic"

    records = [usage(T0, 1), usage(T0, 2, agent="billing"), usage(T0, 3), usage(T0, 4)]
    sources = [Message("spans", 0, 1), Message("spans", 1, 2), Message("spans", 0, 3), None]
    sends = agent_usage_sends(Out(), records, sources)  # type: ignore[arg-type]
    assert [(s.kwargs["key"], s.source) for s in sends] == [
        (agent_key(*TRIAGE).encode(), sources[0]),
        (agent_key("support", "billing").encode(), sources[1]),
    ]
    # They carry no decision: acked by the flush, before their messages (not per batch).
    assert all(send.deferred and send.decision is None for send in sends)
    _, rows = decode_usage(sends[0].kwargs["key"], sends[0].kwargs["value"])
    assert [(r.tokens, source, offset) for r, source, offset in rows] == [
        (1, "spans:0", 1),
        (3, "spans:0", 3),
        (4, None, -1),
    ]


def test_a_window_stays_bounded_in_bytes_whatever_the_traffic():
    guard = worker_guard(policy("{window: 1d, tokens: 1000000000}"))
    records = [usage(T0 + 60 * n, 1) for n in range(3 * 1440)]  # a span a minute, three days
    messages = [Message(f"spans-{n % 700}", n % 50, n) for n in range(len(records))]
    for agent, rows in rows_of(records, messages):
        guard.observe_rows(agent, rows)
    stored = guard.states.table[agent_key(*TRIAGE).encode()]
    window = AgentWindow.from_bytes(stored)
    assert len(window.buckets) <= 240 and len(window.sources) <= 512
    assert len(stored) < 32_000, len(stored)


def test_a_message_sends_one_row_per_agent_and_bucket_and_the_window_counts_the_same():
    budget = policy("{window: 1h, tokens: 5000, action: kill}")
    # One message's usage: two agents, spans in two minutes of the triage agent's window
    # (its buckets are a minute wide), one late span back in the first minute.
    spans = [
        usage(T0 + 1, 400),
        usage(T0 + 2, 300, agent="billing"),
        usage(T0 + 20, 500),
        usage(T0 + 61, 700),
        usage(T0 + 30, 100),
        usage(T0 + 50, 200, agent="billing"),
    ]
    recorder = AgentUsageRecorder(budget)
    for record in spans:
        hand(recorder, record)
    message = Message("spans", 2, 41)
    recorder.sourced(message)
    records, sources = recorder.drain()
    assert sources == [message] * len(records)
    sums = [(r.agent_name, r.end_time_unix_nano // 10**9 - T0, r.tokens) for r in records]
    # A row per (agent, minute), in the order each first appeared; the last span of each
    # stands for it (its trace is the one a crossing names).
    assert sums == [("triage", 30, 1000), ("billing", 50, 500), ("triage", 61, 700)]
    assert (records[0].trace_id, records[0].span_id) == (spans[4].trace_id, spans[4].span_id)
    # The window holds what it would have held from a row per span; the late span, summed
    # before the window saw the next minute, stays in its own minute rather than the newest
    # (so it leaves the window no later than its own span would have).
    one_by_one = worker_guard(budget)
    for record in spans:
        one_by_one.observe_usage(record)
    summed = worker_guard(budget)
    for agent, rows in rows_of(records, sources):
        summed.observe_rows(agent, rows)
    minute = T0 // 60
    for agent, buckets in (
        (TRIAGE, [[minute, 1000, 0], [minute + 1, 700, 0]]),
        (("support", "billing"), [[minute, 500, 0]]),
    ):
        expected, got = one_by_one.windows.get(agent), summed.windows.get(agent)
        assert got.tokens == expected.tokens and list(got.buckets) == buckets
    assert one_by_one.windows.get(TRIAGE).late == 1 and summed.windows.get(TRIAGE).late == 0
    # The next message starts new rows.
    hand(recorder, usage(T0 + 63, 10))
    recorder.sourced(Message("spans", 2, 42))
    assert [r.tokens for r in recorder.drain()[0]] == [10]
