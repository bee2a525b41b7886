"""The tool scope in the worker, without a broker: the rows the span agent sends to the tool
call topic, how the tool scope agent reads them (bad ones refused with a reason), the window's
stored form, rows sent twice dropped by where they came from, and bad input (megabyte names, a
million distinct names) that stays bounded and counted."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace

import pytest

from spanguard.detection.fleet import (
    MAX_NAME_CHARS,
    TOOL_FAILING,
    FleetCall,
    FleetGuard,
    FleetWindow,
    incident_trace_id,
    window_from_bytes,
    window_to_bytes,
)
from spanguard.detection.guard import Guard
from spanguard.schemas.policy import FleetPolicy, Policy
from spanguard.schemas.scope_records import decode_tool_calls, encode_tool_calls, tool_key
from spanguard.streams.expiry import stored_last_seen
from spanguard.streams.tool_scope import (
    ToolCallRecorder,
    ToolScopeCount,
    WorkerFleet,
    tool_scope_wanted,
    tool_window_view,
)
from tests.support.fleet import BASE_NS, SECOND, synthetic_fleet

FLEET = FleetPolicy(enabled=True)
POLICY = Policy(fleet=FLEET)


@dataclass
class Message:
    """What the span agent knows of a source message: where it was read."""

    topic: str
    partition: int
    offset: int


def call(trace: int, at: float, failed: bool = False, tool: str = "search", **kw) -> FleetCall:
    return FleetCall(
        tool,
        kw.get("server", ""),
        f"{trace:032x}",
        f"svc/agent-{trace}",
        BASE_NS + int(at * SECOND),
        failed,
        kw.get("empty", False),
    )


def sent(recorder: ToolCallRecorder) -> list[tuple[bytes, bytes]]:
    """What the span agent would send: (key, value) per tool key."""
    records, sources = recorder.drain()
    where = [(m.topic, m.partition, m.offset) if m is not None else None for m in sources]
    encoded = encode_tool_calls(records, [(f"{w[0]}:{w[1]}", w[2]) if w else None for w in where])
    return [(key.encode(), value) for key, value in encoded.items()]


def worker_fleet(policy: Policy = POLICY, **kw) -> WorkerFleet:
    return WorkerFleet(policy, tool_window_view(policy.fleet)({}), clock=lambda: 1e9, **kw)


def test_the_tool_scope_is_off_unless_the_policy_turns_the_fleet_on():
    assert not tool_scope_wanted(Policy()) and tool_scope_wanted(POLICY)
    recorder = ToolCallRecorder()
    guard = Guard(Policy(), tools=recorder)
    assert guard.tools is None  # off: not one call more per span
    assert Guard(POLICY, tools=recorder).tools is recorder


def test_a_messages_calls_are_summed_per_trace_and_tool_and_read_back():
    recorder = ToolCallRecorder()
    for failed in (False, True, True):
        recorder.hand_tool_call(call(1, 1.0, failed))
    recorder.hand_tool_call(call(2, 2.0, empty=True, server="mcp.example:443"))
    recorder.sourced(Message("spans", 3, 41))
    recorder.hand_tool_call(call(1, 3.0))
    recorder.sourced(Message("spans", 3, 42))
    records = sent(recorder)
    assert len(records) == 2  # one Kafka record per tool key
    by_key = {decode_tool_calls(k, v)[0]: decode_tool_calls(k, v)[1] for k, v in records}
    search = by_key[("search", "")]
    assert [row[:3] for row in search] == [("c", "spans:3", 41), ("c", "spans:3", 42)]
    assert search[0][6:] == (3, 2, 0, 1)  # calls, failures, empties, the last one failed
    assert by_key[("search", "mcp.example:443")][0][6:] == (1, 0, 1, 2)


@pytest.mark.parametrize(
    ("key", "value", "reason"),
    [
        (None, b"{}", "no tool key"),
        (b'["t"]', b'{"v":1,"s":[],"r":[]}', "the key is not [tool, server]"),
        (b'["t",""]', b'{"v":2,"s":[],"r":[]}', "not a version 1 tool call record"),
        (b'["t",""]', b"\xff", "not a tool call record"),
        (b'["t",""]', b'{"v":1,"s":[],"r":[["x",-1,-1,"t"]]}', "not a call or decision row"),
        (b'["t",""]', b'{"v":1,"s":[],"r":[["d",3,-1,"t",1,null]]}', "source index 3"),
        (
            b'["t",""]',
            b'{"v":1,"s":[],"r":[["c",-1,-1,"t","a",1,1,2,0,1]]}',
            "failures and empties past the calls",
        ),
        (b'["' + b"x" * 600 + b'",""]', b'{"v":1,"s":[],"r":[]}', "tool name is not a string"),
    ],
)
def test_a_bad_record_is_refused_with_its_reason(key, value, reason):
    with pytest.raises(ValueError, match=re.escape(reason)):
        decode_tool_calls(key, value)


def test_the_window_round_trips_through_its_stored_form_with_last_seen_last():
    window = FleetWindow(FLEET)
    for trace in range(12):
        window.observe(call(trace, trace, failed=trace % 2 == 0))
    window.observe_decision("search", "", "00112233445566ff", f"{1:032x}", BASE_NS)
    window.sources = {"spans:0": 7}
    window.last_seen = 1234.5
    data = window_to_bytes(window)
    assert stored_last_seen(data) == 1234.5
    again = window_from_bytes(data, FLEET)
    assert window_to_bytes(again) == data
    assert again.key_figures("search") == window.key_figures("search")
    # Both count on alike from there.
    assert [window.observe(call(99, 13, True)), again.observe(call(99, 13, True))] == [None] * 2
    assert window_to_bytes(again) == window_to_bytes(window)


def fleet_rows(calls: list[FleetCall], per_message: int = 50) -> list[tuple[bytes, bytes]]:
    """The calls as the span agent sends them, `per_message` calls per source message."""
    recorder = ToolCallRecorder()
    records: list[tuple[bytes, bytes]] = []
    for index, made in enumerate(calls):
        recorder.hand_tool_call(made)
        if index % per_message == per_message - 1:
            recorder.sourced(Message("spans", 0, index // per_message))
            records += sent(recorder)
    recorder.sourced(Message("spans", 0, len(calls)))
    return records + sent(recorder)


def test_the_fleet_of_200_through_the_records_is_one_incident_and_its_recovery():
    fleet = worker_fleet()
    decisions = []
    for key, value in fleet_rows(synthetic_fleet()):
        decisions += fleet.observe_rows(*decode_tool_calls(key, value))
    assert [(d.rule, d.action, d.scope.tool) for d in decisions] == [
        (TOOL_FAILING, "flag", "search_docs"),
        (TOOL_FAILING, "recovered", "search_docs"),
    ]
    assert decisions[0].trace_id == decisions[1].trace_id


def test_records_sent_again_after_a_crash_are_dropped_and_decide_nothing_twice():
    records = fleet_rows(synthetic_fleet())
    fleet = worker_fleet()
    first = [
        d for key, value in records for d in fleet.observe_rows(*decode_tool_calls(key, value))
    ]
    again = [
        d for key, value in records for d in fleet.observe_rows(*decode_tool_calls(key, value))
    ]
    assert len(first) == 2 and again == []
    assert fleet.tally.count(ToolScopeCount.DUPLICATES) > 0
    # A worker that took over before the window was written decides the same records again.
    restarted = worker_fleet()
    retaken = [
        d for key, value in records for d in restarted.observe_rows(*decode_tool_calls(key, value))
    ]
    assert [d.decision_id for d in retaken] == [d.decision_id for d in first]


def test_a_megabyte_tool_name_is_one_bounded_key():
    recorder = ToolCallRecorder()
    guard_fleet = FleetGuard(POLICY)
    for trace in range(3):
        made = call(trace, trace, tool="t" * 2**20)
        made.tool = made.tool[:MAX_NAME_CHARS]  # as fleet.tool_call bounds it
        recorder.hand_tool_call(made)
        guard_fleet.hand_tool_call(made)
    recorder.sourced(Message("spans", 0, 1))
    [(key, value)] = sent(recorder)
    assert len(key) < 2 * MAX_NAME_CHARS and len(value) < 2000
    assert len(guard_fleet.window.keys) == 1


def test_a_million_distinct_tool_names_are_bounded_and_counted():
    policy = Policy(fleet=replace(FLEET, max_tools=50))
    fleet = worker_fleet(policy)
    for name in range(1000):  # the worker's cap is the same at a thousand as at a million
        key = tool_key(f"tool-{name}", "")
        row = ["c", f"{name:032x}", "a", BASE_NS, 1, 1, 0, 1]
        value = encode_tool_calls([(key, row)], [("spans:0", name)])[key]
        fleet.observe_rows(*decode_tool_calls(key.encode(), value))
        # The cap counts the windows this worker indexes: written in an event's context, as
        # the worker does; here the view's index is filled directly.
        if key in fleet.states:
            event = type("E", (), {"message": Message("tool-calls", 0, name)})()
            fleet.states._index(event, key, 1e9)
    assert fleet.states.indexed() == 50
    assert fleet.tally.count(ToolScopeCount.OVER_TOOL_CAP) == 950
    window = FleetWindow(replace(FLEET, max_tools=50))
    for name in range(10**6):
        window.observe(call(name, 1, tool=f"tool-{name}"))
    assert len(window.keys) == 50 and window.overflow_calls == 10**6 - 50


def test_an_incident_record_is_the_same_after_a_crash_and_names_the_fleet():
    fleet = worker_fleet()
    calls = [call(trace, 1 + trace / 10, failed=True) for trace in range(10)]
    decisions = []
    for key, value in fleet_rows(calls, per_message=3):
        decisions += fleet.observe_rows(*decode_tool_calls(key, value))
    [decision] = decisions
    record = decision.to_dict()
    assert (record["scope"], record["hits"], record["window"]) == ("tool", 8, 300)
    assert record["agents"][0] == "svc/agent-7"
    window = fleet.states[tool_key("search", "")]
    assert incident_trace_id(window.keys[("search", "")].incident) == decision.trace_id
    fleet.retract(decision)  # its record not written: it can open again
    window = fleet.states[tool_key("search", "")]
    assert window.keys[("search", "")].incident is None
    assert json.loads(window_to_bytes(window))["k"][0][7] is None
