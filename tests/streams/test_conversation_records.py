"""The conversation scope's worker parts without a broker: the records the span agent sends,
how the conversation agent reads them (bad ones refused with a reason), the conversation
state's stored form, and the dropping of records sent twice."""

from __future__ import annotations

import importlib.util
import json
from types import SimpleNamespace
from typing import Any

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
    conversation_partition,
    conversation_sends,
    conversation_view,
    conversations_wanted,
    decode_records,
    encode_packs,
)
from spanguard.streams.expiry import stored_last_seen
from tests.detection.test_conversation import turn
from tests.detection.test_rules import run
from tests.support.spans import AgentRecorder

ARGS_HASH = "a" * 64
KILL = {"defaults": {"conversation": {"enabled": True, "action": "kill"}}}
# How a pack writes "é": orjson (the worker's extra) as UTF-8, json escaped.
E_ACUTE = "é".encode() if importlib.util.find_spec("orjson") else b"\\u00e9"


def call(conversation: str, trace: str, span: int, tool: str = "search_docs") -> ConversationCall:
    key = (tool, ARGS_HASH, "r" * 16)
    return ConversationCall(conversation, trace, span.to_bytes(8, "big"), 10**18, key, "svc", None)


def usage(conversation: str, trace: str, span: int, tokens: int) -> ConversationUsage:
    return ConversationUsage(
        conversation, trace, span.to_bytes(8, "big"), 10**18, tokens, 7, "svc", "bot"
    )


def test_records_round_trip_packed_by_partition_each_conversation_in_order():
    conversations = [f"conv-{n}" for n in range(40)]
    partition = {c: conversation_partition(c, 4) for c in conversations}
    assert set(partition.values()) == {0, 1, 2, 3}
    records = [call(c, f"t{n}", 2 * n) for n, c in enumerate(conversations)]
    records += [usage(c, f"t{n}", 2 * n + 1, 30) for n, c in enumerate(conversations)]
    packs = encode_packs(records, 4)
    # One record per partition, holding the conversations whose partition it is.
    assert sorted(pack.partition for pack in packs) == [0, 1, 2, 3]
    for pack in packs:
        assert {partition[c] for c in pack.conversations} == {pack.partition}
        assert pack.key is None  # several conversations: no one id to key it by
        decoded = decode_records(pack.key, pack.value)
        for conversation in pack.conversations:
            mine = [r for r in records if r.conversation_id == conversation]
            assert [r for r in decoded if r.conversation_id == conversation] == mine
    assert sum(len(decode_records(None, p.value)) for p in packs) == len(records)
    (alone,) = encode_packs(records[:1], 4)
    assert alone.key == b"conv-0"  # a lone conversation keeps its id as the key


def test_a_pack_is_exactly_the_version_2_bytes_earlier_workers_read():
    # Written out by hand: a worker of the earlier release reads these bytes, so an encoder
    # that changes a field, its order or the separators fails here before it ships.
    records = [
        call("a", "t1", 1),
        usage("b", "t2", 2, 30),
        ConversationCall("a", "t3", bytes.fromhex("00ff"), 5, ("x", None, None), "s\u00e9", None),
    ]
    (pack,) = encode_packs(records, 1)
    assert pack.value == (
        b'{"v":2,"c":{"a":[["c","t1","0000000000000001",1000000000000000000,"search_docs","'
        + ARGS_HASH.encode()
        + b'","rrrrrrrrrrrrrrrr","svc",null],["c","t3","00ff",5,"x",null,null,"s'
        + E_ACUTE
        + b'",null]],"b":[["u","t2","0000000000000002",1000000000000000000,30,7,"svc","bot"]]}}'
    )
    # orjson writes text as UTF-8 where json (and earlier workers) escaped it: json, which
    # earlier workers decode with, reads both the same.
    escaped = pack.value.replace("é".encode(), b"\\u00e9")
    assert json.loads(pack.value) == json.loads(escaped)
    assert decode_records(None, escaped) == decode_records(None, pack.value)
    assert (pack.key, pack.conversations) == (None, ["a", "b"])
    assert decode_records(pack.key, pack.value) == [records[0], records[2], records[1]]


