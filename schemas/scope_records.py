"""The scope topics' wire records: what the span agent sends to the conversation topic (keyed by
conversation id) and to the agent usage topic (keyed by agent identity), and how the scope agents
read it back (docs/conversations.md, docs/agent-scope.md, "In the worker").

Both hold ids, a call's key (tool name, hashes of its arguments and result), span ids and end
times, token and cost deltas (pico-dollars); never arguments. Versioned:

- conversation topic, version 2: one record per partition and span batch, holding the
  conversations whose partition it is, `{"v": 2, "c": {conversation id: [row, ...], ...}}`;
  version 1, one conversation's `{"v": 1, "r": [row, ...]}` with its id in the key, is still
  read (a worker of an earlier release may have sent it). A row is a call,
  `["c", trace, span hex, end, tool, args hash, result hash, service, agent]`, or a usage
  change, `["u", trace, span hex, end, tokens, cost, service, agent]`.
- agent usage topic, version 1: one record per agent and span batch, its identity in the key
  (`agent_key`), `{"v": 1, "s": [source, ...], "r": [[source index, offset, trace, span hex,
  end, tokens, cost], ...]}`; a source is the "topic:partition" of the span messages the rows
  came from (index -1: none).
- tool call topic, version 1: one record per tool key and span batch, the key in the Kafka key
  (`tool_key`: [tool, server]), `{"v": 1, "s": [source, ...], "r": [row, ...]}`; a row is one
  trace's calls of the tool in one span message, summed, `["c", source index, offset, trace,
  agent, end, calls, failures, empties, last]` (last: how its last call ended, 0 answered, 1
  failed, 2 empty), or a trace-level decision that named the tool, `["d", source index, offset,
  trace, end, args hash or null]`.

The records are the kernel's (spanguard/detection/conversation.py, agent_budget.py), compiled
with the core; a decoder is handed their constructors, an encoder reads the fields the protocols
below name. The checks are written once for both topics: a bad record raises ValueError saying
what is wrong, and the worker dead-letters it with that reason.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from spanguard.schemas import compact_json

__all__ = [
    "AGENT_USAGE_VERSION",
    "CONVERSATION_PACKED_VERSION",
    "CONVERSATION_VERSION",
    "MAX_FIELD_CHARS",
    "TOOL_CALLS_VERSION",
    "CallFields",
    "Pack",
    "ToolRow",
    "UsageFields",
    "agent_key",
    "call_row",
    "decode_agent_usage",
    "decode_conversation_records",
    "decode_tool_calls",
    "encode_agent_usage",
    "encode_tool_calls",
    "pack_rows",
    "tool_key",
    "usage_row",
]

CONVERSATION_VERSION = 1
CONVERSATION_PACKED_VERSION = 2
AGENT_USAGE_VERSION = 1
TOOL_CALLS_VERSION = 1
_PACK_HEAD = b'{"v":2,"c":{'
# Longest text field a record may carry (trace ids are 32 hex, names are bounded upstream).
MAX_FIELD_CHARS = 512
# Names longer than this are keyed without the cache: 4,096 keys of at most this size.
MAX_CACHED_KEY_CHARS = 256

Record = TypeVar("Record")
CallKey = tuple[str, str | None, str | None]


class CallFields(Protocol):
    """What a call row is written from (the kernel's ConversationCall)."""

    trace_id: str
    span_id: bytes
    end_time_unix_nano: int
    key: CallKey
    service: str
    agent_name: str | None


class UsageFields(Protocol):
    """What a usage row is written from (ConversationUsage, AgentUsage)."""

    trace_id: str
    span_id: bytes
    end_time_unix_nano: int
    tokens: int
    cost: int
    service: str
    agent_name: str | None


# (conversation id, trace id, span id, end, key, service, agent name)
MakeCall = Callable[[str, str, bytes, int, CallKey, str, str | None], Record]
# (conversation id, trace id, span id, end, tokens, cost, service, agent name)
MakeConversationUsage = Callable[[str, str, bytes, int, int, int, str, str | None], Record]
# (service, agent name, trace id, span id, end, tokens, cost)
MakeAgentUsage = Callable[[str, str | None, str, bytes, int, int, int], Record]


# -- the checks, for both topics ---------------------------------------------------------------


def text(value: Any, what: str, optional: bool = False, empty: bool = False) -> Any:
    if value is None and optional:
        return None
    if not isinstance(value, str) or (not value and not empty) or len(value) > MAX_FIELD_CHARS:
        raise ValueError(f"{what} is not a string of 1-{MAX_FIELD_CHARS} characters")
    return value


def count(value: Any, what: str, least: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"{what} is not an integer of at least {least}")
    return value


def span_bytes(value: Any) -> bytes:
    try:
        return bytes.fromhex(text(value, "span id"))
    except ValueError:  # a span id that is no string says so too
        raise ValueError("span id is not hex") from None


def _fine_text(value: Any) -> bool:
    return type(value) is str and 0 < len(value) <= MAX_FIELD_CHARS


def _fine_shared(trace_id: Any, span_hex: Any, end: Any, service: Any, agent: Any) -> bool:
    """The fields every conversation row has, each of its type (the fast path's check)."""
    return (
        _fine_text(trace_id)
        and _fine_text(span_hex)
        and type(end) is int
        and end >= 0
        and _fine_text(service)
        and (agent is None or _fine_text(agent))
    )


# -- the conversation topic --------------------------------------------------------------------


def call_row(record: CallFields) -> list[Any]:
    tool, args_hash, result_hash = record.key
    return [
        "c",
        record.trace_id,
        record.span_id.hex(),
        record.end_time_unix_nano,
        tool,
        args_hash,
        result_hash,
        record.service,
        record.agent_name,
    ]


def usage_row(record: UsageFields) -> list[Any]:
    return [
        "u",
        record.trace_id,
        record.span_id.hex(),
        record.end_time_unix_nano,
        record.tokens,
        record.cost,
        record.service,
        record.agent_name,
    ]


@dataclass
class Pack:
    """One record of the conversation topic: where it goes, its key (a lone conversation's
    id, else none), its value, and the conversations it holds."""

    partition: int
    key: bytes | None
    value: bytes
    conversations: list[str]


def pack_rows(
    rows: Iterable[tuple[str, list[Any]]], partition_of: Callable[[str], int], limit: int
) -> list[Pack]:
    """(conversation id, row) pairs as packs, one per partition (`partition_of`) of the
    conversation topic, more when one would pass `limit` bytes: each holds the rows of the
    conversations whose partition it is, each conversation's in order."""
    # partition -> conversation id -> rows; dicts keep each conversation's first appearance.
    by_partition: dict[int, dict[str, list[list[Any]]]] = {}
    for conversation_id, row in rows:
        partition = partition_of(conversation_id)
        conversations = by_partition.get(partition)
        if conversations is None:
            conversations = by_partition[partition] = {}
        held = conversations.get(conversation_id)
        if held is None:
            held = conversations[conversation_id] = []
        held.append(row)
    packs: list[Pack] = []
    for partition, conversations in by_partition.items():
        # One encoding of the whole pack; split by conversation only when it is too large.
        value = compact_json.dumps({"v": CONVERSATION_PACKED_VERSION, "c": conversations})
        if len(value) <= limit:
            packs.append(_pack(partition, list(conversations), value))
            continue
        chunk: list[tuple[str, bytes]] = []
        size = 0
        for conversation_id, held in conversations.items():
            entry = compact_json.dumps({conversation_id: held})[1:-1]
            if chunk and size + len(entry) > limit:
                packs.append(_chunk_pack(partition, chunk))
                chunk, size = [], 0
            chunk.append((conversation_id, entry))
            size += len(entry) + 1
        packs.append(_chunk_pack(partition, chunk))
    return packs


def _chunk_pack(partition: int, chunk: list[tuple[str, bytes]]) -> Pack:
    value = _PACK_HEAD + b",".join(entry for _, entry in chunk) + b"}}"
    return _pack(partition, [conversation_id for conversation_id, _ in chunk], value)


def _pack(partition: int, conversation_ids: list[str], value: bytes) -> Pack:
    # A lone conversation keeps its id as the key, as version 1 records did.
    key = conversation_ids[0].encode() if len(conversation_ids) == 1 else None
    return Pack(partition, key, value, conversation_ids)


def decode_conversation_records(
    key: bytes | None,
    value: bytes | None,
    make_call: MakeCall[Record],
    make_usage: MakeConversationUsage[Record],
) -> list[Record]:
    """The records of one message of the conversation topic, a pack (version 2) or one
    conversation's (version 1, its id in the key), made by `make_call` and `make_usage`."""
    try:
        body = compact_json.loads(value or b"")
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"not a conversation record: {exc}") from None
    version = body.get("v") if isinstance(body, dict) else None
    if version == CONVERSATION_PACKED_VERSION:
        conversations = body.get("c")
        if not isinstance(conversations, dict):
            raise ValueError("no conversation map")
        records: list[Record] = []
        for conversation_id, rows in conversations.items():
            conversation_id = text(conversation_id, "conversation id")
            records += _decode_rows(conversation_id, rows, make_call, make_usage)
        return records
    if version != CONVERSATION_VERSION:
        raise ValueError(
            f"not a version {CONVERSATION_PACKED_VERSION} or {CONVERSATION_VERSION}"
            " conversation record"
        )
    if not key:
        raise ValueError("no conversation id in the key")
    try:
        conversation_id = key.decode()
    except UnicodeDecodeError as exc:
        raise ValueError(f"not a conversation record: {exc}") from None
    conversation_id = text(conversation_id, "conversation id")
    return _decode_rows(conversation_id, body.get("r"), make_call, make_usage)


