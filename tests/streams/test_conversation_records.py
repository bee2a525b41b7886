"""The conversation scope's worker parts without a broker: the records the span agent sends,
how the conversation agent reads them (bad ones refused with a reason), the conversation
state's stored form, and the dropping of records sent twice."""

from __future__ import annotations

import json

import pytest

from spanguard.detection.conversation import (
    MAX_TRACES_REMEMBERED,
    ConversationCall,
    ConversationState,
    ConversationUsage,
)
from spanguard.detection.guard import Guard
from spanguard.schemas.policy import Policy
from spanguard.streams.conversations import (
    MAX_RECENT_SPANS,
    ConversationRecorder,
    WorkerConversations,
    conversation_sends,
    conversation_view,
    conversations_wanted,
    decode_records,
    encode_records,
)
from spanguard.streams.state import stored_last_seen
from tests.detection.test_conversation import turn
from tests.detection.test_rules import run
from tests.support.spans import AgentRecorder

ARGS_HASH = "a" * 64
KILL = {"defaults": {"conversation": {"enabled": True, "action": "kill"}}}


def call(conversation: str, trace: str, span: int, tool: str = "search_docs") -> ConversationCall:
    key = (tool, ARGS_HASH, "r" * 16)
    return ConversationCall(conversation, trace, span.to_bytes(8, "big"), 10**18, key, "svc", None)


def usage(conversation: str, trace: str, span: int, tokens: int) -> ConversationUsage:
    return ConversationUsage(
        conversation, trace, span.to_bytes(8, "big"), 10**18, tokens, 7, "svc", "bot"
    )


def test_records_round_trip_grouped_by_conversation_in_order():
    records = [call("a", "t1", 1), usage("b", "t2", 2, 30), call("a", "t1", 3, "fetch")]
    encoded = encode_records(records)
    assert set(encoded) == {"a", "b"}
    assert decode_records(b"a", encoded["a"]) == [records[0], records[2]]
    assert decode_records(b"b", encoded["b"]) == [records[1]]


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        (None, b'{"v":1,"r":[]}', "no conversation id"),
        (b"c", b"not json", "not a conversation record"),
        (b"\xff", b'{"v":1,"r":[]}', "not a conversation record"),
        (b"c", b'{"v":9,"r":[]}', "version 1"),
        (b"c", b'{"v":1,"r":{}}', "no record list"),
        (b"c", b'{"v":1,"r":[["x"]]}', "not a call or usage row"),
        (b"c", b'{"v":1,"r":[["u","t","zz",1,5,0,"s",null]]}', "span id"),
        (b"c", b'{"v":1,"r":[["u","t","0011",1,-5,0,"s",null]]}', "tokens"),
        (b"c", b'{"v":1,"r":[["c","t","0011",1,5,0,"s",null]]}', "'c' record of 8"),
        (b"c" * 600, b'{"v":1,"r":[]}', "conversation id"),
    ],
)
def test_a_bad_record_is_refused_with_a_reason(key, value, says):
    with pytest.raises(ValueError, match=says):
        decode_records(key, value)


def test_the_state_round_trips_with_last_seen_last():
    guard = WorkerConversations(Policy.from_mapping(KILL), conversation_view({}))
    for span, trace in enumerate(["t1", "t1", "t2", "t2"]):
        guard.observe(call("c", trace, span))
    stored = guard.states.table[b"c"]
    state = ConversationState.from_bytes(stored)
    assert isinstance(state, ConversationState)
    assert state.to_bytes() == stored
    assert list(state.traces) == ["t1", "t2"] and state.trace_count == 2
    assert list(state.killed) == ["tool_loop:t2"]  # the 4th call, completed by t2, killed it
    assert stored_last_seen(stored) == state.last_seen > 0


def test_a_record_sent_twice_is_counted_once():
    guard = WorkerConversations(Policy.from_mapping(KILL), conversation_view({}))
    records = [call("c", "t1", 1), call("c", "t1", 2), call("c", "t2", 3)]
    for record in records + records:  # a batch decided again after a crash re-sends
        assert guard.observe(record) is None
    assert guard.duplicates == 3
    # The 4th distinct call trips: the three re-sent ones did not count.
    decision = guard.observe(call("c", "t2", 4))
    assert decision is not None and decision.hits == 4 and decision.traces == 2


def test_a_conversation_shared_by_thousands_of_traces_stays_bounded_in_bytes():
    guard = WorkerConversations(Policy.from_mapping(KILL), conversation_view({}))
    for n in range(1000):  # a cycle of 7 tools across traces: a kill every few traces
        guard.observe(call("busy", f"{n:032x}", 2 * n, tool=f"tool-{n % 7}"))
        guard.observe(usage("busy", f"{n:032x}", 2 * n + 1, 100))
    stored = guard.states.table[b"busy"]
    state = ConversationState.from_bytes(stored)
    assert state.trace_count == 1000 and state.inference_tokens == 100_000
    # Every list it keeps is at its cap (or below), whatever the traffic: 256 trace ids, 256
    # "rule:trace" kill marks, 256 span ids, the policy's window. About 26 kB at the caps.
    assert len(state.traces) == MAX_TRACES_REMEMBERED
    assert len(state.killed) <= MAX_TRACES_REMEMBERED
    assert len(state.recent_span_ids) == MAX_RECENT_SPANS
    assert len(state.window) == len(state.window_traces) <= 20
    assert len(stored) < 32_000, len(stored)


def test_the_recorder_records_only_agents_whose_policy_turns_the_scope_on():
    policy = Policy.from_mapping(
        {
            "agents": [
                {"match": {"service.name": "chat"}, "conversation": {"enabled": True}},
            ]
        }
    )
    assert conversations_wanted(policy) and not conversations_wanted(Policy())
    recorder = ConversationRecorder(policy)
    guard = Guard(policy, conversations=recorder)
    on, off = turn("conv"), turn("conv")

    chat = AgentRecorder("chat")
    chat.tool(
        "search_docs",
        attributes={
            "gen_ai.operation.name": "execute_tool",
            "gen_ai.tool.name": "search_docs",
            "gen_ai.tool.call.arguments": json.dumps({"query": "refund policy"}),
            "gen_ai.conversation.id": "conv",
        },
    )
    assert run(guard, off.finished() + on.finished()) == []  # support-bot: the scope is off
    assert recorder.drain() == ([], [])
    assert run(guard, chat.finished()) == []  # recorded, not decided, on the trace side
    (record,), (source,) = recorder.drain()
    assert source is None  # no message named
    assert (record.conversation_id, record.trace_id) == ("conv", chat.trace_id)
    assert b"refund" not in encode_records([record])["conv"]


def test_a_batch_sends_one_record_per_conversation_pointing_at_its_first_message():
    class Out:
        conversations_out = "the conversation topic"

    records = [call("a", "t1", 1), call("b", "t2", 2), call("a", "t3", 3), usage("a", "t3", 4, 9)]
    sources = ["message 1", "message 2", "message 3", "message 3"]
    sends = conversation_sends(Out(), records, sources)  # type: ignore[arg-type]
    assert [(s.kwargs["key"], s.source) for s in sends] == [
        (b"a", "message 1"),
        (b"b", "message 2"),
    ]
    assert decode_records(b"a", sends[0].kwargs["value"]) == [records[0], records[2], records[3]]
