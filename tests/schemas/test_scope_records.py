"""The scope topics' records as written today (schemas/scope_records.py): records already on a
topic when a worker is upgraded must still decode, to the same records, and a record written
today must be the same bytes."""

from __future__ import annotations

from spanguard.detection.agent_budget import AgentUsage
from spanguard.detection.conversation import ConversationCall, ConversationUsage
from spanguard.schemas.scope_records import (
    agent_key,
    call_row,
    decode_agent_usage,
    decode_conversation_records,
    encode_agent_usage,
    pack_rows,
    usage_row,
)

SPAN = bytes.fromhex("00000000000000a1")
CALL = ConversationCall(
    "conv-1", "t" * 32, SPAN, 1_700_000_000_000_000_000, ("search", "a" * 8, "r" * 8), "bot", None
)
USAGE = ConversationUsage("conv-1", "t" * 32, SPAN, 1_700_000_000_000_000_000, 120, 7, "bot", "x")
# A pack of the conversation topic (version 2) and one conversation's record (version 1).
PACK = (
    b'{"v":2,"c":{"conv-1":[["c","' + b"t" * 32 + b'","00000000000000a1",1700000000000000000,'
    b'"search","aaaaaaaa","rrrrrrrr","bot",null],["u","' + b"t" * 32 + b'","00000000000000a1",'
    b'1700000000000000000,120,7,"bot","x"]]}}'
)
ONE_CONVERSATION = (
    b'{"v":1,"r":[["u","' + b"t" * 32 + b'","00000000000000a1",1700000000000000000,120,7,"bot",'
    b'"x"]]}'
)
AGENT_USAGE = (
    b'{"v":1,"s":["spans:3"],"r":[[0,41,"' + b"t" * 32 + b'","00000000000000a1",'
    b'1700000000000000000,120,7],[-1,-1,"' + b"t" * 32 + b'","00000000000000a1",'
    b"1700000000000000000,5,0]]}"
)


def test_conversation_records_of_both_versions_decode():
    records = decode_conversation_records(None, PACK, ConversationCall, ConversationUsage)
    assert records == [CALL, USAGE]
    (usage,) = decode_conversation_records(
        b"conv-1", ONE_CONVERSATION, ConversationCall, ConversationUsage
    )
    assert usage == USAGE


def test_a_pack_written_today_is_the_same_bytes():
    rows = [("conv-1", call_row(CALL)), ("conv-1", usage_row(USAGE))]
    (pack,) = pack_rows(rows, lambda conversation_id: 0, limit=900_000)
    assert (pack.partition, pack.key, pack.conversations) == (0, b"conv-1", ["conv-1"])
    assert pack.value == PACK


def test_an_agent_usage_record_decodes_and_is_written_the_same():
    key = agent_key("bot", "x").encode()
    assert key == b'["bot","x"]'
    agent, rows = decode_agent_usage(key, AGENT_USAGE, AgentUsage)
    assert agent == ("bot", "x")
    spent = AgentUsage("bot", "x", "t" * 32, SPAN, 1_700_000_000_000_000_000, 120, 7)
    unsourced = AgentUsage("bot", "x", "t" * 32, SPAN, 1_700_000_000_000_000_000, 5, 0)
    assert rows == [(spent, "spans:3", 41), (unsourced, None, -1)]
    written = encode_agent_usage([spent, unsourced], [("spans:3", 41), None])
    assert written == {'["bot","x"]': AGENT_USAGE}