def _decode_rows(
    conversation_id: str,
    rows: Any,
    make_call: MakeCall[Record],
    make_usage: MakeConversationUsage[Record],
) -> list[Record]:
    if not isinstance(rows, list):
        raise ValueError("no record list")
    records: list[Record] = []
    append = records.append
    for row in rows:
        # The common row, every field of the expected type, is checked inline (a pack of
        # hundreds of rows is decoded per message); anything else takes the checks that say
        # what is wrong.
        if type(row) is not list:
            raise ValueError("a record is not a call or usage row")
        size = len(row)
        kind = row[0] if size else None
        if kind == "c" and size == 9:
            _, trace_id, span_hex, end, tool, args_hash, result_hash, service, agent = row
            if not (
                _fine_shared(trace_id, span_hex, end, service, agent)
                and _fine_text(tool)
                and (args_hash is None or _fine_text(args_hash))
                and (result_hash is None or _fine_text(result_hash))
            ):
                _check_row(row)
            call_key = (tool, args_hash, result_hash)
            span_id = span_bytes(span_hex)
            append(make_call(conversation_id, trace_id, span_id, end, call_key, service, agent))
        elif kind == "u" and size == 8:
            _, trace_id, span_hex, end, tokens, cost, service, agent = row
            if not (
                _fine_shared(trace_id, span_hex, end, service, agent)
                and type(tokens) is int
                and tokens >= 0
                and type(cost) is int
                and cost >= 0
            ):
                _check_row(row)
            span_id = span_bytes(span_hex)
            usage = make_usage(
                conversation_id, trace_id, span_id, end, tokens, cost, service, agent
            )
            append(usage)
        else:
            _check_row(row)
    return records