def test_the_partition_of_a_conversation_is_the_same_whatever_came_before():
    # Partitions are cached per conversation id and partition count: counts asked in turn
    # never answer for one another.
    conversations = [f"conversation-{n}" for n in range(300)]
    for partitions in (8, 3, 8, 1, 1000):
        packs = encode_packs([call(c, "t", n) for n, c in enumerate(conversations)], partitions)
        for pack in packs:
            for conversation in pack.conversations:
                assert pack.partition == conversation_partition(conversation, partitions)


@pytest.mark.parametrize(
    # Apache Kafka's own vectors (UtilsTest.testMurmur2): the Java client's default
    # partitioner puts a key at toPositive(murmur2(key)) % partitions, as aiokafka does.
    ("key", "java_murmur2"),
    [("21", -973932308), ("foobar", -790332482), ("abc", 479470107)],
)
def test_a_conversation_goes_where_a_record_keyed_by_its_id_went(key, java_murmur2):
    for partitions in (1, 8, 1000):
        expected = (java_murmur2 & 0x7FFFFFFF) % partitions
        assert conversation_partition(key, partitions) == expected


def test_a_pack_over_the_size_limit_is_split_and_a_version_1_record_still_reads():
    records = [call(f"c{n}", "t", n) for n in range(30)]
    packs = encode_packs(records, 1, limit=1_000)
    assert len(packs) > 1 and all(len(p.value) <= 1_200 for p in packs)
    assert [r for p in packs for r in decode_records(p.key, p.value)] == records
    # What a worker of the earlier release sent: one conversation, its id in the key.
    row = ["c", "t1", "0000000000000001", 10**18, "search_docs", None, None, "svc", None]
    written_before = json.dumps({"v": 1, "r": [row]}).encode()
    (record,) = decode_records(b"old", written_before)
    assert (record.conversation_id, record.key) == ("old", ("search_docs", None, None))


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        (None, b'{"v":1,"r":[]}', "no conversation id"),
        (b"c", b"not json", "not a conversation record"),
        (b"\xff", b'{"v":1,"r":[]}', "not a conversation record"),
        (b"c", b'{"v":9,"r":[]}', "version 2 or 1"),
        (None, b'{"v":2,"c":[]}', "no conversation map"),
        (None, b'{"v":2,"c":{"":[]}}', "conversation id"),
        (None, b'{"v":2,"c":{"c":{}}}', "no record list"),
        (None, b'{"v":2,"c":{"' + b"c" * 600 + b'":[]}}', "conversation id"),
        (None, b'{"v":2,"c":{"c":[["u","t","zz",1,5,0,"s",null]]}}', "span id"),
        (b"c", b'{"v":1,"r":{}}', "no record list"),
        (b"c", b'{"v":1,"r":[["x"]]}', "not a call or usage row"),
        (b"c", b'{"v":1,"r":[["u","t","zz",1,5,0,"s",null]]}', "span id"),
        (b"c", b'{"v":1,"r":[["u","t","0011",1,-5,0,"s",null]]}', "tokens"),
        (b"c", b'{"v":1,"r":[["c","t","0011",1,5,0,"s",null]]}', "'c' record of 8"),
        (b"c" * 600, b'{"v":1,"r":[]}', "conversation id"),
        (b"c", b'{"v":1,"r":[["c","t","0011",true,"x",null,null,"s",null]]}', "end time"),
        (
            b"c",
            b'{"v":1,"r":[["c","t","0011",1,"' + b"x" * 600 + b'",null,null,"s",null]]}',
            "tool",
        ),
        (b"c", b'{"v":1,"r":[["c","t","0011",1,"x",5,null,"s",null]]}', "arguments hash"),
        (b"c", b'{"v":1,"r":[["c","t","0011",1,"x",null,"","s",null]]}', "result hash"),
        (b"c", b'{"v":1,"r":[["c",7,"0011",1,"x",null,null,"s",null]]}', "trace id"),
        (b"c", b'{"v":1,"r":[["u","t","0011",1,5,-1,"s",null]]}', "cost"),
        (b"c", b'{"v":1,"r":[["u","t","0011",1,5,0,"s",3]]}', "agent name"),
        (b"c", b'{"v":1,"r":[["u","t","0011",1,5,0,null,"a"]]}', "service"),
        (b"c", b'{"v":1,"r":[["u","t","0011",1,5.0,0,"s","a"]]}', "tokens"),
        (b"c", b'{"v":1,"r":[["u","t","0011",1,5,0,"s","a"],"x"]}', "not a call or usage"),
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
    assert list(state.killed) == ["tool_loop:t2"]  # the 3rd call, made by t2, killed it
    assert stored_last_seen(stored) == state.last_seen > 0


def test_a_record_sent_twice_is_counted_once():
    guard = WorkerConversations(Policy.from_mapping(KILL), conversation_view({}))
    records = [call("c", "t1", 1), call("c", "t2", 2)]
    for record in records + records:  # a batch decided again after a crash re-sends
        assert guard.observe(record) is None
    assert guard.duplicates == 2
    # The 3rd distinct call trips: the two re-sent ones did not count.
    decision = guard.observe(call("c", "t2", 3))
    assert decision is not None and decision.evidence.hits == 3 and decision.scope.traces == 2


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


@pytest.mark.parametrize(
    ("budgets", "kept"),
    [({}, False), ({"token_budget": 10**6}, True), ({"usd_budget": 5}, True)],
    ids=["no-budget", "token-budget", "usd-budget"],
)
def test_usage_is_recorded_only_against_a_conversation_budget(budgets, kept):
    policy = Policy.from_mapping({"defaults": {"conversation": {"enabled": True, **budgets}}})
    recorder = ConversationRecorder(policy)
    recorder.hand_call(call("c", "t1", 1))
    recorder.hand_usage(usage("c", "t1", 2, 300))
    records, _ = recorder.drain()
    assert [type(r).__name__ for r in records] == ["ConversationCall"] + (
        ["ConversationUsage"] if kept else []
    )


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
    assert b"refund" not in encode_packs([record], 8)[0].value


def test_a_batch_sends_one_record_per_partition_pointing_at_its_first_message():
    def out(partitions: int) -> Any:
        return SimpleNamespace(
            conversations_out="the conversation topic",
            # The conversation topic has the scopes' partitions, not the spans' topics' count.
            settings=SimpleNamespace(partitions=97, scope_partitions=partitions),
        )

    records = [call("a", "t1", 1), call("b", "t2", 2), call("a", "t3", 3), usage("a", "t3", 4, 9)]
    sources = [None, "message 2", "message 3", "message 3"]  # the first came from no message
    (pack,) = conversation_sends(out(1), records, sources)
    assert (pack.kwargs["key"], pack.kwargs["partition"], pack.source) == (None, 0, "message 2")
    assert pack.deferred and pack.decision is None  # acked by the flush, not per batch
    in_order = [records[0], records[2], records[3], records[1]]  # "a"'s, then "b"'s
    assert decode_records(None, pack.kwargs["value"]) == in_order
    apart = 2  # a partition count that puts "a" and "b" apart
    while conversation_partition("a", apart) == conversation_partition("b", apart):
        apart += 1
    sends = conversation_sends(out(apart), records, sources)
    assert [(s.kwargs["key"], s.source) for s in sends] == [
        (b"a", "message 3"),
        (b"b", "message 2"),
    ]
    assert [s.kwargs["partition"] for s in sends] == [
        conversation_partition(c, apart) for c in ("a", "b")
    ]