def _check_row(row: list[Any]) -> None:
    """Raise ValueError saying what is wrong with a row the fast path did not take."""
    if len(row) not in (8, 9) or row[0] not in ("c", "u"):
        raise ValueError("a record is not a call or usage row")
    text(row[1], "trace id")
    span_bytes(row[2])
    count(row[3], "end time")
    text(row[-2], "service")
    text(row[-1], "agent name", optional=True)
    if row[0] == "c" and len(row) == 9:
        text(row[4], "tool name")
        text(row[5], "arguments hash", optional=True)
        text(row[6], "result hash", optional=True)
    elif row[0] == "u" and len(row) == 8:
        count(row[4], "tokens")
        count(row[5], "cost")
    else:
        raise ValueError(f"a {row[0]!r} record of {len(row)} fields")
    raise ValueError("a record field is not of its type")


# -- the agent usage topic ---------------------------------------------------------------------


def agent_key(service: str, agent_name: str | None) -> str:
    """An agent's identity as one unambiguous text (a name may hold any character): the key
    the worker keys its usage records and window table by. Cached for names of ordinary
    length: a fleet has few agents, and each inference's usage asks for its key three times
    (uncached, a visible share of a scope-on worker's samples: docs/performance.md, "Figures
    behind the code")."""
    if len(service) + len(agent_name or "") <= MAX_CACHED_KEY_CHARS:
        return _cached_agent_key(service, agent_name)
    return _agent_key(service, agent_name)


def _agent_key(service: str, agent_name: str | None) -> str:
    return json.dumps([service, agent_name], separators=(",", ":"), ensure_ascii=False)


_cached_agent_key = functools.lru_cache(maxsize=4096)(_agent_key)


def _source_ref(names: list[str], source: tuple[str, int] | None) -> tuple[int, int]:
    """Where a row came from, as a record holds it: the index of its "topic:partition" in
    `names` (added when new) and its offset; (-1, -1) for no source."""
    if source is None:
        return -1, -1
    if source[0] not in names:
        names.append(source[0])
    return names.index(source[0]), source[1]


def encode_agent_usage(
    records: Iterable[UsageFields], sources: Iterable[tuple[str, int] | None]
) -> dict[str, bytes]:
    """{agent key: one record value holding the agent's usage rows, in order}; `sources`,
    aligned with `records`, are where each came from ("topic:partition", offset; None: no
    source)."""
    grouped: dict[str, tuple[list[str], list[list[Any]]]] = {}
    for record, source in zip(records, sources, strict=True):
        key = agent_key(record.service, record.agent_name)
        names, rows = grouped.setdefault(key, ([], []))
        where, offset = _source_ref(names, source)
        span_id, end = record.span_id.hex(), record.end_time_unix_nano
        rows.append([where, offset, record.trace_id, span_id, end, record.tokens, record.cost])
    return {
        key: compact_json.dumps({"v": AGENT_USAGE_VERSION, "s": names, "r": rows})
        for key, (names, rows) in grouped.items()
    }


def decode_agent_usage(
    key: bytes | None, value: bytes | None, make_usage: MakeAgentUsage[Record]
) -> tuple[tuple[str, str | None], list[tuple[Record, str | None, int]]]:
    """The agent and the rows of one message of the agent usage topic: each a record made by
    `make_usage`, its source partition and its offset."""
    if not key:
        raise ValueError("no agent identity in the key")
    identity, body = _pair_and_body(key, value, "an agent usage", "service, agent name")
    service = text(identity[0], "service")
    agent_name = text(identity[1], "agent name", optional=True, empty=True)
    names, rows = _sources_and_rows(body, AGENT_USAGE_VERSION, "agent usage")
    records: list[tuple[Record, str | None, int]] = []
    for row in rows:
        if not isinstance(row, list) or len(row) != 7:
            raise ValueError("a row is not [source, offset, trace, span, end, tokens, cost]")
        where = count(row[0], "source index", least=-1)
        if where >= len(names):
            raise ValueError(f"source index {where} of {len(names)} sources")
        offset = count(row[1], "offset", least=-1)
        trace_id = text(row[2], "trace id")
        span_id = span_bytes(row[3])
        end = count(row[4], "end time")
        tokens, cost = count(row[5], "tokens"), count(row[6], "cost")
        usage = make_usage(service, agent_name, trace_id, span_id, end, tokens, cost)
        records.append((usage, names[where] if where >= 0 else None, offset))
    return (service, agent_name), records


def _pair_and_body(key: bytes, value: bytes | None, what: str, pair: str) -> tuple[list[Any], Any]:
    """The key (a JSON pair, `pair` naming its parts) and the body of one message of a topic
    keyed by a pair (agent usage, tool calls); the parts and the body are the caller's to
    check."""
    try:
        identity = json.loads(key)
        body = compact_json.loads(value or b"")
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"not {what} record: {exc}") from None
    if not isinstance(identity, list) or len(identity) != 2:
        raise ValueError(f"the key is not [{pair}]")
    return identity, body


def _sources_and_rows(body: Any, version: int, what: str) -> tuple[list[str], list[Any]]:
    """The source names and the rows of a message body written with sources ("s": names,
    "r": rows naming a source by its index)."""
    if not isinstance(body, dict) or body.get("v") != version:
        raise ValueError(f"not a version {version} {what} record")
    names, rows = body.get("s"), body.get("r")
    if not isinstance(names, list) or not isinstance(rows, list):
        raise ValueError("no source or row list")
    return [text(name, "source") for name in names], rows


# -- the tool call topic ------------------------------------------------------------------------

# A row of the tool call topic as read: ("c", source, offset, trace, agent, end, calls,
# failures, empties, last) or ("d", source, offset, trace, end, args hash); source None: none.
ToolRow = tuple[Any, ...]
CALL_LAST = (0, 1, 2)  # answered, failed, empty


def tool_key(tool: str, server: str) -> str:
    """A tool key as one unambiguous text (names may hold any character): the tool call
    topic's key and the tool window table's. Cached for names of ordinary length: every
    counted tool call asks for it, and a fleet has few tools."""
    if len(tool) + len(server) <= MAX_CACHED_KEY_CHARS:
        return _cached_tool_key(tool, server)
    return _tool_key(tool, server)


def _tool_key(tool: str, server: str) -> str:
    return json.dumps([tool, server], separators=(",", ":"), ensure_ascii=False)


_cached_tool_key = functools.lru_cache(maxsize=4096)(_tool_key)


def encode_tool_calls(
    rows: Iterable[tuple[str, list[Any]]], sources: Iterable[tuple[str, int] | None]
) -> dict[str, bytes]:
    """{tool key: one record value holding the key's rows, in order}. `rows` are (tool key,
    row without its source: ["c", trace, agent, end, calls, failures, empties, last] or ["d",
    trace, end, args hash]); `sources`, aligned with them, are where each came from
    ("topic:partition", offset; None: no source)."""
    grouped: dict[str, tuple[list[str], list[list[Any]]]] = {}
    for (key, row), source in zip(rows, sources, strict=True):
        names, held = grouped.setdefault(key, ([], []))
        where, offset = _source_ref(names, source)
        held.append([row[0], where, offset, *row[1:]])
    return {
        key: compact_json.dumps({"v": TOOL_CALLS_VERSION, "s": names, "r": held})
        for key, (names, held) in grouped.items()
    }


def decode_tool_calls(
    key: bytes | None, value: bytes | None
) -> tuple[tuple[str, str], list[ToolRow]]:
    """The tool key and the rows of one message of the tool call topic; ValueError says what
    is wrong."""
    if not key:
        raise ValueError("no tool key")
    identity, body = _pair_and_body(key, value, "a tool call", "tool, server")
    tool = text(identity[0], "tool name")
    server = text(identity[1], "server", empty=True)
    names, rows = _sources_and_rows(body, TOOL_CALLS_VERSION, "tool call")
    return (tool, server), [_tool_row(row, names) for row in rows]


def _tool_row(row: Any, names: list[str]) -> ToolRow:
    """A row as the tool scope counts it; ValueError says what is wrong."""
    if type(row) is list and len(row) == 10 and row[0] == "c":
        fast = _call_row(row, names)
        if fast is not None:
            return fast
    return _checked_tool_row(row, names)


def _call_row(row: list[Any], names: list[str]) -> ToolRow | None:
    """A call row whose every field is plainly fine (what the worker writes), checked in one
    pass (every row of the topic is read); None sends it to the checks that say what is wrong."""
    _, where, offset, trace_id, agent, end, calls, failures, empties, last = row
    if not (
        type(where) is int
        and -1 <= where < len(names)
        and type(offset) is int
        and offset >= -1
        and _fine_text(trace_id)
        and type(agent) is str
        and len(agent) <= MAX_FIELD_CHARS
        and type(end) is int
        and end >= 0
        and type(calls) is int
        and type(failures) is int
        and type(empties) is int
        and failures >= 0
        and empties >= 0
        and calls >= 1
        and failures + empties <= calls
        and type(last) is int
        and last in CALL_LAST
    ):
        return None
    source = names[where] if where >= 0 else None
    return ("c", source, offset, trace_id, agent, end, calls, failures, empties, last)


def _checked_tool_row(row: Any, names: list[str]) -> ToolRow:
    if not isinstance(row, list) or len(row) not in (6, 10) or row[0] not in ("c", "d"):
        raise ValueError("a row is not a call or decision row")
    where = count(row[1], "source index", least=-1)
    if where >= len(names):
        raise ValueError(f"source index {where} of {len(names)} sources")
    source = names[where] if where >= 0 else None
    offset = count(row[2], "offset", least=-1)
    trace_id = text(row[3], "trace id")
    if row[0] == "d" and len(row) == 6:
        end = count(row[4], "end time")
        return ("d", source, offset, trace_id, end, text(row[5], "arguments hash", optional=True))
    if row[0] != "c" or len(row) != 10:
        raise ValueError(f"a {row[0]!r} row of {len(row)} fields")
    agent = text(row[4], "agent", empty=True)
    end = count(row[5], "end time")
    calls = count(row[6], "calls", least=1)
    failures, empties = count(row[7], "failures"), count(row[8], "empties")
    if failures + empties > calls or row[9] not in CALL_LAST or isinstance(row[9], bool):
        raise ValueError("failures and empties past the calls, or no last call's end")
    return ("c", source, offset, trace_id, agent, end, calls, failures, empties, row[9])
